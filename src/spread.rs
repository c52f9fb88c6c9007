//! An estimate of where the blocked time without a stack went (the views'
//! `--spread-blocked`, the endpoint's `spread_blocked=1`).
//!
//! The off-CPU mode measures every wait exactly but reads a stack only for
//! the waits a writer tick finds in progress (README, "Where threads wait"),
//! so a thread that blocks often and briefly (10 ms sleeps, a busy channel)
//! has most of its blocked time without a stack: `[blocked, under 5 ms]`
//! (its short waits, summed) and `[blocked]` (longer waits no tick saw). The
//! waits that do have a stack were found by ticks that fell at moments
//! unrelated to the thread (the recorder jitters them), which makes them
//! samples of where the thread was blocked. [`BlockedSpread`] charges each
//! of a thread's intervals without a stack to the stacks of that thread's
//! waits with one, in proportion to how many were found in each, as a
//! sampling profiler charges time to the stacks its samples saw.
//!
//! The waits are compared by length (strata): a tick captures every wait it
//! finds 5 ms old, but only a sample of the younger ones, so a wait's chance
//! of a stack grows with its length faster than its time does, and a site of
//! 12 ms waits would take time from a site of 6 ms waits of the same thread.
//! Within waits of about one length the chance is the same, so:
//!
//! - `[blocked, under 5 ms]` goes to the thread's waits with a stack shorter
//!   than 5 ms (each such wait a tick finds is as likely to be captured);
//! - a `[blocked]` wait to those of about its length: strata of 5-7.5 ms,
//!   7.5-11.25 ms and so on, each half as long again as the one before;
//! - where the thread has no wait with a stack in that stratum, to those of
//!   the nearest stratum that has some.
//!
//! A thread with no wait with a stack keeps its intervals as they are, and
//! preempted time (`[waiting for CPU]`) is never moved. Sites whose waits are
//! of different lengths come out exact; sites of the same length are a true
//! sample (about 10 short waits with a stack a second for a whole process),
//! whose error shrinks with the recording's length. The figures measured
//! against known waits are in BENCHMARKS.md ("Where the blocked time without
//! a stack went").
//!
//! ```
//! use spulse::spread::BlockedSpread;
//! # fn show(defs: &spulse::Definitions) {
//! let mut spread = BlockedSpread::new();
//! for o in defs.off_cpu_intervals() {
//!     spread.observe(defs, o);
//! }
//! for o in defs.off_cpu_intervals() {
//!     spread.charge(defs, o.thread, o.stack, o.state, o.duration_us, |stack, us| {
//!         println!("{us} us to stack {}", stack.index());
//!     });
//! }
//! # }
//! ```

use std::collections::HashMap;

use crate::{Definitions, Frame, OffCpuInterval, OffCpuState, StackId, ThreadId};

/// The label of the recorder's sums of short blocked waits without a stack
/// (FORMAT.md, frame kind 3).
pub const SHORT_BLOCKED_LABEL: &str = "blocked, under 5 ms";

/// The label of a blocked wait whose stack was not read (FORMAT.md).
pub const BLOCKED_LABEL: &str = "blocked";

/// Waits shorter than this (microseconds) are summed by the recorder when
/// they have no stack.
const SHORT_US: u64 = 5_000;

/// Strata: 0 for the short waits (under [`SHORT_US`]), then waits of 5 ms
/// and more by length, each stratum half as long again as the one before
/// (5-7.5 ms, 7.5-11.25 ms, ...), the last open-ended (from about 2.2 s).
const STRATA: usize = 17;

/// The stratum of a wait of `us` microseconds.
fn stratum_of(us: u64) -> usize {
    let mut bound = SHORT_US;
    let mut k = 0;
    while k < STRATA - 1 && us >= bound {
        bound = bound.saturating_mul(3) / 2;
        k += 1;
    }
    k
}

/// How the stack of a blocked interval reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `[blocked]` alone: a wait whose stack was not read.
    Stackless,
    /// `[blocked, under 5 ms]` alone: short waits without a stack, summed.
    ShortStackless,
    /// A stack whose leaf is `blocked: NAME`: a wait whose stack was read.
    Captured,
    Other,
}

fn kind(defs: &Definitions, stack: StackId, state: OffCpuState) -> Kind {
    if state != OffCpuState::Blocked || stack.index() >= defs.stack_count() {
        return Kind::Other;
    }
    let node = defs.stack(stack);
    let Frame::Label(l) = defs.frame(node.frame) else { return Kind::Other };
    match (defs.label(l), node.parent) {
        (BLOCKED_LABEL, None) => Kind::Stackless,
        (SHORT_BLOCKED_LABEL, None) => Kind::ShortStackless,
        (label, _) if label.starts_with("blocked: ") => Kind::Captured,
        _ => Kind::Other,
    }
}

/// Whether an interval of `stack` in `state` has no stack of its own
/// (`[blocked]` or `[blocked, under 5 ms]` alone): what
/// [`BlockedSpread::charge`] moves.
pub fn is_stackless(defs: &Definitions, stack: StackId, state: OffCpuState) -> bool {
    matches!(kind(defs, stack, state), Kind::Stackless | Kind::ShortStackless)
}

/// A thread's captured stacks, each with the number of waits it was found
/// in per stratum.
#[derive(Debug, Default, Clone)]
struct Captures {
    stacks: Vec<(StackId, [u32; STRATA])>,
    index: HashMap<StackId, usize>,
    sums: [u64; STRATA],
    /// The last wait with a stack counted: its stack and end (a wait the
    /// recorder split at a live reader's window edge is written as parts,
    /// each starting where the one before ended, with the same stack: it is
    /// counted once).
    last: Option<(StackId, u64)>,
}

/// What [`BlockedSpread::charge`] did with an interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charged {
    /// It has a stack (or is preempted): charged to its own.
    Own,
    /// It had none: charged to the thread's captured stacks.
    Moved,
    /// It had none and its thread has no wait with a stack: charged to its own.
    Kept,
}

/// Which of a thread's waits with a stack speak for an interval without
/// one ([`BlockedSpread::stratum`]): those of about its length, or all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stratum(u8);

/// The waits with a stack of each thread, to charge the waits without one
/// to (module documentation).
#[derive(Debug, Default, Clone)]
pub struct BlockedSpread {
    threads: HashMap<ThreadId, Captures>,
    captures: u64,
}

impl BlockedSpread {
    /// An empty estimate: feed it the waits with [`BlockedSpread::observe`]
    /// before charging any.
    pub fn new() -> BlockedSpread {
        BlockedSpread::default()
    }

    /// Count interval `o` if it is a wait with a stack (a part of a split
    /// wait that continues the one counted just before, once). Call it for
    /// every interval the view shows, in the order of the spool.
    pub fn observe(&mut self, defs: &Definitions, o: &OffCpuInterval) {
        if kind(defs, o.stack, o.state) != Kind::Captured {
            return;
        }
        let c = self.threads.entry(o.thread).or_default();
        let end = o.start_us.saturating_add(o.duration_us);
        if c.last.replace((o.stack, end)) == Some((o.stack, o.start_us)) {
            return;
        }
        let i = match c.index.get(&o.stack) {
            Some(&i) => i,
            None => {
                c.stacks.push((o.stack, [0; STRATA]));
                c.index.insert(o.stack, c.stacks.len() - 1);
                c.stacks.len() - 1
            }
        };
        let k = stratum_of(o.duration_us);
        c.stacks[i].1[k] = c.stacks[i].1[k].saturating_add(1);
        c.sums[k] += 1;
        self.captures += 1;
    }

    /// The waits with a stack observed.
    pub fn captures(&self) -> u64 {
        self.captures
    }

    /// The stratum an interval's time is charged by, or `None` when it keeps
    /// its own stack (it has one, or is preempted). A sum of short waits
    /// goes by the short waits with a stack; a single wait without one by
    /// those of about its length, `duration_us`.
    pub fn stratum(
        &self,
        defs: &Definitions,
        stack: StackId,
        state: OffCpuState,
        duration_us: u64,
    ) -> Option<Stratum> {
        match kind(defs, stack, state) {
            Kind::ShortStackless => Some(Stratum(0)),
            Kind::Stackless => Some(Stratum(stratum_of(duration_us).max(1) as u8)),
            _ => None,
        }
    }

    /// Charge `duration_us` of `thread` off the CPU in `stack` and `state`:
    /// `f(stack, us)` once with its own stack, or, for a blocked interval
    /// without a stack of a thread with waits with one, once for each of
    /// those stacks with its share (whole microseconds summing exactly to
    /// `duration_us`; a stack whose share rounds to 0 is left out).
    pub fn charge(
        &self,
        defs: &Definitions,
        thread: ThreadId,
        stack: StackId,
        state: OffCpuState,
        duration_us: u64,
        mut f: impl FnMut(StackId, u64),
    ) -> Charged {
        match self.stratum(defs, stack, state, duration_us) {
            None => {
                f(stack, duration_us);
                Charged::Own
            }
            Some(st) => self.charge_stratum(thread, st, duration_us, |s, us| f(s.unwrap_or(stack), us)),
        }
    }

    /// Charge `us` microseconds without a stack of `thread` in stratum `st`
    /// ([`BlockedSpread::stratum`]; the charge is linear, so the time of
    /// many intervals of one stratum may be charged at once): `f(Some(stack),
    /// share)` for each captured stack, in proportion to its waits of the
    /// stratum (the nearest stratum with any, the shorter one first at equal
    /// distance), or `f(None, us)` if the thread has no wait with a stack.
    pub fn charge_stratum(
        &self,
        thread: ThreadId,
        st: Stratum,
        us: u64,
        mut f: impl FnMut(Option<StackId>, u64),
    ) -> Charged {
        let Some(c) = self.threads.get(&thread).filter(|c| c.sums.iter().any(|&n| n > 0)) else {
            f(None, us);
            return Charged::Kept;
        };
        // The stratum speaking for it: its own, or the nearest with captures
        // (one exists: the thread has some).
        let k = st.0 as usize;
        let k = (0..STRATA)
            .flat_map(|d| [k.checked_sub(d), Some(k + d)])
            .flatten()
            .find(|&j| j < STRATA && c.sums[j] > 0)
            .unwrap_or(k);
        let sum = c.sums[k] as u128;
        let (mut cum, mut given) = (0u128, 0u64);
        for (s, n) in &c.stacks {
            cum += n[k] as u128;
            let upto = (us as u128 * cum / sum) as u64;
            if upto > given {
                f(Some(*s), upto - given);
                given = upto;
            }
        }
        Charged::Moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strata_grow_by_half() {
        assert_eq!(stratum_of(0), 0);
        assert_eq!(stratum_of(4_999), 0);
        assert_eq!(stratum_of(5_000), 1);
        assert_eq!(stratum_of(7_499), 1);
        assert_eq!(stratum_of(7_500), 2);
        assert_eq!(stratum_of(11_250), 3);
        assert_eq!(stratum_of(u64::MAX), STRATA - 1);
    }
}
