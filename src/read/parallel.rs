//! Loading a large spool on two cores, for [`Snapshot`](super::Snapshot).
//!
//! A spool is one stream of variable-length records, so its second half cannot
//! be validated before its first half is (ids, references and timestamps depend
//! on everything before them). It can be *decoded* speculatively, though:
//!
//! 1. Past the midpoint, find a position from which [`SYNC_RECORDS`] records in
//!    a row decode as sample records: very likely a record boundary.
//! 2. One thread validates the first half exactly as the sequential reader
//!    does, stopping at that position; a second thread meanwhile decodes the
//!    rest into runs of samples (with each run's largest thread and stack ids
//!    and its timestamp range, relative to the run's start) and the offsets of
//!    the other records between them, checking only syntax.
//! 3. If the first half ends exactly at the chosen position, it was a
//!    boundary and the decoding of the rest is the one the sequential reader
//!    would make. The validating thread then applies the rest in stream order:
//!    other records through the same rule code as always, runs of samples
//!    with one check per run (ids below the counts defined so far, timestamps
//!    in range from the running time). Anything that does not pass (a failed
//!    run check, a record the speculation could not decode, or a first half
//!    that did not end at the position) is re-read sequentially from there, so
//!    errors, their offsets and the recovered tail are exactly those of the
//!    sequential reader; `tests/format_parallel.rs` and the fuzz checks
//!    compare the two.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::scan::{format_error, scan, Stop};
use super::snapshot::advise_huge_pages;
use crate::format::defs::Definitions;
use crate::format::record::{self, DecodeError};
use crate::format::{tag, varint};
use crate::Error;

/// Spools shorter than this (bytes after the header) load on one core: below
/// it, starting a thread costs more than it saves.
pub(crate) const PARALLEL_MIN_BYTES: usize = 4 << 20;

/// Consecutive sample records that must decode from a position before the
/// second half is decoded from it.
const SYNC_RECORDS: usize = 64;
/// How far past the midpoint a synchronization position is looked for.
const SYNC_WINDOW: usize = 64 << 10;

/// Loads whose second half was applied from the speculative decoding (for
/// tests, which check that the two-thread path really ran).
static SPECULATIONS_APPLIED: AtomicU64 = AtomicU64::new(0);

/// How many loads so far applied a speculatively decoded second half.
#[doc(hidden)]
pub fn speculations_applied() -> u64 {
    SPECULATIONS_APPLIED.load(Ordering::Relaxed)
}

/// The sample columns a [`Snapshot`](super::Snapshot) is built from.
pub(crate) struct Columns {
    pub times: Vec<u64>,
    pub threads: Vec<u32>,
    pub stacks: Vec<u32>,
}

impl Columns {
    fn push(&mut self, s: crate::Sample) {
        self.times.push(s.time_us);
        self.threads.push(s.thread.get());
        self.stacks.push(s.stack.get());
    }
}

/// Validate `bytes` (a spool whose header, `hlen` bytes, was already read)
/// into `defs` and `cols`, using a second thread for the second half when
/// `min_parallel` bytes or more follow the header. Returns the length of the
/// validated prefix and whether the file ends inside a record.
pub(crate) fn load(
    bytes: &[u8],
    hlen: usize,
    defs: &mut Definitions,
    cols: &mut Columns,
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
        let first = scan(&bytes[hlen..sync], hlen as u64, defs, |x, _| {
            cols.push(x);
            true
        });
        let resume = match first {
            Err(e) => {
                cancel.store(true, Ordering::Relaxed);
                return Err(e);
            }
            // The first half ended exactly at `sync`: it is a record boundary.
            Ok((used, Stop::End)) if hlen + used == sync => None,
            // A record straddles `sync`: the speculation started mid-record.
            Ok((used, _)) => Some(hlen + used),
        };
        let resume = match resume {
            Some(at) => {
                cancel.store(true, Ordering::Relaxed);
                at
            }
            None => match rest.join() {
                Ok(spec) => match apply(bytes, &spec, defs, cols).inspect(|_| {
                    SPECULATIONS_APPLIED.fetch_add(1, Ordering::Relaxed);
                })? {
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
    cols: &mut Columns,
) -> Result<(usize, bool), Error> {
    let (used, stop) = scan(&bytes[from..], from as u64, defs, |x, _| {
        cols.push(x);
        true
    })?;
    Ok((from + used, stop == Stop::Incomplete))
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
            match varint::decode_sample_at(bytes, p) {
                Some((_, _, _, next)) => p = next,
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
    /// into `rel[start..end]` (timestamps relative to the time before the
    /// run), `threads` and `stacks`.
    Samples {
        offset: usize,
        start: usize,
        end: usize,
        max_thread: u32,
        max_stack: u32,
        min_rel: i64,
        max_rel: i64,
    },
    /// Any other record (or a sample record outside the fast decoder's reach),
    /// at `offset`, whose syntax decoded completely.
    Record { offset: usize },
}

/// The speculatively decoded rest of the file.
struct Speculation {
    rel: Vec<i64>,
    threads: Vec<u32>,
    stacks: Vec<u32>,
    segments: Vec<Segment>,
    /// Where decoding stopped short of the end (a record it could not decode
    /// completely, or cancellation); `None` if it reached the end exactly.
    stopped_at: Option<usize>,
}

/// Decode `bytes[from..]` without validation (see the module documentation).
fn speculate(bytes: &[u8], from: usize, cancel: &AtomicBool) -> Speculation {
    let bound = (bytes.len() - from) / 4;
    let mut sp = Speculation {
        rel: Vec::with_capacity(bound),
        threads: Vec::with_capacity(bound),
        stacks: Vec::with_capacity(bound),
        segments: Vec::new(),
        stopped_at: None,
    };
    advise_huge_pages(&mut sp.rel);
    advise_huge_pages(&mut sp.threads);
    advise_huge_pages(&mut sp.stacks);
    let mut p = from;
    while p < bytes.len() {
        if cancel.load(Ordering::Relaxed) {
            sp.stopped_at = Some(p);
            return sp;
        }
        let (offset, start) = (p, sp.rel.len());
        let (mut rel, mut min_rel, mut max_rel) = (0i64, i64::MAX, i64::MIN);
        let (mut max_thread, mut max_stack) = (0u32, 0u32);
        while bytes.get(p) == Some(&tag::SAMPLE) {
            if sp.rel.len() % 4096 == 0 && cancel.load(Ordering::Relaxed) {
                break;
            }
            let Some((delta, thread, stack, next)) = varint::decode_sample_at(bytes, p) else { break };
            let (Some(r), Ok(t), Ok(s)) =
                (rel.checked_add(delta), u32::try_from(thread), u32::try_from(stack))
            else {
                break;
            };
            rel = r;
            min_rel = min_rel.min(r);
            max_rel = max_rel.max(r);
            max_thread = max_thread.max(t);
            max_stack = max_stack.max(s);
            sp.rel.push(r);
            sp.threads.push(t);
            sp.stacks.push(s);
            p = next;
        }
        if sp.rel.len() > start {
            let end = sp.rel.len();
            sp.segments.push(Segment::Samples {
                offset,
                start,
                end,
                max_thread,
                max_stack,
                min_rel,
                max_rel,
            });
            continue;
        }
        match record::decode(&bytes[p..]) {
            Ok((_, len)) => {
                sp.segments.push(Segment::Record { offset: p });
                p += len;
            }
            Err(_) => {
                sp.stopped_at = Some(p);
                return sp;
            }
        }
    }
    sp
}

/// Apply the speculation in stream order after the first half was validated.
/// Returns the offset from which the sequential reader must continue, or
/// `None` when everything was applied and the file ends on a record boundary.
fn apply(
    bytes: &[u8],
    sp: &Speculation,
    defs: &mut Definitions,
    cols: &mut Columns,
) -> Result<Option<usize>, Error> {
    for seg in &sp.segments {
        match *seg {
            Segment::Samples { offset, start, end, max_thread, max_stack, min_rel, max_rel } => {
                let time = defs.last_time_us();
                let in_range = |r: i64| time.checked_add_signed(r).is_some();
                if max_thread as usize >= defs.threads().len()
                    || max_stack as usize >= defs.stack_count()
                    || !in_range(min_rel)
                    || !in_range(max_rel)
                {
                    // Some sample of the run breaks a rule: the sequential
                    // reader finds which, with its offset.
                    return Ok(Some(offset));
                }
                cols.times.extend(sp.rel[start..end].iter().map(|&r| time.wrapping_add_signed(r)));
                cols.threads.extend_from_slice(&sp.threads[start..end]);
                cols.stacks.extend_from_slice(&sp.stacks[start..end]);
                defs.commit_samples((end - start) as u64, time.wrapping_add_signed(sp.rel[end - 1]));
            }
            Segment::Record { offset } => match defs.read_record(&bytes[offset..]) {
                Ok((sample, _)) => {
                    if let Some(s) = sample {
                        cols.push(s);
                    }
                }
                // Cannot happen for a record whose syntax decoded completely;
                // the sequential reader decides if it does.
                Err(DecodeError::Incomplete) => return Ok(Some(offset)),
                Err(DecodeError::Bad { at, kind }) => return Err(format_error((offset + at) as u64, kind)),
            },
        }
    }
    Ok(sp.stopped_at)
}
