//! Varint helpers around the `integer-encoding` crate.
//!
//! The spool uses that crate's representation (LEB128; zigzag for signed);
//! tests check that the encoder here produces the crate's bytes and that the
//! decoder accepts exactly the crate's canonical decodings. They are written
//! here for speed and because the format is stricter than the crate: an overlong (non-canonical) encoding is
//! corruption, and a varint that runs into the end of the input is reported as
//! incomplete only when every remaining byte has its continuation bit set and
//! fewer than ten bytes remain.

/// Why a varint could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VarintError {
    /// The input ends inside the varint.
    Incomplete,
    /// Overlong, longer than ten bytes, or overflowing.
    Bad,
}

/// Decode an unsigned varint from the start of `buf`.
///
/// One- and two-byte varints (ids, small deltas: nearly every field of a
/// sample) are decoded inline; longer ones in [`decode_u64_long`].
#[inline(always)]
pub(crate) fn decode_u64(buf: &[u8]) -> Result<(u64, usize), VarintError> {
    if let Some(&b0) = buf.first() {
        if b0 < 0x80 {
            return Ok((b0 as u64, 1));
        }
        if let Some(&b1) = buf.get(1) {
            if b1 < 0x80 {
                if b1 == 0 {
                    return Err(VarintError::Bad);
                }
                return Ok(((b0 & 0x7f) as u64 | (b1 as u64) << 7, 2));
            }
        }
    }
    decode_u64_long(buf)
}

/// The general case of [`decode_u64`]: canonical LEB128 of at most ten bytes.
#[inline(never)]
fn decode_u64_long(buf: &[u8]) -> Result<(u64, usize), VarintError> {
    let mut v = 0u64;
    for i in 0..10 {
        // Running out here means fewer than ten bytes remain and every one of
        // them has the continuation bit: more input could complete the varint.
        let Some(&b) = buf.get(i) else {
            return Err(VarintError::Incomplete);
        };
        v |= ((b & 0x7f) as u64) << (7 * i);
        if b < 0x80 {
            // A zero final byte is overlong; a tenth byte above 1 overflows.
            if (b == 0 && i > 0) || (i == 9 && b > 1) {
                return Err(VarintError::Bad);
            }
            return Ok((v, i + 1));
        }
    }
    // Ten continuation bytes: no completion is a valid 64-bit varint.
    Err(VarintError::Bad)
}

/// Decode a signed (zigzag) varint from the start of `buf`.
#[cfg(test)]
pub(crate) fn decode_i64(buf: &[u8]) -> Result<(i64, usize), VarintError> {
    let (z, n) = decode_u64(buf)?;
    Ok((unzigzag(z), n))
}

/// Append an unsigned varint to `out` (the same bytes as
/// `integer_encoding::VarInt::encode_var`; checked by a test).
#[inline]
pub(crate) fn put_u64(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Append a signed (zigzag) varint to `out`.
#[inline]
pub(crate) fn put_i64(out: &mut Vec<u8>, v: i64) {
    put_u64(out, ((v << 1) ^ (v >> 63)) as u64);
}

/// Decode the three fields of a sample record (`rest[0]` is its tag) when all
/// three varints are complete and canonical: `(delta, thread, stack, length)`.
/// `None` leaves the record to the general decoder, which reports why.
#[inline(always)]
pub(crate) fn decode_sample(rest: &[u8]) -> Option<(i64, u64, u64, usize)> {
    let (d, t, s, end) = decode_sample_at(rest, 0)?;
    Some((d, t, s, end))
}

/// [`decode_sample`] for the record whose tag is `buf[p]`, returning the
/// offset just past it instead of its length. Works on positions rather than
/// re-sliced buffers, which keeps the hot loops of the readers short.
#[inline(always)]
pub(crate) fn decode_sample_at(buf: &[u8], p: usize) -> Option<(i64, u64, u64, usize)> {
    // Common case: a window of 32 bytes (more than the longest sample record)
    // is available, and every varint has at most three bytes. Offsets into the
    // fixed-size window are masked, which is exact here (they stay below 10)
    // and lets the compiler drop a bounds check per byte.
    if let Some(w) = buf.get(p..p.wrapping_add(32)) {
        let w: &[u8; 32] = w.try_into().ok()?;
        if let Some((z, q)) = uvar_in::<true>(w, 1) {
            if let Some((t, q)) = uvar_in::<true>(w, q) {
                if let Some((s, q)) = last_uvar_in_checked::<true>(w, q) {
                    return Some((unzigzag(z), t, s, p + q));
                }
            }
        }
    }
    decode_sample_at_general(buf, p)
}

/// A varint of at most three bytes at `w[q]` (`q < 10`), with the offset past
/// it; `None` for anything longer and, when `CANONICAL`, for an overlong one
/// (the general decoder then decides). Replay of a validated prefix skips the
/// canonical-form check.
#[inline(always)]
fn uvar_in<const CANONICAL: bool>(w: &[u8; 32], q: usize) -> Option<(u64, usize)> {
    let b0 = w[q & 31] as u64;
    if b0 < 0x80 {
        return Some((b0, q + 1));
    }
    let b1 = w[(q + 1) & 31] as u64;
    if b1 < 0x80 {
        return (!CANONICAL || b1 != 0).then_some(((b0 & 0x7f) | b1 << 7, q + 2));
    }
    let b2 = w[(q + 2) & 31] as u64;
    if b2 < 0x80 && (!CANONICAL || b2 != 0) {
        return Some(((b0 & 0x7f) | (b1 & 0x7f) << 7 | b2 << 14, q + 3));
    }
    None
}

/// Decode a sample record that was already validated (the tag is `w[0]`),
/// for sequential replay of a checked prefix: it only finds the varints'
/// lengths and values, without the canonical-form checks of
/// [`decode_sample_at`]. `None` for a varint longer than three bytes (the
/// caller falls back to the general path). If the bytes changed since they
/// were validated, the result is some wrong sample, never a fault.
#[inline(always)]
pub(crate) fn decode_validated_sample(w: &[u8; 32]) -> Option<(i64, u64, u64, usize)> {
    let (z, q) = uvar_in::<false>(w, 1)?;
    let (t, q) = uvar_in::<false>(w, q)?;
    let (s, q) = last_uvar_in(w, q)?;
    Some((unzigzag(z), t, s, q))
}

/// [`uvar_in`] for a record's last field, the stack id, without a branch on
/// the varint's length: that length (one to three bytes) follows which stack
/// was sampled and defeats branch prediction (it was the largest cost left in
/// every reader's sample loop), while the other fields nearly always have the
/// same length. The three bytes are loaded independently, so the offset of
/// the next record depends on two loads and a few instructions. The validated
/// replay path skips the canonical-form check.
#[inline(always)]
fn last_uvar_in(w: &[u8; 32], q: usize) -> Option<(u64, usize)> {
    last_uvar_in_checked::<false>(w, q)
}

/// [`last_uvar_in`], rejecting an overlong encoding when `CANONICAL`.
#[inline(always)]
fn last_uvar_in_checked<const CANONICAL: bool>(w: &[u8; 32], q: usize) -> Option<(u64, usize)> {
    let (b0, b1, b2) = (w[q & 31] as u64, w[(q + 1) & 31] as u64, w[(q + 2) & 31] as u64);
    // Continuation flags: c0 for a second byte, c1 for a third.
    let c0 = b0 >> 7;
    let c1 = c0 & (b1 >> 7);
    if c1 & (b2 >> 7) != 0 {
        return None;
    }
    let (m0, m1) = (0u64.wrapping_sub(c0), 0u64.wrapping_sub(c1));
    let v = (b0 & 0x7f) | (m0 & (b1 & 0x7f) << 7) | (m1 & b2 << 14);
    // Canonical: not below the smallest value of its length.
    if CANONICAL && v < ((m0 & !m1 & 0x80) | (m1 & 0x4000)) {
        return None;
    }
    Some((v, q + 1 + (c0 + c1) as usize))
}

/// The signed value of a zigzag-encoded one.
#[inline(always)]
pub(crate) fn unzigzag(z: u64) -> i64 {
    ((z >> 1) as i64) ^ -((z & 1) as i64)
}

#[inline(always)]
fn decode_sample_at_general(buf: &[u8], p: usize) -> Option<(i64, u64, u64, usize)> {
    let (z, p) = uvar_at(buf, p + 1)?;
    let (t, p) = uvar_at(buf, p)?;
    let (s, p) = uvar_at(buf, p)?;
    Some((unzigzag(z), t, s, p))
}

/// A complete, canonical varint at `buf[p]`, with the offset past it.
#[inline(always)]
fn uvar_at(buf: &[u8], p: usize) -> Option<(u64, usize)> {
    let b0 = *buf.get(p)?;
    if b0 < 0x80 {
        return Some((b0 as u64, p + 1));
    }
    let b1 = *buf.get(p + 1)?;
    if b1 < 0x80 && b1 != 0 {
        return Some(((b0 & 0x7f) as u64 | (b1 as u64) << 7, p + 2));
    }
    let (v, n) = decode_u64_long(buf.get(p..)?).ok()?;
    Some((v, p + n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use integer_encoding::VarInt;

    #[test]
    fn round_trip_and_strictness() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut b = Vec::new();
            put_u64(&mut b, v);
            assert_eq!(decode_u64(&b), Ok((v, b.len())));
            // Every proper prefix is incomplete.
            for cut in 0..b.len() {
                assert_eq!(decode_u64(&b[..cut]), Err(VarintError::Incomplete), "{v} cut {cut}");
            }
        }
        for v in [0i64, -1, 1, -1000, 1000, i64::MIN, i64::MAX] {
            let mut b = Vec::new();
            put_i64(&mut b, v);
            assert_eq!(decode_i64(&b), Ok((v, b.len())));
        }
        // Overlong zero.
        assert_eq!(decode_u64(&[0x80, 0x00]), Err(VarintError::Bad));
        // Eleven continuation bytes can never complete.
        assert_eq!(decode_u64(&[0xff; 11]), Err(VarintError::Bad));
        // Ten bytes whose last overflows 64 bits.
        let mut b = [0xffu8; 10];
        b[9] = 0x02;
        assert_eq!(decode_u64(&b), Err(VarintError::Bad));
        // Ten bytes whose last is 1: u64::MAX's neighbourhood is canonical.
        let mut b = [0xffu8; 10];
        b[9] = 0x01;
        assert_eq!(decode_u64(&b), Ok((u64::MAX, 10)));
        b[0] = 0x80;
        assert_eq!(decode_u64(&b), Ok((u64::MAX - 127, 10)));
        // Nine continuation bytes at the end: incomplete; ten: bad.
        assert_eq!(decode_u64(&[0x80; 9]), Err(VarintError::Incomplete));
        assert_eq!(decode_u64(&[0x80; 10]), Err(VarintError::Bad));
        assert_eq!(decode_u64(&[]), Err(VarintError::Incomplete));
    }

    proptest::proptest! {
        /// The windowed sample decoder agrees with the general one.
        #[test]
        fn sample_decoders_agree(d: i64, t in 0u64..1 << 22, s: u64, small: bool, bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40)) {
            let (d, s) = if small { (d % 10_000, s % 3_000_000) } else { (d, s) };
            let mut rec = vec![5u8];
            put_i64(&mut rec, d);
            put_u64(&mut rec, t);
            put_u64(&mut rec, s);
            let len = rec.len();
            rec.extend_from_slice(&bytes);
            proptest::prop_assert_eq!(decode_sample_at(&rec, 0), Some((d, t, s, len)));
            // The replay decoder of validated records agrees on canonical ones
            // whose varints fit its three-byte fast path.
            let mut window = [0u8; 32];
            let n = rec.len().min(32);
            window[..n].copy_from_slice(&rec[..n]);
            let fits = [(d << 1) ^ (d >> 63), t as i64, s as i64].iter().all(|&v| (v as u64) < 1 << 21);
            let expected = if fits { Some((d, t, s, len)) } else { None };
            proptest::prop_assert_eq!(decode_validated_sample(&window), expected);
            let mut junk = vec![5u8];
            junk.extend_from_slice(&bytes);
            proptest::prop_assert_eq!(decode_sample_at(&junk, 0), decode_sample_at_general(&junk, 0));
            let squashed: Vec<u8> = std::iter::once(5).chain(bytes.iter().map(|b| b & 0x81)).collect();
            proptest::prop_assert_eq!(decode_sample_at(&squashed, 0), decode_sample_at_general(&squashed, 0));
        }

        /// Agrees with the `integer-encoding` crate: every value it encodes
        /// decodes back, and on arbitrary bytes we accept exactly its canonical
        /// decodings.
        #[test]
        fn matches_integer_encoding(v: u64, i: i64, bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..12)) {
            let enc = v.encode_var_vec();
            proptest::prop_assert_eq!(decode_u64(&enc), Ok((v, enc.len())));
            let mut ours = Vec::new();
            put_u64(&mut ours, v);
            proptest::prop_assert_eq!(&ours, &enc);
            let enc = i.encode_var_vec();
            proptest::prop_assert_eq!(decode_i64(&enc), Ok((i, enc.len())));
            ours.clear();
            put_i64(&mut ours, i);
            proptest::prop_assert_eq!(&ours, &enc);
            let theirs = u64::decode_var(&bytes).filter(|&(v, n)| n == v.required_space());
            match decode_u64(&bytes) {
                Ok(ours) => proptest::prop_assert_eq!(Some(ours), theirs),
                Err(VarintError::Bad) => proptest::prop_assert_eq!(theirs, None),
                Err(VarintError::Incomplete) => {
                    proptest::prop_assert!(bytes.len() < 10 && bytes.iter().all(|b| b & 0x80 != 0));
                }
            }
        }
    }
}
