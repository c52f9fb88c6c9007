//! Benchmark instrumentation of the signal handler (compiled with the `testing`
//! feature only): when on, each of our signals
//! adds its handler time (entry to exit, read with [`bench_ticks`]) to a fixed
//! histogram of atomic counters. Off, it costs the handler one relaxed load.
//! Runs in the handler: no allocation, no lock; [`begin`] and [`end`] only read a
//! clock and touch atomics.
//!
//! It also holds the phase knob of the cost breakdown: [`set_stop_after`] makes
//! the handler return after a given phase ([`Phase`]), so a gap meter measures
//! what each phase adds to a sample's cost (`compare/gaps.py`).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

/// When on, each of our signals adds its handler time to the histogram.
static ON: AtomicBool = AtomicBool::new(false);
/// Width of a histogram bucket.
pub(crate) const BUCKET_NS: u64 = 20;
/// Buckets (the last one collects everything slower).
pub(crate) const BUCKETS: usize = 2048;
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
static HIST: [AtomicU64; BUCKETS] = [ZERO; BUCKETS];

/// Where the handler stops when the breakdown knob is set (0: it runs whole).
static STOP_AFTER: AtomicU8 = AtomicU8::new(0);

/// The phases of the handler, in order, for [`set_stop_after`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// The signal is classified as ours; nothing else is done.
    Classify = 1,
    /// The thread id is read, its name captured, an unwinder cache claimed.
    Claim = 2,
    /// A ring slot is claimed, the registers and the time are read.
    Registers = 3,
    /// The stack is unwound into the slot (which is then dropped, not published).
    Unwind = 4,
}

/// Make the handler return after `phase` (`None`: run whole, the default).
/// Samples stopped early are not recorded.
pub(crate) fn set_stop_after(phase: Option<Phase>) {
    STOP_AFTER.store(phase.map_or(0, |p| p as u8), Ordering::SeqCst);
}

/// Whether the handler stops after `phase`.
#[inline(always)]
pub(super) fn stop_after(phase: Phase) -> bool {
    STOP_AFTER.load(Ordering::Relaxed) == phase as u8
}

/// Nanoseconds per tick of [`bench_ticks`], as a 32.32 fixed-point number.
static TICK_NS_Q32: AtomicU64 = AtomicU64::new(1 << 32);

/// Turn handler timing on or off. Turning it on calibrates the tick counter
/// against `CLOCK_MONOTONIC` (about 20 ms).
pub(crate) fn set(on: bool) {
    if on {
        let (t0, n0) = (bench_ticks(), mono_ns());
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (t1, n1) = (bench_ticks(), mono_ns());
        let ticks = t1.wrapping_sub(t0).max(1) as u128;
        let q32 = ((n1.wrapping_sub(n0) as u128) << 32) / ticks;
        TICK_NS_Q32.store(q32.min(u64::MAX as u128) as u64, Ordering::SeqCst);
    }
    ON.store(on, Ordering::SeqCst);
}

/// The clock of the handler-time histogram. On x86_64 the time-stamp counter:
/// reading it costs a few nanoseconds, where `clock_gettime` costs 40-120 ns in
/// the handler (cold vDSO data) and that cost would be counted as the handler's.
#[inline(always)]
fn bench_ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `rdtsc` exists on every x86_64 CPU, reads a counter and has
        // no memory effects.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        mono_ns()
    }
}

/// Take (and reset) the handler-time histogram.
pub(crate) fn take() -> Vec<u64> {
    HIST.iter().map(|b| b.swap(0, Ordering::Relaxed)).collect()
}

#[inline]
pub(super) fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass (vDSO, async-signal-safe).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// Start timing one handler run: its start tick, or 0 when timing is off.
#[inline(always)]
pub(super) fn begin() -> u64 {
    if ON.load(Ordering::Relaxed) {
        bench_ticks()
    } else {
        0
    }
}

/// End timing a handler run begun at `t0` (nothing when `t0` is 0).
#[inline(always)]
pub(super) fn end(t0: u64) {
    if t0 != 0 {
        let ticks = bench_ticks().wrapping_sub(t0) as u128;
        let ns = (ticks * TICK_NS_Q32.load(Ordering::Relaxed) as u128) >> 32;
        let bucket = (ns / BUCKET_NS as u128).min(BUCKETS as u128) as usize;
        if let Some(b) = HIST.get(bucket.min(BUCKETS - 1)) {
            b.fetch_add(1, Ordering::Relaxed);
        }
    }
}
