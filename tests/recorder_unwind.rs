//! Unwinding to the thread root, on every target (natively, and for aarch64
//! under qemu-user): a thread runs `unwind_outer -> unwind_middle ->
//! unwind_inner`, where `unwind_inner` is a leaf function (on aarch64 its
//! caller's return address is still in the link register when it is
//! interrupted). Every sample whose leaf is `unwind_inner` must carry the whole
//! chain in order, then std's thread entry, then no more than glibc's two
//! thread-start frames, and no truncation marker: the unwinder reached the
//! root instead of giving up.

mod recorder_support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use recorder_support::*;
use spulse::Frame;

#[inline(never)]
fn unwind_inner(n: u64) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..n {
        h = (h ^ black_box(i)).wrapping_mul(0x100_0000_01b3).rotate_left(17);
    }
    h
}

#[inline(never)]
fn unwind_middle(n: u64) -> u64 {
    // Using the result after the call keeps it from becoming a tail call.
    black_box(unwind_inner(n)).wrapping_add(1)
}

#[inline(never)]
fn unwind_outer(cpu: f64, wall: Duration) -> u64 {
    let deadline = Instant::now() + wall;
    let c0 = thread_cpu_seconds();
    let mut acc = 0;
    while thread_cpu_seconds() - c0 < cpu && Instant::now() < deadline {
        acc ^= black_box(unwind_middle(50_000));
    }
    acc.wrapping_add(1)
}

#[test]
fn leaf_samples_unwind_to_the_thread_root() {
    check_root(spulse::Recorder::builder(), None);
}

/// The same with the perf-stack engine, where the writer thread unwinds the
/// stack bytes the kernel copied (under qemu-user, which has no perf events,
/// the thread-CPU-timer engine instead, saying so).
#[test]
fn perf_stack_samples_unwind_to_the_thread_root() {
    let (choice, expect) = perf_stack_engine_for("perf_stack_samples_unwind_to_the_thread_root");
    check_root(spulse::Recorder::builder().engine(choice), Some(expect));
}

fn check_root(builder: spulse::RecorderBuilder, expect: Option<spulse::Engine>) {
    let _serial = serial();
    // Every sample unwound, from the first: the executable's tables are
    // checked before `start` returns, however slow the check (a debug build).
    let _defer = DeferThreshold::set(u64::MAX);
    let (_dir, path) = spool_path("unwind.spool");
    let guard = builder.frequency_hz(999).start(&path).expect("start");
    let engine = guard.engine();
    if let Some(e) = expect {
        assert_eq!(engine, e);
    }
    let worker = std::thread::Builder::new()
        .name("unwind-root".into())
        .spawn(|| (gettid(), unwind_outer(1.0, Duration::from_secs(20))))
        .unwrap();
    let (tid, acc) = worker.join().unwrap();
    black_box(acc);
    let stats = guard.finish().expect("finish");
    // The frames below are this executable's, unwound through its tables read
    // where they are mapped (not copied).
    assert!(stats.unwind_tables_mapped > 0, "{stats:?}");
    let snap = spulse::Snapshot::open(&path).expect("spool opens");

    let mut sym = Symbolizer::default();
    let (mut leaf_inner, mut complete) = (0u64, 0u64);
    let mut first_bad = None;
    for s in snap.samples().filter(|s| snap.thread(s.thread).tid == tid) {
        let frames: Vec<_> = snap.stack_frames(s.stack).collect();
        let names: Vec<String> = frames.iter().map(|&f| sym.name(&snap, f)).collect();
        if !names.first().is_some_and(|n| n.ends_with("unwind_inner")) {
            continue;
        }
        leaf_inner += 1;
        let truncated = frames.iter().any(|&f| snap.frame(f) == Frame::Truncated);
        let chain_ok =
            names.len() > 3 && names[1].ends_with("unwind_middle") && names[2].ends_with("unwind_outer");
        // Past `unwind_outer`: the spawn closure and std's thread entry, then
        // glibc's `start_thread` and `clone3`/`clone` at most.
        let entry = names.iter().rposition(|n| n.ends_with("thread_start") && n.contains("std"));
        let root_ok = entry.is_some_and(|i| i > 2 && names.len() - 1 - i <= 2);
        if !truncated && chain_ok && root_ok {
            complete += 1;
        } else if first_bad.is_none() {
            first_bad = Some(names);
        }
    }
    eprintln!("engine {engine}: {leaf_inner} samples in unwind_inner, {complete} unwound to the thread root");
    assert!(leaf_inner >= 100, "too few samples in the leaf function: {leaf_inner}");
    assert!(
        complete as f64 >= 0.95 * leaf_inner as f64,
        "{complete} of {leaf_inner} leaf samples reached the thread root; first that did not: {first_bad:?}"
    );
}

/// The recorder does not copy the executable's unwind tables: its memory does
/// not grow with the executable's `.eh_frame`. The handler's unwinder reads
/// them where the program is mapped; only a rebuilt search table (when the
/// check in `cfi_check.rs` left FDEs out) may be a copy, which is at most the
/// size of `.eh_frame_hdr`. Libraries' tables are copied, and `Stats` counts
/// exactly that.
#[test]
fn executable_unwind_tables_are_not_copied() {
    use object::{Object, ObjectSection};
    let _serial = serial();
    // Checked at start, whatever its size (the deferred check is tested below).
    let _defer = DeferThreshold::set(u64::MAX);
    let file = std::fs::read("/proc/self/exe").expect("read the test executable");
    let elf = object::File::parse(&*file).expect("parse the test executable");
    let size = |name| elf.section_by_name(name).map_or(0, |s| s.size());
    let (eh_frame, eh_frame_hdr) = (size(".eh_frame"), size(".eh_frame_hdr"));
    assert!(eh_frame > 0 && eh_frame_hdr > 0, "the test executable has unwind tables");

    let objects = spulse::testing::unwind_tables::scan();
    let pc = unwind_inner as fn(u64) -> u64 as usize as u64;
    let exe = objects
        .iter()
        .find(|o| o.exec_segments.iter().any(|&(a, n)| a <= pc && pc - a < n))
        .expect("the object holding this test's code");
    assert!(exe.mapped >= eh_frame, "{exe:?}: .eh_frame is {eh_frame} bytes");
    assert!(
        exe.copied <= eh_frame_hdr,
        "{exe:?}: only a rebuilt .eh_frame_hdr ({eh_frame_hdr} bytes) may be copied"
    );
    let libs: Vec<_> = objects.iter().filter(|o| o.path != exe.path).collect();
    eprintln!(
        "executable: .eh_frame {eh_frame} B, .eh_frame_hdr {eh_frame_hdr} B; {} B mapped, {} B copied; \
         libraries: {} B copied",
        exe.mapped,
        exe.copied,
        libs.iter().map(|o| o.copied).sum::<u64>()
    );
    assert!(libs.iter().all(|o| o.mapped == 0), "libraries are copied: {libs:?}");
    assert!(libs.iter().any(|o| o.copied > 0), "{libs:?}");

    // A recording counts the same: the libraries' tables and the executable's
    // rebuilt search table, if any, copied; the executable's tables mapped.
    let (_dir, path) = spool_path("tables.spool");
    let guard = spulse::Recorder::builder().frequency_hz(999).start(&path).expect("start");
    burn(0.05);
    let stats = guard.finish().expect("finish");
    let copied: u64 = objects.iter().map(|o| o.copied).sum();
    assert_eq!((stats.unwind_tables_copied, stats.unwind_tables_mapped), (copied, exe.mapped));
}

/// The check of a large executable's unwind tables runs in the writer thread
/// after `start` returns (here forced for this small one). Until it is done a
/// sample's stack stops at the executable's first frame, marked truncated,
/// never continued by a guess; after it, stacks reach the root.
#[test]
fn executable_tables_checked_after_start() {
    let _serial = serial();
    // Every executable's check deferred, however small.
    let _defer = DeferThreshold::set(0);
    let objects = spulse::testing::unwind_tables::scan();
    let pc = unwind_inner as fn(u64) -> u64 as usize as u64;
    let exe = objects.iter().find(|o| o.exec_segments.iter().any(|&(a, n)| a <= pc && pc - a < n)).unwrap();
    assert_eq!((exe.copied, exe.mapped), (0, 0), "deferred: nothing handed over at start");
    let (leaf_inner, complete, _) = during_the_check(spulse::Recorder::builder(), None);
    assert!(complete as f64 >= 0.9 * leaf_inner as f64, "{complete} of {leaf_inner} reached the root");
}

/// Samples taken while the check runs (made to last 300 ms here): the signal
/// handler unwinds in place and stops at the executable's frames; the
/// perf-stack engine's writer has the kernel's stack copies in hand and keeps
/// them until the check is done, so its samples reach the root from the first.
#[test]
fn perf_stack_samples_taken_during_the_check_wait_for_it() {
    let _serial = serial();
    let _defer = DeferThreshold::set(0);
    let _delay = CheckDelay(spulse::testing::unwind_tables::set_check_delay(300));
    let (_, _, cut) = during_the_check(spulse::Recorder::builder(), None);
    assert!(cut > 10, "the signal engine's samples in the window stop at the executable: only {cut} did");
    let (choice, expect) = perf_stack_engine_for("perf_stack_samples_taken_during_the_check_wait_for_it");
    if expect != spulse::Engine::PerfStack {
        // Said loudly by perf_stack_engine_for (qemu-user: no perf events).
        return;
    }
    let (leaf_inner, complete, cut) =
        during_the_check(spulse::Recorder::builder().engine(choice), Some(expect));
    assert_eq!(cut, 0, "perf-stack samples cut at the executable ({complete} of {leaf_inner} complete)");
    assert!(complete >= 250, "too few samples: {complete} of {leaf_inner} complete");
}

/// Restores the check delay when dropped.
struct CheckDelay(u64);

impl Drop for CheckDelay {
    fn drop(&mut self) {
        spulse::testing::unwind_tables::set_check_delay(self.0);
    }
}

/// Record a thread burning 0.5 s in `unwind_inner` from `start` on: the
/// samples whose leaf is `unwind_inner`, how many reached the root through
/// the whole chain, and how many stopped at the leaf (the executable's first
/// frame) with the truncation marker. Any other shape fails.
fn during_the_check(builder: spulse::RecorderBuilder, expect: Option<spulse::Engine>) -> (u64, u64, u64) {
    let (_dir, path) = spool_path("deferred.spool");
    let guard = builder.frequency_hz(999).start(&path).expect("start");
    if let Some(e) = expect {
        assert_eq!(guard.engine(), e);
    }
    let worker = std::thread::spawn(|| (gettid(), unwind_outer(0.5, Duration::from_secs(20))));
    let (tid, acc) = worker.join().unwrap();
    black_box(acc);
    let stats = guard.finish().expect("finish");
    assert!(stats.unwind_tables_mapped > 0, "the checked tables were handed over: {stats:?}");

    let snap = spulse::Snapshot::open(&path).expect("spool opens");
    let mut sym = Symbolizer::default();
    let (mut leaf_inner, mut complete, mut cut) = (0u64, 0u64, 0u64);
    for s in snap.samples() {
        let frames: Vec<_> = snap.stack_frames(s.stack).collect();
        if snap.thread(s.thread).tid != tid {
            continue;
        }
        let names: Vec<String> = frames.iter().map(|&f| sym.name(&snap, f)).collect();
        if !names.first().is_some_and(|n| n.ends_with("unwind_inner")) {
            continue;
        }
        leaf_inner += 1;
        let truncated = frames.iter().any(|&f| snap.frame(f) == Frame::Truncated);
        let chain_ok =
            names.len() > 3 && names[1].ends_with("unwind_middle") && names[2].ends_with("unwind_outer");
        if !truncated && chain_ok && names.iter().any(|n| n.ends_with("thread_start")) {
            complete += 1;
        } else {
            // Cut before the check was done: the leaf (in the executable) and
            // the marker, nothing guessed after it.
            assert!(
                frames.len() == 2 && snap.frame(frames[1]) == Frame::Truncated,
                "neither complete nor cut at the executable's first frame: {names:?}"
            );
            cut += 1;
        }
    }
    eprintln!("{leaf_inner} samples in unwind_inner: {complete} to the root, {cut} cut at the leaf before the check");
    assert!(leaf_inner >= 50, "too few samples in the leaf function: {leaf_inner}");
    (leaf_inner, complete, cut)
}
