//! Reading the packed container (`FORMAT.md`, section 10): the frame (footer,
//! index, definitions), one block at a time, and the two ways the readers use
//! it: [`Snapshot`](crate::Snapshot) checks every block at open and keeps
//! it decompressed but still coded (`coded.rs`; on two threads for a large
//! file), [`Replay`](crate::Replay) checks every block the same way at open,
//! one at a time, and decodes them again one by one while iterating.
//!
//! A packed file is written whole to a temporary name and renamed, so unlike a
//! spool it has no truncated tail to recover: a file cut anywhere lacks its
//! footer (or its index no longer matches its length) and is corrupt.
//! Every length read from the file is checked against the file's own length
//! before anything is allocated for it, and a block costs at most
//! [`MAX_BLOCK_SAMPLES`] samples of scratch (its decoded bytes are bounded by
//! `max_raw_len`, by its samples); FORMAT.md, section 10, "Memory", states
//! what a whole file may cost.

use std::fs::File;
use std::os::unix::fs::FileExt;

use super::coded::CodedBlock;
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

    /// The `len` bytes at `at`, if the source holds them in memory (no copy).
    fn slice_at(&self, _at: u64, _len: usize) -> Option<&[u8]> {
        None
    }
}

impl Source for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], at: u64) -> Result<(), Error> {
        let start = usize::try_from(at).ok().filter(|&s| s <= self.len());
        match start.and_then(|s| self.get(s..s.checked_add(buf.len())?)) {
            Some(src) => {
                buf.copy_from_slice(src);
                Ok(())
            }
            None => Err(Error::packed_corrupt(at, "the data ends before this field".into())),
        }
    }

    fn slice_at(&self, at: u64, len: usize) -> Option<&[u8]> {
        let s = usize::try_from(at).ok()?;
        self.get(s..s.checked_add(len)?)
    }
}

impl Source for File {
    fn read_exact_at(&self, buf: &mut [u8], at: u64) -> Result<(), Error> {
        match FileExt::read_exact_at(self, buf, at) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err(Error::format(at, FormatErrorKind::ChangedSinceOpen))
            }
            Err(e) => Err(Error::from(e)),
        }
    }
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
        return Err(Error::packed_corrupt(
            len,
            format!("a packed file is at least {} bytes; this one ends after {len}", HEAD_LEN + FOOTER_LEN),
        ));
    }
    let mut head = [0u8; HEAD_LEN as usize];
    src.read_exact_at(&mut head, 0)?;
    if head[..8] == PACKED_MAGIC_V1 {
        return Err(Error::packed_corrupt(
            0,
            "a packed file of the first layout (SPULSPK1, byte planes), which this version no longer reads: \
             pack the spool again"
                .into(),
        ));
    }
    let v3 = head[..8] == PACKED_MAGIC;
    if !v3 && head[..8] != PACKED_MAGIC_V2 {
        return Err(Error::format(0, FormatErrorKind::BadMagic));
    }
    let footer_at = len - FOOTER_LEN;
    let mut footer = [0u8; FOOTER_LEN as usize];
    src.read_exact_at(&mut footer, footer_at)?;
    if footer[24..] != head[..8] {
        return Err(Error::packed_corrupt(
            footer_at + 24,
            "no footer magic at the end: the file is truncated or was not written completely".into(),
        ));
    }
    let (index_at, blocks, samples) = (le64(&footer[0..8]), le64(&footer[8..16]), le64(&footer[16..24]));
    let index_len = blocks.checked_mul(INDEX_ENTRY_LEN);
    if index_len.and_then(|l| l.checked_add(index_at)) != Some(footer_at) {
        return Err(Error::packed_corrupt(
            footer_at,
            format!(
                "an index of {blocks} blocks at offset {index_at} does not end where the footer starts \
                 ({footer_at}): the file is truncated or corrupt"
            ),
        ));
    }
    // The definitions: stored as they are (second layout), or LZ4-compressed
    // (third layout), their offsets then counted from `HEAD_LEN_V3` as if
    // they were stored decoded.
    let defs_len = le64(&head[8..16]);
    let (defs_bytes, defs_base, defs_end) = if v3 {
        let mut c = [0u8; 8];
        src.read_exact_at(&mut c, HEAD_LEN)?;
        let comp = le64(&c);
        let end = match HEAD_LEN_V3.checked_add(comp) {
            Some(e) if e.checked_add(8).is_some_and(|m| m <= index_at) => e,
            _ => {
                return Err(Error::packed_corrupt(
                    HEAD_LEN,
                    format!(
                    "compressed definitions of {comp} bytes do not fit before the index at offset {index_at}"
                ),
                ))
            }
        };
        if defs_len > max_decompressed(comp) {
            return Err(Error::packed_corrupt(
                8,
                format!("{defs_len} bytes of definitions from {comp} compressed bytes (LZ4 decodes at most 255 a byte)"),
            ));
        }
        let mut payload = vec![0u8; comp as usize];
        src.read_exact_at(&mut payload, HEAD_LEN_V3)?;
        let mut bytes = vec![0u8; defs_len as usize];
        decompress_exact(&payload, &mut bytes)
            .map_err(|why| Error::packed_corrupt(HEAD_LEN_V3, format!("the definitions: {why}")))?;
        (bytes, HEAD_LEN_V3, end)
    } else {
        let end = match HEAD_LEN.checked_add(defs_len) {
            Some(e) if e.checked_add(8).is_some_and(|m| m <= index_at) => e,
            _ => {
                return Err(Error::packed_corrupt(
                    8,
                    format!(
                        "definitions of {defs_len} bytes do not fit before the index at offset {index_at}"
                    ),
                ))
            }
        };
        let mut bytes = vec![0u8; defs_len as usize];
        src.read_exact_at(&mut bytes, HEAD_LEN)?;
        (bytes, HEAD_LEN, end)
    };
    let mut m = [0u8; 8];
    src.read_exact_at(&mut m, defs_end)?;
    let mark_count = le64(&m);
    let marks_end = mark_count.checked_mul(8).and_then(|l| l.checked_add(defs_end + 8));
    let Some(marks_end) = marks_end.filter(|&e| e <= index_at) else {
        return Err(Error::packed_corrupt(
            defs_end,
            format!("{mark_count} event positions do not fit before the index"),
        ));
    };
    let mut mark_bytes = vec![0u8; (mark_count * 8) as usize];
    src.read_exact_at(&mut mark_bytes, defs_end + 8)?;
    let marks: Vec<u64> = mark_bytes.chunks_exact(8).map(le64).collect();
    // The stack table (third layout): the stack nodes taken out of the
    // definitions.
    let (table, data_start) = if v3 {
        let table_at = marks_end;
        if table_at + STACK_TABLE_HEAD_LEN > index_at {
            return Err(Error::packed_corrupt(
                table_at,
                "the stack table does not fit before the index".into(),
            ));
        }
        let mut h = [0u8; STACK_TABLE_HEAD_LEN as usize];
        src.read_exact_at(&mut h, table_at)?;
        let (count, raw_len, comp) = parse_stack_table_head(&h);
        let payload_at = table_at + STACK_TABLE_HEAD_LEN;
        if payload_at + comp as u64 > index_at {
            return Err(Error::packed_corrupt(
                table_at + 12,
                format!("a stack table payload of {comp} bytes does not fit before the index"),
            ));
        }
        let mut payload = vec![0u8; comp as usize];
        src.read_exact_at(&mut payload, payload_at)?;
        let nodes = decode_stack_table(count, raw_len, &payload)
            .map_err(|why| Error::packed_corrupt(table_at, format!("the stack table: {why}")))?;
        (Some((nodes, table_at)), payload_at + comp as u64)
    } else {
        (None, marks_end)
    };

    let mut index_bytes = vec![0u8; (blocks * INDEX_ENTRY_LEN) as usize];
    src.read_exact_at(&mut index_bytes, index_at)?;
    let mut index = Vec::with_capacity(blocks as usize);
    let (mut expect, mut total, mut payload_bytes) = (data_start, 0u64, 0u64);
    for (i, raw) in index_bytes.chunks_exact(INDEX_ENTRY_LEN as usize).enumerate() {
        let at = index_at + i as u64 * INDEX_ENTRY_LEN;
        let e = IndexEntry::decode(raw.try_into().expect("chunks of the entry length"));
        if e.offset != expect {
            return Err(Error::packed_corrupt(
                at,
                format!("index entry {i} puts block {i} at offset {}, but it starts at {expect}", e.offset),
            ));
        }
        if e.count == 0 || e.count > MAX_BLOCK_SAMPLES {
            return Err(Error::packed_corrupt(
                at,
                format!("index entry {i}: {} samples (a block holds 1 to {MAX_BLOCK_SAMPLES})", e.count),
            ));
        }
        if e.min_time_us > e.max_time_us {
            return Err(Error::packed_corrupt(
                at,
                format!("index entry {i}: earliest time after latest time"),
            ));
        }
        expect = e.offset + BLOCK_HEADER_LEN + e.compressed as u64;
        if expect > index_at {
            return Err(Error::packed_corrupt(
                at,
                format!("index entry {i}: block {i} runs past the index at {index_at}"),
            ));
        }
        total += e.count as u64;
        payload_bytes += e.compressed as u64;
        index.push(e);
    }
    if expect != index_at {
        return Err(Error::packed_corrupt(
            index_at,
            format!("{} bytes between the last block and the index", index_at - expect),
        ));
    }
    if total != samples {
        return Err(Error::packed_corrupt(
            footer_at + 16,
            format!("the footer counts {samples} samples, the index {total}"),
        ));
    }
    let table = table.as_ref().map(|(n, at)| (&n[..], *at));
    let mut defs = load_definitions(&defs_bytes, defs_base, &marks, defs_end + 8, samples, table)?;
    // Every sample counted; the running time after the last one is known once
    // its block is decoded, and readers set it then (`Frame::finish`). A file
    // without samples keeps the start time, as a spool does.
    defs.commit_samples(samples - defs.sample_count(), defs.last_time_us());
    let (threads, stacks) = (defs.threads().len(), defs.stack_count());
    Ok(Frame { defs, index, samples, file_len: len, payload_bytes, threads, stacks })
}

/// Decode the definitions section (a spool stream without sample records),
/// setting the sample position of each event record from `marks`, and
/// defining the nodes of the stack table (with the table's file offset)
/// where their records stood.
pub(crate) fn load_definitions(
    bytes: &[u8],
    base: u64,
    marks: &[u64],
    marks_at: u64,
    samples: u64,
    table: Option<(&[TableNode], u64)>,
) -> Result<Definitions, Error> {
    let (header, hlen) =
        record::decode_header(bytes).map_err(|(at, k)| Error::format(base + at as u64, k))?;
    let mut defs = Definitions::new(header);
    let (nodes, table_at) = table.unwrap_or((&[], 0));
    let mut next = 0usize;
    let mut pos = hlen;
    let mut k = 0usize;
    loop {
        define_table_nodes(&mut defs, nodes, &mut next, pos as u64, table_at)?;
        if pos >= bytes.len() {
            break;
        }
        let at = base + pos as u64;
        let t = bytes[pos];
        if t == tag::SAMPLE {
            return Err(Error::packed_corrupt(at, "a sample record in the definitions".into()));
        }
        if matches!(
            t,
            tag::PYTHON_RUNTIME
                | tag::PROCESS_MODULE_DEACTIVATION
                | tag::MODULE_DEACTIVATION
                | tag::OFF_CPU
                | tag::HEAP
        ) {
            let Some(&mark) = marks.get(k) else {
                return Err(Error::packed_corrupt(
                    at,
                    format!("more events than the {} positions given", marks.len()),
                ));
            };
            let before = defs.sample_count();
            if mark < before || mark > samples {
                return Err(Error::packed_corrupt(
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
                return Err(Error::packed_corrupt(at, "the definitions end inside a record".into()));
            }
            Err(DecodeError::Bad { at: field, kind }) => return Err(Error::format(at + field as u64, kind)),
        }
    }
    if let Some(n) = nodes.get(next) {
        return Err(Error::packed_corrupt(
            table_at,
            format!(
                "the stack table puts node {next} at offset {} of the definitions, past their {} bytes",
                n.at,
                bytes.len()
            ),
        ));
    }
    if k != marks.len() {
        return Err(Error::packed_corrupt(
            marks_at - 8,
            format!("{} event positions for {k} events", marks.len()),
        ));
    }
    Ok(defs)
}

/// Define the stack table's nodes from `*next` on that stood at offset `pos`
/// of the definitions (a record's start); a node placed before `pos` (inside
/// the header or a record) is corruption. A node breaking a rule of tag 3 is
/// reported at the table's offset `table_at`.
fn define_table_nodes(
    defs: &mut Definitions,
    nodes: &[TableNode],
    next: &mut usize,
    pos: u64,
    table_at: u64,
) -> Result<(), Error> {
    if nodes.get(*next).is_none_or(|n| n.at > pos) {
        // Called before every record of the definitions: nothing to do for
        // most of them, and nothing allocated then.
        return Ok(());
    }
    let mut rec = Vec::with_capacity(32);
    while let Some(n) = nodes.get(*next) {
        if n.at > pos {
            break;
        }
        if n.at < pos {
            return Err(Error::packed_corrupt(
                table_at,
                format!(
                    "the stack table puts node {} at offset {} of the definitions, which is no record's start",
                    *next, n.at
                ),
            ));
        }
        rec.clear();
        let id = defs.stack_count() as u64;
        record::encode(&record::Record::Stack { id, parent: n.parent, frame: n.frame }, &mut rec);
        match defs.read_record(&rec) {
            Ok(_) => {}
            Err(DecodeError::Bad { kind, .. }) => return Err(Error::format(table_at, kind)),
            Err(DecodeError::Incomplete) => {
                return Err(Error::packed_corrupt(
                    table_at,
                    format!("stack table node {} does not encode", *next),
                ))
            }
        }
        *next += 1;
    }
    Ok(())
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
        let (len, count) = self.read_block(src, i, &mut scratch.payload, &mut scratch.raw)?;
        let (lo, hi) =
            decode_block(&mut scratch.bufs, &scratch.raw, len, count, self.threads, self.stacks, sink)
                .map_err(|err| self.block_error(i, err))?;
        self.check_range(i, lo, hi)
    }

    /// Read, decompress and check block `i` in full (`Replay::open`), in
    /// `scratch`; returns its last time.
    pub(crate) fn check_coded(
        &self,
        src: &(impl Source + ?Sized),
        i: usize,
        scratch: &mut Scratch,
    ) -> Result<u64, Error> {
        let (len, count) = self.read_block(src, i, &mut scratch.payload, &mut scratch.raw)?;
        let checked = check_block(&mut scratch.bufs, &scratch.raw, len, count, self.threads, self.stacks)
            .map_err(|err| self.block_error(i, err))?;
        self.check_range(i, checked.lo, checked.hi)?;
        Ok(checked.last)
    }

    /// Read block `i`'s header and check it against the index and the
    /// limits. Returns the decoded length and the sample count.
    fn block_header(&self, src: &(impl Source + ?Sized), i: usize) -> Result<(usize, usize), Error> {
        let e = self.index[i];
        let mut head = [0u8; BLOCK_HEADER_LEN as usize];
        src.read_exact_at(&mut head, e.offset)?;
        let (raw_len, comp, count) = (le32(&head[0..4]), le32(&head[4..8]), le32(&head[8..12]));
        if count != e.count || comp != e.compressed {
            return Err(Error::packed_corrupt(
                e.offset,
                format!(
                    "block {i} holds {count} samples in {comp} bytes, its index entry says {} in {}",
                    e.count, e.compressed
                ),
            ));
        }
        if raw_len as u64 > max_raw_len(count) || raw_len as u64 > max_decompressed(comp as u64) {
            return Err(Error::packed_corrupt(
                e.offset,
                format!(
                    "block {i}: {raw_len} uncompressed bytes cannot hold {count} samples in {comp} compressed bytes \
                     (at most {} and {})",
                    max_raw_len(count),
                    max_decompressed(comp as u64)
                ),
            ));
        }
        Ok((raw_len as usize, count as usize))
    }

    /// Decompress block `i`'s payload (its header already checked, `len`
    /// decoded bytes) into `out`, exactly `len` bytes long.
    fn payload_into(
        &self,
        src: &(impl Source + ?Sized),
        i: usize,
        payload: &mut Vec<u8>,
        out: &mut [u8],
    ) -> Result<(), Error> {
        let e = self.index[i];
        let at = e.offset + BLOCK_HEADER_LEN;
        let comp = e.compressed as usize;
        let bytes = match src.slice_at(at, comp) {
            Some(b) => b,
            None => {
                payload.resize(comp, 0);
                src.read_exact_at(payload, at)?;
                &payload[..]
            }
        };
        decompress_exact(bytes, out).map_err(|m| Error::packed_corrupt(at, format!("block {i}: {m}")))
    }

    /// Read block `i`'s header and payload, check them against the index,
    /// and decompress the payload into `raw` (padded: see [`decompress`]).
    /// Returns the decoded length and the sample count.
    fn read_block(
        &self,
        src: &(impl Source + ?Sized),
        i: usize,
        payload: &mut Vec<u8>,
        raw: &mut Vec<u8>,
    ) -> Result<(usize, usize), Error> {
        let (len, count) = self.block_header(src, i)?;
        prepare_raw(raw, len);
        self.payload_into(src, i, payload, &mut raw[..len])?;
        Ok((len, count))
    }

    /// The error for block `i` refused by the codec.
    fn block_error(&self, i: usize, err: BlockError) -> Error {
        let e = self.index[i];
        match err {
            BlockError::Layout(m) => {
                Error::packed_corrupt(e.offset + BLOCK_HEADER_LEN, format!("block {i}: {m}"))
            }
            BlockError::Undefined { what, id } => {
                Error::format(e.offset, FormatErrorKind::UndefinedReference { what, id })
            }
        }
    }

    /// Check block `i`'s decoded time extremes against its index entry.
    fn check_range(&self, i: usize, lo: u64, hi: u64) -> Result<(), Error> {
        let e = self.index[i];
        if (lo, hi) != (e.min_time_us, e.max_time_us) {
            return Err(Error::packed_corrupt(
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
    let mut scratch = Scratch::default();
    let mut last = None;
    for i in 0..frame.index.len() {
        last = Some(frame.check_coded(src, i, &mut scratch)?);
    }
    Ok(last)
}

/// Blocks `range` of a packed file checked and kept coded, their decoded
/// bytes in one buffer sized from their headers (each followed by
/// [`RAW_PADDING`] zeros); the first error in file order.
fn load_range(
    src: &(impl Source + ?Sized),
    frame: &Frame,
    range: std::ops::Range<usize>,
) -> Result<Vec<CodedBlock>, Error> {
    // The headers first, to size the buffer; a bad header ends the range
    // there, and is reported once the blocks before it have been checked.
    let mut heads = Vec::with_capacity(range.len());
    let mut late = None;
    let mut total = 0usize;
    for i in range.clone() {
        match frame.block_header(src, i) {
            Ok((len, count)) => {
                heads.push((total, len, count));
                total += len + RAW_PADDING;
            }
            Err(e) => {
                late = Some(e);
                break;
            }
        }
    }
    // Each length is within `max_decompressed` of its payload, which lies
    // in the file: the total is bounded by the file's length.
    let mut arena = super::memory::zeroed_buffer(total).map_err(Error::from)?;
    // Huge pages: far fewer page faults for the megabytes about to be
    // written (measured: about a quarter less CPU for the whole open).
    super::memory::advise_huge_pages(&mut arena);
    let mut scratch = Scratch::default();
    let mut checked = Vec::with_capacity(heads.len());
    for (k, &(at, len, count)) in heads.iter().enumerate() {
        let i = range.start + k;
        frame.payload_into(src, i, &mut scratch.payload, &mut arena[at..at + len])?;
        let raw = &arena[at..at + len + RAW_PADDING];
        let c = check_block(&mut scratch.bufs, raw, len, count, frame.threads, frame.stacks)
            .map_err(|err| frame.block_error(i, err))?;
        frame.check_range(i, c.lo, c.hi)?;
        checked.push(c);
    }
    if let Some(e) = late {
        return Err(e);
    }
    let arena = std::sync::Arc::new(arena);
    Ok(heads
        .into_iter()
        .zip(checked)
        .map(|((at, len, count), checked)| CodedBlock { arena: arena.clone(), at, len, count, checked })
        .collect())
}

/// Every block of a packed file checked and kept coded (`Snapshot`), half of
/// them on a second thread when there are enough; the first error in file
/// order.
pub(crate) fn load_coded(src: &(impl Source + ?Sized), frame: &Frame) -> Result<Vec<CodedBlock>, Error> {
    let run = |range: std::ops::Range<usize>| load_range(src, frame, range);
    let blocks = frame.index.len();
    let two = blocks >= 4 && std::thread::available_parallelism().is_ok_and(|c| c.get() >= 2);
    if !two {
        return run(0..blocks);
    }
    // Split where half the samples are.
    let mut acc = 0u64;
    let split = frame
        .index
        .iter()
        .position(|e| {
            acc += e.count as u64;
            2 * acc >= frame.samples
        })
        .map_or(blocks, |p| p + 1);
    let (a, b) = std::thread::scope(|sc| {
        let handle =
            std::thread::Builder::new().name("spulse-unpack".into()).spawn_scoped(sc, || run(split..blocks));
        let a = run(0..split);
        let b = match handle {
            Ok(h) => {
                h.join().unwrap_or_else(|_| Err(Error::packed_corrupt(0, "decoder thread failed".into())))
            }
            // No second thread to be had (resource limits): this one does it.
            Err(_) => match a {
                Ok(_) => run(split..blocks),
                Err(_) => Ok(Vec::new()),
            },
        };
        (a, b)
    });
    let mut a = a?;
    a.extend(b?);
    Ok(a)
}
