//! The writer thread: every flush interval it drains the ring, resolves and
//! interns what the handler captured, tracks modules coming and going, and
//! appends to the spool; at stop it drains everything, flushes and syncs.
//! This file is the run loop of that one thread (`Run`): its steps share
//! `Run`'s state and read in the order a tick runs them. Beside it, each a
//! concern of its own with its part of `Run`: the loaded objects and their
//! generations (`objects.rs`, with the rule that keeps a sample from being
//! attributed to the wrong library), the process's threads and the engine's
//! signal (`threads.rs`), the off-CPU mode (`off_cpu.rs`), control messages,
//! the timeline, rotation, interning, the writer's priority and the automatic
//! engine's switch check (`control.rs`, `timeline.rs`, `rotation.rs`,
//! `intern.rs`, `priority.rs`, `adapt.rs`).
//!
//! Order of work in one tick, and why:
//! 1. drain the ring and write the samples (each resolved against the module
//!    table of the generation it was unwound with);
//! 2. write the deactivations queued by the previous tick: samples the handler
//!    took with the old generation while the new snapshot was being published
//!    have been drained in step 1 by now, so they were resolved while their
//!    module was still active;
//! 3. engine upkeep (per-thread timers for new threads);
//! 4. if the loader's counters moved, rescan: removed objects are queued for
//!    deactivation (or retired at once when a newly loaded object reuses their
//!    range, since active spans of a pid may not overlap), new objects are written
//!    as module records of generation + 1, then the new unwinder snapshot is
//!    published, so no sample can refer to a module before its record;
//! 5. reclaim replaced snapshots no handler can hold, and flush;
//! 6. with rotation, when a segment is due: create the next segment, define
//!    the active modules in it, then sync and unlock the one left behind
//!    (see [`Run::rotate`]);
//! 7. publish the warnings found so far (`Run::publish_warnings`: to the
//!    guard and the program's callback, once each); also after every other
//!    wake-up of the loop, and during `finish` for those only known then.
//!
//! With the perf-stack engine the "ring" of step 1 is also every thread's
//! kernel ring: drained and unwound (`stack_sampler.rs`) with the current
//! module snapshot, then held or written like the handler's samples. The
//! writer waits in `epoll_wait` on those rings and on an eventfd that every
//! control message writes; a ring half full wakes it for steps 1, 2 and 4's
//! check without the flush (`Run::drain_step`), so rings stay small.
//!
mod adapt;
mod control;
#[cfg(feature = "heap")]
mod heap;
mod intern;
mod objects;
mod off_cpu;
mod priority;
mod rotation;
mod threads;
mod timeline;

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::engine::Engine;
use super::handler::ring::{Consumer, RawSample};
use super::handler::{self, Retired, Shared};
use super::modules::{self, ModuleTable};
use super::own_fd::OwnFd;
use super::stack_sampler::StackSampler;
use super::stats::{LostSamples, Stats};
use super::sys;
use super::sys::perf_stack::Woken;
use crate::{Error, Frame, RecorderError, SpoolWriter};
pub(crate) use adapt::Adapt;
pub(crate) use control::{channel, Control, ControlSender};
#[cfg(feature = "heap")]
pub(crate) use heap::HeapEvents;
use intern::Interner;
pub(crate) use objects::define_objects;
pub(crate) use off_cpu::OffCpu;
pub(crate) use rotation::Rotation;
use threads::{blocking_warning, thread_cpu_ticks, ThreadSeen, NEW_THREADS_PRESSURE};
use timeline::{HeldSample, Timeline};

/// Where the spool's bytes go. The writer thread appends to it, and at the end
/// makes it durable and lets readers know the recording is over.
pub(crate) trait Sink: Write + Send {
    /// Make everything written so far durable.
    fn sync(&self) -> std::io::Result<()>;
    /// Tell readers that nothing more will be written.
    fn release(&self);
    /// The file's metadata, while the descriptor is still the sink's.
    fn metadata(&self) -> Option<std::fs::Metadata> {
        None
    }
}

/// The spool writer over the writer thread's sink.
pub(crate) type Out = SpoolWriter<Box<dyn Sink>>;

/// What the writer thread owns.
pub(crate) struct WriterState {
    pub shared: Arc<Shared>,
    /// The ring's one consumer; taken out while a drain runs.
    pub consumer: Option<Consumer>,
    pub out: Out,
    pub table: ModuleTable,
    pub engine: Engine,
    pub exe_path: Vec<u8>,
    pub generation: u64,
    pub dl: (u64, u64),
    pub interval: Duration,
    /// How long the writer may keep what it wrote in its buffer: the flush
    /// interval asked for, or the default's (ticks may come more often: see
    /// [`Run::flush_out`]).
    pub file_flush: Duration,
    pub started: Instant,
    pub pid: u32,
    /// Whether the end of the recording syncs the spool to stable storage.
    pub sync_at_finish: bool,
    /// Whether system time is sampled (decided at start).
    pub kernel_time: super::KernelTime,
    /// Segment rotation, when the recording rotates.
    pub rotation: Option<Rotation>,
    /// The writer's unwinding of stack copies (the perf-stack engine and the
    /// kernel-time rings).
    pub stack_sampler: Option<StackSampler>,
    /// Code whose kernel-time samples are the profiler's own (the signal
    /// return trampoline our handler returns through).
    pub own_code: Option<(u64, u64)>,
    /// What did not go as configured (`Stats::warnings`): those found at
    /// start, then those the writer finds, in order.
    pub warnings: Vec<String>,
    /// Hands each warning to the guard and the program's callback once
    /// (`Run::publish_warnings`).
    pub publisher: super::warnings::Publisher,
    /// The spool's path (with rotation: the first segment's), for warnings.
    pub path: std::path::PathBuf,
    /// Perf-event descriptors the engine holds.
    pub descriptors: usize,
    /// Unwind-table bytes handed to the handler's unwinder so far, by where
    /// they live (every object seen while recording).
    pub table_memory: modules::TableMemory,
    /// The executable's unwind tables when their check was left until after
    /// start; the writer runs it first, between its ticks.
    pub deferred: Option<modules::DeferredTables>,
    /// The off-CPU mode's switch records and captures, when it runs.
    pub off_cpu: Option<OffCpu>,
    /// The automatic engine's switch check, while it runs perf events.
    pub adapt: Option<Adapt>,
    /// The heap events' session, when they are recorded.
    #[cfg(feature = "heap")]
    pub heap: Option<HeapEvents>,
}

struct Run {
    st: WriterState,
    interner: Interner,
    pending_retire: Vec<usize>,
    retired: Vec<Retired>,
    samples_written: u64,
    error: Option<Error>,
    frames: Vec<Frame>,
    /// What is known of the loader state over time.
    timeline: Timeline,
    /// Time taken before this tick's loader check: samples after it are held.
    horizon: u64,
    /// Samples taken after the last check, waiting for the next one.
    held: Vec<HeldSample>,
    /// The counters moved without a visible change since the last generation:
    /// some object came and went unseen, so the next change is not exact.
    unseen_objects: bool,
    /// Every thread seen while recording (but the writer), by tid.
    threads: HashMap<u32, ThreadSeen>,
    /// Whether the last Python-runtime mark written was an entry (a new
    /// segment repeats it).
    python_inside: bool,
    /// The handler's count of named threads at the last thread listing.
    named_at_scan: u64,
    /// The switch records told of a thread created or ended since the last
    /// listing (`threads.rs`).
    threads_changed: bool,
    /// When the threads were last listed.
    scanned_at: Instant,
    /// The least time between two listings: [`SCAN_PACE`] times what the
    /// last one took (see `threads_to_scan`).
    scan_gap: Duration,
    /// The time between two listings asked by nothing but the clock: from
    /// [`threads::THREAD_RESCAN`], doubled after each that found the same
    /// threads, up to `THREAD_RESCAN_MAX` (see `threads_to_scan`).
    rescan_every: Duration,
    /// Threads the last listing found.
    listed: usize,
    /// Ring slots the last drain took.
    drained: usize,
    /// The shortened wait while the ring fills faster than the interval
    /// drains it (see `adapt_wait`).
    short: Option<Duration>,
    /// The ring-full loss count at the last tick.
    lost_before: u64,
    /// Whether the off-CPU mode's switch rings were what raised the writer's
    /// priority (for the warning).
    switch_pressed: bool,
    /// Whether the losses to a full ring, and to busy unwinder caches, were
    /// said (`warn_losses`).
    warned_ring_full: bool,
    warned_no_cache: bool,
    /// The perf-stack engine's unwinding, taken out of the state.
    stack_sampler: Option<StackSampler>,
    /// The control channel's eventfd (perf-stack engine only).
    wake: Option<Arc<OwnFd>>,
    /// Samples known to be in the spool (all written up to the last flush
    /// that succeeded).
    confirmed: u64,
    /// When the spool file was last written ([`Run::flush_out`]).
    flushed_at: Instant,
    /// Samples dropped because the spool could no longer be written.
    dropped: u64,
    /// The program took the engine's signal over (see `check_signal`).
    signal_lost: bool,
    /// The writer's nice value, lowered while it falls behind (`priority.rs`).
    priority: priority::Priority,
    /// Whether the priority's raise, or its refusal, was said.
    warned_priority: bool,
    /// New threads found by the listing that raised the priority, when one
    /// did (see `NEW_THREADS_PRESSURE`).
    crowd_found: Option<usize>,
    /// When `check_signal` last asked whether the program closed the perf
    /// events (see [`CLOSED_CHECK_EVERY`]).
    closed_checked: Option<Instant>,
    /// The ring was faulted in (at the first tick).
    prefaulted: bool,
}

/// What the writer's wait returned.
enum Event {
    Control(Control),
    /// The control channel is closed.
    Closed,
    /// The flush interval is up.
    Tick,
    /// Perf-stack rings reached their watermark.
    Rings,
    /// A switch ring of the off-CPU mode is a quarter full.
    Switches,
    /// Nothing to do yet: wait again.
    Again,
    /// An `_exit` or `exec` asked for a tick now: the requests up to this
    /// number (`exit_request.rs`).
    Flush(u64),
}

/// The thread body: wait for `Start`, then run until `Stop`. `wake` is the
/// control channel's eventfd, when it has one.
/// Set when the writer found every thread of the program ended
/// ([`Run::program_gone`]) and finished the recording for that reason.
static PROGRAM_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The result of the writer's run that ended because every thread of the
/// program had ended (kept for the guard's `finish` in the exit handlers).
static GONE_RESULT: std::sync::Mutex<Option<Result<Stats, Error>>> = std::sync::Mutex::new(None);

/// On the writer thread, after [`main`] returned `res`: if it returned
/// because every thread of the program had ended, keep `res` for the
/// guard and end the process with status 0, as the C library does when
/// the last thread of a process ends (the writer is the last one left:
/// a `main` that ended with `pthread_exit` left the process running
/// forever). The program's exit handlers run here, on the writer thread;
/// a guard finished in them takes the kept result ([`take_gone_result`]).
pub(crate) fn exit_when_program_gone(res: Result<Stats, Error>) -> Result<Stats, Error> {
    if !PROGRAM_GONE.load(Ordering::SeqCst) {
        return res;
    }
    *GONE_RESULT.lock().unwrap_or_else(|e| e.into_inner()) = Some(res);
    // SAFETY: exit runs the process's exit handlers and ends it; nothing of this thread's is used after.
    unsafe { libc::exit(0) }
}

/// The kept result of a writer that ended the process
/// ([`exit_when_program_gone`]), for a guard finished on the writer thread.
pub(crate) fn take_gone_result() -> Option<Result<Stats, Error>> {
    GONE_RESULT.lock().unwrap_or_else(|e| e.into_inner()).take()
}

pub(crate) fn main(rx: Receiver<Control>, wake: Option<Arc<OwnFd>>) -> Result<Stats, Error> {
    let mut st = loop {
        match rx.recv() {
            Ok(Control::Start(st)) => break *st,
            Ok(Control::Python { ack, .. }) => {
                let _ = ack.send(Err(Error::Recorder(RecorderError::NotRunning)));
                continue;
            }
            Ok(Control::Abort) | Ok(Control::Stop) | Err(_) => {
                return Err(Error::Recorder(RecorderError::WriterFailed {
                    what: "exited at start",
                    source: None,
                }));
            }
        }
    };
    let interval = st.interval;
    let stack_sampler = st.stack_sampler.take();
    let priority = priority::Priority::new(&st.shared.writer_boost);
    let mut run = Run {
        st,
        interner: Interner::default(),
        pending_retire: Vec::new(),
        retired: Vec::new(),
        samples_written: 0,
        error: None,
        frames: Vec::new(),
        timeline: Timeline::default(),
        horizon: 0,
        held: Vec::new(),
        unseen_objects: false,
        threads: HashMap::new(),
        python_inside: false,
        named_at_scan: 0,
        threads_changed: true,
        scanned_at: Instant::now(),
        scan_gap: Duration::ZERO,
        rescan_every: threads::THREAD_RESCAN,
        listed: 0,
        drained: 0,
        short: None,
        lost_before: 0,
        switch_pressed: false,
        warned_ring_full: false,
        warned_no_cache: false,
        stack_sampler,
        wake,
        confirmed: 0,
        flushed_at: Instant::now(),
        dropped: 0,
        signal_lost: false,
        priority,
        warned_priority: false,
        crowd_found: None,
        closed_checked: None,
        prefaulted: false,
    };
    // The initial scan was taken before the engine started: every sample is later,
    // so generation 0 is verified from the first tick's check on.
    run.timeline.verified.resize(run.st.generation as usize + 1, 0);
    run.timeline.exact.resize(run.st.generation as usize + 1, true);
    // What start found (an engine refused, kernel time refused, threads left
    // without events): published before the first tick.
    run.publish_warnings();
    run.settle();
    let mut next = Instant::now() + interval;
    if let Some(d) = run.st.deferred.take() {
        if !run.check_deferred(d, &rx, &mut next, interval) {
            return run.finish();
        }
    }
    loop {
        match run.next_event(&rx, next) {
            Event::Control(Control::Stop) | Event::Closed => break,
            Event::Control(Control::Python { entering, ack }) => {
                let _ = ack.send(run.python_mark(entering));
            }
            Event::Control(Control::Start(_)) | Event::Control(Control::Abort) => {}
            // Woken for nothing in particular: the heap events' ring may be
            // filling (its producers wake the writer, see `src/heap/events.rs`).
            Event::Again => run.heap_events(),
            Event::Rings => {
                run.drain_step();
                run.collect_switches();
                run.heap_events();
            }
            Event::Switches => run.collect_switches(),
            // The interval shortens if the engine changes (`adapt_engine`).
            Event::Tick => {
                let interval = run.st.interval;
                run.scheduled(&mut next, interval);
                if run.program_gone() {
                    // Finish, then end the process as the C library would
                    // have (`exit_when_program_gone`).
                    PROGRAM_GONE.store(true, Ordering::SeqCst);
                    break;
                }
            }
            // A tick now for an `_exit` or `exec` (`exit_request.rs`); the
            // clock's ticks stay as they were.
            Event::Flush(asked) => {
                run.tick_for(true);
                run.flush_out(true);
                super::exit_request::answered(asked);
            }
        }
        run.publish_warnings();
        run.settle();
    }
    run.finish()
}

impl Run {
    /// Wait for a control message, the next tick (due at `next`) or, with the
    /// perf-stack engine, rings that reached their watermark; with the
    /// off-CPU mode, a switch ring a quarter full.
    fn next_event(&mut self, rx: &Receiver<Control>, next: Instant) -> Event {
        // Read before looking for work: a wake after this returns the wait
        // below at once (see `exit_request::wait_for_wake`).
        let seen = super::exit_request::wake_seq();
        // An `_exit` or `exec` is waiting for a tick (`exit_request.rs`).
        if let Some(asked) = super::exit_request::pending() {
            return Event::Flush(asked);
        }
        let wait = next.saturating_duration_since(Instant::now());
        let switch_wait = self.st.off_cpu.as_mut().is_some_and(|o| o.tracker_mut().can_wait());
        if self.st.engine.stack_events().is_none() && !switch_wait {
            // No rings to wait on: the futex word, which a control message
            // or an exit's request moves.
            return match rx.try_recv() {
                Ok(c) => Event::Control(c),
                Err(TryRecvError::Disconnected) => Event::Closed,
                Err(TryRecvError::Empty) if wait.is_zero() => Event::Tick,
                Err(TryRecvError::Empty) => {
                    super::exit_request::wait_for_wake(seen, wait);
                    Event::Again
                }
            };
        }
        // Messages first: one sent while the rings kept us busy is not missed,
        // and one sent after this check writes the eventfd the wait sees.
        match rx.try_recv() {
            Ok(c) => return Event::Control(c),
            Err(TryRecvError::Disconnected) => return Event::Closed,
            Err(TryRecvError::Empty) => {}
        }
        if wait.is_zero() {
            return Event::Tick;
        }
        match self.wait_rings(wait) {
            Woken::Rings => Event::Rings,
            Woken::Switches => Event::Switches,
            Woken::Other => {
                if let Some(w) = self.wake.as_ref().filter(|w| w.is_ours()) {
                    let mut n = 0u64;
                    // Resets the eventfd's count.
                    // SAFETY: 8 bytes into our u64, from a non-blocking eventfd we keep open.
                    unsafe { libc::read(w.as_raw_fd(), &mut n as *mut u64 as *mut libc::c_void, 8) };
                }
                Event::Again
            }
        }
    }

    /// Wait up to `wait` on the perf-stack engine's epoll set (the switch
    /// rings are in it too), else on the off-CPU mode's.
    fn wait_rings(&mut self, wait: Duration) -> Woken {
        if let Some(events) = self.st.engine.stack_events() {
            return events.wait(wait);
        }
        match self.st.off_cpu.as_mut() {
            Some(o) => o.tracker_mut().wait(wait),
            None => Woken::Other,
        }
    }

    /// Between ticks, when perf-stack rings filled to their watermark: check
    /// the loader, drain and unwind, apply a module change (no flush: the
    /// tick flushes).
    fn drain_step(&mut self) {
        let change = self.scan_modules();
        self.drain(false);
        self.apply_module_change(change);
    }

    /// Keep the first error (the spool can no longer be written: every later
    /// sample is counted and dropped), and warn of it at once.
    fn note<T>(&mut self, r: Result<T, Error>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                if self.error.is_none() {
                    let at = match &e {
                        Error::Io { path: Some(_), .. } => String::new(),
                        _ => format!(" {}", self.current_path().display()),
                    };
                    self.st.warnings.push(format!(
                        "writing the spool{at} stopped {:.1} s into the recording: {e}; the samples taken \
                         from here on are counted and dropped",
                        self.st.started.elapsed().as_secs_f64()
                    ));
                    self.error = Some(e);
                }
                None
            }
        }
    }

    /// The spool file written now (with rotation: the current segment).
    fn current_path(&self) -> &std::path::Path {
        self.st.rotation.as_ref().and_then(|r| r.current()).unwrap_or(&self.st.path)
    }

    /// Hand the warnings found since the last call to the guard and the
    /// program's callback (see `recorder/warnings.rs`). Cheap when there are
    /// none: a length comparison.
    fn publish_warnings(&mut self) {
        self.st.publisher.publish(&mut self.st.warnings);
    }

    /// The work due at `next`: a tick, and a new segment when one is due.
    fn scheduled(&mut self, next: &mut Instant, interval: Duration) {
        self.tick();
        if self.st.rotation.as_ref().is_some_and(|r| Instant::now() >= r.due) {
            // The segment left must be complete, and a failure to write it
            // must stop the rotation (`rotate` checks for one): the tick's
            // write may have waited for the file's interval.
            self.flush_out(true);
            self.rotate();
        }
        self.warn_losses();
        self.publish_warnings();
        // Fixed rate: the next tick is one interval after this one was due,
        // not after it finished, so ticks do not drift later (in off-CPU
        // mode, the jitter below makes the schedule a random walk with no
        // drift on average).
        *next += interval;
        let now = Instant::now();
        if *next <= now {
            *next = now + interval;
        }
        // Samples that arrived since the last drain: those it took and those
        // lost to a full ring; the next wait follows their rate.
        let lost = self.st.shared.counters.lost_ring_full.load(Ordering::Relaxed);
        let lost_now = lost.saturating_sub(self.lost_before);
        let arrived = (self.drained as u64).saturating_add(lost_now);
        self.lost_before = lost;
        // The perf-stack engine's samples come through the kernel's rings,
        // not the handler's (a token ring of 2 slots): only its losses count.
        let capacity = match self.st.engine.kind() {
            crate::Engine::PerfStack => u64::MAX,
            _ => self.st.shared.ring.capacity() as u64,
        };
        // The off-CPU mode's switch rings, woken at a quarter full, found half
        // full or losing records: the writer gets too little CPU for them.
        let switches = self.switch_pressure();
        let pressed = priority::pressed(arrived, lost_now, capacity) || switches;
        self.priority.observe(pressed, &self.st.shared.writer_boost);
        self.warn_priority(capacity);
        let wait = self.short.unwrap_or(interval);
        let wait = adapt_wait(wait, arrived, self.st.shared.ring.capacity() as u64, interval);
        self.short = (wait < interval).then_some(wait);
        *next = (*next).min(now + wait);
        // The automatic engine's switch check runs at the ticks: in the
        // first seconds, tick often enough that a switch-heavy program moves
        // within tens of milliseconds rather than two flush intervals (it
        // pays the perf events' cost per switch until then).
        if self.st.adapt.is_some() && self.st.started.elapsed() < adapt::EARLY {
            *next = (*next).min(now + adapt::EARLY_TICK);
        }
        // In off-CPU mode, each wait is made up to a tenth longer or shorter
        // (at random, zero on average), so that the waits the ticks' captures
        // find are not phase-locked to a program's own period: a thread
        // sleeping 10 ms, ticked every 10 or 50 ms, was found at the same
        // point of its cycle at every tick, and `--spread-blocked` took that
        // point for its profile.
        if let Some(o) = self.st.off_cpu.as_mut() {
            let wait = next.saturating_duration_since(now);
            let span = (wait / 5).as_nanos() as u64;
            let r = o.tracker_mut().pairing.random() % span.max(1);
            *next = now + wait - wait / 10 + Duration::from_nanos(r);
        }
    }

    /// Whether the off-CPU mode's switch rings were found half full or
    /// losing records since the last call (noted for the warning).
    fn switch_pressure(&mut self) -> bool {
        let pressed = self.st.off_cpu.as_mut().is_some_and(|o| o.tracker_mut().take_pressed());
        if pressed && self.priority.raised_to().is_none() {
            self.switch_pressed = true;
        }
        pressed
    }

    /// Say, once, that the writer fell behind and took a higher priority, or
    /// could not.
    fn warn_priority(&mut self, capacity: u64) {
        if self.warned_priority {
            return;
        }
        let crowd = self.crowd_found;
        let lost = self.lost_before;
        let switches = self.switch_pressed.then(|| self.st.off_cpu.as_ref().map_or(0, |o| o.tracker_lost()));
        let why = || {
            match (crowd, switches) {
            (Some(n), _) => format!("{n} new threads at one listing, each needing its timer"),
            (None, Some(n)) => format!(
                "the off-CPU mode's context-switch rings found half full or more; {n} switch records lost so far"
            ),
            (None, None) if capacity == u64::MAX => format!("{lost} samples lost to full kernel rings so far"),
            (None, None) => format!(
                "the sample ring of {capacity} slots found half full or more; {lost} samples lost so far"
            ),
        }
        };
        if let Some(nice) = self.priority.raised_to() {
            self.warned_priority = true;
            self.st.warnings.push(format!(
                "the writer thread fell behind ({}; many runnable threads share the CPU with it): \
                 its nice value went from {} to {nice} while it drains (only the writer's; it goes back after \
                 {} s without pressure)",
                why(),
                self.priority.base(),
                priority::CALM.as_secs()
            ));
        } else if let Some(e) = self.priority.refused() {
            self.warned_priority = true;
            self.st.warnings.push(format!(
                "the writer thread fell behind ({}; many runnable threads share the CPU with it) \
                 and could not raise its priority (setpriority: {e}; CAP_SYS_NICE or a RLIMIT_NICE above \
                 {} allows it): samples (and off-CPU switch records) may be lost",
                why(),
                20 - self.priority.base()
            ));
        }
    }

    /// Say, once each and as soon as they start, that samples are being lost
    /// and why (the counts are in `Stats::samples_lost` at the end).
    fn warn_losses(&mut self) {
        let c = &self.st.shared.counters;
        let full = c.lost_ring_full.load(Ordering::Relaxed);
        if full > 0 && !self.warned_ring_full {
            self.warned_ring_full = true;
            self.st.warnings.push(format!(
                "samples are being lost: the sample ring was full ({full} so far): the writer thread got too \
                 little CPU to drain it (thousands of runnable threads can starve it) or the ring is too small \
                 for the rate (RecorderBuilder::ring_capacity)"
            ));
        }
        let no_cache = c.lost_no_cache.load(Ordering::Relaxed);
        if no_cache > 0 && !self.warned_no_cache {
            self.warned_no_cache = true;
            self.st.warnings.push(format!(
                "samples are being lost: every unwinder cache was in use ({no_cache} so far): signal handlers \
                 preempted while unwinding, with many more runnable threads than CPUs"
            ));
        }
        self.warn_switch_losses();
    }

    /// Check the executable's unwind tables left from start, keeping to the
    /// writer's schedule meanwhile (ticks when due, control messages answered),
    /// then hand the checked module to the handler: same modules, same
    /// generation. False when asked to stop during the check (the executable
    /// then stays without tables: its frames end the stacks).
    fn check_deferred(
        &mut self,
        d: modules::DeferredTables,
        rx: &Receiver<Control>,
        next: &mut Instant,
        interval: Duration,
    ) -> bool {
        let mut stop = false;
        let mut between = || {
            if let Some(asked) = super::exit_request::pending() {
                self.release_waiting();
                self.tick();
                self.flush_out(true);
                super::exit_request::answered(asked);
            }
            loop {
                match rx.try_recv() {
                    Ok(Control::Stop) | Err(TryRecvError::Disconnected) => {
                        stop = true;
                        return false;
                    }
                    Ok(Control::Python { entering, ack }) => {
                        let _ = ack.send(self.python_mark(entering));
                    }
                    Ok(Control::Start(_)) | Ok(Control::Abort) => {}
                    Err(TryRecvError::Empty) => break,
                }
            }
            // The perf-stack engine's rings fill meanwhile: drain those at
            // their watermark as the main loop would (their stacks stop at the
            // executable's frames until the check is done).
            match self.wait_rings(Duration::ZERO) {
                Woken::Rings => {
                    self.drain_step();
                    self.collect_switches();
                }
                Woken::Switches => self.collect_switches(),
                Woken::Other => {}
            }
            if Instant::now() >= *next {
                self.scheduled(next, interval);
            }
            true
        };
        let delay_until = Instant::now() + modules::check_delay();
        let mut going = true;
        while going && Instant::now() < delay_until {
            going = between();
            std::thread::sleep(Duration::from_millis(1));
        }
        let checked = if going { d.check(&mut between) } else { None };
        if let Some((module, memory)) = checked {
            let snap = self.st.shared.snapshot.with_current(|cur| modules::checked_snapshot(cur, module));
            self.retired.push(self.st.shared.snapshot.replace(Box::new(snap)));
            self.st.table_memory = self.st.table_memory.add(memory);
        }
        // The perf-stack samples taken meanwhile, with the executable's
        // frames now (or, if the check was given up, without them).
        self.release_waiting();
        !stop
    }

    fn tick(&mut self) {
        self.tick_for(false)
    }

    /// Write the heap events handed over (feature `heap`, when asked).
    fn heap_events(&mut self) {
        #[cfg(feature = "heap")]
        self.heap_step();
    }

    /// Whether no heap events can be waiting (none are recorded).
    fn heap_quiet(&self) -> bool {
        #[cfg(feature = "heap")]
        return self.st.heap.is_none();
        #[cfg(not(feature = "heap"))]
        true
    }

    /// Say what an exit would find unwritten (`exit_request::settled`): the
    /// ring slots read, and whether nothing else waits to be written. Only
    /// the signal engines' samples come through the ring; the perf-stack
    /// engine's and the off-CPU mode's come through the kernel's rings, so
    /// with them an exit always asks for a tick.
    fn settle(&mut self) {
        let read = self.st.consumer.as_ref().map(|c| c.position());
        let quiet = self.held.is_empty()
            && self.st.out.buffered() == 0
            && self.st.off_cpu.is_none()
            && self.heap_quiet()
            && self.st.engine.stack_events().is_none();
        super::exit_request::settled(read.unwrap_or(0), quiet && read.is_some());
    }

    /// A tick; `before_exit`: the one an `_exit` or `exec` asked for
    /// (`exit_request.rs`), which writes out what the ring holds and what the
    /// modules need, and leaves out what only a process that runs on needs
    /// (the ring's pages faulted in, the threads listed, the engine adapted):
    /// in a forked child that execs at once, the first tick's fault-in of the
    /// 2 MB ring was a millisecond of the `exec`'s wait.
    fn tick_for(&mut self, before_exit: bool) {
        if before_exit {
            let change = self.scan_modules();
            self.drain(false);
            self.off_cpu_step(false);
            self.apply_module_change(change);
            // (After the change: a library loaded since the last tick is
            // known to the events' stacks.)
            self.heap_events();
            handler::reclaim(&mut self.retired);
            return;
        }
        if !self.prefaulted {
            // The ring's pages, faulted in here rather than in the handler,
            // at the first tick rather than at start: a process that ends
            // sooner (most of a build's) never pays for the 2 MB it would
            // not use (1-2 ms of CPU a process, a tenth of its start-up).
            self.prefaulted = true;
            self.st.shared.ring.prefault();
        }
        self.check_signal(false);
        let tids = self.threads_to_scan();
        if let Some(tids) = &tids {
            let news = self.scan_threads(tids, false);
            // An engine that acts for each new thread (a timer to create)
            // found a crowd of them: the writer's turn among them comes
            // rarely, and no sample flows until it has acted, so no handler
            // would ask for it (see `priority.rs`).
            if news >= NEW_THREADS_PRESSURE && self.st.engine.needs_every_scan() {
                self.priority.observe(true, &self.st.shared.writer_boost);
                self.crowd_found.get_or_insert(news);
            }
        }
        let change = self.scan_modules();
        self.drain(false);
        self.off_cpu_step(false);
        self.apply_module_change(change);
        self.heap_events();
        self.adapt_engine();
        if let Some(tids) = &tids {
            if !self.st.engine.tick(tids) {
                // A thread left without its timer: list again at the next tick.
                self.threads_changed = true;
            }
        }
        handler::reclaim(&mut self.retired);
        self.flush_out(false);
    }

    /// Flush the spool; on success every sample so far is in it. Unless
    /// `force`, only once the file is due ([`WriterState::file_flush`]): the
    /// engines that tick every 50 ms by default (to time a new thread's
    /// first samples) write the file every other tick, as often as the
    /// others. A write of a tick's few KiB to the spool after 50 ms costs
    /// the kernel 25-55 us here (the file's times change, and the journal
    /// with them): at 20 a second it was 8% of an off-CPU writer's time.
    fn flush_out(&mut self, force: bool) {
        // Half a tick early: the ticks that come at about the file's
        // interval each write it, whatever their jitter.
        if !force && self.flushed_at.elapsed() + self.st.interval / 2 < self.st.file_flush {
            return;
        }
        if self.error.is_none() {
            let r = self.st.out.flush();
            if self.note(r).is_some() {
                self.confirmed = self.samples_written;
            }
        }
        self.flushed_at = Instant::now();
    }

    /// Write what the ring holds. Unless `all`, samples taken after this tick's
    /// loader check are held for the next tick (see `objects.rs`).
    fn drain(&mut self, all: bool) {
        let held = std::mem::take(&mut self.held);
        for h in &held {
            self.write_or_hold(&h.view(), all);
        }
        let shared = self.st.shared.clone();
        // Out of `self` for the loop, whose closure borrows `self` mutably.
        let Some(mut consumer) = self.st.consumer.take() else { return };
        self.drained = 0;
        while let Some(()) = consumer.pop(&shared.ring, |s| {
            self.drained += 1;
            if let Some(s) = s {
                self.write_or_hold(&s, all);
            }
        }) {}
        self.st.consumer = Some(consumer);
        self.drain_stacks(all);
    }

    /// Write `s`, or (unless `all`) hold a copy of it for the next tick if it
    /// was taken after this tick's loader check.
    fn write_or_hold(&mut self, s: &RawSample<'_>, all: bool) {
        if !all && s.time_us > self.horizon {
            self.held.push(HeldSample::of(s));
        } else {
            self.write_sample(s);
        }
    }

    /// The perf-stack engine's rings and the kernel-time rings: drain them,
    /// unwind, and write (or hold) the samples as `drain` does the handler's.
    fn drain_stacks(&mut self, all: bool) {
        let Some(mut sampler) = self.stack_sampler.take() else { return };
        sampler.clear();
        let shared = self.st.shared.clone();
        let own = self.st.own_code;
        if let Some(events) = self.st.engine.stack_events() {
            shared.snapshot.with_current(|snap| sampler.collect(events, snap, &shared.counters));
        }
        if let Some(rings) = self.st.engine.kernel_rings() {
            let mut weight = || handler::kernel_weight(&shared);
            shared
                .snapshot
                .with_current(|snap| sampler.collect_kernel(rings, snap, &shared.counters, own, &mut weight));
        }
        self.write_batch(&sampler, all);
        self.stack_sampler = Some(sampler);
    }

    fn write_batch(&mut self, sampler: &StackSampler, all: bool) {
        for u in &sampler.batch {
            let s = RawSample {
                time_us: u.time_us,
                tid: u.tid,
                weight: u.weight,
                generation: u.generation,
                truncated: u.truncated,
                kernel: u.kernel,
                addrs: &sampler.addrs[u.start..u.start + u.len],
            };
            self.write_or_hold(&s, all);
        }
    }

    /// Unwind and write (or hold) the perf-stack samples kept while the
    /// executable's tables are checked, with the current snapshot: called
    /// when the check ends, and before the snapshot changes or the process
    /// exits during it (see `StackSampler::release_waiting`).
    pub(super) fn release_waiting(&mut self) {
        let Some(mut sampler) = self.stack_sampler.take() else { return };
        if sampler.has_waiting() {
            sampler.clear();
            let shared = self.st.shared.clone();
            let own = self.st.own_code;
            shared.snapshot.with_current(|snap| sampler.release_waiting(snap, &shared.counters, own));
            self.write_batch(&sampler, false);
        }
        self.stack_sampler = Some(sampler);
    }

    /// Write a Python-runtime record stamped with a fresh loader check's time,
    /// after every sample taken before that time and before every sample taken
    /// after it (those are held for the next tick, as in a tick).
    fn python_mark(&mut self, entering: bool) -> Result<(), Error> {
        let change = self.scan_modules();
        let mark_time = self.horizon;
        self.drain(false);
        self.apply_module_change(change);
        if let Some(e) = &self.error {
            return Err(Error::Recorder(RecorderError::WriterFailed {
                what: "failed earlier",
                source: Some(e.to_io_error()),
            }));
        }
        let r =
            self.st.out.python_runtime(self.st.pid, mark_time, entering).and_then(|()| self.st.out.flush());
        match r {
            Ok(()) => {
                self.python_inside = entering;
                Ok(())
            }
            Err(e) => {
                let source = e.to_io_error();
                self.note(Err::<(), _>(e));
                Err(Error::Recorder(RecorderError::WriterFailed {
                    what: "could not write the Python-runtime record",
                    source: Some(source),
                }))
            }
        }
    }

    fn write_sample(&mut self, s: &RawSample<'_>) {
        let seen = self.threads.entry(s.tid).or_default();
        seen.sampled = true;
        seen.user_sampled |= !s.kernel;
        if s.addrs.is_empty() {
            return;
        }
        if self.error.is_some() {
            // The spool can no longer be written: counted, not written.
            self.dropped += u64::from(s.weight.max(1));
            return;
        }
        let r = self.sample_inner(s);
        self.note(r);
    }

    fn sample_inner(&mut self, s: &RawSample<'_>) -> Result<(), Error> {
        let thread = self.interner.thread(&mut self.st.out, self.st.pid, s.tid, &self.st.shared.names)?;
        let leaf = self.leaf_of(s)?;
        if let Some(o) = &mut self.st.off_cpu {
            // Where a preempted thread was: its last sampled stack.
            o.last_leaf.insert(s.tid, leaf);
        }
        for _ in 0..s.weight.max(1) {
            self.st.out.sample(s.time_us, thread, leaf)?;
            self.samples_written += 1;
        }
        if self.st.out.buffered() == 0 {
            // An automatic flush just wrote everything.
            self.confirmed = self.samples_written;
        }
        Ok(())
    }

    /// The leaf stack node of a raw sample, defining what is new.
    fn leaf_of(&mut self, s: &RawSample<'_>) -> Result<crate::StackId, Error> {
        let exact_state = self.timeline.exact_state(s.generation, s.time_us);
        let cached = if exact_state {
            self.interner.cached(s.generation, s.truncated, s.kernel, s.addrs)
        } else {
            None
        };
        let leaf = match cached {
            Some(l) => l,
            None => {
                let mut frames = std::mem::take(&mut self.frames);
                frames.clear();
                if s.truncated {
                    frames.push(Frame::Truncated);
                }
                for (i, &a) in s.addrs.iter().enumerate().rev() {
                    // Return addresses point after the call: step back into it.
                    let addr = if i == 0 { a } else { a.wrapping_sub(1) };
                    let entry = self.st.table.resolve(addr, s.generation).filter(|e| {
                        if exact_state {
                            // The address space was generation `g` at `t`: only its own modules.
                            e.gen_added <= s.generation
                        } else {
                            self.timeline.certainly_mapped(e, s.generation, s.time_us)
                        }
                    });
                    frames.push(match entry {
                        Some(e) => Frame::Module {
                            module: e.id,
                            file_relative: addr - e.seg.avma + e.seg.file_offset,
                        },
                        None => Frame::Absolute { address: addr, kernel: false },
                    });
                }
                if s.kernel {
                    // The period ended in the kernel: a kernel-mode leaf on top
                    // of the user stack that entered it. Which kernel function
                    // ran is not known in process: address 0.
                    frames.push(Frame::Absolute { address: 0, kernel: true });
                }
                let r = self.interner.stack(&mut self.st.out, &frames);
                self.frames = frames;
                let leaf = r?;
                if exact_state {
                    self.interner.remember(leaf);
                }
                leaf
            }
        };
        Ok(leaf)
    }

    fn finish(mut self) -> Result<Stats, Error> {
        // What happened to the engine's signal since the last tick.
        self.check_signal(true);
        if let Ok(tids) = super::sys::list_tids() {
            self.scan_threads(&tids, true);
        }
        self.st.engine.stop();
        // Withdraw the state from the handler and wait until no handler uses it:
        // every sample is then in the ring, taken before the check below.
        let _ = handler::unpublish();
        let change = self.scan_modules();
        self.drain(true);
        self.off_cpu_step(true);
        if let Some(events) = self.st.engine.stack_events() {
            // Samples the kernel dropped and never reported in a lost record.
            let lost = events.close_all();
            self.st.shared.counters.lost_ring_full.fetch_add(lost, Ordering::Relaxed);
        }
        if let Some(rings) = self.st.engine.kernel_rings() {
            let lost = rings.lost_unreported();
            self.st.shared.counters.lost_ring_full.fetch_add(lost, Ordering::Relaxed);
        }
        self.apply_module_change(change);
        self.heap_events();
        let pending = std::mem::take(&mut self.pending_retire);
        for idx in pending {
            self.retire(idx);
        }
        handler::reclaim(&mut self.retired);
        self.flush_out(true);
        if self.error.is_none() && self.st.sync_at_finish {
            let r = self.st.out.get_ref().sync().map_err(Error::from);
            self.note(r);
        }
        // The recording is complete on disk: readers may know it now.
        self.st.out.get_ref().release();
        // Those only known now (and any of the steps above).
        self.warn_losses();
        self.publish_warnings();
        if let Some(e) = self.error.take() {
            // Samples written after the last flush that succeeded went with
            // the failed write (or into a descriptor no longer the spool's,
            // which the sink refused): lost, as are those taken afterwards.
            let unflushed = self.samples_written - self.confirmed;
            return Err(Error::Recorder(RecorderError::WriteStopped {
                source: Box::new(e),
                samples_written: self.confirmed,
                samples_lost: unflushed + self.dropped,
                warnings: std::mem::take(&mut self.st.warnings),
            }));
        }
        // Threads seen blocking the signal, never sampled by it (in user
        // mode), alive and having used CPU: a
        // thread is seen blocking for a moment in a handler or while glibc
        // starts it, which is no loss.
        let blocking = self
            .threads
            .iter()
            .filter(|(&tid, t)| {
                t.blocking && !t.user_sampled && thread_cpu_ticks(tid).is_some_and(|c| c >= 2)
            })
            .count();
        if let (true, Some(sig)) = (blocking > 0, self.st.engine.signal()) {
            self.st.warnings.push(blocking_warning(blocking, sig));
        }
        let c = &self.st.shared.counters;
        Ok(Stats {
            samples_written: self.samples_written,
            samples_lost: LostSamples {
                ring_full: c.lost_ring_full.load(Ordering::Relaxed),
                no_cache: c.lost_no_cache.load(Ordering::Relaxed),
                unwind_failed: c.lost_unwind_failed.load(Ordering::Relaxed),
                overrun_capped: c.overrun_capped.load(Ordering::Relaxed),
            },
            signals: c.signals.load(Ordering::Relaxed),
            truncated_stacks: c.truncated.load(Ordering::Relaxed),
            unknown_stacks: c.foreign_stack.load(Ordering::Relaxed),
            bytes: self.st.rotation.as_ref().map_or(0, |r| r.bytes_done) + self.st.out.len(),
            engine: self.st.engine.kind(),
            duration: self.st.started.elapsed(),
            module_generations: self.st.generation + 1,
            threads_seen: self.threads.len() as u64,
            threads_never_sampled: self.threads.values().filter(|t| !t.sampled).count() as u64,
            threads_blocking_signal: self.threads.values().filter(|t| t.blocking).count() as u64,
            kernel_time: self.st.kernel_time.clone(),
            kernel_samples: c.kernel.load(Ordering::Relaxed),
            threads_without_kernel_time: self.st.engine.kernel_missed(),
            own_samples_dropped: c.own_dropped.load(Ordering::Relaxed),
            descriptors: self.st.descriptors as u64,
            warnings: std::mem::take(&mut self.st.warnings),
            segments_written: self.st.rotation.as_ref().map_or(1, |r| r.seq + 1),
            segments_deleted: self.st.rotation.as_ref().map_or(0, |r| r.deleted),
            writer_cpu: super::sys::thread_cpu_time(),
            writer_nice: self.priority.raised_to(),
            unwind_tables_copied: self.st.table_memory.copied,
            off_cpu: self.st.off_cpu.as_ref().map(|o| o.stats()),
            #[cfg(feature = "heap")]
            heap_events: self.st.heap.as_ref().map(|h| h.stats()),
            #[cfg(not(feature = "heap"))]
            heap_events: None,
            unwind_tables_mapped: self.st.table_memory.borrowed,
        })
    }
}

/// The writer's next wait, after a wait of `wait` in which `arrived` samples
/// came into a ring of `capacity` slots: short enough that a quarter of the
/// ring fills in it at that rate, so bursts have room (1 ms at least); once
/// the rate has dropped to less than an eighth of the ring per wait, doubled
/// back towards `interval` (the most it ever is).
fn adapt_wait(wait: Duration, arrived: u64, capacity: u64, interval: Duration) -> Duration {
    let quarter = (capacity / 4).max(1);
    let next = if arrived > quarter {
        wait.mul_f64(quarter as f64 / arrived as f64)
    } else if arrived.saturating_mul(8) < capacity {
        wait.saturating_mul(2)
    } else {
        wait
    };
    next.clamp(Duration::from_millis(1).min(interval), interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_shrinks_with_the_arrival_rate_and_grows_back() {
        let ms = Duration::from_millis;
        let interval = ms(100);
        // A quarter of a 1024-slot ring is 256: 1024 arrivals in 100 ms, so
        // 256 arrive in 25 ms.
        assert_eq!(adapt_wait(interval, 1024, 1024, interval), ms(25));
        // Below a quarter and above an eighth: unchanged.
        assert_eq!(adapt_wait(ms(25), 200, 1024, interval), ms(25));
        // Below an eighth: doubled, never past the interval.
        assert_eq!(adapt_wait(ms(25), 10, 1024, interval), ms(50));
        assert_eq!(adapt_wait(ms(80), 10, 1024, interval), interval);
        // Never below 1 ms, even for a flood.
        assert_eq!(adapt_wait(ms(2), 1 << 40, 1024, interval), ms(1));
        // Nothing arrived: the interval.
        assert_eq!(adapt_wait(interval, 0, 1024, interval), interval);
    }
}
