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
//!   them. It exits with CMD's status (128 + signal number if CMD was killed).
//! * The output holds `flock(LOCK_EX)` while recording, as the embedded
//!   recorder's spool does, so `follow` knows when it is complete.

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use clap::Args;
use spulse::{Header, SpoolWriter};

use super::export::{ExportArgs, Format};
use super::{FilterArgs, SymbolArgs};
use crate::merge::{MergeError, Source};
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
    #[arg(required = true, value_name = "CMD", allow_hyphen_values = true)]
    pub command: Vec<OsString>,
}

/// How often the collector looks for new data (and flushes the output).
const TICK: Duration = Duration::from_millis(20);

/// Record; returns the exit code (CMD's status). `embedded_lib` is the
/// preload library the binary carries (empty if none; see
/// [`crate::preload_lib`]).
pub fn run(args: &RecordArgs, embedded_lib: &[u8]) -> Result<i32, CliError> {
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
            _ => spulse::DEFAULT_FREQUENCY_HZ,
        },
    };
    // An explicit output is created before CMD starts, so a bad path costs nothing.
    let mut early_out = match &args.output {
        Some(p) => {
            Some((create_new(p).map_err(|e| CliError::other(format!("{}: {e}", p.display())))?, p.clone()))
        }
        None => None,
    };
    let dir = HandoffDir::create()?;

    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) only changes who adopts this
    // process's orphaned descendants.
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

    let mut collector =
        Collector { dir: dir.path.clone(), entries: BTreeMap::new(), done: Vec::new(), seen: HashSet::new() };
    let pidfd = pidfd_open(cmd_pid);
    let mut cmd_status: Option<i32> = None;
    // Set once writing the output failed: merging stops, the tree stays
    // supervised (reaped, signals forwarded) until it exits.
    let mut out_failed: Option<String> = None;
    loop {
        if let Some(sig) = take_signal() {
            forward_signal(sig);
        }
        reap(cmd_pid, &mut cmd_status);
        let tree_gone = cmd_status.is_some() && !have_children();
        collector.scan();
        let mut step = |collector: &mut Collector, out_failed: &mut Option<String>| {
            if out_failed.is_none() {
                if let Err(e) = collector.tick(Some(&mut out)).and_then(|()| out.flush()) {
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
                let _ = collector.tick(None);
            }
        };
        step(&mut collector, &mut out_failed);
        if tree_gone && collector.all_done() {
            // One more look: a process may have created its spool just before exiting.
            collector.scan();
            step(&mut collector, &mut out_failed);
            if collector.all_done() {
                break;
            }
        }
        wait_tick(pidfd.as_ref(), cmd_status.is_none());
    }
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
    for w in &summary.warnings {
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
        Some(code) if status == 0 => code,
        _ => status,
    })
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
            files: vec![spool.to_path_buf()],
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

/// One per-process spool file and how far it got.
enum EntryState {
    /// Seen, header not readable yet.
    Waiting,
    /// Being merged.
    Open(Box<Source>),
}

/// A finished spool (merged and retired, or abandoned).
struct Done {
    pid: u32,
    path: PathBuf,
    samples: u64,
    dropped: u64,
    error: Option<String>,
    /// Not merged: writing the output had failed.
    discarded: bool,
}

struct Entry {
    path: PathBuf,
    /// The process's start time (`/proc/<pid>/stat` field 22) when first seen.
    starttime: Option<u64>,
    state: EntryState,
}

struct Collector {
    dir: PathBuf,
    /// By (pid, monotonic ns at the recorder's start): exec images of one pid in order.
    entries: BTreeMap<(u32, u64), Entry>,
    done: Vec<Done>,
    seen: HashSet<OsString>,
}

struct Summary {
    processes: usize,
    samples: u64,
    lost: u64,
    warnings: Vec<String>,
    /// Processes that left an `.error` file (could not record).
    unrecorded: usize,
    /// CPU time (user, system; microseconds) the recorded processes spent
    /// before the recorder started in them (from their stats files).
    before_us: (u64, u64),
}

impl Collector {
    /// Pick up new spool files.
    fn scan(&mut self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return };
        for e in rd.flatten() {
            let name = e.file_name();
            if self.seen.contains(&name) {
                continue;
            }
            let Some((pid, ns)) = parse_name(&name, "spool") else { continue };
            self.seen.insert(name);
            let path = e.path();
            // The directory is private (0700), but the recorded program is
            // untrusted: only a regular file of ours is read.
            if let Err(why) = check_entry(&path) {
                self.done.push(Done {
                    pid,
                    path,
                    samples: 0,
                    dropped: 0,
                    error: Some(format!("process {pid}: its spool was not read: {why}")),
                    discarded: false,
                });
                continue;
            }
            self.entries.insert(
                (pid, ns),
                Entry { path, starttime: proc_starttime(pid), state: EntryState::Waiting },
            );
        }
    }

    fn all_done(&self) -> bool {
        self.entries.is_empty()
    }

    /// Merge what every current spool gained into `out`; finish the spools
    /// whose process ended. Without `out` (writing it failed), drop every spool.
    fn tick(&mut self, out: Option<&mut SpoolWriter<File>>) -> Result<(), spulse::Error> {
        let Some(out) = out else {
            for ((pid, _), entry) in std::mem::take(&mut self.entries) {
                let _ = std::fs::remove_file(&entry.path);
                let path = entry.path;
                self.done.push(Done { pid, path, samples: 0, dropped: 0, error: None, discarded: true });
            }
            return Ok(());
        };
        let keys: Vec<(u32, u64)> = self.entries.keys().copied().collect();
        for (i, &(pid, ns)) in keys.iter().enumerate() {
            // Finished spools leave the map, and keys sort by (pid, ns): only
            // the oldest spool of a pid is merged. A later one is a later exec
            // image, and starts after this one is retired.
            if i > 0 && keys[i - 1].0 == pid {
                continue;
            }
            let superseded = keys.get(i + 1).is_some_and(|k| k.0 == pid);
            let entry = self.entries.get_mut(&(pid, ns)).expect("key from the map");
            // Decide "ended" before the last read: once it has ended, nothing
            // more can be appended, so the read below gets everything.
            let ended = superseded || !alive(pid, entry.starttime);
            if let EntryState::Waiting = entry.state {
                match Source::open(&entry.path, pid) {
                    Ok(s) => entry.state = EntryState::Open(Box::new(s)),
                    Err(e) if ended => {
                        let path = entry.path.clone();
                        self.entries.remove(&(pid, ns));
                        self.done.push(Done {
                            pid,
                            path,
                            samples: 0,
                            dropped: 0,
                            error: Some(format!("process {pid} left no readable spool: {e}")),
                            discarded: false,
                        });
                        continue;
                    }
                    Err(_) => continue,
                }
            }
            let EntryState::Open(src) = &mut entry.state else { continue };
            let failed = match src.pump(out) {
                Ok(()) => None,
                Err(MergeError::Source(msg)) => Some(msg),
                Err(MergeError::Output(e)) => return Err(e),
            };
            if failed.is_some() || ended {
                src.retire_all(out)?;
                let done = Done {
                    pid,
                    path: entry.path.clone(),
                    samples: src.samples,
                    dropped: src.dropped,
                    error: failed.map(|m| format!("process {pid}: stopped reading its spool: {m}")),
                    discarded: false,
                };
                // Its content is in the output now: free the disk space at once
                // (a long build runs through thousands of processes).
                let _ = std::fs::remove_file(&done.path);
                self.entries.remove(&(pid, ns));
                self.done.push(done);
            }
        }
        Ok(())
    }

    fn summary(&self) -> Summary {
        let mut pids = HashSet::new();
        let mut samples = 0;
        let mut lost = 0;
        let mut warnings = Vec::new();
        // What processes' recorders reported (`Stats::warnings`, a write
        // failure), grouped by message, with the pids that said it.
        let mut reported: Vec<(String, Vec<u32>)> = Vec::new();
        let mut discarded = 0u64;
        let mut before_us = (0u64, 0u64);
        for d in &self.done {
            if d.discarded {
                discarded += 1;
                continue;
            }
            pids.insert(d.pid);
            samples += d.samples;
            lost += d.dropped;
            if let Some(m) = &d.error {
                warnings.push(m.clone());
            }
            // Samples the process's own recorder lost (written at its exit),
            // and why it stopped writing, if it did.
            match read_small(&d.path.with_extension("stats")) {
                Ok(text) => {
                    let (first, rest) = text.split_once('\n').unwrap_or((&text, ""));
                    let field = |n| first.split_whitespace().nth(n).and_then(|v| v.parse::<u64>().ok());
                    if let Some(l) = field(1) {
                        lost += l;
                    }
                    // Bounded: a process's CPU time before its constructor
                    // is under a day, and the sum cannot overflow.
                    let day = 86_400_000_000;
                    before_us.0 += field(2).unwrap_or(0).min(day);
                    before_us.1 += field(3).unwrap_or(0).min(day);
                    for w in rest.lines().filter(|l| !l.trim().is_empty()).take(16) {
                        let w: String = w.chars().filter(|c| !c.is_control()).take(400).collect();
                        match reported.iter_mut().find(|(m, _)| *m == w) {
                            Some((_, pids)) => pids.push(d.pid),
                            None => reported.push((w, vec![d.pid])),
                        }
                    }
                }
                Err(None) => {}
                Err(Some(why)) => {
                    warnings.push(format!("process {}: its stats file was not read: {why}", d.pid))
                }
            }
        }
        for (w, pids) in reported {
            warnings.push(match pids.as_slice() {
                [one] => format!("process {one}: {w}"),
                many => format!("{} processes (first {}): {w}", many.len(), many[0]),
            });
        }
        if discarded > 0 {
            warnings.push(format!(
                "{discarded} process spool{} not merged (writing the output had failed)",
                if discarded == 1 { " was" } else { "s were" }
            ));
        }
        // Processes that could not record, grouped by reason: a full
        // directory gives the same reason for every process of a big tree.
        let mut unrecorded: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                if let Some((pid, _)) = parse_name(&e.file_name(), "error") {
                    let why = match read_small(&e.path()) {
                        Ok(text) if !text.trim().is_empty() => text.trim().to_string(),
                        Ok(_) | Err(None) => empty_reason(&self.dir),
                        Err(Some(why)) => format!("its error file was not read: {why}"),
                    };
                    unrecorded.entry(why).or_default().push(pid);
                }
            }
        }
        let mut count = 0;
        for (why, mut who) in unrecorded {
            count += who.len();
            who.sort_unstable();
            if let [pid] = who[..] {
                warnings.push(format!("process {pid} was not recorded: {why}"));
            } else {
                let shown: Vec<String> = who.iter().take(10).map(u32::to_string).collect();
                let more = if who.len() > 10 { ", ..." } else { "" };
                warnings.push(format!(
                    "{} processes were not recorded (pids {}{more}): {why}",
                    who.len(),
                    shown.join(", ")
                ));
            }
        }
        Summary { processes: pids.len(), samples, lost, warnings, unrecorded: count, before_us }
    }
}

/// `<pid>.<ns>.<ext>` with decimal numbers.
fn parse_name(name: &std::ffi::OsStr, ext: &str) -> Option<(u32, u64)> {
    let name = name.to_str()?;
    let stem = name.strip_suffix(ext)?.strip_suffix('.')?;
    let (pid, ns) = stem.split_once('.')?;
    Some((pid.parse().ok()?, ns.parse().ok()?))
}

/// Field 22 of `/proc/<pid>/stat` (start time in clock ticks), `None` if the
/// process is gone or a zombie.
fn proc_starttime(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields are
    // counted after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Whether the process first seen with `starttime` still runs (not a zombie,
/// and its pid not taken by another process).
fn alive(pid: u32, starttime: Option<u64>) -> bool {
    match (starttime, proc_starttime(pid)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// Reap every exited child (CMD and adopted orphans) without blocking; note CMD's status.
fn reap(cmd_pid: u32, cmd_status: &mut Option<i32>) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes the status into the valid `status`.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
        if pid as u32 == cmd_pid {
            *cmd_status = Some(if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else if libc::WIFSIGNALED(status) {
                128 + libc::WTERMSIG(status)
            } else {
                1
            });
        }
    }
}

/// Whether any child (CMD or an adopted descendant) is still alive or unreaped.
fn have_children() -> bool {
    // SAFETY: an all-zero siginfo_t is a valid value for waitid to overwrite.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid with WNOHANG | WNOWAIT only inspects (reaps nothing) and
    // writes into the valid `info`.
    let r = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) };
    // waitid fails with ECHILD when there are no children at all.
    !(r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD))
}

/// A pidfd for CMD, so that the collector wakes as soon as it exits.
fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Some(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) })
}

/// Sleep one tick, waking early when CMD exits.
fn wait_tick(pidfd: Option<&std::os::fd::OwnedFd>, cmd_running: bool) {
    match pidfd {
        Some(fd) if cmd_running => {
            use std::os::fd::AsRawFd;
            let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, TICK.as_millis() as i32) };
        }
        _ => std::thread::sleep(TICK),
    }
}

/// The variable that tells the recorder where to keep its unwind-table verdicts.
const CFI_CACHE_ENV: &str = "SPULSE_CFI_CACHE";

/// Where the recorded processes keep the recorder's verdicts on unwind tables
/// (checked once per library build instead of at every process start): the
/// user's `SPULSE_CFI_CACHE` if set (empty turns the cache off), else
/// `$XDG_CACHE_HOME/spulse/cfi` or `~/.cache/spulse/cfi`. `None` leaves the
/// environment as it is.
fn cfi_cache_dir() -> Option<PathBuf> {
    if std::env::var_os(CFI_CACHE_ENV).is_some() {
        return None;
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| Path::new(d).is_absolute())
        .map(PathBuf::from)
        .or_else(|| {
        std::env::var_os("HOME")
            .filter(|d| Path::new(d).is_absolute())
            .map(|h| PathBuf::from(h).join(".cache"))
    })?;
    Some(base.join("spulse").join("cfi"))
}

/// Find CMD the way `execvp` will: as given if it holds a slash, else on `PATH`.
fn resolve_program(cmd: &OsString) -> Result<PathBuf, CliError> {
    use std::os::unix::ffi::OsStrExt;
    let shown = || cmd.to_string_lossy().into_owned();
    if cmd.as_bytes().contains(&b'/') {
        return Ok(PathBuf::from(cmd));
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    for dir in std::env::split_paths(&path) {
        let p = dir.join(cmd);
        if let Ok(m) = std::fs::metadata(&p) {
            use std::os::unix::fs::PermissionsExt;
            if m.is_file() && m.permissions().mode() & 0o111 != 0 {
                return Ok(p);
            }
        }
    }
    Err(CliError::input(format!("{}: command not found on PATH", shown())))
}

/// Refuse a statically linked ELF executable: it has no dynamic loader, so
/// `LD_PRELOAD` would be silently ignored and the spool would stay empty.
/// Scripts and anything that is not ELF are left to the kernel.
fn check_dynamic(program: &Path) -> Result<(), CliError> {
    use object::read::elf::{FileHeader, ProgramHeader};
    use std::io::Read;
    let shown = program.display();
    let mut f = File::open(program).map_err(|e| CliError::input(format!("{shown}: {e}")))?;
    // The ELF header and program headers are at the start of the file; 64 KiB
    // covers them for any real executable.
    let mut data = Vec::new();
    Read::by_ref(&mut f)
        .take(64 << 10)
        .read_to_end(&mut data)
        .map_err(|e| CliError::input(format!("{shown}: {e}")))?;
    if !data.starts_with(b"\x7fELF") {
        return Ok(());
    }
    fn interp<E: FileHeader>(data: &[u8]) -> Option<(bool, bool)> {
        let h = E::parse(data).ok()?;
        let endian = h.endian().ok()?;
        let phdrs = h.program_headers(endian, data).ok()?;
        let has_interp = phdrs.iter().any(|p| p.p_type(endian) == object::elf::PT_INTERP);
        let dynamic_object = h.e_type(endian) == object::elf::ET_DYN;
        let has_dynamic = phdrs.iter().any(|p| p.p_type(endian) == object::elf::PT_DYNAMIC);
        Some((has_interp, dynamic_object && has_dynamic))
    }
    let found = if data.get(4) == Some(&object::elf::ELFCLASS64) {
        interp::<object::elf::FileHeader64<object::Endianness>>(&data)
    } else {
        interp::<object::elf::FileHeader32<object::Endianness>>(&data)
    };
    match found {
        Some((false, _)) => Err(CliError::input(format!(
            "{shown} is statically linked (it names no ELF interpreter, so no dynamic loader runs in it): \
             LD_PRELOAD cannot load spulse into it and nothing would be recorded. Record a dynamically \
             linked build, or link spulse into the program and call spulse::start"
        ))),
        _ => Ok(()),
    }
}

/// Create `path` with mode 0600 (like an embedded recorder's spool), failing
/// if anything exists there (never overwrite, never follow a symlink).
fn create_new(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
}

/// `<program>-<pid>.spool` in the current directory, or `<program>-<pid>-N.spool`.
fn default_output(cmd: &OsString, pid: u32) -> Result<(File, PathBuf), CliError> {
    let program =
        Path::new(cmd).file_name().map_or_else(|| "spulse".into(), |n| n.to_string_lossy().into_owned());
    for n in 0..1000 {
        let name =
            if n == 0 { format!("{program}-{pid}.spool") } else { format!("{program}-{pid}-{n}.spool") };
        let path = PathBuf::from(name);
        match create_new(&path) {
            Ok(f) => return Ok((f, path)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(CliError::other(format!("{}: {e}", path.display()))),
        }
    }
    Err(CliError::other(format!("no free output name for {program}-{pid}.spool in the current directory")))
}

/// Prefix of the collector's private directories in `TMPDIR` (a new name:
/// directories of this prefix are locked while their collector runs, which
/// is what makes the clean-up of stale ones safe).
const HANDOFF_PREFIX: &str = "spulse-rec-";

/// A stale directory is removed only once it has not changed for this long
/// (a collector locks its directory microseconds after creating it).
const STALE_AFTER: Duration = Duration::from_secs(5);

/// The collector's private directory: mode 0700 whatever the umask, locked
/// (`flock(LOCK_EX)` on a close-on-exec descriptor of the directory) while
/// the collector runs, removed when it ends. A collector that is SIGKILLed
/// leaves it unlocked: the recorded processes started after that see the lock
/// gone and do not record (the preloaded library checks it at start), and the
/// next `spulse record` of the same user removes it (`clean_stale_dirs`).
struct HandoffDir {
    path: PathBuf,
    /// Holds the lock.
    _lock: File,
}

impl HandoffDir {
    fn create() -> Result<HandoffDir, CliError> {
        let tmp = std::env::temp_dir();
        clean_stale_dirs(&tmp);
        let fail = |e: std::io::Error| {
            CliError::other(format!("cannot create the private directory in {}: {e}", tmp.display()))
        };
        let dir = tempfile::Builder::new().prefix(HANDOFF_PREFIX).tempdir_in(&tmp).map_err(fail)?;
        let path = dir.keep();
        let made = (|| {
            use std::os::unix::fs::PermissionsExt;
            // The umask may have taken bits from (or, with tempfile's mode,
            // left bits in) the mode: set it outright.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))?;
            let lock = open_dir(&path)?;
            rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)?;
            Ok(lock)
        })();
        match made {
            Ok(lock) => Ok(HandoffDir { path, _lock: lock }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&path);
                Err(fail(e))
            }
        }
    }
}

impl Drop for HandoffDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A directory, opened to lock it (never through a symlink, close-on-exec so
/// the recorded tree does not inherit the lock).
fn open_dir(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Remove the private directories that collectors of this user left in `tmp`
/// when they were killed: a directory of ours, named with our prefix, that
/// no collector holds locked and that has not changed for [`STALE_AFTER`].
fn clean_stale_dirs(tmp: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = std::fs::read_dir(tmp) else { return };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let now = std::time::SystemTime::now();
    for e in rd.flatten() {
        if !e.file_name().as_encoded_bytes().starts_with(HANDOFF_PREFIX.as_bytes()) {
            continue;
        }
        let path = e.path();
        let Ok(m) = std::fs::symlink_metadata(&path) else { continue };
        let changed = std::time::UNIX_EPOCH + Duration::from_secs(m.ctime().max(0) as u64);
        let quiet = now.duration_since(changed).is_ok_and(|d| d >= STALE_AFTER);
        if !m.is_dir() || m.uid() != me || !quiet {
            continue;
        }
        let Ok(dir) = open_dir(&path) else { continue };
        let same = dir.metadata().is_ok_and(|d| d.dev() == m.dev() && d.ino() == m.ino());
        if same && rustix::fs::flock(&dir, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok() {
            // remove_dir_all never follows symlinks inside.
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// Largest `.error` or `.stats` file read from the private directory.
const SMALL_FILE_MAX: u64 = 4096;

/// Whether `path` (in the private directory) is a regular file of ours;
/// otherwise what it is.
fn check_entry(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let t = m.file_type();
    if !t.is_file() {
        let what = if t.is_symlink() {
            "a symbolic link"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_dir() {
            "a directory"
        } else {
            "a device or socket"
        };
        return Err(format!("it is {what}, not a regular file"));
    }
    if m.uid() != me {
        return Err(format!("it belongs to user {}, not to this user", m.uid()));
    }
    Ok(())
}

use std::os::unix::fs::FileTypeExt;

/// Read a small file from the private directory: opened without following
/// a symlink or waiting on a FIFO, accepted only as a regular file of ours,
/// read up to [`SMALL_FILE_MAX`] bytes (the rest is cut, and said so).
/// `Err(None)` when there is no such file, `Err(Some(why))` when it was refused.
fn read_small(path: &Path) -> Result<String, Option<String>> {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path);
    let f = match f {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(Some("it is a symbolic link, not a regular file".into()))
        }
        Err(e) => return Err(Some(e.to_string())),
    };
    let m = f.metadata().map_err(|e| Some(e.to_string()))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !m.file_type().is_file() {
        let what = if m.file_type().is_fifo() { "a FIFO" } else { "not a regular file" };
        return Err(Some(format!("it is {what}")));
    }
    if m.uid() != me {
        return Err(Some(format!("it belongs to user {}, not to this user", m.uid())));
    }
    let mut buf = Vec::new();
    f.take(SMALL_FILE_MAX + 1).read_to_end(&mut buf).map_err(|e| Some(e.to_string()))?;
    let cut = buf.len() as u64 > SMALL_FILE_MAX;
    buf.truncate(SMALL_FILE_MAX as usize);
    let mut text = String::from_utf8_lossy(&buf).into_owned();
    if cut {
        text.push_str(&format!(" [cut at {SMALL_FILE_MAX} bytes of {}]", m.len()));
    }
    Ok(text)
}

/// What to say for an empty `.error` file: the library writes the reason in
/// one write, so an empty file means that write failed, most likely because
/// the directory's file system is full.
fn empty_reason(dir: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let full = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok().and_then(|c| {
        // SAFETY: all-zero bytes are a valid statvfs (plain integers) to overwrite.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a NUL-terminated path and a valid struct to fill.
        (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_bavail == 0)
    });
    match full {
        Some(true) => format!(
            "no reason could be written: the file system of {} (TMPDIR) is full",
            dir.parent().unwrap_or(dir).display()
        ),
        _ => "no reason was written (its error file is empty; was the file system of TMPDIR full?)".into(),
    }
}

/// The last of SIGINT, SIGTERM, SIGHUP received (0: none), for the main loop.
static SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
}

/// Catch SIGINT, SIGTERM and SIGHUP (the recorded command gets the default
/// dispositions back at exec).
fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: all-zero bytes are a valid sigaction to fill in.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = libc::SA_RESTART;
        // SAFETY: installs an async-signal-safe handler (one atomic store);
        // the old action is not needed.
        unsafe { libc::sigaction(sig, &sa, std::ptr::null_mut()) };
    }
}

fn take_signal() -> Option<i32> {
    let sig = SIGNAL.swap(0, std::sync::atomic::Ordering::SeqCst);
    (sig != 0).then_some(sig)
}

/// Pass `sig` on to the collector's children (CMD and the orphans it
/// adopted), which end the tree as they would have ended it unrecorded; the
/// collector keeps merging until they have exited. A SIGINT that the
/// terminal sent to the whole foreground process group (the collector's
/// group is the terminal's) already reached them and is not sent again.
fn forward_signal(sig: i32) {
    if sig == libc::SIGINT {
        // SAFETY: tcgetpgrp and getpgrp only read process state.
        let foreground = unsafe { libc::tcgetpgrp(libc::STDIN_FILENO) == libc::getpgrp() };
        if foreground {
            return;
        }
    }
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return };
    for t in tasks.flatten() {
        let Ok(list) = std::fs::read_to_string(t.path().join("children")) else { continue };
        for pid in list.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            // SAFETY: kill on a child of ours (unreaped, so its pid is not reused).
            unsafe { libc::kill(pid, sig) };
        }
    }
}
