//! `--spread-blocked`: an estimate of where the blocked time without a stack
//! went.
//!
//! The recorder measures every wait exactly but reads a stack only for the
//! waits a tick finds in progress (README, "Where threads wait"), so a thread
//! that blocks often and briefly (10 ms sleeps, a busy channel) has most of
//! its blocked time without a stack: `[blocked, under 5 ms]` (its short
//! waits, summed) and `[blocked]` (longer waits no tick saw). The waits that
//! do have a stack were found by ticks that fell at moments unrelated to the
//! thread (the recorder jitters them), which makes them samples of where the
//! thread was blocked: a site the thread spends more of its time blocked in
//! is found more often. The estimate charges each of a thread's intervals
//! without a stack to the stacks of that thread's waits with one (those the
//! same filter selects), in proportion to how many were found in each, as a
//! sampling profiler charges time to the stacks its samples saw:
//!
//! - `[blocked, under 5 ms]` to the waits with a stack shorter than 5 ms (a
//!   tick captures a sample of the short waits it finds, so these are an
//!   even sample of them), or all of them if the thread has none;
//! - `[blocked]` to those of 5 ms or more (a tick captures each such wait it
//!   finds 5 ms old), or all of them if the thread has none; in a recording
//!   made before `[blocked, under 5 ms]` existed, where `[blocked]` holds the
//!   sums too, to all of them.
//!
//! A thread with no wait with a stack keeps its intervals as they are;
//! preempted time (`[waiting for CPU]`) is left as it is. The figures
//! measured against known waits are in BENCHMARKS.md ("Where the blocked
//! time without a stack went").

use std::collections::HashMap;

use spulse::{Definitions, Frame, OffCpuInterval, OffCpuState, Sample, StackId};

use crate::select::{Filter, Selector};

/// The label of the recorder's sums of short waits without a stack
/// (FORMAT.md, frame kind 3).
pub const SHORT_BLOCKED: &str = "blocked, under 5 ms";

/// Waits shorter than this are summed by the recorder when they have no stack.
const SHORT_US: u64 = 5_000;

/// How the stack of an off-CPU interval reads.
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

fn kind(defs: &Definitions, o: &OffCpuInterval) -> Kind {
    if o.state != OffCpuState::Blocked || o.stack.index() >= defs.stack_count() {
        return Kind::Other;
    }
    let node = defs.stack(o.stack);
    let Frame::Label(l) = defs.frame(node.frame) else { return Kind::Other };
    match (defs.label(l), node.parent) {
        ("blocked", None) => Kind::Stackless,
        (SHORT_BLOCKED, None) => Kind::ShortStackless,
        (label, _) if label.starts_with("blocked: ") => Kind::Captured,
        _ => Kind::Other,
    }
}

/// A thread's captured stacks, each with the number of waits it was found
/// in: shorter than 5 ms, and 5 ms or more.
#[derive(Debug, Default)]
struct Captures {
    stacks: Vec<(StackId, [u64; 2])>,
    sums: [u64; 2],
}

/// Per thread, the captured stacks and how many waits each was captured in.
#[derive(Debug, Default)]
pub struct Spread {
    /// Indexed by thread id.
    threads: Vec<Captures>,
    /// Whether the recording writes its sums apart (`[blocked, under 5 ms]`).
    sums_apart: bool,
    /// Microseconds moved from the stackless roots to captured stacks so far.
    pub moved_us: u64,
    /// Microseconds without a stack left (threads with no capture).
    pub kept_us: u64,
    /// The waits with a stack the estimate draws on (selected).
    pub captures: u64,
}

impl Spread {
    /// The captures of the intervals `filter` selects, per thread.
    pub fn new(defs: &Definitions, filter: &Filter) -> Spread {
        let mut select = Selector::new(filter, defs.start_time_us());
        let mut index: HashMap<(u32, StackId), usize> = HashMap::new();
        let mut threads: Vec<Captures> = Vec::new();
        let mut sums_apart = false;
        for o in defs.off_cpu_intervals() {
            let k = kind(defs, o);
            sums_apart |= k == Kind::ShortStackless;
            if k != Kind::Captured {
                continue;
            }
            let s = Sample { time_us: o.start_us, thread: o.thread, stack: o.stack };
            if select.next_at(defs, &s, o.samples_before).is_none() {
                continue;
            }
            let t = o.thread.index();
            if t >= threads.len() {
                threads.resize_with(t + 1, Default::default);
            }
            let c = &mut threads[t];
            let i = *index.entry((t as u32, o.stack)).or_insert_with(|| {
                c.stacks.push((o.stack, [0; 2]));
                c.stacks.len() - 1
            });
            let long = usize::from(o.duration_us >= SHORT_US);
            c.stacks[i].1[long] += 1;
            c.sums[long] += 1;
        }
        let captures = threads.iter().map(|c| c.sums[0] + c.sums[1]).sum();
        Spread { threads, sums_apart, moved_us: 0, kept_us: 0, captures }
    }

    /// Charge interval `o`: to its own stack, or, for one without a stack of
    /// a thread with captures, to the captured stacks in proportion (shares
    /// in whole microseconds summing exactly to its duration; a stack whose
    /// share rounds to 0 is not called).
    pub fn charge(&mut self, defs: &Definitions, o: &OffCpuInterval, mut f: impl FnMut(StackId, u64)) {
        let d = o.duration_us;
        // Which captures speak for it: short ones, long ones, or all.
        let class = match kind(defs, o) {
            Kind::ShortStackless => Some(0),
            Kind::Stackless if self.sums_apart => Some(1),
            Kind::Stackless => None,
            _ => return f(o.stack, d),
        };
        let Some(c) = self.threads.get(o.thread.index()).filter(|c| c.sums[0] + c.sums[1] > 0) else {
            self.kept_us += d;
            return f(o.stack, d);
        };
        let weight: &dyn Fn(&[u64; 2]) -> u64 = match class {
            Some(k) if c.sums[k] > 0 => &move |n: &[u64; 2]| n[k],
            _ => &|n: &[u64; 2]| n[0] + n[1],
        };
        let sum: u64 = weight(&c.sums);
        self.moved_us += d;
        let (mut cum, mut given) = (0u128, 0u64);
        for (stack, n) in &c.stacks {
            cum += weight(n) as u128;
            let upto = (d as u128 * cum / sum as u128) as u64;
            if upto > given {
                f(*stack, upto - given);
                given = upto;
            }
        }
    }
}
