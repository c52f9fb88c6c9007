//! Per-reader consistency checks, run by the corpus regression test
//! (`tests/format_fuzz_corpus.rs`) on every input under `fuzz/corpus/` (the
//! cargo-fuzz targets in `fuzz/` drive the public readers directly).
//!
//! Each function feeds arbitrary bytes through one reader and panics if the
//! reader misbehaves: disagrees with [`Snapshot`] (the reference reader) about
//! samples, recovery or the error (kind and byte offset), returns an oversized
//! `Tail` batch, or hands out a sample whose thread or stack is undefined.
//! Hostile input must make the readers return errors, never make these panic.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use spulse::limits::MAX_STACK_DEPTH;
use spulse::{Definitions, Error, Replay, Sample, Snapshot, Tail};

/// Checks every `Snapshot` accessor on `data`, and that re-reading the
/// validated prefix alone gives the same samples without recovery.
pub fn fuzz_check_snapshot(data: &[u8]) {
    // The two-thread load (forced on any size) agrees with the sequential one.
    let (two, one) = (Snapshot::from_bytes_split(data, 0), Snapshot::from_bytes_split(data, usize::MAX));
    match (&two, &one) {
        (Ok(a), Ok(b)) => {
            assert!(a.samples().eq(b.samples()), "two-thread load: other samples");
            assert_eq!(
                (a.valid_len(), a.recovered_from_truncated_tail()),
                (b.valid_len(), b.recovered_from_truncated_tail())
            );
            assert_eq!(
                (a.stack_count(), a.frames(), a.threads()),
                (b.stack_count(), b.frames(), b.threads())
            );
        }
        (Err(a), Err(b)) => assert_same_error(a, b),
        _ => panic!(
            "two-thread and sequential loads disagree: {:?} / {:?}",
            two.as_ref().err(),
            one.as_ref().err()
        ),
    }
    let snap = match one {
        Ok(s) => s,
        Err(e) => {
            let offset = e.offset().expect("a format error names its offset");
            assert!(offset <= data.len() as u64, "error offset {offset} beyond the input");
            return;
        }
    };
    walk_definitions(&snap, snap.samples());
    assert!(snap.valid_len() <= data.len() as u64);
    assert_eq!(snap.recovered_from_truncated_tail(), snap.valid_len() < data.len() as u64);
    let again = Snapshot::from_bytes(&data[..snap.valid_len() as usize]).expect("validated prefix re-reads");
    assert!(!again.recovered_from_truncated_tail());
    assert!(again.samples().eq(snap.samples()));
}

/// Writes `data` to a temporary file and checks that `Replay` agrees with
/// `Snapshot`: the same error, or the same samples, recovery flag and
/// definitions; and that seeking by timestamp yields the right suffix.
pub fn fuzz_check_replay(data: &[u8]) {
    let file = TempFile::new(data);
    let snap = Snapshot::from_bytes(data);
    let replay = Replay::options().index_limit(2).open(&file.path);
    let (snap, replay) = match (snap, replay) {
        (Err(a), Err(b)) => return assert_same_error(&a, &b),
        (Ok(_), Err(e)) => panic!("Replay failed where Snapshot succeeded: {e}"),
        (Err(e), Ok(_)) => panic!("Snapshot failed where Replay succeeded: {e}"),
        (Ok(s), Ok(r)) => (s, r),
    };
    assert_eq!(snap.recovered_from_truncated_tail(), replay.recovered_from_truncated_tail());
    assert_eq!(snap.valid_len(), replay.valid_len());
    assert_eq!(snap.sample_count(), replay.sample_count());
    assert_eq!(snap.stack_count(), replay.stack_count());
    assert_eq!(snap.frames(), replay.frames());
    assert_eq!(snap.modules(), replay.modules());
    assert_eq!(snap.threads(), replay.threads());
    let mut n = 0usize;
    for s in replay.samples() {
        let s = s.expect("replaying a validated, unchanged file");
        assert_eq!(s, snap.sample(n));
        n += 1;
    }
    assert_eq!(n, snap.len());
    // Seeking: the suffix from the first sample at or after `t`.
    if let Some((lo, hi)) = snap.time_range() {
        for t in [lo, lo + (hi - lo) / 2, hi, hi.saturating_add(1)] {
            let first = snap.sample_times().position(|x| x >= t).unwrap_or(snap.len());
            let got: Vec<Sample> = replay.samples_from(t).map(|s| s.expect("replay")).collect();
            assert!(got.iter().copied().eq((first..snap.len()).map(|i| snap.sample(i))), "seek to {t}");
        }
    }
}

/// The packed-file checks: everything [`fuzz_check_replay`] checks, and that
/// `Snapshot::open` of the file (decoded block by block from disk) agrees with
/// `Snapshot::from_bytes`, event positions included.
pub fn fuzz_check_packed(data: &[u8]) {
    fuzz_check_replay(data);
    if !spulse::is_packed(data) {
        return;
    }
    let file = TempFile::new(data);
    match (Snapshot::from_bytes(data), Snapshot::open(&file.path)) {
        (Ok(a), Ok(b)) => {
            assert!(a.is_packed() && b.is_packed());
            assert!(a.samples().eq(b.samples()));
            assert_eq!(a.deactivations(), b.deactivations());
            assert_eq!(a.python_runtime_events(), b.python_runtime_events());
            assert_eq!(a.sample_count(), a.len() as u64);
            for e in a.python_runtime_events() {
                assert!(e.samples_before <= a.sample_count());
            }
            walk_definitions(&a, a.samples());
        }
        (Err(a), Err(b)) => assert_same_error(&a, &b),
        (a, b) => panic!("Snapshot from bytes and from the file disagree: {:?} / {:?}", a.err(), b.err()),
    }
}

/// Uses the first bytes of `data` to pick append sizes, writes the rest to a
/// temporary file in those appends, polls a `Tail` after each, and checks it
/// sees exactly what `Snapshot` sees of the whole input (or the same error).
pub fn fuzz_check_tail(data: &[u8]) {
    let (seed, data) = match data {
        [a, b, rest @ ..] => (u16::from_le_bytes([*a, *b]) as u64, rest),
        _ => (0, data),
    };
    if spulse::is_packed(data) {
        // A packed file never grows: Tail refuses it by name.
        let file = TempFile::new(data);
        let e = Tail::open(&file.path).expect_err("Tail accepted a packed file");
        assert!(e.to_string().contains("never grows"), "{e}");
        return;
    }
    let snap = Snapshot::from_bytes(data);
    let hlen = match header_len(data) {
        Some(n) => n,
        None => {
            // Tail must reject the same header.
            let file = TempFile::new(data);
            let e = Tail::open(&file.path).expect_err("Tail accepted a bad header");
            return assert_same_error(&snap.expect_err("Snapshot accepted a bad header"), &e);
        }
    };
    let mut file = TempFile::new(&data[..hlen]);
    let mut tail = Tail::open(&file.path).expect("header is valid");
    let mut got: Vec<Sample> = Vec::new();
    let mut pos = hlen;
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut error = None;
    'outer: loop {
        loop {
            match tail.poll() {
                Ok(batch) => {
                    assert!(batch.len() <= Tail::MAX_BATCH);
                    if batch.is_empty() {
                        break;
                    }
                    got.extend_from_slice(batch);
                }
                Err(e) => {
                    error = Some(e);
                    break 'outer;
                }
            }
        }
        if pos == data.len() {
            break;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let n = 1 + (rng % 64) as usize;
        let end = (pos + n).min(data.len());
        file.append(&data[pos..end]);
        pos = end;
    }
    match (snap, error) {
        (Err(a), Some(b)) => assert_same_error(&a, &b),
        (Ok(_), Some(e)) => panic!("Tail failed where Snapshot succeeded: {e}"),
        (Err(e), None) => panic!("Tail succeeded where Snapshot failed: {e}"),
        (Ok(s), None) => {
            assert!(got.iter().copied().eq(s.samples()));
            assert_eq!(tail.position(), s.valid_len());
            assert_eq!(tail.has_incomplete_record(), s.recovered_from_truncated_tail());
            assert_eq!(tail.stack_count(), s.stack_count());
            assert_eq!(tail.frames(), s.frames());
        }
    }
}

fn walk_definitions(defs: &Definitions, samples: impl Iterator<Item = Sample>) {
    for s in samples {
        let _ = defs.thread(s.thread);
        let mut depth = 0;
        for f in defs.stack_frames(s.stack) {
            let _ = defs.frame_address(f);
            depth += 1;
        }
        assert_eq!(depth, defs.stack_depth(s.stack));
        assert!(depth <= MAX_STACK_DEPTH as usize);
    }
    for m in defs.modules() {
        assert!(m.start.checked_add(m.size).is_some());
        let _ = m.absolute(m.file_offset);
    }
}

/// Length of the header `data` starts with, if it starts with a complete and
/// valid one: the shortest prefix that reads as a spool (a header followed by
/// no records is a valid, empty spool).
fn header_len(data: &[u8]) -> Option<usize> {
    let longest = spulse::SPOOL_MAGIC.len() + 2 * MAX_VARINT_LEN;
    (spulse::SPOOL_MAGIC.len()..=data.len().min(longest)).find(|&n| Snapshot::from_bytes(&data[..n]).is_ok())
}

/// Bytes of the longest LEB128 encoding of a `u64`.
const MAX_VARINT_LEN: usize = 10;

fn assert_same_error(a: &Error, b: &Error) {
    assert_eq!(a.format_kind(), b.format_kind(), "{a} vs {b}");
    assert_eq!(a.offset(), b.offset(), "{a} vs {b}");
    assert!(a.format_kind().is_some(), "not a format error: {a}");
}

/// A file in the temporary directory, removed on drop.
struct TempFile {
    path: PathBuf,
    file: std::fs::File,
}

impl TempFile {
    fn new(data: &[u8]) -> TempFile {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("spulse-fuzz-{}-{n}.spool", std::process::id()));
        let mut file = std::fs::File::create(&path).expect("create temporary file");
        file.write_all(data).expect("write temporary file");
        TempFile { path, file }
    }

    fn append(&mut self, data: &[u8]) {
        self.file.write_all(data).expect("append to temporary file");
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
