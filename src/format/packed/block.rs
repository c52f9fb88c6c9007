//! One block of samples: encoding (three coded columns, LZ4), decompression,
//! parsing and checking, and decoding into a [`BlockSink`].

use super::*;

/// Encode one block (header and LZ4 payload) of `times.len()` samples onto
/// `out`, using `raw` as scratch. Returns the compressed payload's length.
pub(crate) fn encode_block(
    times: &[u64],
    threads: &[u32],
    stacks: &[u32],
    raw: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> u32 {
    let n = times.len();
    debug_assert!(n >= 1 && n == threads.len() && n == stacks.len() && n <= MAX_BLOCK_SAMPLES as usize);
    raw.clear();
    raw.extend_from_slice(&times[0].to_le_bytes());
    let deltas: Vec<u64> = times.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
    encode_column(&deltas, true, raw);
    encode_column(&threads.iter().map(|&v| v as u64).collect::<Vec<_>>(), false, raw);
    encode_column(&stacks.iter().map(|&v| v as u64).collect::<Vec<_>>(), false, raw);
    let compressed = lz4_flex::block::compress(raw);
    out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    out.extend_from_slice(&(compressed.len() as u32).to_le_bytes());
    out.extend_from_slice(&(n as u32).to_le_bytes());
    out.extend_from_slice(&compressed);
    compressed.len() as u32
}

#[cfg(test)]
/// Decompress an LZ4 payload of exactly `len` bytes into `raw[..len]`,
/// followed by [`RAW_PADDING`] zero bytes; the error says what was wrong.
pub(crate) fn decompress(payload: &[u8], len: usize, raw: &mut Vec<u8>) -> Result<(), String> {
    prepare_raw(raw, len);
    decompress_exact(payload, &mut raw[..len])
}

/// Make `raw` at least `len + RAW_PADDING` bytes long with zeros in
/// `raw[len..len + RAW_PADDING]`.
pub(crate) fn prepare_raw(raw: &mut Vec<u8>, len: usize) {
    // Grown, never cleared: the decoder writes every byte it is asked for,
    // and only the padding must be zeros.
    if raw.is_empty() {
        // A fresh buffer: zeroed pages from the allocator, not written twice.
        *raw = vec![0; len + RAW_PADDING];
    } else if raw.len() < len + RAW_PADDING {
        raw.resize(len + RAW_PADDING, 0);
    }
    raw[len..len + RAW_PADDING].fill(0);
}

/// Decompress an LZ4 payload that must decode to exactly `out.len()` bytes
/// into `out`; the error says what was wrong.
pub(crate) fn decompress_exact(payload: &[u8], out: &mut [u8]) -> Result<(), String> {
    let len = out.len();
    match lz4_flex::block::decompress_into(payload, out) {
        Ok(n) if n == len => Ok(()),
        Ok(n) => Err(format!("decompresses to {n} bytes, not the {len} its header says")),
        Err(e) => Err(format!("LZ4 payload does not decode: {e}")),
    }
}

/// Where a decoded block's samples go: each method decodes a column
/// (with [`Column::decode_into`]) straight into the sink's own storage.
pub(crate) trait BlockSink {
    /// The times: `first`, then each the previous plus the next delta of
    /// `deltas` (wrapping). Returns the earliest and latest.
    fn times(
        &mut self,
        first: u64,
        deltas: &Column,
        raw: &[u8],
        bufs: &mut DecodeBufs,
    ) -> Result<(u64, u64), String>;
    /// The thread ids (the caller has checked the dictionary: each is below
    /// the threads defined).
    fn threads(&mut self, ids: &Column, raw: &[u8], bufs: &mut DecodeBufs) -> Result<(), String>;
    /// The stack ids (checked likewise).
    fn stacks(&mut self, ids: &Column, raw: &[u8], bufs: &mut DecodeBufs) -> Result<(), String>;
}

/// The times of a block into `out` (one more than the deltas), each passed
/// through `to`; returns their extremes.
#[inline(always)]
pub(crate) fn times_into<O>(
    first: u64,
    deltas: &Column,
    raw: &[u8],
    bufs: &mut DecodeBufs,
    out: &mut [O],
    to: impl Fn(u64) -> O,
) -> Result<(u64, u64), String> {
    let (mut t, mut lo, mut hi) = (first, first, first);
    let (head, rest) = out.split_first_mut().expect("a block has a sample");
    *head = to(first);
    deltas.decode_into(raw, bufs, rest, |d| {
        t = t.wrapping_add(d);
        lo = lo.min(t);
        hi = hi.max(t);
        to(t)
    })?;
    Ok((lo, hi))
}

/// Why a decoded block is refused.
#[derive(Debug)]
pub(crate) enum BlockError {
    /// Its layout is inconsistent (the sentence says how).
    Layout(String),
    /// It names a thread or stack that is not defined.
    Undefined { what: &'static str, id: u64 },
}

/// The frame shared by [`decode_block`] and [`check_block`]: the block's
/// first time and its three column headers and dictionaries, which must fill
/// exactly `raw[..len]`, with every thread and stack id the dictionaries hold
/// defined (every value of a column is one of its dictionary's, so checking
/// the dictionaries checks every sample's ids).
pub(super) fn parse_block(
    raw: &[u8],
    len: usize,
    count: usize,
    threads: usize,
    stacks: usize,
) -> Result<(u64, [Column; 3]), BlockError> {
    debug_assert!(count >= 1 && raw.len() >= len + RAW_PADDING);
    if len < 8 {
        return Err(BlockError::Layout(format!("{len} decoded bytes hold no first time")));
    }
    let first = le64(&raw[0..8]);
    let mut pos = 8;
    let tc = Column::parse(raw, len, &mut pos, count - 1, "time").map_err(BlockError::Layout)?;
    let hc = Column::parse(raw, len, &mut pos, count, "thread").map_err(BlockError::Layout)?;
    let sc = Column::parse(raw, len, &mut pos, count, "stack").map_err(BlockError::Layout)?;
    if pos != len {
        return Err(BlockError::Layout(format!("the columns end at decoded byte {pos}, the block at {len}")));
    }
    if let Some(h) = hc.max_value().filter(|&h| h >= threads as u64) {
        return Err(BlockError::Undefined { what: "thread", id: h });
    }
    if let Some(s) = sc.max_value().filter(|&s| s >= stacks as u64) {
        return Err(BlockError::Undefined { what: "stack", id: s });
    }
    Ok((first, [tc, hc, sc]))
}

/// A column's layout error, named after the column.
pub(super) fn layout(what: &'static str) -> impl Fn(String) -> BlockError {
    move |e| BlockError::Layout(format!("{what} column: {e}"))
}

/// Decode the block of `count` samples held in `raw[..len]` (padded with
/// [`RAW_PADDING`] bytes) into `sink`, checking every id against the
/// `threads` and `stacks` defined and that the columns fill exactly `len`
/// bytes; returns the earliest and latest time.
pub(crate) fn decode_block(
    bufs: &mut DecodeBufs,
    raw: &[u8],
    len: usize,
    count: usize,
    threads: usize,
    stacks: usize,
    sink: &mut impl BlockSink,
) -> Result<(u64, u64), BlockError> {
    let (first, [tc, hc, sc]) = parse_block(raw, len, count, threads, stacks)?;
    let range = sink.times(first, &tc, raw, bufs).map_err(layout("time"))?;
    sink.threads(&hc, raw, bufs).map_err(layout("thread"))?;
    sink.stacks(&sc, raw, bufs).map_err(layout("stack"))?;
    Ok(range)
}

/// Where decoding can start inside a block kept coded: the state before
/// sample `c * CHUNK`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mark {
    /// The time of sample `c * CHUNK`.
    pub time: u64,
    /// Escape codes before it in the time (delta), thread and stack columns.
    pub esc: [u32; 3],
}

/// A block checked in full by [`check_block`], to be decoded chunk by chunk.
#[derive(Debug, Clone)]
pub(crate) struct CheckedBlock {
    /// The time deltas, thread ids and stack ids.
    pub cols: [Column; 3],
    /// One per [`CHUNK`] samples.
    pub marks: Vec<Mark>,
    /// Earliest, latest and last time.
    pub lo: u64,
    pub hi: u64,
    pub last: u64,
}

/// Check the block of `count` samples held in `raw[..len]` (padded with
/// [`RAW_PADDING`] bytes) as [`decode_block`] does, every code, escape and
/// id, without writing its samples anywhere: the times are summed chunk by
/// chunk to find their extremes and a [`Mark`] every [`CHUNK`] samples.
pub(crate) fn check_block(
    bufs: &mut DecodeBufs,
    raw: &[u8],
    len: usize,
    count: usize,
    threads: usize,
    stacks: usize,
) -> Result<CheckedBlock, BlockError> {
    let (first, [tc, hc, sc]) = parse_block(raw, len, count, threads, stacks)?;
    let chunks = count.div_ceil(CHUNK);
    let mut marks = Vec::with_capacity(chunks);
    let (lo, hi, last) = tc.check_times(raw, bufs, first, &mut marks).map_err(layout("time"))?;
    debug_assert_eq!(marks.len(), chunks);
    let escapes = |j: usize, m: usize| format!("{j} escape codes for {m} escapes");
    for (k, (col, what)) in [(&hc, "thread"), (&sc, "stack")].into_iter().enumerate() {
        col.check_escapes(raw, &mut bufs.codes).map_err(layout(what))?;
        let mut j = 0usize;
        for (c, mark) in marks.iter_mut().enumerate() {
            mark.esc[k + 1] = j as u32;
            let (s, e) = (c * CHUNK, ((c + 1) * CHUNK).min(count));
            j += col.check_codes(raw, &mut bufs.codes, s, e - s).map_err(layout(what))?;
        }
        if j != col.escapes {
            return Err(layout(what)(escapes(j, col.escapes)));
        }
    }
    Ok(CheckedBlock { cols: [tc, hc, sc], marks, lo, hi, last })
}

/// Plain columns as a sink (one block at a time, for `Replay` and tests).
impl BlockSink for (&mut [u64], &mut [u32], &mut [u32]) {
    fn times(
        &mut self,
        first: u64,
        deltas: &Column,
        raw: &[u8],
        bufs: &mut DecodeBufs,
    ) -> Result<(u64, u64), String> {
        times_into(first, deltas, raw, bufs, self.0, |t| t)
    }
    fn threads(&mut self, ids: &Column, raw: &[u8], bufs: &mut DecodeBufs) -> Result<(), String> {
        ids.decode_into(raw, bufs, self.1, |v| v as u32)
    }
    fn stacks(&mut self, ids: &Column, raw: &[u8], bufs: &mut DecodeBufs) -> Result<(), String> {
        ids.decode_into(raw, bufs, self.2, |v| v as u32)
    }
}
