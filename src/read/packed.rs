//! Reading the packed container (`FORMAT.md`, section 10): the frame (footer,
//! index, definitions), one block at a time, and the two ways the readers use
//! it: [`Snapshot`](crate::Snapshot) decodes every block straight into its
//! place in columns allocated once from the index (on two threads for a
//! large file), [`Replay`](crate::Replay) validates every block once at open
//! and decodes them again one by one while iterating.
//!
//! A packed file is written whole to a temporary name and renamed, so unlike a
//! spool it has no truncated tail to recover: a file cut anywhere lacks its
//! footer (or its index no longer matches its length) and is corrupt.
//! Every length read from the file is checked against the file's own length
//! before anything is allocated for it, and a block costs at most
//! [`MAX_BLOCK_SAMPLES`] samples of scratch (its decoded bytes are bounded by
//! `max_raw_len`).

use std::fs::File;
use std::mem::MaybeUninit;
use std::os::unix::fs::FileExt;

use super::columns::{AnyDest, Block, Dest, Fill, Filler, Kind, Layout, SampleColumns};
use super::scan::format_error;
use crate::format::defs::Definitions;
use crate::format::packed::*;
use crate::format::record::DecodeError;
use crate::format::{record, tag};
use crate::{Error, FormatErrorKind};

/// Bytes a packed reader reads at offsets: a file (as long as it was when
/// opened) or a buffer.
pub(crate) trait Source: Sync {
    /// Fill `buf` from offset `at`; a source shorter than that is an error.
    fn read_exact_at(&self, buf: &mut [u8], at: u64) -> Result<(), Error>;
}

impl Source for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], at: u64) -> Result<(), Error> {
        let start = usize::try_from(at).ok().filter(|&s| s <= self.len());
        match start.and_then(|s| self.get(s..s.checked_add(buf.len())?)) {
            Some(src) => {
                buf.copy_from_slice(src);
                Ok(())
            }
            None => Err(corrupt(at, "the data ends before this field".into())),
        }
    }
}

impl Source for File {
    fn read_exact_at(&self, buf: &mut [u8], at: u64) -> Result<(), Error> {
        match FileExt::read_exact_at(self, buf, at) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(format_error(at, FormatErrorKind::ChangedSinceOpen))
            }
            Err(e) => Err(Error::from(e)),
        }
    }
}

pub(crate) fn corrupt(offset: u64, what: String) -> Error {
    format_error(offset, FormatErrorKind::PackedCorrupt(what))
}

/// Whether `head` (the first bytes of a file) starts with the packed magic
/// (or that of the first packed layout, which the readers refuse by name).
pub(crate) fn is_packed(head: &[u8]) -> bool {
    head.starts_with(&PACKED_MAGIC) || head.starts_with(&PACKED_MAGIC_V1)
}

/// The validated frame of a packed file: definitions, block index, counts.
#[derive(Debug, Clone)]
pub(crate) struct Frame {
    /// The definitions, with every sample counted (`sample_count` and the
    /// running time are those of the whole file).
    pub defs: Definitions,
    pub index: Vec<IndexEntry>,
    pub samples: u64,
    pub file_len: u64,
    /// Sum of the blocks' compressed payloads.
    pub payload_bytes: u64,
    /// Threads and stack nodes defined: sample references must be below.
    pub threads: usize,
    pub stacks: usize,
}

/// Read and check the frame of a packed file of `len` bytes: head, footer,
/// block index and definitions. Blocks themselves are checked as they are
/// decoded ([`Frame::block`]).
pub(crate) fn open_frame(src: &(impl Source + ?Sized), len: u64) -> Result<Frame, Error> {
    if len < HEAD_LEN + FOOTER_LEN {
        return Err(corrupt(
            len,
            format!("a packed file is at least {} bytes; this one ends after {len}", HEAD_LEN + FOOTER_LEN),
        ));
    }
    let mut head = [0u8; HEAD_LEN as usize];
    src.read_exact_at(&mut head, 0)?;
    if head[..8] == PACKED_MAGIC_V1 {
        return Err(corrupt(
            0,
            "a packed file of the first layout (SPULSPK1, byte planes), which this version no longer reads: \
             pack the spool again"
                .into(),
        ));
    }
    if head[..8] != PACKED_MAGIC {
        return Err(format_error(0, FormatErrorKind::BadMagic));
    }
    let footer_at = len - FOOTER_LEN;
    let mut footer = [0u8; FOOTER_LEN as usize];
    src.read_exact_at(&mut footer, footer_at)?;
    if footer[24..] != PACKED_MAGIC {
        return Err(corrupt(
            footer_at + 24,
            "no footer magic at the end: the file is truncated or was not written completely".into(),
        ));
    }
    let (index_at, blocks, samples) = (le64(&footer[0..8]), le64(&footer[8..16]), le64(&footer[16..24]));
    let index_len = blocks.checked_mul(INDEX_ENTRY_LEN);
    if index_len.and_then(|l| l.checked_add(index_at)) != Some(footer_at) {
        return Err(corrupt(
            footer_at,
            format!(
                "an index of {blocks} blocks at offset {index_at} does not end where the footer starts \
                 ({footer_at}): the file is truncated or corrupt"
            ),
        ));
    }
    let defs_len = le64(&head[8..16]);
    let defs_end = match HEAD_LEN.checked_add(defs_len) {
        Some(e) if e.checked_add(8).is_some_and(|m| m <= index_at) => e,
        _ => {
            return Err(corrupt(
                8,
                format!("definitions of {defs_len} bytes do not fit before the index at offset {index_at}"),
            ))
        }
    };
    let mut defs_bytes = vec![0u8; defs_len as usize];
    src.read_exact_at(&mut defs_bytes, HEAD_LEN)?;
    let mut m = [0u8; 8];
    src.read_exact_at(&mut m, defs_end)?;
    let mark_count = le64(&m);
    let marks_end = mark_count.checked_mul(8).and_then(|l| l.checked_add(defs_end + 8));
    let Some(data_start) = marks_end.filter(|&e| e <= index_at) else {
        return Err(corrupt(defs_end, format!("{mark_count} event positions do not fit before the index")));
    };
    let mut mark_bytes = vec![0u8; (mark_count * 8) as usize];
    src.read_exact_at(&mut mark_bytes, defs_end + 8)?;
    let marks: Vec<u64> = mark_bytes.chunks_exact(8).map(le64).collect();

    let mut index_bytes = vec![0u8; (blocks * INDEX_ENTRY_LEN) as usize];
    src.read_exact_at(&mut index_bytes, index_at)?;
    let mut index = Vec::with_capacity(blocks as usize);
    let (mut expect, mut total, mut payload_bytes) = (data_start, 0u64, 0u64);
    for (i, raw) in index_bytes.chunks_exact(INDEX_ENTRY_LEN as usize).enumerate() {
        let at = index_at + i as u64 * INDEX_ENTRY_LEN;
        let e = IndexEntry::decode(raw.try_into().expect("chunks of the entry length"));
        if e.offset != expect {
            return Err(corrupt(
                at,
                format!("index entry {i} puts block {i} at offset {}, but it starts at {expect}", e.offset),
            ));
        }
        if e.count == 0 || e.count > MAX_BLOCK_SAMPLES {
            return Err(corrupt(
                at,
                format!("index entry {i}: {} samples (a block holds 1 to {MAX_BLOCK_SAMPLES})", e.count),
            ));
        }
        if e.min_time_us > e.max_time_us {
            return Err(corrupt(at, format!("index entry {i}: earliest time after latest time")));
        }
        expect = e.offset + BLOCK_HEADER_LEN + e.compressed as u64;
        if expect > index_at {
            return Err(corrupt(at, format!("index entry {i}: block {i} runs past the index at {index_at}")));
        }
        total += e.count as u64;
        payload_bytes += e.compressed as u64;
        index.push(e);
    }
    if expect != index_at {
        return Err(corrupt(
            index_at,
            format!("{} bytes between the last block and the index", index_at - expect),
        ));
    }
    if total != samples {
        return Err(corrupt(
            footer_at + 16,
            format!("the footer counts {samples} samples, the index {total}"),
        ));
    }
    let mut defs = load_definitions(&defs_bytes, HEAD_LEN, &marks, defs_end + 8, samples)?;
    // Every sample counted; the running time after the last one is known once
    // its block is decoded, and readers set it then (`Frame::finish`). A file
    // without samples keeps the start time, as a spool does.
    defs.commit_samples(samples - defs.sample_count(), defs.last_time_us());
    let (threads, stacks) = (defs.threads().len(), defs.stack_count());
    Ok(Frame { defs, index, samples, file_len: len, payload_bytes, threads, stacks })
}

/// Decode the definitions section (a spool stream without sample records),
/// setting the sample position of each tag 6, 7 and 8 record from `marks`.
fn load_definitions(
    bytes: &[u8],
    base: u64,
    marks: &[u64],
    marks_at: u64,
    samples: u64,
) -> Result<Definitions, Error> {
    let (header, hlen) = record::decode_header(bytes).map_err(|(at, k)| format_error(base + at as u64, k))?;
    let mut defs = Definitions::new(header);
    let mut pos = hlen;
    let mut k = 0usize;
    while pos < bytes.len() {
        let at = base + pos as u64;
        let t = bytes[pos];
        if t == tag::SAMPLE {
            return Err(corrupt(at, "a sample record in the definitions".into()));
        }
        if matches!(t, tag::PYTHON_RUNTIME | tag::PROCESS_MODULE_DEACTIVATION | tag::MODULE_DEACTIVATION) {
            let Some(&mark) = marks.get(k) else {
                return Err(corrupt(at, format!("more events than the {} positions given", marks.len())));
            };
            let before = defs.sample_count();
            if mark < before || mark > samples {
                return Err(corrupt(
                    marks_at + 8 * k as u64,
                    format!("event position {mark} is below the previous one ({before}) or past the {samples} samples"),
                ));
            }
            defs.commit_samples(mark - before, defs.last_time_us());
            k += 1;
        }
        match defs.read_record(&bytes[pos..]) {
            Ok((_, len)) => pos += len,
            Err(DecodeError::Incomplete) => {
                return Err(corrupt(at, "the definitions end inside a record".into()));
            }
            Err(DecodeError::Bad { at: field, kind }) => return Err(format_error(at + field as u64, kind)),
        }
    }
    if k != marks.len() {
        return Err(corrupt(marks_at - 8, format!("{} event positions for {k} events", marks.len())));
    }
    Ok(defs)
}

/// Reusable buffers for decoding blocks.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    payload: Vec<u8>,
    raw: Vec<u8>,
    bufs: DecodeBufs,
}

impl Frame {
    /// Read, decompress and check block `i` into the columns (each exactly
    /// its sample count long).
    pub(crate) fn block(
        &self,
        src: &(impl Source + ?Sized),
        i: usize,
        scratch: &mut Scratch,
        times: &mut [u64],
        threads: &mut [u32],
        stacks: &mut [u32],
    ) -> Result<(), Error> {
        let n = self.index[i].count as usize;
        assert!(times.len() == n && threads.len() == n && stacks.len() == n);
        self.block_into(src, i, scratch, &mut (times, threads, stacks))
    }

    /// Read, decompress and check block `i`, handing its samples to `sink`
    /// (which receives every index below the block's count, unless this
    /// fails).
    pub(crate) fn block_into(
        &self,
        src: &(impl Source + ?Sized),
        i: usize,
        scratch: &mut Scratch,
        sink: &mut impl BlockSink,
    ) -> Result<(), Error> {
        let e = self.index[i];
        let mut head = [0u8; BLOCK_HEADER_LEN as usize];
        src.read_exact_at(&mut head, e.offset)?;
        let (raw_len, comp, count) = (le32(&head[0..4]), le32(&head[4..8]), le32(&head[8..12]));
        if count != e.count || comp != e.compressed {
            return Err(corrupt(
                e.offset,
                format!(
                    "block {i} holds {count} samples in {comp} bytes, its index entry says {} in {}",
                    e.count, e.compressed
                ),
            ));
        }
        if raw_len as u64 > max_raw_len(count) || raw_len as u64 > max_decompressed(comp as u64) {
            return Err(corrupt(
                e.offset,
                format!(
                    "block {i}: {raw_len} uncompressed bytes cannot hold {count} samples in {comp} compressed bytes \
                     (at most {} and {})",
                    max_raw_len(count),
                    max_decompressed(comp as u64)
                ),
            ));
        }
        scratch.payload.resize(comp as usize, 0);
        src.read_exact_at(&mut scratch.payload, e.offset + BLOCK_HEADER_LEN)?;
        decompress(&scratch.payload, raw_len as usize, &mut scratch.raw)
            .map_err(|m| corrupt(e.offset + BLOCK_HEADER_LEN, format!("block {i}: {m}")))?;
        let (lo, hi) = decode_block(
            &mut scratch.bufs,
            &scratch.raw,
            raw_len as usize,
            count as usize,
            self.threads,
            self.stacks,
            sink,
        )
        .map_err(|err| match err {
            BlockError::Layout(m) => corrupt(e.offset + BLOCK_HEADER_LEN, format!("block {i}: {m}")),
            BlockError::Undefined { what, id } => {
                format_error(e.offset, FormatErrorKind::UndefinedReference { what, id })
            }
        })?;
        if (lo, hi) != (e.min_time_us, e.max_time_us) {
            return Err(corrupt(
                e.offset,
                format!(
                    "block {i}: times {lo}..={hi} differ from its index entry's {}..={}",
                    e.min_time_us, e.max_time_us
                ),
            ));
        }
        Ok(())
    }

    /// Set the running time to the last sample's (once it is decoded).
    pub(crate) fn finish(&mut self, last_time_us: u64) {
        self.defs.commit_samples(0, last_time_us);
    }
}

/// One decoded block, reused block after block (`Replay`).
#[derive(Debug, Default)]
pub(crate) struct BlockBuf {
    pub times: Vec<u64>,
    pub threads: Vec<u32>,
    pub stacks: Vec<u32>,
    pub scratch: Scratch,
}

impl BlockBuf {
    /// Decode block `i` of `frame` into the buffer.
    pub(crate) fn load(
        &mut self,
        frame: &Frame,
        src: &(impl Source + ?Sized),
        i: usize,
    ) -> Result<(), Error> {
        let n = frame.index[i].count as usize;
        self.times.resize(n, 0);
        self.threads.resize(n, 0);
        self.stacks.resize(n, 0);
        frame.block(src, i, &mut self.scratch, &mut self.times, &mut self.threads, &mut self.stacks)
    }
}

/// Check every block of a packed file one at a time (`Replay::open`), with
/// one block's memory; returns the last sample's time, if any.
pub(crate) fn validate_all(src: &(impl Source + ?Sized), frame: &Frame) -> Result<Option<u64>, Error> {
    let mut buf = BlockBuf::default();
    for i in 0..frame.index.len() {
        buf.load(frame, src, i)?;
    }
    Ok(buf.times.last().copied())
}

/// Hands a decoded block's samples to a [`Filler`], from sample `i` on.
struct FromBlock<'a> {
    buf: &'a BlockBuf,
    i: usize,
}

impl Fill for FromBlock<'_> {
    /// The time and thread of a sample the filler had no room for.
    type Out = Option<(u64, u32)>;

    #[inline(always)]
    fn run<L: Layout>(&mut self, w: &mut Filler<'_, L>) -> Option<(u64, u32)> {
        let b = self.buf;
        let n = b.times.len().min(b.threads.len()).min(b.stacks.len());
        let mut i = self.i;
        while i < n {
            let (t, h, s) = (b.times[i], b.threads[i], b.stacks[i]);
            if !w.put(t, h, s) {
                self.i = i;
                return Some((t, h));
            }
            i += 1;
        }
        self.i = i;
        None
    }
}

/// Decode blocks `range` into columns of their own.
fn decode_range(
    src: &(impl Source + ?Sized),
    frame: &Frame,
    range: std::ops::Range<usize>,
) -> Result<SampleColumns, Error> {
    let count: u64 = frame.index[range.clone()].iter().map(|e| e.count as u64).sum();
    // Room for every sample up front, but never more than one per byte of the
    // file (real profiles take several bytes a sample): a hostile file that
    // claims more than it can plausibly hold grows the columns as it is
    // actually decoded instead.
    let room = count.min(frame.file_len) as usize;
    let start = frame.index.get(range.start).map_or(0, |e| e.min_time_us);
    let mut cols = SampleColumns::new(Block::new(start, room));
    let mut buf = BlockBuf::default();
    for i in range {
        buf.load(frame, src, i)?;
        let mut f = FromBlock { buf: &buf, i: 0 };
        while let Some((time, thread)) = cols.last_mut().fill(&mut f) {
            cols.make_room(time, thread);
        }
    }
    Ok(cols)
}

/// Writes every element of its columns (`decode_into` does, also when it
/// fails): the safety of `assume_written` in `decode_all` rests on this.
impl<L: Layout> BlockSink for Dest<'_, L> {
    fn times(
        &mut self,
        first: u64,
        deltas: &Column,
        raw: &[u8],
        bufs: &mut DecodeBufs,
    ) -> Result<(u64, u64), String> {
        let origin = self.origin();
        times_into(first, deltas, raw, bufs, self.offs(), |t| {
            MaybeUninit::new(L::off(t.wrapping_sub(origin)))
        })
    }
    fn threads(&mut self, ids: &Column, raw: &[u8], bufs: &mut DecodeBufs) -> Result<(), String> {
        ids.decode_into(raw, bufs, self.threads(), |v| MaybeUninit::new(L::thread(v as u32)))
    }
    fn stacks(&mut self, ids: &Column, raw: &[u8], bufs: &mut DecodeBufs) -> Result<(), String> {
        ids.decode_into(raw, bufs, self.stacks(), |v| MaybeUninit::new(L::stack(v as u32)))
    }
}

/// Decode packed blocks straight into their place in the final columns.
fn decode_jobs(
    src: &(impl Source + ?Sized),
    frame: &Frame,
    jobs: Vec<(usize, AnyDest<'_>)>,
) -> Result<(), Error> {
    let mut scratch = Scratch::default();
    for (i, dest) in jobs {
        match dest {
            AnyDest::Compact(mut d) => frame.block_into(src, i, &mut scratch, &mut d)?,
            AnyDest::Narrow(mut d) => frame.block_into(src, i, &mut scratch, &mut d)?,
            AnyDest::Wide(mut d) => frame.block_into(src, i, &mut scratch, &mut d)?,
        }
    }
    Ok(())
}

/// Times a narrow column block can hold: offsets below 2^32 from its origin.
const NARROW_SPAN: u64 = 1 << 32;

/// Every sample of a packed file in a `Snapshot`'s columns.
///
/// The index tells every block's sample count and time range before any is
/// decoded, so the final columns are allocated once, at their exact size:
/// consecutive packed blocks whose times fit one narrow column block (10
/// bytes a sample, `columns.rs`) share it, and each packed block is decoded
/// straight into its own part of it, half of the blocks on a second thread
/// when there are enough of them. Nothing is copied afterwards. A file
/// claiming more samples than it has bytes (possible for a real one only if
/// its samples barely vary) is decoded block by block into columns that grow
/// as the blocks prove their samples instead.
pub(crate) fn decode_all(src: &(impl Source + ?Sized), frame: &Frame) -> Result<SampleColumns, Error> {
    let blocks = frame.index.len();
    if frame.samples > frame.file_len {
        return decode_range(src, frame, 0..blocks);
    }
    // (first packed block, end, earliest time, latest time, samples, narrow)
    let narrow_ids = frame.threads <= 1 << 16;
    let mut segs: Vec<(usize, usize, u64, u64, usize, bool)> = Vec::new();
    for (i, e) in frame.index.iter().enumerate() {
        if let Some(s) = segs.last_mut().filter(|s| s.5) {
            let (lo, hi) = (s.2.min(e.min_time_us), s.3.max(e.max_time_us));
            if hi - lo < NARROW_SPAN {
                (s.1, s.2, s.3, s.4) = (i + 1, lo, hi, s.4 + e.count as usize);
                continue;
            }
        }
        let narrow = narrow_ids && e.max_time_us - e.min_time_us < NARROW_SPAN;
        segs.push((i, i + 1, e.min_time_us, e.max_time_us, e.count as usize, narrow));
    }
    // Ids small enough for the 7-byte compact columns (every id of a block
    // is checked below these counts before it is written).
    let compact = frame.threads <= 1 << 8 && frame.stacks <= 1 << 16;
    let kind = |narrow: bool| match (narrow, compact) {
        (true, true) => Kind::Compact,
        (true, false) => Kind::Narrow,
        (false, _) => Kind::Wide,
    };
    let mut cols: Vec<Block> = segs.iter().map(|s| Block::exact(s.2, s.4, kind(s.5))).collect();
    let mut jobs: Vec<(usize, AnyDest<'_>)> = Vec::with_capacity(blocks);
    for (s, b) in segs.iter().zip(&mut cols) {
        let mut rest = b.spare_mut();
        for i in s.0..s.1 {
            let (here, after) = rest.split_at(frame.index[i].count as usize);
            jobs.push((i, here));
            rest = after;
        }
    }
    debug_assert!(jobs.iter().all(|(i, d)| d.len() == frame.index[*i].count as usize));
    let two = blocks >= 4 && std::thread::available_parallelism().is_ok_and(|c| c.get() >= 2);
    if two {
        // Split where half the samples are decoded.
        let mut acc = 0u64;
        let split = jobs
            .iter()
            .position(|(i, _)| {
                acc += frame.index[*i].count as u64;
                2 * acc >= frame.samples
            })
            .map_or(jobs.len(), |p| p + 1);
        let second = jobs.split_off(split);
        let (a, b) = std::thread::scope(|sc| {
            let handle = std::thread::Builder::new()
                .name("spulse-unpack".into())
                .spawn_scoped(sc, || decode_jobs(src, frame, second))
                .map_err(|_| ());
            let a = decode_jobs(src, frame, jobs);
            let b = match handle {
                Ok(h) => Some(h.join().unwrap_or_else(|_| Err(corrupt(0, "decoder thread failed".into())))),
                // No second thread to be had (resource limits): the jobs
                // went with the failed spawn; decode the whole file again
                // below, on this thread.
                Err(()) => None,
            };
            (a, b)
        });
        // The first error in file order.
        a?;
        match b {
            Some(b) => b?,
            None => return decode_range(src, frame, 0..blocks),
        }
    } else {
        decode_jobs(src, frame, jobs)?;
    }
    for (s, b) in segs.iter().zip(&mut cols) {
        // Every job succeeded; `block_into` hands every index below a packed
        // block's count to the sink before it returns `Ok`.
        // SAFETY: the block was created empty and its jobs wrote its first `s.4`
        // samples (the sum of its packed blocks' counts) in disjoint parts, in full.
        unsafe { b.assume_written(s.4) };
    }
    Ok(SampleColumns::from_blocks(cols))
}
