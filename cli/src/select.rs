//! Sample selection, the one place every command decides which samples count
//! and in what context their stacks are symbolized.
//!
//! - [`Filter`]: the selection the user asked for (thread, process, time
//!   window), checked against the spool by [`Filter::validate`] so that every
//!   command rejects the same filters the same way.
//! - [`Selector`]: streams samples (from `Replay` or `Tail`) and, for each
//!   selected sample, says which process it belongs to and whether that
//!   process was inside a recorded Python-runtime interval.
//! - [`Contexts`]: interns the [`Context`] a selected sample's stack is
//!   symbolized in, with a per-thread cache so the per-sample cost is an index.
//!
//! A *context* is what symbolization of a stack depends on besides the stack
//! itself: the process (absolute frames are named from that process's perf
//! map), whether the sample fell inside one of the process's recorded
//! Python-runtime intervals (perf-map names are only trusted there when the
//! spool records such intervals, since CPython's trampolines are unmapped and
//! their addresses reused outside them), and, for per-thread outputs, the
//! thread.

use std::collections::HashMap;
use std::path::Path;

use spulse::{Definitions, OffCpuInterval, OffCpuState, PythonRuntimeEvent, Sample, ThreadId};

use crate::display::escape;
use crate::CliError;

/// Which samples count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only samples of threads with this kernel thread id.
    pub tid: Option<u32>,
    /// Only samples of threads with this name ([`Filter::name_matches`]).
    pub thread_name: Option<&'static str>,
    /// Only samples of threads of this process id.
    pub pid: Option<u32>,
    /// Only samples at or after this many microseconds since the profile start.
    pub from_us: Option<u64>,
    /// Only samples before this many microseconds since the profile start.
    pub to_us: Option<u64>,
    /// What is counted: CPU samples (the default), off-CPU time or both.
    pub time: TimeMode,
    /// Charge each thread's stackless `[blocked]` time to the stacks its
    /// captured waits were in (`--spread-blocked`, [`crate::spread`]).
    pub spread_blocked: bool,
}

/// What a profile counts (`--off-cpu`, `--wall`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TimeMode {
    /// CPU samples, each counting one (the default).
    #[default]
    Cpu,
    /// Blocked off-CPU intervals only (FORMAT.md, tag 9), each weighing its
    /// duration in microseconds: where threads waited. Time spent runnable
    /// but preempted (`[waiting for CPU]`) is left out ([`Selector::left_out_us`]);
    /// the wall view has it.
    OffCpu,
    /// CPU samples weighing one sampling interval each, plus off-CPU
    /// intervals weighing their durations: wall-clock microseconds.
    Wall,
}

impl TimeMode {
    /// Whether weights are microseconds (not samples).
    pub fn is_time(self) -> bool {
        self != TimeMode::Cpu
    }
}

impl Filter {
    /// Reject a filter that can select nothing by construction: a time window
    /// that ends where or before it starts. Needs no spool, so commands call it
    /// before opening anything.
    pub fn check_window(&self) -> Result<(), CliError> {
        if let (Some(f), Some(t)) = (self.from_us, self.to_us) {
            if f >= t {
                return Err(CliError::input(format!("--from {f} must be below --to {t}")));
            }
        }
        Ok(())
    }

    /// Whether a thread named `name` passes the name filter: the same name, or
    /// the kernel's 15-byte cut of a longer one given by the user.
    pub fn name_matches(&self, name: &str) -> bool {
        match self.thread_name {
            None => true,
            Some(want) => want == name || (name.len() == 15 && want.len() > 15 && want.starts_with(name)),
        }
    }

    /// Reject a thread or process id that no thread record of the spool
    /// `file` has (a typo would otherwise select nothing, silently).
    pub fn validate(&self, defs: &Definitions, file: &Path) -> Result<(), CliError> {
        self.check_window()?;
        let shown = || escape(&file.display().to_string()).into_owned();
        if let Some(tid) = self.tid {
            if !defs.threads().iter().any(|t| t.tid == tid) {
                return Err(CliError::input(format!("{}: no thread with tid {tid}", shown())));
            }
        }
        if let Some(want) = self.thread_name {
            if !defs
                .threads()
                .iter()
                .any(|t| self.name_matches(&t.name) && self.pid.is_none_or(|p| p == t.pid))
            {
                let mut names: Vec<&str> = defs.threads().iter().map(|t| t.name.as_str()).collect();
                names.sort_unstable();
                names.dedup();
                names.truncate(20);
                return Err(CliError::input(format!(
                    "{}: no thread named {}{} (names: {})",
                    shown(),
                    escape(want),
                    self.pid.map(|p| format!(" in pid {p}")).unwrap_or_default(),
                    escape(&names.join(", "))
                )));
            }
        }
        if let Some(pid) = self.pid {
            if !defs.threads().iter().any(|t| t.pid == pid) {
                return Err(CliError::input(format!("{}: no thread of pid {pid}", shown())));
            }
            if let Some(tid) = self.tid {
                if !defs.threads().iter().any(|t| t.tid == tid && t.pid == pid) {
                    return Err(CliError::input(format!(
                        "{}: no thread with tid {tid} in pid {pid}",
                        shown()
                    )));
                }
            }
        }
        Ok(())
    }
}

/// A selected sample: its thread, process, and whether absolute frames may be
/// named from the process's perf map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selected {
    pub thread: ThreadId,
    pub pid: u32,
    /// True inside a recorded Python-runtime interval of the process, or
    /// always when the spool records no transition for the process.
    pub perf_map_allowed: bool,
}

/// Streams samples in spool order and selects them by a [`Filter`], tracking
/// which processes are inside a Python-runtime interval.
///
/// Works on a complete spool (`Replay`) and on one still growing (`Tail`):
/// threads and Python-runtime transitions defined since the last call are
/// picked up as they appear.
pub struct Selector {
    filter: Filter,
    /// The spool's start (unix us); `from` and `to`, the time window, are offsets from it,
    /// compared as offsets (absolute times saturated at a start near the
    /// end of time, and a sample at the start fell after `--to 5`).
    start: u64,
    from: Option<u64>,
    to: Option<u64>,
    /// Per thread index: whether the thread passes the thread and pid filters.
    wanted: Vec<bool>,
    /// Transitions whose process has been registered in `inside`.
    registered: usize,
    /// Transitions applied so far (those before the current sample).
    applied: usize,
    /// Per process with at least one recorded transition: inside an interval.
    inside: HashMap<u32, bool>,
    /// Samples read so far, selected or not (the next sample's ordinal).
    read: u64,
    /// Samples selected so far.
    selected: u64,
    /// Microseconds of preempted intervals the off-CPU mode left out.
    left_out_us: u64,
}

impl Selector {
    /// A selector for a spool whose profile started at `start_time_us`.
    pub fn new(filter: &Filter, start_time_us: u64) -> Selector {
        Selector {
            filter: *filter,
            start: start_time_us,
            from: filter.from_us,
            to: filter.to_us,
            wanted: Vec::new(),
            registered: 0,
            applied: 0,
            inside: HashMap::new(),
            read: 0,
            selected: 0,
            left_out_us: 0,
        }
    }

    /// Microseconds of waiting for a CPU (preempted intervals, cut to the
    /// window) that [`TimeMode::OffCpu`] left out so far.
    pub fn left_out_us(&self) -> u64 {
        self.left_out_us
    }

    /// Samples read so far (selected or not).
    pub fn read(&self) -> u64 {
        self.read
    }

    /// Samples selected so far.
    pub fn selected(&self) -> u64 {
        self.selected
    }

    /// Select an off-CPU interval, given as a sample at its start, placed
    /// after `ordinal` samples (its `samples_before`; intervals must come in
    /// stream order, through a selector of their own).
    pub fn next_at(&mut self, defs: &Definitions, s: &Sample, ordinal: u64) -> Option<Selected> {
        self.read = ordinal;
        self.next(defs, s)
    }

    /// Select an off-CPU interval (in stream order, through a selector of
    /// its own), cut to the time window: one that overlaps the window is
    /// selected, and returned as the part inside it (its start moved up to
    /// the window's, its duration cut at the window's end); a window of 100 ms
    /// counts at most 100 ms of each thread's waits.
    pub fn interval(&mut self, defs: &Definitions, o: &OffCpuInterval) -> Option<(Selected, OffCpuInterval)> {
        let rel = o.start_us.saturating_sub(self.start);
        let end = rel.saturating_add(o.duration_us);
        let from = self.from.unwrap_or(0).max(rel);
        let to = self.to.map_or(end, |t| t.min(end));
        if to < from || (to == from && o.duration_us > 0) {
            self.read = o.samples_before;
            return None;
        }
        let cut = OffCpuInterval { start_us: self.start.saturating_add(from), duration_us: to - from, ..*o };
        let s = Sample { time_us: cut.start_us, thread: o.thread, stack: o.stack };
        let sel = self.next_at(defs, &s, o.samples_before)?;
        if self.filter.time == TimeMode::OffCpu && o.state == OffCpuState::Preempted {
            self.left_out_us = self.left_out_us.saturating_add(cut.duration_us);
            self.selected -= 1;
            return None;
        }
        Some((sel, cut))
    }

    /// Take the next sample of the stream: `None` when the filter drops it.
    /// Every sample of the stream must pass through here, in order, since
    /// Python-runtime transitions are placed by sample ordinal.
    #[inline]
    pub fn next(&mut self, defs: &Definitions, s: &Sample) -> Option<Selected> {
        let n = self.read;
        self.read += 1;
        let t = s.thread.index();
        if t >= self.wanted.len() {
            self.add_threads(defs);
        }
        if !self.wanted[t]
            || self.from.is_some_and(|f| s.time_us.saturating_sub(self.start) < f)
            || self.to.is_some_and(|e| s.time_us.saturating_sub(self.start) >= e)
        {
            return None;
        }
        self.selected += 1;
        let pid = defs.thread(s.thread).pid;
        let events = defs.python_runtime_events();
        let perf_map_allowed = if events.is_empty() { true } else { self.python_state(events, n, pid) };
        Some(Selected { thread: s.thread, pid, perf_map_allowed })
    }

    #[cold]
    fn add_threads(&mut self, defs: &Definitions) {
        let f = self.filter;
        for t in &defs.threads()[self.wanted.len()..] {
            self.wanted.push(
                f.tid.is_none_or(|tid| tid == t.tid)
                    && f.pid.is_none_or(|pid| pid == t.pid)
                    && f.name_matches(&t.name),
            );
        }
    }

    /// Whether `pid` is inside a Python-runtime interval at sample ordinal `n`
    /// (or has no recorded transition). A process with a recorded transition
    /// (anywhere in the spool; in what has been read of a spool still being
    /// written) is outside until its first `enter`.
    #[inline]
    fn python_state(&mut self, events: &[PythonRuntimeEvent], n: u64, pid: u32) -> bool {
        for e in &events[self.registered..] {
            self.inside.entry(e.pid).or_insert(false);
        }
        self.registered = events.len();
        while let Some(e) = events.get(self.applied).filter(|e| e.samples_before <= n) {
            self.inside.insert(e.pid, e.entering);
            self.applied += 1;
        }
        self.inside.get(&pid).copied().unwrap_or(true)
    }
}

/// What a stack's symbolization depends on besides the stack (the library's
/// symbolizer defines it).
pub use spulse::symbolize::Context;

/// Interns contexts as small ids. Ids are assigned in thread-record order
/// (outside before inside a Python-runtime interval), so output ordered by
/// context id is ordered by thread whatever order the samples come in.
pub struct Contexts {
    per_thread: bool,
    /// The contexts, indexed by id.
    list: Vec<Context>,
    index: HashMap<Context, u32>,
    /// Per thread index: the context ids for [perf map not allowed, allowed].
    by_thread: Vec<[u32; 2]>,
}

impl Contexts {
    /// Contexts for the threads `defs` defines so far; with `per_thread` each
    /// thread has contexts of its own, otherwise threads of a process share.
    pub fn new(defs: &Definitions, per_thread: bool) -> Contexts {
        let mut c = Contexts { per_thread, list: Vec::new(), index: HashMap::new(), by_thread: Vec::new() };
        c.add_threads(defs);
        c
    }

    /// The context id of a selected sample.
    #[inline]
    pub fn id(&mut self, defs: &Definitions, s: &Selected) -> u32 {
        let t = s.thread.index();
        if t >= self.by_thread.len() {
            self.add_threads(defs);
        }
        self.by_thread[t][s.perf_map_allowed as usize]
    }

    /// Assign ids to both contexts of each thread defined since the last call,
    /// in thread order (equal contexts, such as two threads of one process,
    /// share an id).
    #[cold]
    fn add_threads(&mut self, defs: &Definitions) {
        let threads = defs.threads();
        for t in &threads[self.by_thread.len()..] {
            let mut pair = [0; 2];
            for (slot, allowed) in [false, true].into_iter().enumerate() {
                let c = Context {
                    thread: self.per_thread.then_some(t.id),
                    pid: t.pid,
                    perf_map_allowed: allowed,
                };
                pair[slot] = self.intern(c);
            }
            self.by_thread.push(pair);
        }
    }

    fn intern(&mut self, c: Context) -> u32 {
        let next = self.list.len() as u32;
        *self.index.entry(c).or_insert_with(|| {
            self.list.push(c);
            next
        })
    }

    /// The context with id `id`.
    pub fn get(&self, id: u32) -> Context {
        self.list[id as usize]
    }

    /// Number of contexts interned.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether no context is interned.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// All contexts, indexed by id.
    pub fn list(&self) -> &[Context] {
        &self.list
    }

    /// All contexts, indexed by id.
    pub fn into_vec(self) -> Vec<Context> {
        self.list
    }
}
