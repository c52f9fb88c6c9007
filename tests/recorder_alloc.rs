//! The handler allocates nothing: a counting global allocator counts every
//! allocation made on a watched thread that only spins (allocation-free by
//! construction) while it is sampled thousands of times at 4 kHz. Any allocation
//! on that thread can only come from the signal handler.

mod recorder_support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use recorder_support::*;

struct Counting;

static WATCHED: AtomicU32 = AtomicU32::new(0);
static WATCHING: AtomicBool = AtomicBool::new(false);
static ON_WATCHED: AtomicU64 = AtomicU64::new(0);
static ALL: AtomicU64 = AtomicU64::new(0);

fn note() {
    ALL.fetch_add(1, Ordering::Relaxed);
    if WATCHING.load(Ordering::Relaxed) && gettid() == WATCHED.load(Ordering::Relaxed) {
        ON_WATCHED.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: forwards to the system allocator; counting touches only atomics and a
// raw gettid syscall (no allocation, no thread-locals).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        note();
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        note();
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[inline(never)]
fn spin_until(cpu_target: f64, deadline: Instant) -> u64 {
    let c0 = thread_cpu_seconds();
    let mut h = 1u64;
    while thread_cpu_seconds() - c0 < cpu_target && Instant::now() < deadline {
        for i in 0..10_000u64 {
            h = (h ^ black_box(i)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

#[test]
fn handler_allocates_nothing_across_thousands_of_samples() {
    let (_dir, path) = spool_path("alloc.spool");
    let guard = spulse::Recorder::builder().frequency_hz(4000).start(&path).expect("start");
    // The watched thread opens and closes the watch window itself, with atomics
    // only: no channel or other handshake runs inside the window, so whatever
    // the counter sees there was allocated by the signal handler.
    let h = std::thread::spawn(move || {
        let tid = gettid();
        WATCHED.store(tid, Ordering::SeqCst);
        WATCHING.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(8);
        let r = spin_until(1.0, deadline);
        let during_spin = ON_WATCHED.load(Ordering::SeqCst);
        // One deliberate allocation inside the window proves the counter sees
        // this thread's allocations at all.
        black_box(Box::new(r));
        let with_probe = ON_WATCHED.load(Ordering::SeqCst);
        // Stop watching before the thread's own exit path frees its buffers.
        WATCHING.store(false, Ordering::SeqCst);
        (tid, during_spin, with_probe)
    });
    let (tid, during_spin, with_probe) = h.join().unwrap();
    let stats = guard.finish().expect("finish");

    let snap = spulse::Snapshot::open(&path).unwrap();
    let samples = per_thread(&snap).get(&tid).copied().unwrap_or(0);
    eprintln!("watched thread: {samples} samples, {during_spin} allocations while spinning; {stats:?}");
    assert!(samples >= 2000, "expected thousands of samples of the watched thread, got {samples}");
    assert!(with_probe > during_spin, "the counter did not see the watched thread's own allocation");
    assert_eq!(
        during_spin, 0,
        "allocations on the sampled thread while it spun (only the handler ran there)"
    );
    assert!(ALL.load(Ordering::SeqCst) > 0, "the counting allocator is in use");
}
