//! Which allocations are sampled: a per-thread count of the bytes left until
//! the next sample, drawn from an exponential distribution (a Poisson process
//! over the bytes a thread allocates, as Go's runtime does), and the
//! per-thread re-entrancy guard.
//!
//! An unsampled allocation costs one thread-local decrement and a compare.
//! Every thread-local here is `const`-initialized and has no destructor, so it
//! is a plain `#[thread_local]` slot: reading it never allocates, never
//! registers anything, and works during and after the thread's TLS
//! destructors.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Go's default `MemProfileRate`: one sample every 512 KiB on average.
pub const DEFAULT_RATE: usize = 512 * 1024;

/// Bytes between two looks at the rate while sampling is off.
const OFF_PARK: i64 = 64 << 20;

/// A rate set at run time by [`super::set_sample_rate`] (`u64::MAX`: none;
/// the allocator's own rate applies).
static RATE_OVERRIDE: AtomicU64 = AtomicU64::new(u64::MAX);

thread_local! {
    /// Bytes this thread may still allocate before the next sample; at or
    /// below zero the next allocation takes the slow path. Starts at zero so
    /// that the first allocation of a thread draws its first interval.
    static BYTES_LEFT: Cell<i64> = const { Cell::new(0) };
    /// xorshift64* state; zero until the thread's first slow path.
    static RNG: Cell<u64> = const { Cell::new(0) };
    /// Inside the sampler (unwinding, recording): allocations made meanwhile
    /// are never sampled (one that runs the counter out is not counted).
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// The mean sampling interval in bytes in effect for an allocator built with
/// `own` (0: sampling off).
#[inline]
pub(crate) fn rate(own: usize) -> u64 {
    match RATE_OVERRIDE.load(Ordering::Relaxed) {
        u64::MAX => own as u64,
        r => r,
    }
}

pub(crate) fn set_rate(rate: Option<usize>) {
    RATE_OVERRIDE.store(rate.map_or(u64::MAX, |r| r as u64), Ordering::Relaxed);
}

/// Count `size` bytes allocated by this thread; true if this allocation is to
/// be sampled. The fast path is the decrement.
#[inline(always)]
pub(crate) fn take(size: usize, own_rate: usize) -> bool {
    BYTES_LEFT.with(|left| {
        let l = left.get().wrapping_sub(size as i64);
        left.set(l);
        if l > 0 {
            false
        } else {
            slow(left, size, own_rate)
        }
    })
}

/// The counter ran out (or this is the thread's first allocation).
#[cold]
#[inline(never)]
fn slow(left: &Cell<i64>, size: usize, own_rate: usize) -> bool {
    let rate = rate(own_rate);
    if BUSY.with(Cell::get) || rate == 0 {
        // Not counted: an allocation of the sampler itself, or sampling off
        // (then the counter is parked 64 MiB away, so that a rate set again
        // later is seen within that many bytes).
        left.set(if rate == 0 { OFF_PARK } else { left.get().wrapping_add(size as i64) });
        return false;
    }
    if RNG.with(Cell::get) == 0 {
        // The thread's first slow path: its first interval, from which this
        // allocation is then counted (memoryless: as likely to be sampled as
        // any other).
        seed();
        let l = draw(rate).saturating_sub(size as i64);
        left.set(l);
        if l > 0 {
            return false;
        }
    }
    // Sampled. The next interval is drawn afresh (as Go's `nextSample`): by
    // the exponential's memorylessness an allocation of `s` bytes is sampled
    // with probability 1 - exp(-s / rate), whatever came before it.
    left.set(draw(rate));
    true
}

fn seed() {
    // The address of this thread's TLS slot and the time: distinct per thread
    // and per run. Never zero (zero marks "not seeded").
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass; no allocation.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let addr = RNG.with(|r| r as *const Cell<u64> as u64);
    let mut s = addr ^ (ts.tv_nsec as u64).rotate_left(32) ^ ts.tv_sec as u64;
    s = splitmix(s);
    RNG.with(|r| r.set(if s == 0 { 0x9e37_79b9_7f4a_7c15 } else { s }));
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform draw in (0, 1).
fn uniform() -> f64 {
    RNG.with(|r| {
        let mut x = r.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        r.set(x);
        // 53 random bits, offset by half a step: never 0, never 1.
        ((x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    })
}

/// The next interval: exponential with mean `rate`, at least one byte.
fn draw(rate: u64) -> i64 {
    let x = -uniform().ln() * rate as f64;
    (x as i64).max(1)
}

/// The Horvitz-Thompson weight of a sampled allocation of `size` bytes: the
/// inverse of its sampling probability 1 - exp(-size / rate). This is Go's
/// `scaleHeapSample` factor, applied per allocation (Go applies it to a
/// bucket's average size; the same for a stack that allocates one size,
/// unbiased when the sizes vary).
pub(crate) fn weight(size: usize, rate: u64) -> f64 {
    if rate <= 1 || size == 0 {
        return 1.0;
    }
    let p = -(-(size as f64) / rate as f64).exp_m1();
    if p <= 0.0 {
        1.0
    } else {
        1.0 / p
    }
}

/// Run `f` with this thread's re-entrancy guard set (allocations made inside
/// are not sampled). Returns `None` if the guard was set already.
#[inline]
pub(crate) fn guarded<R>(f: impl FnOnce() -> R) -> Option<R> {
    if BUSY.with(|b| b.replace(true)) {
        return None;
    }
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            BUSY.with(|b| b.set(false));
        }
    }
    let _reset = Reset;
    Some(f())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weight_is_the_inverse_sampling_probability() {
        assert_eq!(weight(100, 1), 1.0);
        let w = weight(1024, 512 * 1024);
        assert!((w - 512.5).abs() < 0.01, "{w}");
        assert!((weight(64 << 20, 512 * 1024) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn intervals_are_exponential_with_the_mean_rate() {
        guarded(seed).unwrap();
        let n = 200_000;
        let rate = 512 * 1024;
        let xs: Vec<f64> = (0..n).map(|_| draw(rate) as f64).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        // Standard error of the mean: rate / sqrt(n) = 0.22 %; 5 sigma.
        assert!((mean / rate as f64 - 1.0).abs() < 0.012, "mean {mean}");
        // An exponential's P(X > mean) = 1/e.
        let above = xs.iter().filter(|&&x| x > rate as f64).count() as f64 / n as f64;
        assert!((above - (-1f64).exp()).abs() < 0.006, "{above}");
    }

    #[test]
    fn sampling_off_parks_the_counter_and_comes_back() {
        // On a thread of its own: the counters are per thread.
        std::thread::spawn(|| {
            assert!(!take(1 << 30, 0), "rate 0: never sampled");
            assert_eq!(BYTES_LEFT.with(Cell::get), OFF_PARK);
            // Back at rate 1: sampled once the parked bytes are spent.
            let mut sampled = false;
            for _ in 0..=(OFF_PARK >> 20) {
                sampled |= take(1 << 20, 1);
            }
            assert!(sampled);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_guard_does_not_nest() {
        assert_eq!(guarded(|| guarded(|| 1)), Some(None));
        assert_eq!(guarded(|| 2), Some(2));
    }
}
