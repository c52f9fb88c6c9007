//! Varint helpers around the `integer-encoding` crate.
//!
//! The spool uses that crate's representation (LEB128; zigzag for signed). On
//! top of it the format is strict: an overlong (non-canonical) encoding is
//! corruption, and a varint that runs into the end of the input is reported as
//! incomplete only when every remaining byte has its continuation bit set and
//! fewer than ten bytes remain.

use integer_encoding::VarInt;

/// Why a varint could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VarintError {
    /// The input ends inside the varint.
    Incomplete,
    /// Overlong, longer than ten bytes, or overflowing.
    Bad,
}

/// Decode an unsigned varint from the start of `buf`.
#[inline]
pub(crate) fn decode_u64(buf: &[u8]) -> Result<(u64, usize), VarintError> {
    // Fast path: one byte (the common case for ids and small deltas).
    if let Some(&b) = buf.first() {
        if b < 0x80 {
            return Ok((b as u64, 1));
        }
    }
    match u64::decode_var(buf) {
        Some((v, n)) => {
            if n != v.required_space() {
                Err(VarintError::Bad)
            } else {
                Ok((v, n))
            }
        }
        None => Err(classify_failure(buf)),
    }
}

/// Decode a signed (zigzag) varint from the start of `buf`.
#[inline]
pub(crate) fn decode_i64(buf: &[u8]) -> Result<(i64, usize), VarintError> {
    if let Some(&b) = buf.first() {
        if b < 0x80 {
            let b = b as i64;
            return Ok(((b >> 1) ^ -(b & 1), 1));
        }
    }
    match i64::decode_var(buf) {
        Some((v, n)) => {
            if n != v.required_space() {
                Err(VarintError::Bad)
            } else {
                Ok((v, n))
            }
        }
        None => Err(classify_failure(buf)),
    }
}

fn classify_failure(buf: &[u8]) -> VarintError {
    if buf.len() < 10 && buf.iter().all(|b| b & 0x80 != 0) {
        VarintError::Incomplete
    } else {
        VarintError::Bad
    }
}

/// Append an unsigned varint to `out`.
#[inline]
pub(crate) fn put_u64(out: &mut Vec<u8>, v: u64) {
    let mut tmp = [0u8; 10];
    let n = v.encode_var(&mut tmp);
    out.extend_from_slice(&tmp[..n]);
}

/// Append a signed (zigzag) varint to `out`.
#[inline]
pub(crate) fn put_i64(out: &mut Vec<u8>, v: i64) {
    let mut tmp = [0u8; 10];
    let n = v.encode_var(&mut tmp);
    out.extend_from_slice(&tmp[..n]);
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
