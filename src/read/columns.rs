//! The sample columns of a [`Snapshot`](super::Snapshot).
//!
//! Samples are kept column-wise (timestamp, thread, stack) in one or more
//! [`Block`]s: one per thread that decoded a part of the file
//! (`parallel.rs`), so the second thread of a two-thread load writes its
//! samples straight to their final place and nothing is copied afterwards.
//!
//! A block stores each timestamp as an offset from the block's origin. It
//! starts narrow, 10 bytes per sample: 4-byte offsets (from 4.5 minutes before
//! the time the block starts at to 67 minutes after it) and 2-byte thread ids. The first
//! sample that does not fit widens the block, once, to 8-byte offsets and
//! 4-byte thread ids (16 bytes per sample). Memory written while loading is
//! most of the cost of loading a large spool (the kernel zeroes every fresh
//! page first), so the narrow form loads faster as well as smaller.

use std::mem::MaybeUninit;

use super::snapshot::advise_huge_pages;
use crate::format::{Sample, StackId, ThreadId};

/// How far before the time a block starts at its origin lies: narrow offsets
/// cover `[start - BIAS, start + 2^32 - BIAS)` microseconds, from 4.5 minutes
/// before (samples of different threads arrive slightly out of order) to 67
/// minutes after.
const BIAS: u64 = 1 << 28;

/// One column per field.
#[derive(Debug, Clone)]
pub(crate) struct Cols<O, T> {
    offs: Vec<O>,
    threads: Vec<T>,
    stacks: Vec<u32>,
}

impl<O, T> Cols<O, T> {
    fn with_capacity(n: usize) -> Self {
        let mut c = Cols {
            offs: Vec::with_capacity(n),
            threads: Vec::with_capacity(n),
            stacks: Vec::with_capacity(n),
        };
        advise_huge_pages(&mut c.offs);
        advise_huge_pages(&mut c.threads);
        advise_huge_pages(&mut c.stacks);
        c
    }

    fn truncate(&mut self, n: usize) {
        self.offs.truncate(n);
        self.threads.truncate(n);
        self.stacks.truncate(n);
    }

    fn shrink_to_fit(&mut self) {
        self.offs.shrink_to_fit();
        self.threads.shrink_to_fit();
        self.stacks.shrink_to_fit();
    }
}

/// The two column layouts of a block.
pub(crate) trait Layout {
    /// A timestamp offset.
    type Off: Copy;
    /// A thread id.
    type Thread: Copy;
    /// `off` and `thread` in this layout, if they fit.
    fn narrow(off: u64, thread: u32) -> Option<(Self::Off, Self::Thread)>;
}

/// 4-byte offsets and 2-byte thread ids.
pub(crate) enum NarrowLayout {}
/// 8-byte offsets and 4-byte thread ids: everything fits.
pub(crate) enum WideLayout {}

impl Layout for NarrowLayout {
    type Off = u32;
    type Thread = u16;
    #[inline(always)]
    fn narrow(off: u64, thread: u32) -> Option<(u32, u16)> {
        match (u32::try_from(off), u16::try_from(thread)) {
            (Ok(o), Ok(t)) => Some((o, t)),
            _ => None,
        }
    }
}

impl Layout for WideLayout {
    type Off = u64;
    type Thread = u32;
    #[inline(always)]
    fn narrow(off: u64, thread: u32) -> Option<(u64, u32)> {
        Some((off, thread))
    }
}

/// Writes samples into a block's spare capacity. It lives on the decoding
/// loop's stack, so its count and slices stay in registers (pushing to the
/// block's vectors one by one keeps their lengths in memory, which was a
/// third of the decoding loop's time); the block's lengths are set once, when
/// [`Block::fill`] returns.
pub(crate) struct Filler<'a, L: Layout> {
    origin: u64,
    offs: &'a mut [MaybeUninit<L::Off>],
    threads: &'a mut [MaybeUninit<L::Thread>],
    stacks: &'a mut [MaybeUninit<u32>],
    n: usize,
}

impl<'a, L: Layout> Filler<'a, L> {
    fn new(origin: u64, cols: &'a mut Cols<L::Off, L::Thread>) -> Self {
        let offs = cols.offs.spare_capacity_mut();
        let threads = cols.threads.spare_capacity_mut();
        let stacks = cols.stacks.spare_capacity_mut();
        // One length for all three, so one comparison guards each write.
        let m = offs.len().min(threads.len()).min(stacks.len());
        Filler { origin, offs: &mut offs[..m], threads: &mut threads[..m], stacks: &mut stacks[..m], n: 0 }
    }

    /// Write a sample taken at `time_us`; `false` (and nothing written) if it
    /// does not fit this layout or the capacity is used up: the caller then
    /// hands it to [`Block::push`] once the fill is over.
    #[inline(always)]
    pub(crate) fn put(&mut self, time_us: u64, thread: u32, stack: u32) -> bool {
        let n = self.n;
        match L::narrow(time_us.wrapping_sub(self.origin), thread) {
            Some((o, t)) if n < self.offs.len() => {
                self.offs[n].write(o);
                self.threads[n].write(t);
                self.stacks[n].write(stack);
                self.n = n + 1;
                true
            }
            _ => false,
        }
    }
}

/// A decoding loop run by [`Block::fill`] in whichever layout the block has.
pub(crate) trait Fill {
    /// What the loop returns.
    type Out;
    /// Decode into `w` until done or until a sample does not fit.
    fn run<L: Layout>(&mut self, w: &mut Filler<'_, L>) -> Self::Out;
}

fn fill_cols<L: Layout, F: Fill>(origin: u64, cols: &mut Cols<L::Off, L::Thread>, f: &mut F) -> F::Out {
    let mut w = Filler::<L>::new(origin, cols);
    let out = f.run(&mut w);
    let n = w.n;
    let len = cols.offs.len() + n;
    // SAFETY: the filler wrote elements 0..n of each column's spare capacity
    // (`put` writes all three at index `n` before counting it), so the first
    // `len` elements of each vector are initialized, and `len` is within the
    // capacity because the spare slices were.
    unsafe {
        cols.offs.set_len(len);
        cols.threads.set_len(len);
        cols.stacks.set_len(len);
    }
    out
}

/// A block's columns, narrow until a sample does not fit.
#[derive(Debug, Clone)]
enum Width {
    Narrow(Cols<u32, u16>),
    Wide(Cols<u64, u32>),
}

/// A run of consecutive samples, column-wise; a sample's timestamp is
/// `origin + offset` (wrapping).
#[derive(Debug, Clone)]
pub(crate) struct Block {
    origin: u64,
    cols: Width,
}

impl Block {
    /// An empty block for samples from about `start_us` on, with room for
    /// `capacity` samples (address space only: pages are touched as samples
    /// are written).
    pub(crate) fn new(start_us: u64, capacity: usize) -> Block {
        Block { origin: start_us.wrapping_sub(BIAS), cols: Width::Narrow(Cols::with_capacity(capacity)) }
    }

    /// Number of samples.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        match &self.cols {
            Width::Narrow(c) => c.offs.len(),
            Width::Wide(c) => c.offs.len(),
        }
    }

    /// Whether the block's columns are the narrow ones (for tests).
    pub(crate) fn is_narrow(&self) -> bool {
        matches!(self.cols, Width::Narrow(_))
    }

    /// Append a sample taken at `time_us`.
    #[inline(always)]
    pub(crate) fn push(&mut self, time_us: u64, thread: u32, stack: u32) {
        let off = time_us.wrapping_sub(self.origin);
        match &mut self.cols {
            Width::Narrow(c) => {
                if let (Ok(o), Ok(t)) = (u32::try_from(off), u16::try_from(thread)) {
                    c.offs.push(o);
                    c.threads.push(t);
                    c.stacks.push(stack);
                } else {
                    self.widen();
                    self.push(time_us, thread, stack);
                }
            }
            Width::Wide(c) => {
                c.offs.push(off);
                c.threads.push(thread);
                c.stacks.push(stack);
            }
        }
    }

    /// Run the decoding loop `f` with a [`Filler`] over the block's spare
    /// capacity, in the block's layout.
    #[inline]
    pub(crate) fn fill<F: Fill>(&mut self, f: &mut F) -> F::Out {
        match &mut self.cols {
            Width::Narrow(c) => fill_cols::<NarrowLayout, F>(self.origin, c, f),
            Width::Wide(c) => fill_cols::<WideLayout, F>(self.origin, c, f),
        }
    }

    /// Make room for a sample at `time_us` of `thread` that a [`Filler`]
    /// could not take: widen the block if it does not fit the narrow layout,
    /// else grow the capacity.
    #[cold]
    pub(crate) fn make_room(&mut self, time_us: u64, thread: u32) {
        let off = time_us.wrapping_sub(self.origin);
        match &mut self.cols {
            Width::Narrow(_) if NarrowLayout::narrow(off, thread).is_none() => self.widen(),
            Width::Narrow(c) => reserve(c),
            Width::Wide(c) => reserve(c),
        }
        fn reserve<O, T>(c: &mut Cols<O, T>) {
            let more = (c.offs.len() / 8).max(1024);
            c.offs.reserve(more);
            c.threads.reserve(more);
            c.stacks.reserve(more);
        }
    }

    /// Switch to the wide columns, keeping every sample (and the capacity).
    #[cold]
    fn widen(&mut self) {
        if let Width::Narrow(n) = &self.cols {
            let mut w = Cols::with_capacity(n.offs.capacity().max(n.offs.len() + 1));
            w.offs.extend(n.offs.iter().map(|&o| o as u64));
            w.threads.extend(n.threads.iter().map(|&t| t as u32));
            w.stacks.extend_from_slice(&n.stacks);
            self.cols = Width::Wide(w);
        }
    }

    /// Move every timestamp by `delta_us` (wrapping): a block whose samples
    /// were pushed with times relative to a start not yet known is rebased
    /// onto it once it is.
    pub(crate) fn rebase(&mut self, delta_us: u64) {
        self.origin = self.origin.wrapping_add(delta_us);
    }

    /// Keep the first `n` samples.
    pub(crate) fn truncate(&mut self, n: usize) {
        match &mut self.cols {
            Width::Narrow(c) => c.truncate(n),
            Width::Wide(c) => c.truncate(n),
        }
    }

    /// The sample at `i` (`i < len()`).
    #[inline]
    fn get(&self, i: usize) -> Sample {
        let (off, thread, stack) = match &self.cols {
            Width::Narrow(c) => (c.offs[i] as u64, c.threads[i] as u32, c.stacks[i]),
            Width::Wide(c) => (c.offs[i], c.threads[i], c.stacks[i]),
        };
        Sample { time_us: self.origin.wrapping_add(off), thread: ThreadId(thread), stack: StackId(stack) }
    }
}

/// Every sample of a snapshot, in stream order.
#[derive(Debug, Clone, Default)]
pub(crate) struct SampleColumns {
    blocks: Vec<Block>,
    len: usize,
}

impl SampleColumns {
    /// Columns starting with `first`.
    pub(crate) fn new(first: Block) -> SampleColumns {
        SampleColumns { blocks: vec![first], len: 0 }
    }

    /// The block samples are appended to.
    #[inline]
    pub(crate) fn last_mut(&mut self) -> &mut Block {
        self.blocks.last_mut().expect("columns always have a block")
    }

    /// Append a sample to the last block.
    #[inline(always)]
    pub(crate) fn push(&mut self, s: Sample) {
        self.last_mut().push(s.time_us, s.thread.get(), s.stack.get());
    }

    /// Append a block (decoded elsewhere) after the samples so far.
    pub(crate) fn push_block(&mut self, b: Block) {
        self.blocks.push(b);
    }

    /// Drop unused capacity and empty blocks, once loading is over.
    pub(crate) fn finish(&mut self) {
        self.blocks.retain(|b| b.len() > 0);
        for b in &mut self.blocks {
            match &mut b.cols {
                Width::Narrow(c) => c.shrink_to_fit(),
                Width::Wide(c) => c.shrink_to_fit(),
            }
        }
        self.len = self.blocks.iter().map(Block::len).sum();
    }

    /// The blocks (for tests of the widening).
    pub(crate) fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// Number of samples (after [`finish`](Self::finish)).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The sample at index `i` in stream order.
    pub(crate) fn get(&self, mut i: usize) -> Option<Sample> {
        for b in &self.blocks {
            if i < b.len() {
                return Some(b.get(i));
            }
            i -= b.len();
        }
        None
    }

    /// Every sample in stream order.
    pub(crate) fn iter(&self) -> Samples<'_> {
        Samples { blocks: &self.blocks, block: 0, i: 0, remaining: self.len }
    }
}

/// Iterator over a snapshot's samples in stream order
/// ([`Snapshot::samples`](super::Snapshot::samples)).
#[derive(Debug, Clone)]
pub struct Samples<'a> {
    blocks: &'a [Block],
    block: usize,
    i: usize,
    remaining: usize,
}

impl Iterator for Samples<'_> {
    type Item = Sample;

    #[inline]
    fn next(&mut self) -> Option<Sample> {
        loop {
            let b = self.blocks.get(self.block)?;
            if self.i < b.len() {
                let s = b.get(self.i);
                self.i += 1;
                self.remaining -= 1;
                return Some(s);
            }
            self.block += 1;
            self.i = 0;
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl ExactSizeIterator for Samples<'_> {}

impl std::iter::FusedIterator for Samples<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes `samples` through fillers, making room whenever one is full
    /// or a sample does not fit its layout, as the loaders do.
    struct Feed<'s> {
        samples: &'s [(u64, u32, u32)],
        next: usize,
    }

    impl Fill for Feed<'_> {
        type Out = Option<(u64, u32)>;
        fn run<L: Layout>(&mut self, w: &mut Filler<'_, L>) -> Option<(u64, u32)> {
            while let Some(&(time, thread, stack)) = self.samples.get(self.next) {
                if !w.put(time, thread, stack) {
                    return Some((time, thread));
                }
                self.next += 1;
            }
            None
        }
    }

    fn load(block: &mut Block, samples: &[(u64, u32, u32)]) {
        let mut feed = Feed { samples, next: 0 };
        while let Some((time, thread)) = block.fill(&mut feed) {
            block.make_room(time, thread);
        }
    }

    fn contents(cols: &SampleColumns) -> Vec<(u64, u32, u32)> {
        cols.iter().map(|s| (s.time_us, s.thread.get(), s.stack.get())).collect()
    }

    #[test]
    fn a_full_filler_grows_the_block_and_keeps_it_narrow() {
        let start = 1_700_000_000_000_000;
        let samples: Vec<_> = (0..5000).map(|i| (start + i * 1000, (i % 7) as u32, i as u32)).collect();
        let mut block = Block::new(start, 3);
        load(&mut block, &samples);
        assert!(block.is_narrow());
        let mut cols = SampleColumns::new(block);
        cols.finish();
        assert_eq!(cols.len(), 5000);
        assert_eq!(contents(&cols), samples);
        assert_eq!(cols.iter().len(), 5000);
        assert_eq!(cols.get(4999).map(|s| s.time_us), Some(samples[4999].0));
        assert_eq!(cols.get(5000), None);
    }

    #[test]
    fn values_outside_the_narrow_layout_widen_it_once() {
        let start: u64 = 1_000_000;
        // The first times past either end of the narrow range, far past it,
        // and a thread id past 16 bits, each after some narrow samples. (Times
        // wrap: 0 and u64::MAX are inside the range around this start.)
        let (lo, hi) = (start.wrapping_sub(BIAS), start.wrapping_sub(BIAS).wrapping_add(1 << 32));
        assert!(Block::new(start, 0).origin == lo);
        let odds = [(hi, 1, 1), (lo.wrapping_sub(1), 1, 1), (start + (1 << 40), 1, 1), (start, 70_000, 1)];
        for (i, fits) in
            [(hi.wrapping_sub(1), 1), (lo, 1), (0, 1), (u64::MAX, 1), (start, 65_535)].into_iter().enumerate()
        {
            let mut block = Block::new(start, 1);
            load(&mut block, &[(fits.0, fits.1, 0)]);
            assert!(block.is_narrow(), "{i}");
            assert_eq!(block.get(0).time_us, fits.0);
        }
        for odd in odds {
            let mut samples: Vec<_> = (0..100).map(|i| (start + i, 2, 3)).collect();
            samples.push(odd);
            samples.extend((0..100).map(|i| (start + 200 + i, 4, u32::MAX)));
            let mut block = Block::new(start, samples.len());
            load(&mut block, &samples[..100]);
            assert!(block.is_narrow(), "{odd:?}");
            load(&mut block, &samples[100..]);
            assert!(!block.is_narrow(), "{odd:?}");
            let mut cols = SampleColumns::new(block);
            cols.finish();
            assert_eq!(contents(&cols), samples, "{odd:?}");
        }
    }

    #[test]
    fn blocks_rebase_truncate_and_read_in_order() {
        // A second block pushed relative to an unknown start, rebased later.
        let mut first = Block::new(500, 10);
        load(&mut first, &[(500, 0, 0), (700, 1, 1)]);
        let mut second = Block::new(0, 10);
        let rel = |r: i64| r as u64;
        load(&mut second, &[(rel(-50), 2, 2), (rel(10), 3, 3), (rel(20), 4, 4)]);
        second.rebase(700);
        second.truncate(2);
        let mut cols = SampleColumns::new(first);
        cols.push_block(second);
        cols.push_block(Block::new(0, 0));
        cols.finish();
        assert_eq!(cols.blocks().len(), 2, "the empty block is dropped");
        assert_eq!(contents(&cols), [(500, 0, 0), (700, 1, 1), (650, 2, 2), (710, 3, 3)]);
        assert_eq!(cols.get(2).map(|s| s.time_us), Some(650));
        let mut it = cols.iter();
        it.next();
        assert_eq!(it.len(), 3);
    }
}
