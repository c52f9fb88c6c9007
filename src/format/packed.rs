//! The packed container (`spulse pack`): constants, the fixed-width fields of
//! its frame, and the codec of one block of samples. `FORMAT.md`, section 10,
//! specifies every byte; the writer is `crate::write::pack`, the readers
//! `crate::read::packed`.
//!
//! A block holds up to [`MAX_BLOCK_SAMPLES`] samples as three fixed-width
//! little-endian columns (time `u64`, thread `u32`, stack `u32`), each column
//! stored byte plane by byte plane (all least significant bytes, then all
//! next bytes, ...), then compressed as one LZ4 block (`lz4_flex`). The
//! planes put the bytes that hardly change (the high bytes of timestamps and
//! ids) next to each other, where LZ4 finds long matches: a profile's columns
//! compress to about half the size they do value by value.

/// The eight bytes a packed file starts and ends with.
pub const PACKED_MAGIC: [u8; 8] = *b"SPULSPK1";

/// Most samples in one block. Readers allocate one block's columns at a time
/// (16 bytes a sample: 1 MiB), so this bounds the memory a block can cost.
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

/// Bytes of one decoded sample (time, thread, stack).
pub(crate) const SAMPLE_BYTES: usize = 16;

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
    debug_assert!(n == threads.len() && n == stacks.len() && n <= MAX_BLOCK_SAMPLES as usize);
    raw.clear();
    raw.resize(n * SAMPLE_BYTES, 0);
    let (t, rest) = raw.split_at_mut(n * 8);
    let (h, s) = rest.split_at_mut(n * 4);
    for (i, v) in times.iter().enumerate() {
        for (k, b) in v.to_le_bytes().into_iter().enumerate() {
            t[k * n + i] = b;
        }
    }
    for (col, vals) in [(h, threads), (s, stacks)] {
        for (i, v) in vals.iter().enumerate() {
            for (k, b) in v.to_le_bytes().into_iter().enumerate() {
                col[k * n + i] = b;
            }
        }
    }
    let compressed = lz4_flex::block::compress(raw);
    out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    out.extend_from_slice(&(compressed.len() as u32).to_le_bytes());
    out.extend_from_slice(&(n as u32).to_le_bytes());
    out.extend_from_slice(&compressed);
    compressed.len() as u32
}

/// What decoding a block found, for the checks against the index and the
/// definitions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockStats {
    pub min_time_us: u64,
    pub max_time_us: u64,
    /// The largest thread and stack id in the block.
    pub max_thread: u32,
    pub max_stack: u32,
}

/// Decompress an LZ4 payload of exactly `raw.len()` bytes into `raw`; the
/// error says what was wrong.
pub(crate) fn decompress(payload: &[u8], raw: &mut [u8]) -> Result<(), String> {
    match lz4_flex::block::decompress_into(payload, raw) {
        Ok(n) if n == raw.len() => Ok(()),
        Ok(n) => Err(format!("decompresses to {n} bytes, not the {} its header says", raw.len())),
        Err(e) => Err(format!("LZ4 payload does not decode: {e}")),
    }
}

/// Undo the byte planes of a decompressed block of `times.len()` samples
/// (`raw` holds `16 * n` bytes) into the three columns, and measure them.
pub(crate) fn unplane(raw: &[u8], times: &mut [u64], threads: &mut [u32], stacks: &mut [u32]) -> BlockStats {
    let n = times.len();
    assert!(raw.len() == n * SAMPLE_BYTES && threads.len() == n && stacks.len() == n);
    let (t, rest) = raw.split_at(n * 8);
    let (h, s) = rest.split_at(n * 4);
    let (min_time_us, max_time_us) = unplane_n::<8, u64>(t, times);
    let (_, max_thread) = unplane_n::<4, u32>(h, threads);
    let (_, max_stack) = unplane_n::<4, u32>(s, stacks);
    BlockStats { min_time_us, max_time_us, max_thread, max_stack }
}

/// Transpose an 8 x 8 byte matrix held as eight little-endian rows: byte `c`
/// of `a[r]` moves to byte `r` of `a[c]`. Three rounds of block swaps (4 x 4,
/// then 2 x 2, then single bytes), each a few shifts and masks per row.
#[inline(always)]
fn transpose8(a: &mut [u64; 8]) {
    for i in 0..4 {
        let t = ((a[i] >> 32) ^ a[i + 4]) & 0x0000_0000_ffff_ffff;
        a[i] ^= t << 32;
        a[i + 4] ^= t;
    }
    for i in [0, 1, 4, 5] {
        let t = ((a[i] >> 16) ^ a[i + 2]) & 0x0000_ffff_0000_ffff;
        a[i] ^= t << 16;
        a[i + 2] ^= t;
    }
    for i in [0, 2, 4, 6] {
        let t = ((a[i] >> 8) ^ a[i + 1]) & 0x00ff_00ff_00ff_00ff;
        a[i] ^= t << 8;
        a[i + 1] ^= t;
    }
}

/// Undo `W` byte planes of `out.len()` values, eight values at a time (the
/// eight bytes of each plane for them are one row of [`transpose8`]); returns
/// their minimum and maximum (`(MAX, MIN)` for none).
#[inline(always)]
fn unplane_n<const W: usize, T: Copy + Ord + Planed<W>>(col: &[u8], out: &mut [T]) -> (T, T) {
    let n = out.len();
    let planes: [&[u8]; W] = std::array::from_fn(|k| &col[k * n..(k + 1) * n]);
    let (mut lo, mut hi) = (T::MAX, T::MIN);
    let whole = n - n % 8;
    for (c, chunk) in out[..whole].chunks_exact_mut(8).enumerate() {
        let at = c * 8;
        let mut rows = [0u64; 8];
        for (row, plane) in rows.iter_mut().zip(planes) {
            *row = u64::from_le_bytes(plane[at..at + 8].try_into().expect("eight bytes"));
        }
        transpose8(&mut rows);
        for (o, &v) in chunk.iter_mut().zip(&rows) {
            let v = T::truncate(v);
            *o = v;
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    for i in whole..n {
        let v = T::from_le(std::array::from_fn(|k| planes[k][i]));
        out[i] = v;
        lo = lo.min(v);
        hi = hi.max(v);
    }
    (lo, hi)
}

/// An unsigned integer of `W` bytes, rebuilt from its little-endian bytes.
trait Planed<const W: usize>: Sized {
    const MIN: Self;
    const MAX: Self;
    fn from_le(b: [u8; W]) -> Self;
    /// The value in the low `W` bytes of `v` (the rest are zero).
    fn truncate(v: u64) -> Self;
}
impl Planed<8> for u64 {
    const MIN: u64 = 0;
    const MAX: u64 = u64::MAX;
    #[inline(always)]
    fn from_le(b: [u8; 8]) -> u64 {
        u64::from_le_bytes(b)
    }
    #[inline(always)]
    fn truncate(v: u64) -> u64 {
        v
    }
}
impl Planed<4> for u32 {
    const MIN: u32 = 0;
    const MAX: u32 = u32::MAX;
    #[inline(always)]
    fn from_le(b: [u8; 4]) -> u32 {
        u32::from_le_bytes(b)
    }
    #[inline(always)]
    fn truncate(v: u64) -> u32 {
        v as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose8_moves_byte_c_of_row_r_to_byte_r_of_row_c() {
        let mut a: [u64; 8] =
            std::array::from_fn(|r| u64::from_le_bytes(std::array::from_fn(|c| (16 * r + c) as u8)));
        transpose8(&mut a);
        for (c, row) in a.iter().enumerate() {
            assert_eq!(row.to_le_bytes(), std::array::from_fn(|r| (16 * r + c) as u8));
        }
    }

    #[test]
    fn block_round_trip() {
        for n in [1000u64, 1003, 7, 1] {
            round_trip(n);
        }
    }

    fn round_trip(n: u64) {
        let times: Vec<u64> =
            (0..n).map(|i| 1_700_000_000_000_000u64.wrapping_add(i * 997 % 5000) ^ (i << 56)).collect();
        let threads: Vec<u32> = (0..n as u32).map(|i| i % 7).collect();
        let stacks: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 70_000).collect();
        let n = n as usize;
        let (mut raw, mut out) = (Vec::new(), Vec::new());
        let c = encode_block(&times, &threads, &stacks, &mut raw, &mut out);
        assert_eq!(le32(&out[0..4]) as usize, 16 * n);
        assert_eq!(le32(&out[4..8]), c);
        assert_eq!(le32(&out[8..12]) as usize, n);
        let mut raw = vec![0u8; 16 * n];
        decompress(&out[12..], &mut raw).unwrap();
        let (mut t, mut h, mut s) = (vec![0; n], vec![0; n], vec![0; n]);
        let st = unplane(&raw, &mut t, &mut h, &mut s);
        assert_eq!((t, h, s), (times.clone(), threads.clone(), stacks.clone()));
        assert_eq!(st.min_time_us, *times.iter().min().unwrap());
        assert_eq!(st.max_time_us, *times.iter().max().unwrap());
        assert_eq!(st.max_stack, *stacks.iter().max().unwrap());
        assert_eq!(st.max_thread, *threads.iter().max().unwrap());
        // A size the payload does not decode to is an error, not a panic.
        let mut short = vec![0u8; 16 * n - 1];
        assert!(decompress(&out[12..], &mut short).is_err());
    }
}
