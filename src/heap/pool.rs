//! The pool of page-aligned blocks that small sampled allocations are served
//! from.
//!
//! Every sampled block is page-aligned (so that a free whose address is not
//! is known unsampled with one test, see [`super::SAMPLED_ALIGN`]). A small
//! sampled block (at most a page, aligned to at most a page) takes one
//! page of this pool instead of an aligned or over-allocated block of the
//! inner allocator's: glibc serves `posix_memalign(4096, small)` and a 4 KiB+
//! block from its bins, not its per-thread cache (the first made each
//! sample about 0.9 us dearer, the second cost 0.35 ns a malloc/free pair on
//! one thread; BENCHMARKS.md, "Heap profiles").
//!
//! The pool holds up to [`CHUNKS`] chunks of [`CHUNK_PAGES`] pages (64 KiB
//! each, 1 MiB in all), each allocated from the inner allocator the first
//! time a sample finds the chunks before it full, and kept for the
//! allocator's lifetime (a global allocator's: the program's). Which pages
//! are in use is one bit each in a word per chunk, claimed and given back
//! with atomic operations: no lock, nothing that waits, safe in a forked
//! child (a page claimed by a thread of the parent that was in the middle
//! of a sample stays claimed) and at thread exit. A sample that finds a
//! chunk being allocated by another thread does without the pool (so that
//! two threads do not add two chunks at once); a chunk being allocated when
//! the process forks stays so in the child, which then uses the chunks
//! before it only. When every page is
//! taken (more than 256 small sampled blocks live: at the default rate
//! some 128 MiB of small blocks live, or many threads sampling at once) a
//! sampled block is over-allocated from the inner allocator instead.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A page, the size and alignment of a pool block.
pub(crate) const PAGE: usize = 4096;
/// Pages in a chunk.
pub(crate) const CHUNK_PAGES: usize = 16;
/// Chunks in the pool at most.
pub(crate) const CHUNKS: usize = 16;
/// Bytes the pool takes from the inner allocator at most.
pub(crate) const MAX_BYTES: usize = CHUNKS * CHUNK_PAGES * PAGE;

/// `base` of a chunk not allocated yet.
const NONE: usize = 0;
/// `base` of a chunk being allocated.
const GROWING: usize = 1;
/// `used` of a chunk with every page taken.
const FULL: u64 = (1 << CHUNK_PAGES) - 1;

/// The mark of a pool block's tag (the others are offsets below a page).
pub(crate) const TAG: u32 = 1 << 31;

fn chunk_layout() -> Layout {
    // A valid layout: a power-of-two alignment, a small size.
    Layout::from_size_align(CHUNK_PAGES * PAGE, PAGE).unwrap()
}

/// Whether a block of `layout` fits a pool page.
#[inline]
pub(crate) fn fits(layout: Layout) -> bool {
    layout.size() <= PAGE && layout.align() <= PAGE
}

#[derive(Default)]
pub(crate) struct Pool {
    /// Each chunk's address ([`NONE`], [`GROWING`]).
    base: [AtomicUsize; CHUNKS],
    /// Each chunk's pages in use, one bit each.
    used: [AtomicU64; CHUNKS],
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pages: u32 = self.used.iter().map(|u| u.load(Ordering::Relaxed).count_ones()).sum();
        f.debug_struct("Pool").field("pages_in_use", &pages).finish()
    }
}

impl Pool {
    pub(crate) const fn new() -> Pool {
        Pool { base: [const { AtomicUsize::new(NONE) }; CHUNKS], used: [const { AtomicU64::new(0) }; CHUNKS] }
    }

    /// A free page and its tag, taking a new chunk from `a` if those before
    /// it are full; `None` if the pool is full (or `a` failed).
    pub(crate) fn take<A: GlobalAlloc>(&self, a: &A) -> Option<(*mut u8, u32)> {
        for c in 0..CHUNKS {
            let base = self.base[c].load(Ordering::Acquire);
            if base == NONE {
                if self.base[c].compare_exchange(NONE, GROWING, Ordering::Relaxed, Ordering::Relaxed).is_err()
                {
                    continue;
                }
                // SAFETY: a valid layout of nonzero size.
                let p = unsafe { a.alloc(chunk_layout()) };
                if p.is_null() {
                    self.base[c].store(NONE, Ordering::Release);
                    return None;
                }
                // The first page is ours before anyone else sees the chunk.
                self.used[c].store(1, Ordering::Relaxed);
                self.base[c].store(p as usize, Ordering::Release);
                return Some((p, TAG | (c * CHUNK_PAGES) as u32));
            }
            if base == GROWING {
                // Another thread is adding this chunk: rather than add the
                // next one too, this sample does without the pool.
                return None;
            }
            let used = &self.used[c];
            let mut u = used.load(Ordering::Relaxed);
            while u != FULL {
                let i = (!u).trailing_zeros() as usize;
                match used.compare_exchange_weak(u, u | 1 << i, Ordering::Acquire, Ordering::Relaxed) {
                    Ok(_) => return Some(((base + i * PAGE) as *mut u8, TAG | (c * CHUNK_PAGES + i) as u32)),
                    Err(now) => u = now,
                }
            }
        }
        None
    }

    /// Give back the page of `tag` (from [`take`](Self::take)).
    pub(crate) fn give(&self, tag: u32) {
        let n = (tag & !TAG) as usize;
        let (c, i) = (n / CHUNK_PAGES, n % CHUNK_PAGES);
        self.used[c].fetch_and(!(1 << i), Ordering::Release);
    }

    /// Pages in use now.
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> u32 {
        self.used.iter().map(|u| u.load(Ordering::Relaxed).count_ones()).sum()
    }

    /// The chunks' addresses and layout (tests: the blocks of the inner
    /// allocator the pool keeps).
    #[cfg(test)]
    pub(crate) fn chunks(&self) -> Vec<(usize, Layout)> {
        self.base
            .iter()
            .map(|b| b.load(Ordering::Acquire))
            .filter(|&b| b > GROWING)
            .map(|b| (b, chunk_layout()))
            .collect()
    }

    /// Whether `p` is the page of `tag` (tests).
    #[cfg(test)]
    pub(crate) fn holds(&self, p: *mut u8, tag: u32) -> bool {
        let n = (tag & !TAG) as usize;
        let (c, i) = (n / CHUNK_PAGES, n % CHUNK_PAGES);
        let base = self.base[c].load(Ordering::Acquire);
        base > GROWING && base + i * PAGE == p as usize
    }
}
