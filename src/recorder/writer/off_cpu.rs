//! The writer's part of the off-CPU mode (`RecorderBuilder::off_cpu`): at
//! each tick, after the samples are drained, pair the context-switch records
//! into off-CPU intervals (`sys/perf_switch.rs`, `sys/pairing.rs`), write the finished ones
//! (FORMAT.md, tag 9), and capture each thread found blocked and not yet
//! captured (`sys/blocked.rs`, unwound by `stack_sampler.rs`).
//!
//! A capture is turned into a stack of the spool at once, in the tick that
//! took it, exactly like a sample drained in that tick (same module
//! generation rules), so an interval written many ticks later refers to
//! stack ids only, never to a module retired meanwhile. Its leaf is a label
//! frame naming the system call (`blocked: futex`). An interval without a
//! capture (the thread woke before a tick saw it blocked, or the capture
//! failed) is charged to `[blocked]` alone; a preempted one to `[waiting for
//! CPU]` on top of the thread's last sampled stack (its own root if none).
//! Such waits shorter than 5 ms are summed per thread and state and written
//! once a tick (`sys/pairing.rs`, `SUM_BELOW_NS`), the blocked ones under
//! `[blocked, under 5 ms]` alone; the others one by one.
//!
//! Costs: the records are a ring read per CPU per tick (and between ticks
//! when a ring is a quarter full: the writer also waits on the rings); a capture is one
//! `/proc` read, a `process_vm_readv` of `user_stack_copy` bytes and an
//! unwind, at most once per blocking, for every wait a tick finds at least
//! 5 ms long and about 10 shorter ones a second (`sys/pairing.rs`,
//! "Captures"); a thread that stays blocked costs nothing more, and writes
//! one interval record when it wakes (or, for a short wait without a stack,
//! adds to its thread's sum for the tick).

use rustc_hash::FxHashMap as HashMap;

use super::Run;
use crate::recorder::handler::ring::RawSample;
use crate::recorder::stats::OffCpuStats;
use crate::recorder::sys::blocked::syscall_name;
use crate::recorder::sys::pairing::{Capture, Interval};
use crate::recorder::sys::perf_switch::SwitchTracker;
use crate::recorder::sys::sigmask;
use crate::{Error, StackId};

/// The off-CPU mode's state in the writer.
pub(crate) struct OffCpu {
    tracker: SwitchTracker,
    /// Stack copy buffer (`user_stack_copy` bytes).
    copy: Vec<u8>,
    /// `/proc` read buffer.
    buf: Vec<u8>,
    tids: Vec<u32>,
    /// Each thread's last sampled stack (for a preempted thread).
    pub(super) last_leaf: HashMap<u32, StackId>,
    intervals: u64,
    with_stack: u64,
    /// Whether the loss of switch records was said while recording.
    warned_lost: bool,
}

impl OffCpu {
    /// The switch tracker (to wait on its rings).
    pub(crate) fn tracker_mut(&mut self) -> &mut SwitchTracker {
        &mut self.tracker
    }

    pub(crate) fn new(tracker: SwitchTracker, stack_copy: u32) -> OffCpu {
        OffCpu {
            tracker,
            copy: vec![0; stack_copy.max(64) as usize],
            buf: Vec::with_capacity(512),
            tids: Vec::new(),
            last_leaf: HashMap::default(),
            intervals: 0,
            with_stack: 0,
            warned_lost: false,
        }
    }

    /// Switch records lost so far (rings full).
    /// Whether thread `tid` is off the CPU now, its wait not yet written.
    pub(crate) fn is_waiting(&self, tid: u32) -> bool {
        self.tracker.pairing.is_out(tid)
    }

    /// The threads with a wait paired and not yet written (by the drain just
    /// before the captures; the next tick writes them).
    pub(crate) fn unwritten(&self) -> impl Iterator<Item = u32> + '_ {
        self.tracker.pairing.unwritten()
    }

    pub(crate) fn tracker_lost(&self) -> u64 {
        self.tracker.counts.lost
    }

    /// What was seen so far.
    pub(crate) fn stats(&self) -> OffCpuStats {
        let c = self.tracker.counts;
        OffCpuStats {
            intervals: self.intervals,
            waits: self.tracker.pairing.waits,
            with_stack: self.with_stack,
            captures: c.captured,
            captures_raced: c.missed_ran + self.tracker.pairing.dropped,
            captures_refused: c.refused,
            refused_errno: c.refused_errno,
            records_lost: c.lost,
        }
    }
}

impl Run {
    /// A new segment begins (rotation): the stacks defined in the last one
    /// are not defined in it.
    pub(super) fn off_cpu_new_segment(&mut self) {
        if let Some(o) = self.st.off_cpu.as_mut() {
            o.last_leaf.clear();
            o.tracker.pairing.forget_stacks();
        }
    }

    /// One tick of the off-CPU mode (`end`: the recording stops; threads
    /// still off the CPU are closed now).
    pub(super) fn off_cpu_step(&mut self, end: bool) {
        let Some(mut o) = self.st.off_cpu.take() else { return };
        if end {
            o.tracker.stop();
        }
        // A window closing at the time asked (the `http` endpoint): the
        // drain that reaches it writes the waits up to it.
        crate::recorder::take_off_cpu_splits(|at_ns| o.tracker.request_split(at_ns));
        o.tracker.collect(end);
        if end {
            o.tracker.finish(crate::recorder::sys::now_ns());
        }
        // The short waits summed since the last tick, one interval per
        // thread and state (`SUM_BELOW_NS`).
        o.tracker.pairing.flush_sums();
        let mut done = std::mem::take(&mut o.tracker.pairing.done);
        for iv in &done {
            if self.error.is_some() {
                break;
            }
            let r = self.write_interval(&mut o, iv);
            self.note(r);
        }
        // Given back: its capacity serves the next ticks.
        done.clear();
        o.tracker.pairing.done = done;
        if !end && self.error.is_none() {
            self.capture_blocked(&mut o);
        }
        if end {
            let s = o.stats();
            if s.captures_refused > 0 {
                self.st.warnings.push(format!(
                    "off-CPU stacks not captured {} times: the kernel refused to read a blocked thread's \
                     /proc/self/task/<tid>/syscall or stack ({}; a process that is not dumpable cannot); \
                     those waits are charged to [blocked]",
                    s.captures_refused,
                    std::io::Error::from_raw_os_error(s.refused_errno)
                ));
            }
            if s.records_lost > 0 {
                // The total says it all; no "being lost" after it.
                o.warned_lost = true;
                self.st.warnings.push(format!(
                    "{} context-switch records lost (ring full): off-CPU time is missing for them",
                    s.records_lost
                ));
            }
        }
        self.st.off_cpu = Some(o);
    }

    /// Say once, as soon as it starts, that switch records are being lost
    /// (the total is said at the end).
    pub(super) fn warn_switch_losses(&mut self) {
        let Some(o) = self.st.off_cpu.as_mut() else { return };
        let lost = o.tracker.counts.lost;
        if lost > 0 && !o.warned_lost {
            o.warned_lost = true;
            self.st.warnings.push(format!(
                "context-switch records are being lost ({lost} so far; ring full): the writer thread got too \
                 little CPU to drain the switch rings; off-CPU time is missing for them"
            ));
        }
    }

    /// Between ticks, when a switch ring is a quarter full: drain the rings and
    /// pair their records (the intervals are written at the next tick).
    /// A drain that finds a ring half full or losing records raises the
    /// writer's priority at once: a starved writer's ticks come late.
    pub(super) fn collect_switches(&mut self) {
        if let Some(o) = self.st.off_cpu.as_mut() {
            crate::recorder::take_off_cpu_splits(|at_ns| o.tracker.request_split(at_ns));
            o.tracker.collect(false);
            if self.switch_pressure() {
                self.priority.observe(true, &self.st.shared.writer_boost);
            }
        }
    }

    /// Capture every thread that is blocked and not captured yet in this
    /// blocking, and define its stack in the spool now.
    fn capture_blocked(&mut self, o: &mut OffCpu) {
        let mut tids = std::mem::take(&mut o.tids);
        // The records since the tick's drain first (the intervals they end
        // are written at the next tick): a thread that woke while the tick
        // wrote is not captured for nothing. Judged as of that drain, a
        // switch-heavy program's threads had mostly run again by their
        // capture: 92% of the captures were wasted (at 40 us each).
        o.tracker.collect(false);
        o.tracker.due_captures(&mut tids);
        let Some(mut sampler) = self.stack_sampler.take() else {
            o.tids = tids;
            return;
        };
        let shared = self.st.shared.clone();
        let schedstat = o.tracker.losing_records();

        for &tid in &tids {
            if sigmask::own::is_own(tid) {
                continue;
            }
            let (copy, buf) = (&mut o.copy, &mut o.buf);
            let table = &self.st.table;
            let c = shared.snapshot.with_current(|snap| {
                let bias_of = |a: u64| table.resolve(a, snap.generation).map(|e| e.key.bias);
                sampler.capture_blocked(tid, snap, copy, buf, &bias_of, schedstat)
            });
            if c.is_ok() {
                // Its name now, while it lives: the interval is written when
                // the wait ends, maybe at the thread's exit, when
                // `/proc/self/task/<tid>/comm` is gone (once a thread).
                let r = self.interner.thread(&mut self.st.out, self.st.pid, tid, &shared.names);
                self.note(r);
            }
            let c = match c {
                Ok(mut c) => match self.capture_stack(&c) {
                    Ok(stack) => {
                        c.stack = Some(stack);
                        Ok(c)
                    }
                    Err(e) => {
                        self.note(Err::<(), _>(e));
                        break;
                    }
                },
                Err(m) => Err(m),
            };
            o.tracker.set_capture(tid, c);
        }
        self.stack_sampler = Some(sampler);
        o.tids = tids;
    }

    /// The spool stack of a capture: its frames, then the system call's label.
    fn capture_stack(&mut self, c: &Capture) -> Result<StackId, Error> {
        let raw = RawSample {
            time_us: c.at_ns / 1000,
            tid: 0,
            weight: 1,
            generation: c.generation,
            truncated: c.truncated,
            kernel: false,
            addrs: &c.addrs,
        };
        let leaf = self.leaf_of(&raw)?;
        let label = match c.syscall {
            Some(nr) => match syscall_name(nr) {
                Some(name) => format!("blocked: {name}"),
                None => format!("blocked: syscall {nr}"),
            },
            None => "blocked: page fault".to_string(),
        };
        let f = self.interner.label(&mut self.st.out, &label)?;
        self.interner.node(&mut self.st.out, Some(leaf), f)
    }

    fn write_interval(&mut self, o: &mut OffCpu, iv: &Interval) -> Result<(), Error> {
        if sigmask::own::is_own(iv.tid) {
            // One of spulse's own threads (the `http` endpoint's, waiting
            // for requests): never in its own profiles.
            return Ok(());
        }
        let thread = self.interner.thread(&mut self.st.out, self.st.pid, iv.tid, &self.st.shared.names)?;
        let stack = match (iv.preempted, iv.capture.as_ref()) {
            (false, Some(c)) => {
                o.with_stack += 1;
                match c.stack {
                    Some(s) => s,
                    // Captured before this segment began: defined again here.
                    None => self.capture_stack(c)?,
                }
            }
            (false, None) if iv.summed => self.interner.short_blocked_root(&mut self.st.out)?,
            (false, None) => self.interner.blocked_root(&mut self.st.out)?,
            (true, _) => {
                let f = self.interner.waiting_label(&mut self.st.out)?;
                let parent = o.last_leaf.get(&iv.tid).copied();
                self.interner.node(&mut self.st.out, parent, f)?
            }
        };
        // Both ends truncated to microseconds: durations add up without drift.
        let start_us = iv.start_ns / 1000;
        let duration_us = (iv.end_ns / 1000).saturating_sub(start_us);
        self.st.out.off_cpu(thread, stack, start_us, duration_us, iv.preempted)?;
        o.intervals += 1;
        Ok(())
    }
}

#[cfg(test)]
mod bench_write {
    /// Bench (ignored; BENCHMARKS.md "Off-CPU mode"): the interner's thread lookup and the spool's off-CPU record, 100 threads.
    #[test]
    #[ignore]
    fn bench_write_interval() {
        let names = crate::recorder::handler::ThreadNames::default();
        for _ in 0..3 {
            let header = crate::Header { start_time_us: 1_764_000_000_000_000, interval_us: 1000 };
            let mut w = crate::SpoolWriter::new(std::io::sink(), header).unwrap();
            let mut interner = super::super::intern::Interner::default();
            let stack = interner.blocked_root(&mut w).unwrap();
            let n = 2_000_000u64;
            let start = std::time::Instant::now();
            for i in 0..n {
                let tid = 1_000_000 + (i % 100) as u32;
                let thread = interner.thread(&mut w, 1, tid, &names).unwrap();
                w.off_cpu(thread, stack, 1_764_000_000_000_000 + i * 10, 5 + i % 300, false).unwrap();
            }
            let el = start.elapsed();
            eprintln!("BENCH write: {:.1} ns an interval", el.as_nanos() as f64 / n as f64);
        }
    }
}
