//! Which allocations are sampled: stratified (jittered) sampling of each
//! thread's allocated bytes, and the per-thread re-entrancy guard.
//!
//! A thread's allocations are laid end to end on a line of bytes, cut into
//! strata of `rate` bytes (the grid starts at a random phase when the thread
//! first allocates); each stratum holds exactly one sample point, placed
//! uniformly at random in it, independently of the others. An allocation is
//! sampled if it holds a point; it stands for `rate` bytes per point it holds
//! ([`Sampled`](super::Sampled) records the count).
//!
//! Against a Poisson process of the same mean (Go's runtime, jemalloc) this
//! is unbiased the same way (the expected points in any stretch of `b` bytes
//! are `b / rate`) and never has a larger variance: the points a set of bytes
//! holds are a sum of independent 0-or-1 counts, one per stratum it touches,
//! each with variance p (1 - p) against the Poisson's p. A function that
//! allocates a contiguous run of `b` bytes gets `b / rate` points give or
//! take one at each end, where a Poisson process is off by sqrt(b / rate);
//! interleaved with others at a scale finer than the rate, it does no worse
//! than Poisson. The points are independent between strata, so there is no
//! aliasing with periodic allocation patterns (measured: `compare/heap_sampling.py`).
//!
//! An unsampled allocation costs one thread-local decrement and a sign test,
//! made before the allocation ([`charge`]).
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

/// The largest rate honoured (larger ones are this).
const MAX_RATE: u64 = 1 << 48;

/// A rate set at run time by [`super::set_sample_rate`] (`u64::MAX`: none;
/// the allocator's own rate applies).
static RATE_OVERRIDE: AtomicU64 = AtomicU64::new(u64::MAX);

// The count of bytes this thread may still allocate before its pending
// sample point is `tls`'s (`tls::with_left`): below zero the allocation that
// took it there holds the point (slow path). It starts at zero so that the
// thread's first allocation lays the grid.
thread_local! {
    /// Bytes from the pending point to the end of its stratum (-1: no grid
    /// laid yet, or laid anew after sampling was off).
    static TAIL: Cell<i64> = const { Cell::new(-1) };
    /// The stratum length of the grid (the rate it was laid for).
    static GRID: Cell<u64> = const { Cell::new(0) };
    /// xorshift64* state; zero until the thread's first slow path.
    static RNG: Cell<u64> = const { Cell::new(0) };
    /// Inside the sampler (unwinding, recording): allocations made meanwhile
    /// are never sampled (one that reaches the point is not counted).
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
    .min(MAX_RATE)
}

pub(crate) fn set_rate(rate: Option<usize>) {
    RATE_OVERRIDE.store(rate.map_or(u64::MAX, |r| r as u64), Ordering::Relaxed);
}

/// The stratum length of this thread's grid: the rate the points counted by
/// the latest [`take`] stand for.
pub(crate) fn grid() -> u64 {
    GRID.with(Cell::get)
}

/// Count `size` bytes about to be allocated by this thread (`off`: the
/// allocator's copy of the count's offset from the thread pointer): true if
/// they hold no sample point (the fast path, one thread-local decrement and a
/// sign test, done before the allocation so that the wrapper can hand over
/// to the inner allocator with a tail call). False: the allocation reaches
/// the pending point (or this is the thread's first allocation, or sampling
/// is off); then [`points`] once the allocation succeeded, or [`refund`] if
/// it failed.
#[inline(always)]
pub(crate) fn charge(off: &super::tls::OffsetCopy, size: usize) -> bool {
    match super::tls::try_sub(off, size) {
        Some(left) => left >= 0,
        None => super::tls::with_left(|left| {
            let l = left.get().wrapping_sub(size as i64);
            left.set(l);
            l >= 0
        }),
    }
}

/// Give back the `size` bytes of an allocation that [`charge`] found
/// reaching the pending point and that failed: it is not counted.
#[cold]
pub(crate) fn refund(size: usize) {
    super::tls::with_left(|left| left.set(left.get().wrapping_add(size as i64)));
}

/// The sample points an allocation of `size` bytes holds, given that
/// [`charge`] returned false for it (0: none after all); taken before the
/// allocation (a sampled block is allocated with another layout), with
/// [`save`] first so that a failed allocation can be given back
/// ([`restore`], then [`refund`]).
#[cold]
#[inline(never)]
pub(crate) fn points(size: usize, own_rate: usize) -> u64 {
    super::tls::with_left(|left| slow(left, size, own_rate))
}

/// This thread's sampling state, saved by [`save`] before [`points`] and put
/// back by [`restore`] if the allocation then fails (it is not counted).
#[derive(Clone, Copy)]
pub(crate) struct Saved {
    left: i64,
    tail: i64,
    grid: u64,
    rng: u64,
}

#[cold]
pub(crate) fn save() -> Saved {
    Saved {
        left: super::tls::with_left(Cell::get),
        tail: TAIL.with(Cell::get),
        grid: GRID.with(Cell::get),
        rng: RNG.with(Cell::get),
    }
}

#[cold]
pub(crate) fn restore(s: Saved) {
    super::tls::with_left(|c| c.set(s.left));
    TAIL.with(|c| c.set(s.tail));
    GRID.with(|c| c.set(s.grid));
    RNG.with(|c| c.set(s.rng));
}

/// Bytes this thread may still allocate before its pending point.
#[cfg(test)]
pub(crate) fn left() -> i64 {
    super::tls::with_left(Cell::get)
}

/// Count `size` bytes allocated by this thread; the number of sample points
/// the allocation holds (0: not sampled).
#[cfg(test)]
fn take(size: usize, own_rate: usize) -> u64 {
    static COPY: super::tls::OffsetCopy = super::tls::OffsetCopy::new();
    COPY.refresh();
    if charge(&COPY, size) {
        0
    } else {
        points(size, own_rate)
    }
}

/// The allocation reaches the pending point (or this is the thread's first
/// allocation, or sampling is off).
fn slow(left: &Cell<i64>, size: usize, own_rate: usize) -> u64 {
    super::tls::learn();
    let rate = rate(own_rate);
    if BUSY.with(Cell::get) || rate == 0 {
        // Not counted: an allocation of the sampler itself (its bytes given
        // back), or sampling off (then the counter is parked 64 MiB away, so
        // that a rate set again later is seen within that many bytes, and the
        // grid is laid anew then).
        if rate == 0 {
            left.set(OFF_PARK);
            TAIL.with(|t| t.set(-1));
        } else {
            left.set(left.get().wrapping_add(size as i64));
        }
        return 0;
    }
    if RNG.with(Cell::get) == 0 {
        seed();
    }
    let size = size.min(i64::MAX as usize / 2) as i64;
    let r = rate as i64;
    let (offset, tail) = if TAIL.with(Cell::get) < 0 || GRID.with(Cell::get) != rate {
        // Lay a grid: this allocation starts `phase` bytes into a stratum
        // whose point is `p` bytes into it; if that point is behind, the
        // pending one is the next stratum's.
        GRID.with(|g| g.set(rate));
        let (phase, p) = (below(r), below(r));
        if p >= phase {
            (p - phase, r - p)
        } else {
            let q = below(r);
            (r - phase + q, r - q)
        }
    } else {
        // The pending point's offset in this allocation.
        (left.get().wrapping_add(size), TAIL.with(Cell::get))
    };
    let (points, offset, tail) = count(offset, tail, size, r);
    left.set(offset);
    TAIL.with(|t| t.set(tail));
    points
}

/// The points an allocation of `size` bytes holds, given its pending point
/// `offset` bytes from its start, `tail` bytes before the end of that point's
/// stratum (strata of `r` bytes); and the next pending point's offset from
/// the allocation's end and its tail.
fn count(offset: i64, tail: i64, size: i64, r: i64) -> (u64, i64, i64) {
    if offset >= size {
        return (0, offset - size, tail);
    }
    // Bytes from the point to the allocation's end.
    let over = size - offset;
    if over <= tail {
        // The allocation ends in the point's stratum: the next point is in
        // the next stratum.
        let q = below(r);
        return (1, tail - over + q, r - q);
    }
    // Whole strata after the point's (one point each), then `x` bytes into
    // the last one the allocation reaches.
    let rest = over - tail;
    let (full, x) = (rest / r, rest % r);
    let q = below(r);
    if q < x {
        let q2 = below(r);
        (2 + full as u64, r - x + q2, r - q2)
    } else {
        (1 + full as u64, q - x, r - q)
    }
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

/// A uniform draw in [0, r) (r >= 1, at most [`MAX_RATE`]).
fn below(r: i64) -> i64 {
    let x = RNG.with(|c| {
        let mut x = c.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        c.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    });
    // The high bits times r: uniform to within r / 2^64.
    ((x as u128 * r as u128) >> 64) as i64
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

    /// Allocations of the sizes `sizes` yields on a thread of its own (the
    /// counters are per thread), at `rate`: the points each held.
    fn points(rate: usize, sizes: impl Iterator<Item = usize> + Send + 'static) -> Vec<(usize, u64)> {
        std::thread::spawn(move || sizes.map(|s| (s, take(s, rate))).collect()).join().unwrap()
    }

    fn sizes(seed: u64, max: usize) -> impl Iterator<Item = usize> + Send {
        let mut x = splitmix(seed) | 1;
        std::iter::repeat_with(move || {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            1 + (x.wrapping_mul(0x2545_f491_4f6c_dd1d) % max as u64) as usize
        })
    }

    #[test]
    fn every_stratum_holds_one_point() {
        // Any run of allocations holds its bytes / rate points, give or take
        // one at each end; a Poisson process would be off by sqrt(200) ~ 14.
        let rate = 64 * 1024;
        for (seed, max) in [(1, 100), (2, 5000), (3, 200_000), (4, 3 * rate)] {
            let got = points(rate, sizes(seed, max).take(200 * rate / (max / 2 + 1)));
            let bytes: usize = got.iter().map(|g| g.0).sum();
            let n: u64 = got.iter().map(|g| g.1).sum();
            let want = bytes as f64 / rate as f64;
            assert!((n as f64 - want).abs() <= 2.0, "max {max}: {n} points in {want} strata");
            // Every prefix too (the counts between are bounded, not drifting).
            let (mut b, mut k) = (0usize, 0u64);
            for &(s, p) in &got {
                b += s;
                k += p;
                assert!((k as f64 - b as f64 / rate as f64).abs() <= 2.0, "max {max}: {k} after {b} bytes");
            }
        }
    }

    #[test]
    fn points_are_uniform_within_their_strata() {
        // One-byte allocations: the gap between two successive points is
        // rate + U2 - U1 (U uniform on [0, rate)): mean rate, and below
        // rate / 2 with probability 1/8.
        let rate = 1000;
        let got = points(rate, std::iter::repeat_n(1, 2_000_000));
        let at: Vec<usize> = got.iter().enumerate().filter(|g| g.1 .1 == 1).map(|g| g.0).collect();
        assert!(got.iter().all(|g| g.1 <= 1));
        let gaps: Vec<f64> = at.windows(2).map(|w| (w[1] - w[0]) as f64).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((mean / rate as f64 - 1.0).abs() < 0.01, "mean gap {mean}");
        let short = gaps.iter().filter(|&&g| g < rate as f64 / 2.0).count() as f64 / gaps.len() as f64;
        // 2,000 gaps: standard error 0.0074; 4 sigma.
        assert!((short - 0.125).abs() < 0.03, "{short}");
    }

    #[test]
    fn large_blocks_hold_one_point_per_stratum() {
        // 10.5 strata: 9 or 10 whole ones inside, and a part of one at
        // each end, whose point may or may not be inside: 9 to 12 points,
        // 10.5 on average (the variance is at most 2 * 1/4 a block).
        let rate = 4096;
        let got = points(rate, std::iter::repeat_n(10 * rate + rate / 2, 1000));
        assert!(got.iter().all(|g| (9..=12).contains(&g.1)), "{got:?}");
        let mean = got.iter().map(|g| g.1 as f64).sum::<f64>() / got.len() as f64;
        assert!((mean - 10.5).abs() < 0.1, "{mean}");
        // Rate 1: every byte is a point, every allocation is sampled.
        assert!(points(1, sizes(5, 300).take(1000)).iter().all(|&(s, p)| p == s as u64));
    }

    #[test]
    fn sampling_off_parks_the_counter_and_comes_back() {
        // On a thread of its own: the counters are per thread.
        std::thread::spawn(|| {
            assert_eq!(take(1 << 30, 0), 0, "rate 0: never sampled");
            assert_eq!(super::super::tls::with_left(Cell::get), OFF_PARK);
            // Back at rate 1: sampled once the parked bytes are spent.
            let mut sampled = 0;
            for _ in 0..=(OFF_PARK >> 20) {
                sampled += take(1 << 20, 1);
            }
            assert_eq!(sampled, 1 << 20, "the allocation past the parked bytes, every byte of it");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_fast_path_counts_on_each_threads_own_count() {
        // The first slow path learns the count's offset (the tests are an
        // executable holding this code, on x86-64 or aarch64).
        let _ = take(1, 1 << 20);
        if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) && !super::super::tls::SLOT {
            assert_ne!(super::super::tls::offset(), 0, "offset learnt");
        }
        static COPY: super::super::tls::OffsetCopy = super::super::tls::OffsetCopy::new();
        COPY.refresh();
        assert_eq!(COPY.get(), super::super::tls::offset(), "the copy takes the learnt offset");
        let each = || {
            super::super::tls::with_left(|c| c.set(1_000));
            assert!(charge(&COPY, 300));
            assert_eq!(left(), 700, "the fast path took from this thread's count");
            assert!(!charge(&COPY, 800));
            assert_eq!(left(), -100);
            super::super::tls::with_left(|c| c.set(0));
        };
        each();
        // Threads started after it was learnt, several at once.
        let threads: Vec<_> = (0..4).map(|_| std::thread::spawn(each)).collect();
        for t in threads {
            t.join().unwrap();
        }
        each();
    }

    #[test]
    fn the_guard_does_not_nest() {
        assert_eq!(guarded(|| guarded(|| 1)), Some(None));
        assert_eq!(guarded(|| 2), Some(2));
    }
}
