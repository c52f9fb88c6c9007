//! Packed files built by hand from `FORMAT.md`, section 10 (frame, coded
//! columns, bit fields, LZ4 blocks), for the shapes the writer never makes:
//! the hostile ones the memory bounds are about ([`Hostile`]).

use spulse::{Frame, Header, SpoolWriter, PACKED_MAGIC_V2};

/// `vals` as fields of `width` bits, least significant bit first, the last
/// byte padded with zero bits.
pub fn bit_fields(vals: &[u64], width: u32) -> Vec<u8> {
    let mut out = vec![0u8; (vals.len() * width as usize).div_ceil(8)];
    for (i, &v) in vals.iter().enumerate() {
        for b in 0..width as usize {
            if v >> b & 1 == 1 {
                let bit = i * width as usize + b;
                out[bit / 8] |= 1 << (bit % 8);
            }
        }
    }
    out
}

fn width_of(v: u64) -> u32 {
    64 - v.leading_zeros()
}

/// A coded column: dictionary `base` then `gaps` (of `gap_width` bits),
/// code width `k`, a frequent table of dictionary indices `frequent`, the
/// `codes` and the escapes' dictionary indices `escapes`.
pub fn column(
    base: u64,
    gaps: &[u64],
    gap_width: u32,
    k: u32,
    frequent: &[u64],
    codes: &[u64],
    escapes: &[u64],
) -> Vec<u8> {
    let d = if codes.is_empty() && escapes.is_empty() && gaps.is_empty() && base == 0 && frequent.is_empty() {
        0
    } else {
        gaps.len() + 1
    };
    let wi = width_of(d.saturating_sub(1) as u64);
    let mut out = Vec::new();
    out.extend_from_slice(&base.to_le_bytes());
    out.extend_from_slice(&(d as u32).to_le_bytes());
    out.extend_from_slice(&[gap_width as u8, k as u8]);
    out.extend_from_slice(&(frequent.len() as u16).to_le_bytes());
    out.extend_from_slice(&(escapes.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend(bit_fields(gaps, gap_width));
    out.extend(bit_fields(frequent, wi));
    out.extend(bit_fields(codes, k));
    out.extend(bit_fields(escapes, wi));
    out
}

/// A column of `c` copies of `v` in its smallest form (one dictionary
/// entry, code width 0, every field 0 bits wide).
pub fn constant_column(v: u64, c: usize) -> Vec<u8> {
    if c == 0 {
        return column(0, &[], 0, 0, &[], &[], &[]);
    }
    column(v, &[], 0, 0, &[], &[], &vec![0; c])
}

/// A block (12-byte header and LZ4 payload) of `count` samples decoding to
/// `raw`.
pub fn frame_block(raw: &[u8], count: u32) -> Vec<u8> {
    let comp = lz4_flex::block::compress(raw);
    let mut out = Vec::new();
    out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    out.extend_from_slice(&(comp.len() as u32).to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&comp);
    out
}

/// A packed file of the second layout (`SPULSPK2`, which readers still
/// read; its definitions are stored as they are): the definitions of `spool` (which must hold no samples
/// and no events), then `blocks`, each (framed block, sample count,
/// earliest and latest time), and the index and footer.
pub fn assemble(spool: &[u8], blocks: &[(Vec<u8>, u32, u64, u64)]) -> Vec<u8> {
    let mut f = PACKED_MAGIC_V2.to_vec();
    f.extend_from_slice(&(spool.len() as u64).to_le_bytes());
    f.extend_from_slice(spool);
    f.extend_from_slice(&0u64.to_le_bytes());
    let mut index = Vec::new();
    let mut samples = 0u64;
    for (b, count, min, max) in blocks {
        index.extend_from_slice(&(f.len() as u64).to_le_bytes());
        index.extend_from_slice(&min.to_le_bytes());
        index.extend_from_slice(&max.to_le_bytes());
        index.extend_from_slice(&count.to_le_bytes());
        index.extend_from_slice(&(b.len() as u32 - 12).to_le_bytes());
        f.extend_from_slice(b);
        samples += *count as u64;
    }
    let index_at = f.len() as u64;
    f.extend_from_slice(&index);
    f.extend_from_slice(&index_at.to_le_bytes());
    f.extend_from_slice(&(blocks.len() as u64).to_le_bytes());
    f.extend_from_slice(&samples.to_le_bytes());
    f.extend_from_slice(&PACKED_MAGIC_V2);
    f
}

/// Definitions of one thread (pid and tid 7) and one stack node of one
/// frame: thread 0, stack 0.
pub fn one_stack_definitions(start_time_us: u64) -> Vec<u8> {
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us, interval_us: 1000 }).unwrap();
    w.define_thread(7, 7, "main").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x1010, kernel: false }).unwrap();
    w.define_stack(None, f).unwrap();
    w.into_inner().unwrap()
}

/// The shapes of hostile (or merely unusual) packed files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hostile {
    /// One-sample blocks whose columns use 12-bit codes for one frequent
    /// value: before the code width was tied to the frequent table, each
    /// column of each block cost a 32 KiB table at open. Refused now.
    WideCodes,
    /// One-sample blocks in the narrowest valid form: the most blocks (and
    /// per-block overhead) a file of a given size can have.
    OneSampleBlocks,
    /// Blocks of 65,536 samples whose thread and stack columns have 65,536
    /// dictionary entries (all equal: gaps of 0 bits), 12-bit codes and a
    /// full frequent table, and whose codes are all 0: the most memory per
    /// sample a valid block can ask for, from a few hundred compressed bytes.
    FullDictionaries,
    /// Blocks of 4,095 samples whose every column has 4,095 dictionary
    /// entries (the time deltas 64 bits apart), 12-bit codes, a full frequent
    /// table and every value an escape: the most decoded bytes, dictionary
    /// and tables a valid block can have for each of its samples.
    MaxPerSample,
    /// Blocks of 65,536 identical samples (thread 0, stack 0, one interval
    /// apart): a few dozen bytes a block, as `spulse pack` writes a
    /// perfectly repetitive recording.
    Repetitive,
}

/// Start time of the files [`hostile`] makes.
pub const HOSTILE_START_US: u64 = 1_700_000_000_000_000;

/// A packed file of `blocks` blocks of the shape `kind`.
pub fn hostile(kind: Hostile, blocks: usize) -> Vec<u8> {
    let t0 = HOSTILE_START_US;
    let defs = one_stack_definitions(t0);
    let (n, raw, step) = match kind {
        Hostile::WideCodes | Hostile::OneSampleBlocks => {
            let k = if kind == Hostile::WideCodes { 12 } else { 1 };
            let mut raw = t0.to_le_bytes().to_vec();
            raw.extend(constant_column(0, 0));
            for _ in 0..2 {
                raw.extend(column(0, &[], 0, k, &[0], &[0], &[]));
            }
            (1u32, raw, 0u64)
        }
        Hostile::FullDictionaries => {
            let n = 1usize << 16;
            let mut raw = t0.to_le_bytes().to_vec();
            raw.extend(constant_column(0, n - 1));
            let frequent: Vec<u64> = (0..4095).collect();
            for _ in 0..2 {
                raw.extend(column(0, &vec![0; n - 1], 0, 12, &frequent, &vec![0; n], &[]));
            }
            (n as u32, raw, 0)
        }
        Hostile::MaxPerSample => {
            let n = 4095usize;
            let mut raw = t0.to_le_bytes().to_vec();
            let frequent: Vec<u64> = (0..4095).collect();
            let escape = vec![4095u64; n];
            // The deltas: 4,094 of them, dictionary entries 2^63 apart.
            raw.extend(column(
                0,
                &vec![1 << 63; n - 2],
                64,
                12,
                &frequent[..4094],
                &escape[..n - 1],
                &vec![0; n - 1],
            ));
            for _ in 0..2 {
                raw.extend(column(0, &vec![0; n - 1], 0, 12, &frequent, &escape, &vec![0; n]));
            }
            (n as u32, raw, 0)
        }
        Hostile::Repetitive => {
            let n = 1usize << 16;
            let mut raw = Vec::new();
            raw.extend(constant_column(1000, n - 1));
            raw.extend(constant_column(0, n));
            raw.extend(constant_column(0, n));
            (n as u32, raw, 1000)
        }
    };
    let span = step * (n as u64 - 1);
    let list: Vec<_> = (0..blocks as u64)
        .map(|b| {
            let first = t0 + b * (span + step);
            let mut r = raw.clone();
            if kind == Hostile::Repetitive {
                r.splice(0..0, first.to_le_bytes());
            }
            (frame_block(&r, n), n, first, first + span)
        })
        .collect();
    assemble(&defs, &list)
}

/// The most heap a reader may hold for a packed file of `len` bytes whose
/// footer counts `samples` samples, as `FORMAT.md` (section 10, "Memory")
/// states it: `PER_SAMPLE` bytes a sample, `PER_BYTE` a byte of the file,
/// and `FIXED`. The count is taken as at most 2,048 a byte (a block of at
/// most 65,536 samples has a 32-byte index entry), as a reader checks it.
pub fn memory_bound(len: u64, samples: u64) -> u64 {
    const PER_SAMPLE: u64 = 128;
    const PER_BYTE: u64 = 32;
    const FIXED: u64 = 8 << 20;
    PER_SAMPLE * samples.min(2048 * len) + PER_BYTE * len + FIXED
}

/// The most heap a reader may hold for the packed file `data`: [`memory_bound`]
/// of its length and footer's samples, plus, for the third layout, `PER_BYTE`
/// a byte of its decoded definitions and `PER_NODE` a node of its stack table
/// (`FORMAT.md`, section 10, "Memory"), each as much as a reader accepts
/// before allocating (LZ4 decodes at most 255 bytes a byte, plus 64; a table
/// holds at most 8 nodes a decoded byte, plus 4,096).
pub fn memory_bound_of(data: &[u8]) -> u64 {
    const PER_BYTE: u64 = 32;
    const PER_NODE: u64 = 96;
    let len = data.len() as u64;
    let mut bound = memory_bound(len, footer_samples(data));
    if data.len() >= 24 && data.starts_with(&spulse::PACKED_MAGIC) {
        let le64 = |at: usize| data.get(at..at + 8).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()));
        let cap = |c: u64| c.min(len).saturating_mul(255).saturating_add(64);
        let (defs, comp) = (le64(8), le64(16));
        bound += PER_BYTE * defs.min(cap(comp));
        let marks_at = 24u64.saturating_add(comp);
        let marks = le64(marks_at.min(len) as usize);
        let table_at = marks_at.saturating_add(8).saturating_add(marks.saturating_mul(8));
        if table_at.saturating_add(16) <= len {
            let t = table_at as usize;
            let nodes = le64(t);
            let raw = u32::from_le_bytes(data[t + 8..t + 12].try_into().unwrap()) as u64;
            let tcomp = u32::from_le_bytes(data[t + 12..t + 16].try_into().unwrap()) as u64;
            let raw = raw.min(cap(tcomp));
            bound += PER_NODE * nodes.min(raw * 8 + 4096) + raw;
        }
    }
    bound
}

/// The sample count in the footer of `data` if it starts like a packed file
/// (0 otherwise): what [`memory_bound`] takes.
pub fn footer_samples(data: &[u8]) -> u64 {
    if !spulse::is_packed(data) || data.len() < 48 {
        return 0;
    }
    let at = data.len() - 16;
    u64::from_le_bytes(data[at..at + 8].try_into().expect("eight bytes"))
}
