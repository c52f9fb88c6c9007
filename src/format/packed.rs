//! The packed container (`spulse pack`): constants, the fixed-width fields of
//! its frame, and the codec of one block of samples. `FORMAT.md`, section 10,
//! specifies every byte; the writer is `crate::write::pack`, the readers
//! `crate::read::packed`.
//!
//! A block holds up to [`MAX_BLOCK_SAMPLES`] samples as three *coded
//! columns* (time deltas, thread ids, stack ids), then compressed as one LZ4
//! block (`lz4_flex`). A coded column is a per-block dictionary of the
//! column's distinct values (sorted, stored as bit-packed gaps) and, for each
//! value, a fixed-width code: the rank of the value among the block's most
//! frequent ones, or an escape whose dictionary index is in a second
//! fixed-width section. Every section is bit-packed at the narrowest width
//! its values need, so a value costs a few bits rather than whole bytes (LZ4
//! has no entropy coder; this is the part of one that fixed widths allow).
//! Decoding is table lookups on fixed-width bit fields, with no branch on the
//! data: see [`Column::decode_into`].

/// The eight bytes a packed file starts and ends with.
pub const PACKED_MAGIC: [u8; 8] = *b"SPULSPK2";

/// The magic of the first packed layout (byte-plane columns), which readers
/// recognise in order to refuse it with a clear message.
pub(crate) const PACKED_MAGIC_V1: [u8; 8] = *b"SPULSPK1";

/// Most samples in one block. Readers decode one block at a time into a
/// buffer bounded by this (see [`max_raw_len`]).
pub const MAX_BLOCK_SAMPLES: u32 = 1 << 16;

/// The fixed part at the start: magic, then the definitions' length (`u64`).
pub(crate) const HEAD_LEN: u64 = 16;

/// A block header: uncompressed bytes, compressed bytes, sample count (`u32` each).
pub(crate) const BLOCK_HEADER_LEN: u64 = 12;

/// One index entry: block offset, earliest and latest time (`u64` each),
/// sample count and compressed length (`u32` each).
pub(crate) const INDEX_ENTRY_LEN: u64 = 32;

/// The footer at the very end: index offset, block count, sample count
/// (`u64` each), then the magic again.
pub(crate) const FOOTER_LEN: u64 = 32;

/// Bytes of one sample as the readers expose it (time `u64`, thread and
/// stack `u32`): the "decoded columns" that memory use is measured against.
pub(crate) const SAMPLE_BYTES: usize = 16;

/// Bytes of a coded column's header.
pub(crate) const COLUMN_HEADER_LEN: usize = 24;

/// The widest code: a block's frequent-value table has at most
/// `2^MAX_CODE_WIDTH - 1` entries.
pub(crate) const MAX_CODE_WIDTH: u32 = 12;

/// Zero bytes after a decoded block in the readers' buffer, so that a bit
/// field near the end can be read with one 16-byte load.
pub(crate) const RAW_PADDING: usize = 16;

/// A bound on the bytes a valid block of `count` samples decodes to: the
/// first time, and per column its 24-byte header, at most `count - 1` gaps of
/// 64 bits, a frequent table of at most 4,095 entries of at most 16 bits, and
/// `count` codes and escapes of at most 12 and 16 bits: under
/// `8,216 + 12 × count` bytes a column. Readers refuse a larger
/// `uncompressed_bytes` before allocating for it (FORMAT.md, section 10).
pub(crate) fn max_raw_len(count: u32) -> u64 {
    8 + 3 * (8216 + 12 * count as u64)
}

/// The most output an LZ4 block of `compressed` bytes can decode to. Each
/// byte of a literal or match length extension adds at most 255 bytes of
/// output, so a block that claims more is corrupt whatever its content; the
/// readers check this before they allocate anything for the block.
pub(crate) fn max_decompressed(compressed: u64) -> u64 {
    compressed.saturating_mul(255).saturating_add(64)
}

/// One entry of the block index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IndexEntry {
    /// File offset of the block header.
    pub offset: u64,
    /// Earliest sample time in the block.
    pub min_time_us: u64,
    /// Latest sample time in the block.
    pub max_time_us: u64,
    /// Samples in the block.
    pub count: u32,
    /// Compressed payload bytes.
    pub compressed: u32,
}

impl IndexEntry {
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.min_time_us.to_le_bytes());
        out.extend_from_slice(&self.max_time_us.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.compressed.to_le_bytes());
    }

    pub(crate) fn decode(b: &[u8; INDEX_ENTRY_LEN as usize]) -> IndexEntry {
        IndexEntry {
            offset: le64(&b[0..8]),
            min_time_us: le64(&b[8..16]),
            max_time_us: le64(&b[16..24]),
            count: le32(&b[24..28]),
            compressed: le32(&b[28..32]),
        }
    }
}

pub(crate) fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

pub(crate) fn le32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

/// Bits needed for `v` (0 for 0).
#[inline]
pub(crate) fn bit_width(v: u64) -> u32 {
    64 - v.leading_zeros()
}

/// Appends values of a fixed bit width, least significant bit first; the
/// last byte is padded with zero bits.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u128,
    bits: u32,
}

impl<'a> BitWriter<'a> {
    fn new(out: &'a mut Vec<u8>) -> Self {
        BitWriter { out, acc: 0, bits: 0 }
    }

    #[inline]
    fn put(&mut self, v: u64, width: u32) {
        debug_assert!(width == 64 || v >> width == 0);
        self.acc |= (v as u128) << self.bits;
        self.bits += width;
        if self.bits >= 64 {
            self.out.extend_from_slice(&(self.acc as u64).to_le_bytes());
            self.acc >>= 64;
            self.bits -= 64;
        }
    }

    fn finish(self) {
        let bytes = self.bits.div_ceil(8) as usize;
        self.out.extend_from_slice(&self.acc.to_le_bytes()[..bytes]);
    }
}

/// Field `i` of `width` bits (at most 64) of the bit-packed section starting
/// at byte `at` of `raw`. `raw` extends at least [`RAW_PADDING`] bytes past
/// any section, so the 16-byte load stays inside it.
#[inline(always)]
fn field(raw: &[u8], at: usize, i: usize, width: u32) -> u64 {
    let bit = i * width as usize;
    let byte = at + bit / 8;
    let w = u128::from_le_bytes(raw[byte..byte + 16].try_into().expect("sixteen bytes"));
    let v = (w >> (bit % 8)) as u64;
    if width >= 64 {
        v
    } else {
        v & ((1u64 << width) - 1)
    }
}

/// As [`field`] for widths of at most 56 bits: one 8-byte load.
#[inline(always)]
fn narrow_field(raw: &[u8], at: usize, i: usize, width: u32) -> u64 {
    debug_assert!(width <= 56);
    let bit = i * width as usize;
    let byte = at + bit / 8;
    let w = u64::from_le_bytes(raw[byte..byte + 8].try_into().expect("eight bytes"));
    (w >> (bit % 8)) & ((1u64 << width) - 1)
}

/// Encode `vals` as a coded column onto `out`. `signed` orders the
/// dictionary as `i64` (time deltas, which may be negative) rather than
/// `u64`, so that its gaps stay small.
fn encode_column(vals: &[u64], signed: bool, out: &mut Vec<u8>) {
    let key = |v: u64| if signed { v ^ (1 << 63) } else { v };
    let mut dict: Vec<u64> = vals.iter().map(|&v| key(v)).collect();
    dict.sort_unstable();
    dict.dedup();
    let idx: Vec<u32> =
        vals.iter().map(|&v| dict.binary_search(&key(v)).expect("in the dictionary") as u32).collect();
    for d in &mut dict {
        *d = key(*d);
    }
    let (c, d) = (vals.len() as u64, dict.len() as u64);
    let wi = bit_width(d.saturating_sub(1));
    let gw = dict.windows(2).map(|w| bit_width(w[1].wrapping_sub(w[0]))).max().unwrap_or(0);
    let mut counts = vec![0u64; dict.len()];
    for &i in &idx {
        counts[i as usize] += 1;
    }
    // Dictionary indices, most frequent first.
    let mut order: Vec<u32> = (0..dict.len() as u32).collect();
    order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
    let mut covered = vec![0u64; order.len() + 1];
    for (r, &o) in order.iter().enumerate() {
        covered[r + 1] = covered[r] + counts[o as usize];
    }
    // The code width that makes codes, escapes and the frequent table
    // smallest (0: every value an escape, i.e. plain dictionary indices).
    let cost = |k: u32| -> (u64, u64) {
        if k == 0 {
            return (c * wi as u64, 0);
        }
        let f = d.min((1 << k) - 1);
        (c * k as u64 + (c - covered[f as usize]) * wi as u64 + f * wi as u64, f)
    };
    let k = (0..=MAX_CODE_WIDTH).min_by_key(|&k| cost(k).0).expect("some width");
    let f = cost(k).1;
    let esc = (1u64 << k) - 1;
    let m = c - covered[f as usize];

    out.extend_from_slice(&dict.first().copied().unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&(d as u32).to_le_bytes());
    out.push(gw as u8);
    out.push(k as u8);
    out.extend_from_slice(&(f as u16).to_le_bytes());
    out.extend_from_slice(&(m as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    let mut w = BitWriter::new(out);
    for g in dict.windows(2) {
        w.put(g[1].wrapping_sub(g[0]), gw);
    }
    w.finish();
    let mut w = BitWriter::new(out);
    for &o in &order[..f as usize] {
        w.put(o as u64, wi);
    }
    w.finish();
    let mut rank = vec![esc; dict.len()];
    for (r, &o) in order[..f as usize].iter().enumerate() {
        rank[o as usize] = r as u64;
    }
    let mut w = BitWriter::new(out);
    for &i in &idx {
        w.put(rank[i as usize], k);
    }
    w.finish();
    let mut w = BitWriter::new(out);
    for &i in idx.iter().filter(|&&i| rank[i as usize] == esc) {
        w.put(i as u64, wi);
    }
    w.finish();
}

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

/// Decompress an LZ4 payload of exactly `len` bytes into `raw[..len]`,
/// followed by [`RAW_PADDING`] zero bytes; the error says what was wrong.
pub(crate) fn decompress(payload: &[u8], len: usize, raw: &mut Vec<u8>) -> Result<(), String> {
    // Grown, never cleared: the decoder writes every byte it is asked for,
    // and only the padding must be zeros.
    if raw.len() < len + RAW_PADDING {
        raw.resize(len + RAW_PADDING, 0);
    }
    raw[len..len + RAW_PADDING].fill(0);
    match lz4_flex::block::decompress_into(payload, &mut raw[..len]) {
        Ok(n) if n == len => Ok(()),
        Ok(n) => Err(format!("decompresses to {n} bytes, not the {len} its header says")),
        Err(e) => Err(format!("LZ4 payload does not decode: {e}")),
    }
}

/// A parsed, checked coded column of a decoded block.
#[derive(Debug)]
pub(crate) struct Column {
    /// Values the column holds.
    count: usize,
    /// Code width (0: every value an escape).
    code_width: u32,
    /// Width of a dictionary index.
    index_width: u32,
    /// Start of the codes and escapes in the decoded block.
    codes_at: usize,
    escapes_at: usize,
    /// Escapes the codes announce.
    escapes: usize,
    /// Entries of the frequent table.
    frequent: usize,
    /// The value of each code below the frequent count (others unused).
    table: Vec<u64>,
    /// The dictionary.
    dict: Vec<u64>,
}

/// Bytes of a section of `n` fields of `width` bits.
fn section_len(n: u64, width: u32) -> u64 {
    (n * width as u64).div_ceil(8)
}

impl Column {
    /// Parse the coded column of `count` values at `*pos` of `raw` (the
    /// decoded block of `len` bytes, padded), moving `*pos` past it. Errors
    /// name the offset in the decoded block.
    pub(crate) fn parse(
        raw: &[u8],
        len: usize,
        pos: &mut usize,
        count: usize,
        what: &str,
    ) -> Result<Column, String> {
        let at = *pos;
        if len - at.min(len) < COLUMN_HEADER_LEN {
            return Err(format!("the {what} column's header at decoded byte {at} runs past the block's end"));
        }
        let h = &raw[at..at + COLUMN_HEADER_LEN];
        let base = le64(&h[0..8]);
        let d = le32(&h[8..12]) as u64;
        let (gw, k) = (h[12] as u32, h[13] as u32);
        let f = u16::from_le_bytes([h[14], h[15]]) as u64;
        let m = le32(&h[16..20]) as u64;
        let bad = |why: String| Err(format!("the {what} column at decoded byte {at}: {why}"));
        let c = count as u64;
        if d > c || (d == 0) != (c == 0) {
            return bad(format!("{d} distinct values for {c} values"));
        }
        if le32(&h[20..24]) != 0 {
            return bad("the reserved field is not zero".into());
        }
        if gw > 64 || k > MAX_CODE_WIDTH {
            return bad(format!(
                "gap width {gw} or code width {k} out of range (at most 64 and {MAX_CODE_WIDTH})"
            ));
        }
        let limit = if k == 0 { 0 } else { d.min((1 << k) - 1) };
        if f > limit {
            return bad(format!("{f} frequent values with code width {k} and {d} distinct values"));
        }
        if m > c || (k == 0 && m != c) {
            return bad(format!("{m} escapes for {c} values with code width {k}"));
        }
        let wi = bit_width(d.saturating_sub(1));
        let gaps_at = (at + COLUMN_HEADER_LEN) as u64;
        let freq_at = gaps_at + section_len(d.saturating_sub(1), gw);
        let codes_at = freq_at + section_len(f, wi);
        let escapes_at = codes_at + section_len(c, k);
        let end = escapes_at + section_len(m, wi);
        if end > len as u64 {
            return bad(format!("its sections end at decoded byte {end}, past the block's {len} bytes"));
        }
        let mut dict = Vec::with_capacity(d as usize);
        let mut v = base;
        for j in 0..d as usize {
            if j > 0 {
                v = v.wrapping_add(field(raw, gaps_at as usize, j - 1, gw));
            }
            dict.push(v);
        }
        // Unused codes (from `f` on) map to 0; `decode` refuses them.
        let mut table = vec![0u64; 1 << k];
        for (r, t) in table.iter_mut().enumerate().take(f as usize) {
            let i = narrow_field(raw, freq_at as usize, r, wi);
            if i >= d {
                return bad(format!("frequent value {r} is dictionary entry {i} of {d}"));
            }
            *t = dict[i as usize];
        }
        *pos = end as usize;
        Ok(Column {
            count,
            code_width: k,
            index_width: wi,
            codes_at: codes_at as usize,
            escapes_at: escapes_at as usize,
            escapes: m as usize,
            frequent: f as usize,
            table,
            dict,
        })
    }

    /// The largest dictionary value (every value of the column is one of
    /// them); `None` for an empty column.
    pub(crate) fn max_value(&self) -> Option<u64> {
        self.dict.iter().copied().max()
    }

    /// Every value `v` of the column, in order, as `map(v)` into `out`
    /// (exactly as long as the column; every element is written, also when
    /// this fails), using `bufs` for the escapes. The codes are checked as
    /// they go (each a frequent rank or the escape, the escapes as many as
    /// announced, each a dictionary index) without a branch on them: a bad
    /// one is noted and reported once the loop is done.
    #[inline(always)]
    pub(crate) fn decode_into<T>(
        &self,
        raw: &[u8],
        bufs: &mut DecodeBufs,
        out: &mut [T],
        mut map: impl FnMut(u64) -> T,
    ) -> Result<(), String> {
        let (k, wi, m) = (self.code_width, self.index_width, self.escapes);
        let d = self.dict.len();
        assert_eq!(out.len(), self.count);
        if self.count == 0 {
            return Ok(());
        }
        let bad_index = || Err(format!("an escape is not one of the {d} dictionary entries"));
        if k == 0 {
            // Every value an escape: plain dictionary indices.
            let dict = &self.dict[..];
            let mut top = 0u32;
            with_width!(wi, W => fields::<W, T>(raw, self.escapes_at, out, |x| {
                top = top.max(x);
                map(dict[(x as usize).min(d - 1)])
            }));
            return if top as usize >= d { bad_index() } else { Ok(()) };
        }
        let table = &self.table[..1 << k];
        if m == 0 {
            // No escapes: every code a frequent rank.
            let mut top = 0u32;
            with_width!(k, W => fields::<W, T>(raw, self.codes_at, out, |c| {
                top = top.max(c);
                map(table[c as usize & ((1 << W) - 1)])
            }));
            if top as usize >= self.frequent {
                return Err(format!("a code is not one of the {} frequent values", self.frequent));
            }
            return Ok(());
        }
        let esc_idx = unpack(raw, self.escapes_at, wi, m, &mut bufs.escapes);
        let bad = esc_idx.iter().copied().max().is_some_and(|i| i as usize >= d);
        // The escapes' values, then zeros up to one per code, so that
        // surplus escape codes (an error, reported below) read inside it.
        bufs.escaped.clear();
        bufs.escaped.extend(esc_idx.iter().map(|&i| self.dict[(i as usize).min(d - 1)]));
        bufs.escaped.resize(self.count + 1, 0);
        let escaped = &bufs.escaped[..];
        let frequent = self.frequent as u32;
        let (mut j, mut bad_code) = (0usize, false);
        with_width!(k, W => fields::<W, T>(raw, self.codes_at, out, |code| {
            // Both candidates loaded and one kept by a mask: a branch here
            // would be mispredicted at every escape.
            let esc = (1u32 << W) - 1;
            let is_esc = code == esc;
            bad_code |= !is_esc & (code >= frequent);
            let (e, f) = (escaped[j], table[code as usize & ((1 << W) - 1)]);
            let keep_e = (is_esc as u64).wrapping_neg();
            j += is_esc as usize;
            map((e & keep_e) | (f & !keep_e))
        }));
        if bad {
            return bad_index();
        }
        if bad_code {
            return Err(format!("a code is neither one of the {frequent} frequent values nor the escape"));
        }
        if j != m {
            return Err(format!("{j} escape codes for {m} escapes"));
        }
        Ok(())
    }
}

/// Run `$body` with `$W` a constant equal to `$width` (0 to 16), so that
/// the bit-field loops in it are compiled for each width.
macro_rules! with_width {
    ($width:expr, $W:ident => $body:expr) => {
        with_width!(@ $width, $W, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
    };
    (@ $width:expr, $W:ident, $body:expr, $($w:literal)*) => {
        match $width {
            $($w => {
                const $W: usize = $w;
                $body
            })*
            _ => unreachable!("field widths are at most 16 bits"),
        }
    };
}
use with_width;

/// `out[i] = f(field i)` for the `out.len()` fields of `W` bits (at most
/// 16) of the section at byte `at` of `raw` (padded), in order: eight fields
/// (`W` bytes) at a time, each an 8-byte load at a constant offset in the
/// group, a constant shift and a mask, which the compiler unrolls.
#[inline(always)]
fn fields<const W: usize, T>(raw: &[u8], at: usize, out: &mut [T], mut f: impl FnMut(u32) -> T) {
    let mask = ((1u64 << W) - 1) as u32;
    let groups = out.len().div_ceil(8);
    // Groups whose loads stay inside `raw`: the last load of a group reads
    // bytes `7 * W / 8 .. + 8` past its start.
    let reach = 7 * W / 8 + 8;
    let fast = match raw.len().checked_sub(at + reach) {
        Some(room) if W > 0 => (room / W + 1).min(out.len() / 8),
        Some(_) => out.len() / 8,
        None => 0,
    };
    let (head, tail) = out.split_at_mut(fast * 8);
    for (g, chunk) in head.chunks_exact_mut(8).enumerate() {
        let group = &raw[at + g * W..at + g * W + reach];
        for (j, o) in chunk.iter_mut().enumerate() {
            let (byte, shift) = (j * W / 8, j * W % 8);
            let word = u64::from_le_bytes(group[byte..byte + 8].try_into().expect("eight bytes"));
            *o = f((word >> shift) as u32 & mask);
        }
    }
    // The rest (a section at the very end of the block): through a copy
    // padded with zeros.
    for (g, chunk) in tail.chunks_mut(8).enumerate() {
        let g = fast + g;
        let mut b = [0u8; 24];
        let rest = raw.get(at + g * W..).unwrap_or(&[]);
        let n = rest.len().min(24);
        b[..n].copy_from_slice(&rest[..n]);
        for (j, o) in chunk.iter_mut().enumerate() {
            let (byte, shift) = (j * W / 8, j * W % 8);
            let word = u64::from_le_bytes(b[byte..byte + 8].try_into().expect("eight bytes"));
            *o = f((word >> shift) as u32 & mask);
        }
    }
    debug_assert!(groups >= fast);
}

/// Reusable buffers for [`Column::decode_into`].
#[derive(Debug, Default)]
pub(crate) struct DecodeBufs {
    escapes: Vec<u32>,
    escaped: Vec<u64>,
}

/// Unpack `n` fields of `width` bits (at most 16) from the section at byte
/// `at` of `raw` (padded) into `out`, which it returns.
fn unpack<'a>(raw: &[u8], at: usize, width: u32, n: usize, out: &'a mut Vec<u32>) -> &'a [u32] {
    if out.len() < n {
        out.resize(n, 0);
    }
    let out = &mut out[..n];
    with_width!(width, W => fields::<W, u32>(raw, at, out, |x| x));
    out
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
    // Every value of a column is one of its dictionary's, so checking the
    // dictionaries checks every sample's ids.
    if let Some(h) = hc.max_value().filter(|&h| h >= threads as u64) {
        return Err(BlockError::Undefined { what: "thread", id: h });
    }
    if let Some(s) = sc.max_value().filter(|&s| s >= stacks as u64) {
        return Err(BlockError::Undefined { what: "stack", id: s });
    }
    let layout = |what: &'static str| move |e: String| BlockError::Layout(format!("{what} column: {e}"));
    let range = sink.times(first, &tc, raw, bufs).map_err(layout("time"))?;
    sink.threads(&hc, raw, bufs).map_err(layout("thread"))?;
    sink.stacks(&sc, raw, bufs).map_err(layout("stack"))?;
    Ok(range)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(times: &[u64], threads: &[u32], stacks: &[u32]) {
        let n = times.len();
        let (mut raw, mut out) = (Vec::new(), Vec::new());
        let c = encode_block(times, threads, stacks, &mut raw, &mut out);
        let len = le32(&out[0..4]) as usize;
        assert_eq!(len, raw.len());
        assert!(len as u64 <= max_raw_len(n as u32));
        assert_eq!(le32(&out[4..8]), c);
        assert_eq!(le32(&out[8..12]) as usize, n);
        let mut dec = Vec::new();
        decompress(&out[12..], len, &mut dec).unwrap();
        let (mut t, mut h, mut s) = (vec![0; n], vec![0; n], vec![0; n]);
        let (lo, hi) = decode_block(
            &mut DecodeBufs::default(),
            &dec,
            len,
            n,
            u32::MAX as usize + 1,
            u32::MAX as usize + 1,
            &mut (&mut t[..], &mut h[..], &mut s[..]),
        )
        .unwrap();
        assert_eq!((&t[..], &h[..], &s[..]), (times, threads, stacks));
        assert_eq!(lo, *times.iter().min().unwrap());
        assert_eq!(hi, *times.iter().max().unwrap());
        // Ids are checked against the definitions.
        let max_h = *threads.iter().max().unwrap() as usize;
        let e = decode_block(
            &mut DecodeBufs::default(),
            &dec,
            len,
            n,
            max_h,
            usize::MAX,
            &mut (&mut t[..], &mut h[..], &mut s[..]),
        )
        .unwrap_err();
        assert!(matches!(e, BlockError::Undefined { what: "thread", id } if id == max_h as u64), "{e:?}");
        // A size the payload does not decode to is an error, not a panic.
        assert!(decompress(&out[12..], len - 1, &mut dec).is_err());
    }

    #[test]
    fn blocks_round_trip() {
        for n in [1u64, 2, 7, 1000, 1003, 65_536] {
            let times: Vec<u64> =
                (0..n).map(|i| 1_700_000_000_000_000u64.wrapping_add(i * 997 % 5000) ^ (i << 56)).collect();
            let threads: Vec<u32> = (0..n as u32).map(|i| i % 7).collect();
            let stacks: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 70_000).collect();
            round_trip(&times, &threads, &stacks);
        }
        // Extremes: every id at its largest, times at both ends of u64
        // (deltas of any size, both signs), one distinct value per column.
        round_trip(&[u64::MAX, 0, u64::MAX, 1 << 63], &[u32::MAX; 4], &[u32::MAX, 0, u32::MAX, 5]);
        round_trip(&[5; 300], &[0; 300], &[3; 300]);
        // Skewed values (escape codes and frequent ranks mixed).
        let zipf: Vec<u32> = (0..20_000u32).map(|i| if i % 3 == 0 { i * 7 } else { i % 5 }).collect();
        let times: Vec<u64> = (0..20_000u64).map(|i| 1000 * i + (i * 37) % 41).collect();
        round_trip(&times, &zipf, &zipf);
    }

    #[test]
    fn unpack_reads_every_width_up_to_the_end_of_the_block() {
        for width in 0..=16u32 {
            for n in [0usize, 1, 7, 8, 9, 100, 1001] {
                let vals: Vec<u64> =
                    (0..n as u64).map(|i| i.wrapping_mul(0x9E37_79B9) % (1 << width).max(1)).collect();
                // A section after 3 bytes of something else, and nothing after
                // it but the padding (the tightest case for the loads).
                let mut raw = vec![0xa5u8; 3];
                let mut w = BitWriter::new(&mut raw);
                for &v in &vals {
                    w.put(v, width);
                }
                w.finish();
                raw.extend_from_slice(&[0; RAW_PADDING]);
                let mut out = Vec::new();
                let got = unpack(&raw, 3, width, n, &mut out);
                assert!(got.iter().map(|&v| v as u64).eq(vals.iter().copied()), "width {width}, {n} values");
            }
        }
    }

    #[test]
    fn bit_fields_round_trip_at_every_width() {
        for width in 0..=64u32 {
            let vals: Vec<u64> = (0..77u64)
                .map(|i| {
                    i.wrapping_mul(0x9E37_79B9_7F4A_7C15) & if width == 64 { !0 } else { (1 << width) - 1 }
                })
                .collect();
            let mut out = Vec::new();
            let mut w = BitWriter::new(&mut out);
            for &v in &vals {
                w.put(v, width);
            }
            w.finish();
            assert_eq!(out.len() as u64, section_len(77, width));
            out.resize(out.len() + RAW_PADDING, 0);
            for (i, &v) in vals.iter().enumerate() {
                assert_eq!(field(&out, 0, i, width), v, "width {width}");
                if width <= 56 {
                    assert_eq!(narrow_field(&out, 0, i, width), v, "width {width}");
                }
            }
        }
    }
}
