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
//! decrement; an unsampled free a test of its address's low 12 bits (every
//! sampled block is page-aligned: a small one takes a page of the sampler's
//! pool, a larger one is over-allocated by up to a page and aligned in it),
//! and, for the rare page-aligned one, a load from a small filter of the
//! sampled addresses. A sampled allocation is unwound on the
//! spot with the recorder's framehop tables (the unwinder allocates nothing
//! while walking; it is built by the first sample, with its own allocations
//! passed through unsampled, and rebuilt when libraries are loaded or
//! unloaded), its stack interned in a fixed table, and the block entered in a
//! fixed table of live sampled blocks that `dealloc` and `realloc` update.
//! An allocation made while the same thread is inside the sampler is never
//! sampled. The samples other threads take while the first sample's thread
//! builds the unwinder (about 7 ms of CPU for a 50 MB executable) have no
//! stack: a program that starts many allocating threads at once loses most
//! of their early stacks (measured: 64 threads started together on 2 cores,
//! 98 % of their samples without stack, none with the unwinder built
//! before). Calling [`profile`] once at the start of `main`, before other
//! threads start, builds it there.
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
//! plus the pool of pages for small sampled blocks, taken from the inner
//! allocator 64 KiB at a time as the live small sampled blocks need them and
//! kept, 1 MiB at most ([`POOL_BYTES`]: 256 blocks; past that a small sampled
//! block is over-allocated by a page like a large one), and each sampled
//! block larger than a page holds up to a page more than asked (a page per
//! 512 KiB of live heap at the default rate: under 1 %);
//! plus, once the first sample is taken, the unwinder: eight framehop caches
//! (about 33 KB each) and a copy of the loaded libraries' unwind tables (as
//! the CPU recorder keeps). Beyond the capacities samples are still counted
//! but lose their stack or their in-use tracking ([`stats`] says how many;
//! an untracked block is left out of the in-use figures, which are then a
//! lower bound, rather than kept in them after its free).
//!
//! A heap profile is a state, what is live now and what was allocated since
//! the start, read whole as pprof ([`profile`], `/debug/pprof/heap`,
//! `RecorderBuilder::heap_profile`). A recording holds the samples too only
//! when asked (`RecorderBuilder::heap_events`: each sampled allocation and
//! the free of each sampled block as a tag-10 record, FORMAT.md, handed to
//! the recorder's writer through a lock-free ring of [`EVENT_CAPACITY`]; the
//! Firefox export draws them as native allocations and a memory track);
//! without it a recording made with a `Sampled` allocator stays as it would
//! be without one.
//!
//! Safe with the CPU recorder (its signal handler never allocates; the two
//! share no lock), with `fork` (no lock of its own anywhere: a child forked
//! in the middle of a sample loses at most that sample's slots; the loader's
//! lock is taken only to build the unwinder, once, and a child forked during
//! that build does not redo it: its samples then have no stack), at thread exit and
//! in thread-local destructors (the sampler's thread-locals are `const` and
//! have no destructor), and in signal handlers (an allocation interrupting
//! the sampler on its thread is not sampled; one on an alternate signal
//! stack, `SA_ONSTACK`, or on any stack other than the thread's own, is
//! sampled without its stack: the unwinder needs up to ~18 KiB of stack, and
//! Rust's alternate stacks have 8 KiB; the wrapped allocator must of course
//! be one that may be called there, which glibc's `malloc` is not). Nothing in the sampler waits for another thread, but
//! for a bounded spin (an insert into the live table waits up to 512 spins
//! for a filter bucket that another thread is clearing).
//!
//! On x86-64 Linux with glibc the fast path's count is a thread-local
//! variable of spulse's own with the initial-exec TLS model (three
//! instructions an allocation). Two layouts need
//! `RUSTFLAGS="--cfg spulse_no_tls_slot"` (the count is then a
//! `thread_local!`, a little slower): spulse inside a Rust `dylib` (as Bevy's
//! `dynamic_linking` builds) with the `#[global_allocator]` in another crate,
//! which fails to link with `undefined symbol:
//! spulse_heap_bytes_left_<hash>_in_a_rust_dylib_build_with_cfg_spulse_no_tls_slot`;
//! and processes that load many `cdylib`s each with its own `Sampled` (Python
//! or Node extensions): each takes its whole TLS segment (about 136 bytes)
//! from the static TLS glibc keeps spare for libraries loaded later, and the
//! 13th such library failed to load here ("cannot allocate memory in static
//! TLS block"; `GLIBC_TUNABLES=glibc.rtld.optional_static_tls=N` gives more).

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) mod events;
mod live;
mod pool;
#[cfg(feature = "pprof")]
mod pprof;
mod sampler;
mod stacks;
mod tls;
mod unwind;

#[cfg(feature = "http")]
pub(crate) use pprof::profile_with;
#[cfg(feature = "pprof")]
pub use pprof::{profile, write_profile, HEAP_PATH};
pub use sampler::DEFAULT_RATE;

/// Live sampled blocks the table holds (see the module documentation).
pub const LIVE_CAPACITY: usize = live::CAPACITY;
/// Bytes the pool of page-aligned blocks for small sampled allocations
/// takes from the inner allocator at most (see the module documentation).
pub const POOL_BYTES: usize = pool::MAX_BYTES;
/// Distinct stacks the profile keeps.
pub const STACK_CAPACITY: usize = stacks::CAPACITY;
/// Heap events the sampler's ring holds for the recorder's writer
/// ([`crate::RecorderBuilder::heap_events`]).
pub const EVENT_CAPACITY: usize = events::CAPACITY;
/// Addresses kept per sampled stack (the leaf-most; deeper frames are cut).
pub const STACK_DEPTH: usize = stacks::MAX_DEPTH;

/// The addresses of stack slot `slot` (leaf first) into `out`; false if it
/// has none (the recorder's heap events, `src/recorder/writer/heap.rs`).
pub(crate) fn stack_addrs(slot: u32, out: &mut Vec<u64>) -> bool {
    stacks::addrs(slot, out)
}

static SAMPLES: AtomicU64 = AtomicU64::new(0);
/// The rate of the latest sample (the profile's `period`).
static LAST_RATE: AtomicU64 = AtomicU64::new(DEFAULT_RATE as u64);

/// A [`GlobalAlloc`] that samples the allocations it passes to `A`; see the
/// [module documentation](self).
#[derive(Debug, Default)]
pub struct Sampled<A> {
    inner: A,
    rate: usize,
    /// Where small sampled blocks live.
    pool: pool::Pool,
    /// The fast path's count's offset from the thread pointer, copied here
    /// by this allocator's slow path once learnt (0 until then: the
    /// thread-local's accessor is used). Unused, and 0, where the count is
    /// `tls::slot`'s (x86-64 Linux with glibc).
    offset: tls::OffsetCopy,
}

impl<A> Sampled<A> {
    /// Wrap `inner`, sampling every [`DEFAULT_RATE`] bytes on average.
    pub const fn new(inner: A) -> Sampled<A> {
        Sampled { inner, rate: DEFAULT_RATE, pool: pool::Pool::new(), offset: tls::OffsetCopy::new() }
    }

    /// Wrap `inner`, sampling every `rate` bytes on average (0: never; 1:
    /// every allocation).
    pub const fn with_rate(inner: A, rate: usize) -> Sampled<A> {
        Sampled { inner, rate, pool: pool::Pool::new(), offset: tls::OffsetCopy::new() }
    }

    /// The wrapped allocator.
    pub const fn inner(&self) -> &A {
        &self.inner
    }
}

/// Change the mean sampling interval of every [`Sampled`] allocator at run
/// time (`None`: back to each allocator's own). Each sample is scaled by the
/// rate in effect when it was taken. A thread takes up the new rate at its
/// next sample point, laid at the old rate (as Go's runtime does): up to
/// the old rate's bytes later (64 MiB when sampling was off), and the bytes
/// it allocates until then are counted neither way; so set the rate before
/// the allocations to be measured start, or on threads started after.
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
    /// Sampled blocks not tracked for lack of a table slot: counted in the
    /// allocated figures, and counted freed at once (the in-use figures
    /// leave them out: while the table is full, they are a lower bound).
    pub untracked_blocks: u64,
    /// Samples recorded without their stack (unwinder not built yet or
    /// being rebuilt, all unwinder caches in use, no stack bounds, or an
    /// allocation made off the thread's own stack or with less than 32 KiB
    /// of it left: in a signal handler on an alternate signal stack, on a
    /// coroutine's stack).
    pub without_stack: u64,
    /// Replaced unwinders leaked because a walk was using them.
    pub unwinders_leaked: u64,
    /// Samples whose stack was new when the table of stacks
    /// ([`STACK_CAPACITY`]) had no room for it: counted in the profile
    /// as `[no stack]`.
    pub stack_table_full: u64,
}

/// The sampler's counters now.
pub fn stats() -> Stats {
    Stats {
        samples: SAMPLES.load(Ordering::Relaxed),
        live_blocks: live::live(),
        untracked_blocks: live::dropped(),
        without_stack: unwind::NO_STACK.load(Ordering::Relaxed),
        unwinders_leaked: unwind::LEAKED.load(Ordering::Relaxed),
        stack_table_full: stacks::FULL.load(Ordering::Relaxed),
    }
}

/// What the inlined fast path of `realloc` did with the new size's bytes.
#[derive(Clone, Copy)]
enum Charge {
    /// Nothing: the count's offset is not learnt (the cold path charges them).
    NotYet,
    /// Charged; they reach the pending sample point.
    Reached,
    /// Charged; no sample point (the old block may be sampled).
    Charged,
}

/// The alignment of every sampled block's address.
pub const SAMPLED_ALIGN: usize = 4096;

/// The layout a sampled block of `layout` is allocated with by the inner
/// allocator (and freed with): `layout` grown by enough bytes to hold a
/// [`SAMPLED_ALIGN`]-aligned block of `layout.size()` (`SAMPLED_ALIGN -
/// layout.align()` more; none if `layout` is that aligned already), so that
/// a free whose address is not a multiple of it is known unsampled with one
/// test. `None` if there is no such layout (a size within 4 KiB of
/// `isize::MAX`): such a block is not sampled.
#[inline]
fn sampled_layout(layout: Layout) -> Option<Layout> {
    if layout.align() >= SAMPLED_ALIGN {
        return Some(layout);
    }
    let size = layout.size().checked_add(SAMPLED_ALIGN - layout.align())?;
    Layout::from_size_align(size, layout.align()).ok()
}

/// The aligned address in the inner allocator's block `base` of a
/// [`sampled_layout`], and its offset from `base`.
#[inline]
fn aligned_in(base: *mut u8) -> (*mut u8, u32) {
    let offset = (base as usize).wrapping_neg() & (SAMPLED_ALIGN - 1);
    (base.wrapping_add(offset), offset as u32)
}

/// Whether `p` is aligned as a sampled block is (false: not sampled).
#[inline(always)]
fn aligned_as_sampled(p: *mut u8) -> bool {
    p as usize & (SAMPLED_ALIGN - 1) == 0
}

/// Take a sample of the block `p` of `size` bytes just allocated (from
/// where `tag` says, see [`live::Block::offset`]), which holds `points`
/// sample points; false if the block could not be entered in the table of
/// live blocks (the sample is counted all the same, but the block must not
/// stay where it is: nothing would tell its free so).
#[cold]
#[inline(never)]
fn record(p: *mut u8, size: usize, points: u64, tag: u32) -> bool {
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
        SAMPLES.fetch_add(1, Ordering::Relaxed);
        // The allocation's event first (the block is not the program's
        // yet): its free is an event only if this one went into the ring
        // (not dropped, ring full), and never for the profiler's own
        // threads' blocks, whose allocations are not written (their frees
        // may come from the program's threads, and the other way round).
        let mut e = events::Event::default();
        let mut session = events::session();
        if session != 0 {
            let tid = events::tid();
            e = events::Event {
                time_us: events::now_us(),
                tid,
                stack,
                address: p as u64,
                size: size as u64,
                bytes,
                freed: false,
                session,
            };
            if crate::recorder::is_own_thread(tid) || !events::push(e) {
                session = 0;
            }
        }
        let word = events::tag_stack(stack, session);
        let tracked = live::insert(p, live::Block { bytes, objects, stack: word, offset: tag });
        if !tracked {
            // Its free will not be seen: counted freed now, so that the
            // stack's in-use figures do not keep it forever (a table full
            // for good would otherwise show every later sample as a leak).
            stacks::add_free(stack, objects, bytes);
            if session != 0 {
                e.freed = true;
                events::push(e);
            }
        }
        tracked
    })
    .unwrap_or(false)
}

/// The block at `p` of `size` bytes is about to be given back: its tag if
/// it was sampled (where it came from, [`live::Block::offset`]).
#[cold]
#[inline(never)]
fn forget(p: *mut u8, size: usize) -> Option<u32> {
    let b = live::remove(p)?;
    let (stack, session) = events::untag_stack(b.stack);
    stacks::add_free(stack, b.objects, b.bytes);
    if session != 0 && session == events::session() {
        events::push(events::Event {
            time_us: events::now_us(),
            tid: events::tid(),
            stack,
            address: p as u64,
            size: size as u64,
            bytes: b.bytes,
            freed: true,
            session,
        });
    }
    Some(b.offset)
}

impl<A: GlobalAlloc> Sampled<A> {
    /// # Safety
    ///
    /// As [`GlobalAlloc::alloc`] (`zeroed`: [`GlobalAlloc::alloc_zeroed`]).
    #[inline]
    unsafe fn inner_alloc(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        // SAFETY: our caller's contract is `A`'s.
        unsafe {
            if zeroed {
                self.inner.alloc_zeroed(layout)
            } else {
                self.inner.alloc(layout)
            }
        }
    }

    /// A page-aligned block for a sampled allocation of `layout`, and its
    /// tag for the table of live blocks: a pool page if the block fits one
    /// and the pool has one free ([`pool::TAG`] and the page's index),
    /// else a block of [`sampled_layout`] from `A` (the aligned address's
    /// offset in it). Null if there is none (`layout` too large to grow, or
    /// `A` failed).
    ///
    /// # Safety
    ///
    /// As [`GlobalAlloc::alloc`] (`zeroed`: [`GlobalAlloc::alloc_zeroed`]).
    unsafe fn sampled_alloc(&self, layout: Layout, zeroed: bool) -> (*mut u8, u32) {
        if pool::fits(layout) {
            if let Some((p, tag)) = self.pool.take(&self.inner) {
                if zeroed {
                    // SAFETY: a pool page holds `pool::PAGE` >= `layout.size()`
                    // bytes, ours until given back.
                    unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
                }
                return (p, tag);
            }
        }
        let Some(big) = sampled_layout(layout) else {
            return (std::ptr::null_mut(), 0);
        };
        // SAFETY: `big` is a valid layout of nonzero size.
        let base = unsafe { self.inner_alloc(big, zeroed) };
        if base.is_null() {
            return (base, 0);
        }
        aligned_in(base)
    }

    /// Give back a block of [`sampled_alloc`](Self::sampled_alloc) for
    /// `layout` at `p` with `tag`.
    ///
    /// # Safety
    ///
    /// `p` and `tag` from `sampled_alloc(layout, _)`, not given back yet.
    unsafe fn sampled_free(&self, p: *mut u8, layout: Layout, tag: u32) {
        if tag & pool::TAG != 0 {
            self.pool.give(tag);
        } else {
            // SAFETY: `A` gave `p - tag` with `sampled_layout(layout)` (which
            // existed then).
            unsafe { self.inner.dealloc(p.sub(tag as usize), sampled_layout(layout).unwrap_or(layout)) }
        }
    }

    /// The rest of an allocation that did not take the fast path: its bytes
    /// were `charged` and reach the pending sample point, or (the count's
    /// offset not learnt) they are charged here. One call site in the
    /// inlined fast path: it keeps the code small where the program
    /// allocates (a larger one made the compiler move `Vec`'s allocation out
    /// of a program's loop, BENCHMARKS.md).
    ///
    /// # Safety
    ///
    /// As [`GlobalAlloc::alloc`].
    #[cold]
    #[inline(never)]
    unsafe fn alloc_cold(&self, layout: Layout, charged: bool) -> *mut u8 {
        if !charged && sampler::charge(&self.offset, layout.size()) {
            // SAFETY: our caller's contract is `A`'s.
            return unsafe { self.inner.alloc(layout) };
        }
        // SAFETY: our caller's contract.
        unsafe { self.alloc_reaching(layout, false) }
    }

    /// [`alloc_cold`](Self::alloc_cold) for `alloc_zeroed`.
    ///
    /// # Safety
    ///
    /// As [`GlobalAlloc::alloc_zeroed`].
    #[cold]
    #[inline(never)]
    unsafe fn alloc_zeroed_cold(&self, layout: Layout, charged: bool) -> *mut u8 {
        if !charged && sampler::charge(&self.offset, layout.size()) {
            // SAFETY: our caller's contract is `A`'s.
            return unsafe { self.inner.alloc_zeroed(layout) };
        }
        // SAFETY: our caller's contract.
        unsafe { self.alloc_reaching(layout, true) }
    }

    /// The rest of a reallocation that did not take the fast path (see
    /// [`Charge`]): its old block may be sampled, or its new size reaches the
    /// pending point.
    ///
    /// # Safety
    ///
    /// As [`GlobalAlloc::realloc`].
    #[cold]
    #[inline(never)]
    #[allow(clippy::nonminimal_bool)] // reads as the two fast-path conditions
    unsafe fn realloc_cold(&self, ptr: *mut u8, layout: Layout, new_size: usize, charge: Charge) -> *mut u8 {
        let reached = match charge {
            Charge::NotYet => !sampler::charge(&self.offset, new_size),
            Charge::Reached => true,
            Charge::Charged => false,
        };
        if !reached && !(aligned_as_sampled(ptr) && live::maybe_sampled(ptr)) {
            // SAFETY: our caller's contract is `A`'s (the block is not sampled).
            return unsafe { self.inner.realloc(ptr, layout, new_size) };
        }
        // SAFETY: our caller's contract.
        unsafe { self.realloc_sampled(ptr, layout, new_size, reached) }
    }

    /// The rest of an allocation whose bytes reach this thread's pending
    /// sample point ([`sampler::charge`] said so): count the points, then
    /// allocate (a sampled block page-aligned, [`sampled_alloc`](Self::sampled_alloc)) and sample.
    ///
    /// # Safety
    ///
    /// As [`GlobalAlloc::alloc`].
    #[cold]
    #[inline(never)]
    unsafe fn alloc_reaching(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        let saved = sampler::save();
        let points = sampler::points(layout.size(), self.rate);
        // (`points` learnt the offset if this is the process's first.)
        self.offset.refresh();
        // SAFETY: our caller's contract (`sampled_alloc`'s is `A`'s).
        let (p, tag) = unsafe {
            if points == 0 {
                (self.inner_alloc(layout, zeroed), u32::MAX)
            } else {
                self.sampled_alloc(layout, zeroed)
            }
        };
        if p.is_null() {
            sampler::restore(saved);
            sampler::refund(layout.size());
            return p;
        }
        if points == 0 {
            // A thread's first allocation (or one of the sampler's own):
            // the process's first builds the unwinder now, before threads
            // sample together (those that sample while it is built go
            // without their stacks: most of a short multi-threaded program's
            // samples did).
            if sampler::rate(self.rate) != 0 {
                unwind::build_early();
            }
            return p;
        }
        if record(p, layout.size(), points, tag) {
            return p;
        }
        // Not tracked (no table slot): a block of the caller's layout instead.
        // SAFETY: `p`, `tag` from `sampled_alloc(layout)` just above; `layout`
        // is our caller's.
        unsafe {
            self.sampled_free(p, layout, tag);
            self.inner_alloc(layout, zeroed)
        }
    }

    /// The rest of a free whose block is aligned as a sampled one and whose
    /// filter bucket is set: the table says whether it was sampled, and so
    /// where it came from.
    ///
    /// The block comes first (and the allocator last): where the program
    /// frees, it is then in the register that both this call and `A`'s
    /// `dealloc` take it in.
    ///
    /// # Safety
    ///
    /// As [`GlobalAlloc::dealloc`].
    #[cold]
    #[inline(never)]
    unsafe fn dealloc_sampled(ptr: *mut u8, layout: Layout, this: &Self) {
        // Out of the table before the allocator may hand the address out again.
        match forget(ptr, layout.size()) {
            // SAFETY: a sampled block, from `sampled_alloc(layout)` with `tag`.
            Some(tag) => unsafe { this.sampled_free(ptr, layout, tag) },
            // SAFETY: our caller's contract is `A`'s (not sampled).
            None => unsafe { this.inner.dealloc(ptr, layout) },
        }
    }

    /// The rest of a reallocation whose old block may be sampled, or whose
    /// new size reaches the pending point (`reached`). A reallocation is the
    /// free of the old block and the allocation of the new one (as
    /// jemalloc's profiler counts it); one from or to a sampled block is a
    /// move (allocate, copy, free), as the two come from different places.
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
        // SAFETY: `GlobalAlloc::realloc`'s contract: `new_size` rounded up to
        // `layout.align()` does not overflow `isize`, and it is not zero.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        let old_tag =
            if aligned_as_sampled(ptr) && live::maybe_sampled(ptr) { live::offset_of(ptr) } else { None };
        let saved = sampler::save();
        let points = if reached { sampler::points(new_size, self.rate) } else { 0 };
        self.offset.refresh();
        // Whether a failure is to give this reallocation's bytes back.
        let mut undo = reached;
        let fail = |undo: bool| {
            if undo {
                sampler::restore(saved);
                sampler::refund(new_size);
            }
            std::ptr::null_mut()
        };
        let keep = layout.size().min(new_size);
        if points != 0 {
            // SAFETY: a valid layout of nonzero size.
            let (q, tag) = unsafe { self.sampled_alloc(new_layout, false) };
            if !q.is_null() {
                // SAFETY: `ptr` holds `layout.size()` bytes, `q` `new_size`;
                // two distinct live blocks.
                unsafe { std::ptr::copy_nonoverlapping(ptr, q, keep) };
                if record(q, new_size, points, tag) {
                    match old_tag {
                        Some(old) => {
                            forget(ptr, layout.size());
                            // SAFETY: sampled, from `sampled_alloc(layout)`.
                            unsafe { self.sampled_free(ptr, layout, old) };
                        }
                        // SAFETY: our caller's contract: `A` gave `ptr` with `layout`.
                        None => unsafe { self.inner.dealloc(ptr, layout) },
                    }
                    return q;
                }
                // Not tracked: a block of the caller's layout instead (below);
                // the sample is counted.
                // SAFETY: from `sampled_alloc(new_layout)` just above.
                unsafe { self.sampled_free(q, new_layout, tag) };
                undo = false;
            } else {
                // `A` failed (or the size is within a page of `isize::MAX`).
                return fail(undo);
            }
        }
        let Some(old) = old_tag else {
            // SAFETY: our caller's contract is `A`'s.
            let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
            return if p.is_null() { fail(undo) } else { p };
        };
        // A sampled block to an unsampled one.
        // SAFETY: a valid layout of nonzero size.
        let q = unsafe { self.inner.alloc(new_layout) };
        if q.is_null() {
            // The old block stays, and stays in the table.
            return fail(undo);
        }
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(ptr, q, keep) };
        forget(ptr, layout.size());
        // SAFETY: sampled, from `sampled_alloc(layout)` with `old`.
        unsafe { self.sampled_free(ptr, layout, old) };
        q
    }
}

// The fast paths (no sample point reached, block not sampled) end in a tail
// call to `A`: the count is taken before the allocation. An allocation that
// fails on the fast path has its bytes counted all the same (fewer than the
// bytes left to the pending point: the grid shifts by that much); one that
// reaches the point and fails is not counted.

// How sampled blocks are kept: page-aligned (so aligned as the caller
// asked), either a page of the pool (a block of `A`'s the pool keeps, for a
// layout that fits a page) or a grown layout's block of `A`
// (`sampled_layout`) holding the caller's at a recorded offset, given back
// to the pool or to `A` at that offset with that same grown layout. The table
// of live blocks says which blocks are sampled: a sampled block is handed
// out only once it is in the table, and taken out of it only just before it
// is given back. The bookkeeping never touches the blocks' memory, except the
// zeroing of a pool page for `alloc_zeroed` and the copy of a reallocation
// that moves a block to or from a sampled one.

// SAFETY: every call is passed on to `A` with the caller's arguments, except
// for sampled blocks, kept as said just above: `A`'s guarantees are ours.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Sampled<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        tls::charge_or!(self.offset, layout.size(), |charged| {
            // SAFETY: our caller's contract.
            unsafe { self.alloc_cold(layout, charged) }
        });
        // SAFETY: our caller's contract is `A`'s.
        unsafe { self.inner.alloc(layout) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        tls::charge_or!(self.offset, layout.size(), |charged| {
            // SAFETY: our caller's contract.
            unsafe { self.alloc_zeroed_cold(layout, charged) }
        });
        // SAFETY: our caller's contract is `A`'s.
        unsafe { self.inner.alloc_zeroed(layout) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // A block not aligned as sampled ones are (nearly all) is not
        // sampled; of the others, the filter tells most.
        if aligned_as_sampled(ptr) && live::maybe_sampled(ptr) {
            // SAFETY: our caller's contract.
            return unsafe { Self::dealloc_sampled(ptr, layout, self) };
        }
        // SAFETY: our caller's contract is `A`'s (the block is not sampled).
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let charge = if let Some(left) = tls::try_sub(&self.offset, new_size) {
            if left >= 0 && !aligned_as_sampled(ptr) {
                // SAFETY: our caller's contract is `A`'s (the block is not sampled).
                return unsafe { self.inner.realloc(ptr, layout, new_size) };
            }
            if left < 0 {
                Charge::Reached
            } else {
                Charge::Charged
            }
        } else {
            Charge::NotYet
        };
        // SAFETY: our caller's contract.
        unsafe { self.realloc_cold(ptr, layout, new_size, charge) }
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
            // The slow paths above copied the learnt offset into the
            // allocator: its fast path reads the count without the accessor.
            assert_eq!(s.offset.get(), tls::offset());
            if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) && !tls::SLOT {
                assert_ne!(s.offset.get(), 0, "the offset is learnt in a test executable");
            }
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
        live::offset_of(p).is_some()
    }

    /// Whether `p`'s block with `A` has the layout a block of `l` has when
    /// it is sampled (`true`: grown, `p` aligned in it) or not (`false`: at
    /// `p`, the caller's); panics if neither.
    fn check_block(s: &Sampled<Checking>, p: *mut u8, l: Layout) -> bool {
        if let Some(offset) = live::offset_of(p) {
            assert!(aligned_as_sampled(p), "{p:?}: a sampled block is 4096-aligned");
            if offset & pool::TAG != 0 {
                assert!(pool::fits(l), "{l:?} from the pool");
                assert!(s.pool.holds(p, offset), "{p:?}: the pool's page of its tag");
                return true;
            }
            let base = p.wrapping_sub(offset as usize);
            let with_a = s.inner().layout(base).expect("a block of the inner allocator");
            assert_eq!(with_a, sampled_layout(l).unwrap());
            assert!(offset as usize + l.size() <= with_a.size());
            true
        } else {
            assert_eq!(s.inner().layout(p), Some(l), "an unsampled block has its caller's layout");
            false
        }
    }

    /// Every block freed: the inner allocator holds only the pool's chunks,
    /// and no pool page is in use.
    fn assert_only_the_pool_left(s: &Sampled<Checking>) {
        let mut left: Vec<(usize, Layout)> =
            s.inner().blocks.lock().unwrap().iter().map(|(&p, &l)| (p, l)).collect();
        let mut chunks = s.pool.chunks();
        left.sort_unstable_by_key(|b| b.0);
        chunks.sort_unstable_by_key(|b| b.0);
        assert_eq!(left, chunks, "blocks of the inner allocator left, besides the pool's chunks");
        assert_eq!(s.pool.in_use(), 0, "pool pages in use");
    }

    fn holds_zeroes(p: *mut u8, n: usize) -> bool {
        // SAFETY: `p` holds at least `n` bytes, initialized.
        unsafe { std::slice::from_raw_parts(p, n) }.iter().all(|&b| b == 0)
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
    fn sampled_blocks_are_page_aligned_and_freed_with_their_layout() {
        std::thread::spawn(|| {
            // Rate 1: every allocation of at least a byte is sampled.
            let s = Sampled::with_rate(Checking::default(), 1);
            let mut blocks = Vec::new();
            for (i, size) in [1usize, 7, 16, 24, 100, 4095, 4096, 4097, 70_000].into_iter().enumerate() {
                for align in [1usize, 8, 16, 64, 4096, 8192, 1 << 16] {
                    let l = Layout::from_size_align(size, align).unwrap();
                    // SAFETY: a valid layout of nonzero size.
                    let p = unsafe {
                        if i % 2 == 0 {
                            s.alloc(l)
                        } else {
                            s.alloc_zeroed(l)
                        }
                    };
                    assert!(!p.is_null());
                    assert!(check_block(&s, p, l), "{l:?}: sampled at rate 1");
                    assert_eq!(p as usize % align, 0);
                    if i % 2 == 1 {
                        // SAFETY: `p` holds `size` bytes, zeroed by `alloc_zeroed`.
                        let bytes = unsafe { std::slice::from_raw_parts(p, size) };
                        assert!(bytes.iter().all(|&b| b == 0));
                    }
                    blocks.push((p, l));
                }
            }
            for (p, l) in blocks {
                // SAFETY: allocated above with `l`.
                unsafe { s.dealloc(p, l) };
                assert!(!sampled(p));
            }
            assert_only_the_pool_left(&s);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn unsampled_blocks_keep_their_layout_even_page_aligned_ones() {
        std::thread::spawn(|| {
            // Sampling off: nothing sampled, every call passed on as is
            // (page-aligned blocks pass the alignment test and are told by
            // the filter and the table).
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
            assert_only_the_pool_left(&s);
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
            assert_only_the_pool_left(&s);
            for (i, row) in seen.iter().enumerate() {
                for (j, &k) in row.iter().enumerate() {
                    assert!(k > 0, "sampled {} -> sampled {}: {seen:?}", i == 1, j == 1);
                }
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_sampled_block_the_table_refuses_has_its_callers_layout() {
        std::thread::spawn(|| {
            let s = Sampled::with_rate(Checking::default(), 1);
            let l = Layout::from_size_align(300, 16).unwrap();
            let before = stats();
            live::REFUSE.with(|r| r.set(true));
            // SAFETY: a valid layout.
            let p = unsafe { s.alloc(l) };
            assert!(!check_block(&s, p, l), "not tracked, so not over-aligned");
            // SAFETY: a valid layout.
            let z = unsafe { s.alloc_zeroed(l) };
            assert!(!check_block(&s, z, l));
            fill(p, 300, 9);
            // SAFETY: allocated with `l`; nonzero.
            let q = unsafe { s.realloc(p, l, 5000) };
            let l2 = Layout::from_size_align(5000, 16).unwrap();
            assert!(!check_block(&s, q, l2) && holds(q, 300, 9));
            live::REFUSE.with(|r| r.set(false));
            let after = stats();
            assert!(after.samples - before.samples >= 3, "still counted as samples");
            assert!(after.untracked_blocks - before.untracked_blocks >= 3);
            // A tracked one reallocated while the table refuses its new block.
            // SAFETY: allocated with `l2`; a valid layout.
            let r = unsafe { s.realloc(q, l2, 200) };
            let l3 = Layout::from_size_align(200, 16).unwrap();
            assert!(check_block(&s, r, l3));
            fill(r, 200, 4);
            live::REFUSE.with(|x| x.set(true));
            // SAFETY: allocated with `l3`; nonzero.
            let t = unsafe { s.realloc(r, l3, 100) };
            live::REFUSE.with(|x| x.set(false));
            let l4 = Layout::from_size_align(100, 16).unwrap();
            assert!(!check_block(&s, t, l4) && holds(t, 100, 4) && !sampled(r));
            // SAFETY: allocated with these layouts.
            unsafe {
                s.dealloc(t, l4);
                s.dealloc(z, l);
            }
            assert_only_the_pool_left(&s);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn small_sampled_blocks_take_pool_pages_up_to_the_bound_then_grown_blocks() {
        std::thread::spawn(|| {
            let s = Sampled::with_rate(Checking::default(), 1);
            let pages = pool::CHUNKS * pool::CHUNK_PAGES;
            let l = Layout::from_size_align(48, 16).unwrap();
            let mut blocks = Vec::new();
            // Blocks by where they came from: the pool, grown, not tracked (a
            // bucket of the filter being cleared by another test's thread for
            // too long: rare, allowed; each checked with its caller's layout).
            let mut seen = [0usize; 3];
            for i in 0..pages + 40 {
                // SAFETY: a valid layout.
                let p = unsafe {
                    if i % 3 == 0 {
                        s.alloc_zeroed(l)
                    } else {
                        s.alloc(l)
                    }
                };
                let tracked = check_block(&s, p, l);
                if i % 3 == 0 {
                    assert!(holds_zeroes(p, 48), "a pool page zeroed for alloc_zeroed");
                }
                let from_pool = live::offset_of(p).is_some_and(|t| t & pool::TAG != 0);
                let kind = if !tracked {
                    2
                } else if from_pool {
                    0
                } else {
                    1
                };
                assert!(kind != 0 || seen[1] == 0, "block {i}: the pool's pages first");
                seen[kind] += 1;
                fill(p, 48, i as u8);
                blocks.push(p);
            }
            assert_eq!(seen[0], pages, "every pool page taken, then grown blocks: {seen:?}");
            assert!(seen[2] <= 4, "{seen:?}");
            assert_eq!(s.pool.chunks().len(), pool::CHUNKS);
            assert_eq!(s.pool.chunks().len() * pool::CHUNK_PAGES * pool::PAGE, pool::MAX_BYTES);
            // Reallocations within and out of the pool keep the contents.
            for (i, p) in blocks.iter_mut().enumerate() {
                assert!(holds(*p, 48, i as u8), "block {i} kept its contents");
                let n = [40usize, 4096, 5000][i % 3];
                // SAFETY: allocated with `l`; nonzero.
                let q = unsafe { s.realloc(*p, l, n) };
                let l2 = Layout::from_size_align(n, 16).unwrap();
                check_block(&s, q, l2);
                assert!(holds(q, 40, i as u8));
                // SAFETY: allocated with `l2`.
                unsafe { s.dealloc(q, l2) };
                // Freed pages are taken again (the pool does not grow).
                // SAFETY: a valid layout.
                *p = unsafe { s.alloc(l) };
                check_block(&s, *p, l);
                fill(*p, 48, i as u8);
            }
            assert_eq!(s.pool.chunks().len(), pool::CHUNKS);
            for (i, p) in blocks.into_iter().enumerate() {
                assert!(holds(p, 48, i as u8));
                // SAFETY: allocated with `l`.
                unsafe { s.dealloc(p, l) };
            }
            assert_only_the_pool_left(&s);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn threads_sampling_at_once_never_share_a_pool_page() {
        let s: &'static Sampled<Checking> = Box::leak(Box::new(Sampled::with_rate(Checking::default(), 1)));
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                std::thread::spawn(move || {
                    let mut live = std::collections::VecDeque::new();
                    let mut untracked = 0;
                    for i in 0..3000usize {
                        let size = 1 + (i * 37 + t as usize * 11) % 4096;
                        let l = Layout::from_size_align(size, 8).unwrap();
                        // SAFETY: a valid layout.
                        let p = unsafe { s.alloc(l) };
                        // Not tracked: a filter bucket being cleared by
                        // another thread for too long (rare, allowed).
                        untracked += !check_block(s, p, l) as usize;
                        let seed = t.wrapping_mul(61).wrapping_add(i as u8);
                        fill(p, size, seed);
                        live.push_back((p, l, seed));
                        if live.len() > 20 {
                            let (p, l, seed) = live.pop_front().unwrap();
                            assert!(holds(p, l.size(), seed), "thread {t}: a block overwritten");
                            // SAFETY: allocated with `l`.
                            unsafe { s.dealloc(p, l) };
                        }
                    }
                    assert!(untracked <= 30, "thread {t}: {untracked} of 3,000 blocks not tracked");
                    for (p, l, seed) in live {
                        assert!(holds(p, l.size(), seed));
                        // SAFETY: allocated with `l`.
                        unsafe { s.dealloc(p, l) };
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_only_the_pool_left(s);
        // 84 blocks live at most (6 chunks' worth; a chunk is added only
        // when a scan found those before it full).
        assert!(s.pool.chunks().len() <= 8, "{} chunks", s.pool.chunks().len());
    }
}
