//! The packed container (`spulse pack`): constants, the fixed-width fields of
//! its frame, and the codec of one block of samples. `FORMAT.md`, section 10,
//! specifies every byte; the writer is `crate::pack`, the readers
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

/// Whether `head` (the first bytes of a file) starts with the packed magic
/// (or that of the first packed layout, which the readers refuse by name).
pub(crate) fn is_packed(head: &[u8]) -> bool {
    head.starts_with(&PACKED_MAGIC) || head.starts_with(&PACKED_MAGIC_V1)
}

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

/// Samples between two checkpoints of a block kept coded in memory
/// (`crate::read::coded`): reading any sample decodes at most this many.
/// A multiple of 8, so that every checkpoint starts a group of bit fields.
pub(crate) const CHUNK: usize = 1024;

/// Zero bytes after a decoded block in the readers' buffer, so that a bit
/// field near the end can be read with one 16-byte load.
pub(crate) const RAW_PADDING: usize = 16;

/// A bound on the bytes a coded column of `c` values takes (see
/// [`max_raw_len`]): its 24-byte header, at most `c - 1` gaps of 64 bits (the
/// dictionary has at most `c` entries), a frequent table of at most
/// `min(c, 4,095)` entries of at most 16 bits, and `c` codes and at most `c`
/// escapes of at most 12 and 16 bits.
pub(crate) fn max_column_len(c: u64) -> u64 {
    24 + 8 * c + 2 * c.min((1 << MAX_CODE_WIDTH) - 1) + (7 * c).div_ceil(2)
}

/// A bound on the bytes a valid block of `count` samples decodes to: the
/// first time, the time column of `count - 1` deltas and the thread and
/// stack columns of `count` ids ([`max_column_len`]), so at most 99 bytes
/// plus 46.5 a sample. Readers refuse a larger `uncompressed_bytes` before
/// allocating for it (FORMAT.md, section 10), which bounds what a block
/// kept decoded costs by its samples, however well its payload compresses.
pub(crate) fn max_raw_len(count: u32) -> u64 {
    let c = count as u64;
    8 + max_column_len(c.saturating_sub(1)) + 2 * max_column_len(c)
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

/// A parsed, checked coded column of a decoded block.
#[derive(Debug, Clone)]
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
        // The table of `2^k` code values below is what a block kept coded
        // holds per column: a code width no wider than its frequent table
        // needs keeps it within twice the table (FORMAT.md, section 10).
        if k > 0 && f < 1 << (k - 1) {
            return bad(format!(
                "code width {k} for {f} frequent values (at most {} bits are needed)",
                bit_width(f)
            ));
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

    /// Check the escape section: each escape a dictionary index. Indices of
    /// 1 to 8 bits are compared with the dictionary's size straight from the
    /// packed bits ([`fields_below`]); wider ones are unpacked into `codes` a
    /// chunk at a time and their largest taken by a reduction the compiler
    /// vectorizes.
    pub(crate) fn check_escapes(&self, raw: &[u8], codes: &mut Vec<u16>) -> Result<(), String> {
        let d = self.dict.len();
        if (1..=8).contains(&self.index_width) && self.escapes > 0 {
            // Narrow indices (a column of a few threads, every value an
            // escape): compared with `d` straight from the packed bits.
            if !fields_below(raw, self.escapes_at, self.index_width, self.escapes, d as u64) {
                return Err(format!("an escape is not one of the {d} dictionary entries"));
            }
            return Ok(());
        }
        let mut top = 0u16;
        let mut start = 0;
        while start < self.escapes {
            let n = CHUNK.min(self.escapes - start);
            let cs = unpack_codes(raw, self.escapes_at, self.index_width, start, n, codes);
            top = top.max(cs.iter().copied().fold(0, u16::max));
            start += n;
        }
        if self.escapes > 0 && top as usize >= d {
            return Err(format!("an escape is not one of the {d} dictionary entries"));
        }
        Ok(())
    }

    /// Check the codes of values `start..start + n` (`start` a multiple of
    /// 8): each a frequent rank or the escape. Returns how many are escapes.
    /// With a full frequent table (every code but the escape a rank) and
    /// codes of up to 8 bits, only the escapes are counted, from the packed
    /// bits ([`count_escapes`]); otherwise the codes are unpacked into
    /// `codes` first, then checked by a branch-free reduction over them (see
    /// [`code_stats`]).
    pub(crate) fn check_codes(
        &self,
        raw: &[u8],
        codes: &mut Vec<u16>,
        start: usize,
        n: usize,
    ) -> Result<usize, String> {
        debug_assert!(start % 8 == 0 && start + n <= self.count);
        let k = self.code_width;
        if k == 0 {
            return Ok(n);
        }
        let frequent = self.frequent as u32;
        if frequent == (1 << k) - 1 && k <= 8 {
            // Every code is a frequent rank or the escape: only the escapes
            // need counting, straight from the packed bits.
            let escapes = count_escapes(raw, self.codes_at + start / 8 * k as usize, k, n);
            if self.escapes == 0 && escapes > 0 {
                return Err(format!("a code is not one of the {frequent} frequent values"));
            }
            return Ok(escapes);
        }
        let cs = unpack_codes(raw, self.codes_at, k, start, n, codes);
        let (escapes, top) = code_stats(cs, k);
        let bad = top > frequent;
        if self.escapes == 0 && (bad || escapes > 0) {
            return Err(format!("a code is not one of the {frequent} frequent values"));
        }
        if bad {
            return Err(format!("a code is neither one of the {frequent} frequent values nor the escape"));
        }
        Ok(escapes)
    }

    /// Check this column of time deltas (every code, escape and the escape
    /// count) and sum it from `first`, a chunk of codes at a time, pushing a [`Mark`] onto
    /// `marks` (its `esc[0]`) every [`CHUNK`] samples of the block's
    /// `self.count + 1`. Returns the earliest, latest and last time.
    pub(crate) fn check_times(
        &self,
        raw: &[u8],
        bufs: &mut DecodeBufs,
        first: u64,
        marks: &mut Vec<Mark>,
    ) -> Result<(u64, u64, u64), String> {
        let (k, wi, m, d) = (self.code_width, self.index_width, self.escapes, self.dict.len());
        let (mut t, mut lo, mut hi) = (first, first, first);
        let samples = self.count + 1;
        let chunks = samples.div_ceil(CHUNK);
        // The escapes' values, once for the block, and a zero that surplus
        // escape codes (an error, reported below) read.
        let mut top = 0u32;
        bufs.escaped.clear();
        if d > 0 {
            let dict = &self.dict[..];
            bufs.escaped.reserve(m + 1);
            let out = &mut bufs.escaped;
            with_width!(wi, W => fields::<W, ()>(raw, self.escapes_at, &mut vec![(); m][..], |i| {
                top = top.max(i);
                out.push(dict[(i as usize).min(d - 1)]);
            }));
        }
        bufs.escaped.push(0);
        if m > 0 && top as usize >= d {
            return Err(format!("an escape is not one of the {d} dictionary entries"));
        }
        let escaped = &bufs.escaped[..];
        if k == 0 {
            // Every value an escape, in order.
            for c in 0..chunks {
                marks.push(Mark { time: t, esc: [(c * CHUNK) as u32, 0, 0] });
                let (s, e) = (c * CHUNK, ((c + 1) * CHUNK).min(self.count));
                for &v in escaped.get(s..e).unwrap_or(&[]) {
                    t = t.wrapping_add(v);
                    lo = lo.min(t);
                    hi = hi.max(t);
                }
            }
            return Ok((lo, hi, t));
        }
        // Codes of `k` bits: each chunk's unpacked into `bufs.codes`, then
        // summed `GROUP` at a time. Code `2^k - 1` (the escape) and the
        // unused codes from `frequent` on read 0 from the table, and a
        // group's escapes are the next ones of `escaped`: its sum is that of
        // its table values and of those escapes. A group of deltas below
        // 2^40 whose sum does not carry the time past 2^64 - 1 only moves
        // time forward: its latest time is its last, its earliest the time
        // before it (already counted). Any other group (a delta that is
        // negative as a signed number, or huge) is summed one time at a time.
        const GROUP: usize = 16;
        let table = &self.table[..1 << k];
        debug_assert!(table[(1 << k) - 1] == 0);
        let frequent = self.frequent as u32;
        let esc_code = ((1u32 << k) - 1) as u16;
        // Whether no table value can move time back (or far): then only the
        // escapes' values need that test.
        let table_small = table.iter().all(|&v| v >> 40 == 0);
        let (mut j, mut top) = (0usize, 0u32);
        // One chunk's codes `$cs` (bytes or unpacked), group by group.
        macro_rules! sum_groups {
            ($cs:expr) => {
                for group in $cs.chunks(GROUP) {
                    let ne = group.iter().map(|&x| (u16::from(x) == esc_code) as u16).sum::<u16>() as usize;
                    let (mut sum, mut or) = (0u64, 0u64);
                    with_width!(k, W => {
                        // Codes are below 2^W: no bounds check in the loop.
                        let tab: &[u64; 1 << W] = table.try_into().expect("2^k entries");
                        if table_small {
                            for &x in group {
                                sum = sum.wrapping_add(tab[usize::from(x) & ((1 << W) - 1)]);
                            }
                        } else {
                            for &x in group {
                                let v = tab[usize::from(x) & ((1 << W) - 1)];
                                sum = sum.wrapping_add(v);
                                or |= v;
                            }
                        }
                    });
                    for &v in escaped.get(j.min(m)..(j + ne).min(m)).unwrap_or(&[]) {
                        sum = sum.wrapping_add(v);
                        or |= v;
                    }
                    match t.checked_add(sum) {
                        Some(end) if or >> 40 == 0 => {
                            hi = hi.max(end);
                            t = end;
                        }
                        _ => {
                            let mut jj = j;
                            for &x in group {
                                let v = if u16::from(x) == esc_code {
                                    jj += 1;
                                    escaped[(jj - 1).min(m)]
                                } else {
                                    table[usize::from(x)]
                                };
                                t = t.wrapping_add(v);
                                lo = lo.min(t);
                                hi = hi.max(t);
                            }
                        }
                    }
                    j += ne;
                }
            };
        }
        let mut codes = std::mem::take(&mut bufs.codes);
        for c in 0..chunks {
            marks.push(Mark { time: t, esc: [j as u32, 0, 0] });
            let (s, e) = (c * CHUNK, ((c + 1) * CHUNK).min(self.count));
            if s >= e {
                continue;
            }
            // Codes of 8 bits are the bytes themselves; others are
            // unpacked first.
            if k == 8 {
                let cs = &raw[self.codes_at + s..self.codes_at + e];
                top = top.max(code_stats(cs, k).1);
                sum_groups!(cs);
            } else {
                let cs = unpack_codes(raw, self.codes_at, k, s, e - s, &mut codes);
                top = top.max(code_stats(cs, k).1);
                sum_groups!(cs);
            }
        }
        bufs.codes = codes;
        let bad = top > frequent;
        if m == 0 && (bad || j > 0) {
            return Err(format!("a code is not one of the {frequent} frequent values"));
        }
        if bad {
            return Err(format!("a code is neither one of the {frequent} frequent values nor the escape"));
        }
        if j != m {
            return Err(format!("{j} escape codes for {m} escapes"));
        }
        Ok((lo, hi, t))
    }

    /// Values `start..start + out.len()` (`start` a multiple of 8) as
    /// `map(v)` into `out`, `esc_start` escape codes coming before `start`:
    /// for a column already checked ([`check_codes`](Self::check_codes),
    /// [`check_escapes`](Self::check_escapes) and the escape count), so
    /// nothing is checked here; out-of-range fields (impossible after those
    /// checks) read as some dictionary value, never out of bounds.
    #[inline(always)]
    pub(crate) fn decode_range<T>(
        &self,
        raw: &[u8],
        bufs: &mut DecodeBufs,
        start: usize,
        esc_start: usize,
        out: &mut [T],
        mut map: impl FnMut(u64) -> T,
    ) {
        let (k, wi, n) = (self.code_width, self.index_width, out.len());
        let d = self.dict.len();
        debug_assert!(start % 8 == 0 && start + n <= self.count);
        if n == 0 || d == 0 {
            return;
        }
        let dict = &self.dict[..];
        if k == 0 {
            let at = |w: usize| self.escapes_at + start / 8 * w;
            with_width!(wi, W => fields::<W, T>(raw, at(W), out, |x| map(dict[(x as usize).min(d - 1)])));
            return;
        }
        let table = &self.table[..1 << k];
        let at = |w: usize| self.codes_at + start / 8 * w;
        if self.escapes == 0 {
            with_width!(k, W => fields::<W, T>(raw, at(W), out, |c| map(table[c as usize & ((1 << W) - 1)])));
            return;
        }
        // The escapes from `esc_start` on (at most one per value), unpacked
        // from the 8-field group it is in.
        let base = esc_start.min(self.escapes) & !7;
        let skip = esc_start.min(self.escapes) - base;
        let window = (self.escapes - base).min(skip + n);
        // Their values, then zeros up to one per value past `skip`.
        if bufs.escaped.len() < skip + n + 1 {
            bufs.escaped.resize(skip + n + 1, 0);
        }
        let esc_at = self.escapes_at + base / 8 * wi as usize;
        let (values, zeros) = bufs.escaped.split_at_mut(window);
        with_width!(wi, W => fields::<W, u64>(raw, esc_at, values, |i| dict[(i as usize).min(d - 1)]));
        zeros.fill(0);
        let escaped = &bufs.escaped[skip..];
        let mut j = 0usize;
        with_width!(k, W => fields::<W, T>(raw, at(W), out, |code| {
            let is_esc = code == (1u32 << W) - 1;
            let (e, f) = (escaped[j], table[code as usize & ((1 << W) - 1)]);
            let keep_e = (is_esc as u64).wrapping_neg();
            j += is_esc as usize;
            map((e & keep_e) | (f & !keep_e))
        }));
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
#[derive(Debug, Default, Clone)]
pub(crate) struct DecodeBufs {
    escapes: Vec<u32>,
    escaped: Vec<u64>,
    /// One chunk's codes, unpacked (`check_block`).
    codes: Vec<u16>,
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

/// The fields `start..start + n` (`start` a multiple of 8) of width `k`
/// (at most 16: codes or dictionary indices) of the section at byte `at` of `raw`
/// (padded), unpacked into `out`, which it returns.
fn unpack_codes<'a>(
    raw: &[u8],
    at: usize,
    k: u32,
    start: usize,
    n: usize,
    out: &'a mut Vec<u16>,
) -> &'a [u16] {
    if out.len() < n {
        out.resize(n, 0);
    }
    let out = &mut out[..n];
    let at = |w: usize| at + start / 8 * w;
    with_width!(k, W => fields::<W, u16>(raw, at(W), out, |x| x as u16));
    out
}

/// How many of the `n` codes of `k` bits (1 to 8) packed from byte `at` of
/// `raw` (padded) are the escape, all `k` bits set. Eight codes fill `k`
/// bytes; in the 64-bit word loaded there, bit `j * k` of `x & x >> 1 & ...
/// & x >> (k - 1)` is set exactly when code `j` is all ones, so one masked
/// population count gives a group's escapes.
fn count_escapes(raw: &[u8], at: usize, k: u32, n: usize) -> usize {
    match k {
        1 => count_escapes_w::<1>(raw, at, n),
        2 => count_escapes_w::<2>(raw, at, n),
        3 => count_escapes_w::<3>(raw, at, n),
        4 => count_escapes_w::<4>(raw, at, n),
        5 => count_escapes_w::<5>(raw, at, n),
        6 => count_escapes_w::<6>(raw, at, n),
        7 => count_escapes_w::<7>(raw, at, n),
        8 => count_escapes_w::<8>(raw, at, n),
        _ => unreachable!("escapes are counted this way for codes of 1 to 8 bits"),
    }
}

#[inline(always)]
fn count_escapes_w<const W: usize>(raw: &[u8], at: usize, n: usize) -> usize {
    debug_assert!((1..=8).contains(&W));
    // Bit 0 of each of the eight fields of a group.
    let lows = (0..8).fold(0u64, |m, j| m | 1 << (j * W));
    let all_ones = |x: u64| (1..W).fold(x, |y, b| y & x >> b);
    // A group's word, through a copy padded with zeros where the eight
    // bytes would run past `raw`.
    let word = |g: usize| -> u64 {
        let mut b = [0u8; 8];
        let rest = raw.get(at + g * W..).unwrap_or(&[]);
        let len = rest.len().min(8);
        b[..len].copy_from_slice(&rest[..len]);
        u64::from_le_bytes(b)
    };
    let full = n / 8;
    // The groups whose word lies inside `raw`, loaded directly.
    let direct = raw.len().checked_sub(at + 8).map_or(0, |room| (room / W + 1).min(full));
    let mut count = 0u32;
    for g in 0..direct {
        let x = u64::from_le_bytes(raw[at + g * W..at + g * W + 8].try_into().expect("eight bytes"));
        count += (all_ones(x) & lows).count_ones();
    }
    for g in direct..full {
        count += (all_ones(word(g)) & lows).count_ones();
    }
    let tail = n % 8;
    if tail > 0 {
        // Only the first `tail` fields of the last group are codes.
        let keep = lows & ((1u64 << (tail * W)) - 1);
        count += (all_ones(word(full)) & keep).count_ones();
    }
    count as usize
}

/// Whether each of the `n` fields of `w` bits (1 to 8) packed from byte
/// `at` of `raw` is below `d` (1 to `2^w`). Eight fields fill `w` bytes, one
/// 64-bit word. Its even fields, masked apart so that each has the `w` bits
/// of the next field free above it, plus `2^w - d` in each carry into bit
/// `w` of the field exactly where the field is `d` or more; then the odd
/// fields, shifted onto the even places, the same way.
fn fields_below(raw: &[u8], at: usize, w: u32, n: usize, d: u64) -> bool {
    match w {
        1 => fields_below_w::<1>(raw, at, n, d),
        2 => fields_below_w::<2>(raw, at, n, d),
        3 => fields_below_w::<3>(raw, at, n, d),
        4 => fields_below_w::<4>(raw, at, n, d),
        5 => fields_below_w::<5>(raw, at, n, d),
        6 => fields_below_w::<6>(raw, at, n, d),
        7 => fields_below_w::<7>(raw, at, n, d),
        8 => fields_below_w::<8>(raw, at, n, d),
        _ => unreachable!("fields of 1 to 8 bits are compared this way"),
    }
}

#[inline(always)]
fn fields_below_w<const W: usize>(raw: &[u8], at: usize, n: usize, d: u64) -> bool {
    debug_assert!((1..=1 << W).contains(&d));
    let field = (1u64 << W) - 1;
    let evens = [0, 2, 4, 6].iter().fold(0u64, |m, j| m | field << (j * W));
    let add = [0, 2, 4, 6].iter().fold(0u64, |m, j| m | ((1 << W) - d) << (j * W));
    let carries = [0, 2, 4, 6].iter().fold(0u64, |m, j| m | 1 << (j * W + W));
    let over = |x: u64| (((x & evens) + add) | (((x >> W) & evens) + add)) & carries;
    let mut bad = 0u64;
    let (full, tail) = (n / 8, n % 8);
    // The groups whose word lies inside `raw`, loaded directly.
    let direct = raw.len().checked_sub(at + 8).map_or(0, |room| (room / W + 1).min(full));
    for g in 0..direct {
        bad |= over(u64::from_le_bytes(raw[at + g * W..at + g * W + 8].try_into().expect("eight bytes")));
    }
    // The rest through a copy padded with zeros; of the last group only the
    // first `tail` fields (zeros are below any `d`).
    for g in direct..n.div_ceil(8) {
        let mut b = [0u8; 8];
        let rest = raw.get(at + g * W..).unwrap_or(&[]);
        let len = rest.len().min(8);
        b[..len].copy_from_slice(&rest[..len]);
        let keep = if g == full { (1u64 << (tail * W)) - 1 } else { u64::MAX };
        bad |= over(u64::from_le_bytes(b) & keep);
    }
    bad == 0
}

/// For codes of `k` bits (1 to 12): how many are the escape (`2^k - 1`),
/// and the largest of `(code + 1) mod 2^k` (0 for the escape, `r + 1` for
/// frequent rank `r`), so that every code is valid exactly when that is at
/// most the frequent table's length. A reduction without branches, which
/// the compiler vectorizes.
#[inline(always)]
fn code_stats<C: Copy + Into<u16>>(codes: &[C], k: u32) -> (usize, u32) {
    let mask = ((1u32 << k) - 1) as u16;
    let (mut escapes, mut top) = (0u16, 0u16);
    // At most 2^16 - 1 codes per call (a chunk), so the count fits.
    debug_assert!(codes.len() < 1 << 16);
    for &c in codes {
        let y = c.into().wrapping_add(1) & mask;
        top = top.max(y);
        escapes += (y == 0) as u16;
    }
    (escapes as usize, top as u32)
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
fn parse_block(
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
fn layout(what: &'static str) -> impl Fn(String) -> BlockError {
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
        // Checked without decoding, then read back chunk by chunk from the
        // checkpoints, as a `Snapshot` does.
        let big = u32::MAX as usize + 1;
        let c = check_block(&mut DecodeBufs::default(), &dec, len, n, big, big).unwrap();
        assert_eq!((c.lo, c.hi, c.last), (lo, hi, times[n - 1]));
        assert_eq!(c.marks.len(), n.div_ceil(CHUNK));
        let mut bufs = DecodeBufs::default();
        for (k, m) in c.marks.iter().enumerate() {
            let (s, e) = (k * CHUNK, ((k + 1) * CHUNK).min(n));
            assert_eq!(m.time, times[s]);
            let mut t = m.time;
            let mut got = vec![0u64; e - s - 1];
            c.cols[0].decode_range(&dec, &mut bufs, s, m.esc[0] as usize, &mut got, |d| {
                t = t.wrapping_add(d);
                t
            });
            assert_eq!(got, times[s + 1..e], "times of chunk {k}");
            for (col, want) in [(&c.cols[1], threads), (&c.cols[2], stacks)].into_iter().zip([1, 2]) {
                let mut got = vec![0u32; e - s];
                col.0.decode_range(&dec, &mut bufs, s, m.esc[want] as usize, &mut got, |v| v as u32);
                assert_eq!(got, col.1[s..e], "column {want} of chunk {k}");
            }
        }
        // Ids are checked as `decode_block` checks them.
        let max_s = *stacks.iter().max().unwrap() as usize;
        assert!(matches!(
            check_block(&mut DecodeBufs::default(), &dec, len, n, big, max_s),
            Err(BlockError::Undefined { what: "stack", .. })
        ));
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
        for n in [1u64, 2, 7, 1000, 1003, 1024, 1025, 2049, 65_536] {
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
        let profile: Vec<u32> = (0..20_000u32).map(|i| if i % 3 == 0 { i * 7 } else { i % 5 }).collect();
        let times: Vec<u64> = (0..20_000u64).map(|i| 1000 * i + (i * 37) % 41).collect();
        round_trip(&times, &profile, &profile);
    }

    /// An escape that is not a dictionary index is refused by `check_block`
    /// wherever it is in the escape section (the check goes a chunk of
    /// indices at a time).
    #[test]
    fn an_escape_past_the_dictionary_is_an_error() {
        let n = 6000u64;
        let times: Vec<u64> = (0..n).map(|i| 1000 * i).collect();
        let threads: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        let stacks: Vec<u32> = (0..n as u32).map(|i| if i % 3 == 0 { i * 7 } else { i % 5 }).collect();
        let (mut raw, mut out) = (Vec::new(), Vec::new());
        encode_block(&times, &threads, &stacks, &mut raw, &mut out);
        let len = le32(&out[0..4]) as usize;
        let mut dec = Vec::new();
        decompress(&out[12..], len, &mut dec).unwrap();
        let mut pos = 8;
        let _ = Column::parse(&dec, len, &mut pos, n as usize - 1, "time").unwrap();
        let _ = Column::parse(&dec, len, &mut pos, n as usize, "thread").unwrap();
        let sc = Column::parse(&dec, len, &mut pos, n as usize, "stack").unwrap();
        let (wi, d, m) = (sc.index_width as usize, sc.dict.len(), sc.escapes);
        assert!(m > CHUNK + 3 && d < 1 << wi, "{m} escapes, {d} entries of {wi} bits");
        let big = u32::MAX as usize + 1;
        assert!(check_block(&mut DecodeBufs::default(), &dec, len, n as usize, big, big).is_ok());
        for j in [0, CHUNK + 3, m - 1] {
            let mut bad = dec.clone();
            for b in j * wi..(j + 1) * wi {
                bad[sc.escapes_at + b / 8] |= 1 << (b % 8);
            }
            match check_block(&mut DecodeBufs::default(), &bad, len, n as usize, big, big) {
                Err(BlockError::Layout(msg)) => {
                    assert!(msg.contains("stack column: an escape is not one of the"), "{msg}")
                }
                other => panic!("escape {j}: {other:?}"),
            }
        }
    }

    /// `check_times` sums a group of deltas at once when they only move time
    /// forward without wrapping, and one at a time otherwise: its extremes
    /// must equal the samples' in every mix of the two (`round_trip` compares
    /// them with the true minimum and maximum).
    #[test]
    fn time_extremes_in_every_kind_of_group() {
        let n = 5000u64;
        let ids: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        // Rising, with a step back every 37 samples (and a larger one in a
        // group of its own), or only rising.
        let mut t = 1_700_000_000_000_000u64;
        let mut back = Vec::new();
        for i in 0..n {
            t = match i {
                _ if i % 37 == 36 => t - 150,
                2000 => t - 1_000_000,
                _ => t + 100 + i % 7,
            };
            back.push(t);
        }
        round_trip(&back, &ids, &ids);
        let rising: Vec<u64> = (0..n).map(|i| 1000 + 10 * i + i % 3).collect();
        round_trip(&rising, &ids, &ids);
        // Rising until the time wraps past 2^64 - 1 (small deltas, whose sum
        // overflows in the group where it happens).
        let wrap: Vec<u64> = (0..n).map(|i| (u64::MAX - 20_000).wrapping_add(7 * i)).collect();
        round_trip(&wrap, &ids, &ids);
        // Rising by deltas of 2^40 and more (summed one at a time).
        let big: Vec<u64> = (0..n).map(|i| i * (1 << 40) + i % 5).collect();
        round_trip(&big, &ids, &ids);
        // A group whose deltas wrap to a small sum although its times dip
        // below every other and peak above: only its first sample and last
        // time would be seen if it were summed at once.
        let mut dip: Vec<u64> = vec![1_000_000, 0, 5_000_000, 1_000_001];
        dip.extend((4..n).map(|i| 1_000_000 + i));
        round_trip(&dip, &ids, &ids);
        // The largest delta of a group the fast way, then one too large.
        let edge: Vec<u64> = (0..n).map(|i| i * ((1 << 40) - 1) + (i / 100) * 2).collect();
        round_trip(&edge, &ids, &ids);
        // As a profile's deltas are: hundreds of distinct values, a few of
        // them frequent (8-bit codes, read as the bytes themselves), the rare
        // ones escapes, some of those steps back.
        let n = 20_000u64;
        let ids: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        let mut t = 1_700_000_000_000_000u64;
        let mut profile = Vec::new();
        for i in 0..n {
            // Every 44th a rare delta (one of about 450, a fifth of them
            // steps back), the others among 255 frequent ones.
            let r = i / 44;
            t = match i % 44 {
                43 if r % 5 == 0 => t - (r + 1),
                43 => t + 100_000 + r,
                _ => t + 1000 + (i * 7919) % 255,
            };
            profile.push(t);
        }
        let (mut raw, mut out) = (Vec::new(), Vec::new());
        encode_block(&profile, &ids, &ids, &mut raw, &mut out);
        let mut dec = Vec::new();
        decompress(&out[12..], raw.len(), &mut dec).unwrap();
        let time = Column::parse(&dec, raw.len(), &mut 8, profile.len() - 1, "time").unwrap();
        assert_eq!(time.code_width, 8, "{} distinct deltas, {} escapes", time.dict.len(), time.escapes);
        assert!(time.escapes > 0 && time.dict.iter().any(|&d| d >> 63 == 1));
        round_trip(&profile, &ids, &ids);
    }

    #[test]
    fn escapes_counted_from_packed_bits_at_every_width() {
        for width in 1..=8u32 {
            let esc = (1u64 << width) - 1;
            for n in [0usize, 1, 7, 8, 9, 100, 1001] {
                // Escapes at irregular places, and every other code too.
                let vals: Vec<u64> = (0..n as u64)
                    .map(|i| if i % 3 == 0 || i % 7 == 5 { esc } else { i.wrapping_mul(0x9E37_79B9) % esc })
                    .collect();
                let want = vals.iter().filter(|&&v| v == esc).count();
                // Ones after the section (what follows a column), and with
                // no padding: the tail's fields must not be counted, and the
                // loads must stay inside.
                for after in [&[0xffu8; 9][..], &[]] {
                    let mut raw = vec![0x5au8; 3];
                    let mut w = BitWriter::new(&mut raw);
                    for &v in &vals {
                        w.put(v, width);
                    }
                    w.finish();
                    let end = 3 + section_len(n as u64, width) as usize;
                    raw.truncate(end);
                    raw.extend_from_slice(after);
                    assert_eq!(count_escapes(&raw, 3, width, n), want, "width {width}, {n} codes");
                }
            }
        }
    }

    #[test]
    fn fields_compared_with_a_bound_from_packed_bits_at_every_width() {
        for width in 1..=8u32 {
            let top = 1u64 << width;
            for d in [1, 2, top / 2 + 1, top - 1, top].into_iter().filter(|&d| (1..=top).contains(&d)) {
                for n in [1usize, 7, 8, 9, 100, 1001] {
                    // Every field below `d`, then one field (first, middle,
                    // last) set to each value from `d` on.
                    let ok: Vec<u64> = (0..n as u64).map(|i| i.wrapping_mul(0x9E37_79B9) % d).collect();
                    let mut cases = vec![(ok.clone(), true)];
                    for at in [0, n / 2, n - 1] {
                        for v in d..top {
                            let mut bad = ok.clone();
                            bad[at] = v;
                            cases.push((bad, false));
                        }
                    }
                    for (vals, want) in cases {
                        // Ones after the section: fields past `n` are not compared.
                        let mut raw = vec![0x5au8; 3];
                        let mut w = BitWriter::new(&mut raw);
                        for &v in &vals {
                            w.put(v, width);
                        }
                        w.finish();
                        raw.truncate(3 + section_len(n as u64, width) as usize);
                        raw.extend_from_slice(&[0xff; 9]);
                        assert_eq!(
                            fields_below(&raw, 3, width, n, d),
                            want,
                            "width {width}, d {d}, {vals:?}"
                        );
                    }
                }
            }
        }
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
