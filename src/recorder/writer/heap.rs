//! Heap events (`RecorderBuilder::heap_events`): the writer takes the
//! sampled allocations and frees that `spulse::heap` hands over
//! (`src/heap/events.rs`) at each tick and writes them as tag-10 records
//! (FORMAT.md, "Heap events"), their stacks resolved as the samples' are.

use super::Run;
use crate::heap::events;
use crate::recorder::handler::ring::RawSample;
use crate::recorder::stats::HeapEventStats;
use crate::{Error, StackId};

/// The label of an allocation sampled without its stack.
const NO_STACK: &str = "no stack";

/// This recorder's session of heap events; ended when dropped (with the
/// writer's state, whichever way the recording ends).
pub(crate) struct HeapEvents {
    session: u32,
    written: u64,
    /// [`events::LOST`] when the session began.
    lost_before: u64,
    warned_lost: bool,
    addrs: Vec<u64>,
}

impl HeapEvents {
    /// Begin the process's session of heap events; `Err` with a warning's
    /// sentence if another recorder has it.
    pub(crate) fn begin() -> Result<HeapEvents, String> {
        let lost_before = events::LOST.load(std::sync::atomic::Ordering::Relaxed);
        match events::begin() {
            Some(session) => {
                Ok(HeapEvents { session, written: 0, lost_before, warned_lost: false, addrs: Vec::new() })
            }
            None => Err("heap events are not recorded: another recorder of this process records them".into()),
        }
    }

    fn lost(&self) -> u64 {
        events::LOST.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(self.lost_before)
    }

    pub(crate) fn stats(&self) -> HeapEventStats {
        HeapEventStats { written: self.written, lost: self.lost() }
    }
}

impl Drop for HeapEvents {
    fn drop(&mut self) {
        events::end(self.session);
    }
}

impl Run {
    /// Write the heap events handed over since the last step.
    pub(super) fn heap_step(&mut self) {
        let Some(mut h) = self.st.heap.take() else { return };
        while let Some(e) = events::pop() {
            // Another session's (made as it ended), or nothing to write to
            // any more. (The profiler's own threads' blocks make no event:
            // `heap::record`.)
            if e.session != h.session || self.error.is_some() {
                continue;
            }
            let r = self.heap_event(&mut h, &e);
            if self.note(r).is_some() {
                h.written += 1;
            }
        }
        let lost = h.lost();
        if lost > 0 && !h.warned_lost {
            h.warned_lost = true;
            self.st.warnings.push(format!(
                "heap events lost: the sampler's ring of {} events was full before the writer came round \
                 ({lost} so far; the heap profile's figures are not affected)",
                events::CAPACITY
            ));
        }
        self.st.heap = Some(h);
    }

    fn heap_event(&mut self, h: &mut HeapEvents, e: &events::Event) -> Result<(), Error> {
        let thread = self.interner.thread(&mut self.st.out, self.st.pid, e.tid, &self.st.shared.names)?;
        let stack = if crate::heap::stack_addrs(e.stack, &mut h.addrs) {
            let raw = RawSample {
                time_us: e.time_us,
                tid: e.tid,
                weight: 1,
                // The modules as they are now (the sampler does not know the
                // generation it walked in; the writer comes round within a tick).
                generation: self.st.generation,
                // The table keeps the leaf-most frames of deeper stacks.
                truncated: h.addrs.len() >= crate::heap::STACK_DEPTH,
                kernel: false,
                addrs: &h.addrs,
            };
            self.leaf_of(&raw)?
        } else {
            self.no_stack()?
        };
        self.st.out.heap_event(thread, stack, e.time_us, e.address, e.size, e.bytes, e.freed)
    }

    fn no_stack(&mut self) -> Result<StackId, Error> {
        let f = self.interner.label(&mut self.st.out, NO_STACK)?;
        self.interner.node(&mut self.st.out, None, f)
    }
}
