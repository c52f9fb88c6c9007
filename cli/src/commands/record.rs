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
    let dir = tempfile::Builder::new()
        .prefix("spulse-record-")
        .tempdir()
        .map_err(|e| CliError::other(format!("cannot create the private directory: {e}")))?;

    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) only changes who adopts this
    // process's orphaned descendants.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        // Ctrl-C reaches the whole foreground process group: the tree ends by
        // itself and the collector keeps merging until it has. (The handler is
        // reset in CMD by exec.)
        let flag = interrupted.clone();
        let _ = ctrlc::set_handler(move || flag.store(true, std::sync::atomic::Ordering::SeqCst));
    }

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
    let child = cmd
        .args(&args.command[1..])
        .env("LD_PRELOAD", &preload)
        .env("SPULSE_RECORD_DIR", dir.path())
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
    let lock_err = |e: std::io::Error| CliError::other(format!("{}: cannot lock: {e}", out_path.display()));
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        .map_err(|e| lock_err(e.into()))?;
    let interval_us = (1_000_000 + hz as u64 / 2) / hz as u64;
    let mut out = SpoolWriter::new(file, Header { start_time_us, interval_us })?;
    out.flush()?;

    let mut collector = Collector {
        dir: dir.path().to_path_buf(),
        entries: BTreeMap::new(),
        done: Vec::new(),
        seen: HashSet::new(),
    };
    let pidfd = pidfd_open(cmd_pid);
    let mut cmd_status: Option<i32> = None;
    loop {
        reap(cmd_pid, &mut cmd_status);
        let tree_gone = cmd_status.is_some() && !have_children();
        collector.scan();
        collector.tick(&mut out)?;
        out.flush()?;
        if tree_gone && collector.all_done() {
            // One more look: a process may have created its spool just before exiting.
            collector.scan();
            collector.tick(&mut out)?;
            if collector.all_done() {
                break;
            }
        }
        wait_tick(pidfd.as_ref(), cmd_status.is_none());
    }
    let _ = interrupted;
    out.flush()?;
    let file = out.into_inner()?;
    file.sync_all().map_err(|e| CliError::other(format!("{}: {e}", out_path.display())))?;
    let _ = rustix::fs::flock(&file, rustix::fs::FlockOperation::Unlock);

    let summary = collector.summary();
    let mut err = std::io::stderr().lock();
    for w in &summary.warnings {
        let _ = writeln!(err, "spulse: warning: {}", crate::display::escape(w));
    }
    if !summary.warnings.is_empty() {
        // Beside the output, for `spulse info` (the spool has no place for them).
        use std::os::unix::fs::OpenOptionsExt;
        let text: String = summary.warnings.iter().map(|w| w.replace('\n', " ") + "\n").collect();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(spulse::warnings_path(&out_path));
        if let Ok(mut f) = f {
            let _ = f.write_all(text.as_bytes());
        }
    }
    let out_shown = out_path.display().to_string();
    let shown = crate::display::escape(&out_shown);
    let _ = writeln!(
        err,
        "spulse: recorded {} process{}, {} samples ({} lost) into {shown}\nspulse: next: spulse top {shown}   (or: spulse info {shown})",
        summary.processes,
        if summary.processes == 1 { "" } else { "es" },
        summary.samples,
        summary.lost,
    );
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
    [(Format::Svg, &args.svg), (Format::Pprof, &args.pprof)].into_iter().filter_map(|(f, p)| Some((f, p.as_ref()?)))
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
            self.entries.insert(
                (pid, ns),
                Entry { path, starttime: proc_starttime(pid), state: EntryState::Waiting },
            );
        }
    }

    fn all_done(&self) -> bool {
        self.entries.is_empty()
    }

    /// Merge what every current spool gained; finish the spools whose process ended.
    fn tick(&mut self, out: &mut SpoolWriter<File>) -> Result<(), CliError> {
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
                Err(MergeError::Output(e)) => return Err(e.into()),
            };
            if failed.is_some() || ended {
                src.retire_all(out)?;
                let done = Done {
                    pid,
                    path: entry.path.clone(),
                    samples: src.samples,
                    dropped: src.dropped,
                    error: failed.map(|m| format!("process {pid}: stopped reading its spool: {m}")),
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
        // What processes' recorders reported (`Stats::warnings`), with how many said it.
        let mut reported: Vec<(String, Vec<u32>)> = Vec::new();
        for d in &self.done {
            pids.insert(d.pid);
            samples += d.samples;
            lost += d.dropped;
            if let Some(m) = &d.error {
                warnings.push(m.clone());
            }
            // Samples the process's own recorder lost (written at its exit).
            if let Ok(text) = std::fs::read_to_string(d.path.with_extension("stats")) {
                let mut lines = text.lines();
                let first = lines.next().unwrap_or("");
                if let Some(l) = first.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()) {
                    lost += l;
                }
                for w in lines.filter(|l| !l.trim().is_empty()).take(16) {
                    let w: String = w.chars().filter(|c| !c.is_control()).take(400).collect();
                    match reported.iter_mut().find(|(m, _)| *m == w) {
                        Some((_, pids)) => pids.push(d.pid),
                        None => reported.push((w, vec![d.pid])),
                    }
                }
            }
        }
        for (w, pids) in reported {
            warnings.push(match pids.as_slice() {
                [one] => format!("process {one}: {w}"),
                many => format!("{} processes (first {}): {w}", many.len(), many[0]),
            });
        }
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                if let Some((pid, _)) = parse_name(&e.file_name(), "error") {
                    let why = std::fs::read_to_string(e.path()).unwrap_or_default();
                    warnings.push(format!("process {pid} was not recorded: {}", why.trim()));
                }
            }
        }
        Summary { processes: pids.len(), samples, lost, warnings }
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

/// Create `path`, failing if anything exists there (never overwrite, never follow a symlink).
fn create_new(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .custom_flags(libc::O_CLOEXEC)
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
