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

// SAFETY: every call is passed on to `A` with the caller's arguments
// unchanged, so `A`'s guarantees are ours; the bookkeeping around it never
// touches the blocks' memory.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Sampled<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: our caller's contract is `A`'s.
        let p = unsafe { self.inner.alloc(layout) };
        if !p.is_null() {
            let points = sampler::take(layout.size(), self.rate);
            if points != 0 {
                record(p, layout.size(), points);
            }
        }
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: our caller's contract is `A`'s.
        let p = unsafe { self.inner.alloc_zeroed(layout) };
        if !p.is_null() {
            let points = sampler::take(layout.size(), self.rate);
            if points != 0 {
                record(p, layout.size(), points);
            }
        }
        p
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
        // A reallocation is the free of the old block and the allocation of
        // the new one (as jemalloc's profiler counts it).
        let old = if live::maybe_sampled(ptr) { live::remove(ptr) } else { None };
        // SAFETY: our caller's contract is `A`'s.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if p.is_null() {
            // The old block stays allocated: back into the table.
            if let Some(b) = old {
                live::insert(ptr, b);
            }
            return p;
        }
        if let Some(b) = old {
            stacks::add_free(b.stack, b.objects, b.bytes);
        }
        let points = sampler::take(new_size, self.rate);
        if points != 0 {
            record(p, new_size, points);
        }
        p
    }
}
