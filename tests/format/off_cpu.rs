//! Off-CPU intervals (tag 9) and label frames (frame kind 3), FORMAT.md
//! section 4: written by `SpoolWriter`, read back alike by `Snapshot` (one
//! and two threads), `Replay`, `Tail` and the packed container, every cut a
//! valid prefix, and each rule rejected at the offset FORMAT.md names.

use spulse::{FormatErrorKind, Frame, Header, OffCpuInterval, OffCpuState, Snapshot, SpoolWriter};

use crate::{every_cut_keeps_a_valid_prefix_of, every_reader_gives, rejected, with, Events};

/// (thread, stack, start, duration, preempted, samples before) of each interval.
type Row = (usize, usize, u64, u64, bool, u64);

fn rows(v: &[OffCpuInterval]) -> Vec<Row> {
    v.iter()
        .map(|o| {
            let pre = o.state == OffCpuState::Preempted;
            (o.thread.index(), o.stack.index(), o.start_us, o.duration_us, pre, o.samples_before)
        })
        .collect()
}

/// A spool of `n` rounds, each a few CPU samples and an off-CPU interval under
/// a label leaf, and the intervals it holds.
fn spool(n: u64) -> (Vec<u8>, Vec<Row>) {
    let start = 1_700_000_000_000_000;
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: start, interval_us: 1000 }).unwrap();
    let t0 = w.define_thread(7, 7, "main").unwrap();
    let t1 = w.define_thread(7, 8, "worker").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x40_1000, kernel: false }).unwrap();
    let root = w.define_stack(None, f).unwrap();
    let futex = w.define_label("blocked: futex").unwrap();
    let cpu = w.define_label("waiting for CPU").unwrap();
    let s_futex = w.define_stack(Some(root), futex).unwrap();
    let s_cpu = w.define_stack(Some(root), cpu).unwrap();
    let mut want = Vec::new();
    let mut samples = 0;
    for i in 0..n {
        for k in 0..3 {
            w.sample(start + i * 10_000 + k * 1000, t0, root).unwrap();
            samples += 1;
        }
        let (stack, pre) = if i % 3 == 2 { (s_cpu, true) } else { (s_futex, false) };
        let (t, s0, d) = (t1, start + i * 10_000 + 500, 1_000 + i * 37);
        w.off_cpu(t, stack, s0, d, pre).unwrap();
        want.push((t.index(), stack.index(), s0, d, pre, samples));
    }
    (w.into_inner().unwrap(), want)
}

/// Tag 9 as [`crate::Events`] reads it back.
const OFF_CPU: Events<Row> = Events {
    kept: |d| rows(d.off_cpu_intervals()),
    polled: |t| rows(t.off_cpu()),
    count: |d| d.off_cpu_count(),
};

#[test]
fn every_reader_gives_the_written_intervals() {
    let (bytes, want) = spool(2_000);
    every_reader_gives(&bytes, 6_000, &want, &OFF_CPU);
    // The label frames read back as labels, with their text.
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    let leaf = snap.definitions().stack(snap.definitions().off_cpu_intervals()[0].stack).frame;
    let Frame::Label(l) = snap.definitions().frame(leaf) else { panic!("leaf is not a label") };
    assert_eq!(snap.definitions().label(l), "blocked: futex");
}

#[test]
fn every_cut_keeps_a_valid_prefix() {
    let (bytes, want) = spool(40);
    every_cut_keeps_a_valid_prefix_of(&bytes, &want, &OFF_CPU);
}

#[test]
fn rules_of_tag_9_and_label_frames() {
    // Valid: thread 0, stack 0, start 5, duration 7, blocked.
    let (ok, _) = with(&[9, 0, 0, 5, 7, 0]);
    assert_eq!(Snapshot::from_bytes(&ok).unwrap().definitions().off_cpu_intervals().len(), 1);
    // Undefined thread and stack, at the tag byte.
    let (k, off, at) = rejected(&[9, 1, 0, 5, 7, 0]);
    assert_eq!((k, off), (FormatErrorKind::UndefinedReference { what: "thread", id: 1 }, at));
    let (k, off, at) = rejected(&[9, 0, 3, 5, 7, 0]);
    assert_eq!((k, off), (FormatErrorKind::UndefinedReference { what: "stack", id: 3 }, at));
    // start + duration overflowing 64 bits.
    let mut r = vec![9, 0, 0];
    r.extend_from_slice(&[0xff; 9]);
    r.push(0x01);
    r.extend_from_slice(&[1, 0]);
    let (k, off, at) = rejected(&r);
    assert_eq!((k, off), (FormatErrorKind::IntervalEndOverflow, at));
    // A state other than 0 or 1, at the field.
    let (k, off, at) = rejected(&[9, 0, 0, 5, 7, 2]);
    assert_eq!((k, off), (FormatErrorKind::BadValue("off-CPU state", 2), at + 5));
    // A label frame (id 1): invalid UTF-8 and too long, at the length.
    let (k, off, at) = rejected(&[2, 1, 3, 2, 0xc3, 0x28]);
    assert_eq!((k, off), (FormatErrorKind::BadUtf8("frame label"), at + 3));
    let (k, off, at) = rejected(&[2, 1, 3, 65]);
    assert_eq!((k, off), (FormatErrorKind::TooLong { what: "frame label", len: 65, limit: 64 }, at + 3));
    // A cut inside an invalid label is corruption, not a truncated tail.
    let (k, _, _) = rejected(&[2, 1, 3, 4, 0xff]);
    assert_eq!(k, FormatErrorKind::BadUtf8("frame label"));
    // The writer refuses what readers would reject.
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: 0, interval_us: 1 }).unwrap();
    assert!(w.define_label(&"x".repeat(65)).is_err());
    let t = w.define_thread(1, 1, "").unwrap();
    let l = w.define_label("blocked").unwrap();
    let s = w.define_stack(None, l).unwrap();
    assert!(w.off_cpu(t, s, u64::MAX, 1, false).is_err());
    w.off_cpu(t, s, 10, 1, true).unwrap();
}

/// A writer counts its intervals but keeps none of them: a recorder writes
/// one per blocking for as long as it runs (its memory must not grow with
/// them), and the bytes still read back whole.
#[test]
fn a_writer_keeps_no_interval() {
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: 0, interval_us: 1 }).unwrap();
    let t = w.define_thread(1, 1, "").unwrap();
    let l = w.define_label("blocked").unwrap();
    let s = w.define_stack(None, l).unwrap();
    for i in 0..10_000 {
        w.off_cpu(t, s, 10 + i, 1, false).unwrap();
    }
    assert_eq!(w.definitions().off_cpu_count(), 10_000);
    assert!(w.definitions().off_cpu_intervals().is_empty());
    let snap = Snapshot::from_bytes(&w.into_inner().unwrap()).unwrap();
    assert_eq!(snap.definitions().off_cpu_intervals().len(), 10_000);
}
