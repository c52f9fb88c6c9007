//! The sampling engines: who sends the profiling signal, to which thread, and how
//! often (or, for the perf-stack engine, which rings the kernel writes samples
//! into). [`Engine`] is chosen at start ([`EngineChoice`]) and owned by the writer
//! thread, which calls [`Engine::tick`] every flush interval (thread timers,
//! kernel-time events and perf-stack events use it to cover threads created
//! since) and [`Engine::stop`] at the end.
//!
//! [`EngineChoice`]: super::EngineChoice

use super::sys::{perf, perf_kernel, perf_stack, timer};

/// A running engine.
pub(crate) enum Engine {
    /// The user-time events, and the kernel-time rings when allowed.
    Perf(perf::PerfEngine, Option<perf_kernel::KernelRings>),
    Threads(timer::ThreadTimers),
    Process(timer::ProcessTimer),
    /// Per-thread events that copy the user stack into rings (no signal).
    PerfStack(perf_stack::StackEvents),
}

impl Engine {
    /// The spool's name for it.
    pub(crate) fn kind(&self) -> crate::Engine {
        match self {
            Engine::Perf(..) => crate::Engine::PerfEvent,
            Engine::Threads(_) => crate::Engine::ThreadCpuTimer,
            Engine::Process(_) => crate::Engine::ProcessTimer,
            Engine::PerfStack(_) => crate::Engine::PerfStack,
        }
    }

    /// Periodic upkeep (new threads for per-thread timers and perf-stack
    /// events). Whether every thread of `tids` is covered: `false` when a
    /// timer could not be created, to be tried again at the next listing (a
    /// perf-stack event refused is given up on, `PerThreadEvents`).
    pub(crate) fn tick(&mut self, tids: &[u32]) -> bool {
        match self {
            Engine::Threads(t) => t.rescan(tids),
            Engine::PerfStack(s) => {
                s.rescan(tids);
                true
            }
            _ => true,
        }
    }

    /// Whether a thread created since the last tick goes unsampled until the
    /// writer lists the threads (one timer or one perf-stack event per thread,
    /// none inherited), so the listing must be taken on every tick (in the
    /// off-CPU mode: at every tick whose switch records tell of a thread
    /// created or ended, `writer/threads.rs`). The perf
    /// engine's inherited events sample a new thread from its first
    /// instruction, and its first sample tells the writer that the thread
    /// exists.
    pub(crate) fn needs_every_scan(&self) -> bool {
        matches!(self, Engine::Threads(_) | Engine::PerfStack(_))
    }

    /// The perf-stack engine's events, if that engine runs.
    pub(crate) fn stack_events(&mut self) -> Option<&mut perf_stack::StackEvents> {
        match self {
            Engine::PerfStack(s) => Some(s),
            _ => None,
        }
    }

    /// Perf-event descriptors held.
    pub(crate) fn descriptors(&self) -> usize {
        match self {
            Engine::Perf(p, k) => p.descriptors() + k.as_ref().map_or(0, |k| k.fds),
            Engine::PerfStack(s) => s.descriptors(),
            _ => 0,
        }
    }

    /// The kernel-time rings, if they run.
    pub(crate) fn kernel_rings(&mut self) -> Option<&mut perf_kernel::KernelRings> {
        match self {
            Engine::Perf(_, Some(k)) => Some(k),
            _ => None,
        }
    }

    /// Threads alive at start that got no kernel-time events (descriptor budget).
    pub(crate) fn kernel_missed(&self) -> u64 {
        match self {
            Engine::Perf(_, Some(k)) => k.missed,
            _ => 0,
        }
    }

    /// The signal the engine samples with, if any.
    pub(crate) fn signal(&self) -> Option<i32> {
        match self {
            Engine::Perf(..) => Some(libc::SIGTRAP),
            Engine::Threads(_) | Engine::Process(_) => Some(libc::SIGPROF),
            Engine::PerfStack(_) => None,
        }
    }

    /// Stop sending the signal (the program took it over); the kernel-time
    /// rings, which send none, go on.
    pub(crate) fn stop_signals(&mut self) {
        match self {
            Engine::Perf(p, _) => p.stop(),
            Engine::Threads(t) => t.stop(),
            Engine::Process(p) => p.stop(),
            Engine::PerfStack(_) => {}
        }
    }

    /// Whether the program closed the perf events' descriptors (sampling
    /// has stopped).
    pub(crate) fn closed_by_program(&self) -> bool {
        match self {
            Engine::Perf(p, k) => p.closed_by_program() || k.as_ref().is_some_and(|k| k.closed_by_program()),
            _ => false,
        }
    }

    /// Stop sending signals.
    pub(crate) fn stop(&mut self) {
        match self {
            Engine::Perf(p, k) => {
                p.stop();
                if let Some(k) = k {
                    k.stop();
                }
            }
            Engine::Threads(t) => t.stop(),
            Engine::Process(p) => p.stop(),
            Engine::PerfStack(s) => s.stop(),
        }
    }
}
