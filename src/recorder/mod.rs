//! The recorder: `spulse::start("out.spool")` and [`Recorder::builder`] sample
//! every thread's CPU time with a signal handler, and a writer thread turns the
//! samples into a spool. The opt-in perf-stack engine
//! ([`EngineChoice::PerfStack`]) has no signal and no handler: the kernel copies
//! each sample's user registers and stack top into a ring per thread
//! (`sys/perf_stack.rs`, whose doc states the memory bound: 260 KiB a thread by
//! default, 64 MiB at most) and the writer thread unwinds the copies
//! (`stack_sampler.rs`) and writes them through the same path.
//!
//! Pieces: `handler/` (everything that runs in the signal handler: the handler,
//! the ring's producer side, the unwinder cache pool and walk, the module-snapshot
//! cell, the shared state and counters; its `mod.rs` gives the async-signal-safety
//! argument), `sys/` (the OS layer: `sigaction`, `perf_event_open`, timers,
//! thread-control-block probing, `/proc/self/maps`), `engine.rs` (the running
//! engine: who sends the signal), `stack_sampler.rs` (the perf-stack engine's
//! unwinding), `modules/` (loaded objects: `scan.rs`, `table.rs` and the
//! handler's unwinder snapshots in `snapshot.rs`;
//! `cfi_check.rs` decides which unwind tables the handler may be handed and
//! `cfi_cache.rs` keeps its verdicts per library build), `writer/` (the spool
//! side: the run loop, control messages, the timeline that decides which
//! samples to hold, rotation, and `intern.rs`), `builder.rs` (the settings and
//! their checks), `stats.rs` (what a recording reports), `warnings.rs` (the
//! warnings handed to the program as the writer finds them), `output.rs` (the
//! output-path template, segment paths, spool creation). This file holds the
//! guard, the start sequence and its cleanup, and the Python-runtime marks.
//!
//! # Starting
//! Every builder value is checked before anything is created, so a bad one is
//! an `Err` naming it with no file, signal handler or thread left behind. The
//! output path is a template (`{pid}`, `{timestamp}`, `{seq}`), `SPULSE_OUTPUT`
//! overrides it, and `overwrite(true)` replaces an existing spool by unlink and
//! exclusive create (never through a symlink, never a spool whose recorder is
//! still running).
//!
//! # Rotation
//! With [`RecorderBuilder::rotate`] the recording is a series of segment files,
//! `{seq}` in the path numbering them (`000000`, `000001`, ...). At the first
//! flush at or after each interval the writer thread creates the next segment
//! (same rules as the first: exclusive create, `overwrite`, mode, lock), writes
//! its header and the definitions of every module still active, then flushes,
//! syncs and unlocks the segment it leaves. Frames, stacks and threads are
//! defined again in the new segment when its samples first need them, so every
//! segment is a complete spool that any reader opens on its own. The next
//! segment exists (locked) before the previous one is unlocked: a follower that
//! finds a segment unlocked and no next segment knows the recording ended.
//! [`RecorderBuilder::retain`] deletes the oldest segments this recorder
//! created (checked by device, inode, size and modification time at the
//! segment's end, since inode numbers are reused: a file someone put in
//! their place is left alone) so that at most N remain.
//!
//! # Followers' lock
//! The spool's descriptor holds `flock(LOCK_EX)` from creation until the final
//! `fsync` (then `LOCK_UN`), or until the process dies (and any child forked
//! meanwhile, which shares the open file description, exits). A reader that gets
//! `EWOULDBLOCK` from `flock(LOCK_SH | LOCK_NB)` on its own descriptor knows the
//! recording is still running; once it gets the lock, the file is complete (or
//! its writer died) and will not grow.
//!
//! # Processes
//! * A forked child gets nothing: no engine delivers signals to it (perf events
//!   use `inherit_thread`, POSIX timers and itimers are not inherited by `fork`),
//!   a `pthread_atfork` child hook withdraws the recorder state so the handler
//!   ignores anything that arrives anyway, and a [`Guard`] dropped in the child
//!   does nothing. The child has no spool unless it starts a recorder of its own
//!   (with another path), which it may: the parent's "running" mark is cleared
//!   in the child.
//! * `exec`: perf events are removed at exec (`remove_on_exec`) and POSIX timers
//!   are deleted, so the new program never sees a profiling signal. The
//!   process-timer fallback engine's itimer survives a direct `exec` of the
//!   profiled process (not a fork+exec); see `sys/timer.rs`.

mod builder;
mod engine;
pub(crate) mod exit_request;
mod handler;
pub(crate) mod modules;
mod output;
mod own_fd;
mod stack_sampler;
mod stats;
mod sys;
mod warnings;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::{Engine, Error, Header, RecorderError, SpoolWriter};
use handler::{ring, unwind, Counters, Shared, StackBounds};
use writer::{Control, ControlSender, WriterState};

use builder::{Checked, MAX_SIGNAL_WEIGHT, MAX_UNWIND_CACHES, PER_THREAD_ENGINE_FLUSH_INTERVAL};
pub use builder::{Recorder, RecorderBuilder};
pub use exit_request::{flush_before_exit, writer_tid};
use output::create_spool;
pub use stats::{
    warnings_path, write_warnings, EngineChoice, HeapEventStats, KernelTime, LostSamples, OffCpuStats, Stats,
    SWITCH_HEAVY_PER_CPU_SECOND,
};
pub use sys::preloaded::live_spool_of_this_copy;
#[cfg(feature = "http")]
pub(crate) use sys::preloaded::preload_live_spool;
#[cfg(feature = "http")]
pub(crate) use sys::preloaded::preload_split_off_cpu;
#[cfg(feature = "http")]
pub(crate) use sys::sigmask::spawn_quiet;

/// Start recording to `path` with the defaults.
///
/// `path` is a template (`{pid}`, `{timestamp}`) and `SPULSE_OUTPUT` overrides
/// it, as for [`RecorderBuilder::start`]; an existing file is refused (use
/// `Recorder::builder().overwrite(true)` to replace it).
pub fn start(path: impl AsRef<Path>) -> Result<Guard, Error> {
    Recorder::builder().start(path)
}

/// A running recording. Dropping it stops sampling, drains, writes and syncs;
/// [`Guard::finish`] does the same and reports.
#[derive(Debug)]
pub struct Guard {
    inner: Option<Running>,
}

#[derive(Debug)]
struct Running {
    tx: ControlSender,
    join: JoinHandle<Result<Stats, Error>>,
    pid: u32,
    path: PathBuf,
    engine: Engine,
    /// The warnings the writer thread has published so far.
    warnings: Arc<warnings::WarningLog>,
    #[cfg(all(feature = "heap", feature = "pprof"))]
    heap_profile: Option<PathBuf>,
}

/// Least bytes of a blocked thread's stack the off-CPU mode's capture copies
/// (`user_stack_copy` if larger). The writer copies them, not the thread,
/// once a capture: 64 KiB with `process_vm_readv` is about a microsecond,
/// and a 16 KiB copy cut node's event loop a few frames above `main`.
const OFF_CPU_STACK_COPY: u32 = 64 << 10;

static RUNNING: AtomicBool = AtomicBool::new(false);
static PYTHON_TX: Mutex<Option<ControlSender>> = Mutex::new(None);
static PYTHON_INSIDE: AtomicBool = AtomicBool::new(false);
/// The running recorder's spool, for readers in the same process (the `http`
/// endpoint cuts its windows from it): (pid that started it, path, flush
/// interval). Set once a recording has started, cleared when it stops.
static LIVE_SPOOL: Mutex<Option<(u32, PathBuf, Duration)>> = Mutex::new(None);

/// A rotating recorder moved on to the segment at `path`: profile windows cut
/// from the live spool from now on read that one.
pub(crate) fn set_live_segment(path: &Path) {
    let mut live = LIVE_SPOOL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((pid, p, _)) = &mut *live {
        if *pid == sys::getpid() {
            *p = path.to_path_buf();
        }
    }
}

/// Requests to the running recorder's writer (off-CPU mode): write the part
/// up to each time (unix ns; 0: none) of every wait still open, and the sums
/// of short waits up to it, when a drain reaches it (at its next tick or
/// ring wake-up). The `http` endpoint's wall-clock window asks it when it
/// opens and when it closes, so that threads blocked past its end are
/// counted in it and no summed record straddles either edge. Up to four
/// are held (two windows' edges); a request finding them all taken
/// replaces the last.
static OFF_CPU_SPLITS_AT_NS: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Whether `tid` is one of spulse's own threads (the writer, the probes,
/// the endpoint's): lock-free, allocation-free.
#[cfg(feature = "heap")]
pub(crate) fn is_own_thread(tid: u32) -> bool {
    sys::sigmask::own::is_own(tid)
}

/// This thread's kernel thread id, without a system call where the
/// recorder's start found glibc's field for it (allocation-free: the heap
/// sampler's events).
#[cfg(feature = "heap")]
pub(crate) fn current_tid() -> u32 {
    sys::tcb::current_tid()
}

/// Ask the recorder running in this process (if in off-CPU mode) to write,
/// within a flush interval, the part up to `at_ns` (unix ns) of every wait
/// still open (see `OFF_CPU_SPLITS_AT_NS`).
pub fn request_off_cpu_split(at_ns: u64) {
    let free = OFF_CPU_SPLITS_AT_NS
        .iter()
        .any(|slot| slot.compare_exchange(0, at_ns, Ordering::SeqCst, Ordering::SeqCst).is_ok());
    if !free {
        OFF_CPU_SPLITS_AT_NS[OFF_CPU_SPLITS_AT_NS.len() - 1].store(at_ns, Ordering::SeqCst);
    }
}

/// The pending split requests, each once (taken by the writer: see
/// [`request_off_cpu_split`]).
pub(crate) fn take_off_cpu_splits(mut each: impl FnMut(u64)) {
    for slot in &OFF_CPU_SPLITS_AT_NS {
        let at = slot.swap(0, Ordering::SeqCst);
        if at != 0 {
            each(at);
        }
    }
}

/// The spool path and flush interval of the recorder running in this process,
/// if any. A forked child sees none (the recording belongs to the parent).
pub(crate) fn live_spool() -> Option<(PathBuf, Duration)> {
    let live = LIVE_SPOOL.lock().unwrap_or_else(|e| e.into_inner());
    match &*live {
        Some((pid, path, flush)) if *pid == sys::getpid() && RUNNING.load(Ordering::SeqCst) => {
            Some((path.clone(), *flush))
        }
        _ => None,
    }
}

impl Guard {
    /// The engine this recording started with. The automatic choice may
    /// later move from the perf-event engine to per-thread CPU timers (see
    /// [`EngineChoice::Auto`]): [`warnings`](Self::warnings) then says so,
    /// and [`Stats::engine`] is the engine that ran last.
    pub fn engine(&self) -> Engine {
        self.inner.as_ref().map_or(Engine::Unknown, |r| r.engine)
    }

    /// The spool's path (of a rotating recording: its first segment's).
    pub fn path(&self) -> &Path {
        self.inner.as_ref().map_or(Path::new(""), |r| &r.path)
    }

    /// What did not go as configured so far, one sentence each, oldest
    /// first: the same sentences, in the same order, that
    /// [`Stats::warnings`] holds at the end, as far as the writer thread has
    /// found them (empty for a guard that has stopped).
    ///
    /// The writer thread publishes each warning after the step that found
    /// it, so this sees it within about one flush interval
    /// ([`RecorderBuilder::flush_interval`]): the engine refused and the one
    /// that ran instead, or kernel time refused, at once; the program taking
    /// the engine's signal or descriptors over, the spool's descriptor
    /// closed or reused (or a full disk: writing stopped), a rotation
    /// stepping over a segment name taken by another file, as they happen.
    /// Some are only known when the recording ends (off-CPU records lost,
    /// stacks the kernel refused to read): those appear in
    /// [`Stats::warnings`] (and reach [`RecorderBuilder::on_warning`]'s
    /// callback) during [`Guard::finish`].
    ///
    /// Cheap: a copy of a short list, taken under a lock that the writer
    /// thread holds only to append one string.
    pub fn warnings(&self) -> Vec<String> {
        self.inner.as_ref().map_or_else(Vec::new, |r| r.warnings.snapshot())
    }

    /// Stop, drain, write and sync; report what was recorded.
    ///
    /// If the spool stopped being writable while recording (a full disk, or
    /// the program closed the spool's descriptor or reused its number: the
    /// recorder then writes nothing more through it), the error is
    /// [`RecorderError::WriteStopped`] with the samples written before, those
    /// lost, and the warnings ([`Stats::warnings`]'s list).
    pub fn finish(mut self) -> Result<Stats, Error> {
        self.stop()
    }

    fn stop(&mut self) -> Result<Stats, Error> {
        let Some(run) = self.inner.take() else {
            return Err(Error::Recorder(RecorderError::NotRunning));
        };
        if sys::getpid() != run.pid {
            // A forked child: the recorder belongs to the parent; touch nothing.
            std::mem::forget(run);
            return Err(Error::Recorder(RecorderError::ForkedChild));
        }
        *PYTHON_TX.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *LIVE_SPOOL.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let res = if sys::gettid() == exit_request::writer_tid() {
            // On the writer thread: the program's threads had all ended, and
            // the writer, having finished the recording, is ending the
            // process; these are its exit handlers. It cannot join itself.
            let res = writer::take_gone_result().unwrap_or(Err(Error::Recorder(RecorderError::NotRunning)));
            std::mem::forget(run.join);
            res
        } else {
            let _ = run.tx.send(Control::Stop);
            match run.join.join() {
                Ok(r) => r,
                Err(_) => {
                    Err(Error::Recorder(RecorderError::WriterFailed { what: "panicked", source: None }))
                }
            }
        };
        PYTHON_INSIDE.store(false, Ordering::SeqCst);
        RUNNING.store(false, Ordering::SeqCst);
        let res = res.map_err(|e| e.with_path(&run.path));
        #[cfg(all(feature = "heap", feature = "pprof"))]
        if let Some(heap) = &run.heap_profile {
            let written = crate::heap::write_profile(heap);
            return res.and_then(|stats| written.map(|()| stats));
        }
        res
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.inner.is_some() {
            let _ = self.stop();
        }
    }
}

/// Benchmark support, with the `testing` feature only (not a stable API): the
/// signal handler's own running time.
#[cfg(feature = "testing")]
pub mod bench_support {
    /// Width of one histogram bucket in nanoseconds.
    pub const BUCKET_NS: u64 = super::handler::timing::BUCKET_NS;

    /// Turn handler timing on or off (off by default; costs one relaxed load).
    pub fn handler_timing(on: bool) {
        super::handler::timing::set(on)
    }

    /// Take and reset the histogram of handler times (`BUCKET_NS` per bucket;
    /// the last bucket collects everything slower).
    pub fn take_handler_times() -> Vec<u64> {
        super::handler::timing::take()
    }

    pub use super::handler::timing::Phase;

    /// Make the handler return after `phase` (`None`: run whole), for the
    /// per-phase cost breakdown; samples stopped early are not recorded.
    pub fn stop_after(phase: Option<Phase>) {
        super::handler::timing::set_stop_after(phase)
    }
}

#[cfg(feature = "testing")]
pub use modules::table_report;

/// For a library that interposes `sigaction` (spulse's preload library): not
/// part of the API. See `sys/sigaction.rs`, "Signals the program owns".
#[doc(hidden)]
pub mod interpose {
    use std::os::raw::c_int;

    pub use super::sys::sigaction::SigactionFn;

    /// Route the recorder's own `sigaction` calls to `f`, the C library's
    /// (found with `dlsym(RTLD_NEXT, ...)`), not to the interposer.
    pub fn set_real_sigaction(f: SigactionFn) {
        super::sys::sigaction::set_real_sigaction(f)
    }

    /// The interposed `sigaction`: `Some(rc)` when the recorder's handler
    /// holds `sig` and the program's action was kept to chain to instead;
    /// `None`: pass the call on.
    ///
    /// # Safety
    /// As `sigaction(2)`: `act` null or valid, `old` null or writable.
    pub unsafe fn sigaction(
        sig: c_int,
        act: *const libc::sigaction,
        old: *mut libc::sigaction,
    ) -> Option<c_int> {
        // SAFETY: the caller's contract.
        unsafe { super::handler::virtual_action(sig, act, old) }
    }

    pub use super::sys::sigmask::MaskFn;

    /// Let [`sigmask`] keep SIGTRAP out of the threads' real masks (called
    /// once, at load, by an interposer of `pthread_sigmask` and
    /// `sigprocmask`). False: no thread-specific key is usable for it; pass
    /// every call on.
    pub fn enable_virtual_mask() -> bool {
        super::sys::sigmask::enable()
    }

    /// The interposed `pthread_sigmask`/`sigprocmask`: `Some(rc)`, `real`'s
    /// result, when the call was made with SIGTRAP kept out of the real mask
    /// while the perf-event engine samples with it (see `sys/sigmask.rs`);
    /// `None`: pass the call on.
    ///
    /// # Safety
    /// As `pthread_sigmask(3)`; `real` is the C library's function.
    pub unsafe fn sigmask(
        real: MaskFn,
        how: c_int,
        set: *const libc::sigset_t,
        old: *mut libc::sigset_t,
    ) -> Option<c_int> {
        // SAFETY: the caller's contract.
        unsafe { super::sys::sigmask::virtual_mask(real, how, set, old) }
    }

    /// Whether the program blocks SIGTRAP on this thread while its real mask
    /// does not (an interposed `pthread_create` then gives the new thread
    /// the same flag, by [`inherit_blocks_trap`] in it).
    pub fn program_blocks_trap() -> bool {
        super::sys::sigmask::program_blocks_trap()
    }

    /// In a new thread whose creator's [`program_blocks_trap`] was true.
    pub fn inherit_blocks_trap() {
        super::sys::sigmask::inherit_blocks_trap()
    }
}

/// Called in a forked child (async-signal-safe: atomics only): the parent's
/// recorder is not running here.
pub(crate) fn forget_parent_recorder_after_fork() {
    RUNNING.store(false, Ordering::SeqCst);
    PYTHON_INSIDE.store(false, Ordering::SeqCst);
}

/// Mark that this process enters Python-runtime mode (a tag-6 record), for
/// embedders of CPython's perf trampoline. Call it before activating the
/// trampoline: it returns once the record is written after every sample taken
/// so far, so every sample that can see trampoline frames follows it. (It waits
/// for the writer thread: microseconds, or up to one flush of work.)
pub fn python_runtime_enter() -> Result<(), Error> {
    python_mark(true)
}

/// Mark that this process leaves Python-runtime mode (call it after the
/// trampoline is deactivated).
pub fn python_runtime_leave() -> Result<(), Error> {
    python_mark(false)
}

fn python_mark(entering: bool) -> Result<(), Error> {
    let tx = PYTHON_TX.lock().unwrap_or_else(|e| e.into_inner());
    let Some(tx) = tx.as_ref() else {
        return Err(Error::Recorder(RecorderError::NotRunning));
    };
    if PYTHON_INSIDE.swap(entering, Ordering::SeqCst) == entering {
        return Err(Error::Recorder(RecorderError::PythonModeAlready { entering }));
    }
    let (ack_tx, ack_rx) = mpsc::sync_channel(1);
    let gone = || Error::Recorder(RecorderError::WriterFailed { what: "is gone", source: None });
    let res = match tx.send(Control::Python { entering, ack: ack_tx }) {
        Ok(()) => ack_rx.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|_| Err(gone())),
        Err(_) => Err(gone()),
    };
    if res.is_err() {
        PYTHON_INSIDE.store(!entering, Ordering::SeqCst);
    }
    res
}

fn start_with(b: &RecorderBuilder, path: &Path) -> Result<Guard, Error> {
    if let Some(pid) = sys::preloaded::recorded_by_preload() {
        return Err(Error::Recorder(RecorderError::RecordedByPreload { pid }));
    }
    if RUNNING.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        return Err(Error::Recorder(RecorderError::AlreadyRunning));
    }
    match start_inner(b, path) {
        Ok(g) => Ok(g),
        Err(e) => {
            RUNNING.store(false, Ordering::SeqCst);
            Err(e)
        }
    }
}

fn start_inner(b: &RecorderBuilder, path: &Path) -> Result<Guard, Error> {
    let Checked { hz, kernel_time, off_cpu, engine: choice, path, rotation, flush } = b.check(path)?;
    let path = path.as_path();
    let period_ns = 1_000_000_000u64 / hz as u64;
    let interval_us = (1_000_000 + hz as u64 / 2) / hz as u64;
    let file = create_spool(path, b.mode, b.overwrite)?;
    let file_id = file.metadata().map_err(|e| Error::io(Some(path), e))?;
    let mut cleanup = Cleanup { path: Some(path.to_path_buf()), installed: Vec::new(), tx: None, join: None };
    // The header goes out as soon as the file exists, before any engine or
    // thread starts: a reader that opens the file while `start` runs (a `Tail`,
    // `spulse follow`) finds at most a few microseconds of an empty file, never
    // a header cut short. Every sample is taken later, and sample deltas are
    // signed anyway.
    let start_time_us = sys::now_us();
    let sink: Box<dyn writer::Sink> = Box::new(own_fd::SpoolFile::new(file));
    let mut out =
        SpoolWriter::new(sink, Header { start_time_us, interval_us }).map_err(|e| e.with_path(path))?;

    let pid = sys::getpid();
    let exe_path = std::fs::read_link("/proc/self/exe")
        .or_else(|_| std::env::current_exe())
        .map(|p| {
            use std::os::unix::ffi::OsStringExt;
            p.into_os_string().into_vec()
        })
        .unwrap_or_default();
    let dl = modules::dl_counters();
    let mut objects = modules::scan(&exe_path, &|_| false, true);
    let snapshot = modules::initial_snapshot(&objects, 0);
    let deferred = objects.iter_mut().find_map(|o| o.deferred.take());
    let (main_top, main_span) = sys::maps::main_stack_bounds();
    let tcb_block_offset = sys::tcb::stack_block_offset();
    let tcb_tid_offset = sys::tcb::tid_offset();
    let ncpu = sys::cpus_allowed();
    // The perf-stack engine never writes the handler's ring: a token one.
    let (ring, consumer) = if choice == EngineChoice::PerfStack {
        ring::Ring::new(2, 1)
    } else {
        ring::Ring::new(b.ring_capacity, b.max_stack_depth)
    };
    let shared = Arc::new(Shared {
        pid,
        writer_tid: AtomicU32::new(0),
        ring,
        caches: unwind::CachePool::new((2 * ncpu + 2).min(MAX_UNWIND_CACHES)),
        snapshot: handler::SnapshotCell::new(Box::new(snapshot)),
        bounds: StackBounds { main_top, main_span, tcb_block_offset, tcb_tid_offset },
        counters: Counters::default(),
        weight_cap: MAX_SIGNAL_WEIGHT,
        kernel_weight_milli: sys::perf::KERNEL_PERIOD_MILLI,
        names: handler::ThreadNames::default(),
        writer_boost: handler::WriterBoost::new(),
    });

    // The writer thread exists before any engine, so it can be left out of them.
    // The perf-stack engine's writer waits on its rings, and the off-CPU
    // mode's on its switch rings: its channel has an eventfd to wake it. The
    // others' waits on a futex word (`exit_request.rs`: no descriptor, so
    // none the program could put another file on).
    let candidates = engine_candidates(choice);
    let (tx, rx, wake) =
        writer::channel(candidates.contains(&EngineChoice::PerfStack) || off_cpu).map_err(|e| {
            Error::Recorder(RecorderError::WriterFailed {
                what: "could not be spawned (eventfd)",
                source: Some(e),
            })
        })?;
    let wake_fd = wake.as_ref().map(|w| {
        use std::os::fd::AsRawFd;
        w.as_raw_fd()
    });
    let (tid_tx, tid_rx) = mpsc::sync_channel::<u32>(1);
    exit_request::arm(wake_fd);
    let join =
        sys::sigmask::spawn_quiet(std::thread::Builder::new().name("spulse-writer".into()), move || {
            // Said when the thread ends, by a panic too.
            let _done = exit_request::WriterThread::started(sys::gettid());
            let _ = tid_tx.send(sys::gettid());
            writer::exit_when_program_gone(writer::main(rx, wake))
        })
        .map_err(|e| {
            Error::Recorder(RecorderError::WriterFailed { what: "could not be spawned", source: Some(e) })
        })?;
    cleanup.tx = Some(tx.clone());
    cleanup.join = Some(join);
    let exited = || Error::Recorder(RecorderError::WriterFailed { what: "exited at start", source: None });
    let writer_tid = tid_rx.recv().map_err(|_| exited())?;
    shared.writer_tid.store(writer_tid, Ordering::SeqCst);
    handler::publish(shared.clone());

    let mut reasons = Vec::new();
    let mut engine = None;
    let budget = fd_budget();
    for &c in candidates {
        let sig = if c == EngineChoice::PerfEvent { Signal::SIGTRAP } else { Signal::SIGPROF };
        // The perf-stack engine sends no signal: no handler.
        let install = if c == EngineChoice::PerfStack { Ok(false) } else { handler::install(sig) };
        match install {
            Ok(true) => cleanup.installed.push(sig),
            Ok(false) => {}
            Err(err) => {
                reasons.push(Error::Recorder(err));
                continue;
            }
        }
        let r = match c {
            EngineChoice::PerfStack => {
                let cfg = sys::perf_stack::StackConfig {
                    period_ns,
                    stack_copy: b.user_stack_copy,
                    data_pages: b.perf_stack_ring_pages,
                    watermark: b.perf_stack_watermark,
                };
                sys::perf_stack::StackEvents::start(cfg, writer_tid, wake_fd)
                    .map(engine::Engine::PerfStack)
                    .map_err(|source| RecorderError::EngineRefused {
                        what: "perf_event_open (task-clock, user registers and stack, mapped ring)",
                        source,
                    })
            }
            EngineChoice::PerfEvent => sys::perf::PerfEngine::start(period_ns, writer_tid, budget)
                .map(|p| engine::Engine::Perf(p, None))
                .map_err(|source| RecorderError::EngineRefused {
                    what: "perf_event_open (task-clock, sigtrap)",
                    source,
                }),
            EngineChoice::ThreadCpuTimer => sys::timer::ThreadTimers::start(period_ns, writer_tid)
                .map(engine::Engine::Threads)
                .map_err(|source| RecorderError::EngineRefused {
                    what: "per-thread CPU timers (timer_create)",
                    source,
                }),
            _ => {
                // Before arming: the first SI_KERNEL SIGPROF must already count as ours.
                handler::mark_process_timer_used();
                sys::timer::ProcessTimer::start(period_ns)
                    .map(engine::Engine::Process)
                    .map_err(|source| RecorderError::EngineRefused { what: "setitimer(ITIMER_PROF)", source })
            }
        };
        match r {
            Ok(e) => {
                engine = Some(e);
                break;
            }
            Err(err) => {
                reasons.push(Error::Recorder(err));
                // Nothing of this engine runs: give the signal back at once.
                if cleanup.installed.last() == Some(&sig) {
                    cleanup.installed.pop();
                    handler::restore(sig);
                }
            }
        }
    }
    let Some(engine) = engine else {
        // One engine asked for: its own error; several tried: all of them.
        return Err(match reasons.len() {
            1 => reasons.remove(0),
            _ => Error::Recorder(RecorderError::NoEngine(reasons)),
        });
    };
    let kind = engine.kind();
    let mut warnings: Vec<String> =
        reasons.iter().map(|r| format!("{r}; the {} engine ran instead", kind.name())).collect();
    // An engine that covers a new thread only when the writer next lists the
    // threads (per-thread timers, perf-stack events) keeps the shorter default
    // interval, so a new thread's unsampled start stays at most 50 ms.
    // The spool file is written at most this far apart (the interval asked
    // for, or the default's 100 ms), even where the writer ticks more often.
    let file_flush = flush;
    let flush = if b.flush_interval.is_none() && engine.needs_every_scan() {
        flush.min(PER_THREAD_ENGINE_FLUSH_INTERVAL)
    } else {
        flush
    };
    let kcfg = sys::perf_kernel::KernelConfig {
        period_ns: period_ns.saturating_mul(sys::perf::KERNEL_PERIOD_MILLI) / 1000,
        stack_copy: b.user_stack_copy,
        drain_interval_ns: flush.as_nanos().min(u64::MAX as u128) as u64,
    };
    let (engine, kernel_status) = start_kernel_time(engine, kernel_time, kcfg, writer_tid, budget);
    // Refused where the default only asks "where allowed" is the normal
    // unprivileged case (`Stats::kernel_time` says it); asked for by name
    // (builder or SPULSE_KERNEL_TIME=1), it is a deviation worth a warning.
    let asked =
        b.kernel_time == Some(true) || std::env::var("SPULSE_KERNEL_TIME").is_ok_and(|v| v.trim() == "1");
    if let KernelTime::Refused(why) = &kernel_status {
        if kernel_time && asked && kind == Engine::PerfEvent {
            warnings.push(format!("kernel time not sampled: {why}"));
        }
    }
    let mut engine = engine;
    if let Some(k) = engine.kernel_rings() {
        if k.missed > 0 {
            warnings.push(format!(
                "{} threads alive at start got no kernel-time events (descriptor budget {budget})",
                k.missed
            ));
        }
    }
    // The off-CPU mode's switch events, within what the engine left of the budget.
    let switches = if off_cpu {
        // The larger switch rings, unless they would take the locked memory
        // the perf-stack engine's rings of threads created later need.
        let large = engine.kind() != crate::Engine::PerfStack || sys::can_lock_memory();
        match sys::perf_switch::SwitchTracker::start(
            writer_tid,
            budget.saturating_sub(engine.descriptors()),
            large,
        ) {
            Ok(mut t) => {
                // The writer drains a quarter-full ring at once: on the
                // engine's epoll set if it has one, else on one of its own.
                let watched = match (engine.stack_events(), wake_fd) {
                    (Some(events), _) => t
                        .ring_fds()
                        .into_iter()
                        .try_for_each(|fd| events.watch(fd, sys::perf_stack::SWITCH_KEY)),
                    (None, Some(w)) => t.wait_with(w),
                    (None, None) => Ok(()),
                };
                if let Err(e) = watched {
                    warnings.push(format!(
                        "off-CPU switch records are drained only every flush interval (the writer cannot wait \
                         on them: {e}); a program switching more than about 50,000 times a second per CPU \
                         loses some"
                    ));
                }
                if t.missed_threads() > 0 {
                    warnings.push(format!(
                        "{} threads alive at start got no off-CPU events (descriptor budget {budget})",
                        t.missed_threads()
                    ));
                }
                Some(t)
            }
            Err(e) => {
                warnings
                    .push(format!("off-CPU time not recorded: the context-switch events were refused: {e}"));
                None
            }
        }
    } else {
        None
    };
    let descriptors = engine.descriptors() + switches.as_ref().map_or(0, |t| t.descriptors());
    // The automatic choice may leave the perf-event engine for per-thread
    // timers if the program turns out to switch context often.
    let adapt = (choice == EngineChoice::Auto && kind == Engine::PerfEvent)
        .then(|| writer::Adapt::new(period_ns, writer_tid, b.flush_interval.is_none()));
    let needs_sampler =
        kind == Engine::PerfStack || kernel_status == KernelTime::Sampled || switches.is_some();
    // From here on signals may be pending: if a later step fails, the handler
    // stays installed (it ignores our stray signals) rather than exposing them to
    // the default disposition, which would kill the process.
    cleanup.installed.clear();
    let mut table = modules::ModuleTable::default();
    let refs: Vec<&modules::LoadedObject> = objects.iter().collect();
    writer::define_objects(&mut out, &mut table, pid, &refs, 0)?;
    out.flush()?;
    let log = Arc::new(warnings::WarningLog::default());
    let state = WriterState {
        shared,
        consumer: Some(consumer),
        out,
        table,
        engine,
        exe_path,
        generation: 0,
        dl,
        interval: flush,
        file_flush,
        started: Instant::now(),
        pid,
        sync_at_finish: b.sync_at_finish,
        kernel_time: kernel_status,
        rotation: rotation
            .map(|plan| writer::Rotation::new(plan, path, &file_id, b.mode, b.overwrite, interval_us)),
        stack_sampler: needs_sampler.then(|| stack_sampler::StackSampler::new(b.max_stack_depth)),
        off_cpu: switches.map(|t| writer::OffCpu::new(t, b.user_stack_copy.max(OFF_CPU_STACK_COPY))),
        adapt,
        #[cfg(feature = "heap")]
        heap: if b.heap_events {
            writer::HeapEvents::begin().map_err(|w| warnings.push(w)).ok()
        } else {
            None
        },
        own_code: handler::return_trampoline(),
        warnings,
        publisher: warnings::Publisher::new(log.clone(), b.on_warning.clone()),
        path: path.to_path_buf(),
        descriptors,
        table_memory: objects.iter().fold(Default::default(), |m, o| m.add(o.table_memory)),
        deferred,
    };
    tx.send(Control::Start(Box::new(state))).map_err(|_| exited())?;
    let join = cleanup.join.take().expect("writer thread handle");
    cleanup.disarm();
    *PYTHON_TX.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx.clone());
    PYTHON_INSIDE.store(false, Ordering::SeqCst);
    *LIVE_SPOOL.lock().unwrap_or_else(|e| e.into_inner()) = Some((pid, path.to_path_buf(), file_flush));
    Ok(Guard {
        inner: Some(Running {
            tx,
            join,
            pid,
            path: path.to_path_buf(),
            engine: kind,
            warnings: log,
            #[cfg(all(feature = "heap", feature = "pprof"))]
            heap_profile: b.heap_profile.clone(),
        }),
    })
}

/// Add the kernel-time rings to a perf engine when asked and allowed; what
/// came of it. They may use what the user-time events left of `budget`.
fn start_kernel_time(
    engine: engine::Engine,
    wanted: bool,
    cfg: sys::perf_kernel::KernelConfig,
    writer_tid: u32,
    budget: usize,
) -> (engine::Engine, KernelTime) {
    match engine {
        engine::Engine::Perf(p, _) if wanted => {
            let left = budget.saturating_sub(p.descriptors());
            match sys::perf_kernel::KernelRings::start(cfg, writer_tid, left) {
                Ok(k) => (engine::Engine::Perf(p, Some(k)), KernelTime::Sampled),
                Err(e) => (
                    engine::Engine::Perf(p, None),
                    KernelTime::Refused(format!(
                        "kernel-mode perf_event_open (task-clock, exclude_user, per CPU): {e}"
                    )),
                ),
            }
        }
        e @ engine::Engine::Perf(..) => (e, KernelTime::Off),
        e @ engine::Engine::PerfStack(_) if wanted => {
            (e, KernelTime::Refused("the perf-stack engine samples user time only".into()))
        }
        e @ engine::Engine::PerfStack(_) => (e, KernelTime::Off),
        e => (e, KernelTime::Unmarked),
    }
}

/// The most perf-event descriptors a recorder may hold: an eighth of the soft
/// `RLIMIT_NOFILE` at start, so that the program keeps the rest. The
/// user-time events take one per thread alive at start, the kernel-time
/// events one per thread alive at start and CPU; threads created later
/// inherit their creator's events and take none.
fn fd_budget() -> usize {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct we pass.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 { rl.rlim_cur } else { 1024 };
    (soft.min(1 << 20) / 8) as usize
}

/// Undoes a partial start: withdraws the state, restores signal dispositions
/// installed by this start, stops the writer thread and removes the file.
struct Cleanup {
    path: Option<PathBuf>,
    installed: Vec<Signal>,
    tx: Option<ControlSender>,
    join: Option<JoinHandle<Result<Stats, Error>>>,
}

impl Cleanup {
    fn disarm(&mut self) {
        self.path = None;
        self.installed.clear();
        self.tx = None;
        self.join = None;
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.path.is_none() && self.join.is_none() {
            return;
        }
        let _ = handler::unpublish();
        for &sig in &self.installed {
            handler::restore(sig);
        }
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Control::Abort);
        }
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The engines tried, in order, for `choice`.
fn engine_candidates(choice: EngineChoice) -> &'static [EngineChoice] {
    match choice {
        // A Go program's runtime takes every signal for itself (it installs
        // its handlers by raw system calls, over ours): a SIGTRAP or SIGPROF
        // of ours then reaches the Go runtime, which dies of it ("SIGTRAP:
        // trace trap", "unexpected return pc"). Only the perf-stack engine
        // sends none.
        EngineChoice::Auto if sys::go_program() => &[EngineChoice::PerfStack],
        // Under a debugger (`gdb`, `strace`: a tracer at start), every
        // signal of ours stops the program for the tracer, and gdb takes a
        // SIGTRAP for its own: no signal then, else SIGPROF, which debuggers
        // pass on without stopping.
        EngineChoice::Auto if sys::traced() => {
            &[EngineChoice::PerfStack, EngineChoice::ThreadCpuTimer, EngineChoice::ProcessTimer]
        }
        EngineChoice::Auto => {
            &[EngineChoice::PerfEvent, EngineChoice::ThreadCpuTimer, EngineChoice::ProcessTimer]
        }
        EngineChoice::PerfEvent => &[EngineChoice::PerfEvent],
        EngineChoice::ThreadCpuTimer => &[EngineChoice::ThreadCpuTimer],
        EngineChoice::ProcessTimer => &[EngineChoice::ProcessTimer],
        EngineChoice::PerfStack => &[EngineChoice::PerfStack],
    }
}
