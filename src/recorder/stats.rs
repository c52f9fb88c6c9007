//! What a recording produced and how it was asked to run: [`Stats`],
//! [`LostSamples`], [`KernelTime`], [`EngineChoice`], and the `<spool>.warnings`
//! file beside a spool ([`warnings_path`], [`write_warnings`]). The writer
//! thread fills these in; nothing here runs in the signal handler.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::Engine;

/// Which sampling engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum EngineChoice {
    /// perf events, else per-thread CPU timers, else the process timer.
    ///
    /// With perf events, the writer also watches the program's voluntary
    /// context switches (`getrusage`, every flush interval; preemptions
    /// are other tasks' doing and do not count): each switch schedules
    /// the perf events out and in, and re-arms their timers, which costs
    /// from a fraction of a microsecond to several on virtual machines. When
    /// the program switches more than [`SWITCH_HEAVY_PER_CPU_SECOND`] times
    /// per second of its CPU time (measured over at least 50 ms of its CPU
    /// time), the recorder moves to per-thread CPU timers, which the kernel
    /// checks at its scheduler tick and which cost nothing per switch; from
    /// then on samples come at most once per tick (`CONFIG_HZ`) per thread,
    /// each weighted by the periods it stands for, and kernel time is
    /// charged to the user stack that entered the kernel. It happens at most
    /// once, and [`Stats::warnings`] says when and why.
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
    /// user stack ([`RecorderBuilder::user_stack_copy`](crate::RecorderBuilder::user_stack_copy)) into a ring mapped
    /// from each event; no signal and no handler: the writer thread unwinds
    /// the copies. Threads that block signals are sampled too; threads created
    /// after start are covered from the next flush on. Fails if refused.
    PerfStack,
}

/// Voluntary context switches (the program blocking) per second of its CPU
/// time above which the automatic engine leaves the perf-event engine for
/// per-thread CPU timers (see [`EngineChoice::Auto`]). A CPU-bound program
/// blocks a handful of times per CPU-second; a server or a pipeline of
/// threads handing work to each other tens of thousands of times.
pub const SWITCH_HEAVY_PER_CPU_SECOND: u64 = 5_000;

impl EngineChoice {
    /// The choice named `name` (`auto`, `perf-event`, `thread-timer`,
    /// `process-timer`, `perf-stack`: the `SPULSE_ENGINE` values).
    pub fn from_name(name: &str) -> Option<EngineChoice> {
        Some(match name {
            "auto" => EngineChoice::Auto,
            "perf-event" => EngineChoice::PerfEvent,
            "thread-timer" => EngineChoice::ThreadCpuTimer,
            "process-timer" => EngineChoice::ProcessTimer,
            "perf-stack" => EngineChoice::PerfStack,
            _ => return None,
        })
    }
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
    /// User time only: switched off ([`RecorderBuilder::kernel_time`](crate::RecorderBuilder::kernel_time) or
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
    /// end). Their CPU time is missing from the profile, and `warnings`
    /// says so when this is not 0. Always 0 with the perf-stack engine,
    /// which sends no signal; under `spulse record`/LD_PRELOAD the
    /// perf-event engine's SIGTRAP is kept out of the masks the program sets
    /// with `pthread_sigmask`/`sigprocmask` (see README, "Signals the program
    /// owns").
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
    /// the program's, so dropped (never written). Told by the signal return
    /// trampoline on their stack: glibc's `__restore_rt` on x86_64, the
    /// vDSO's `__kernel_rt_sigreturn` on aarch64 (none dropped where there
    /// is no vDSO, as under qemu-user before 8.1).
    pub own_samples_dropped: u64,
    /// Perf-event descriptors the engine held: at most an eighth of the
    /// soft `RLIMIT_NOFILE` at start (the descriptor budget; see
    /// [`RecorderBuilder::engine`](crate::RecorderBuilder::engine)).
    pub descriptors: u64,
    /// What did not go as configured, one sentence each: an engine refused
    /// and the one that ran instead, kernel time refused, threads left
    /// without events, the profiling signal or the engine's descriptors taken
    /// over by the program, a rotation stepping over a taken segment name,
    /// off-CPU records lost. Empty when everything ran as asked. The same
    /// sentences reach the program while it records, as they are found:
    /// [`Guard::warnings`](crate::Guard::warnings) and
    /// [`RecorderBuilder::on_warning`](crate::RecorderBuilder::on_warning).
    /// (When writing the spool stopped, `finish` is an `Err` and
    /// [`RecorderError::WriteStopped`](crate::RecorderError::WriteStopped)
    /// holds them.) `spulse record` prints them.
    pub warnings: Vec<String>,
    /// Spool files written: 1, or with [`RecorderBuilder::rotate`](crate::RecorderBuilder::rotate) the number
    /// of segments created (deleted ones included).
    pub segments_written: u64,
    /// Segments deleted by [`RecorderBuilder::retain`](crate::RecorderBuilder::retain).
    pub segments_deleted: u64,
    /// CPU time of the recorder's writer thread (draining the ring, interning
    /// stacks, writing, its periodic checks): the part of the profiler's cost
    /// spent outside the sampled threads.
    pub writer_cpu: Duration,
    /// The lowest nice value the writer thread took while it fell behind the
    /// samples or the off-CPU mode's switch records (many runnable threads
    /// sharing the CPU with it), when it took
    /// one below its start's; a warning says so too. Only the writer's own
    /// priority changes, and only where `setpriority` allows it (root,
    /// `CAP_SYS_NICE` or `RLIMIT_NICE`).
    pub writer_nice: Option<i32>,
    /// Bytes of unwind tables (`.eh_frame`, `.eh_frame_hdr`) copied into the
    /// recorder's memory for the signal handler's unwinder, summed over the
    /// objects loaded while recording: every library's tables, and the main
    /// executable's search table when it had to be rebuilt (see
    /// `src/recorder/modules/cfi_check.rs`). Never the executable's `.eh_frame`.
    pub unwind_tables_copied: u64,
    /// Bytes of unwind tables the handler's unwinder reads where they are
    /// mapped, not copied: the main executable's (it stays mapped, read-only,
    /// for the life of the process). Not part of the recorder's memory.
    pub unwind_tables_mapped: u64,
    /// What the off-CPU mode ([`RecorderBuilder::off_cpu`](crate::RecorderBuilder::off_cpu)) saw; `None` when
    /// it was off or its events were refused (then a warning says why).
    pub off_cpu: Option<OffCpuStats>,
    /// What became of the heap events ([`RecorderBuilder::heap_events`](crate::RecorderBuilder::heap_events),
    /// feature `heap`); `None` when they were not asked for or another
    /// recorder took them (then a warning says so).
    pub heap_events: Option<HeapEventStats>,
}

/// What became of the heap events ([`Stats::heap_events`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeapEventStats {
    /// Heap records written (FORMAT.md, tag 10): sampled allocations and
    /// the frees of sampled blocks.
    pub written: u64,
    /// Events dropped because the sampler's ring of events was full (the
    /// writer did not come round in time; a warning says so).
    pub lost: u64,
}

/// What the off-CPU mode saw ([`Stats::off_cpu`]).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct OffCpuStats {
    /// Off-CPU interval records written (FORMAT.md, tag 9): one a wait, but
    /// for the short waits without a stack (under 5 ms, `[blocked, under 5
    /// ms]` or `[waiting for CPU]`), which are summed into one record per
    /// thread and state at each writer tick.
    pub intervals: u64,
    /// Waits measured (each switch-out paired with its switch-in, or closed
    /// when the recording stopped), summed or not.
    pub waits: u64,
    /// Of the intervals, those whose stack was captured (the others: a thread
    /// that woke before the writer's next tick saw it blocked, or whose
    /// capture failed, is charged to `[blocked]` alone, or to `[blocked, under
    /// 5 ms]` with its other short waits; a preempted thread
    /// to `[waiting for CPU]` on top of its last sampled stack).
    pub with_stack: u64,
    /// Stacks of blocked threads captured (kept or not): every wait found
    /// at least 5 ms long by a writer tick, and of the shorter ones about
    /// 100 a second (the writer's cost of the mode is mostly these).
    pub captures: u64,
    /// Captures given up because the thread was running when tried, or was
    /// switched in during the copy.
    pub captures_raced: u64,
    /// Captures the kernel refused (`/proc/self/task/<tid>/syscall` or
    /// `process_vm_readv`: a process that is not dumpable), and the last errno.
    pub captures_refused: u64,
    /// The errno of the last refused capture (0: none).
    pub refused_errno: i32,
    /// Context-switch records the kernel could not write (ring full).
    pub records_lost: u64,
}

impl Stats {
    /// Total samples lost.
    pub fn lost(&self) -> u64 {
        self.samples_lost.total()
    }
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
