//! The record loop shared by every reader: decode, validate, hand samples on.

use crate::format::defs::Definitions;
use crate::format::record::sample::{self, SampleFields};
use crate::format::record::{self, DecodeError, Record};
use crate::format::{tag, Sample};
use crate::Error;

/// Why a scan stopped before the end of its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Every byte was consumed.
    End,
    /// The input ends inside a record, which starts at the returned position.
    Incomplete,
    /// The sample callback asked to stop.
    Limit,
}

/// Decode and validate records in `buf` (which starts at file offset `base`),
/// calling `on_sample` for each sample; it returns `false` to stop after that
/// sample. Returns how many bytes were consumed (always a record boundary) and
/// why the scan stopped.
#[inline]
pub(crate) fn scan(
    buf: &[u8],
    base: u64,
    defs: &mut Definitions,
    on_sample: impl FnMut(Sample, u64) -> bool,
) -> Result<(usize, Stop), Error> {
    let mut pos = 0;
    let stop = scan_from(buf, &mut pos, base, defs, on_sample)?;
    Ok((pos, stop))
}

/// Like [`scan`], but keeps the position in `*pos`, which on an error is the
/// start of the rejected record (everything before it was applied).
#[inline]
pub(crate) fn scan_from(
    buf: &[u8],
    pos: &mut usize,
    base: u64,
    defs: &mut Definitions,
    mut on_sample: impl FnMut(Sample, u64) -> bool,
) -> Result<Stop, Error> {
    while *pos < buf.len() {
        let at = *pos;
        // Fast path for the record that dominates every spool.
        if buf[at] == tag::SAMPLE {
            match defs.apply_samples(buf, pos, |s, at| on_sample(s, base + at as u64)) {
                Ok(true) => return Ok(Stop::Limit),
                Ok(false) => {}
                Err((at, kind)) => return Err(Error::format(base + at as u64, kind)),
            }
            if *pos != at {
                continue;
            }
        }
        match defs.read_record(&buf[at..]) {
            Ok((sample, len)) => {
                *pos += len;
                if let Some(s) = sample {
                    if !on_sample(s, base + at as u64) {
                        return Ok(Stop::Limit);
                    }
                }
            }
            Err(DecodeError::Incomplete) => return Ok(Stop::Incomplete),
            Err(DecodeError::Bad { at: field, kind }) => {
                return Err(Error::format(base + (at + field) as u64, kind))
            }
        }
    }
    Ok(Stop::End)
}

/// Skip one already-validated record, returning the sample fields if it is a
/// sample. Used by sequential iteration over a prefix that passed `scan`.
#[inline]
pub(crate) fn next_validated(rest: &[u8]) -> Option<(Option<SampleFields>, usize)> {
    if rest[0] == tag::SAMPLE {
        let (fields, len) = sample::decode_at(rest, 0)?;
        return Some((Some(fields), len));
    }
    match record::decode(rest) {
        Ok((Record::Sample(fields), len)) => Some((Some(fields), len)),
        Ok((_, len)) => Some((None, len)),
        Err(_) => None,
    }
}
