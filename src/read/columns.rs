//! The sample columns of a [`Snapshot`](super::Snapshot) of a spool, and
//! the iterator over a snapshot's samples ([`Samples`]), which also walks a
//! packed file's coded blocks (`coded.rs`).
//!
//! Samples are kept column-wise (timestamp, thread, stack) in one or more
//! [`Block`]s: one per thread that decoded a part of the file
//! (`parallel.rs`), so the second thread of a two-thread load writes its
//! samples straight to their final place and nothing is copied afterwards.
//!
//! A block stores each timestamp as an offset from the block's origin. It
//! starts narrow, 10 bytes per sample: 4-byte offsets (from 4.5 minutes before
//! the time the block starts at to 67 minutes after it) and 2-byte thread ids.
//! A sample whose time is outside that range starts a new narrow block, so a
//! profile of many hours stays narrow (one block per hour or so). A thread id
//! past 16 bits, or a time outside the range of a block of fewer than
//! [`MIN_SPLIT`] samples (timestamps jumping back and forth, which only
//! corrupt-looking input does), widens the block instead, once, to 8-byte
//! offsets and 4-byte thread ids (16 bytes per sample); so there are fewer
//! blocks than one per [`MIN_SPLIT`] samples, plus one per loading thread.
//! Memory written while loading is a share of the cost of loading a large
//! spool (the kernel zeroes every fresh page first), so the narrow form loads
//! faster as well as smaller.

use std::mem::MaybeUninit;

use super::coded::CodedIter;
use super::memory::advise_huge_pages;
use crate::format::{Sample, StackId, ThreadId};

/// How far before the time a block starts at its origin lies: narrow offsets
/// cover `[start - BIAS, start + 2^32 - BIAS)` microseconds, from 4.5 minutes
/// before (samples of different threads arrive slightly out of order) to 67
/// minutes after.
const BIAS: u64 = 1 << 28;

/// The fewest samples a narrow block holds before a time outside its range
/// starts a new block rather than widening it.
pub(crate) const MIN_SPLIT: usize = 4096;

/// One column per field.
#[derive(Debug, Clone)]
pub(crate) struct Cols<O, T, S = u32> {
    offs: Vec<O>,
    threads: Vec<T>,
    stacks: Vec<S>,
}

impl<O, T, S> Cols<O, T, S> {
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
    /// A stack id.
    type Stack: Copy;
    /// `off` and `thread` in this layout, if they fit.
    fn narrow(off: u64, thread: u32) -> Option<(Self::Off, Self::Thread)>;
    /// `stack` in this layout, cut to its width (the caller knows it fits).
    fn stack(stack: u32) -> Self::Stack;
}

/// 4-byte offsets and 2-byte thread ids.
pub(crate) enum NarrowLayout {}
/// 8-byte offsets and 4-byte thread ids: everything fits.
pub(crate) enum WideLayout {}

impl Layout for NarrowLayout {
    type Off = u32;
    type Thread = u16;
    type Stack = u32;
    #[inline(always)]
    fn narrow(off: u64, thread: u32) -> Option<(u32, u16)> {
        match (u32::try_from(off), u16::try_from(thread)) {
            (Ok(o), Ok(t)) => Some((o, t)),
            _ => None,
        }
    }
    #[inline(always)]
    fn stack(stack: u32) -> u32 {
        stack
    }
}

impl Layout for WideLayout {
    type Off = u64;
    type Thread = u32;
    type Stack = u32;
    #[inline(always)]
    fn narrow(off: u64, thread: u32) -> Option<(u64, u32)> {
        Some((off, thread))
    }
    #[inline(always)]
    fn stack(stack: u32) -> u32 {
        stack
    }
}

/// Writes samples into a block's spare capacity. It lives on the decoding
/// loop's stack, so its count and slices stay in registers (pushing to the
/// block's vectors one by one keeps their lengths in memory, and updating them
/// costs about a third of the decoding loop's time); the block's lengths are
/// set once, when [`Block::fill`] returns.
pub(crate) struct Filler<'a, L: Layout> {
    origin: u64,
    offs: &'a mut [MaybeUninit<L::Off>],
    threads: &'a mut [MaybeUninit<L::Thread>],
    stacks: &'a mut [MaybeUninit<L::Stack>],
    n: usize,
}

impl<'a, L: Layout> Filler<'a, L> {
    fn new(origin: u64, cols: &'a mut Cols<L::Off, L::Thread, L::Stack>) -> Self {
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
                self.stacks[n].write(L::stack(stack));
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

fn fill_cols<L: Layout<Stack = u32>, F: Fill>(
    origin: u64,
    cols: &mut Cols<L::Off, L::Thread, L::Stack>,
    f: &mut F,
) -> F::Out {
    let mut w = Filler::<L>::new(origin, cols);
    let out = f.run(&mut w);
    let n = w.n;
    let len = cols.offs.len() + n;
    // The filler wrote elements 0..n of each column's spare capacity (`put`
    // writes all three at index `n` before counting it).
    // SAFETY: so the first `len` elements of each vector are initialized, and
    // `len` is within the capacity, as the spare slices were.
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

    /// Append a sample taken at `time_us`; `false` (nothing appended) if it
    /// does not fit the narrow layout.
    #[inline(always)]
    fn try_push(&mut self, time_us: u64, thread: u32, stack: u32) -> bool {
        let off = time_us.wrapping_sub(self.origin);
        match &mut self.cols {
            Width::Narrow(c) => match NarrowLayout::narrow(off, thread) {
                Some((o, t)) => {
                    c.offs.push(o);
                    c.threads.push(t);
                    c.stacks.push(stack);
                }
                None => return false,
            },
            Width::Wide(c) => {
                c.offs.push(off);
                c.threads.push(thread);
                c.stacks.push(stack);
            }
        }
        true
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

    /// Grow the capacity (the loaders reserve an upper bound up front, so
    /// only tests get here).
    #[cold]
    fn reserve(&mut self) {
        fn reserve<O, T, S>(c: &mut Cols<O, T, S>) {
            // Geometric growth (an eighth more) with a floor, so that
            // pushing sample by sample stays amortized constant time.
            let more = (c.offs.len() / 8).max(1024);
            c.offs.reserve(more);
            c.threads.reserve(more);
            c.stacks.reserve(more);
        }
        match &mut self.cols {
            Width::Narrow(c) => reserve(c),
            Width::Wide(c) => reserve(c),
        }
    }

    /// Unused capacity, in samples.
    fn spare(&self) -> usize {
        match &self.cols {
            Width::Narrow(c) => c.offs.capacity() - c.offs.len(),
            Width::Wide(c) => c.offs.capacity() - c.offs.len(),
        }
    }

    fn shrink_to_fit(&mut self) {
        match &mut self.cols {
            Width::Narrow(c) => c.shrink_to_fit(),
            Width::Wide(c) => c.shrink_to_fit(),
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
#[derive(Debug, Clone)]
pub(crate) struct SampleColumns {
    blocks: Vec<Block>,
    /// Index of each block's first sample (after [`finish`](Self::finish)).
    starts: Vec<usize>,
    len: usize,
}

impl SampleColumns {
    /// Columns starting with `first`.
    pub(crate) fn new(first: Block) -> SampleColumns {
        SampleColumns { blocks: vec![first], starts: Vec::new(), len: 0 }
    }

    /// The block samples are appended to.
    #[inline]
    pub(crate) fn last_mut(&mut self) -> &mut Block {
        self.blocks.last_mut().expect("columns always have a block")
    }

    /// Append a sample (to the last block, or to a new one: see the module
    /// documentation).
    pub(crate) fn push(&mut self, s: Sample) {
        let (time, thread, stack) = (s.time_us, s.thread.get(), s.stack.get());
        while !self.last_mut().try_push(time, thread, stack) {
            self.make_room(time, thread);
        }
    }

    /// Make room for a sample at `time_us` of `thread` that the last block
    /// (or its [`Filler`]) could not take: a new block if the time is outside
    /// a narrow block's range and the block holds [`MIN_SPLIT`] samples or
    /// more, wider columns if the sample does not fit otherwise, else more
    /// capacity.
    #[cold]
    pub(crate) fn make_room(&mut self, time_us: u64, thread: u32) {
        let last = self.last_mut();
        let off = time_us.wrapping_sub(last.origin);
        let narrow = last.is_narrow();
        if narrow && u16::try_from(thread).is_ok() && u32::try_from(off).is_err() && last.len() >= MIN_SPLIT {
            // The new block takes over the room reserved for the rest.
            let spare = last.spare();
            last.shrink_to_fit();
            self.blocks.push(Block::new(time_us, spare.max(1)));
        } else if narrow && NarrowLayout::narrow(off, thread).is_none() {
            last.widen();
        } else {
            last.reserve();
        }
    }

    /// Append `other`'s blocks, moving their timestamps by `delta_us` (see
    /// [`Block::rebase`]).
    pub(crate) fn append_rebased(&mut self, other: SampleColumns, delta_us: u64) {
        for mut b in other.blocks {
            b.rebase(delta_us);
            self.blocks.push(b);
        }
    }

    /// Samples held so far (while loading).
    pub(crate) fn count(&self) -> usize {
        self.blocks.iter().map(Block::len).sum()
    }

    /// Keep the first `n` samples.
    pub(crate) fn truncate(&mut self, mut n: usize) {
        let mut keep = 0;
        for b in &mut self.blocks {
            keep += 1;
            if n <= b.len() {
                b.truncate(n);
                break;
            }
            n -= b.len();
        }
        self.blocks.truncate(keep.max(1));
    }

    /// Drop unused capacity and empty blocks, once loading is over.
    pub(crate) fn finish(&mut self) {
        self.blocks.retain(|b| b.len() > 0);
        let mut start = 0;
        self.starts.clear();
        for b in &mut self.blocks {
            b.shrink_to_fit();
            self.starts.push(start);
            start += b.len();
        }
        self.len = start;
    }

    /// The blocks (for tests of the widening).
    #[cfg(feature = "testing")]
    pub(crate) fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// Number of samples (after [`finish`](Self::finish)).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The sample at index `i` in stream order (after [`finish`](Self::finish)).
    pub(crate) fn get(&self, i: usize) -> Option<Sample> {
        if i >= self.len {
            return None;
        }
        let k = self.starts.partition_point(|&s| s <= i) - 1;
        Some(self.blocks[k].get(i - self.starts[k]))
    }

    /// Every sample in stream order.
    pub(crate) fn iter(&self) -> Samples<'_> {
        Samples { inner: Inner::Columns { blocks: &self.blocks, block: 0, i: 0, remaining: self.len } }
    }
}

/// Iterator over a snapshot's samples in stream order
/// ([`Snapshot::samples`](super::Snapshot::samples)).
#[derive(Debug, Clone)]
pub struct Samples<'a> {
    inner: Inner<'a>,
}

#[derive(Debug, Clone)]
enum Inner<'a> {
    /// A spool's columns.
    Columns { blocks: &'a [Block], block: usize, i: usize, remaining: usize },
    /// A packed file's coded blocks, decoded a chunk at a time.
    Coded(CodedIter<'a>),
}

impl<'a> Samples<'a> {
    pub(crate) fn coded(it: CodedIter<'a>) -> Samples<'a> {
        Samples { inner: Inner::Coded(it) }
    }
}

impl Iterator for Samples<'_> {
    type Item = Sample;

    #[inline(always)]
    fn next(&mut self) -> Option<Sample> {
        match &mut self.inner {
            Inner::Columns { blocks, block, i, remaining } => loop {
                let b = blocks.get(*block)?;
                if *i < b.len() {
                    let s = b.get(*i);
                    *i += 1;
                    *remaining -= 1;
                    return Some(s);
                }
                *block += 1;
                *i = 0;
            },
            Inner::Coded(it) => it.next(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = match &self.inner {
            Inner::Columns { remaining, .. } => *remaining,
            Inner::Coded(it) => it.remaining,
        };
        (n, Some(n))
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

    fn load(cols: &mut SampleColumns, samples: &[(u64, u32, u32)]) {
        let mut feed = Feed { samples, next: 0 };
        while let Some((time, thread)) = cols.last_mut().fill(&mut feed) {
            cols.make_room(time, thread);
        }
    }

    fn contents(cols: &SampleColumns) -> Vec<(u64, u32, u32)> {
        cols.iter().map(|s| (s.time_us, s.thread.get(), s.stack.get())).collect()
    }

    fn shape(cols: &SampleColumns) -> Vec<(usize, bool)> {
        cols.blocks().iter().map(|b| (b.len(), b.is_narrow())).collect()
    }

    #[test]
    fn a_full_filler_grows_the_block_and_keeps_it_narrow() {
        let start = 1_700_000_000_000_000;
        let samples: Vec<_> = (0..5000).map(|i| (start + i * 1000, (i % 7) as u32, i as u32)).collect();
        let mut cols = SampleColumns::new(Block::new(start, 3));
        load(&mut cols, &samples);
        cols.finish();
        assert_eq!(shape(&cols), [(5000, true)]);
        assert_eq!(contents(&cols), samples);
        assert_eq!(cols.iter().len(), 5000);
        assert_eq!(cols.get(4999).map(|s| s.time_us), Some(samples[4999].0));
        assert_eq!(cols.get(5000), None);
    }

    #[test]
    fn an_edge_of_the_narrow_range_widens_a_small_block() {
        let start: u64 = 1_000_000;
        // The first times past either end of the narrow range, far past it,
        // and a thread id past 16 bits, each after some narrow samples (fewer
        // than MIN_SPLIT). Times wrap: 0 and u64::MAX are inside the range
        // around this start.
        let (lo, hi) = (start.wrapping_sub(BIAS), start.wrapping_sub(BIAS).wrapping_add(1 << 32));
        assert!(Block::new(start, 0).origin == lo);
        for (i, fits) in
            [(hi.wrapping_sub(1), 1), (lo, 1), (0, 1), (u64::MAX, 1), (start, 65_535)].into_iter().enumerate()
        {
            let mut cols = SampleColumns::new(Block::new(start, 1));
            load(&mut cols, &[(fits.0, fits.1, 0)]);
            cols.finish();
            assert_eq!(shape(&cols), [(1, true)], "{i}");
            assert_eq!(cols.get(0).unwrap().time_us, fits.0);
        }
        let odds = [(hi, 1, 1), (lo.wrapping_sub(1), 1, 1), (start + (1 << 40), 1, 1), (start, 70_000, 1)];
        for odd in odds {
            let mut samples: Vec<_> = (0..100).map(|i| (start + i, 2, 3)).collect();
            samples.push(odd);
            samples.extend((0..100).map(|i| (start + 200 + i, 4, u32::MAX)));
            let mut cols = SampleColumns::new(Block::new(start, samples.len()));
            load(&mut cols, &samples[..100]);
            load(&mut cols, &samples[100..]);
            cols.finish();
            assert_eq!(shape(&cols), [(201, false)], "{odd:?}");
            assert_eq!(contents(&cols), samples, "{odd:?}");
        }
    }

    #[test]
    fn time_outside_a_full_block_starts_a_new_narrow_block() {
        let start: u64 = 1_700_000_000_000_000;
        // Ten hours, one sample every 100 ms: a new block about every 67
        // minutes, all narrow, but for a thread id past 16 bits in the last
        // block, which widens that block only.
        let mut samples: Vec<_> = (0..360_000u64).map(|i| (start + i * 100_000, (i % 3) as u32, 7)).collect();
        samples[350_000].1 = 100_000;
        let mut cols = SampleColumns::new(Block::new(start, samples.len()));
        load(&mut cols, &samples);
        cols.finish();
        let blocks = shape(&cols);
        assert_eq!(blocks.len(), 9, "{blocks:?}");
        assert!(blocks[..8].iter().all(|&(n, narrow)| narrow && n >= 40_000), "{blocks:?}");
        assert!(!blocks[8].1, "{blocks:?}");
        assert_eq!(contents(&cols), samples);
        for i in (0..samples.len()).step_by(997).chain([samples.len() - 1]) {
            let s = cols.get(i).unwrap();
            assert_eq!((s.time_us, s.thread.get(), s.stack.get()), samples[i], "{i}");
        }
        // Jumping back and forth from the start: one widened block, not one
        // block per sample.
        let jumpy: Vec<_> = (0..10_000u64).map(|i| (start + (i % 2) * (1 << 40) + i, 1, 1)).collect();
        let mut cols = SampleColumns::new(Block::new(start, jumpy.len()));
        load(&mut cols, &jumpy);
        cols.finish();
        assert_eq!(shape(&cols), [(10_000, false)]);
        assert_eq!(contents(&cols), jumpy);
    }

    #[test]
    fn columns_rebase_truncate_and_read_in_order() {
        // Columns pushed relative to a start not yet known, rebased later.
        let mut cols = SampleColumns::new(Block::new(500, 10));
        load(&mut cols, &[(500, 0, 0), (700, 1, 1)]);
        let mut rest = SampleColumns::new(Block::new(0, 10));
        let rel = |r: i64| r as u64;
        load(&mut rest, &[(rel(-50), 2, 2), (rel(10), 3, 3), (rel(20), 4, 4)]);
        let before = cols.count();
        cols.append_rebased(rest, 700);
        cols.truncate(before + 2);
        cols.finish();
        assert_eq!(contents(&cols), [(500, 0, 0), (700, 1, 1), (650, 2, 2), (710, 3, 3)]);
        assert_eq!(cols.get(2).map(|s| s.time_us), Some(650));
        let mut it = cols.iter();
        it.next();
        assert_eq!(it.len(), 3);
        // Cutting at a block boundary drops the later blocks.
        let mut rest = SampleColumns::new(Block::new(0, 10));
        load(&mut rest, &[(5, 9, 9)]);
        cols.append_rebased(rest, 1000);
        cols.truncate(4);
        cols.finish();
        assert_eq!(shape(&cols), [(2, true), (2, true)]);
    }
}
