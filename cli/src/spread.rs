//! `--spread-blocked`: the library's estimate of where the blocked time
//! without a stack went ([`spulse::spread`]), over the intervals a filter
//! selects, with what it moved counted for the header of `top`.

use spulse::spread::{BlockedSpread, Charged};
use spulse::{Definitions, OffCpuInterval, StackId};

use crate::select::{Filter, Selector};

/// The estimate for one view, and what it moved so far.
#[derive(Debug)]
pub struct Spread {
    spread: BlockedSpread,
    /// Microseconds moved from the stackless roots to captured stacks so far.
    pub moved_us: u64,
    /// Microseconds without a stack left (threads with no capture).
    pub kept_us: u64,
}

impl Spread {
    /// The waits with a stack among the intervals `filter` selects, per thread.
    pub fn new(defs: &Definitions, filter: &Filter) -> Spread {
        let mut select = Selector::new(filter, defs.start_time_us());
        let mut spread = BlockedSpread::new();
        for o in defs.off_cpu_intervals() {
            if let Some((_, o)) = select.interval(defs, o) {
                spread.observe(defs, &o);
            }
        }
        Spread { spread, moved_us: 0, kept_us: 0 }
    }

    /// The waits with a stack the estimate draws on.
    pub fn captures(&self) -> u64 {
        self.spread.captures()
    }

    /// Charge interval `o` ([`BlockedSpread::charge`]).
    pub fn charge(&mut self, defs: &Definitions, o: &OffCpuInterval, f: impl FnMut(StackId, u64)) {
        match self.spread.charge(defs, o.thread, o.stack, o.state, o.duration_us, f) {
            Charged::Own => {}
            Charged::Moved => self.moved_us = self.moved_us.saturating_add(o.duration_us),
            Charged::Kept => self.kept_us = self.kept_us.saturating_add(o.duration_us),
        }
    }
}
