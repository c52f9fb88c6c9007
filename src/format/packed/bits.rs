//! Bit-level helpers of the block codec: widths, the bit writer, and the
//! fixed-width field loops (compiled per width by `with_width!`) that decoding
//! and checking run on.

/// Bits needed for `v` (0 for 0).
#[inline]
pub(crate) fn bit_width(v: u64) -> u32 {
    64 - v.leading_zeros()
}

/// Appends values of a fixed bit width, least significant bit first; the
/// last byte is padded with zero bits.
pub(super) struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u128,
    bits: u32,
}

impl<'a> BitWriter<'a> {
    pub(super) fn new(out: &'a mut Vec<u8>) -> Self {
        BitWriter { out, acc: 0, bits: 0 }
    }

    #[inline]
    pub(super) fn put(&mut self, v: u64, width: u32) {
        debug_assert!(width == 64 || v >> width == 0);
        self.acc |= (v as u128) << self.bits;
        self.bits += width;
        if self.bits >= 64 {
            self.out.extend_from_slice(&(self.acc as u64).to_le_bytes());
            self.acc >>= 64;
            self.bits -= 64;
        }
    }

    pub(super) fn finish(self) {
        let bytes = self.bits.div_ceil(8) as usize;
        self.out.extend_from_slice(&self.acc.to_le_bytes()[..bytes]);
    }
}

/// Field `i` of `width` bits (at most 64) of the bit-packed section starting
/// at byte `at` of `raw`. `raw` extends at least [`RAW_PADDING`] bytes past
/// any section, so the 16-byte load stays inside it.
#[inline(always)]
pub(super) fn field(raw: &[u8], at: usize, i: usize, width: u32) -> u64 {
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
pub(super) fn narrow_field(raw: &[u8], at: usize, i: usize, width: u32) -> u64 {
    debug_assert!(width <= 56);
    let bit = i * width as usize;
    let byte = at + bit / 8;
    let w = u64::from_le_bytes(raw[byte..byte + 8].try_into().expect("eight bytes"));
    (w >> (bit % 8)) & ((1u64 << width) - 1)
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
pub(super) use with_width;

/// `out[i] = f(field i)` for the `out.len()` fields of `W` bits (at most
/// 16) of the section at byte `at` of `raw` (padded), in order: eight fields
/// (`W` bytes) at a time, each an 8-byte load at a constant offset in the
/// group, a constant shift and a mask, which the compiler unrolls.
#[inline(always)]
pub(super) fn fields<const W: usize, T>(raw: &[u8], at: usize, out: &mut [T], mut f: impl FnMut(u32) -> T) {
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

/// Unpack `n` fields of `width` bits (at most 16) from the section at byte
/// `at` of `raw` (padded) into `out`, which it returns.
pub(super) fn unpack<'a>(raw: &[u8], at: usize, width: u32, n: usize, out: &'a mut Vec<u32>) -> &'a [u32] {
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
pub(super) fn unpack_codes<'a>(
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
pub(super) fn count_escapes(raw: &[u8], at: usize, k: u32, n: usize) -> usize {
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
pub(super) fn count_escapes_w<const W: usize>(raw: &[u8], at: usize, n: usize) -> usize {
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
pub(super) fn fields_below(raw: &[u8], at: usize, w: u32, n: usize, d: u64) -> bool {
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
pub(super) fn fields_below_w<const W: usize>(raw: &[u8], at: usize, n: usize, d: u64) -> bool {
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
pub(super) fn code_stats<C: Copy + Into<u16>>(codes: &[C], k: u32) -> (usize, u32) {
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
