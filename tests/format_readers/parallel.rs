//! `Snapshot`'s two-thread load (`src/read/parallel.rs`) against the
//! sequential one: the same samples, definitions, recovery and errors (kind
//! and byte offset) on valid spools, on every kind of cut and on corrupted
//! bytes, with the two-thread path forced on small inputs.

use spulse::Snapshot;
use spulse_testkit::spool::*;

/// Random ops with long stretches of samples only (the two-thread path needs
/// runs of sample records past the midpoint to start from).
fn runs_ops(seed: u64, n: usize) -> Vec<Op> {
    let mut ops = random_ops(seed, n);
    for (i, op) in ops.iter_mut().enumerate() {
        if (i / 150) % 3 != 0 {
            op.0 = 8; // a sample
        }
    }
    ops
}

fn both(bytes: &[u8]) -> (Result<Snapshot, spulse::Error>, Result<Snapshot, spulse::Error>) {
    (Snapshot::from_bytes_split(bytes, 0), Snapshot::from_bytes_split(bytes, usize::MAX))
}

fn assert_same(bytes: &[u8], what: &str) {
    match both(bytes) {
        (Ok(p), Ok(s)) => {
            assert_eq!(p.len(), s.len(), "{what}: sample count");
            assert!(p.samples().eq(s.samples()), "{what}: samples");
            assert_eq!(p.valid_len(), s.valid_len(), "{what}: valid length");
            assert_eq!(p.recovered_from_truncated_tail(), s.recovered_from_truncated_tail(), "{what}");
            assert_eq!(p.sample_count(), s.sample_count(), "{what}");
            assert_eq!(p.stack_count(), s.stack_count(), "{what}");
            assert_eq!(p.frames(), s.frames(), "{what}");
            assert_eq!(p.modules(), s.modules(), "{what}");
            assert_eq!(p.threads(), s.threads(), "{what}");
            assert_eq!(p.deactivations(), s.deactivations(), "{what}");
        }
        (Err(a), Err(b)) => {
            assert_eq!(a.offset(), b.offset(), "{what}: {a} / {b}");
            assert_eq!(a.format_kind(), b.format_kind(), "{what}: {a} / {b}");
        }
        (p, s) => panic!("{what}: two threads gave {:?}, one gave {:?}", p.err(), s.err()),
    }
}

#[test]
fn two_threads_load_what_one_loads() {
    for seed in 1..=4 {
        let (bytes, model) = build(runs_ops(seed, 12_000));
        let before = spulse::testing::speculations_applied();
        let (p, _) = both(&bytes);
        let p = p.unwrap();
        assert_snapshot_matches(&p, &model);
        assert!(
            spulse::testing::speculations_applied() > before,
            "seed {seed}: the two-thread path did not run"
        );
        assert_same(&bytes, &format!("seed {seed}"));
    }
}

#[test]
fn cuts_and_corruptions_give_the_same_result() {
    let (bytes, _) = build(runs_ops(9, 8_000));
    let n = bytes.len();
    assert!(n > 20_000, "{n} bytes");
    // Cuts everywhere in the second half, where the speculation runs.
    for cut in (n / 2..n).step_by(97).chain(n - 40..n) {
        assert_same(&bytes[..cut], &format!("cut at {cut}"));
    }
    // One corrupted byte: most give an error somewhere in the second half
    // (or a different valid spool), which must be the sequential reader's.
    let mut errors = 0;
    for at in (8..n).step_by(61) {
        for v in [0x00u8, 0xff, 0x05, bytes[at] ^ 0x80, bytes[at].wrapping_add(1)] {
            let mut bad = bytes.clone();
            bad[at] = v;
            errors += Snapshot::from_bytes_split(&bad, usize::MAX).is_err() as usize;
            assert_same(&bad, &format!("byte {at} = {v:#04x}"));
        }
    }
    assert!(errors > 100, "only {errors} corruptions were errors");
}

/// A sample record (tag 5, zigzag delta, thread, stack) in the spool's varints.
fn sample_record(delta: i64, thread: u64, stack: u64) -> Vec<u8> {
    use integer_encoding::VarInt;
    let mut r = vec![5u8];
    r.extend(delta.encode_var_vec());
    r.extend(thread.encode_var_vec());
    r.extend(stack.encode_var_vec());
    r
}

#[test]
fn a_bad_sample_inside_a_run_is_found_at_its_offset() {
    let (bytes, model) = build(runs_ops(5, 8_000));
    let n = bytes.len();
    // Record boundaries in the second half between two sample records.
    let spots: Vec<usize> = model
        .boundaries
        .windows(2)
        .map(|w| w[0] as usize)
        .filter(|&b| b > n / 2 + 64 && bytes[b] == 5 && bytes.get(b.wrapping_sub(1)).is_some())
        .step_by(37)
        .take(12)
        .collect();
    assert!(spots.len() >= 6, "{} spots", spots.len());
    for &at in &spots {
        // The first undefined ids at this point of the stream.
        let prefix = Snapshot::from_bytes(&bytes[..at]).unwrap();
        let (threads, stacks) = (prefix.threads().len() as u64, prefix.stack_count() as u64);
        let bad_records = [
            (sample_record(0, threads, 0), "thread"),
            (sample_record(0, 0, stacks), "stack"),
            (sample_record(-(1i64 << 62), 0, 0), "timestamp"),
        ];
        for (rec, what) in &bad_records {
            let mut bad = bytes[..at].to_vec();
            bad.extend_from_slice(rec);
            bad.extend_from_slice(&bytes[at..]);
            let e = Snapshot::from_bytes_split(&bad, 0).expect_err(what);
            assert_eq!(e.offset(), Some(at as u64), "{what} at {at}: {e}");
            assert_same(&bad, &format!("bad {what} at {at}"));
        }
    }
}

#[test]
fn opening_a_large_file_reads_and_loads_it_whole() {
    // Past the size from which the file is read and loaded by two threads.
    let (bytes, model) = build(runs_ops(21, 900_000));
    assert!(bytes.len() > 5 << 20, "{} bytes", bytes.len());
    let file = temp_file(&bytes);
    let before = spulse::testing::speculations_applied();
    let snap = Snapshot::open(file.path()).unwrap();
    assert!(spulse::testing::speculations_applied() > before, "the two-thread path did not run");
    assert_snapshot_matches(&snap, &model);
    assert_eq!(snap.valid_len(), bytes.len() as u64);
    assert_eq!(snap.file_len(), bytes.len() as u64);
    // Cut inside its last record: the same recovery as from memory.
    let cut = temp_file(&bytes[..bytes.len() - 1]);
    let a = Snapshot::open(cut.path()).unwrap();
    let b = Snapshot::from_bytes_split(&bytes[..bytes.len() - 1], usize::MAX).unwrap();
    assert!(a.recovered_from_truncated_tail() && b.recovered_from_truncated_tail());
    assert!(a.samples().eq(b.samples()));
}

/// Samples that do not fit a narrow block (4-byte time offsets, 2-byte thread
/// ids) start a new block or widen one, in either half of a two-thread load,
/// and every value comes back exactly.
#[test]
fn samples_that_do_not_fit_a_narrow_block_start_a_new_one_or_widen_it() {
    use spulse::{Frame, Header, SpoolWriter};
    const N: usize = 400_000;
    const HOUR_US: u64 = 3_600_000_000;
    // (what, sample index, time offset from the regular one, thread, and the
    // (blocks, narrow blocks) of the two-thread and of the one-thread load).
    // There is one block per loading thread. A time outside a block's range
    // starts a new block; if the next (regular) sample is outside the new
    // block's range too, it widens that block. A thread id past 16 bits
    // widens the block it falls in.
    type Shape = ((usize, usize), (usize, usize));
    let new_block_widened: Shape = ((3, 2), (2, 1));
    let cases: [(&str, Option<usize>, i64, usize, Shape); 7] = [
        ("nothing", None, 0, 0, ((2, 2), (1, 1))),
        ("a late sample, first half", Some(N / 4), 5 * HOUR_US as i64, 1, new_block_widened),
        ("a late sample, second half", Some(3 * N / 4), 5 * HOUR_US as i64, 1, new_block_widened),
        ("an early sample, first half", Some(N / 4), -(START_US as i64) + 7, 1, new_block_widened),
        // Ten minutes early: the regular samples after it fit its block.
        ("an early sample, second half", Some(3 * N / 4), -600_000_000, 1, ((3, 3), (2, 2))),
        ("thread 69,999, first half", Some(N / 4), 0, 69_999, ((2, 1), (1, 0))),
        ("thread 69,999, second half", Some(3 * N / 4), 0, 69_999, ((2, 1), (1, 0))),
    ];
    for (what, at, shift, odd_thread, shape) in cases {
        let header = Header { start_time_us: START_US, interval_us: 1000 };
        let mut w = SpoolWriter::new(Vec::new(), header).unwrap();
        let threads: Vec<_> = (0..70_000u32).map(|i| w.define_thread(1, i + 1, "t").unwrap()).collect();
        let frame = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
        let root = w.define_stack(None, frame).unwrap();
        let leaf = w.define_stack(Some(root), frame).unwrap();
        let mut expected = Vec::with_capacity(N);
        for i in 0..N {
            let regular = START_US + i as u64 * 1000;
            let (time, thread) = match at {
                Some(a) if a == i => (regular.wrapping_add_signed(shift), odd_thread),
                _ => (regular, i % 6),
            };
            let stack = if i % 3 == 0 { root } else { leaf };
            w.sample(time, threads[thread], stack).unwrap();
            expected.push((time, thread, stack.index()));
        }
        let bytes = w.into_inner().unwrap();
        let before = spulse::testing::speculations_applied();
        let (p, s) = both(&bytes);
        let (p, s) = (p.unwrap(), s.unwrap());
        assert!(spulse::testing::speculations_applied() > before, "{what}: the two-thread path did not run");
        let got: Vec<_> = p.samples().map(|x| (x.time_us, x.thread.index(), x.stack.index())).collect();
        assert!(got == expected, "{what}: two-thread load");
        assert!(s.samples().eq(p.samples()), "{what}: one-thread load");
        assert_eq!(p.sample(N - 1).time_us, expected[N - 1].0, "{what}");
        assert_eq!(p.time_range().unwrap().1, expected.iter().map(|e| e.0).max().unwrap(), "{what}");
        assert_eq!((p.column_blocks(), s.column_blocks()), shape, "{what}");
    }
}

/// A profile of many hours loads into narrow columns, one block per hour or
/// so, on either path, with every sample exact.
#[test]
fn a_long_profile_stays_in_narrow_blocks() {
    use spulse::{Frame, Header, SpoolWriter};
    // Ten hours, one sample every 100 ms, cycling over three threads.
    const N: u64 = 360_000;
    let header = Header { start_time_us: START_US, interval_us: 100_000 };
    let mut w = SpoolWriter::new(Vec::new(), header).unwrap();
    let threads: Vec<_> = (0..3u32).map(|i| w.define_thread(1, i + 1, "t").unwrap()).collect();
    let frame = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let stack = w.define_stack(None, frame).unwrap();
    for i in 0..N {
        // Now and then another record, so that the speculation has many runs.
        if i % 20_000 == 10_000 {
            w.define_thread(2, i as u32, "later").unwrap();
        }
        w.sample(START_US + i * 100_000, threads[(i % 3) as usize], stack).unwrap();
    }
    let bytes = w.into_inner().unwrap();
    let before = spulse::testing::speculations_applied();
    let (p, s) = both(&bytes);
    let (p, s) = (p.unwrap(), s.unwrap());
    assert!(spulse::testing::speculations_applied() > before, "the two-thread path did not run");
    for (snap, how) in [(&p, "two threads"), (&s, "one thread")] {
        let (blocks, narrow) = snap.column_blocks();
        assert_eq!(blocks, narrow, "{how}: every block narrow");
        assert!((9..=10).contains(&blocks), "{how}: {blocks} blocks");
        assert_eq!(snap.len(), N as usize);
        assert!(snap.sample_times().eq((0..N).map(|i| START_US + i * 100_000)), "{how}");
        assert_eq!(snap.sample(N as usize - 1).time_us, START_US + (N - 1) * 100_000);
        assert_eq!(snap.sample(200_000).thread.index(), 200_000 % 3);
    }
    // Cuts and bad samples in the second half, where the speculation's own
    // columns have several blocks by then: the two loads still agree.
    let n = bytes.len();
    for k in 1..=6 {
        let at = n / 2 + k * (n / 2) / 7;
        assert_same(&bytes[..at], &format!("cut at {at}"));
        // A record boundary near `at`: sample records here are 4-6 bytes.
        let boundary = (at..at + 8)
            .find(|&b| {
                Snapshot::from_bytes_split(&bytes[..b], usize::MAX)
                    .is_ok_and(|x| !x.recovered_from_truncated_tail())
            })
            .unwrap();
        let mut bad = bytes[..boundary].to_vec();
        bad.extend_from_slice(&sample_record(0, 1000, 0));
        bad.extend_from_slice(&bytes[boundary..]);
        let e = Snapshot::from_bytes_split(&bad, 0).expect_err("thread 1000 is undefined");
        assert_eq!(e.offset(), Some(boundary as u64));
        assert_same(&bad, &format!("bad sample at {boundary}"));
    }
}
