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
//! sampling profiler charges time to the stacks its samples saw:
//!
//! - `[blocked, under 5 ms]` to its waits with a stack shorter than 5 ms (a
//!   tick captures a random sample of the short waits it finds, so these
//!   are an even sample of them), or to all of them if it has none;
//! - `[blocked]` to those of 5 ms or more (a tick captures each such wait it
//!   finds 5 ms old), or to all of them if it has none; in a recording made
//!   before `[blocked, under 5 ms]` existed, where `[blocked]` holds the sums
//!   too, to all of them.
//!
//! A thread with no wait with a stack keeps its intervals as they are, and
//! preempted time (`[waiting for CPU]`) is never moved. The figures measured
//! against known waits are in BENCHMARKS.md ("Where the blocked time without
//! a stack went").
//!
//! ```
//! use spulse::spread::BlockedSpread;
//! # fn show(defs: &spulse::Definitions) {
//! let mut spread = BlockedSpread::new(defs);
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
/// in: shorter than 5 ms, and 5 ms or more.
#[derive(Debug, Default, Clone)]
struct Captures {
    stacks: Vec<(StackId, [u64; 2])>,
    index: HashMap<StackId, usize>,
    sums: [u64; 2],
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

/// The waits with a stack of each thread, to charge the waits without one
/// to (module documentation).
#[derive(Debug, Default, Clone)]
pub struct BlockedSpread {
    threads: HashMap<ThreadId, Captures>,
    /// Whether the recording writes its sums apart (`[blocked, under 5 ms]`).
    sums_apart: bool,
    captures: u64,
}

impl BlockedSpread {
    /// An estimate for a recording with these definitions (they say whether
    /// it writes its sums of short waits apart). Feed it the waits with
    /// [`BlockedSpread::observe`] before charging any.
    pub fn new(defs: &Definitions) -> BlockedSpread {
        let sums_apart = defs
            .frames()
            .iter()
            .any(|f| matches!(f, Frame::Label(l) if defs.label(*l) == SHORT_BLOCKED_LABEL));
        BlockedSpread { sums_apart, ..BlockedSpread::default() }
    }

    /// Count interval `o` if it is a wait with a stack (and note a sum of
    /// short waits: the recording writes them apart). Call it for every
    /// interval the view shows.
    pub fn observe(&mut self, defs: &Definitions, o: &OffCpuInterval) {
        match kind(defs, o.stack, o.state) {
            Kind::ShortStackless => self.sums_apart = true,
            Kind::Captured => {
                let c = self.threads.entry(o.thread).or_default();
                let i = match c.index.get(&o.stack) {
                    Some(&i) => i,
                    None => {
                        c.stacks.push((o.stack, [0; 2]));
                        c.index.insert(o.stack, c.stacks.len() - 1);
                        c.stacks.len() - 1
                    }
                };
                let long = usize::from(o.duration_us >= SHORT_US);
                c.stacks[i].1[long] += 1;
                c.sums[long] += 1;
                self.captures += 1;
            }
            _ => {}
        }
    }

    /// The waits with a stack observed.
    pub fn captures(&self) -> u64 {
        self.captures
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
        // Which waits with a stack speak for it: short ones, long ones, or all.
        let class = match kind(defs, stack, state) {
            Kind::ShortStackless => Some(0),
            Kind::Stackless if self.sums_apart => Some(1),
            Kind::Stackless => None,
            _ => {
                f(stack, duration_us);
                return Charged::Own;
            }
        };
        let Some(c) = self.threads.get(&thread).filter(|c| c.sums[0] + c.sums[1] > 0) else {
            f(stack, duration_us);
            return Charged::Kept;
        };
        let weight = |n: &[u64; 2]| match class {
            Some(k) if c.sums[k] > 0 => n[k],
            _ => n[0] + n[1],
        };
        let sum = weight(&c.sums) as u128;
        let (mut cum, mut given) = (0u128, 0u64);
        for (s, n) in &c.stacks {
            cum += weight(n) as u128;
            let upto = (duration_us as u128 * cum / sum) as u64;
            if upto > given {
                f(*s, upto - given);
                given = upto;
            }
        }
        Charged::Moved
    }
}
