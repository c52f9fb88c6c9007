//! The recorder: `spulse::start("out.spool")` and [`Recorder::builder`] sample
//! every thread's CPU time with a signal handler, and a writer thread turns the
//! samples into a spool.
//!
//! Pieces: `engine/` (who sends the signal: perf events, per-thread CPU timers,
//! the process itimer), `signal.rs` (the handler and every piece of unsafe code it
//! runs), `ring.rs` (handler -> writer queue), `unwind.rs` (framehop caches and the
//! walk), `modules.rs` (loaded objects, generations, unwinder snapshots),
//! `intern.rs` and `writer_thread.rs` (the spool side). This file holds the public
//! API: builder, guard, statistics, Python-runtime marks.
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
//!   profiled process (not a fork+exec); see `engine/timer.rs`.

mod engine;
mod intern;
mod modules;
mod ring;
mod signal;
mod unwind;
mod writer_thread;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::{Engine, Error, Header, SpoolWriter};
use writer_thread::{Control, WriterState};

/// Which sampling engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum EngineChoice {
    /// perf events, else per-thread CPU timers, else the process timer.
    #[default]
    Auto,
    /// Per-thread `perf_event_open` task-clock events (SIGTRAP); fail if refused.
    PerfEvent,
    /// Per-thread CPU-clock POSIX timers (SIGPROF, overrun-weighted).
    ThreadCpuTimer,
    /// `setitimer(ITIMER_PROF)` (SIGPROF).
    ProcessTimer,
}

/// Samples that were not written, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LostSamples {
    /// The ring was full (the writer fell behind).
    pub ring_full: u64,
    /// Every unwinder cache was in use by other handlers.
    pub no_cache: u64,
    /// Not even the interrupted pc could be read.
    pub unwind_failed: u64,
    /// Timer overruns beyond the per-signal cap (64 intervals).
    pub overrun_capped: u64,
}

impl LostSamples {
    /// All lost samples.
    pub fn total(&self) -> u64 {
        self.ring_full + self.no_cache + self.unwind_failed + self.overrun_capped
    }
}

/// What a recording produced.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Sample records written (a timer signal with overruns counts 1 + overrun).
    pub samples_written: u64,
    /// Samples lost, by reason.
    pub samples_lost: LostSamples,
    /// Profiling signals handled while recording.
    pub signals: u64,
    /// Stacks whose unwinding stopped before the root (marked truncated).
    pub truncated_stacks: u64,
    /// Of those, samples on a stack the handler could not prove mapped (leaf only).
    pub unknown_stacks: u64,
    /// Size of the spool in bytes.
    pub bytes: u64,
    /// The engine that ran.
    pub engine: Engine,
    /// How long the recorder ran.
    pub duration: Duration,
    /// Module-table generations seen (1 + the number of changes).
    pub module_generations: u64,
}

impl Stats {
    /// Total samples lost.
    pub fn lost(&self) -> u64 {
        self.samples_lost.total()
    }
}

/// Counters the handler updates.
#[derive(Default)]
pub(crate) struct Counters {
    pub signals: AtomicU64,
    pub lost_ring_full: AtomicU64,
    pub lost_no_cache: AtomicU64,
    pub lost_unwind_failed: AtomicU64,
    pub overrun_capped: AtomicU64,
    pub truncated: AtomicU64,
    pub foreign_stack: AtomicU64,
}

/// Stack bounds the handler trusts (see `signal.rs`).
pub(crate) struct StackBounds {
    pub main_top: u64,
    pub main_span: u64,
    pub tcb_block_offset: Option<usize>,
    pub tcb_tid_offset: Option<usize>,
}

/// State shared by the handler and the writer thread.
pub(crate) struct Shared {
    pub pid: u32,
    pub writer_tid: AtomicU32,
    pub ring: ring::Ring,
    pub caches: unwind::CachePool,
    pub snapshot: signal::SnapshotCell,
    pub bounds: StackBounds,
    pub counters: Counters,
    pub weight_cap: u32,
}

/// Entry point for configuring a recorder.
#[derive(Debug)]
pub struct Recorder(());

impl Recorder {
    /// A builder with the defaults (999 Hz or `SPULSE_FREQUENCY`, depth 128,
    /// 2048 ring slots, 50 ms flush interval, automatic engine, mode 0600).
    pub fn builder() -> RecorderBuilder {
        RecorderBuilder::default()
    }
}

/// Recorder settings; [`RecorderBuilder::start`] starts recording.
///
/// ```no_run
/// use std::time::Duration;
///
/// let guard = spulse::Recorder::builder()
///     .frequency_hz(4000)
///     .max_stack_depth(256)
///     .flush_interval(Duration::from_millis(20))
///     .start("out.spool")?;
/// // ... the work to profile ...
/// let stats = guard.finish()?;
/// println!("{} samples ({} lost) by {}", stats.samples_written, stats.lost(), stats.engine);
/// # Ok::<(), spulse::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RecorderBuilder {
    frequency_hz: Option<u32>,
    max_stack_depth: usize,
    ring_capacity: usize,
    flush_interval: Duration,
    engine: EngineChoice,
    mode: u32,
}

impl Default for RecorderBuilder {
    fn default() -> Self {
        RecorderBuilder {
            frequency_hz: None,
            max_stack_depth: 128,
            ring_capacity: 2048,
            flush_interval: Duration::from_millis(50),
            engine: EngineChoice::Auto,
            mode: 0o600,
        }
    }
}

/// Default sampling frequency.
pub const DEFAULT_FREQUENCY_HZ: u32 = 999;

impl RecorderBuilder {
    /// Samples per second of each thread's CPU time (default 999, or the
    /// `SPULSE_FREQUENCY` environment variable). Must be 1..=100000.
    pub fn frequency_hz(mut self, hz: u32) -> Self {
        self.frequency_hz = Some(hz);
        self
    }
    /// Most frames kept per sample (1..=4095); deeper stacks keep the leaf-most
    /// frames under a truncated-stack marker.
    pub fn max_stack_depth(mut self, depth: usize) -> Self {
        self.max_stack_depth = depth;
        self
    }
    /// Samples the ring holds between flushes (rounded up to a power of two).
    pub fn ring_capacity(mut self, slots: usize) -> Self {
        self.ring_capacity = slots;
        self
    }
    /// How often the writer thread drains the ring and appends to the spool.
    pub fn flush_interval(mut self, interval: Duration) -> Self {
        self.flush_interval = interval;
        self
    }
    /// Which sampling engine to use (default: the best one the system allows).
    pub fn engine(mut self, engine: EngineChoice) -> Self {
        self.engine = engine;
        self
    }
    /// Permission bits of the new spool (default 0600).
    pub fn mode(mut self, mode: u32) -> Self {
        self.mode = mode;
        self
    }

    /// Create the spool at `path` (which must not exist) and start recording.
    pub fn start(&self, path: impl AsRef<Path>) -> Result<Guard, Error> {
        start_with(self, path.as_ref())
    }
}

/// Start recording to `path` with the defaults.
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
    tx: Sender<Control>,
    join: JoinHandle<Result<Stats, Error>>,
    pid: u32,
    path: PathBuf,
    engine: Engine,
}

static RUNNING: AtomicBool = AtomicBool::new(false);
static PYTHON_TX: Mutex<Option<Sender<Control>>> = Mutex::new(None);
static PYTHON_INSIDE: AtomicBool = AtomicBool::new(false);

impl Guard {
    /// The engine sampling this recording.
    pub fn engine(&self) -> Engine {
        self.inner.as_ref().map_or(Engine::Unknown, |r| r.engine)
    }

    /// The spool's path.
    pub fn path(&self) -> &Path {
        self.inner.as_ref().map_or(Path::new(""), |r| &r.path)
    }

    /// Stop, drain, write and sync; report what was recorded.
    pub fn finish(mut self) -> Result<Stats, Error> {
        self.stop()
    }

    fn stop(&mut self) -> Result<Stats, Error> {
        let Some(run) = self.inner.take() else {
            return Err(Error::Recorder("recorder already stopped".into()));
        };
        // SAFETY: getpid has no preconditions.
        if unsafe { libc::getpid() } as u32 != run.pid {
            // A forked child: the recorder belongs to the parent; touch nothing.
            std::mem::forget(run);
            return Err(Error::Recorder(
                "this recorder belongs to the parent process (guard used after fork)".into(),
            ));
        }
        *PYTHON_TX.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let _ = run.tx.send(Control::Stop);
        let res = match run.join.join() {
            Ok(r) => r,
            Err(_) => Err(Error::Recorder("the spulse writer thread panicked".into())),
        };
        PYTHON_INSIDE.store(false, Ordering::SeqCst);
        RUNNING.store(false, Ordering::SeqCst);
        res.map_err(|e| match e {
            Error::Io { path: None, source } => Error::Io { path: Some(run.path.clone()), source },
            other => other,
        })
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.inner.is_some() {
            let _ = self.stop();
        }
    }
}

/// Benchmark support (not a stable API): the signal handler's own running time.
#[doc(hidden)]
pub mod bench_support {
    /// Width of one histogram bucket in nanoseconds.
    pub const BUCKET_NS: u64 = super::signal::TIMING_BUCKET_NS;

    /// Turn handler timing on or off (off by default; costs one relaxed load).
    pub fn handler_timing(on: bool) {
        super::signal::set_timing(on)
    }

    /// Take and reset the histogram of handler times (`BUCKET_NS` per bucket;
    /// the last bucket collects everything slower).
    pub fn take_handler_times() -> Vec<u64> {
        super::signal::take_timing()
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
        return Err(Error::Recorder("no spulse recorder is running".into()));
    };
    if PYTHON_INSIDE.swap(entering, Ordering::SeqCst) == entering {
        return Err(Error::Recorder(format!(
            "python_runtime_{}: the process is {} Python-runtime mode already",
            if entering { "enter" } else { "leave" },
            if entering { "in" } else { "out of" }
        )));
    }
    let (ack_tx, ack_rx) = mpsc::sync_channel(1);
    let gone = || Error::Recorder("the spulse writer thread is gone".into());
    let res = match tx.send(Control::Python { entering, ack: ack_tx }) {
        Ok(()) => ack_rx.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|_| Err(gone())),
        Err(_) => Err(gone()),
    };
    if res.is_err() {
        PYTHON_INSIDE.store(!entering, Ordering::SeqCst);
    }
    res
}

fn frequency(b: &RecorderBuilder) -> Result<u32, Error> {
    let hz = match b.frequency_hz {
        Some(hz) => hz,
        None => match std::env::var("SPULSE_FREQUENCY") {
            Ok(v) => v.trim().parse::<u32>().map_err(|_| {
                Error::Recorder(format!("SPULSE_FREQUENCY={v:?} is not a whole number of samples per second"))
            })?,
            Err(_) => DEFAULT_FREQUENCY_HZ,
        },
    };
    if hz == 0 || hz > 100_000 {
        return Err(Error::Recorder(format!("sampling frequency {hz} Hz is outside 1..=100000")));
    }
    Ok(hz)
}

fn start_with(b: &RecorderBuilder, path: &Path) -> Result<Guard, Error> {
    if RUNNING.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_err() {
        return Err(Error::Recorder(
            "a spulse recorder is already running in this process; finish it before starting another".into(),
        ));
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
    let hz = frequency(b)?;
    if b.max_stack_depth == 0 || b.max_stack_depth >= crate::format::limits::MAX_STACK_DEPTH as usize {
        return Err(Error::Recorder(format!("max_stack_depth {} is outside 1..=4095", b.max_stack_depth)));
    }
    if b.flush_interval.is_zero() {
        return Err(Error::Recorder("flush_interval must be positive".into()));
    }
    let period_ns = 1_000_000_000u64 / hz as u64;
    let interval_us = (1_000_000 + hz as u64 / 2) / hz as u64;
    let file: File = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(b.mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::Io { path: Some(path.to_path_buf()), source: e })?;
    let mut cleanup = Cleanup { path: Some(path.to_path_buf()), installed: Vec::new(), tx: None, join: None };
    // The header goes out as soon as the file exists, before any engine or
    // thread starts: a reader that opens the file while `start` runs (a `Tail`,
    // `spulse follow`) finds at most a few microseconds of an empty file, never
    // a header cut short. Every sample is taken later, and sample deltas are
    // signed anyway.
    let start_time_us = signal::now_us();
    let mut out = SpoolWriter::new(file, Header { start_time_us, interval_us }).map_err(|e| match e {
        Error::Io { path: None, source } => Error::Io { path: Some(path.to_path_buf()), source },
        other => other,
    })?;

    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    let exe_path = std::fs::read_link("/proc/self/exe")
        .or_else(|_| std::env::current_exe())
        .map(|p| {
            use std::os::unix::ffi::OsStringExt;
            p.into_os_string().into_vec()
        })
        .unwrap_or_default();
    let dl = modules::dl_counters();
    let objects = modules::scan(&exe_path, &|_| false);
    let snapshot = modules::initial_snapshot(&objects, 0);
    let (main_top, main_span) = signal::main_stack_bounds();
    let tcb_block_offset = signal::probe_tcb_stack_offset();
    let tcb_tid_offset = signal::probe_tcb_tid_offset();
    let ncpu = std::thread::available_parallelism().map_or(2, |n| n.get());
    let shared = Arc::new(Shared {
        pid,
        writer_tid: AtomicU32::new(0),
        ring: ring::Ring::new(b.ring_capacity, b.max_stack_depth),
        caches: unwind::CachePool::new((2 * ncpu + 2).min(64)),
        snapshot: signal::SnapshotCell::new(Box::new(snapshot)),
        bounds: StackBounds { main_top, main_span, tcb_block_offset, tcb_tid_offset },
        counters: Counters::default(),
        weight_cap: 64,
    });

    // The writer thread exists before any engine, so it can be left out of them.
    let (tx, rx) = mpsc::channel::<Control>();
    let (tid_tx, tid_rx) = mpsc::sync_channel::<u32>(1);
    let join = std::thread::Builder::new()
        .name("spulse-writer".into())
        .spawn(move || {
            let _ = tid_tx.send(signal::gettid());
            writer_thread::main(rx)
        })
        .map_err(|e| Error::Recorder(format!("cannot spawn the spulse writer thread: {e}")))?;
    cleanup.tx = Some(tx.clone());
    cleanup.join = Some(join);
    let writer_tid =
        tid_rx.recv().map_err(|_| Error::Recorder("the spulse writer thread exited at start".into()))?;
    shared.writer_tid.store(writer_tid, Ordering::SeqCst);
    signal::publish(shared.clone());

    let candidates: &[EngineChoice] = match b.engine {
        EngineChoice::Auto => {
            &[EngineChoice::PerfEvent, EngineChoice::ThreadCpuTimer, EngineChoice::ProcessTimer]
        }
        EngineChoice::PerfEvent => &[EngineChoice::PerfEvent],
        EngineChoice::ThreadCpuTimer => &[EngineChoice::ThreadCpuTimer],
        EngineChoice::ProcessTimer => &[EngineChoice::ProcessTimer],
    };
    let mut reasons = Vec::new();
    let mut engine = None;
    for &c in candidates {
        let sig = if c == EngineChoice::PerfEvent { Signal::SIGTRAP } else { Signal::SIGPROF };
        match signal::install(sig) {
            Ok(true) => cleanup.installed.push(sig),
            Ok(false) => {}
            Err(msg) => {
                reasons.push(msg);
                continue;
            }
        }
        let r = match c {
            EngineChoice::PerfEvent => engine::perf::PerfEngine::start(period_ns, writer_tid)
                .map(engine::Engine::Perf)
                .map_err(|e| format!("perf_event_open (task-clock, sigtrap) was refused: {e}")),
            EngineChoice::ThreadCpuTimer => engine::timer::ThreadTimers::start(period_ns, writer_tid)
                .map(engine::Engine::Threads)
                .map_err(|e| format!("per-thread CPU timers (timer_create) were refused: {e}")),
            _ => engine::timer::ProcessTimer::start(period_ns)
                .map(engine::Engine::Process)
                .map_err(|e| format!("setitimer(ITIMER_PROF) was refused: {e}")),
        };
        match r {
            Ok(e) => {
                engine = Some(e);
                break;
            }
            Err(msg) => {
                reasons.push(msg);
                // Nothing of this engine runs: give the signal back at once.
                if cleanup.installed.last() == Some(&sig) {
                    cleanup.installed.pop();
                    signal::restore(sig);
                }
            }
        }
    }
    let Some(engine) = engine else {
        return Err(Error::Recorder(format!("cannot start sampling: {}", reasons.join("; "))));
    };
    let kind = engine.kind();
    // From here on signals may be pending: if a later step fails, the handler
    // stays installed (it ignores our stray signals) rather than exposing them to
    // the default disposition, which would kill the process.
    cleanup.installed.clear();
    let mut table = modules::ModuleTable::default();
    let refs: Vec<&modules::LoadedObject> = objects.iter().collect();
    writer_thread::define_objects(&mut out, &mut table, pid, &refs, 0)?;
    out.flush()?;
    let state = WriterState {
        shared,
        out,
        table,
        engine,
        exe_path,
        generation: 0,
        dl,
        interval: b.flush_interval,
        started: Instant::now(),
        pid,
    };
    tx.send(Control::Start(Box::new(state)))
        .map_err(|_| Error::Recorder("the spulse writer thread exited at start".into()))?;
    let join = cleanup.join.take().expect("writer thread handle");
    cleanup.disarm();
    *PYTHON_TX.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx.clone());
    PYTHON_INSIDE.store(false, Ordering::SeqCst);
    Ok(Guard { inner: Some(Running { tx, join, pid, path: path.to_path_buf(), engine: kind }) })
}

/// Undoes a partial start: withdraws the state, restores signal dispositions
/// installed by this start, stops the writer thread and removes the file.
struct Cleanup {
    path: Option<PathBuf>,
    installed: Vec<Signal>,
    tx: Option<Sender<Control>>,
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
        let _ = signal::unpublish();
        for &sig in &self.installed {
            signal::restore(sig);
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
