//! Truncation at every byte offset of a generated spool: `Snapshot`, `Replay`
//! and `Tail` agree on the sample count at every cut, the count never
//! decreases as the cut moves forward, and the recovered flag is set exactly
//! when the cut falls inside a record.

use std::io::{Seek, Write};

use spulse::{FormatErrorKind, Replay, Snapshot, Tail};
use spulse_testkit::spool::*;

#[test]
fn every_cut_of_a_generated_spool() {
    let (bytes, model) = build(random_ops(3, 400));
    assert!(bytes.len() > 2_000, "spool of {} bytes", bytes.len());
    let header_len = model.boundaries[0] as usize;
    // One file, truncated and re-grown in place for each cut.
    let mut file = tempfile::NamedTempFile::new().unwrap();
    let mut last = 0usize;
    for cut in 0..=bytes.len() {
        let data = &bytes[..cut];
        let snap = Snapshot::from_bytes(data);
        file.as_file().set_len(0).unwrap();
        file.as_file_mut().rewind().unwrap();
        file.as_file_mut().write_all(data).unwrap();
        let replay = Replay::options().index_limit(2).open(file.path());
        let tail = Tail::open(file.path());
        if cut < header_len {
            for e in [snap.err().unwrap(), replay.err().unwrap(), tail.err().unwrap()] {
                assert_eq!(e.format_kind(), Some(&FormatErrorKind::TruncatedHeader), "cut {cut}");
            }
            continue;
        }
        let snap = snap.unwrap();
        let replay = replay.unwrap();
        let mut tail = tail.unwrap();
        let at_boundary = model.boundaries.binary_search(&(cut as u64)).is_ok();
        assert_eq!(snap.recovered_from_truncated_tail(), !at_boundary, "cut {cut}");
        assert_eq!(replay.recovered_from_truncated_tail(), !at_boundary, "cut {cut}");
        let mut tailed = Vec::new();
        tail_drain(&mut tail, &mut tailed).unwrap();
        assert_eq!(tail.has_incomplete_record(), !at_boundary, "cut {cut}");
        let replayed = replay.samples().collect::<Result<Vec<_>, _>>().unwrap();
        assert_eq!(replayed.len(), snap.len(), "cut {cut}");
        assert_eq!(tailed.len(), snap.len(), "cut {cut}");
        assert!(snap.len() >= last, "count decreased at cut {cut}");
        last = snap.len();
        // The retained prefix ends at the last record boundary at or before the cut.
        let expect = model.boundaries.iter().copied().filter(|&b| b <= cut as u64).max().unwrap();
        assert_eq!(snap.valid_len(), expect);
        assert_eq!(replay.valid_len(), expect);
        assert_eq!(tail.position(), expect);
        let want: Vec<_> = model.samples.iter().take(snap.len()).copied().collect();
        let got: Vec<_> = snap.samples().map(|s| (s.time_us, s.thread.index(), s.stack.index())).collect();
        assert_eq!(got, want);
    }
    assert_eq!(last, model.samples.len());
}

#[test]
fn a_file_shorter_than_its_header_is_an_error() {
    for data in [&b""[..], b"SPUL", b"SPULSE3\0", b"SPULSE3\0\x80", b"SPULSE3\0\x01", b"SPULSE3\0\x01\x82"] {
        let e = Snapshot::from_bytes(data).unwrap_err();
        assert_eq!(e.format_kind(), Some(&FormatErrorKind::TruncatedHeader));
    }
    assert_eq!(
        Snapshot::from_bytes(b"SPULSE2\0").unwrap_err().format_kind(),
        Some(&FormatErrorKind::BadMagic)
    );
    assert_eq!(Snapshot::from_bytes(b"NOPE").unwrap_err().format_kind(), Some(&FormatErrorKind::BadMagic));
}

/// A followed spool that shrinks (truncated or rewritten in place) is an
/// error naming the sizes, not samples read against definitions that no
/// longer hold.
#[test]
fn a_followed_spool_that_shrinks_is_an_error() {
    let (bytes, model) = build(random_ops(5, 200));
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.as_file_mut().write_all(&bytes).unwrap();
    let mut tail = Tail::open(file.path()).unwrap();
    let mut tailed = Vec::new();
    tail_drain(&mut tail, &mut tailed).unwrap();
    assert_eq!(tailed.len(), model.samples.len());
    let half = bytes.len() as u64 / 2;
    file.as_file().set_len(half).unwrap();
    let e = tail.poll().unwrap_err().to_string();
    assert!(e.contains(&format!("the file shrank to {half} bytes after {} were read", bytes.len())), "{e}");
}
