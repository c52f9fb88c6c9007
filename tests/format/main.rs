//! The spool encoding against FORMAT.md: round trips of random valid spools
//! through every reader, one test per rejection rule, truncation at every byte,
//! FORMAT.md's worked example, and the size of a profile-shaped spool. One
//! test binary; each module is one area.

mod doc;
mod heap;
mod off_cpu;
mod rejections;
mod roundtrip;
mod size;
mod truncation;

use std::fmt::Debug;

use spulse::{Definitions, FormatErrorKind, Frame, Header, Replay, Snapshot, SpoolWriter, Tail};
use spulse_testkit::spool::{pack_bytes, tail_drain, temp_file};

/// How the records of one kind of event beyond the seed (tag 9, tag 10)
/// read back: as the definitions keep them, as a `Tail`'s poll hands them
/// out, and how many the stream held.
pub(crate) struct Events<R> {
    pub kept: fn(&Definitions) -> Vec<R>,
    pub polled: fn(&Tail) -> Vec<R>,
    pub count: fn(&Definitions) -> u64,
}

/// Every reader gives the events `want` of the spool `bytes` of `samples`
/// samples: `Snapshot` on one and two threads, `Replay`, `Tail` poll by
/// poll, and the packed container's `Snapshot` and `Replay`, with their
/// positions among the samples.
pub(crate) fn every_reader_gives<R: PartialEq + Debug>(
    bytes: &[u8],
    samples: usize,
    want: &[R],
    e: &Events<R>,
) {
    let snap = Snapshot::from_bytes(bytes).unwrap();
    assert_eq!((e.kept)(snap.definitions()), want);
    assert_eq!((e.count)(snap.definitions()), want.len() as u64);
    assert_eq!(snap.len(), samples, "events are not samples");
    // The two-thread load (forced on a small spool) places them alike.
    let split = Snapshot::from_bytes_split(bytes, 0).unwrap();
    assert_eq!((e.kept)(split.definitions()), want);
    let f = temp_file(bytes);
    let replay = Replay::open(f.path()).unwrap();
    assert_eq!((e.kept)(replay.definitions()), want);
    assert_eq!(replay.samples().count(), samples);
    // Tail: each poll hands out its own; together, all of them.
    let mut tail = Tail::open(f.path()).unwrap();
    let mut got = Vec::new();
    loop {
        let n = tail.poll().unwrap().len();
        got.extend((e.polled)(&tail));
        if n == 0 {
            break;
        }
    }
    assert_eq!(got, want);
    assert_eq!((e.count)(tail.definitions()), want.len() as u64);
    let packed = pack_bytes(bytes);
    let p = Snapshot::from_bytes(&packed).unwrap();
    assert_eq!((e.kept)(p.definitions()), want);
    assert_eq!(p.len(), samples);
    let pf = temp_file(&packed);
    let pr = Replay::open(pf.path()).unwrap();
    assert_eq!((e.kept)(pr.definitions()), want);
}

/// Every cut of `bytes` (whose events are `want`) reads back as a valid
/// prefix holding the events before the cut, in `Snapshot` and `Tail` alike.
pub(crate) fn every_cut_keeps_a_valid_prefix_of<R: PartialEq + Debug>(
    bytes: &[u8],
    want: &[R],
    e: &Events<R>,
) {
    let mut last = 0;
    for cut in 28..=bytes.len() {
        let snap = Snapshot::from_bytes(&bytes[..cut]).unwrap_or_else(|err| panic!("cut {cut}: {err}"));
        let kept = (e.kept)(snap.definitions());
        let n = kept.len();
        assert!(n >= last, "cut {cut}");
        last = n;
        assert_eq!(kept, want[..n]);
        let f = temp_file(&bytes[..cut]);
        let mut tail = Tail::open(f.path()).unwrap();
        let mut s = Vec::new();
        tail_drain(&mut tail, &mut s).unwrap();
        assert_eq!(s.len(), snap.len(), "cut {cut}");
        assert_eq!((e.count)(tail.definitions()), n as u64, "cut {cut}");
    }
    assert_eq!(last, want.len());
}

/// A spool with one thread, one root stack, then `tail` appended.
pub(crate) fn with(tail: &[u8]) -> (Vec<u8>, u64) {
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: 100, interval_us: 1000 }).unwrap();
    w.define_thread(1, 1, "").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    w.define_stack(None, f).unwrap();
    let mut bytes = w.into_inner().unwrap();
    let at = bytes.len() as u64;
    bytes.extend_from_slice(tail);
    (bytes, at)
}

pub(crate) fn rejected(tail: &[u8]) -> (FormatErrorKind, u64, u64) {
    let (bytes, at) = with(tail);
    let e = Snapshot::from_bytes(&bytes).unwrap_err();
    // Tail reports the same error at the same offset.
    let f = temp_file(&bytes);
    let mut t = Tail::open(f.path()).unwrap();
    let mut s = Vec::new();
    let te = tail_drain(&mut t, &mut s).unwrap_err();
    assert_eq!((te.format_kind(), te.offset()), (e.format_kind(), e.offset()));
    (e.format_kind().unwrap().clone(), e.offset().unwrap(), at)
}
