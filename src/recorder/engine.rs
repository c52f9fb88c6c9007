//! The sampling engines: who sends the profiling signal, to which thread, and how
//! often. [`Engine`] is chosen at start ([`EngineChoice`]) and owned by the writer
//! thread, which calls [`Engine::tick`] every flush interval (thread timers use it
//! to cover threads created since) and [`Engine::stop`] at the end.

use super::sys::{perf, timer};

/// A running engine.
pub(crate) enum Engine {
    /// The user-time events, and the kernel-time events when allowed.
    Perf(perf::PerfEngine, Option<perf::KernelEvents>),
    Threads(timer::ThreadTimers),
    Process(timer::ProcessTimer),
}

impl Engine {
    /// The spool's name for it.
    pub(crate) fn kind(&self) -> crate::Engine {
        match self {
            Engine::Perf(..) => crate::Engine::PerfEvent,
            Engine::Threads(_) => crate::Engine::ThreadCpuTimer,
            Engine::Process(_) => crate::Engine::ProcessTimer,
        }
    }

    /// Periodic upkeep (new threads for per-thread timers and kernel-time events).
    pub(crate) fn tick(&mut self, tids: &[u32]) {
        match self {
            Engine::Threads(t) => t.rescan(tids),
            Engine::Perf(_, Some(k)) => k.rescan(tids),
            _ => {}
        }
    }

    /// Whether a thread created since the last tick goes unsampled until the
    /// writer lists the threads (one timer per thread, none inherited), so the
    /// listing must be taken on every tick. The perf engine's inherited events
    /// sample a new thread from its first instruction, and its first sample
    /// tells the writer that the thread exists.
    pub(crate) fn needs_every_scan(&self) -> bool {
        matches!(self, Engine::Threads(_))
    }

    /// Keep the kernel-time events' descriptors open for the life of the
    /// process (see `KernelEvents::stop`).
    pub(crate) fn leak_kernel_events(&mut self) {
        if let Engine::Perf(_, k) = self {
            if let Some(k) = k.take() {
                std::mem::forget(k);
            }
        }
    }

    /// Threads that got no kernel-time event (limit or descriptor table).
    pub(crate) fn kernel_missed(&self) -> u64 {
        match self {
            Engine::Perf(_, Some(k)) => k.missed,
            _ => 0,
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
        }
    }
}
