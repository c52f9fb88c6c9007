//! [`Recorder::builder`] and [`RecorderBuilder`]: every setting, its default and
//! bounds, the environment overrides (`SPULSE_*`), and the check that resolves
//! them (frequency, output path, rotation plan) before anything is created.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::handler::ring;
use super::output::{expand_template, segment_path};
use super::stats::EngineChoice;
use super::sys;
use super::warnings::WarningCallback;
use super::{start_with, Guard};
use crate::{Error, RecorderError};

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
    pub(super) frequency_hz: Option<u32>,
    pub(super) max_stack_depth: usize,
    pub(super) ring_capacity: usize,
    /// As set (`None`: the default, or the rotation interval if shorter).
    pub(super) flush_interval: Option<Duration>,
    /// As set; `None`: `SPULSE_ENGINE`, else [`EngineChoice::Auto`].
    pub(super) engine: Option<EngineChoice>,
    pub(super) kernel_time: Option<bool>,
    pub(super) off_cpu: Option<bool>,
    pub(super) mode: u32,
    pub(super) overwrite: bool,
    pub(super) sync_at_finish: bool,
    pub(super) rotate: Option<Duration>,
    pub(super) retain: Option<usize>,
    pub(super) user_stack_copy: u32,
    pub(super) perf_stack_ring_pages: usize,
    pub(super) perf_stack_watermark: bool,
    /// Whether the `SPULSE_*` environment variables apply (false for the
    /// `http` endpoint's own temporary windows).
    pub(super) environment: bool,
    /// Called on the writer thread with each warning as it is found.
    pub(super) on_warning: Option<WarningCallback>,
    /// Where `finish` writes the heap profile (`spulse::heap`).
    #[cfg(all(feature = "heap", feature = "pprof"))]
    pub(super) heap_profile: Option<std::path::PathBuf>,
    /// Whether the spool carries the heap sampler's events.
    #[cfg(feature = "heap")]
    pub(super) heap_events: bool,
}

impl Default for RecorderBuilder {
    fn default() -> Self {
        RecorderBuilder {
            frequency_hz: None,
            max_stack_depth: 128,
            ring_capacity: 2048,
            flush_interval: None,
            engine: None,
            kernel_time: None,
            off_cpu: None,
            mode: 0o600,
            overwrite: false,
            sync_at_finish: true,
            rotate: None,
            retain: None,
            user_stack_copy: Self::DEFAULT_USER_STACK_COPY,
            perf_stack_ring_pages: Self::DEFAULT_PERF_STACK_RING_PAGES,
            perf_stack_watermark: true,
            environment: true,
            on_warning: None,
            #[cfg(all(feature = "heap", feature = "pprof"))]
            heap_profile: None,
            #[cfg(feature = "heap")]
            heap_events: false,
        }
    }
}

impl RecorderBuilder {
    /// Default [`user_stack_copy`](Self::user_stack_copy): 16 KiB.
    pub const DEFAULT_USER_STACK_COPY: u32 = 16 << 10;
    /// Default [`perf_stack_ring_pages`](Self::perf_stack_ring_pages): 64 pages (256 KiB).
    pub const DEFAULT_PERF_STACK_RING_PAGES: usize = 64;
    /// Default sampling frequency.
    pub const DEFAULT_FREQUENCY_HZ: u32 = 999;
    /// Most bytes the sample ring may take (`ring_capacity x (4 + max_stack_depth) x 8`).
    pub const MAX_RING_BYTES: usize = 256 << 20;
}

/// How often the writer drains the ring and appends to the spool by default.
const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(100);

/// The default flush interval of the engines that start sampling a new thread
/// at the writer's next tick (per-thread CPU timers, perf-stack).
pub(super) const PER_THREAD_ENGINE_FLUSH_INTERVAL: Duration = Duration::from_millis(50);

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
    /// [`MAX_RING_BYTES`](Self::MAX_RING_BYTES) (256 MiB); the defaults take 2 MiB.
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
    /// Which sampling engine to use (default [`EngineChoice::Auto`], or the
    /// `SPULSE_ENGINE` environment variable: `auto`, `perf-event`,
    /// `thread-timer`, `process-timer` or `perf-stack`). `Auto` starts with
    /// the best engine the system allows and, when that is the perf-event
    /// engine and the program turns out to switch context often (see
    /// [`EngineChoice::Auto`]), moves to per-thread CPU timers, whose cost
    /// does not grow with context switches; naming an engine keeps it.
    pub fn engine(mut self, engine: EngineChoice) -> Self {
        self.engine = Some(engine);
        self
    }
    /// Record off-CPU time too (default off, or the `SPULSE_OFF_CPU`
    /// environment variable: `1` on, `0` off): for every interval a thread
    /// spends off the CPU, its exact length (from the kernel's context-switch
    /// records of a perf event that counts nothing and sends no signal), and
    /// where it waited: the stack it blocked in, with the system call as a
    /// `[blocked: futex]` leaf (read from `/proc/self/task/<tid>/syscall` and
    /// a copy of its stack, at most once per blocking, without waking it:
    /// every wait a writer tick finds 5 ms long, and about 10 shorter ones a
    /// second, the others charged to `[blocked]`, or summed under `[blocked,
    /// under 5 ms]` when shorter than 5 ms), or
    /// `[waiting for CPU]` when it was preempted. Needs no privilege
    /// (`perf_event_paranoid` 2 is enough). The spool then holds off-CPU
    /// intervals (FORMAT.md, tag 9); `spulse top --off-cpu` and `--wall` show
    /// them. A thread that stays blocked costs nothing while it does. Where
    /// the events are refused, the recording goes on without and
    /// [`Stats::warnings`](crate::Stats::warnings) says why; [`Stats::off_cpu`](crate::Stats::off_cpu) counts what was seen.
    pub fn off_cpu(mut self, on: bool) -> Self {
        self.off_cpu = Some(on);
        self
    }

    /// Sample system CPU time too (default on, or the `SPULSE_KERNEL_TIME`
    /// environment variable, `0` or `1`). With the perf-event engine, a period
    /// that ends in kernel mode becomes a sample with a kernel-mode leaf frame
    /// on top of the user stack that entered the kernel; where the kernel
    /// refuses kernel-mode counting the recorder samples user time only and
    /// says so in [`Stats::kernel_time`](crate::Stats::kernel_time). The timer engines always count both.
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
    /// time to copy it and takes ring space. The off-CPU mode's captures of
    /// blocked threads copy at least 64 KiB (the writer copies them, once a
    /// blocking).
    pub fn user_stack_copy(mut self, bytes: u32) -> Self {
        self.user_stack_copy = bytes;
        self
    }

    /// With [`EngineChoice::PerfStack`]: data pages of each thread's sample
    /// ring (a power of two, 1..=1024; default 64, 256 KiB with 4 KiB pages).
    /// Each thread's ring maps one page more; rings take at most 64 MiB in
    /// all (threads beyond get none). The writer drains the rings when one is
    /// half full; samples that find their ring full are lost
    /// ([`LostSamples::ring_full`](crate::LostSamples::ring_full)).
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

    /// Call `callback` with each warning (what did not go as configured, one
    /// sentence: the sentences of [`Stats::warnings`](crate::Stats::warnings)(super::Stats::warnings),
    /// each once, in the same order) as the recorder finds it: those found at
    /// start as soon as the writer thread runs, those that arise while
    /// recording (the program taking the engine's signal or descriptors
    /// over, the spool's descriptor taken away or the disk full, a rotation
    /// stepping over a taken segment name) after the writer step that found
    /// them, within about one [`flush_interval`](Self::flush_interval), and
    /// those only known at the end during [`Guard::finish`]. See
    /// [`Guard::warnings`] for the list so far without a callback.
    ///
    /// The callback runs on the recorder's writer thread, never in a signal
    /// handler: it may allocate, lock and log, but while it runs the writer
    /// does not drain samples, so it should return quickly (a slow callback
    /// fills the ring and loses samples, counted in
    /// [`LostSamples::ring_full`](crate::LostSamples::ring_full)(super::LostSamples::ring_full)). A callback
    /// that panics is not called again (a warning says so). It must not
    /// wait for the recorder: finishing or dropping the [`Guard`] there, or
    /// calling [`python_runtime_enter`](crate::python_runtime_enter), waits
    /// for the writer thread, which is the thread running the callback. The recorder
    /// itself never writes warnings to stderr or to any descriptor it did not
    /// open (stderr belongs to the program, which may have closed it or
    /// reused its number): printing or logging them is the program's choice,
    /// here or from [`Stats::warnings`](crate::Stats::warnings)(super::Stats::warnings).
    ///
    /// ```no_run
    /// let guard = spulse::Recorder::builder()
    ///     .on_warning(|w| eprintln!("profiler: {w}"))
    ///     .start("out.spool")?;
    /// # Ok::<(), spulse::Error>(())
    /// ```
    pub fn on_warning(mut self, callback: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.on_warning = Some(WarningCallback(std::sync::Arc::new(callback)));
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
    /// runs on, recorded once (see `src/recorder/sys/preloaded.rs`).
    pub fn start(&self, path: impl AsRef<Path>) -> Result<Guard, Error> {
        start_with(self, path.as_ref())
    }

    /// When the recording finishes ([`Guard::finish`] or drop), also write
    /// the heap profile ([`crate::heap::write_profile`]) to `path` (features
    /// `heap` and `pprof`; the program's global allocator must be
    /// [`crate::heap::Sampled`] for it to hold samples).
    #[cfg(all(feature = "heap", feature = "pprof"))]
    pub fn heap_profile(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.heap_profile = Some(path.into());
        self
    }

    /// Write the heap sampler's events into the spool too (feature `heap`;
    /// default off): each sampled allocation, with its stack, its block's
    /// address and size and the bytes it stands for, and each sampled
    /// block's free, as heap records (FORMAT.md, tag 10), with the time and
    /// thread of each. The program's global allocator must be
    /// [`crate::heap::Sampled`] for there to be any; `spulse firefox` draws
    /// them as the thread's native allocations (allocated, retained and
    /// freed memory by stack, over time). One recorder of a process at a
    /// time takes them (a second one says so in a warning). A recording
    /// made without them is seed-literal, as before. The sampler hands them
    /// over through a ring of [`crate::heap::EVENT_CAPACITY`] events; if the
    /// writer does not come round before it fills, the rest are lost,
    /// counted in [`Stats::heap_events`](crate::Stats::heap_events) and said
    /// in a warning.
    #[cfg(feature = "heap")]
    pub fn heap_events(mut self, on: bool) -> Self {
        self.heap_events = on;
        self
    }
}

/// Settings checked and resolved before anything is created.
pub(super) struct Checked {
    pub(super) hz: u32,
    pub(super) kernel_time: bool,
    pub(super) off_cpu: bool,
    /// The engine: as set, else `SPULSE_ENGINE`, else `Auto`.
    pub(super) engine: EngineChoice,
    pub(super) path: PathBuf,
    pub(super) rotation: Option<RotationPlan>,
    /// The flush interval: as set, else the default or the rotation interval
    /// if that is shorter.
    pub(super) flush: Duration,
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

impl RecorderBuilder {
    /// Ignore the `SPULSE_*` environment variables (`SPULSE_OUTPUT`,
    /// `SPULSE_FREQUENCY`, `SPULSE_ROTATE`, `SPULSE_RETAIN`,
    /// `SPULSE_KERNEL_TIME`, `SPULSE_OFF_CPU`, `SPULSE_ENGINE`): the `http`
    /// endpoint's temporary window records with the defaults into its own
    /// file, whatever the process was told.
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

    /// The environment variable `name` as text (`Ok(None)` if unset or the
    /// environment is ignored); a value that is not UTF-8 is refused, as any
    /// other value the setting does not take (it was taken for unset).
    fn env_text(&self, name: &'static str) -> Result<Option<String>, Error> {
        match self.env_var(name).map(|v| v.into_string()) {
            None => Ok(None),
            Some(Ok(v)) => Ok(Some(v)),
            Some(Err(v)) => Err(invalid(name, format!("{name}={v:?} is not UTF-8 text"))),
        }
    }

    /// Check every setting; resolve the frequency and the output path.
    pub(super) fn check(&self, path: &Path) -> Result<Checked, Error> {
        let hz = frequency(self)?;
        let kernel_time = match self.kernel_time {
            Some(on) => on,
            None => match self.env_text("SPULSE_KERNEL_TIME")? {
                Some(v) if v.trim() == "0" => false,
                Some(v) if v.trim() == "1" => true,
                Some(v) => {
                    return Err(invalid(
                        "SPULSE_KERNEL_TIME",
                        format!("SPULSE_KERNEL_TIME={v:?} is neither 0 (user time only) nor 1"),
                    ))
                }
                None => true,
            },
        };
        let off_cpu = match self.off_cpu {
            Some(on) => on,
            None => match self.env_text("SPULSE_OFF_CPU")? {
                Some(v) if v.trim() == "0" || v.trim().is_empty() => false,
                Some(v) if v.trim() == "1" => true,
                Some(v) => {
                    return Err(invalid(
                        "SPULSE_OFF_CPU",
                        format!("SPULSE_OFF_CPU={v:?} is neither 1 (record off-CPU time) nor 0"),
                    ))
                }
                None => false,
            },
        };
        let engine = match self.engine {
            Some(e) => e,
            None => match self.env_text("SPULSE_ENGINE")? {
                Some(v) if v.trim().is_empty() => EngineChoice::Auto,
                Some(v) => EngineChoice::from_name(v.trim()).ok_or_else(|| {
                    invalid(
                        "SPULSE_ENGINE",
                        format!(
                            "SPULSE_ENGINE={v:?} is none of auto, perf-event, thread-timer, process-timer, \
                             perf-stack"
                        ),
                    )
                })?,
                None => EngineChoice::Auto,
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
        if bytes > RecorderBuilder::MAX_RING_BYTES {
            return Err(invalid(
                "ring_capacity",
                format!(
                    "ring_capacity {slots} with max_stack_depth {depth} needs {} MiB for the sample ring, \
                 more than the limit of {} MiB; lower one of them",
                    bytes >> 20,
                    RecorderBuilder::MAX_RING_BYTES >> 20
                ),
            ));
        }
        let copy = self.user_stack_copy;
        if copy == 0 || !copy.is_multiple_of(8) || copy >= sys::perf_stack::MAX_STACK_COPY {
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
        Ok(Checked { hz, kernel_time, off_cpu, engine, path: first, rotation, flush })
    }

    /// The rotation interval and retention (builder values, else
    /// `SPULSE_ROTATE` and `SPULSE_RETAIN`), checked.
    fn rotation_settings(&self) -> Result<Option<(Duration, Option<usize>)>, Error> {
        let env = |name: &'static str| -> Result<Option<String>, Error> {
            Ok(self.env_text(name)?.filter(|v| !v.trim().is_empty()))
        };
        let (every, every_setting) = match self.rotate {
            Some(d) => (Some(d), "rotate"),
            None => match env("SPULSE_ROTATE")? {
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
            None => match env("SPULSE_RETAIN")? {
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
pub(super) const MAX_UNWIND_CACHES: usize = 64;
/// Most sample intervals one signal may stand for (a timer's overruns beyond
/// it are counted as lost): a thread that was descheduled for long must not
/// claim a huge weight for the one stack seen when it ran again.
pub(super) const MAX_SIGNAL_WEIGHT: u32 = 64;
/// Largest `ring_capacity`.
const MAX_RING_SLOTS: usize = ring::MAX_SLOTS;
/// Longest `flush_interval`.
const MAX_FLUSH_INTERVAL: Duration = Duration::from_secs(600);

fn frequency(b: &RecorderBuilder) -> Result<u32, Error> {
    let hz = match b.frequency_hz {
        Some(hz) => hz,
        None => match b.env_text("SPULSE_FREQUENCY")? {
            Some(v) => v.trim().parse::<u32>().map_err(|_| {
                invalid(
                    "SPULSE_FREQUENCY",
                    format!("SPULSE_FREQUENCY={v:?} is not a whole number of samples per second"),
                )
            })?,
            None => RecorderBuilder::DEFAULT_FREQUENCY_HZ,
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
