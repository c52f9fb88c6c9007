//! Varints, and nothing else: encoding, strict decoding and zigzag.
//!
//! The spool uses the `integer-encoding` crate's representation (LEB128;
//! zigzag for signed); tests check that the encoder here produces the crate's
//! bytes and that the decoder accepts exactly the crate's canonical decodings.
//! They are written here for speed and because the format is stricter than the
//! crate: an overlong (non-canonical) encoding is corruption, and a varint that
//! runs into the end of the input is reported as incomplete only when every
//! remaining byte has its continuation bit set and fewer than [`MAX_LEN`] bytes
//! remain. Record layouts, including the sample record's, belong to the record
//! codec (`super::record`).

/// The longest varint: a 64-bit value in 7-bit groups takes ten bytes.
pub(crate) const MAX_LEN: usize = 10;

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

/// The general case of [`decode_u64`]: canonical LEB128 of at most
/// [`MAX_LEN`] bytes.
#[inline(never)]
fn decode_u64_long(buf: &[u8]) -> Result<(u64, usize), VarintError> {
    let mut v = 0u64;
    for i in 0..MAX_LEN {
        // Running out here means fewer than ten bytes remain and every one of
        // them has the continuation bit: more input could complete the varint.
        let Some(&b) = buf.get(i) else {
            return Err(VarintError::Incomplete);
        };
        v |= ((b & 0x7f) as u64) << (7 * i);
        if b < 0x80 {
            // A zero final byte is overlong; a tenth byte above 1 overflows.
            if (b == 0 && i > 0) || (i == MAX_LEN - 1 && b > 1) {
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

/// Write an unsigned varint at the start of `out` (at least [`MAX_LEN`]
/// bytes, not yet initialized); returns its length. The bytes of
/// [`put_u64`].
#[inline]
pub(crate) fn write_u64_uninit(out: &mut [std::mem::MaybeUninit<u8>], mut v: u64) -> usize {
    let mut i = 0;
    while v >= 0x80 {
        out[i].write(v as u8 | 0x80);
        v >>= 7;
        i += 1;
    }
    out[i].write(v as u8);
    i + 1
}

/// Append a signed (zigzag) varint to `out`.
#[inline]
pub(crate) fn put_i64(out: &mut Vec<u8>, v: i64) {
    put_u64(out, ((v << 1) ^ (v >> 63)) as u64);
}

/// The signed value of a zigzag-encoded one.
#[inline(always)]
pub(crate) fn unzigzag(z: u64) -> i64 {
    ((z >> 1) as i64) ^ -((z & 1) as i64)
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
            // `write_u64_uninit`, read back through the one writer that uses
            // it (tag byte, then the varint, then three one-byte fields).
            let mut rec = Vec::new();
            crate::format::record::encode_off_cpu(&mut rec, v, 0, 0, 0, false);
            proptest::prop_assert_eq!(rec.len(), enc.len() + 5);
            proptest::prop_assert_eq!(&rec[1..1 + enc.len()], &enc[..]);
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
