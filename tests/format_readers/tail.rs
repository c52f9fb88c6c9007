//! `Tail` over a growing file: random-size appends (including cuts inside
//! records and more than one batch of samples pending) yield exactly the
//! samples `Snapshot` sees, in batches of at most 16,384.

use std::io::Write;

use proptest::prelude::*;
use spulse::{Header, Snapshot, SpoolWriter, Tail};
use spulse_testkit::spool::*;

fn grow_and_tail(bytes: &[u8], sizes: &[usize]) -> (Vec<spulse::Sample>, usize) {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    // Tail::open needs the whole header.
    let first = header_len_of(bytes);
    file.write_all(&bytes[..first]).unwrap();
    let mut tail = Tail::open(file.path()).unwrap();
    let mut got = Vec::new();
    let mut max_batch = 0;
    let mut pos = first;
    let mut i = 0;
    loop {
        loop {
            let batch = tail.poll().unwrap();
            max_batch = max_batch.max(batch.len());
            if batch.is_empty() {
                break;
            }
            got.extend_from_slice(batch);
        }
        if pos == bytes.len() {
            break;
        }
        let n = sizes[i % sizes.len()].max(1);
        i += 1;
        let end = (pos + n).min(bytes.len());
        file.write_all(&bytes[pos..end]).unwrap();
        pos = end;
    }
    assert_eq!(tail.position(), bytes.len() as u64);
    (got, max_batch)
}

fn header_len_of(bytes: &[u8]) -> usize {
    // The header is the magic and two varints.
    let mut pos = 8;
    for _ in 0..2 {
        while bytes[pos] & 0x80 != 0 {
            pos += 1;
        }
        pos += 1;
    }
    pos
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn tail_over_random_appends_sees_what_snapshot_sees(
        seed in any::<u64>(),
        sizes in prop::collection::vec(1usize..300, 1..20),
    ) {
        let (bytes, _) = build(random_ops(seed, 1_500));
        let snap = Snapshot::from_bytes(&bytes).unwrap();
        let (got, max_batch) = grow_and_tail(&bytes, &sizes);
        prop_assert!(max_batch <= Tail::MAX_BATCH);
        prop_assert!(got.iter().copied().eq(snap.samples()));
    }
}

#[test]
fn more_than_one_batch_pending() {
    let header = Header { start_time_us: 5_000_000, interval_us: 1000 };
    let mut w = SpoolWriter::new(Vec::new(), header).unwrap();
    let t = w.define_thread(1, 1, "main").unwrap();
    let f = w.define_frame(spulse::Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let s = w.define_stack(None, f).unwrap();
    let n = 3 * Tail::MAX_BATCH + 123;
    for i in 0..n as u64 {
        w.sample(5_000_000 + i * 1000, t, s).unwrap();
    }
    let bytes = w.into_inner().unwrap();
    let file = temp_file(&bytes);
    let mut tail = Tail::open(file.path()).unwrap();
    let mut sizes = Vec::new();
    let mut got = Vec::new();
    loop {
        let batch = tail.poll().unwrap();
        if batch.is_empty() {
            break;
        }
        sizes.push(batch.len());
        got.extend_from_slice(batch);
    }
    assert_eq!(sizes, vec![Tail::MAX_BATCH, Tail::MAX_BATCH, Tail::MAX_BATCH, 123]);
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    assert!(got.iter().copied().eq(snap.samples()));
    // Definitions stay reachable after the batches are gone.
    assert_eq!(tail.thread(got[0].thread).name, "main");
    assert_eq!(tail.stack_frames(got[0].stack).count(), 1);

    // The same spool appended in pieces that split records.
    let (got, max_batch) = grow_and_tail(&bytes, &[7, 70_001, 3, 100_000]);
    assert!(max_batch <= Tail::MAX_BATCH);
    assert!(got.iter().copied().eq(snap.samples()));
}

#[test]
fn incomplete_record_is_retried_after_growth() {
    let (bytes, model) = build(random_ops(5, 200));
    // Cut inside the last record.
    let last_start = model.boundaries[model.boundaries.len() - 2] as usize;
    let cut = last_start + 1;
    assert!(cut < bytes.len());
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(&bytes[..cut]).unwrap();
    let mut tail = Tail::open(file.path()).unwrap();
    let mut got = Vec::new();
    tail_drain(&mut tail, &mut got).unwrap();
    assert_eq!(tail.position(), last_start as u64);
    assert!(tail.has_incomplete_record());
    // Nothing new: polls stay empty and the position stays before the record.
    assert!(tail.poll().unwrap().is_empty());
    assert_eq!(tail.position(), last_start as u64);
    file.write_all(&bytes[cut..]).unwrap();
    tail_drain(&mut tail, &mut got).unwrap();
    assert_eq!(tail.position(), bytes.len() as u64);
    assert!(!tail.has_incomplete_record());
    assert_eq!(got.len(), model.samples.len());
}
