//! The packed file's frame: magic, fixed lengths and bounds, the block index
//! entry, and little-endian field reads (`FORMAT.md`, section 10).

/// The eight bytes a packed file starts and ends with (the layout
/// [`crate::pack`] writes: compressed definitions and a stack table).
pub const PACKED_MAGIC: [u8; 8] = *b"SPULSPK3";

/// The magic of the second layout (definitions stored as they are, stack
/// nodes among them), which readers still read.
pub const PACKED_MAGIC_V2: [u8; 8] = *b"SPULSPK2";

/// The magic of the first packed layout (byte-plane columns), which readers
/// recognise in order to refuse it with a clear message.
pub(crate) const PACKED_MAGIC_V1: [u8; 8] = *b"SPULSPK1";

/// Whether `head` (the first bytes of a file) starts with the packed magic
/// (or that of the first packed layout, which the readers refuse by name).
pub fn is_packed(head: &[u8]) -> bool {
    head.starts_with(&PACKED_MAGIC)
        || head.starts_with(&PACKED_MAGIC_V2)
        || head.starts_with(&PACKED_MAGIC_V1)
}

/// Most samples in one block. Readers decode one block at a time into a
/// buffer bounded by this (see [`max_raw_len`]).
pub const MAX_BLOCK_SAMPLES: u32 = 1 << 16;

/// The fixed part at the start of the second layout: magic, then the
/// definitions' length (`u64`).
pub(crate) const HEAD_LEN: u64 = 16;

/// The fixed part at the start of the third layout: magic, then the
/// definitions' decoded and compressed lengths (`u64` each). Offsets in the
/// definitions are counted from here, as if they were stored decoded.
pub(crate) const HEAD_LEN_V3: u64 = 24;

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
