//! Heap profiles (cargo feature `heap`): a sampling global allocator
//! wrapper, [`Sampled`], and (with the `pprof` feature too) the pprof heap
//! profile of what it sampled, [`profile`].
//!
//! ```ignore
//! use std::alloc::System;
//! #[global_allocator]
//! static ALLOC: spulse::heap::Sampled<System> = spulse::heap::Sampled::new(System);
//!
//! // ... later, anywhere:
//! let pprof_gz: Vec<u8> = spulse::heap::profile()?;
//! ```
//!
//! `Sampled` wraps any [`GlobalAlloc`] (the system allocator, jemalloc,
//! mimalloc) and samples allocations by bytes allocated, one sample point in
//! every [`DEFAULT_RATE`] bytes (512 KiB, Go's rate; [`Sampled::with_rate`],
//! [`set_sample_rate`]) a thread allocates, at a random place in each such
//! stretch (stratified sampling, see below). Each thread counts down the
//! bytes left until its next point. An unsampled allocation costs that
//! decrement; an unsampled free one load from a small filter of the sampled
//! addresses. A sampled allocation is unwound on the
//! spot with the recorder's framehop tables (the unwinder allocates nothing
//! while walking; it is built by the first sample, with its own allocations
//! passed through unsampled, and rebuilt when libraries are loaded or
//! unloaded), its stack interned in a fixed table, and the block entered in a
//! fixed table of live sampled blocks that `dealloc` and `realloc` update.
//! An allocation made while the same thread is inside the sampler is never
//! sampled.
//!
//! Each sample point stands for `rate` bytes: a sampled allocation of `size`
//! bytes holding `k` points (`k` > 1 only for allocations near or above the
//! rate) counts `k * rate` bytes and `k * rate / size` allocations, so the
//! profile's values are unbiased estimates of everything allocated and in
//! use, already scaled (as Go's `/debug/pprof/heap` values are; `period` is
//! the rate). Go's runtime and jemalloc draw their points from a Poisson
//! process, where a function that allocated `b` bytes is off by about
//! `1 / sqrt(b / rate)` (7 % for 100 MB at 512 KiB); here each `rate`-byte
//! stretch of a thread's allocations holds exactly one point, placed
//! uniformly and independently of the others, so a function that allocates
//! its bytes in one run is off by less than two points (`2 * rate` bytes;
//! 100 MB: 1 %), in `n` runs by about `sqrt(n / 2)` points, and one whose
//! allocations are interleaved with others' finer than the rate by no more
//! than under Poisson sampling (the variance is never larger). No
//! aliasing with periodic allocation loops: the points of different
//! stretches are independent (measured in BENCHMARKS.md, "Heap profiles").
//!
//! Memory is fixed and static (touched page by page), 4.2 MiB in all:
//! 2 MiB for up to 65,536 live sampled blocks ([`LIVE_CAPACITY`]; at the
//! default rate about one per 512 KiB of live heap, so a live heap of some
//! 32 GiB), 18 KiB of filter (2 KiB of it read by frees),
//! 2.2 MiB for 4,096 distinct stacks of up to 64 frames ([`STACK_CAPACITY`]),
//! plus, once the first sample is taken, the unwinder: eight framehop caches
//! (about 33 KB each) and a copy of the loaded libraries' unwind tables (as
//! the CPU recorder keeps). Beyond the capacities samples are still counted
//! but lose their stack or their in-use tracking ([`stats`] says how many).
//!
//! Safe with the CPU recorder (its signal handler never allocates; the two
//! share no lock), with `fork` (no lock of its own anywhere: a child forked
//! in the middle of a sample loses at most that sample's slots; the loader's
//! lock is taken only to build the unwinder, once, and a child forked during
//! that build does not redo it: its samples then have no stack), at thread exit and
//! in thread-local destructors (the sampler's thread-locals are `const` and
//! have no destructor). Nothing in the sampler ever waits for another thread.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};

mod live;
#[cfg(feature = "pprof")]
mod pprof;
mod sampler;
mod stacks;
mod unwind;

#[cfg(feature = "pprof")]
pub use pprof::{profile, write_profile, HEAP_PATH};
pub use sampler::DEFAULT_RATE;

/// Live sampled blocks the table holds (see the module documentation).
pub const LIVE_CAPACITY: usize = live::CAPACITY;
/// Distinct stacks the profile keeps.
pub const STACK_CAPACITY: usize = stacks::CAPACITY;

static SAMPLES: AtomicU64 = AtomicU64::new(0);
/// The rate of the latest sample (the profile's `period`).
static LAST_RATE: AtomicU64 = AtomicU64::new(DEFAULT_RATE as u64);

/// A [`GlobalAlloc`] that samples the allocations it passes to `A`; see the
/// [module documentation](self).
#[derive(Debug, Default)]
pub struct Sampled<A> {
    inner: A,
    rate: usize,
}

impl<A> Sampled<A> {
    /// Wrap `inner`, sampling every [`DEFAULT_RATE`] bytes on average.
    pub const fn new(inner: A) -> Sampled<A> {
        Sampled { inner, rate: DEFAULT_RATE }
    }

    /// Wrap `inner`, sampling every `rate` bytes on average (0: never; 1:
    /// every allocation).
    pub const fn with_rate(inner: A, rate: usize) -> Sampled<A> {
        Sampled { inner, rate }
    }

    /// The wrapped allocator.
    pub const fn inner(&self) -> &A {
        &self.inner
    }
}

/// Change the mean sampling interval of every [`Sampled`] allocator at run
/// time (`None`: back to each allocator's own). Each sample is scaled by the
/// rate in effect when it was taken.
pub fn set_sample_rate(rate: Option<usize>) {
    sampler::set_rate(rate);
}

/// The sampler's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Allocations sampled so far.
    pub samples: u64,
    /// Sampled blocks live now (in the table).
    pub live_blocks: u64,
    /// Sampled blocks not tracked for lack of a table slot: their in-use
    /// bytes are never subtracted.
    pub untracked_blocks: u64,
    /// Samples recorded without their stack (unwinder not built yet or
    /// being rebuilt, all unwinder caches in use, no stack bounds).
    pub without_stack: u64,
    /// Replaced unwinders leaked because a walk was using them.
    pub unwinders_leaked: u64,
}

/// The sampler's counters now.
pub fn stats() -> Stats {
    Stats {
        samples: SAMPLES.load(Ordering::Relaxed),
        live_blocks: live::live(),
        untracked_blocks: live::dropped(),
        without_stack: unwind::NO_STACK.load(Ordering::Relaxed),
        unwinders_leaked: unwind::LEAKED.load(Ordering::Relaxed),
    }
}

/// Take a sample of the block `p` of `size` bytes just allocated, which
/// holds `points` sample points.
#[cold]
#[inline(never)]
fn record(p: *mut u8, size: usize, points: u64) {
    sampler::guarded(|| {
        // Each point stands for a stratum of `rate` bytes.
        let rate = sampler::grid();
        if LAST_RATE.load(Ordering::Relaxed) != rate {
            LAST_RATE.store(rate, Ordering::Relaxed);
        }
        let bytes = points.saturating_mul(rate);
        let objects = (bytes as f64 / size.max(1) as f64 * stacks::FIXED as f64).round() as u64;
        let mut addrs = [0u64; stacks::MAX_DEPTH];
        let n = unwind::capture(&mut addrs);
        let stack = stacks::intern(&addrs[..n]);
        stacks::add_alloc(stack, objects, bytes);
        live::insert(p, live::Block { bytes, objects, stack });
        SAMPLES.fetch_add(1, Ordering::Relaxed);
    });
}

/// The block at `p` is about to go back to the allocator.
#[cold]
#[inline(never)]
fn forget(p: *mut u8) {
    if let Some(b) = live::remove(p) {
        stacks::add_free(b.stack, b.objects, b.bytes);
    }
}

impl<A: GlobalAlloc> Sampled<A> {
    /// The rest of an allocation whose bytes reach this thread's pending
    /// sample point ([`sampler::charge`] said so): allocate, then sample.
    ///
    /// # Safety
    ///
    /// As [`GlobalAlloc::alloc`].
    #[cold]
    #[inline(never)]
    unsafe fn alloc_reaching(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        // SAFETY: our caller's contract is `A`'s.
        let p = unsafe {
            if zeroed {
                self.inner.alloc_zeroed(layout)
            } else {
                self.inner.alloc(layout)
            }
        };
        if p.is_null() {
            sampler::refund(layout.size());
            return p;
        }
        let points = sampler::points(layout.size(), self.rate);
        if points != 0 {
            record(p, layout.size(), points);
        }
        p
    }

    /// The rest of a reallocation whose old block may be sampled, or whose
    /// new size reaches the pending point (`reached`).
    ///
    /// # Safety
    ///
    /// As [`GlobalAlloc::realloc`].
    #[cold]
    #[inline(never)]
    unsafe fn realloc_sampled(
        &self,
        ptr: *mut u8,
        layout: Layout,
        new_size: usize,
        reached: bool,
    ) -> *mut u8 {
        // A reallocation is the free of the old block and the allocation of
        // the new one (as jemalloc's profiler counts it).
        let old = if live::maybe_sampled(ptr) { live::remove(ptr) } else { None };
        // SAFETY: our caller's contract is `A`'s.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if p.is_null() {
            // The old block stays allocated: back into the table; the new
            // bytes are not counted.
            if let Some(b) = old {
                live::insert(ptr, b);
            }
            if reached {
                sampler::refund(new_size);
            }
            return p;
        }
        if let Some(b) = old {
            stacks::add_free(b.stack, b.objects, b.bytes);
        }
        if reached {
            let points = sampler::points(new_size, self.rate);
            if points != 0 {
                record(p, new_size, points);
            }
        }
        p
    }
}

// SAFETY: every call is passed on to `A` with the caller's arguments
// unchanged, so `A`'s guarantees are ours; the bookkeeping around it never
// touches the blocks' memory.
//
// The fast paths (no sample point reached, block not sampled) end in a tail
// call to `A`: the count is taken before the allocation. An allocation that
// fails on the fast path has its bytes counted all the same (fewer than the
// bytes left to the pending point: the grid shifts by that much); one that
// reaches the point and fails is not counted.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Sampled<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if sampler::charge(layout.size()) {
            // SAFETY: our caller's contract is `A`'s.
            return unsafe { self.inner.alloc(layout) };
        }
        // SAFETY: our caller's contract.
        unsafe { self.alloc_reaching(layout, false) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if sampler::charge(layout.size()) {
            // SAFETY: our caller's contract is `A`'s.
            return unsafe { self.inner.alloc_zeroed(layout) };
        }
        // SAFETY: our caller's contract.
        unsafe { self.alloc_reaching(layout, true) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Out of the table before the allocator may hand the address out again.
        if live::maybe_sampled(ptr) {
            forget(ptr);
        }
        // SAFETY: our caller's contract is `A`'s.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let reached = !sampler::charge(new_size);
        if !(reached | live::maybe_sampled(ptr)) {
            // SAFETY: our caller's contract is `A`'s.
            return unsafe { self.inner.realloc(ptr, layout, new_size) };
        }
        // SAFETY: our caller's contract.
        unsafe { self.realloc_sampled(ptr, layout, new_size, reached) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// The system allocator, failing every allocation while [`FAIL`] is set.
    struct Failing;
    static FAIL: AtomicBool = AtomicBool::new(false);

    // SAFETY: passes everything to System, or returns null (allowed).
    unsafe impl GlobalAlloc for Failing {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            if FAIL.load(Ordering::Relaxed) {
                return std::ptr::null_mut();
            }
            // SAFETY: our caller's contract, passed on.
            unsafe { std::alloc::System.alloc(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            // SAFETY: our caller's contract, passed on.
            unsafe { std::alloc::System.dealloc(p, l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
            if FAIL.load(Ordering::Relaxed) {
                return std::ptr::null_mut();
            }
            // SAFETY: our caller's contract, passed on.
            unsafe { std::alloc::System.realloc(p, l, n) }
        }
    }

    #[test]
    fn a_failed_allocation_past_the_pending_point_is_not_counted() {
        // On a thread of its own: the count is per thread. `FAIL` is read
        // only by this test's allocator.
        std::thread::spawn(|| {
            let s = Sampled::with_rate(Failing, 1 << 20);
            let l = Layout::from_size_align(64, 8).unwrap();
            // Lay the grid; go on until the pending point is at least
            // 4 KiB away (at most a few allocations past a point).
            let q = loop {
                // SAFETY: a valid layout; freed below or kept as `q`.
                let p = unsafe { s.alloc(l) };
                assert!(!p.is_null());
                if sampler::left() >= 4096 {
                    break p;
                }
                // SAFETY: allocated above with `l`.
                unsafe { s.dealloc(p, l) };
            };
            let left = sampler::left();
            FAIL.store(true, Ordering::Relaxed);
            let past = Layout::from_size_align(left as usize + 1, 8).unwrap();
            // SAFETY: a valid layout (the allocator fails it).
            assert!(unsafe { s.alloc(past) }.is_null());
            assert_eq!(sampler::left(), left, "a failed allocation past the point is not counted");
            // SAFETY: `q` was allocated with `l`; the allocator fails the
            // new size and `q` stays allocated.
            assert!(unsafe { s.realloc(q, l, past.size()) }.is_null());
            assert_eq!(sampler::left(), left, "nor a failed reallocation");
            // Short of the point a failed allocation's bytes are counted (the
            // fast path hands over to the allocator without looking back).
            // SAFETY: a valid layout (the allocator fails it).
            assert!(unsafe { s.alloc(l) }.is_null());
            assert_eq!(sampler::left(), left - 64);
            FAIL.store(false, Ordering::Relaxed);
            // SAFETY: `q` is still allocated with `l`.
            unsafe { s.dealloc(q, l) };
        })
        .join()
        .unwrap();
    }

    /// The system allocator, recording the layout of every block it hands
    /// out by address, and panicking if a block is freed or reallocated with
    /// another layout than the one it was allocated with (or is unknown).
    #[derive(Default)]
    struct Checking {
        blocks: std::sync::Mutex<std::collections::HashMap<usize, Layout>>,
    }

    impl Checking {
        fn layout(&self, p: *mut u8) -> Option<Layout> {
            self.blocks.lock().unwrap().get(&(p as usize)).copied()
        }
        fn take(&self, p: *mut u8, l: Layout, what: &str) {
            let had = self.blocks.lock().unwrap().remove(&(p as usize));
            assert_eq!(had, Some(l), "{what} of {p:?} with another layout than its allocation's");
        }
        fn put(&self, p: *mut u8, l: Layout) -> *mut u8 {
            if !p.is_null() {
                assert!(self.blocks.lock().unwrap().insert(p as usize, l).is_none());
            }
            p
        }
        fn real(l: Layout) -> Layout {
            // System is not to be given zero sizes.
            Layout::from_size_align(l.size().max(1), l.align()).unwrap()
        }
    }

    // SAFETY: passes everything to System (zero sizes as one byte, which the
    // caller never reads), with the layout it was given for the block.
    unsafe impl GlobalAlloc for Checking {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            // SAFETY: a valid layout of nonzero size.
            self.put(unsafe { std::alloc::System.alloc(Self::real(l)) }, l)
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            // SAFETY: a valid layout of nonzero size.
            self.put(unsafe { std::alloc::System.alloc_zeroed(Self::real(l)) }, l)
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            self.take(p, l, "dealloc");
            // SAFETY: allocated by System with `real(l)` (checked above).
            unsafe { std::alloc::System.dealloc(p, Self::real(l)) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
            self.take(p, l, "realloc");
            // SAFETY: allocated by System with `real(l)` (checked above);
            // the caller's contract for `n`.
            let q = unsafe { std::alloc::System.realloc(p, Self::real(l), n.max(1)) };
            if q.is_null() {
                self.put(p, l);
                return q;
            }
            self.put(q, Layout::from_size_align(n, l.align()).unwrap())
        }
    }

    fn sampled(p: *mut u8) -> bool {
        live::contains(p)
    }

    /// Whether `p`'s block is sampled; panics unless `A` holds it with the
    /// caller's layout `l` (`Sampled` passes every layout on unchanged).
    fn check_block(s: &Sampled<Checking>, p: *mut u8, l: Layout) -> bool {
        assert_eq!(s.inner().layout(p), Some(l), "a block of the inner allocator, with its caller's layout");
        sampled(p)
    }

    fn fill(p: *mut u8, n: usize, seed: u8) {
        for i in 0..n {
            // SAFETY: `p` holds at least `n` bytes.
            unsafe { *p.add(i) = seed.wrapping_add(i as u8) };
        }
    }

    fn holds(p: *mut u8, n: usize, seed: u8) -> bool {
        // SAFETY: `p` holds at least `n` bytes, all written by `fill`.
        (0..n).all(|i| unsafe { *p.add(i) } == seed.wrapping_add(i as u8))
    }

    #[test]
    fn unsampled_blocks_keep_their_layout() {
        std::thread::spawn(|| {
            // Sampling off: nothing sampled, every call passed on as is.
            let s = Sampled::with_rate(Checking::default(), 0);
            for align in [8usize, 4096, 1 << 16] {
                for size in [0usize, 1, 24, 5000] {
                    let l = Layout::from_size_align(size, align).unwrap();
                    // SAFETY: a valid layout (size 0 only to `Checking`,
                    // which takes it).
                    let p = unsafe { s.alloc(l) };
                    assert!(!check_block(&s, p, l));
                    fill(p, size, 3);
                    // SAFETY: allocated with `l`; a nonzero new size.
                    let q = unsafe { s.realloc(p, l, size + 100) };
                    let l2 = Layout::from_size_align(size + 100, align).unwrap();
                    assert!(!check_block(&s, q, l2) && holds(q, size, 3));
                    // SAFETY: allocated with `l2`.
                    unsafe { s.dealloc(q, l2) };
                }
            }
            assert!(s.inner().blocks.lock().unwrap().is_empty());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn reallocations_across_sample_points_keep_contents_and_layouts() {
        std::thread::spawn(|| {
            // Sizes around the rate: every move between sampled and
            // unsampled blocks, growing and shrinking, each checked.
            let s = Sampled::with_rate(Checking::default(), 8192);
            let mut seen = [[0u32; 2]; 2];
            let mut x = 0x2545_f491_4f6c_dd1du64;
            for round in 0..40 {
                let align = [8usize, 16, 4096][round % 3];
                let mut l = Layout::from_size_align(64, align).unwrap();
                // SAFETY: a valid layout.
                let mut p = unsafe { s.alloc(l) };
                let mut was = check_block(&s, p, l);
                fill(p, l.size(), round as u8);
                for _ in 0..50 {
                    x ^= x >> 12;
                    x ^= x << 25;
                    x ^= x >> 27;
                    let n = 1 + (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as usize % 12_000;
                    // SAFETY: `p` allocated with `l`; `n` nonzero.
                    let q = unsafe { s.realloc(p, l, n) };
                    assert!(!q.is_null());
                    let keep = l.size().min(n);
                    assert!(holds(q, keep, round as u8), "contents kept across a reallocation");
                    l = Layout::from_size_align(n, align).unwrap();
                    let now = check_block(&s, q, l);
                    seen[was as usize][now as usize] += 1;
                    if q != p {
                        assert!(!sampled(p), "a moved block's old address is out of the table");
                    }
                    fill(q, n, round as u8);
                    (p, was) = (q, now);
                }
                // SAFETY: allocated with `l`.
                unsafe { s.dealloc(p, l) };
            }
            assert!(s.inner().blocks.lock().unwrap().is_empty());
            for (i, row) in seen.iter().enumerate() {
                for (j, &k) in row.iter().enumerate() {
                    assert!(k > 0, "sampled {} -> sampled {}: {seen:?}", i == 1, j == 1);
                }
            }
        })
        .join()
        .unwrap();
    }
}
