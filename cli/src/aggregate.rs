//! Streaming aggregation: samples are read once through `Replay` and counted per
//! (context, stack id). Nothing per sample is kept, so memory is bounded by the
//! distinct stacks, never by the number of samples.
//!
//! A *context* is what symbolization of a stack depends on besides the stack
//! itself: the process (absolute frames are named from that process's perf map),
//! whether the sample fell inside one of the process's recorded Python-runtime
//! intervals (perf-map names are only trusted there when the spool records such
//! intervals), and, for per-thread exports, the thread.

use std::collections::HashMap;

use spulse::{Definitions, Replay, StackId, ThreadId};

use crate::input::progress;
use crate::CliError;

/// Which samples count.
#[derive(Debug, Clone, Copy, Default)]
pub struct Filter {
    /// Only samples of threads with this kernel thread id.
    pub tid: Option<u32>,
    /// Only samples of this process.
    pub pid: Option<u32>,
    /// Only samples at or after this many microseconds since the profile start.
    pub from_us: Option<u64>,
    /// Only samples before this many microseconds since the profile start.
    pub to_us: Option<u64>,
}

/// What a stack's symbolization depends on besides the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Context {
    /// The thread, for per-thread aggregations; `None` otherwise.
    pub thread: Option<ThreadId>,
    /// The sampled process.
    pub pid: u32,
    /// Whether absolute frames may be named from the process's perf map: true
    /// inside a recorded Python-runtime interval, or always when the spool
    /// records no such interval for the process.
    pub perf_map_allowed: bool,
}

/// A multiplicative hasher for the small integer keys of the per-thread counts
/// (the default SipHash costs more than the rest of the per-sample work).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

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
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

enum Counts {
    /// `[context][stack index]` for a handful of contexts, plus every
    /// (context, stack) in the order it was first counted.
    Dense(Vec<Vec<u64>>, Vec<(u32, StackId)>),
    /// `(context, stack)`, for per-thread aggregations.
    Sparse(IdMap<(u32, StackId), u64>),
}

/// Sample counts per (context, stack).
pub struct Aggregate {
    /// The contexts, indexed by the context ids used in [`Aggregate::iter`].
    pub contexts: Vec<Context>,
    counts: Counts,
    /// Samples counted (after filtering).
    pub total: u64,
    /// Samples read (before filtering).
    pub read: u64,
    /// Smallest and largest timestamp of the counted samples.
    pub time_range: Option<(u64, u64)>,
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
        Aggregate { contexts, counts: Counts::Sparse(counts), total, read: total, time_range: None }
    }

    /// Number of distinct (context, stack) pairs with samples.
    pub fn distinct(&self) -> usize {
        match &self.counts {
            Counts::Dense(_, seen) => seen.len(),
            Counts::Sparse(m) => m.len(),
        }
    }
}

/// Tracks, sample by sample, which processes are inside a Python-runtime interval.
struct PythonState<'a> {
    events: &'a [spulse::PythonRuntimeEvent],
    next: usize,
    /// Processes with at least one recorded transition.
    recorded: HashMap<u32, bool>,
}

impl<'a> PythonState<'a> {
    fn new(defs: &'a Definitions) -> Self {
        let events = defs.python_runtime_events();
        let recorded = events.iter().map(|e| (e.pid, false)).collect();
        PythonState { events, next: 0, recorded }
    }

    /// Advance to the sample with ordinal `n` (0-based stream position).
    #[inline]
    fn advance(&mut self, n: u64) {
        while self.next < self.events.len() && self.events[self.next].samples_before <= n {
            let e = self.events[self.next];
            self.recorded.insert(e.pid, e.entering);
            self.next += 1;
        }
    }

    #[inline]
    fn allowed(&self, pid: u32) -> bool {
        self.recorded.get(&pid).copied().unwrap_or(true)
    }
}

/// Read every sample of `replay` and count it per (context, stack).
pub fn aggregate(replay: &Replay, filter: &Filter, per_thread: bool) -> Result<Aggregate, CliError> {
    let defs: &Definitions = replay;
    let threads = defs.threads();
    let start = defs.start_time_us();
    let from = filter.from_us.map(|f| start.saturating_add(f));
    let to = filter.to_us.map(|t| start.saturating_add(t));
    let has_python = !defs.python_runtime_events().is_empty();

    // Context ids per thread: [not allowed, allowed].
    let mut contexts: Vec<Context> = Vec::new();
    let mut ctx_index: HashMap<Context, u32> = HashMap::new();
    let mut thread_ctx: Vec<[u32; 2]> = Vec::with_capacity(threads.len());
    let mut thread_wanted: Vec<bool> = Vec::with_capacity(threads.len());
    for t in threads {
        let mut pair = [0u32; 2];
        for (i, allowed) in [false, true].into_iter().enumerate() {
            let c = Context {
                thread: if per_thread { Some(t.id) } else { None },
                pid: t.pid,
                perf_map_allowed: allowed || !has_python,
            };
            let next = contexts.len() as u32;
            pair[i] = *ctx_index.entry(c).or_insert_with(|| {
                contexts.push(c);
                next
            });
        }
        thread_ctx.push(pair);
        thread_wanted
            .push(filter.tid.is_none_or(|tid| tid == t.tid) && filter.pid.is_none_or(|pid| pid == t.pid));
    }

    let stacks = defs.stack_count();
    let mut counts = if per_thread {
        Counts::Sparse(IdMap::default())
    } else {
        Counts::Dense(vec![Vec::new(); contexts.len()], Vec::new())
    };
    let mut python = PythonState::new(defs);
    let bar = progress(defs.sample_count(), "reading");
    let mut total = 0u64;
    let mut read = 0u64;
    let (mut tmin, mut tmax) = (u64::MAX, 0u64);
    for s in replay.samples() {
        let s = s?;
        let n = read;
        read += 1;
        if n & 0xffff == 0 {
            bar.set_position(n);
        }
        let t = s.thread.index();
        if !thread_wanted[t] || from.is_some_and(|f| s.time_us < f) || to.is_some_and(|e| s.time_us >= e) {
            continue;
        }
        let allowed = if has_python {
            python.advance(n);
            python.allowed(threads[t].pid)
        } else {
            true
        };
        let ctx = thread_ctx[t][allowed as usize];
        match &mut counts {
            Counts::Dense(v, seen) => {
                let c = &mut v[ctx as usize];
                if c.is_empty() {
                    c.resize(stacks, 0);
                }
                let slot = &mut c[s.stack.index()];
                if *slot == 0 {
                    seen.push((ctx, s.stack));
                }
                *slot += 1;
            }
            Counts::Sparse(m) => *m.entry((ctx, s.stack)).or_insert(0) += 1,
        }
        total += 1;
        tmin = tmin.min(s.time_us);
        tmax = tmax.max(s.time_us);
    }
    bar.finish_and_clear();
    Ok(Aggregate { contexts, counts, total, read, time_range: (total > 0).then_some((tmin, tmax)) })
}
