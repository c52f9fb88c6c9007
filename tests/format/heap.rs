//! Heap events (tag 10), FORMAT.md section 4: written by `SpoolWriter`,
//! read back alike by `Snapshot` (one and two threads), `Replay`, `Tail` and
//! the packed container, every cut a valid prefix, and each rule rejected at
//! the offset FORMAT.md names.

use spulse::{FormatErrorKind, Frame, Header, HeapEvent, Snapshot, SpoolWriter};

use crate::{every_cut_keeps_a_valid_prefix_of, every_reader_gives, rejected, with, Events};

/// (thread, stack, time, address, size, bytes, freed, samples before).
type Row = (usize, usize, u64, u64, u64, u64, bool, u64);

fn rows(v: &[HeapEvent]) -> Vec<Row> {
    v.iter()
        .map(|e| {
            (
                e.thread.index(),
                e.stack.index(),
                e.time_us,
                e.address,
                e.size,
                e.bytes,
                e.freed,
                e.samples_before,
            )
        })
        .collect()
}

/// A spool of `n` rounds, each a few CPU samples, an allocation and (every
/// other round) the free of the one before, and the events it holds.
fn spool(n: u64) -> (Vec<u8>, Vec<Row>) {
    let start = 1_700_000_000_000_000;
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: start, interval_us: 1000 }).unwrap();
    let t0 = w.define_thread(7, 7, "main").unwrap();
    let t1 = w.define_thread(7, 8, "worker").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x40_1000, kernel: false }).unwrap();
    let g = w.define_frame(Frame::Absolute { address: 0x40_2000, kernel: false }).unwrap();
    let root = w.define_stack(None, f).unwrap();
    let leaf = w.define_stack(Some(root), g).unwrap();
    let mut want = Vec::new();
    let mut samples = 0;
    let mut last = root;
    for i in 0..n {
        for k in 0..3 {
            w.sample(start + i * 10_000 + k * 1000, t0, root).unwrap();
            samples += 1;
        }
        let (t, s, at) = (
            if i % 2 == 0 { t0 } else { t1 },
            if i % 3 == 0 { root } else { leaf },
            start + i * 10_000 + 500,
        );
        let (addr, size, bytes) = (0x7f00_0000_0000 + i * 4096, 16 + i * 8, 524_288);
        w.heap_event(t, s, at, addr, size, bytes, false).unwrap();
        want.push((t.index(), s.index(), at, addr, size, bytes, false, samples));
        if i % 2 == 1 {
            // The free of the round before's block, on another thread.
            let addr = addr - 4096;
            w.heap_event(t0, last, at + 1, addr, 0, bytes, true).unwrap();
            want.push((t0.index(), last.index(), at + 1, addr, 0, bytes, true, samples));
        }
        last = s;
    }
    (w.into_inner().unwrap(), want)
}

/// Tag 10 as [`crate::Events`] reads it back.
const HEAP: Events<Row> =
    Events { kept: |d| rows(d.heap_events()), polled: |t| rows(t.heap()), count: |d| d.heap_count() };

#[test]
fn every_reader_gives_the_written_events() {
    let (bytes, want) = spool(2_000);
    every_reader_gives(&bytes, 6_000, &want, &HEAP);
    assert!(Snapshot::from_bytes(&bytes).unwrap().definitions().off_cpu_intervals().is_empty());
}

#[test]
fn every_cut_keeps_a_valid_prefix() {
    let (bytes, want) = spool(40);
    every_cut_keeps_a_valid_prefix_of(&bytes, &want, &HEAP);
}

#[test]
fn rules_of_tag_10() {
    // Valid: thread 0, stack 0, time 5, address 7, size 3, bytes 9, freed.
    let (ok, _) = with(&[10, 0, 0, 5, 7, 3, 9, 1]);
    let snap = Snapshot::from_bytes(&ok).unwrap();
    assert_eq!(rows(snap.definitions().heap_events()), [(0, 0, 5, 7, 3, 9, true, 0)]);
    // Undefined thread and stack, at the tag byte.
    let (k, off, at) = rejected(&[10, 1, 0, 5, 7, 3, 9, 0]);
    assert_eq!((k, off), (FormatErrorKind::UndefinedReference { what: "thread", id: 1 }, at));
    let (k, off, at) = rejected(&[10, 0, 3, 5, 7, 3, 9, 0]);
    assert_eq!((k, off), (FormatErrorKind::UndefinedReference { what: "stack", id: 3 }, at));
    // A state other than 0 or 1, at the field.
    let (k, off, at) = rejected(&[10, 0, 0, 5, 7, 3, 9, 2]);
    assert_eq!((k, off), (FormatErrorKind::BadValue("heap event state", 2), at + 7));
    // An overlong varint, at the field.
    let (k, off, at) = rejected(&[10, 0, 0, 0x85, 0x00, 7, 3, 9, 0]);
    assert!(matches!(k, FormatErrorKind::BadVarint), "{k:?}");
    assert_eq!(off, at + 3);
    // A cut inside the record is a truncated tail.
    let (cut, _) = with(&[10, 0, 0, 5, 7]);
    assert!(Snapshot::from_bytes(&cut).unwrap().recovered_from_truncated_tail());
    // The writer refuses what readers would reject.
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: 0, interval_us: 1 }).unwrap();
    let t = w.define_thread(1, 1, "").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let s = w.define_stack(None, f).unwrap();
    // Ids of another spool's, not defined in this one.
    let mut other = SpoolWriter::new(Vec::new(), Header { start_time_us: 0, interval_us: 1 }).unwrap();
    other.define_thread(1, 1, "").unwrap();
    let t1 = other.define_thread(1, 2, "").unwrap();
    let of = other.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    other.define_stack(None, of).unwrap();
    let s1 = other.define_stack(None, of).unwrap();
    assert!(w.heap_event(t1, s, 1, 2, 3, 4, false).is_err());
    assert!(w.heap_event(t, s1, 1, 2, 3, 4, false).is_err());
    w.heap_event(t, s, 1, 2, 3, 4, false).unwrap();
}

/// A writer counts its events but keeps none of them, and the bytes still
/// read back whole.
#[test]
fn a_writer_keeps_no_event() {
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: 0, interval_us: 1 }).unwrap();
    let t = w.define_thread(1, 1, "").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let s = w.define_stack(None, f).unwrap();
    for i in 0..10_000 {
        w.heap_event(t, s, 10 + i, i * 16, 16, 4096, i % 2 == 1).unwrap();
    }
    assert_eq!(w.definitions().heap_count(), 10_000);
    assert!(w.definitions().heap_events().is_empty());
    let snap = Snapshot::from_bytes(&w.into_inner().unwrap()).unwrap();
    assert_eq!(snap.definitions().heap_events().len(), 10_000);
}
