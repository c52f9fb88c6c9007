//! The sampling engines: who sends the profiling signal, to which thread, and how
//! often. [`Engine`] is chosen at start ([`EngineChoice`]) and owned by the writer
//! thread, which calls [`Engine::tick`] every flush interval (thread timers use it
//! to cover threads created since) and [`Engine::stop`] at the end.

use super::sys::{perf, timer};

/// A running engine.
pub(crate) enum Engine {
    Perf(perf::PerfEngine),
    Threads(timer::ThreadTimers),
    Process(timer::ProcessTimer),
}

impl Engine {
    /// The spool's name for it.
    pub(crate) fn kind(&self) -> crate::Engine {
        match self {
            Engine::Perf(_) => crate::Engine::PerfEvent,
            Engine::Threads(_) => crate::Engine::ThreadCpuTimer,
            Engine::Process(_) => crate::Engine::ProcessTimer,
        }
    }

    /// Periodic upkeep (new threads for per-thread timers).
    pub(crate) fn tick(&mut self) {
        if let Engine::Threads(t) = self {
            t.rescan();
        }
    }

    /// Stop sending signals.
    pub(crate) fn stop(&mut self) {
        match self {
            Engine::Perf(p) => p.stop(),
            Engine::Threads(t) => t.stop(),
            Engine::Process(p) => p.stop(),
        }
    }
}
