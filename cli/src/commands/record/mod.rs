//! `spulse record [-F HZ] [-o PATH] [--] CMD [ARGS...]`: run CMD with
//! `libspulse_preload.so` loaded into it and into every process it starts, and
//! merge what they record into one spool.
//!
//! Design (README "Recording a command" has the user's view):
//! * The collector (this process) makes a private directory (mode 0700) and
//!   runs CMD with `LD_PRELOAD` naming the library and `SPULSE_RECORD_DIR`
//!   naming the directory. Each process, and each program a process `exec`s,
//!   records itself with the ordinary embedded recorder into
//!   `<pid>.<ns>.spool` there: same engines, same per-sample cost, and a
//!   process that is SIGKILLed keeps what it flushed (every 100 ms).
//! * The collector follows each of those spools with `Tail` (see
//!   [`crate::merge`]), remaps ids into one dense stream and appends it to the
//!   output, flushing every tick (20 ms), so the output is a valid spool at every
//!   moment and `spulse follow` works on it live. A per-process spool is
//!   untrusted input: garbage in it is a reader error for that one process.
//! * A process's spool is finished when the process is gone (or a zombie, or
//!   its pid now belongs to another process) or when a later spool of the same
//!   pid appears (it exec'd); then its modules are retired with a tag-7 record.
//! * The collector is a child subreaper: orphaned descendants are reparented to
//!   it, so it waits until the whole tree has exited, not only CMD, and reaps
//!   them. It exits with CMD's status; if CMD was killed by a signal, it ends killed by the same signal.
//! * The output holds `flock(LOCK_EX)` while recording, as the embedded
//!   recorder's spool does, so `follow` knows when it is complete.
//!
//! The parts: `launch.rs` (before CMD runs), `handoff.rs` (the private
//! directory), `process.rs` (the supervised tree and its signals),
//! `collector.rs` (merging each process's spool), `summary.rs` (what the
//! recording ends with).

mod collector;
mod handoff;
mod launch;
mod process;
mod summary;

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use clap::Args;
use spulse::{Header, SpoolWriter};

use collector::Collector;
use handoff::HandoffDir;
use launch::{cfi_cache_dir, check_dynamic, create_new, default_output, resolve_program, CFI_CACHE_ENV};
use process::{
    forward_signal, have_children, install_signal_handlers, only_daemons_left, pidfd_open, reap, take_signal,
    wait_tick,
};

use super::export::{ExportArgs, Format};
use super::{FilterArgs, SymbolArgs};
use crate::CliError;

/// Arguments of `spulse record`.
#[derive(Debug, Args)]
#[command(
    trailing_var_arg = true,
    after_help = "Examples:\n  spulse record -- make -j2\n  spulse record -o gz.spool --svg gz.svg -- gzip -k big.tar\n  spulse record -F 4999 --pprof app.pb.gz -- ./app --flag"
)]
pub struct RecordArgs {
    /// Samples per second of CPU time, per thread (1 to 100000; default
    /// `SPULSE_FREQUENCY` or 999).
    #[arg(short = 'F', long = "frequency", value_name = "HZ", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub frequency: Option<u32>,
    /// The spool to write (must not exist). Default: `<program>-<pid>.spool`
    /// in the current directory, with a suffix if that exists.
    #[arg(short = 'o', long = "output", value_name = "PATH")]
    pub output: Option<PathBuf>,
    /// Also write an SVG flame graph of the recording to OUT when the
    /// command ends (as `spulse export SPOOL -o OUT` would; the spool is
    /// written as well).
    #[arg(long, value_name = "OUT")]
    pub svg: Option<PathBuf>,
    /// Also write a gzipped pprof profile of the recording to OUT when the
    /// command ends (as `spulse export SPOOL --format pprof -o OUT` would).
    #[arg(long, value_name = "OUT")]
    pub pprof: Option<PathBuf>,
    /// Also record off-CPU time (sets `SPULSE_OFF_CPU=1` for CMD): where and
    /// how long each thread waited (blocked in a system call, or waiting for
    /// a CPU), from the kernel's context-switch records, with no signal sent
    /// and no privilege needed. View it with `spulse top --off-cpu` or
    /// `--wall`.
    #[arg(long)]
    pub off_cpu: bool,
    /// The command to record, and its arguments.
    #[arg(required = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// How often the collector looks for new data (and flushes the output).
const TICK: Duration = Duration::from_millis(20);

/// Record; returns how to end (CMD's status, or the signal that killed it). `embedded_lib` is the
/// preload library the binary carries (empty if none; see
/// [`crate::preload_lib`]).
pub fn run(args: &RecordArgs, embedded_lib: &[u8]) -> Result<Exit, CliError> {
    check_exports(args)?;
    let program = resolve_program(&args.command[0])?;
    check_dynamic(&program)?;
    // `_lib_dir`: a temporary directory holding the library, if it had to go to one.
    let (lib, _lib_dir) = crate::preload_lib::locate(embedded_lib)?;
    let hz = match args.frequency {
        Some(hz) => hz,
        None => match std::env::var("SPULSE_FREQUENCY") {
            Ok(v) if !v.trim().is_empty() => {
                v.trim().parse::<u32>().ok().filter(|h| (1..=100_000).contains(h)).ok_or_else(|| {
                    CliError::input(format!("SPULSE_FREQUENCY={v:?} is not a whole number from 1 to 100000"))
                })?
            }
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(CliError::input(format!("SPULSE_FREQUENCY={v:?} is not UTF-8 text")))
            }
            _ => spulse::RecorderBuilder::DEFAULT_FREQUENCY_HZ,
        },
    };
    // An explicit output is created before CMD starts, so a bad path costs nothing.
    let mut early_out = match &args.output {
        Some(p) => Some((create_new(p).map_err(|e| output_error(p, &e))?, p.clone())),
        None => None,
    };
    let dir = HandoffDir::create()?;

    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) only changes who adopts this process's orphaned descendants.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    // SIGINT, SIGTERM and SIGHUP are forwarded to the tree, which ends by
    // itself; the collector keeps merging until it has (see `forward_signal`).
    install_signal_handlers();

    let start_time_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    let mut preload = OsString::from(&lib);
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(":");
        preload.push(old);
    }
    let mut cmd = Command::new(&args.command[0]);
    if let Some(dir) = cfi_cache_dir() {
        cmd.env(CFI_CACHE_ENV, dir);
    }
    if args.off_cpu {
        cmd.env("SPULSE_OFF_CPU", "1");
    }
    // The C library's `posix_spawn` leaves its two internal signals (32, 33)
    // ignored in the child, and an ignored signal stays ignored across
    // `exec`: CMD would start with them ignored, as it does not from a
    // shell. Set them to their default before `exec` (a `pre_exec` also
    // makes the spawn a fork and exec).
    // SAFETY: the closure makes only rt_sigaction system calls, which are async-signal-safe, on a zeroed (SIG_DFL) action it owns.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            for sig in [32, 33] {
                let dfl = [0u64; 4];
                libc::syscall(libc::SYS_rt_sigaction, sig, dfl.as_ptr(), std::ptr::null_mut::<u64>(), 8);
            }
            Ok(())
        });
    }
    let child = cmd
        .args(&args.command[1..])
        .env("LD_PRELOAD", &preload)
        .env("SPULSE_RECORD_DIR", &dir.path)
        .env("SPULSE_FREQUENCY", hz.to_string())
        .env_remove("SPULSE_OUTPUT")
        // The collector reads one spool per process: no segments.
        .env_remove("SPULSE_ROTATE")
        .env_remove("SPULSE_RETAIN")
        .spawn()
        .map_err(|e| CliError::input(format!("cannot run {}: {e}", args.command[0].to_string_lossy())))?;
    let cmd_pid = child.id();
    drop(child); // reaped below with waitpid, together with adopted orphans

    let (file, out_path) = match early_out.take() {
        Some(x) => x,
        None => match default_output(&args.command[0], cmd_pid) {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: kill on the pid of our own unreaped child.
                unsafe { libc::kill(cmd_pid as i32, libc::SIGKILL) };
                return Err(e);
            }
        },
    };
    let out_shown = out_path.display().to_string();
    let shown = crate::display::escape(&out_shown);
    // Every failure to write the output names it, and exits 1 (README).
    let out_err = |e: &dyn std::fmt::Display| format!("{out_shown}: {e}");
    let lock_err = |e: std::io::Error| CliError::other(format!("{}: cannot lock: {e}", out_path.display()));
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .map_err(|e| lock_err(e.into()))?;
    let interval_us = (1_000_000 + hz as u64 / 2) / hz as u64;
    let mut out = SpoolWriter::new(file, Header { start_time_us, interval_us })
        .and_then(|mut o| o.flush().map(|()| o))
        .map_err(|e| {
            // SAFETY: kill on the pid of our own unreaped child.
            unsafe { libc::kill(cmd_pid as i32, libc::SIGKILL) };
            CliError::other(out_err(&e))
        })?;

    let mut collector = Collector {
        dir: dir.path.clone(),
        users: dir.users_path(),
        entries: BTreeMap::new(),
        done: Vec::new(),
        seen: HashSet::new(),
        live: Default::default(),
    };
    let pidfd = pidfd_open(cmd_pid);
    let mut cmd_status: Option<i32> = None;
    // Set once writing the output failed: merging stops, the tree stays
    // supervised (reaped, signals forwarded) until it exits.
    let mut out_failed: Option<String> = None;
    // Signals forwarded to the tree, the last of them, and when the second
    // came.
    let (mut signals, mut last_signal, mut second_at) = (0u32, 0i32, None);
    // When the first came, and whether the wait after it was explained.
    let (mut first_at, mut hinted) = (None, false);
    loop {
        if let Some(sig) = take_signal() {
            if forward_signal(sig) {
                signals += 1;
                last_signal = sig;
                if signals == 1 {
                    first_at = Some(std::time::Instant::now());
                }
                if signals == 2 {
                    second_at = Some(std::time::Instant::now());
                }
            }
        }
        reap(cmd_pid, &mut cmd_status);
        let mut tree_gone = cmd_status.is_some() && !have_children();
        if cmd_status.is_some() && !tree_gone {
            if let Some(n) = only_daemons_left() {
                tree_gone = true;
                let _ = writeln!(
                    std::io::stderr(),
                    "spulse: not waiting for {n} detached process{} (a session of its own, as daemons start): \
                     what {} wrote so far is merged",
                    if n == 1 { "" } else { "es" },
                    if n == 1 { "it" } else { "they" },
                );
            }
        }
        // A second signal forwarded: the collector stops waiting for a tree
        // that does not end, after a second of grace for one that is ending
        // (what it wrote so far is merged).
        let give_up = !tree_gone && second_at.is_some_and(|t| t.elapsed() >= GIVE_UP_GRACE);
        // A tree still running 2 s after the first signal (a child that
        // ignores it, or finishes its work first): say what is waited for
        // and how to stop waiting, once.
        if !tree_gone && signals == 1 && !hinted && first_at.is_some_and(|t| t.elapsed() >= HINT_AFTER) {
            hinted = true;
            let _ = writeln!(
                std::io::stderr(),
                "spulse: the signal was passed on; waiting for the command's processes to end \
                 (a second signal, such as Ctrl-C, stops waiting: they keep running, unrecorded)"
            );
        }
        collector.scan();
        let mut step = |collector: &mut Collector, out_failed: &mut Option<String>, ended: bool| {
            if out_failed.is_none() {
                if let Err(e) = collector.tick(Some(&mut out), ended).and_then(|()| out.flush()) {
                    let msg = out_err(&e);
                    let _ = writeln!(
                        std::io::stderr(),
                        "spulse: error: {}; recording stops here, waiting for the command to exit",
                        crate::display::escape(&msg)
                    );
                    *out_failed = Some(msg);
                }
            }
            if out_failed.is_some() {
                let _ = collector.tick(None, ended);
            }
        };
        step(&mut collector, &mut out_failed, false);
        print_live_warnings(&mut collector);
        if tree_gone || give_up {
            // One more look: a process may have created its spool just
            // before exiting. Then every spool is finished: no process of
            // the tree can still write (or, given up, none is waited for).
            collector.scan();
            step(&mut collector, &mut out_failed, true);
            // (A pass finishes the oldest spool of each pid: a later exec
            // image of one waits for the next.)
            while !collector.all_done() {
                step(&mut collector, &mut out_failed, true);
            }
            print_live_warnings(&mut collector);
            if give_up {
                let _ = writeln!(
                    std::io::stderr(),
                    "spulse: a second signal: stopped waiting for the command, which still runs (unrecorded from here)"
                );
            }
            break;
        }
        wait_tick(pidfd.as_ref(), cmd_status.is_none());
    }
    // Killed: the status a shell shows (128 + the signal), and the signal
    // to end with.
    let killed_by = cmd_status.filter(|&s| s < 0).map(|s| -s);
    let cmd_status = cmd_status.map(|s| if s < 0 { 128 - s } else { s });
    // Given up on a command still running: the status a signal gives.
    let cmd_status = cmd_status.or((last_signal != 0).then_some(128 + last_signal));
    let finished = match out_failed {
        Some(m) => Err(m),
        None => out
            .into_inner()
            .map_err(|e| out_err(&e))
            .and_then(|file| file.sync_all().map(|()| file).map_err(|e| out_err(&e))),
    };
    if let Ok(file) = &finished {
        let _ = rustix::fs::flock(file, rustix::fs::FlockOperation::Unlock);
    }

    let summary = collector.summary();
    let mut err = std::io::stderr().lock();
    // All of them beside the output; on stderr those not printed already.
    for w in &summary.fresh {
        let _ = writeln!(err, "spulse: warning: {}", crate::display::escape(w));
    }
    if !summary.warnings.is_empty() {
        // Beside the output, for `spulse info` (the spool has no place for them).
        let _ = spulse::write_warnings(&out_path, &summary.warnings);
    }
    let _ = writeln!(
        err,
        "spulse: recorded {} process{}, {} samples ({} lost) into {shown}\nspulse: next: spulse top {shown}   (or: spulse info {shown})",
        summary.processes,
        if summary.processes == 1 { "" } else { "es" },
        summary.samples,
        summary.lost,
    );
    let (user, sys) = summary.before_us;
    if user + sys > 0 {
        let _ = writeln!(
            err,
            "spulse: not sampled: {:.1} ms of CPU ({:.1} user, {:.1} system) spent before the recorder started \
             in {} (exec, dynamic loading, earlier constructors)",
            (user + sys) as f64 / 1000.0,
            user as f64 / 1000.0,
            sys as f64 / 1000.0,
            if summary.processes == 1 { "the process" } else { "the processes" },
        );
    }
    if summary.kernel_refused > 0 {
        let paranoid = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
            .ok()
            .map(|v| format!(" (perf_event_paranoid is {})", v.trim()))
            .unwrap_or_default();
        let _ = writeln!(
            err,
            "spulse: kernel time not sampled in {}: the kernel refused kernel-mode sampling{paranoid}; \
             as root, with CAP_PERFMON, or at perf_event_paranoid 1 or lower it is",
            if summary.kernel_refused == summary.kernel_known && summary.kernel_known == 1 {
                "the process".to_string()
            } else {
                format!("{} of {} processes", summary.kernel_refused, summary.kernel_known)
            },
        );
    }
    if summary.kernel_budget > 0 {
        let _ = writeln!(
            err,
            "spulse: kernel time not sampled in {}: the descriptor limit (ulimit -n) left no room for its \
             events (spulse takes at most an eighth of it, one per CPU); a larger limit lets it",
            if summary.kernel_budget == summary.kernel_known && summary.kernel_known == 1 {
                "the process".to_string()
            } else {
                format!("{} of {} processes", summary.kernel_budget, summary.kernel_known)
            },
        );
    }
    // The whole tree's CPU (every process of it was waited for once the
    // command was) against what the recording accounts for.
    if cmd_status.is_some() && last_signal == 0 {
        if let Some(line) = unaccounted_cpu(&summary, hz) {
            let _ = writeln!(err, "{line}");
        }
    }
    if let Err(m) = finished {
        return Err(CliError::other(format!(
            "writing the output failed: {m} (it holds what was merged before; the command exited with status {})",
            cmd_status.unwrap_or(1)
        )));
    }
    if summary.processes == 0 && summary.unrecorded > 0 {
        return Err(CliError::other(format!(
            "nothing was recorded: {} process{} could not record (see the warnings above); the command exited \
             with status {}",
            summary.unrecorded,
            if summary.unrecorded == 1 { "" } else { "es" },
            cmd_status.unwrap_or(1)
        )));
    }
    drop(err);
    let status = cmd_status.unwrap_or(1);
    let failed = write_exports(args, &out_path);
    // A failed export is reported; the exit status stays the command's own
    // unless that was success.
    Ok(match failed {
        Some(code) if status == 0 => Exit { code, killed_by: None },
        _ => Exit { code: status, killed_by },
    })
}

/// User CPU of the tree the recording does not account for, if it is at
/// least [`UNACCOUNTED_MIN_US`] and a fifth of the tree's: the line that says
/// so and where such time goes. The tree's user CPU is this process's
/// `RUSAGE_CHILDREN` (CMD and every descendant its parent or this subreaper
/// waited for); the recording accounts for a sampling interval per sample
/// and per lost sample, for the CPU the processes spent before their
/// recorders started, and for spulse's own (its start and writer thread in
/// each process, user and system). Kernel time is otherwise left out on the
/// tree's side (it is not sampled everywhere), so a recording that samples
/// it only counts more.
fn unaccounted_cpu(summary: &summary::Summary, hz: u32) -> Option<String> {
    // SAFETY: rusage is plain data; zero is a valid value to fill in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes the struct we pass.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) } != 0 {
        return None;
    }
    let tree_us =
        (ru.ru_utime.tv_sec as u64).saturating_mul(1_000_000).saturating_add(ru.ru_utime.tv_usec as u64);
    let interval_us = (1_000_000 + u64::from(hz) / 2) / u64::from(hz.max(1));
    let accounted = summary
        .samples
        .saturating_add(summary.lost)
        .saturating_mul(interval_us)
        .saturating_add(summary.before_us.0)
        .saturating_add(summary.own_us);
    let missing = tree_us.saturating_sub(accounted);
    if missing < UNACCOUNTED_MIN_US || missing.saturating_mul(5) < tree_us {
        return None;
    }
    Some(format!(
        "spulse: not seen: the command's processes used {:.2} s of user CPU, and the recording accounts for {:.2} s \
         (samples, lost samples, time before the recorders started, and spulse's own {:.2} s); the other {:.2} s \
         ran where no recorder could sample it: in processes the recorder could not enter (static, set-uid or \
         file-capability programs; programs started by raw system calls rather than the C library's fork and \
         exec, as Go's os/exec and raw clone() do), or in the last moments of processes that ended without the \
         C library's exit (Go programs)",
        tree_us as f64 / 1e6,
        accounted.min(tree_us) as f64 / 1e6,
        summary.own_us as f64 / 1e6,
        missing as f64 / 1e6,
    ))
}

/// The least unaccounted user CPU worth a line (200 ms).
const UNACCOUNTED_MIN_US: u64 = 200_000;

/// How `spulse record` ends: with CMD's exit code, or killed by the signal
/// that killed CMD ([`process::die_like`]; `code` is then 128 + it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub code: i32,
    pub killed_by: Option<i32>,
}

impl Exit {
    /// End the process so.
    pub fn end(self) -> ! {
        if let Some(sig) = self.killed_by {
            std::io::stderr().flush().ok();
            process::die_like(sig);
        }
        std::process::exit(self.code)
    }
}

/// How long the tree may run on after the first signal forwarded to it
/// before `record` says it waits, and how to stop waiting.
const HINT_AFTER: std::time::Duration = std::time::Duration::from_secs(2);

/// How long the tree has, after a second signal forwarded to it, before the
/// collector stops waiting for it.
const GIVE_UP_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Why the output `p` could not be created, with the way out where there is one.
fn output_error(p: &Path, e: &std::io::Error) -> CliError {
    let shown = crate::display::escape(&p.display().to_string()).into_owned();
    let why = match e.kind() {
        std::io::ErrorKind::AlreadyExists if p.is_dir() => {
            "is a directory: -o names the spool file to create".into()
        }
        std::io::ErrorKind::AlreadyExists => {
            "already exists: spulse record never overwrites a file (remove it, or choose another name)".into()
        }
        _ => e.to_string(),
    };
    CliError::other(format!("{shown}: {why}"))
}

/// Print, as they arrive, the warnings the recorded processes' recorders
/// found while the command runs (the program taking the engine's signal or
/// descriptors over, its spool's descriptor closed or reused, a full disk).
fn print_live_warnings(collector: &mut Collector) {
    let ws = collector.live_warnings();
    if ws.is_empty() {
        return;
    }
    let mut err = std::io::stderr().lock();
    for w in ws {
        let _ = writeln!(err, "spulse: warning: {}", crate::display::escape(&w));
    }
}

/// The exports `--svg` and `--pprof` ask for.
fn exports(args: &RecordArgs) -> impl Iterator<Item = (Format, &PathBuf)> {
    [(Format::Svg, &args.svg), (Format::Pprof, &args.pprof)]
        .into_iter()
        .filter_map(|(f, p)| Some((f, p.as_ref()?)))
}

/// Refuse, before the command starts, an export that could not be written:
/// into a directory that does not exist, onto the spool, or two exports onto
/// one file.
fn check_exports(args: &RecordArgs) -> Result<(), CliError> {
    let mut seen: Vec<&PathBuf> = Vec::new();
    for (format, path) in exports(args) {
        let shown = || crate::display::escape(&path.display().to_string()).into_owned();
        let flag = if format == Format::Svg { "--svg" } else { "--pprof" };
        if args.output.as_ref() == Some(path) || seen.contains(&path) {
            return Err(CliError::input(format!("{flag} {}: the same file as another output", shown())));
        }
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            return Err(CliError::input(format!("{flag} {}: no such directory {}", shown(), dir.display())));
        }
        // An export replaces an older export, never a recording (a spool or
        // a packed file: their magic begins with `SPULS`).
        // (Only a regular file is read, without blocking: `--svg /dev/stdout`
        // or a FIFO is never opened here.)
        use std::os::unix::fs::OpenOptionsExt;
        let mut head = [0u8; 5];
        let recording = std::fs::metadata(path).is_ok_and(|m| m.is_file())
            && std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
                .open(path)
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
                .is_ok_and(|()| &head == b"SPULS");
        if recording {
            return Err(CliError::input(format!(
                "{flag} {}: refusing to overwrite a recording (a spool or packed file) with an export",
                shown()
            )));
        }
        seen.push(path);
    }
    Ok(())
}

/// Write the `--svg` and `--pprof` exports of the finished spool; returns
/// the exit code of the first that failed (each failure is reported).
fn write_exports(args: &RecordArgs, spool: &Path) -> Option<i32> {
    let mut failed = None;
    for (format, path) in exports(args) {
        let export = ExportArgs {
            input: super::InputArgs { files: vec![spool.to_path_buf()] },
            format: Some(format),
            output: path.clone(),
            per_thread: false,
            per_process: false,
            filter: FilterArgs { thread: None, pid: None, from: None, to: None },
            time: super::TimeArgs::default(),
            symbols: SymbolArgs { symbols: Vec::new(), no_symbolize: false, split_unknown: false },
        };
        if let Err(e) = super::export::run(&export) {
            eprintln!("spulse: error: {}", crate::display::escape(&e.message));
            failed.get_or_insert(e.code);
        }
    }
    failed
}
