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
//! unwinding), `modules.rs` (loaded objects, generations,
//! unwinder snapshots), `cfi_check.rs` (which unwind tables the handler may be
//! handed) and `cfi_cache.rs` (its verdicts, kept per library build), `intern.rs` and `writer_thread.rs` (the spool side). This file holds
//! the public API: builder, guard, statistics, Python-runtime marks, and the
//! start sequence.
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

mod cfi_cache;
mod cfi_check;
mod engine;
mod handler;
mod intern;
pub(crate) mod modules;
mod own_fd;
mod stack_sampler;
mod sys;
mod writer_thread;

use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::{Engine, Error, Header, RecorderError, SpoolWriter};
use handler::{ring, unwind, Counters, Shared, StackBounds};
use writer_thread::{Control, ControlSender, WriterState};

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
    /// Opt-in, never chosen by `Auto`: per-thread `perf_event_open` task-clock
    /// events (user time) that copy the user registers and the top of the
    /// user stack ([`RecorderBuilder::user_stack_copy`]) into a ring mapped
    /// from each event; no signal and no handler: the writer thread unwinds
    /// the copies. Threads that block signals are sampled too; threads created
    /// after start are covered from the next flush on. Fails if refused.
    PerfStack,
}

/// Samples that were not written, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LostSamples {
    /// The ring was full (the writer fell behind; perf-stack engine: a
    /// thread's ring in the kernel was, as the kernel reports).
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

/// Whether system CPU time (periods that end in kernel mode) was sampled.
///
/// The spool cannot say which of these applied (a recording with no kernel-mode
/// sample may just have made no system calls), so [`Stats`] does.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelTime {
    /// Sampled: system CPU time is sampled at 1/8.618 of the rate, each
    /// sample weighing 8 or 9 intervals, 8.618 on average (a period of the
    /// kernel-time event ends every 8.618 sampling periods of the thread's
    /// running time, in user mode too, where its timer is pure cost), as a sample whose leaf is a
    /// kernel-mode absolute frame (address 0: the kernel function is not
    /// known) on top of the user stack that entered the kernel. The events
    /// send no signal: the kernel copies the user registers and the top of
    /// the user stack (`user_stack_copy` bytes) into a ring per CPU, and the
    /// writer thread unwinds them.
    Sampled,
    /// User time only: switched off ([`RecorderBuilder::kernel_time`] or
    /// `SPULSE_KERNEL_TIME=0`).
    Off,
    /// User time only: kernel-mode counting could not be set up, because the
    /// kernel refused it (usually `perf_event_paranoid` >= 2 without
    /// `CAP_PERFMON`), or its descriptors did not fit the recorder's
    /// descriptor budget, or the engine is the perf-stack engine, which
    /// samples user time only; the reason.
    Refused(String),
    /// The timer engines count user and system time alike and cannot tell
    /// them apart: system time is in the samples, with no kernel-mode leaf.
    Unmarked,
}

impl std::fmt::Display for KernelTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelTime::Sampled => f.write_str("sampled (kernel-mode leaf frames)"),
            KernelTime::Off => f.write_str("not sampled (switched off)"),
            KernelTime::Refused(why) => write!(f, "not sampled ({why})"),
            KernelTime::Unmarked => f.write_str("sampled with user time, not told apart (timer engine)"),
        }
    }
}

/// What a recording produced.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Sample records written (a timer signal with overruns counts 1 + overrun).
    pub samples_written: u64,
    /// Samples lost, by reason.
    pub samples_lost: LostSamples,
    /// Profiling signals handled while recording (perf-stack engine: samples
    /// the kernel wrote into the rings).
    pub signals: u64,
    /// Stacks whose unwinding stopped before the root (marked truncated).
    pub truncated_stacks: u64,
    /// Of those, samples on a stack the handler could not prove mapped (leaf
    /// only; perf-stack engine: samples that came without registers or stack
    /// bytes).
    pub unknown_stacks: u64,
    /// Size of the spool in bytes (with rotation: of all segments written,
    /// deleted ones included).
    pub bytes: u64,
    /// The engine that ran.
    pub engine: Engine,
    /// How long the recorder ran.
    pub duration: Duration,
    /// Module-table generations seen (1 + the number of changes).
    pub module_generations: u64,
    /// Threads of the process seen while recording (found in `/proc/self/task`
    /// at each flush, or in a sample), not counting the recorder's own thread.
    pub threads_seen: u64,
    /// Of those, threads that never got a sample: threads that used no CPU time
    /// while recording, and threads that block the profiling signal (which
    /// therefore cannot be sampled; see `threads_blocking_signal`).
    pub threads_never_sampled: u64,
    /// Threads seen blocking the engine's profiling signal (`SigBlk` in
    /// `/proc/self/task/<tid>/status` when the thread was first seen or at the
    /// end). Their CPU time is missing from the profile. Always 0 with the
    /// perf-stack engine, which sends no signal.
    pub threads_blocking_signal: u64,
    /// Whether system CPU time was sampled, and if not, why.
    pub kernel_time: KernelTime,
    /// Sample intervals whose period ended in kernel mode (written with a
    /// kernel leaf), counted by weight: a kernel-time sample stands for 8 or 9.
    pub kernel_samples: u64,
    /// Threads alive at start that got no kernel-time events (the
    /// descriptor budget ran out; threads they create later have none
    /// either): only their user time was sampled.
    pub threads_without_kernel_time: u64,
    /// Kernel-time samples taken while the kernel returned from the
    /// recorder's own signal handler, by weight: the profiler's cost, not
    /// the program's, so dropped (never written).
    pub own_samples_dropped: u64,
    /// Perf-event descriptors the engine held: at most an eighth of the
    /// soft `RLIMIT_NOFILE` at start (the descriptor budget; see
    /// [`RecorderBuilder::engine`]).
    pub descriptors: u64,
    /// What did not go as configured, one sentence each: an engine refused
    /// and the one that ran instead, kernel time refused, threads left
    /// without events, the profiling signal taken over by the program.
    /// Empty when everything ran as asked. `spulse record` prints them.
    pub warnings: Vec<String>,
    /// Spool files written: 1, or with [`RecorderBuilder::rotate`] the number
    /// of segments created (deleted ones included).
    pub segments_written: u64,
    /// Segments deleted by [`RecorderBuilder::retain`].
    pub segments_deleted: u64,
    /// CPU time of the recorder's writer thread (draining the ring, interning
    /// stacks, writing, its periodic checks): the part of the profiler's cost
    /// spent outside the sampled threads.
    pub writer_cpu: Duration,
    /// Bytes of unwind tables (`.eh_frame`, `.eh_frame_hdr`) copied into the
    /// recorder's memory for the signal handler's unwinder, summed over the
    /// objects loaded while recording: every library's tables, and the main
    /// executable's search table when it had to be rebuilt (see
    /// `src/recorder/cfi_check.rs`). Never the executable's `.eh_frame`.
    pub unwind_tables_copied: u64,
    /// Bytes of unwind tables the handler's unwinder reads where they are
    /// mapped, not copied: the main executable's (it stays mapped, read-only,
    /// for the life of the process). Not part of the recorder's memory.
    pub unwind_tables_mapped: u64,
}

impl Stats {
    /// Total samples lost.
    pub fn lost(&self) -> u64 {
        self.samples_lost.total()
    }
}

/// Entry point for configuring a recorder.
#[derive(Debug)]
pub struct Recorder(());

impl Recorder {
    /// A builder with the defaults (999 Hz or `SPULSE_FREQUENCY`, depth 128,
    /// 2048 ring slots, 100 ms flush interval, automatic engine, mode 0600).
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
    /// As set (`None`: the default, or the rotation interval if shorter).
    flush_interval: Option<Duration>,
    engine: EngineChoice,
    kernel_time: Option<bool>,
    mode: u32,
    overwrite: bool,
    sync_at_finish: bool,
    rotate: Option<Duration>,
    retain: Option<usize>,
    user_stack_copy: u32,
    perf_stack_ring_pages: usize,
    perf_stack_watermark: bool,
    /// Whether the `SPULSE_*` environment variables apply (false for the
    /// `http` endpoint's own temporary windows).
    environment: bool,
    /// Where `finish` writes the heap profile (`spulse::heap`).
    #[cfg(all(feature = "heap", feature = "pprof"))]
    heap_profile: Option<PathBuf>,
}

impl Default for RecorderBuilder {
    fn default() -> Self {
        RecorderBuilder {
            frequency_hz: None,
            max_stack_depth: 128,
            ring_capacity: 2048,
            flush_interval: None,
            engine: EngineChoice::Auto,
            kernel_time: None,
            mode: 0o600,
            overwrite: false,
            sync_at_finish: true,
            rotate: None,
            retain: None,
            user_stack_copy: DEFAULT_USER_STACK_COPY,
            perf_stack_ring_pages: DEFAULT_PERF_STACK_RING_PAGES,
            perf_stack_watermark: true,
            environment: true,
            #[cfg(all(feature = "heap", feature = "pprof"))]
            heap_profile: None,
        }
    }
}

/// Default [`RecorderBuilder::user_stack_copy`]: 16 KiB.
pub const DEFAULT_USER_STACK_COPY: u32 = 16 << 10;
/// Default [`RecorderBuilder::perf_stack_ring_pages`]: 64 pages (256 KiB).
pub const DEFAULT_PERF_STACK_RING_PAGES: usize = 64;

/// Default sampling frequency.
pub const DEFAULT_FREQUENCY_HZ: u32 = 999;

/// How often the writer drains the ring and appends to the spool by default.
const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(100);

/// The default flush interval of the engines that start sampling a new thread
/// at the writer's next tick (per-thread CPU timers, perf-stack).
const PER_THREAD_ENGINE_FLUSH_INTERVAL: Duration = Duration::from_millis(50);

impl RecorderBuilder {
    /// Samples per second of each thread's CPU time (default 999, or the
    /// `SPULSE_FREQUENCY` environment variable). Must be 1..=100000.
    pub fn frequency_hz(mut self, hz: u32) -> Self {
        self.frequency_hz = Some(hz);
        self
    }
    /// Most frames kept per sample (1..=4095), a kernel-mode leaf included
    /// (above a depth of 1); deeper stacks keep the leaf-most frames under a
    /// truncated-stack marker.
    pub fn max_stack_depth(mut self, depth: usize) -> Self {
        self.max_stack_depth = depth;
        self
    }
    /// Samples the ring holds between flushes (2..=1048576, rounded up to a
    /// power of two). The ring is allocated at start:
    /// `slots x (4 + max_stack_depth) x 8` bytes, which must not exceed
    /// [`MAX_RING_BYTES`] (256 MiB); the defaults take 2 MiB.
    pub fn ring_capacity(mut self, slots: usize) -> Self {
        self.ring_capacity = slots;
        self
    }
    /// How often the writer thread drains the ring and appends to the spool
    /// (1 ms..=10 min; default 100 ms, 50 ms with an engine that starts
    /// sampling a new thread at the writer's next tick (per-thread CPU timers,
    /// perf-stack), or the [`rotate`](Self::rotate) interval if that is
    /// shorter). Each wake-up of the writer costs a
    /// context switch and a write: at 50 ms they were most of an idle
    /// recorder's CPU (measured 0.12% of a sampled thread against 0.07% at
    /// 100 ms). When samples arrive faster than a quarter of the ring per
    /// interval (counting those a full ring lost), the writer wakes as often
    /// as that rate needs (down to every millisecond), so many busy threads
    /// do not overflow the ring between two flushes; it returns to the
    /// interval when the rate drops.
    pub fn flush_interval(mut self, interval: Duration) -> Self {
        self.flush_interval = Some(interval);
        self
    }
    /// Which sampling engine to use (default: the best one the system allows).
    pub fn engine(mut self, engine: EngineChoice) -> Self {
        self.engine = engine;
        self
    }
    /// Sample system CPU time too (default on, or the `SPULSE_KERNEL_TIME`
    /// environment variable, `0` or `1`). With the perf-event engine, a period
    /// that ends in kernel mode becomes a sample with a kernel-mode leaf frame
    /// on top of the user stack that entered the kernel; where the kernel
    /// refuses kernel-mode counting the recorder samples user time only and
    /// says so in [`Stats::kernel_time`]. The timer engines always count both.
    pub fn kernel_time(mut self, on: bool) -> Self {
        self.kernel_time = Some(on);
        self
    }
    /// Permission bits of the new spool (default 0600; the process umask still
    /// applies). Only the `0o777` bits are allowed (no setuid, setgid or sticky
    /// bit) and the owner must keep read and write permission.
    pub fn mode(mut self, mode: u32) -> Self {
        self.mode = mode;
        self
    }
    /// Replace a spool that already exists at the path (default: refuse).
    /// The old file is unlinked and a new one created in its place (still
    /// `O_EXCL | O_NOFOLLOW`, with [`mode`](Self::mode)): a symlink at the path is
    /// removed, never followed, and a reader holding the old file keeps reading
    /// the old file. A spool that a running recorder still holds locked (see the
    /// crate documentation on live reading) and a path that is not a regular
    /// file or symlink (a directory, FIFO, device) are refused. The old file is
    /// removed before sampling starts: if the start then fails, neither remains.
    pub fn overwrite(mut self, overwrite: bool) -> Self {
        self.overwrite = overwrite;
        self
    }
    /// Start a new segment file every `interval` (10 ms..=30 days, and at
    /// least the [`flush_interval`](Self::flush_interval) if one is set); default: one file,
    /// or the `SPULSE_ROTATE` environment variable (seconds, such as `60` or
    /// `0.5`). The path must then contain `{seq}`, which becomes the segment
    /// number, 0 first, zero-padded to six digits (`out-{seq}.spool` gives
    /// `out-000000.spool`, `out-000001.spool`, ...).
    ///
    /// A segment starts at the first flush at or after its due time, with its
    /// own header and the definitions of the modules still loaded; every
    /// segment is a complete spool, readable without the others. The previous
    /// segment is flushed, synced and unlocked once the next one exists, so a
    /// crash loses at most the current flush interval of the current segment.
    /// Each segment is created under the same rules as the first (exclusive
    /// create unless [`overwrite`](Self::overwrite), [`mode`](Self::mode), the
    /// followers' lock). When a segment cannot be created (its path is taken,
    /// the disk is full), nothing more is written, as after any write error,
    /// and [`Guard::finish`] returns that error naming the segment.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// // One segment a minute; only the last hour stays on disk.
    /// let guard = spulse::Recorder::builder()
    ///     .rotate(Duration::from_secs(60))
    ///     .retain(60)
    ///     .start("/var/tmp/app-{pid}-{seq}.spool")?;
    /// // ...
    /// let stats = guard.finish()?;
    /// println!("{} segments, {} deleted", stats.segments_written, stats.segments_deleted);
    /// # Ok::<(), spulse::Error>(())
    /// ```
    pub fn rotate(mut self, interval: Duration) -> Self {
        self.rotate = Some(interval);
        self
    }
    /// With [`rotate`](Self::rotate): keep only the newest `segments` segment
    /// files (1..=1000000), deleting the oldest when a new one starts (default:
    /// keep all, or the `SPULSE_RETAIN` environment variable). Only files this
    /// recorder created are deleted: when a segment's path names another file
    /// by then (other device or inode), that file is left alone and no longer
    /// counts among the segments kept. The oldest is deleted right after the
    /// next segment is created, so a process that dies in between (killed,
    /// or ended by `_exit`) leaves N + 1.
    pub fn retain(mut self, segments: usize) -> Self {
        self.retain = Some(segments);
        self
    }

    /// With [`EngineChoice::PerfStack`]: bytes of each sampled thread's stack
    /// the kernel copies per sample, from the stack pointer up (default 16
    /// KiB; a multiple of 8, 8..65536: the kernel's sample record has a 16-bit
    /// size). The unwinder reads only the copy: a stack whose frames reach
    /// beyond it is written truncated. Each copy costs the sampled thread the
    /// time to copy it and takes ring space.
    pub fn user_stack_copy(mut self, bytes: u32) -> Self {
        self.user_stack_copy = bytes;
        self
    }

    /// With [`EngineChoice::PerfStack`]: data pages of each thread's sample
    /// ring (a power of two, 1..=1024; default 64, 256 KiB with 4 KiB pages).
    /// Each thread's ring maps one page more; rings take at most 64 MiB in
    /// all (threads beyond get none). The writer drains the rings when one is
    /// half full; samples that find their ring full are lost
    /// ([`LostSamples::ring_full`]).
    pub fn perf_stack_ring_pages(mut self, pages: usize) -> Self {
        self.perf_stack_ring_pages = pages;
        self
    }

    /// With [`EngineChoice::PerfStack`]: whether a ring half full wakes the
    /// writer thread to drain it (default true). With `false` the writer
    /// drains only every [`flush_interval`](Self::flush_interval), so each
    /// ring must hold a whole interval of samples (at 999 Hz and 100 ms, 100
    /// samples of about `user_stack_copy` bytes each: 512 pages for 16 KiB
    /// copies), or the rest is lost.
    pub fn perf_stack_watermark(mut self, on: bool) -> Self {
        self.perf_stack_watermark = on;
        self
    }

    /// Whether finishing the recording waits until the spool is on stable
    /// storage (`fsync`; default true), so that it survives a power loss or a
    /// kernel crash right after. What the recorder flushed survives the
    /// process's own death either way. `false` saves the few milliseconds
    /// (often more on a virtual disk) that the sync costs at exit, for
    /// spools that are read and discarded at once: the preloaded library does
    /// so under `spulse record`, whose collector owns the durable output.
    pub fn sync_at_finish(mut self, sync: bool) -> Self {
        self.sync_at_finish = sync;
        self
    }

    /// Create the spool at `path` and start recording.
    ///
    /// `path` is a template: `{pid}` becomes the process id, `{timestamp}`
    /// the start time in seconds since the Unix epoch and, with
    /// [`rotate`](Self::rotate) only (where it is required), `{seq}` the
    /// segment number (`{{` and `}}` stand for literal braces; any other
    /// `{...}` is an error). When the `SPULSE_OUTPUT`
    /// environment variable is set and not empty, it replaces `path` (and is a
    /// template too). The file must not exist unless [`overwrite`](Self::overwrite)
    /// is set. Every setting is checked before anything is created: a bad value
    /// is an `Err` naming it, and leaves no file, no signal handler and no thread.
    /// When `libspulse_preload.so` (`LD_PRELOAD`, `spulse record`) already
    /// records this process, the call is an `Err` saying so
    /// ([`RecorderError::RecordedByPreload`]) and the program
    /// runs on, recorded once (see `src/preloaded.rs`).
    pub fn start(&self, path: impl AsRef<Path>) -> Result<Guard, Error> {
        start_with(self, path.as_ref())
    }

    /// When the recording finishes ([`Guard::finish`] or drop), also write
    /// the heap profile ([`crate::heap::write_profile`]) to `path` (features
    /// `heap` and `pprof`; the program's global allocator must be
    /// [`crate::heap::Sampled`] for it to hold samples).
    #[cfg(all(feature = "heap", feature = "pprof"))]
    pub fn heap_profile(mut self, path: impl Into<PathBuf>) -> Self {
        self.heap_profile = Some(path.into());
        self
    }
}

/// Most bytes the sample ring may take (`ring_capacity x (4 + max_stack_depth) x 8`).
pub const MAX_RING_BYTES: usize = 256 << 20;

/// Settings checked and resolved before anything is created.
struct Checked {
    hz: u32,
    kernel_time: bool,
    path: PathBuf,
    rotation: Option<RotationPlan>,
    /// The flush interval: as set, else the default or the rotation interval
    /// if that is shorter.
    flush: Duration,
}

/// Rotation settings, resolved.
pub(crate) struct RotationPlan {
    /// The path's bytes around each `{seq}` (at least two pieces).
    pub pieces: Vec<Vec<u8>>,
    pub every: Duration,
    pub retain: Option<usize>,
}

/// Shortest and longest rotation interval.
const MIN_ROTATE: Duration = Duration::from_millis(10);
const MAX_ROTATE: Duration = Duration::from_secs(30 * 86_400);
/// Most segments `retain` may keep.
const MAX_RETAIN: usize = 1_000_000;

/// The path of segment `seq`: the pieces joined by the zero-padded number.
pub(crate) fn segment_path(pieces: &[Vec<u8>], seq: u64) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let num = format!("{seq:06}");
    let mut out = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(num.as_bytes());
        }
        out.extend_from_slice(p);
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

impl RecorderBuilder {
    /// Ignore the `SPULSE_*` environment variables (`SPULSE_OUTPUT`,
    /// `SPULSE_FREQUENCY`, `SPULSE_ROTATE`, `SPULSE_RETAIN`,
    /// `SPULSE_KERNEL_TIME`): the `http` endpoint's temporary window records
    /// with the defaults into its own file, whatever the process was told.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn without_environment(mut self) -> Self {
        self.environment = false;
        self
    }

    /// The environment variable `name`, unless the environment is ignored.
    fn env_var(&self, name: &str) -> Option<std::ffi::OsString> {
        if self.environment {
            std::env::var_os(name)
        } else {
            None
        }
    }

    /// Check every setting; resolve the frequency and the output path.
    fn check(&self, path: &Path) -> Result<Checked, Error> {
        let hz = frequency(self)?;
        let kernel_time = match self.kernel_time {
            Some(on) => on,
            None => match self.env_var("SPULSE_KERNEL_TIME").map(|v| v.into_string()) {
                Some(Ok(v)) if v.trim() == "0" => false,
                Some(Ok(v)) if v.trim() == "1" => true,
                Some(Ok(v)) => {
                    return Err(invalid(
                        "SPULSE_KERNEL_TIME",
                        format!("SPULSE_KERNEL_TIME={v:?} is neither 0 (user time only) nor 1"),
                    ))
                }
                // As `std::env::var` had it: not Unicode is as good as unset.
                Some(Err(_)) | None => true,
            },
        };
        let depth = self.max_stack_depth;
        if !(1..=MAX_DEPTH).contains(&depth) {
            return Err(invalid(
                "max_stack_depth",
                format!("max_stack_depth {depth} is outside 1..={MAX_DEPTH}"),
            ));
        }
        let slots = self.ring_capacity;
        if !(2..=MAX_RING_SLOTS).contains(&slots) {
            return Err(invalid(
                "ring_capacity",
                format!("ring_capacity {slots} is outside 2..={MAX_RING_SLOTS}"),
            ));
        }
        let bytes = slots.next_power_of_two().saturating_mul((ring::HEADER_WORDS + depth) * 8);
        if bytes > MAX_RING_BYTES {
            return Err(invalid(
                "ring_capacity",
                format!(
                    "ring_capacity {slots} with max_stack_depth {depth} needs {} MiB for the sample ring, \
                 more than the limit of {} MiB; lower one of them",
                    bytes >> 20,
                    MAX_RING_BYTES >> 20
                ),
            ));
        }
        let copy = self.user_stack_copy;
        if copy == 0 || copy % 8 != 0 || copy >= sys::perf_stack::MAX_STACK_COPY {
            return Err(invalid(
                "user_stack_copy",
                format!(
                    "user_stack_copy {copy} must be a multiple of 8 in 8..{} bytes",
                    sys::perf_stack::MAX_STACK_COPY
                ),
            ));
        }
        let pages = self.perf_stack_ring_pages;
        if !pages.is_power_of_two() || pages > sys::perf_stack::MAX_RING_PAGES {
            return Err(invalid(
                "perf_stack_ring_pages",
                format!(
                    "perf_stack_ring_pages {pages} must be a power of two in 1..={}",
                    sys::perf_stack::MAX_RING_PAGES
                ),
            ));
        }
        if let Some(fi) = self.flush_interval {
            if fi < Duration::from_millis(1) || fi > MAX_FLUSH_INTERVAL {
                return Err(invalid(
                    "flush_interval",
                    format!("flush_interval {fi:?} is outside 1ms..=10min"),
                ));
            }
        }
        let mode = self.mode;
        if mode & !0o777 != 0 {
            return Err(invalid(
                "mode",
                format!(
                    "mode {mode:#o} has bits other than permissions (setuid, setgid, sticky or unknown); \
                     only 0o777 bits are allowed"
                ),
            ));
        }
        if mode & 0o600 != 0o600 {
            return Err(invalid(
                "mode",
                format!("mode {mode:#o} must give the owner read and write (0o600)"),
            ));
        }
        let (template, from_env) = match self.env_var("SPULSE_OUTPUT") {
            Some(v) if !v.is_empty() => (PathBuf::from(v), true),
            _ => (path.to_path_buf(), false),
        };
        let pid = sys::getpid();
        let secs =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let path_err = |msg: String| {
            if from_env {
                invalid("SPULSE_OUTPUT", format!("SPULSE_OUTPUT: {msg}"))
            } else {
                invalid("path", msg)
            }
        };
        let pieces = expand_template(&template, pid, secs).map_err(path_err)?;
        let rotation = self.rotation_settings()?;
        let shown = template.display();
        let first = segment_path(&pieces, 0);
        let rotation = match (rotation, pieces.len()) {
            (None, 1) => None,
            (None, _) => {
                return Err(path_err(format!(
                    "path template \"{shown}\" has {{seq}}, which numbers the segments of a rotating \
                     recording: set rotate (or SPULSE_ROTATE), or write {{{{seq}}}} for the literal text"
                )))
            }
            (Some(_), 1) => {
                return Err(path_err(format!(
                    "path template \"{shown}\" has no {{seq}}: a rotating recording needs it to name its \
                     segments (such as \"out-{{seq}}.spool\")"
                )))
            }
            (Some((every, retain)), _) => Some(RotationPlan { pieces, every, retain }),
        };
        if first.as_os_str().is_empty() {
            return Err(path_err("the spool path is empty".into()));
        }
        let flush = match (self.flush_interval, &rotation) {
            (Some(set), _) => set,
            (None, Some(plan)) => DEFAULT_FLUSH_INTERVAL.min(plan.every),
            (None, None) => DEFAULT_FLUSH_INTERVAL,
        };
        Ok(Checked { hz, kernel_time, path: first, rotation, flush })
    }

    /// The rotation interval and retention (builder values, else
    /// `SPULSE_ROTATE` and `SPULSE_RETAIN`), checked.
    fn rotation_settings(&self) -> Result<Option<(Duration, Option<usize>)>, Error> {
        let env = |name: &str| {
            self.env_var(name).and_then(|v| v.into_string().ok()).filter(|v| !v.trim().is_empty())
        };
        let (every, every_setting) = match self.rotate {
            Some(d) => (Some(d), "rotate"),
            None => match env("SPULSE_ROTATE") {
                Some(v) => {
                    let d = v
                        .trim()
                        .parse::<f64>()
                        .ok()
                        .and_then(|s| Duration::try_from_secs_f64(s).ok())
                        .ok_or_else(|| {
                            invalid(
                                "SPULSE_ROTATE",
                                format!("SPULSE_ROTATE={v:?} is not a number of seconds"),
                            )
                        })?;
                    (Some(d), "SPULSE_ROTATE")
                }
                None => (None, "rotate"),
            },
        };
        let (retain, retain_setting) = match self.retain {
            Some(n) => (Some(n), "retain"),
            None => match env("SPULSE_RETAIN") {
                Some(v) => {
                    let n = v.trim().parse::<usize>().map_err(|_| {
                        invalid(
                            "SPULSE_RETAIN",
                            format!("SPULSE_RETAIN={v:?} is not a whole number of segments"),
                        )
                    })?;
                    (Some(n), "SPULSE_RETAIN")
                }
                None => (None, "retain"),
            },
        };
        if let Some(n) = retain {
            if !(1..=MAX_RETAIN).contains(&n) {
                return Err(invalid(
                    retain_setting,
                    format!("{retain_setting} {n} is outside 1..={MAX_RETAIN} segments"),
                ));
            }
        }
        let Some(every) = every else {
            if retain.is_some() {
                return Err(invalid(
                    retain_setting,
                    format!(
                        "{retain_setting} keeps the newest segments of a rotating recording: set rotate too"
                    ),
                ));
            }
            return Ok(None);
        };
        if every < MIN_ROTATE || every > MAX_ROTATE {
            return Err(invalid(
                every_setting,
                format!("{every_setting} interval {every:?} is outside 10ms..=30days"),
            ));
        }
        if let Some(fi) = self.flush_interval.filter(|&fi| every < fi) {
            return Err(invalid(
                every_setting,
                format!(
                    "{every_setting} interval {every:?} is shorter than the flush_interval {fi:?}; segments \
                     start at flushes"
                ),
            ));
        }
        Ok(Some((every, retain)))
    }
}

/// An invalid builder setting.
fn invalid(setting: &'static str, message: String) -> Error {
    Error::Recorder(RecorderError::InvalidConfig { setting, message })
}

/// Deepest `max_stack_depth`: one frame less than the format's stack limit,
/// which leaves room for the truncated-stack marker at the root.
const MAX_DEPTH: usize = crate::format::limits::MAX_STACK_DEPTH as usize - 1;
/// Highest sampling frequency: a 10 us period, below which the handler's own
/// time (several microseconds with a deep stack) would dominate the profile.
const MAX_FREQUENCY_HZ: u32 = 100_000;
/// Most unwinder caches: two per CPU plus two let every CPU's handler find one
/// while another is held by an interrupted handler; more only costs memory.
const MAX_UNWIND_CACHES: usize = 64;
/// Most sample intervals one signal may stand for (a timer's overruns beyond
/// it are counted as lost): a thread that was descheduled for long must not
/// claim a huge weight for the one stack seen when it ran again.
const MAX_SIGNAL_WEIGHT: u32 = 64;
/// Largest `ring_capacity`.
const MAX_RING_SLOTS: usize = ring::MAX_SLOTS;
/// Longest `flush_interval`.
const MAX_FLUSH_INTERVAL: Duration = Duration::from_secs(600);

/// Replace `{pid}` and `{timestamp}` in `template` (`{{`/`}}` are literal
/// braces) and split it at each `{seq}`: the pieces to join with a segment
/// number (one piece when there is no `{seq}`).
fn expand_template(template: &Path, pid: u32, unix_secs: u64) -> Result<Vec<Vec<u8>>, String> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = template.as_os_str().as_bytes();
    let shown = template.display();
    let mut pieces = Vec::new();
    let mut out = Vec::with_capacity(bytes.len() + 16);
    let mut i = 0;
    while i < bytes.len() {
        let rest = &bytes[i..];
        if rest.starts_with(b"{{") || rest.starts_with(b"}}") {
            out.push(rest[0]);
            i += 2;
        } else if rest.starts_with(b"{pid}") {
            out.extend_from_slice(pid.to_string().as_bytes());
            i += 5;
        } else if rest.starts_with(b"{timestamp}") {
            out.extend_from_slice(unix_secs.to_string().as_bytes());
            i += 11;
        } else if rest.starts_with(b"{seq}") {
            pieces.push(std::mem::take(&mut out));
            i += 5;
        } else if rest[0] == b'{' || rest[0] == b'}' {
            let end = rest.iter().position(|&b| b == b'}').map_or(rest.len(), |e| e + 1);
            return Err(format!(
                "path template \"{shown}\" has an unknown placeholder \"{}\" at byte {i} \
                 (known: {{pid}}, {{timestamp}}, {{seq}}; write {{{{ or }}}} for a literal brace)",
                String::from_utf8_lossy(&rest[..end.min(40)])
            ));
        } else {
            out.push(rest[0]);
            i += 1;
        }
    }
    pieces.push(out);
    Ok(pieces)
}

/// Create the spool file: new (`O_EXCL`), never through a symlink, close-on-exec,
/// and locked (`flock(LOCK_EX)`) for as long as the recording runs.
pub(crate) fn create_spool(path: &Path, mode: u32, overwrite: bool) -> Result<File, Error> {
    let io_err = |source| Error::io(Some(path), source);
    if overwrite {
        remove_for_overwrite(path)?;
    }
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                io_err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the spool already exists; use a path template such as \"out-{pid}.spool\" \
                     (or \"{timestamp}\"), set SPULSE_OUTPUT, or replace it with \
                     Recorder::builder().overwrite(true)",
                ))
            } else {
                io_err(e)
            }
        })?;
    if let Err(e) = sys::try_lock(file.as_fd(), sys::Lock::Exclusive) {
        let _ = std::fs::remove_file(path);
        return Err(io_err(e));
    }
    // Out of the way of the program's own descriptors (see `own_fd.rs`).
    Ok(File::from(own_fd::move_high(file.into())))
}

/// For `overwrite(true)`: unlink what is at `path` if it is a regular file
/// that no running recorder holds, or a symlink (removed, not followed).
fn remove_for_overwrite(path: &Path) -> Result<(), Error> {
    let io_err = |source| Error::io(Some(path), source);
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(e)),
    };
    let ft = meta.file_type();
    if ft.is_file() {
        // O_NONBLOCK: never wait on the open; O_NOFOLLOW: it may have been
        // replaced by a symlink since the lstat.
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)
            .map_err(io_err)?;
        if sys::try_lock(f.as_fd(), sys::Lock::Shared).is_err() {
            return Err(Error::Recorder(RecorderError::OverwriteRefused {
                path: path.to_path_buf(),
                reason: "a running recorder is still writing it (it holds the spool's lock)",
            }));
        }
    } else if !ft.is_symlink() {
        return Err(Error::Recorder(RecorderError::OverwriteRefused {
            path: path.to_path_buf(),
            reason: "it is not a regular file or symlink",
        }));
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(e)),
    }
}

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
    #[cfg(all(feature = "heap", feature = "pprof"))]
    heap_profile: Option<PathBuf>,
}

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
    /// The engine sampling this recording.
    pub fn engine(&self) -> Engine {
        self.inner.as_ref().map_or(Engine::Unknown, |r| r.engine)
    }

    /// The spool's path (of a rotating recording: its first segment's).
    pub fn path(&self) -> &Path {
        self.inner.as_ref().map_or(Path::new(""), |r| &r.path)
    }

    /// Stop, drain, write and sync; report what was recorded.
    ///
    /// If the spool stopped being writable while recording (a full disk, or
    /// the program closed the spool's descriptor or reused its number: the
    /// recorder then writes nothing more through it), the error is
    /// [`RecorderError::WriteStopped`] with the samples written before and
    /// those lost.
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
        let _ = run.tx.send(Control::Stop);
        let res = match run.join.join() {
            Ok(r) => r,
            Err(_) => Err(Error::Recorder(RecorderError::WriterFailed { what: "panicked", source: None })),
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

fn frequency(b: &RecorderBuilder) -> Result<u32, Error> {
    let hz = match b.frequency_hz {
        Some(hz) => hz,
        None => match b.env_var("SPULSE_FREQUENCY").map(|v| v.into_string()) {
            Some(Ok(v)) => v.trim().parse::<u32>().map_err(|_| {
                invalid(
                    "SPULSE_FREQUENCY",
                    format!("SPULSE_FREQUENCY={v:?} is not a whole number of samples per second"),
                )
            })?,
            Some(Err(_)) | None => DEFAULT_FREQUENCY_HZ,
        },
    };
    if !(1..=MAX_FREQUENCY_HZ).contains(&hz) {
        let setting = if b.frequency_hz.is_some() { "frequency_hz" } else { "SPULSE_FREQUENCY" };
        return Err(invalid(
            setting,
            format!("sampling frequency {hz} Hz is outside 1..={MAX_FREQUENCY_HZ}"),
        ));
    }
    Ok(hz)
}

fn start_with(b: &RecorderBuilder, path: &Path) -> Result<Guard, Error> {
    if let Some(pid) = crate::preloaded::recorded_by_preload() {
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
    let Checked { hz, kernel_time, path, rotation, flush } = b.check(path)?;
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
    let sink: Box<dyn writer_thread::Sink> = Box::new(own_fd::SpoolFile::new(file));
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
    let (ring, consumer) = if b.engine == EngineChoice::PerfStack {
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
    });

    // The writer thread exists before any engine, so it can be left out of them.
    // The perf-stack engine's writer waits on its rings: its channel has an
    // eventfd to wake it.
    let (tx, rx, wake) = writer_thread::channel(b.engine == EngineChoice::PerfStack).map_err(|e| {
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
    let join = std::thread::Builder::new()
        .name("spulse-writer".into())
        .spawn(move || {
            let _ = tid_tx.send(sys::gettid());
            writer_thread::main(rx, wake)
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

    let candidates: &[EngineChoice] = match b.engine {
        EngineChoice::Auto => {
            &[EngineChoice::PerfEvent, EngineChoice::ThreadCpuTimer, EngineChoice::ProcessTimer]
        }
        EngineChoice::PerfEvent => &[EngineChoice::PerfEvent],
        EngineChoice::ThreadCpuTimer => &[EngineChoice::ThreadCpuTimer],
        EngineChoice::ProcessTimer => &[EngineChoice::ProcessTimer],
        EngineChoice::PerfStack => &[EngineChoice::PerfStack],
    };
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
    let descriptors = engine.descriptors();
    let needs_sampler = kind == Engine::PerfStack || kernel_status == KernelTime::Sampled;
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
        consumer: Some(consumer),
        out,
        table,
        engine,
        exe_path,
        generation: 0,
        dl,
        interval: flush,
        started: Instant::now(),
        pid,
        sync_at_finish: b.sync_at_finish,
        kernel_time: kernel_status,
        rotation: rotation
            .map(|plan| writer_thread::Rotation::new(plan, path, &file_id, b.mode, b.overwrite, interval_us)),
        stack_sampler: needs_sampler.then(|| stack_sampler::StackSampler::new(b.max_stack_depth)),
        own_code: handler::return_trampoline(),
        warnings,
        descriptors,
        table_memory: objects.iter().fold(Default::default(), |m, o| m.add(o.table_memory)),
        deferred,
    };
    tx.send(Control::Start(Box::new(state))).map_err(|_| exited())?;
    let join = cleanup.join.take().expect("writer thread handle");
    cleanup.disarm();
    *PYTHON_TX.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx.clone());
    PYTHON_INSIDE.store(false, Ordering::SeqCst);
    *LIVE_SPOOL.lock().unwrap_or_else(|e| e.into_inner()) = Some((pid, path.to_path_buf(), flush));
    Ok(Guard {
        inner: Some(Running {
            tx,
            join,
            pid,
            path: path.to_path_buf(),
            engine: kind,
            #[cfg(all(feature = "heap", feature = "pprof"))]
            heap_profile: b.heap_profile.clone(),
        }),
    })
}

/// The name of the file beside a spool that holds its recorders'
/// [`Stats::warnings`] (`<spool>.warnings`, one per line), read by `spulse
/// info`: the spool itself keeps to the seed format, which has no place for
/// them. `spulse record` writes it beside its output when there are
/// warnings; an embedded recorder leaves it to the program ([`write_warnings`]
/// with `Guard::finish`'s `Stats`), so a recording makes no file but its spool.
pub fn warnings_path(spool: &Path) -> PathBuf {
    let mut p = spool.as_os_str().to_owned();
    p.push(".warnings");
    PathBuf::from(p)
}

/// Write `warnings` beside `spool`, one a line, at [`warnings_path`] (mode
/// 0600, never through a symlink), replacing an earlier such file.
pub fn write_warnings(spool: &Path, warnings: &[String]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let text: String = warnings.iter().map(|w| w.replace('\n', " ") + "\n").collect();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(warnings_path(spool))?;
    f.write_all(text.as_bytes())
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
