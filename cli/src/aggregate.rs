//! Streaming aggregation: samples are read once through `Replay`, selected by
//! [`crate::select`], and counted per (context, stack id). Nothing per sample
//! is kept, so memory is bounded by the distinct stacks, never by the number
//! of samples.

use std::collections::HashMap;

use spulse::{Definitions, Replay, StackId};

use crate::input::{progress, PROGRESS_STEP};
use crate::select::{Context, Contexts, Filter, Selector, TimeMode};
use crate::spread::Spread;
use crate::CliError;

/// A multiplicative hasher for the small integer keys of the per-thread counts
/// (the default SipHash costs more than the rest of the per-sample work).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

/// An odd constant with well-mixed bits (the one FxHash uses): multiplying by
/// it spreads consecutive ids over the high bits hashbrown takes its buckets from.
const MULTIPLIER: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    #[inline]
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(MULTIPLIER);
    }
}

/// The most contexts counted densely (see [`aggregate`]; two a process,
/// with and without its perf map).
const DENSE_CONTEXTS: usize = 64;

type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

enum Counts {
    /// `[context][stack index]` for a handful of contexts, plus every
    /// (context, stack) in the order it was first counted.
    Dense(Vec<Vec<u64>>, Vec<(u32, StackId)>),
    /// `(context, stack)`, for per-thread aggregations.
    Sparse(IdMap<(u32, StackId), u64>),
}

/// Sample counts per (context, stack): samples, or microseconds when the
/// filter's [`TimeMode`] counts time (`--off-cpu`, `--wall`).
pub struct Aggregate {
    /// The contexts, indexed by the context ids used in [`Aggregate::iter`].
    pub contexts: Vec<Context>,
    counts: Counts,
    /// Samples counted (after filtering), or microseconds in a time mode.
    pub total: u64,
    /// Smallest and largest timestamp of the counted samples.
    pub time_range: Option<(u64, u64)>,
    /// Off-CPU microseconds per (context, stack) of the selected intervals,
    /// whatever the mode (the pprof export's `off-cpu` sample type).
    pub off_cpu: IdMap<(u32, StackId), u64>,
    /// With `--spread-blocked`: what the estimate moved.
    pub spread: Option<SpreadTotals>,
    /// Microseconds waiting for a CPU that `--off-cpu` left out (blocked
    /// time only; `--wall` counts it).
    pub left_out_us: u64,
}

/// What `--spread-blocked` did in an aggregation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpreadTotals {
    /// Microseconds blocked without a stack charged to captured stacks.
    pub moved_us: u64,
    /// Microseconds blocked without a stack kept (threads without a capture).
    pub kept_us: u64,
    /// The waits with a stack the estimate drew on.
    pub captures: u64,
}

impl Aggregate {
    /// Every (context id, stack, count) with a non-zero count, sorted by
    /// (context, stack) so that output built from it is deterministic.
    pub fn iter(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        let mut v: Vec<(usize, StackId, u64)> = match &self.counts {
            Counts::Dense(counts, seen) => {
                seen.iter().map(|&(c, s)| (c as usize, s, counts[c as usize][s.index()])).collect()
            }
            Counts::Sparse(m) => m.iter().map(|(&(c, s), &n)| (c as usize, s, n)).collect(),
        };
        v.sort_unstable_by_key(|&(c, s, _)| (c, s));
        v.into_iter()
    }

    /// An aggregation from counts gathered elsewhere (`follow` counts as it tails).
    pub fn from_counts(contexts: Vec<Context>, counts: HashMap<(u32, StackId), u64>) -> Aggregate {
        let total = counts.values().sum();
        let counts = counts.into_iter().collect();
        Aggregate {
            contexts,
            counts: Counts::Sparse(counts),
            total,
            time_range: None,
            off_cpu: IdMap::default(),
            spread: None,
            left_out_us: 0,
        }
    }

    /// Every (context id, stack, off-CPU microseconds), sorted as [`Aggregate::iter`].
    pub fn iter_off_cpu(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        let mut v: Vec<(usize, StackId, u64)> =
            self.off_cpu.iter().map(|(&(c, s), &n)| (c as usize, s, n)).collect();
        v.sort_unstable_by_key(|&(c, s, _)| (c, s));
        v.into_iter()
    }

    /// One aggregation per process (by the contexts' pids), each with its own
    /// contexts: what aggregating each process alone would give, from one
    /// pass over the samples (`top --per-process` aggregated every process
    /// alone, reading the whole spool each time: 25-34 s for 8,000
    /// processes). Only without `--spread-blocked` (whose totals are not
    /// kept per process): `spread` is `None` in each.
    pub fn split_by_pid(self) -> HashMap<u32, Aggregate> {
        let mut out: HashMap<u32, Aggregate> = HashMap::new();
        // Each context's new id in its process's aggregation.
        let mut ids: Vec<u32> = Vec::with_capacity(self.contexts.len());
        for c in &self.contexts {
            let a = out.entry(c.pid).or_insert_with(|| Aggregate {
                contexts: Vec::new(),
                counts: Counts::Sparse(IdMap::default()),
                total: 0,
                time_range: None,
                off_cpu: IdMap::default(),
                spread: None,
                // (Not kept per process.)
                left_out_us: 0,
            });
            ids.push(a.contexts.len() as u32);
            a.contexts.push(*c);
        }
        for (c, s, n) in self.iter() {
            let a = out.get_mut(&self.contexts[c].pid).expect("every context's pid");
            if let Counts::Sparse(m) = &mut a.counts {
                *m.entry((ids[c], s)).or_insert(0) += n;
            }
            a.total = a.total.saturating_add(n);
        }
        for (&(c, s), &n) in &self.off_cpu {
            let a = out.get_mut(&self.contexts[c as usize].pid).expect("every context's pid");
            *a.off_cpu.entry((ids[c as usize], s)).or_insert(0) += n;
        }
        out
    }

    /// Number of distinct (context, stack) pairs with samples.
    pub fn distinct(&self) -> usize {
        match &self.counts {
            Counts::Dense(_, seen) => seen.len(),
            Counts::Sparse(m) => m.len(),
        }
    }
}

/// Read every sample of `replay` and count it per (context, stack).
pub fn aggregate(replay: &Replay, filter: &Filter, per_thread: bool) -> Result<Aggregate, CliError> {
    let defs: &Definitions = replay;
    let mut select = Selector::new(filter, defs.start_time_us());
    let mut contexts = Contexts::new(defs, per_thread);
    let stacks = defs.stack_count();
    // Dense counts take a slot per stack for each context counted: for a
    // handful of contexts only (a recording of a build has thousands of
    // processes, each a context).
    let mut counts = if per_thread || contexts.len() > DENSE_CONTEXTS {
        Counts::Sparse(IdMap::default())
    } else {
        Counts::Dense(vec![Vec::new(); contexts.len()], Vec::new())
    };
    let bar = progress(defs.sample_count(), "reading");
    let (mut tmin, mut tmax) = (u64::MAX, 0u64);
    let mode = filter.time;
    // Weight of one CPU sample: 1 (samples), or its interval in microseconds.
    let sample_weight = if mode.is_time() { defs.interval_us().max(1) } else { 1 };
    let mut total = 0u64;
    let add = |counts: &mut Counts, ctx: u32, stack: StackId, w: u64| match counts {
        Counts::Dense(v, seen) => {
            let c = &mut v[ctx as usize];
            if c.is_empty() {
                c.resize(stacks, 0);
            }
            let slot = &mut c[stack.index()];
            if *slot == 0 {
                seen.push((ctx, stack));
            }
            // (Saturating: a spool's durations are untrusted.)
            *slot = slot.saturating_add(w);
        }
        Counts::Sparse(m) => {
            let n: &mut u64 = m.entry((ctx, stack)).or_insert(0);
            *n = n.saturating_add(w);
        }
    };
    let samples = if mode == TimeMode::OffCpu { None } else { Some(replay.samples()) };
    for s in samples.into_iter().flatten() {
        let s = s?;
        let n = select.read();
        if n.is_multiple_of(PROGRESS_STEP) {
            bar.set_position(n);
        }
        let Some(sel) = select.next(defs, &s) else { continue };
        let ctx = contexts.id(defs, &sel);
        add(&mut counts, ctx, s.stack, sample_weight);
        total = total.saturating_add(sample_weight);
        tmin = tmin.min(s.time_us);
        tmax = tmax.max(s.time_us);
    }
    bar.finish_and_clear();
    let mut off_cpu = IdMap::default();
    let mut spread = filter.spread_blocked.then(|| Spread::new(defs, filter));
    let left_out_us;
    {
        // Off-CPU intervals, each at its start, weighing its duration (split
        // over the thread's captured stacks with `--spread-blocked`).
        let mut select = Selector::new(filter, defs.start_time_us());
        for o in defs.off_cpu_intervals() {
            // (Cut to the time window.)
            let Some((sel, o)) = select.interval(defs, o) else { continue };
            let o = &o;
            if o.duration_us == 0 {
                continue;
            }
            let ctx = contexts.id(defs, &sel);
            let mut charge = |stack: StackId, d: u64| {
                let n: &mut u64 = off_cpu.entry((ctx, stack)).or_insert(0);
                *n = n.saturating_add(d);
                if mode.is_time() {
                    add(&mut counts, ctx, stack, d);
                }
            };
            match &mut spread {
                Some(sp) => sp.charge(defs, o, &mut charge),
                None => charge(o.stack, o.duration_us),
            }
            if mode.is_time() {
                total = total.saturating_add(o.duration_us);
                tmin = tmin.min(o.start_us);
                tmax = tmax.max(o.start_us.saturating_add(o.duration_us));
            }
        }
        left_out_us = select.left_out_us();
    }
    Ok(Aggregate {
        contexts: contexts.into_vec(),
        counts,
        total,
        time_range: (total > 0).then_some((tmin, tmax)),
        off_cpu,
        spread: spread.map(|s| SpreadTotals {
            moved_us: s.moved_us,
            kept_us: s.kept_us,
            captures: s.captures(),
        }),
        left_out_us,
    })
}
