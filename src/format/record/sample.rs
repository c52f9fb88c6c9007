//! The sample record: its layout, written once, and the specialised readers of
//! that layout that the readers' hot loops use.
//!
//! A sample record is the tag byte followed by three varints: the zigzag
//! timestamp delta, the thread id and the stack id. [`encode`] writes it (for
//! the record codec and the writer's sample path) and [`read_fields`] is the
//! only code that reads it. Reading is generic over a [`FieldReader`], which
//! says how one varint is read:
//!
//! * [`Cursor`] (the general record decoder, [`super::decode`], through a
//!   [`Recording`] that keeps the fields read before an error): any length,
//!   complete and canonical, with errors that name the offending field;
//! * a 32-byte [`Window`] with varints of at most three bytes, optionally
//!   skipping the canonical-form check: the steady state of every reader's
//!   sample loop, where a varint longer than that falls back to the cursor.
//!
//! Nearly every field of a sample is one or two bytes (ids, small deltas), so
//! the window reader handles almost every record; the stack id, the last field,
//! is read without a branch on its length (see [`Window::last_field`]).

use super::{Cursor, DecodeError};
use crate::format::tag;
use crate::format::varint::{put_i64, put_u64, unzigzag};

/// Bytes a [`Window`] holds: more than the longest sample record a window
/// reader accepts (the tag and three varints of at most three bytes), rounded
/// up to a power of two so that offsets into it can be masked.
pub(crate) const WINDOW: usize = 32;

/// The fields of a sample record, before they are checked against the
/// definitions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SampleFields {
    /// Microseconds since the previous sample (or the header's start time).
    pub(crate) delta_us: i64,
    /// Thread id (a reference to a thread record).
    pub(crate) thread: u64,
    /// Stack id (a reference to a stack record).
    pub(crate) stack: u64,
}

/// Append a sample record with `fields` to `out`.
#[inline]
pub(crate) fn encode(fields: &SampleFields, out: &mut Vec<u8>) {
    out.push(tag::SAMPLE);
    put_i64(out, fields.delta_us);
    put_u64(out, fields.thread);
    put_u64(out, fields.stack);
}

/// How the varint fields of a record are read. Positions are passed in and
/// returned rather than kept in the reader, which lets the compiler keep the
/// window reader's offsets as constants on each path of the sample loops.
pub(crate) trait FieldReader {
    /// Why a field could not be read.
    type Error;

    /// The field at offset `q`, and the offset just past it.
    fn field(&mut self, q: usize) -> Result<(u64, usize), Self::Error>;

    /// The field at offset `q`, known to be the record's last; a reader may
    /// read it differently (see [`Window::last_field`]).
    #[inline(always)]
    fn last_field(&mut self, q: usize) -> Result<(u64, usize), Self::Error> {
        self.field(q)
    }
}

/// The sample layout: read the fields of the sample record whose tag is at
/// offset `q - 1`, in stream order, returning them and the offset just past
/// the record.
#[inline(always)]
pub(crate) fn read_fields<R: FieldReader>(r: &mut R, q: usize) -> Result<(SampleFields, usize), R::Error> {
    let (z, q) = r.field(q)?;
    let (thread, q) = r.field(q)?;
    let (stack, q) = r.last_field(q)?;
    Ok((SampleFields { delta_us: unzigzag(z), thread, stack }, q))
}

/// A cursor that keeps the fields it read, so that a sample record that does
/// not decode completely can be reported with the fields before the one that
/// failed (the general decoder's partial record, whose complete fields are
/// still checked; FORMAT.md, section 6).
pub(crate) struct Recording<'c, 'a> {
    cursor: &'c mut Cursor<'a>,
    /// The fields read so far, in stream order (the delta still zigzagged),
    /// the others zero.
    values: [u64; 3],
    read: usize,
}

impl<'c, 'a> Recording<'c, 'a> {
    pub(crate) fn new(cursor: &'c mut Cursor<'a>) -> Self {
        Recording { cursor, values: [0; 3], read: 0 }
    }

    /// The fields read before an error, the others zero.
    pub(crate) fn partial(&self) -> SampleFields {
        let [z, thread, stack] = self.values;
        SampleFields { delta_us: unzigzag(z), thread, stack }
    }
}

impl FieldReader for Recording<'_, '_> {
    type Error = DecodeError;

    #[inline(always)]
    fn field(&mut self, q: usize) -> Result<(u64, usize), DecodeError> {
        let (v, q) = self.cursor.field(q)?;
        if let Some(slot) = self.values.get_mut(self.read) {
            *slot = v;
            self.read += 1;
        }
        Ok((v, q))
    }
}

impl FieldReader for Cursor<'_> {
    type Error = DecodeError;

    #[inline(always)]
    fn field(&mut self, q: usize) -> Result<(u64, usize), DecodeError> {
        self.pos = q;
        let v = self.u64()?;
        Ok((v, self.pos))
    }
}

/// Reads varints of at most three bytes from a fixed window of [`WINDOW`]
/// bytes (offsets below 10 while a sample is read). Offsets are masked to the
/// window, which is exact here and lets the compiler drop a bounds check per
/// byte. Fails (`Err(())`) on a longer varint and, when `CANONICAL`, on an
/// overlong one; the caller then falls back to the cursor, which decides.
pub(crate) struct Window<'w, const CANONICAL: bool>(pub(crate) &'w [u8; WINDOW]);

impl<const CANONICAL: bool> Window<'_, CANONICAL> {
    #[inline(always)]
    fn byte(&self, q: usize) -> u64 {
        self.0[q & (WINDOW - 1)] as u64
    }
}

impl<const CANONICAL: bool> FieldReader for Window<'_, CANONICAL> {
    type Error = ();

    #[inline(always)]
    fn field(&mut self, q: usize) -> Result<(u64, usize), ()> {
        let b0 = self.byte(q);
        if b0 < 0x80 {
            return Ok((b0, q + 1));
        }
        let b1 = self.byte(q + 1);
        if b1 < 0x80 {
            if CANONICAL && b1 == 0 {
                return Err(());
            }
            return Ok(((b0 & 0x7f) | b1 << 7, q + 2));
        }
        let b2 = self.byte(q + 2);
        if b2 < 0x80 && (!CANONICAL || b2 != 0) {
            return Ok(((b0 & 0x7f) | (b1 & 0x7f) << 7 | b2 << 14, q + 3));
        }
        Err(())
    }

    /// The stack id without a branch on its length: that length (one to
    /// three bytes) follows which stack was sampled and defeats branch
    /// prediction, while the other fields nearly always have the same length.
    /// The three bytes are loaded independently, so the offset of the next
    /// record depends on two loads and a few instructions. The canonical-form
    /// check is one compare against the smallest value of the length found.
    #[inline(always)]
    fn last_field(&mut self, q: usize) -> Result<(u64, usize), ()> {
        let (b0, b1, b2) = (self.byte(q), self.byte(q + 1), self.byte(q + 2));
        // Continuation flags: c0 for a second byte, c1 for a third.
        let c0 = b0 >> 7;
        let c1 = c0 & (b1 >> 7);
        if c1 & (b2 >> 7) != 0 {
            return Err(());
        }
        let (m0, m1) = (0u64.wrapping_sub(c0), 0u64.wrapping_sub(c1));
        let v = (b0 & 0x7f) | (m0 & (b1 & 0x7f) << 7) | (m1 & b2 << 14);
        if CANONICAL && v < ((m0 & !m1 & 0x80) | (m1 & 0x4000)) {
            return Err(());
        }
        Ok((v, q + 1 + (c0 + c1) as usize))
    }
}

/// Decode the sample record whose tag is `buf[p]` when its three varints are
/// complete and canonical, returning its fields and the offset just past it.
/// `None` leaves the record to the general decoder, which reports why.
///
/// The window reader takes the record when a full window is available and
/// every varint has at most three bytes; otherwise the cursor reads it. Works
/// on positions rather than re-sliced buffers, which keeps the readers' hot
/// loops short.
#[inline(always)]
pub(crate) fn decode_at(buf: &[u8], p: usize) -> Option<(SampleFields, usize)> {
    if let Some(w) = buf.get(p..p.wrapping_add(WINDOW)) {
        let w: &[u8; WINDOW] = w.try_into().ok()?;
        if let Ok((f, q)) = read_fields(&mut Window::<true>(w), 1) {
            return Some((f, p + q));
        }
    }
    decode_at_cursor(buf, p)
}

/// [`decode_at`] with the cursor: records near the end of the input or with a
/// varint longer than three bytes. Kept out of line, so that the readers' hot
/// loops hold only the window reader.
#[inline(never)]
fn decode_at_cursor(buf: &[u8], p: usize) -> Option<(SampleFields, usize)> {
    read_fields(&mut Cursor::new(buf, p), p + 1).ok()
}

/// Decode a sample record that was already validated (its tag is `w[0]`), for
/// sequential replay of a checked prefix: the window reader without the
/// canonical-form checks, returning the fields and the record's length. `None`
/// for a varint longer than three bytes (the caller falls back to the general
/// decoder). If the bytes changed since they were validated, the result is
/// some wrong sample, never a fault.
#[inline(always)]
pub(crate) fn decode_validated(w: &[u8; WINDOW]) -> Option<(SampleFields, usize)> {
    read_fields(&mut Window::<false>(w), 1).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::record::{decode, Record};
    use proptest::prelude::*;

    /// What the general decoder makes of the sample record at `buf[0]`, as
    /// [`decode_at`] reports it.
    fn general(buf: &[u8]) -> Option<(SampleFields, usize)> {
        match decode(buf) {
            Ok((Record::Sample(f), len)) => Some((f, len)),
            _ => None,
        }
    }

    proptest! {
        /// The window readers agree with the general decoder on encoded
        /// samples and on arbitrary bytes.
        #[test]
        fn readers_agree(d: i64, t in 0u64..1 << 22, s: u64, small: bool, bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            let (d, s) = if small { (d % 10_000, s % 3_000_000) } else { (d, s) };
            let fields = SampleFields { delta_us: d, thread: t, stack: s };
            let mut rec = Vec::new();
            encode(&fields, &mut rec);
            let len = rec.len();
            rec.extend_from_slice(&bytes);
            prop_assert_eq!(decode_at(&rec, 0), Some((fields, len)));
            prop_assert_eq!(general(&rec), Some((fields, len)));
            // The replay reader of validated records agrees on canonical ones
            // whose varints fit its three-byte window reader.
            let mut window = [0u8; WINDOW];
            let n = rec.len().min(WINDOW);
            window[..n].copy_from_slice(&rec[..n]);
            let fits = [(d << 1) ^ (d >> 63), t as i64, s as i64].iter().all(|&v| (v as u64) < 1 << 21);
            let expected = if fits { Some((fields, len)) } else { None };
            prop_assert_eq!(decode_validated(&window), expected);
            // On arbitrary bytes (and on bytes with mostly continuation bits
            // and zeros, which exercise the overlong and long cases) the
            // specialised decoder accepts exactly what the general one does.
            let mut junk = vec![crate::format::tag::SAMPLE];
            junk.extend_from_slice(&bytes);
            prop_assert_eq!(decode_at(&junk, 0), general(&junk));
            let squashed: Vec<u8> = std::iter::once(crate::format::tag::SAMPLE).chain(bytes.iter().map(|b| b & 0x81)).collect();
            prop_assert_eq!(decode_at(&squashed, 0), general(&squashed));
        }
    }
}
