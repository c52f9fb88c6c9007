//! The samples of a packed file as a [`Snapshot`](crate::Snapshot) holds
//! them: each block LZ4-decompressed but still in its coded form (the
//! bit-packed columns of `FORMAT.md`, section 10), about 2.7 bytes a sample
//! for a profile against 7 to 16 decoded.
//!
//! Every block is checked in full when the file is opened
//! (`format::packed::check_block`: every code, escape, id and the time
//! extremes), so reading it later cannot fail. While checking, a [`Mark`]
//! is kept every [`CHUNK`] samples (the time there and the escapes before it
//! in each column), so reading sample `i` decodes at most one chunk (the
//! last chunk decoded is kept for the next read), and iterating decodes one
//! chunk at a time into a small buffer. The blocks decoded by one thread at
//! open share one buffer, sized from their headers before any is
//! decompressed (`read::packed::load_range`).
//!
//! [`Mark`]: crate::format::packed::Mark

use std::sync::{Arc, Mutex};

use crate::format::packed::{CheckedBlock, DecodeBufs, CHUNK, RAW_PADDING};
use crate::format::{Sample, StackId, ThreadId};

/// One block of a packed file, checked, still coded.
#[derive(Debug, Clone)]
pub(crate) struct CodedBlock {
    /// The buffer holding this block's decompressed bytes, with those of the
    /// other blocks decoded by the same thread (one allocation for all of
    /// them: fewer page faults than one buffer a block).
    pub(crate) arena: Arc<Vec<u8>>,
    /// Where the block starts in `arena` and its decoded length; the
    /// [`RAW_PADDING`] bytes after it are zeros.
    pub(crate) at: usize,
    pub(crate) len: usize,
    /// Samples in it.
    pub(crate) count: usize,
    /// Its columns and checkpoints.
    pub(crate) checked: CheckedBlock,
}

impl CodedBlock {
    /// The decoded block and its padding, as `check_block` saw it.
    #[inline]
    fn raw(&self) -> &[u8] {
        &self.arena[self.at..self.at + self.len + RAW_PADDING]
    }

    /// Decode chunk `c` (samples `c * CHUNK` to the next checkpoint or the
    /// block's end) into `out`.
    fn decode(&self, c: usize, out: &mut Chunk) {
        let mark = self.checked.marks[c];
        let s = c * CHUNK;
        let n = (s + CHUNK).min(self.count) - s;
        let [tc, hc, sc] = &self.checked.cols;
        let raw = self.raw();
        out.times.resize(n, 0);
        out.threads.resize(n, 0);
        out.stacks.resize(n, 0);
        out.times[0] = mark.time;
        let mut t = mark.time;
        // Deltas `s..s + n - 1` give the times of samples `s + 1..s + n`.
        tc.decode_range(raw, &mut out.bufs, s, mark.esc[0] as usize, &mut out.times[1..], |d| {
            t = t.wrapping_add(d);
            t
        });
        hc.decode_range(raw, &mut out.bufs, s, mark.esc[1] as usize, &mut out.threads, |v| v as u32);
        sc.decode_range(raw, &mut out.bufs, s, mark.esc[2] as usize, &mut out.stacks, |v| v as u32);
    }

    fn chunks(&self) -> usize {
        self.checked.marks.len()
    }
}

/// One decoded chunk (at most [`CHUNK`] samples) and the buffers decoding
/// it takes.
#[derive(Debug, Clone, Default)]
struct Chunk {
    times: Vec<u64>,
    threads: Vec<u32>,
    stacks: Vec<u32>,
    bufs: DecodeBufs,
}

impl Chunk {
    fn with_capacity() -> Box<Chunk> {
        Box::new(Chunk {
            times: Vec::with_capacity(CHUNK),
            threads: Vec::with_capacity(CHUNK),
            stacks: Vec::with_capacity(CHUNK),
            bufs: DecodeBufs::default(),
        })
    }

    #[inline]
    fn get(&self, j: usize) -> Option<Sample> {
        Some(Sample {
            time_us: *self.times.get(j)?,
            thread: ThreadId(*self.threads.get(j)?),
            stack: StackId(*self.stacks.get(j)?),
        })
    }
}

/// Every sample of a packed file, block by block, coded.
#[derive(Debug)]
pub(crate) struct CodedSamples {
    blocks: Vec<CodedBlock>,
    /// Index of each block's first sample.
    starts: Vec<usize>,
    len: usize,
    /// Earliest and latest time (of every block's, checked at open).
    range: Option<(u64, u64)>,
    /// The chunk [`get`](Self::get) decoded last: (block, chunk, samples).
    cache: Mutex<Option<(usize, usize, Box<Chunk>)>>,
}

impl Clone for CodedSamples {
    fn clone(&self) -> Self {
        CodedSamples {
            blocks: self.blocks.clone(),
            starts: self.starts.clone(),
            len: self.len,
            range: self.range,
            cache: Mutex::new(None),
        }
    }
}

impl CodedSamples {
    /// The samples of `blocks`, in order.
    pub(crate) fn new(blocks: Vec<CodedBlock>) -> CodedSamples {
        let mut starts = Vec::with_capacity(blocks.len());
        let mut len = 0;
        let mut range: Option<(u64, u64)> = None;
        for b in &blocks {
            starts.push(len);
            len += b.count;
            let (lo, hi) = (b.checked.lo, b.checked.hi);
            range = Some(range.map_or((lo, hi), |(a, z)| (a.min(lo), z.max(hi))));
        }
        CodedSamples { blocks, starts, len, range, cache: Mutex::new(None) }
    }

    /// Number of samples.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Number of blocks.
    #[cfg(feature = "testing")]
    pub(crate) fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// The earliest and latest time, if there are samples.
    pub(crate) fn time_range(&self) -> Option<(u64, u64)> {
        self.range
    }

    /// The last sample's time, if any.
    pub(crate) fn last_time(&self) -> Option<u64> {
        self.blocks.last().map(|b| b.checked.last)
    }

    /// The sample at index `i` in file order.
    pub(crate) fn get(&self, i: usize) -> Option<Sample> {
        if i >= self.len {
            return None;
        }
        let k = self.starts.partition_point(|&s| s <= i) - 1;
        let local = i - self.starts[k];
        let (c, j) = (local / CHUNK, local % CHUNK);
        match self.cache.try_lock() {
            Ok(mut cache) => {
                let hit = matches!(&*cache, Some((b, cc, _)) if (*b, *cc) == (k, c));
                if !hit {
                    let mut chunk = cache.take().map_or_else(Chunk::with_capacity, |(_, _, chunk)| chunk);
                    self.blocks[k].decode(c, &mut chunk);
                    *cache = Some((k, c, chunk));
                }
                cache.as_ref().and_then(|(_, _, chunk)| chunk.get(j))
            }
            // Another thread is reading: decode without the cache.
            Err(_) => {
                let mut chunk = Chunk::with_capacity();
                self.blocks[k].decode(c, &mut chunk);
                chunk.get(j)
            }
        }
    }

    /// Every sample in file order.
    pub(crate) fn iter(&self) -> CodedIter<'_> {
        CodedIter { samples: self, block: 0, chunk: 0, pos: 0, buf: Box::default(), remaining: self.len }
    }
}

/// Iterator over [`CodedSamples`], a chunk at a time.
#[derive(Debug, Clone)]
pub(crate) struct CodedIter<'a> {
    samples: &'a CodedSamples,
    /// The next chunk to decode.
    block: usize,
    chunk: usize,
    /// Next sample of `buf` to hand out.
    pos: usize,
    buf: Box<Chunk>,
    pub(crate) remaining: usize,
}

impl CodedIter<'_> {
    /// Decode the next chunk into the buffer; `false` at the end.
    #[inline(never)]
    fn refill(&mut self) -> bool {
        let Some(b) = self.samples.blocks.get(self.block) else {
            return false;
        };
        b.decode(self.chunk, &mut self.buf);
        self.pos = 0;
        self.chunk += 1;
        if self.chunk == b.chunks() {
            (self.block, self.chunk) = (self.block + 1, 0);
        }
        true
    }
}

impl Iterator for CodedIter<'_> {
    type Item = Sample;

    #[inline(always)]
    fn next(&mut self) -> Option<Sample> {
        if self.pos >= self.buf.times.len() && !self.refill() {
            return None;
        }
        let s = self.buf.get(self.pos)?;
        self.pos += 1;
        self.remaining -= 1;
        Some(s)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}
