//! Loading a large spool on two cores, for [`Snapshot`](super::Snapshot).
//!
//! A spool is one stream of variable-length records, so its second half cannot
//! be validated before its first half is (ids, references and timestamps depend
//! on everything before them). It can be *decoded* speculatively, though:
//!
//! 1. Past the midpoint, find a position from which [`SYNC_RECORDS`] records in
//!    a row decode as sample records: very likely a record boundary.
//! 2. One thread validates the first half exactly as the sequential reader
//!    does, stopping at that position, into the sample columns
//!    (`columns.rs`); a second thread meanwhile decodes the rest straight
//!    into columns of its own, with timestamps relative to the time at
//!    the position (not yet known), noting each run of samples (its largest
//!    thread and stack ids and its timestamp range) and the offsets of the
//!    other records between them, checking only syntax.
//! 3. If the first half ends exactly at the chosen position, it was a
//!    boundary and the decoding of the rest is the one the sequential reader
//!    would make. The validating thread then rebases the second columns onto
//!    the time it reached and applies the rest in stream order: other records
//!    through the same rule code as always, runs of samples with one check per
//!    run (ids below the counts defined so far, timestamps in range); no
//!    sample is copied. Anything that does not pass (a failed run check, a
//!    record the speculation could not decode, or a first half that did not
//!    end at the position) cuts the second columns back to what passed and is
//!    re-read sequentially from there, so errors, their offsets and the
//!    recovered tail are exactly those of the sequential reader;
//!    `tests/format_readers/parallel.rs` and the fuzz corpus checks compare
//!    the two.

use std::sync::atomic::{AtomicBool, Ordering};

use super::columns::{Block, Fill, Filler, Layout, SampleColumns};
use super::scan::{scan_from, Stop};
use crate::format::defs::Definitions;
use crate::format::record::sample::{self, SampleFields};
use crate::format::record::{self, DecodeError};
use crate::format::{tag, Sample, MIN_SAMPLE_RECORD_LEN};
use crate::Error;

/// Spools shorter than this (bytes after the header) load on one core: below
/// it, starting a thread costs more than it saves.
pub(crate) const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// Consecutive sample records that must decode from a position before the
/// second half is decoded from it.
const SYNC_RECORDS: usize = 64;
/// How far past the midpoint a synchronization position is looked for.
const SYNC_WINDOW: usize = 64 << 10;
/// The speculative decoder looks for cancellation once per this many samples:
/// often enough that an abandoned speculation stops within microseconds,
/// rarely enough that the atomic load costs nothing in the sample loop.
const CANCEL_CHECK_SAMPLES: usize = 4096;

/// Loads whose second half was applied from the speculative decoding (with
/// the `testing` feature, for tests that check the two-thread path really ran).
#[cfg(feature = "testing")]
static SPECULATIONS_APPLIED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many loads so far applied a speculatively decoded second half.
#[cfg(feature = "testing")]
pub fn speculations_applied() -> u64 {
    SPECULATIONS_APPLIED.load(Ordering::Relaxed)
}

/// Count a load whose speculation was applied (nothing without `testing`).
fn count_applied() {
    #[cfg(feature = "testing")]
    SPECULATIONS_APPLIED.fetch_add(1, Ordering::Relaxed);
}

/// Validate `bytes` (a spool whose header, `hlen` bytes, was already read)
/// into `defs` and `cols`, using a second thread for the second half when
/// `min_parallel` bytes or more follow the header. Returns the length of the
/// validated prefix and whether the file ends inside a record.
pub(crate) fn load(
    bytes: &[u8],
    hlen: usize,
    defs: &mut Definitions,
    cols: &mut SampleColumns,
    min_parallel: usize,
) -> Result<(usize, bool), Error> {
    let body = bytes.len() - hlen;
    let two_cores = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    let sync =
        if body >= min_parallel.max(1) && two_cores { find_sync(bytes, hlen + body / 2) } else { None };
    let Some(sync) = sync else {
        return sequential(bytes, hlen, defs, cols);
    };
    let cancel = AtomicBool::new(false);
    std::thread::scope(|s| {
        let spawned = std::thread::Builder::new()
            .name("spulse-load".into())
            .spawn_scoped(s, || speculate(bytes, sync, &cancel));
        // No thread to be had (resource limits): read it all on this one.
        let Ok(rest) = spawned else {
            return sequential(bytes, hlen, defs, cols);
        };
        // Stop the speculation and wait for its thread to exit: the scope
        // would wait for it too, but only for its closure to return, not for
        // the thread's exit (and its thread-local destructors) to finish.
        let abandon = |rest: std::thread::ScopedJoinHandle<'_, Speculation>| {
            cancel.store(true, Ordering::Relaxed);
            let _ = rest.join();
        };
        let first = validate_into(bytes, hlen, sync, defs, cols);
        let resume = match first {
            Err(e) => {
                abandon(rest);
                return Err(e);
            }
            // The first half ended exactly at `sync`: it is a record boundary.
            Ok((end, Stop::End)) if end == sync => None,
            // A record straddles `sync`: the speculation started mid-record.
            Ok((end, _)) => Some(end),
        };
        let resume = match resume {
            Some(at) => {
                abandon(rest);
                at
            }
            None => match rest.join() {
                Ok(spec) => match apply(bytes, spec, defs, cols).inspect(|_| count_applied())? {
                    Some(at) => at,
                    None => return Ok((bytes.len(), false)),
                },
                // Not expected (the decoder only reads and pushes), but then
                // the rest is simply read sequentially.
                Err(_) => sync,
            },
        };
        sequential(bytes, resume, defs, cols)
    })
}

/// The sequential reader, from record boundary `from` to the end.
fn sequential(
    bytes: &[u8],
    from: usize,
    defs: &mut Definitions,
    cols: &mut SampleColumns,
) -> Result<(usize, bool), Error> {
    let (end, stop) = validate_into(bytes, from, bytes.len(), defs, cols)?;
    Ok((end, stop == Stop::Incomplete))
}

/// The sequential reader over `bytes[from..to]` (`from` a record boundary),
/// appending samples to the last block of `cols`. Returns the offset it
/// stopped at (a record boundary) and why.
fn validate_into(
    bytes: &[u8],
    from: usize,
    to: usize,
    defs: &mut Definitions,
    cols: &mut SampleColumns,
) -> Result<(usize, Stop), Error> {
    struct Validate<'b, 'd> {
        buf: &'b [u8],
        base: u64,
        pos: usize,
        defs: &'d mut Definitions,
        /// A sample the filler had no room for, already validated.
        pending: Option<Sample>,
    }
    impl Fill for Validate<'_, '_> {
        type Out = Result<Stop, Error>;
        #[inline(always)]
        fn run<L: Layout>(&mut self, w: &mut Filler<'_, L>) -> Result<Stop, Error> {
            let pending = &mut self.pending;
            scan_from(self.buf, &mut self.pos, self.base, self.defs, |s, _| {
                w.put(s.time_us, s.thread.get(), s.stack.get()) || {
                    *pending = Some(s);
                    false
                }
            })
        }
    }
    let mut v = Validate { buf: &bytes[from..to], base: from as u64, pos: 0, defs, pending: None };
    loop {
        let stop = cols.last_mut().fill(&mut v)?;
        match v.pending.take() {
            // A new block, wider columns or more room; then the scan goes on.
            Some(s) => cols.push(s),
            None => return Ok((from + v.pos, stop)),
        }
    }
}

/// A position at or after `from` (within [`SYNC_WINDOW`]) from which
/// [`SYNC_RECORDS`] sample records decode in a row.
fn find_sync(bytes: &[u8], from: usize) -> Option<usize> {
    let end = bytes.len().min(from.saturating_add(SYNC_WINDOW));
    'candidates: for q in from..end {
        let mut p = q;
        for _ in 0..SYNC_RECORDS {
            if bytes.get(p) != Some(&tag::SAMPLE) {
                continue 'candidates;
            }
            match sample::decode_at(bytes, p) {
                Some((_, next)) => p = next,
                None => continue 'candidates,
            }
        }
        return Some(q);
    }
    None
}

/// One piece of the speculatively decoded rest of the file, in stream order.
enum Segment {
    /// Consecutive sample records starting at file offset `offset`, decoded
    /// into the speculation's columns at `start..end`, with their largest ids
    /// and the range of their timestamps relative to the time at the start of
    /// the speculation.
    Samples {
        offset: usize,
        start: usize,
        end: usize,
        max_thread: u32,
        max_stack: u32,
        min_rel: i64,
        max_rel: i64,
        last_rel: i64,
    },
    /// A record other than a sample at `offset`, whose syntax decoded
    /// completely, with `start` samples decoded before it.
    Record { offset: usize, start: usize },
}

/// The speculatively decoded rest of the file.
struct Speculation {
    /// The samples, with timestamps relative to the time at the start of the
    /// speculation (rebased onto it when that is known).
    cols: SampleColumns,
    segments: Vec<Segment>,
    /// Where decoding stopped short of the end (a record it could not decode
    /// completely, or cancellation); `None` if it reached the end exactly.
    stopped_at: Option<usize>,
}

/// The speculative decoder's position and the statistics of the run of
/// samples it is in.
struct Decoder<'b> {
    bytes: &'b [u8],
    cancel: &'b AtomicBool,
    p: usize,
    /// Timestamp relative to the start of the speculation.
    rel: i64,
    /// Samples decoded so far (all runs).
    n: usize,
    min_rel: i64,
    max_rel: i64,
    max_thread: u32,
    max_stack: u32,
}

impl Fill for Decoder<'_> {
    /// The time and thread of a sample the filler had no room for (not
    /// consumed), if any.
    type Out = Option<(u64, u32)>;

    /// Decode sample records from `p` until a record that is not one (or
    /// that does not decode, or cancellation), keeping the run's statistics.
    #[inline(always)]
    fn run<L: Layout>(&mut self, w: &mut Filler<'_, L>) -> Option<(u64, u32)> {
        let bytes = self.bytes;
        let (mut p, mut rel, mut n) = (self.p, self.rel, self.n);
        let (mut min_rel, mut max_rel) = (self.min_rel, self.max_rel);
        let (mut max_thread, mut max_stack) = (self.max_thread, self.max_stack);
        let mut no_room = None;
        while bytes.get(p) == Some(&tag::SAMPLE) {
            if n % CANCEL_CHECK_SAMPLES == 0 && self.cancel.load(Ordering::Relaxed) {
                break;
            }
            let Some((SampleFields { delta_us: delta, thread, stack }, next)) = sample::decode_at(bytes, p)
            else {
                break;
            };
            let (Some(r), Ok(t), Ok(s)) =
                (rel.checked_add(delta), u32::try_from(thread), u32::try_from(stack))
            else {
                break;
            };
            if !w.put(r as u64, t, s) {
                no_room = Some((r as u64, t));
                break;
            }
            rel = r;
            min_rel = min_rel.min(r);
            max_rel = max_rel.max(r);
            max_thread = max_thread.max(t);
            max_stack = max_stack.max(s);
            n += 1;
            p = next;
        }
        (self.p, self.rel, self.n) = (p, rel, n);
        (self.min_rel, self.max_rel) = (min_rel, max_rel);
        (self.max_thread, self.max_stack) = (max_thread, max_stack);
        no_room
    }
}

/// Decode `bytes[from..]` without validation (see the module documentation).
fn speculate(bytes: &[u8], from: usize, cancel: &AtomicBool) -> Speculation {
    let bound = (bytes.len() - from) / MIN_SAMPLE_RECORD_LEN;
    let mut sp = Speculation {
        cols: SampleColumns::new(Block::new(0, bound)),
        segments: Vec::new(),
        stopped_at: None,
    };
    let mut d = Decoder {
        bytes,
        cancel,
        p: from,
        rel: 0,
        n: 0,
        min_rel: i64::MAX,
        max_rel: i64::MIN,
        max_thread: 0,
        max_stack: 0,
    };
    while d.p < bytes.len() {
        if cancel.load(Ordering::Relaxed) {
            sp.stopped_at = Some(d.p);
            return sp;
        }
        let (offset, start) = (d.p, d.n);
        (d.min_rel, d.max_rel, d.max_thread, d.max_stack) = (i64::MAX, i64::MIN, 0, 0);
        while let Some((time, thread)) = sp.cols.last_mut().fill(&mut d) {
            sp.cols.make_room(time, thread);
        }
        if d.n > start {
            sp.segments.push(Segment::Samples {
                offset,
                start,
                end: d.n,
                max_thread: d.max_thread,
                max_stack: d.max_stack,
                min_rel: d.min_rel,
                max_rel: d.max_rel,
                last_rel: d.rel,
            });
            continue;
        }
        // A sample record the loop above did not take (cut short, not
        // canonical, or out of its reach) ends the speculation: the
        // sequential reader decides about it.
        if bytes[d.p] == tag::SAMPLE {
            sp.stopped_at = Some(d.p);
            return sp;
        }
        match record::decode(&bytes[d.p..]) {
            Ok((_, len)) => {
                sp.segments.push(Segment::Record { offset: d.p, start: d.n });
                d.p += len;
            }
            Err(_) => {
                sp.stopped_at = Some(d.p);
                return sp;
            }
        }
    }
    sp
}

/// Apply the speculation in stream order after the first half was validated:
/// its columns join `cols`, cut back to what passed. Returns the offset from
/// which the sequential reader must continue (appending to them), or
/// `None` when everything was applied and the file ends on a record boundary.
fn apply(
    bytes: &[u8],
    sp: Speculation,
    defs: &mut Definitions,
    cols: &mut SampleColumns,
) -> Result<Option<usize>, Error> {
    // The time every relative timestamp of the speculation counts from (only
    // sample records move the running time).
    let t0 = defs.last_time_us();
    let in_range = |r: i64| t0.checked_add_signed(r).is_some();
    let Speculation { cols: rest, segments, stopped_at } = sp;
    let before = cols.count();
    cols.append_rebased(rest, t0);
    for seg in &segments {
        match *seg {
            Segment::Samples { offset, start, end, max_thread, max_stack, min_rel, max_rel, last_rel } => {
                if max_thread as usize >= defs.threads().len()
                    || max_stack as usize >= defs.stack_count()
                    || !in_range(min_rel)
                    || !in_range(max_rel)
                {
                    // Some sample of the run breaks a rule: the sequential
                    // reader finds which, with its offset (so this load ends
                    // in that error; the columns are cut back anyway, to hold
                    // exactly the samples applied so far).
                    cols.truncate(before + start);
                    return Ok(Some(offset));
                }
                defs.commit_samples((end - start) as u64, t0.wrapping_add_signed(last_rel));
            }
            Segment::Record { offset, start } => {
                // Never a sample record (the speculation stops at one it
                // cannot take), so applying it moves no sample column.
                debug_assert_ne!(bytes[offset], tag::SAMPLE);
                match defs.read_record(&bytes[offset..]) {
                    Ok((None, _)) => {}
                    Ok((Some(_), _)) => unreachable!("speculation segments hold no sample record"),
                    // Cannot happen for a record whose syntax decoded
                    // completely; the sequential reader decides if it does.
                    Err(DecodeError::Incomplete) => {
                        cols.truncate(before + start);
                        return Ok(Some(offset));
                    }
                    Err(DecodeError::Bad { at, kind }) => {
                        return Err(Error::format((offset + at) as u64, kind))
                    }
                }
            }
        }
    }
    // Stopped short: the samples decoded up to there were all applied.
    Ok(stopped_at)
}
