//! Hostile programs and handoff directories under `LD_PRELOAD` and `spulse
//! record`: a program that closes every descriptor above 2 and opens files of
//! its own, entries of the private directory that are FIFOs, symlinks or huge
//! files, a full file system, signals, a killed collector, a process that
//! switches user, a `TMPDIR` that is not UTF-8.

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The library as `spulse record` finds it (built with the tool).
fn lib() -> PathBuf {
    let lib = Path::new(env!("CARGO_BIN_EXE_spulse")).parent().unwrap().join("deps/libspulse_preload.so");
    assert!(lib.is_file(), "{} is built with the tool", lib.display());
    lib
}

/// Run `cmd`, failing the test if it has not exited within `limit`.
fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start the command");
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!("{cmd:?} still running after {limit:?}; stderr: {}", stderr(&o));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The victim: burns CPU (so samples are taken), then closes every
/// descriptor from 3 up (`loop`: 3..1023 one by one; `range`:
/// `close_range(3, ~0U, 0)`), opens out0.txt..out2.txt and writes known
/// lines into them while burning more CPU. `burn SECS` only burns.
const VICTIM: &str = r#"
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
static volatile unsigned long sink;
static void burn(double secs) {
  struct timespec a, b; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
  for (;;) { for (int i = 0; i < 100000; i++) sink += i * i;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
    if ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9 > secs) break; }
}
int main(int argc, char **argv) {
  if (argc > 2 && strcmp(argv[1], "burn") == 0) { burn(atof(argv[2])); return 0; }
  burn(0.3);
  if (argc > 1 && strcmp(argv[1], "range") == 0) syscall(SYS_close_range, 3, ~0U, 0);
  else for (int fd = 3; fd < 1024; fd++) close(fd);
  FILE *f[3]; char name[32];
  for (int i = 0; i < 3; i++) {
    snprintf(name, sizeof name, "out%d.txt", i);
    f[i] = fopen(name, "w");
    if (!f[i]) return 2;
  }
  for (int k = 0; k < 10; k++) {
    burn(0.03);
    for (int i = 0; i < 3; i++) { fprintf(f[i], "file %d line %d\n", i, k); fflush(f[i]); }
  }
  for (int i = 0; i < 3; i++) fclose(f[i]);
  return 0;
}
"#;

fn victim(dir: &Path) -> PathBuf {
    compile_c(dir, "victim", VICTIM, &[])
}

/// Whether this test runs as root; if not, says SKIPPED with `why` (CI runs
/// as root: there it fails instead).
fn as_root(why: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(!in_ci(), "CI runs as root: {why}");
    eprintln!("SKIPPED: {why}");
    false
}

/// A CPU-time burner for the C programs below, `burn(seconds)` of the
/// calling thread's CPU (prepended to each by [`compile_c`]).
const BURN_C: &str = r#"
#define _GNU_SOURCE
#include <time.h>
static volatile unsigned long sink;
static void burn(double secs) {
  struct timespec a, b; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
  for (;;) { for (int i = 0; i < 100000; i++) sink += i * i;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    if ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9 > secs) break; }
}
"#;

/// `source` (with [`BURN_C`] before it) compiled with `cc -O1 flags` into
/// `dir/name`.
fn compile_c(dir: &Path, name: &str, source: &str, flags: &[&str]) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    let text =
        if source.contains("static void burn(") { source.to_string() } else { format!("{BURN_C}{source}") };
    std::fs::write(&src, text).unwrap();
    let exe = dir.join(name);
    let o = Command::new("cc").arg("-O1").args(flags).arg("-o").arg(&exe).arg(&src).output().expect("run cc");
    assert!(o.status.success(), "cc: {}", stderr(&o));
    exe
}

/// What the victim writes into out<i>.txt.
fn expected(i: usize) -> String {
    (0..10).map(|k| format!("file {i} line {k}\n")).collect()
}

fn check_victim_files(dir: &Path, what: &str) {
    for i in 0..3 {
        let got = std::fs::read(dir.join(format!("out{i}.txt"))).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&got),
            expected(i),
            "{what}: out{i}.txt must hold exactly the program's bytes"
        );
    }
}

/// The command, with a soft descriptor limit of 1024 (as most systems set
/// it, so the recorder's high descriptor is among those the loop closes).
fn limited(exe: &Path, arg: &str) -> Command {
    let mut c = Command::new(exe);
    c.arg(arg);
    // SAFETY: setrlimit is async-signal-safe; it lowers this child's own soft limit.
    unsafe {
        c.pre_exec(|| {
            let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl);
            rl.rlim_cur = rl.rlim_cur.min(1024);
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
            Ok(())
        });
    }
    c
}

/// Under `LD_PRELOAD`: the program's files hold exactly its bytes, the spool
/// stays a valid spool, and the loss is reported on stderr.
#[test]
fn a_program_closing_every_descriptor_keeps_its_files_under_ld_preload() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = victim(tmp.path());
    for mode in ["loop", "range"] {
        let dir = tmp.path().join(mode);
        std::fs::create_dir(&dir).unwrap();
        let spool = dir.join("v.spool");
        let mut c = limited(&exe, mode);
        c.current_dir(&dir)
            .env("LD_PRELOAD", lib())
            .env_remove("SPULSE_RECORD_DIR")
            .env("SPULSE_OUTPUT", &spool);
        let o = run_bounded(c, Duration::from_secs(60));
        assert!(o.status.success(), "{mode}: {:?} {}", o.status, stderr(&o));
        check_victim_files(&dir, mode);
        let err = stderr(&o);
        assert!(
            err.contains("closed or reused by the program") && err.contains("were lost"),
            "{mode}: the loss is reported: {err}"
        );
        let s = spulse::Snapshot::open(&spool).expect("the spool stays valid");
        assert!(s.samples().count() > 0, "{mode}: samples before the close are kept");
    }
}

/// Under `spulse record`: the same, and the summary says what happened.
#[test]
fn a_program_closing_every_descriptor_keeps_its_files_under_record() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = victim(tmp.path());
    for mode in ["loop", "range"] {
        let dir = tmp.path().join(mode);
        std::fs::create_dir(&dir).unwrap();
        let out = dir.join("r.spool");
        let mut c = limited(Path::new(env!("CARGO_BIN_EXE_spulse")), "record");
        c.current_dir(&dir).arg("-o").arg(&out).arg("--").arg(&exe).arg(mode);
        let o = run_bounded(c, Duration::from_secs(60));
        assert!(o.status.success(), "{mode}: {:?} {}", o.status, stderr(&o));
        check_victim_files(&dir, mode);
        let err = stderr(&o);
        assert!(
            err.contains("warning: process") && err.contains("closed or reused by the program"),
            "{mode}: the summary reports the taken spool: {err}"
        );
        spulse::Snapshot::open(&out).expect("the output is a valid spool");
    }
}

/// `spulse record` with `TMPDIR` set to `tmpdir`, in `cwd`.
fn record(cwd: &Path, tmpdir: &Path, args: &[&OsStr]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spulse"));
    c.current_dir(cwd).env("TMPDIR", tmpdir).arg("record").args(args);
    c
}

/// The collectors' private directories in `tmpdir` (not their `.users`
/// siblings: see [`users_dirs`]).
fn handoff_dirs(tmpdir: &Path) -> Vec<PathBuf> {
    spulse_rec_entries(tmpdir)
        .into_iter()
        .filter(|p| !p.as_os_str().as_bytes().ends_with(b".users"))
        .collect()
}

/// The `.users` directories a collector running as root makes beside its
/// private directory.
fn users_dirs(tmpdir: &Path) -> Vec<PathBuf> {
    spulse_rec_entries(tmpdir).into_iter().filter(|p| p.as_os_str().as_bytes().ends_with(b".users")).collect()
}

fn spulse_rec_entries(tmpdir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(tmpdir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().as_bytes().starts_with(b"spulse-rec"))
        .collect()
}

/// Under `umask 000` the private directory is 0700 and the output 0600.
#[test]
fn the_private_directory_is_0700_and_the_output_0600_whatever_the_umask() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o.spool");
    let script = "stat -c %a \"$SPULSE_RECORD_DIR\"";
    let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.args(["sh", "-c", script]);
    // SAFETY: umask is async-signal-safe and only changes this child's mask.
    unsafe {
        c.pre_exec(|| {
            libc::umask(0);
            Ok(())
        });
    }
    let o = run_bounded(c, Duration::from_secs(60));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "700");
    assert_eq!(std::fs::metadata(&out).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(handoff_dirs(tmp.path()).is_empty(), "removed at the end");
}

/// Entries the recorded program (or anyone who could write the directory)
/// puts there: a FIFO named as an error file and as a spool, a symlink to
/// `/dev/zero`, a 100 MB sparse error file. No hang, a bounded warning each.
#[test]
fn hostile_entries_in_the_private_directory_give_short_warnings() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o.spool");
    let script = "d=\"$SPULSE_RECORD_DIR\"; mkfifo \"$d/7777.1.error\"; mkfifo \"$d/7780.1.spool\"; \
                  ln -s /dev/zero \"$d/7778.1.error\"; truncate -s 100M \"$d/7779.1.error\"";
    let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.args(["sh", "-c", script]);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert!(o.status.success(), "{:?} {err}", o.status);
    assert!(err.len() < 20_000, "warnings are bounded ({} bytes)", err.len());
    for (pid, what) in [("7777", "FIFO"), ("7778", "symbolic link"), ("7780", "FIFO")] {
        assert!(
            err.lines().any(|l| l.contains(&format!("process {pid}")) && l.contains(what)),
            "process {pid} named as {what}: {err}"
        );
    }
    assert!(err.lines().any(|l| l.contains("process 7779") && l.contains("cut at 4096 bytes")), "{err}");
}

/// SIGTERM to `spulse record` reaches the command, which ends; the collector
/// finishes the output, removes its directory and exits with the command's
/// status (killed by SIGTERM: it ends killed by SIGTERM).
#[test]
fn sigterm_is_forwarded_and_the_directory_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o.spool");
    let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.args(["sleep", "60"]).stdout(Stdio::null()).stderr(Stdio::piped());
    // Its own process group, as when started by a service manager: the
    // signal reaches the collector alone.
    c.process_group(0);
    let mut child = c.spawn().unwrap();
    let t = Instant::now();
    while handoff_dirs(tmp.path()).is_empty()
        || std::fs::read_dir(&handoff_dirs(tmp.path())[0]).map_or(0, |d| d.count()) == 0
    {
        assert!(t.elapsed() < Duration::from_secs(30), "sleep started recording");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "spulse record ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGTERM), "the command's status: {status:?}");
    assert!(handoff_dirs(tmp.path()).is_empty(), "directory removed");
    spulse::Snapshot::open(&out).expect("a complete output");
}

/// A tmpfs of `size` at a new directory, or `None` (SKIPPED) when mounting is
/// not allowed here.
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let d = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0777"), "tmpfs"])
            .arg(d.path())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let why = "mounting a tmpfs (needs root)";
            assert!(!in_ci(), "{why} failed in CI");
            eprintln!("SKIPPED: a full file system: {why} is not allowed here");
            return None;
        }
        Some(Tmpfs(d))
    }

    fn path(&self) -> &Path {
        self.0.path()
    }

    /// Fill it up, leaving about `leave` bytes.
    fn fill(&self, leave: u64) {
        // SAFETY: all-zero bytes are a valid statvfs for statvfs to fill.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        let c = std::ffi::CString::new(self.path().as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path and a valid struct.
        assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
        let free = st.f_bavail * st.f_frsize;
        let n = free.saturating_sub(leave) as usize;
        let _ = std::fs::write(self.path().join("filler"), vec![1u8; n]);
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

/// The output's file system fills while the command runs: the error names the
/// output, exit code 1, and the collector still waits for the command (which
/// finishes its work: its marker file exists when `spulse record` exits).
#[test]
fn a_full_output_disk_exits_1_naming_the_file_after_the_tree_ended() {
    let Some(fs) = Tmpfs::mount("1m") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let exe = victim(tmp.path());
    fs.fill(4096);
    let out = fs.path().join("o.spool");
    let mark = tmp.path().join("mark");
    let script = format!("{} burn 2.5; echo done > {}", exe.display(), mark.display());
    let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.args(["sh", "-c", &script]);
    let o = run_bounded(c, Duration::from_secs(120));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&out.display().to_string()) && err.contains("No space left"), "{err}");
    assert!(mark.exists(), "the collector waited for the command to finish");
    assert!(handoff_dirs(tmp.path()).is_empty(), "directory removed");
}

/// A full `TMPDIR`: no process can record; one grouped warning with a reason
/// and exit code 1, not one empty warning per process and 0.
#[test]
fn a_full_tmpdir_gives_one_warning_with_a_reason_and_exit_1() {
    let Some(fs) = Tmpfs::mount("256k") else { return };
    fs.fill(0);
    let cwd = tempfile::tempdir().unwrap();
    let out = cwd.path().join("o.spool");
    let mut c = record(cwd.path(), fs.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.args(["sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do /bin/true; done"]);
    let o = run_bounded(c, Duration::from_secs(120));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("not recorded")).collect();
    assert_eq!(warnings.len(), 1, "one grouped warning: {err}");
    assert!(warnings[0].contains("21 processes") && warnings[0].contains("full"), "{err}");
    assert!(err.contains("nothing was recorded"), "{err}");
}

/// User-mode samples of the threads named `name` in the spool `out`.
fn user_samples_named(out: &Path, name: &str) -> u64 {
    let s = spulse::Snapshot::open(out).expect("the output is a valid spool");
    let d = s.definitions();
    s.samples()
        .filter(|smp| d.thread(smp.thread).name == name)
        .filter(|smp| {
            !matches!(d.frame(d.stack(smp.stack).frame), spulse::Frame::Absolute { kernel: true, .. })
        })
        .count() as u64
}

/// What a recorded program's stderr must never hold: the recorder's word on
/// a process it could not record, or the loader's on a library it could
/// not load.
fn assert_program_stderr_is_its_own(err: &str) {
    assert!(!err.contains("not recording"), "the recorder spoke on the program's stderr: {err}");
    assert!(!err.contains("cannot be preloaded"), "the loader could not load the library: {err}");
}

/// A process that switches from root to another user (groups, then group,
/// then user, as a daemon drops root), forks, and execs a program that
/// burns 0.2 s of CPU: the program is recorded, its samples in the output,
/// and nothing is said on its stderr. Before, the collector's directory
/// (0700, root's) was closed to it: it was not recorded and said so on the
/// program's stderr, once per process.
#[test]
fn a_process_that_switches_user_is_recorded_and_says_nothing() {
    if !as_root("switching user needs root") {
        return;
    }
    if !oracle("python3", &["python3", "-c", "import os"], "python3") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let exe = victim(tmp.path());
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = tmp.path().join("o.spool");
    let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    // (setpriv sets the user first and keeps its capabilities for the calling
    // thread only: see `setpriv_dropping_root_is_recorded`.)
    let switch = "import os, sys; os.setgroups([]); os.setgid(65534); os.setuid(65534); \
                  pid = os.fork(); \
                  pid or os.execv(sys.argv[1], sys.argv[1:]); \
                  sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))";
    c.args(["python3", "-c", switch]).arg(&exe).args(["burn", "0.2"]);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_program_stderr_is_its_own(&err);
    // 0.2 s of CPU at the default 999 Hz: about 200 user samples; at least
    // half (the program's start is not sampled, a busy machine delays).
    let got = user_samples_named(&out, "victim");
    assert!(got >= 100, "{got} samples of the program run as user 65534: {err}");
    // Nothing of the directories is left.
    assert_eq!(spulse_rec_entries(tmp.path()), Vec::<PathBuf>::new());
}

/// `setpriv` keeps capabilities for its calling thread only while it changes
/// user, then changes group: the C library makes each change in every thread
/// and aborts the process when one is refused, as the recorder's writer was
/// (SIGABRT, exit 134, under `spulse record` only). Now its recording is
/// finished around those calls, and the command it starts as another user
/// is recorded, saying nothing on its stderr.
#[test]
fn setpriv_dropping_root_is_recorded() {
    setpriv_victim_is_recorded(|_, spulse_record| spulse_record);
}

/// As root with `setpriv` (else SKIPPED, or failed in CI): `spulse record`
/// as `command` makes it (given the temporary directory, 0755, and the
/// tool's usual command there, which writes `o.spool`) runs the victim as
/// user 65534 through `setpriv`, burning 0.2 s. It must exit 0, leave the
/// program's stderr its own, and hold at least 100 of the victim's user
/// samples (about 200 at the default 999 Hz; its start is not sampled).
/// The temporary directory is returned for more checks.
fn setpriv_victim_is_recorded(command: impl FnOnce(&Path, Command) -> Command) -> Option<tempfile::TempDir> {
    if !as_root("switching user needs root") || !oracle("setpriv", &["setpriv", "--version"], "util-linux") {
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    let exe = victim(tmp.path());
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = tmp.path().join("o.spool");
    let mut c = command(tmp.path(), Command::new(env!("CARGO_BIN_EXE_spulse")));
    c.current_dir(tmp.path()).env("TMPDIR", tmp.path()).args(["record", "-o"]).arg(&out);
    c.args(["--", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&exe)
        .args(["burn", "0.2"]);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "setpriv and its command end well: {err}");
    assert_program_stderr_is_its_own(&err);
    let got = user_samples_named(&out, "victim");
    assert!(got >= 100, "{got} samples of the program setpriv ran as user 65534: {err}");
    Some(tmp)
}

/// Root's installed `spulse` (the library from the copy inside the binary,
/// no `XDG_CACHE_HOME`) writes the library where every user can load it,
/// `/var/cache/spulse/preload-<hash>/` (root's, mode 0755/0555): a command
/// run as another user by `setpriv` is recorded, and the loader says
/// nothing on its stderr. Under root's `~/.cache` (0700) the loader printed
/// "cannot be preloaded" there and the command went unrecorded.
#[test]
fn roots_library_copy_is_loadable_by_the_users_root_switches_to() {
    let Some(tmp) = setpriv_victim_is_recorded(|dir, _| {
        // Alone in its directory, so the embedded copy is used (not target/'s deps/).
        let bin = dir.join("spulse");
        if std::fs::hard_link(env!("CARGO_BIN_EXE_spulse"), &bin).is_err() {
            std::fs::copy(env!("CARGO_BIN_EXE_spulse"), &bin).unwrap();
        }
        let mut c = Command::new(&bin);
        c.env("HOME", dir.join("home")).env_remove("XDG_CACHE_HOME").env_remove("SPULSE_PRELOAD_LIB");
        c
    }) else {
        return;
    };
    // The copy is root's public one, not under HOME.
    let home_copies = std::fs::read_dir(tmp.path().join("home/.cache/spulse"))
        .map(|rd| rd.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("preload-")).count())
        .unwrap_or(0);
    assert_eq!(home_copies, 0, "the library went under HOME");
    let copies: Vec<PathBuf> = std::fs::read_dir("/var/cache/spulse")
        .unwrap()
        .map(|e| e.unwrap().path().join("libspulse_preload.so"))
        .filter(|p| p.is_file())
        .collect();
    assert!(!copies.is_empty(), "no copy in /var/cache/spulse");
    for p in copies {
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (0, 0o555), "{}", p.display());
    }
}

/// A program that clears its environment and then forks (Python's
/// `os.environ.clear()`): the child is recorded into the output like any
/// other, and no file appears in the program's working directory. Before,
/// the child, finding no `SPULSE_RECORD_DIR`, recorded itself into
/// `spulse-<pid>.spool` there, as a library preloaded by hand does.
#[test]
fn a_program_clearing_its_environment_before_a_fork_gets_no_files() {
    if !oracle("python3", &["python3", "-c", "import os"], "python3") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path().join("cwd");
    std::fs::create_dir(&cwd).unwrap();
    let out = tmp.path().join("o.spool");
    let mut c = record(&cwd, tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    // The child burns 0.2 s of CPU in Python (reading the clock every
    // millisecond or so: where the clock is a system call, a tighter loop
    // spends most of its time in the kernel) and ends with `_exit`.
    let script = "import os, sys, time; os.environ.clear(); pid = os.fork()\n\
                  if pid == 0:\n\
                  \x20   t = time.process_time()\n\
                  \x20   while time.process_time() - t < 0.2: sum(range(50000))\n\
                  \x20   os._exit(0)\n\
                  sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))";
    c.args(["python3", "-c", script]);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let left: Vec<_> = std::fs::read_dir(&cwd).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "files in the program's working directory: {left:?}");
    // 0.2 s at the default 999 Hz: about 200 user samples in the child.
    let s = spulse::Snapshot::open(&out).unwrap();
    let d = s.definitions();
    let mut by_pid: std::collections::HashMap<u32, u64> = Default::default();
    for smp in s.samples() {
        if !matches!(d.frame(d.stack(smp.stack).frame), spulse::Frame::Absolute { kernel: true, .. }) {
            *by_pid.entry(d.thread(smp.thread).pid).or_default() += 1;
        }
    }
    assert!(by_pid.values().any(|&n| n >= 100), "the forked child's samples are missing: {by_pid:?}; {err}");
}

/// `setuid` from a signal handler (async-signal-safe by POSIX) while the
/// program allocates: the interposer's check allocated, and a signal landing
/// inside `malloc` deadlocked the program on the allocator's lock. Exits 0
/// after 3 M allocations with thousands of handler runs.
const SETUID_IN_HANDLER: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <signal.h>
#include <sys/time.h>
static volatile long n;
static void h(int s){ (void)s; if (setuid(0)) _exit(5); n++; }
int main(){
  struct sigaction sa = {0}; sa.sa_handler = h; sa.sa_flags = SA_RESTART; sigaction(SIGALRM,&sa,0);
  struct itimerval it = {{0,500},{0,500}}; setitimer(ITIMER_REAL,&it,0);
  void *p[64] = {0};
  for (long i = 0; i < 3000000; i++) { int k = i & 63; free(p[k]); p[k] = malloc(16 + (i*7919) % 9000); }
  printf("done %ld handler runs\n", n);
  return 0;
}
"#;

#[test]
fn setuid_in_a_signal_handler_does_not_deadlock() {
    if !as_root("setuid(0) needs root") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c(tmp.path(), "sigsetuid", SETUID_IN_HANDLER, &[]);
    let out = tmp.path().join("u.spool");
    let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.arg(&exe);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("done "), "{err}");
}

/// A `TMPDIR` whose name is not UTF-8 still records.
#[test]
fn a_non_utf8_tmpdir_still_records() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = victim(tmp.path());
    let odd = tmp.path().join(OsStr::from_bytes(b"t\xffmp{x}"));
    std::fs::create_dir(&odd).unwrap();
    let out = tmp.path().join("o.spool");
    let mut c = record(tmp.path(), &odd, &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.arg(&exe).args(["burn", "0.3"]);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("recorded 1 process,"), "{err}");
    let s = spulse::Snapshot::open(&out).unwrap();
    assert!(s.samples().count() > 50, "{} samples", s.samples().count());
}

/// A command started in a new pid namespace with the system's `/proc`
/// (`unshare -pf`, no `--mount-proc`): its threads are listed there under
/// the outer namespace's ids, which its own perf events and timers do not
/// know; it is sampled all the same (before: no sample at all).
#[test]
fn a_program_in_a_new_pid_namespace_is_sampled() {
    if !as_root("a new pid namespace needs root here") {
        return;
    }
    if !oracle("unshare", &["unshare", "--version"], "util-linux") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let exe = victim(tmp.path());
    for off_cpu in [false, true] {
        let out = tmp.path().join(format!("ns-{off_cpu}.spool"));
        let mut args: Vec<&OsStr> = vec!["-o".as_ref(), out.as_os_str()];
        if off_cpu {
            args.push("--off-cpu".as_ref());
        }
        args.extend(["--", "unshare", "-pf"].map(OsStr::new));
        let mut c = record(tmp.path(), tmp.path(), &args);
        c.arg(&exe).args(["burn", "0.3"]);
        let o = run_bounded(c, Duration::from_secs(60));
        let err = stderr(&o);
        assert!(o.status.success(), "{err}");
        let s = spulse::Snapshot::open(&out).unwrap();
        let n = s.samples().count();
        assert!(n > 50, "off-CPU mode {off_cpu}: {n} samples of 0.3 s burnt in a new pid namespace; {err}");
    }
    // Two namespaces running pid 1 at the same time: the second spool of
    // pid 1 is not taken for an exec of the first, which went on being
    // written (before: the first was cut there and its later samples lost).
    let out = tmp.path().join("two.spool");
    let mut c = record(
        tmp.path(),
        tmp.path(),
        &["-o".as_ref(), out.as_os_str(), "--".as_ref(), "sh".as_ref(), "-c".as_ref()],
    );
    c.arg("unshare -pf \"$0\" burn 0.4 & sleep 0.1; unshare -pf \"$0\" burn 0.4; wait").arg(&exe);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("(0 lost)") && !err.contains("deleted"), "{err}");
    let n = spulse::Snapshot::open(&out).unwrap().samples().count();
    assert!(n > 500, "{n} samples of 2 x 0.4 s burnt; {err}");
}

/// Burns, enters a new user namespace (`unshare(CLONE_NEWUSER)`, which the
/// kernel allows only in a process of one thread), says how that went, burns
/// again; with `threaded` it first starts a thread of its own (then the call
/// fails with `EINVAL`, recorded or not). Exits 3 if the call failed.
const UNSHARER: &str = r#"
#define _GNU_SOURCE
#include <sched.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static void *idle(void *p) { (void)p; pause(); return 0; }
int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "threaded") == 0) { pthread_t t; pthread_create(&t, 0, idle, 0); }
  burn(0.25);
  int r = unshare(CLONE_NEWUSER);
  printf("unshare: %s\n", r ? strerror(errno) : "ok");
  burn(0.25);
  return r ? 3 : 0;
}
"#;

/// A program entering a user namespace (`unshare -U`, `nsenter -U`, rootless
/// sandboxes) does so under `spulse record` as without it: the recorder's
/// writer thread is out of the way for the call, and both halves of the
/// run are sampled. One with a thread of its own gets `EINVAL` as it would
/// unrecorded. (Before: `unshare: Invalid argument` under `record` only.)
#[test]
fn a_program_entering_a_user_namespace_is_not_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c(tmp.path(), "unsharer", UNSHARER, &["-pthread"]);
    let bare = Command::new(&exe).output().unwrap();
    if String::from_utf8_lossy(&bare.stdout).trim() != "unshare: ok" {
        assert!(!in_ci(), "user namespaces are allowed in CI (root)");
        eprintln!("SKIPPED: this machine refuses a new user namespace unrecorded too: {:?}", bare);
        return;
    }
    for (arg, want_out, want_code) in
        [("single", "unshare: ok", 0), ("threaded", "unshare: Invalid argument", 3)]
    {
        let out = tmp.path().join(format!("{arg}.spool"));
        let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
        c.arg(&exe).arg(arg);
        let o = run_bounded(c, Duration::from_secs(60));
        let err = stderr(&o);
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), want_out, "{arg}: {err}");
        assert_eq!(o.status.code(), Some(want_code), "{arg}: {err}");
        let s = spulse::Snapshot::open(&out).unwrap();
        // 0.25 s burnt on each side of the call, at 1,000 samples a
        // second of CPU: more than one side's worth means both were sampled.
        let n = s.samples().count();
        assert!(n > 300, "{arg}: {n} samples of 0.5 s burnt; {err}");
    }
}

/// Blocks SIGUSR1 and SIGCHLD (the daemon pattern: signals read
/// synchronously), burns, sends itself SIGUSR1 and waits for it with
/// `sigtimedwait`, then has a child exit and reads SIGCHLD from a
/// `signalfd`. Exits 0 when both arrive where it waits for them.
const SIGNAL_READER: &str = r#"
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
int main(void) {
  sigset_t s; sigemptyset(&s); sigaddset(&s, SIGUSR1); sigaddset(&s, SIGCHLD);
  sigprocmask(SIG_BLOCK, &s, 0);
  burn(0.1);
  struct timespec to = {5, 0}; siginfo_t si;
  kill(getpid(), SIGUSR1);
  if (sigtimedwait(&s, &si, &to) != SIGUSR1) { puts("no SIGUSR1"); return 1; }
  int fd = signalfd(-1, &s, SFD_CLOEXEC);
  pid_t p = fork();
  if (p == 0) { burn(0.05); _exit(4); }
  struct pollfd pf = {fd, POLLIN, 0};
  if (poll(&pf, 1, 5000) != 1) { puts("no SIGCHLD"); return 2; }
  waitpid(p, 0, 0);
  puts("both");
  return 0;
}
"#;

/// A signal the program blocks in its only thread, to read it with
/// `sigtimedwait` or a `signalfd`, reaches it there: the recorder's threads
/// block every signal. (Before: the writer thread did not, the kernel gave
/// the process's SIGUSR1 to it, and its default action killed the program.)
#[test]
fn signals_the_program_blocks_to_read_them_are_not_taken_by_the_recorder() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c(tmp.path(), "reader", SIGNAL_READER, &[]);
    for off_cpu in [false, true] {
        let out = tmp.path().join(format!("r-{off_cpu}.spool"));
        let mut args: Vec<&OsStr> = vec!["-o".as_ref(), out.as_os_str()];
        if off_cpu {
            args.push("--off-cpu".as_ref());
        }
        args.push("--".as_ref());
        let mut c = record(tmp.path(), tmp.path(), &args);
        c.arg(&exe);
        let o = run_bounded(c, Duration::from_secs(60));
        let err = stderr(&o);
        assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "both", "off-CPU {off_cpu}: {err}");
        assert_eq!(o.status.code(), Some(0), "off-CPU {off_cpu}: {err}");
    }
}

/// A command that leaves a daemon behind (a process in a session of its
/// own, as `ssh-agent` or `setsid CMD &` start) ends `record` when it ends,
/// as a shell does not wait for the daemon either; one that leaves a
/// background job of its own session is waited for. (Before: `record` waited
/// for the daemon, forever for `ssh-agent`.)
#[test]
fn a_daemon_left_behind_is_not_waited_for() {
    let tmp = tempfile::tempdir().unwrap();
    let pidfile = tmp.path().join("daemon.pid");
    let out = tmp.path().join("d.spool");
    // The daemon execs a program after `record` has ended: that process
    // says nothing on the daemon's stderr (before: "cannot use the directory").
    let daemon_err = tmp.path().join("daemon.err");
    let script = format!(
        "(setsid sh -c 'sleep 1; /bin/true; sleep 30' </dev/null >/dev/null 2>'{}' & echo $! > '{}'); echo started",
        daemon_err.display(),
        pidfile.display()
    );
    let mut c = record(
        tmp.path(),
        tmp.path(),
        &["-o".as_ref(), out.as_os_str(), "--".as_ref(), "sh".as_ref(), "-c".as_ref()],
    );
    c.arg(&script);
    let t = Instant::now();
    let o = run_bounded(c, Duration::from_secs(60));
    let took = t.elapsed();
    let daemon: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let said = std::fs::read_to_string(&daemon_err).unwrap_or_default();
    // SAFETY: kill of the daemon's process group (its own session) this test started.
    unsafe { libc::kill(-daemon, libc::SIGKILL) };
    assert_eq!(said, "", "the daemon's stderr stays its own");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(took < Duration::from_secs(20), "record waited {took:?} for the daemon: {err}");
    assert!(err.contains("not waiting for 1 detached process"), "{err}");
    spulse::Snapshot::open(&out).unwrap();
    // A background job of the command's own session is still waited for.
    let mut c = record(
        tmp.path(),
        tmp.path(),
        &["-o".as_ref(), tmp.path().join("j.spool").as_os_str(), "--".as_ref()],
    );
    c.args(["sh", "-c", "(sleep 1 &); echo started"]);
    let t = Instant::now();
    let o = run_bounded(c, Duration::from_secs(60));
    assert!(t.elapsed() >= Duration::from_millis(900), "the background sleep was waited for: {}", stderr(&o));
    assert!(!stderr(&o).contains("detached"), "{}", stderr(&o));
}

/// A stand-in for a Go program: the Go linker's build id note, and, as Go's
/// runtime does, its own SIGTRAP and SIGPROF handlers installed by raw
/// system calls over anyone's (x86-64). Exits 99 if one of those signals
/// reaches it, 0 after burning 0.3 s.
const GO_LIKE: &str = r#"
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
__asm__(".section .note.go.buildid,\"a\",@note\n.balign 4\n.long 4\n.long 8\n.long 4\n.asciz \"Go\"\n.byte 0\n.ascii \"abcdefgh\"\n.previous\n");
static void stolen(int sig) { (void)sig; write(2, "stolen signal\n", 14); _exit(99); }
extern void restorer(void);
__asm__(".text\nrestorer:\nmov $15, %rax\nsyscall\n");
struct ksa { void *h; unsigned long flags; void *restorer; unsigned long mask; };
int main(void) {
  /* As Go's runtime: its own handlers by raw system calls, over anyone's. */
  for (int sig = 1; sig < 32; sig++) {
    if (sig == SIGKILL || sig == SIGSTOP || sig == SIGCHLD || sig == SIGWINCH || sig == SIGURG) continue;
    if (sig != SIGTRAP && sig != SIGPROF) continue;
    struct ksa a; memset(&a, 0, sizeof a); a.h = (void *)stolen; a.flags = 0x04000000 /* SA_RESTORER */; a.restorer = (void *)restorer;
    syscall(SYS_rt_sigaction, sig, &a, 0, 8);
  }
  burn(0.3);
  return 0;
}
"#;

/// A Go program is recorded with the perf-stack engine, which sends no
/// signal: its runtime takes every signal for itself, and a signal engine's
/// SIGTRAP or SIGPROF reached it (Go programs built with cgo, and `go
/// build` itself, died of "SIGTRAP: trace trap" or "unexpected return pc"
/// under `spulse record`).
#[cfg(target_arch = "x86_64")]
#[test]
fn a_go_program_gets_no_signal_of_ours() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c(tmp.path(), "go_like", GO_LIKE, &[]);
    let out = tmp.path().join("go.spool");
    let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.arg(&exe);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let n = spulse::Snapshot::open(&out).unwrap().samples().count();
    assert!(n > 50, "{n} samples of 0.3 s burnt: {err}");
}

/// Burns 0.2 s, enters a seccomp mode (`s`: strict, through `prctl`; `f`:
/// an allow-list filter that kills the process on anything else, through
/// `syscall(SYS_seccomp)` on every thread, after libseccomp's two probes;
/// `k`: a filter killing on `perf_event_open` and `timer_create`, then a
/// forked child that must exit 0), burns some more, says "done"
/// and exits 7 (strict: by the raw `exit` system call, all it allows; a
/// filter: by `_exit`).
const SECCOMPER: &str = r#"
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#define ALLOW(nr) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 1), BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)
int main(int argc, char **argv) {
  burn(0.2);
  prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
  if (argv[1][0] == 's') {
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_STRICT)) return 1;
  } else if (argv[1][0] == 'k') {
    /* A filter that kills on what only a recorder would call, then a fork:
       the child inherits it and must not start a recorder. */
    struct sock_filter f[] = { BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_perf_event_open, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_timer_create, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW), BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS) };
    struct sock_fprog p = { sizeof f / sizeof f[0], f };
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &p, 0, 0)) return 1;
    pid_t c = fork();
    if (c == 0) { burn(0.1); _exit(0); }
    int st = 0;
    waitpid(c, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return 3;
  } else {
    struct sock_filter f[] = { BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
      ALLOW(SYS_read), ALLOW(SYS_write), ALLOW(SYS_exit), ALLOW(SYS_exit_group), ALLOW(SYS_rt_sigreturn),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS) };
    struct sock_fprog p = { sizeof f / sizeof f[0], f };
    /* libseccomp's probes first: refused, they change nothing. */
    syscall(SYS_seccomp, SECCOMP_SET_MODE_STRICT, 1, NULL);
    syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, NULL);
    burn(0.2);
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &p)) return 1;
  }
  /* (No clock: strict mode allows no clock_gettime of CPU time.) */
  for (unsigned long i = 0; i < 200000000UL; i++) sink += i;
  write(1, "done\n", 5);
  /* Strict mode allows only the thread's exit; a filter, the C library's
     _exit (interposed: it must make no other system call then). */
  if (argv[1][0] == 's') syscall(SYS_exit, 7);
  _exit(7);
}
"#;

/// A program that enters a seccomp mode runs on as unrecorded: its
/// recording is finished just before (what came before is kept, a warning
/// says why it stops). Before, strict mode killed it at the next sample
/// (SIGSEGV) and an allow-list filter with SIGSYS.
#[test]
fn a_program_entering_seccomp_is_not_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c(tmp.path(), "seccomper", SECCOMPER, &[]);
    for mode in ["s", "f", "k"] {
        let out = tmp.path().join(format!("{mode}.spool"));
        let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
        c.arg(&exe).arg(mode);
        let o = run_bounded(c, Duration::from_secs(60));
        let err = stderr(&o);
        assert_eq!(String::from_utf8_lossy(&o.stdout), "done\n", "{mode}: {:?} {err}", o.status);
        assert_eq!(o.status.code(), Some(7), "{mode}: {err}");
        assert!(err.contains("entered a seccomp mode"), "{mode}: {err}");
        let n = spulse::Snapshot::open(&out).unwrap().samples().count();
        // Strict and the forking filter: 0.2 s burnt before; the allow-list
        // filter: 0.4 s (the probes stop nothing).
        let least = if mode == "f" { 300 } else { 100 };
        assert!(n > least, "{mode}: {n} samples of the burn before; {err}");
    }
}

/// A minimal debugger: runs its arguments under ptrace, passes every signal
/// on, prints how many signal stops there were (not the exec's SIGTRAP).
const TRACER: &str = r#"
#include <signal.h>
#include <stdio.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
#include <unistd.h>
/* Runs argv[1..] under ptrace as a debugger would: every signal the tracee
   gets stops it for the tracer, which passes it on. Prints how many signal
   stops there were (the exec's own SIGTRAP not counted). */
int main(int argc, char **argv) {
  pid_t p = fork();
  if (p == 0) { ptrace(PTRACE_TRACEME, 0, 0, 0); execv(argv[1], argv + 1); _exit(127); }
  int st, stops = 0, first = 1;
  while (waitpid(p, &st, 0) == p) {
    if (WIFEXITED(st) || WIFSIGNALED(st)) break;
    int sig = WSTOPSIG(st);
    if (first && sig == SIGTRAP) { first = 0; sig = 0; } else stops++;
    ptrace(PTRACE_CONT, p, 0, (void *)(long)sig);
  }
  printf("stops %d\n", stops);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
}
"#;

/// A program run under a debugger (a tracer at start) gets no signal of
/// ours: each stopped it for the tracer, and gdb took the perf-event
/// engine's SIGTRAP for its own and stopped the program ("received signal
/// SIGTRAP"). It is sampled all the same (the perf-stack engine).
#[test]
fn a_traced_program_gets_no_signal_of_ours() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = victim(tmp.path());
    let exe = compile_c(tmp.path(), "tracer", TRACER, &[]);
    let out = tmp.path().join("t.spool");
    let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.arg(&exe).arg(&victim).args(["burn", "0.3"]);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "stops 0", "{err}");
    let s = spulse::Snapshot::open(&out).unwrap();
    let n = s.samples().count();
    assert!(n > 100, "{n} samples of 0.3 s burnt under a tracer: {err}");
}

/// A SIGKILLed `spulse record` leaves its directory: processes the orphaned
/// tree starts afterwards do not record into it (it stops growing), and the
/// next `spulse record` removes it.
#[test]
fn a_killed_collector_leaves_a_directory_the_next_run_removes() {
    let tmp = tempfile::tempdir().unwrap();
    let pidfile = tmp.path().join("loop.pid");
    let script = format!("echo $$ > {}; while :; do /bin/true 2>/dev/null; done", pidfile.display());
    let out = tmp.path().join("o.spool");
    let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
    c.args(["sh", "-c", &script]).stdout(Stdio::null()).stderr(Stdio::null());
    let mut child = c.spawn().unwrap();
    let t = Instant::now();
    while !pidfile.exists() || std::fs::read_to_string(&pidfile).unwrap().trim().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    child.kill().unwrap();
    child.wait().unwrap();
    let loop_pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    let dirs = handoff_dirs(tmp.path());
    assert_eq!(dirs.len(), 1, "the killed collector's directory is left");
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert_eq!(users_dirs(tmp.path()).len(), usize::from(root), "root's collector makes a .users directory");
    // New processes' spools (a process already recording may still add its
    // `.warnings` beside its spool: the shell's loop switches context often
    // enough for its recorder to change engine and say so).
    let count = || {
        std::fs::read_dir(&dirs[0]).map_or(0, |d| {
            d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".spool")).count()
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let before = count();
    std::thread::sleep(Duration::from_millis(1000));
    let after = count();
    // SAFETY: kill the orphaned loop we started.
    unsafe { libc::kill(loop_pid, libc::SIGKILL) };
    assert!(after <= before, "the orphaned tree stopped recording into it: {before} -> {after} entries");
    // Left alone while it may still change; removed once quiet.
    std::thread::sleep(Duration::from_millis(5500));
    let out2 = tmp.path().join("o2.spool");
    let c =
        record(tmp.path(), tmp.path(), &["-o".as_ref(), out2.as_os_str(), "--".as_ref(), "true".as_ref()]);
    let o = run_bounded(c, Duration::from_secs(60));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!dirs[0].exists(), "the next run removed the stale directory");
    assert_eq!(users_dirs(tmp.path()), Vec::<PathBuf>::new(), "and its .users directory");
}

/// A program that lowers `RLIMIT_FSIZE` to 0, runs threads, forks a child
/// that execs `/bin/true`, and exits 0: the recorder's own writes on the
/// program's threads (the child's spool header, the last flush, the stats)
/// must fail with `EFBIG`, not raise `SIGXFSZ` (whose default action killed
/// the child before its exec and the program at its exit, status 153). The
/// program's own write past the limit still gets its signal, as it would
/// unrecorded: the recorder takes back only the signals its writes raised.
#[test]
fn a_program_limiting_its_file_size_is_not_killed_by_our_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c(
        tmp.path(),
        "fsize",
        r#"
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <fcntl.h>
static void *work(void *a) { (void)a; burn(0.1); return 0; }
int main(int argc, char **argv) {
  burn(0.1);
  struct rlimit r = {0, 0};
  if (setrlimit(RLIMIT_FSIZE, &r)) { perror("setrlimit"); return 5; }
  pthread_t t[2];
  for (int i = 0; i < 2; i++) pthread_create(&t[i], 0, work, 0);
  for (int i = 0; i < 2; i++) pthread_join(t[i], 0);
  pid_t c = fork();
  if (c == 0) { burn(0.05); execl("/bin/true", "true", (char *)0); _exit(3); }
  int st = 0;
  waitpid(c, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) { fprintf(stderr, "child status %d\n", st); return 4; }
  if (argc > 1) {
    /* The program's own write past its limit: SIGXFSZ, ignored here, so EFBIG. */
    signal(SIGXFSZ, SIG_IGN);
    int fd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (write(fd, "x", 1) != -1) return 6;
    signal(SIGXFSZ, SIG_DFL);
    /* ...and with the default action, its own write still kills it. */
    write(fd, "x", 1);
    return 7;
  }
  return 0;
}
"#,
        &["-pthread"],
    );
    let out = tmp.path().join("fsize.spool");
    let mut c = Command::new(env!("CARGO_BIN_EXE_spulse"));
    c.current_dir(tmp.path()).arg("record").arg("-o").arg(&out).arg("--").arg(&exe);
    let o = run_bounded(c, Duration::from_secs(60));
    assert_eq!(o.status.code(), Some(0), "the program's own status: {}", stderr(&o));
    // Unrecorded, its own write past the limit kills it with SIGXFSZ: so
    // it does recorded (`record` ends by the same signal).
    let mine = tmp.path().join("mine.txt");
    let mut c = Command::new(env!("CARGO_BIN_EXE_spulse"));
    c.current_dir(tmp.path())
        .arg("record")
        .arg("-o")
        .arg(tmp.path().join("own.spool"))
        .arg("--")
        .arg(&exe)
        .arg(&mine);
    let o = run_bounded(c, Duration::from_secs(60));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGXFSZ),
        "its own write's signal: {:?} {}",
        o.status,
        stderr(&o)
    );
}

/// A program that `dup2`s its own file over every descriptor below its
/// limit (256 here, soft and hard), so that it has no free descriptor at its
/// exit: the recorder's losses and warnings still reach `spulse record`'s
/// summary and the `.warnings` beside the output (the stats page is mapped
/// at start; a stats file created at exit failed with `EMFILE`, and the
/// summary said "0 lost" with no warning), and the program's file holds
/// only its own bytes.
#[test]
fn a_program_filling_its_descriptor_table_still_has_its_losses_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c(
        tmp.path(),
        "dupall",
        r#"
#include <fcntl.h>
#include <stdio.h>
#include <sys/resource.h>
#include <unistd.h>
int main(void) {
  burn(0.2);
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  int f = open("mine.txt", O_CREAT | O_TRUNC | O_WRONLY | O_APPEND, 0600);
  for (long fd = 0; fd < (long)rl.rlim_cur; fd++) if (fd != f) dup2(f, fd);
  burn(0.4);
  dprintf(f, "mine\n");
  return 0;
}
"#,
        &[],
    );
    let out = tmp.path().join("d.spool");
    let mut c = Command::new(env!("CARGO_BIN_EXE_spulse"));
    c.current_dir(tmp.path()).arg("record").arg("-o").arg(&out).arg("--").arg(&exe);
    // SAFETY: setrlimit is async-signal-safe; it lowers this child's own limits.
    unsafe {
        c.pre_exec(|| {
            let rl = libc::rlimit { rlim_cur: 256, rlim_max: 256 };
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
            Ok(())
        });
    }
    let o = run_bounded(c, Duration::from_secs(60));
    assert!(o.status.success(), "{:?} {}", o.status, stderr(&o));
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("mine.txt")).unwrap(),
        "mine\n",
        "the program's file is its own"
    );
    // (How many samples were lost depends on what the recorder had taken
    // when the program's dup2 reached its descriptors: none on a busy
    // machine. That it stopped, and why, is said.)
    let err = stderr(&o);
    assert!(err.contains("the recording stopped writing early"), "{err}");
    let saved =
        std::fs::read_to_string(tmp.path().join("d.spool.warnings")).expect("warnings beside the output");
    assert!(saved.contains("closed or reused by the program"), "{saved}");
}

/// Kernel time a recording could not sample is said in the summary: as uid
/// 65534 at `perf_event_paranoid` 2 or more the kernel refuses kernel-mode
/// sampling, and `spulse record` names the setting; as root (whose
/// recordings sample kernel time) it says nothing of it, nor of the
/// perf-stack engine, which samples user time only.
#[test]
fn refused_kernel_time_is_said_in_the_summary() {
    if !as_root("switching user needs root") {
        return;
    }
    if !oracle("setpriv", &["setpriv", "--version"], "util-linux") {
        return;
    }
    let paranoid: i32 = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(2);
    let tmp = tempfile::tempdir().unwrap();
    let exe = victim(tmp.path());
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let said = "kernel time not sampled in the process: the kernel refused kernel-mode sampling";
    let mut c = Command::new("setpriv");
    c.current_dir(tmp.path())
        .env("TMPDIR", tmp.path())
        .env("HOME", tmp.path())
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o"])
        .arg(tmp.path().join("nobody.spool"))
        .arg("--")
        .arg(&exe)
        .args(["burn", "0.1"]);
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    if paranoid >= 2 {
        assert!(err.contains(said) && err.contains(&format!("perf_event_paranoid is {paranoid}")), "{err}");
    } else {
        assert!(!err.contains(said), "kernel counting is allowed here: {err}");
    }
    let out = tmp.path().join("root.spool");
    let c = record(
        tmp.path(),
        tmp.path(),
        &["-o".as_ref(), out.as_os_str(), "--".as_ref(), exe.as_os_str(), "burn".as_ref(), "0.1".as_ref()],
    );
    let o = run_bounded(c, Duration::from_secs(60));
    assert!(o.status.success() && !stderr(&o).contains(said), "{}", stderr(&o));
    // The perf-stack engine samples user time only, whatever the
    // privileges: not the kernel's refusal, and not said as one.
    let out = tmp.path().join("stack.spool");
    let mut c = record(
        tmp.path(),
        tmp.path(),
        &["-o".as_ref(), out.as_os_str(), "--".as_ref(), exe.as_os_str(), "burn".as_ref(), "0.1".as_ref()],
    );
    c.env("SPULSE_ENGINE", "perf-stack");
    let o = run_bounded(c, Duration::from_secs(60));
    assert!(o.status.success() && !stderr(&o).contains(said), "{}", stderr(&o));
    // As root with `ulimit -n 8`: the descriptor budget (one) goes to the
    // user-time event, none is left for one per CPU; said as that, not as
    // the kernel's refusal.
    let out = tmp.path().join("few.spool");
    let mut c = Command::new("sh");
    c.current_dir(tmp.path())
        .env("TMPDIR", tmp.path())
        .arg("-c")
        .arg(format!("ulimit -n 8 && exec \"$0\" record -o few.spool -- {} burn 0.1", exe.display()));
    // `$0` of the script: the tool.
    c.arg(env!("CARGO_BIN_EXE_spulse"));
    let o = run_bounded(c, Duration::from_secs(60));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains(said), "{err}");
    assert!(err.contains("the descriptor limit (ulimit -n) left no room"), "{err}");
    spulse::Snapshot::open(&out).unwrap();
}

/// `main` ends with `pthread_exit`; with an argument, after starting a
/// thread that burns 0.2 s and prints.
const PTHREAD_EXIT_MAIN: &str = r#"
#include <pthread.h>
#include <stdio.h>
static void *worker(void *a) { burn(0.2); printf("worker done\n"); fflush(stdout); return a; }
int main(int argc, char **argv) {
  pthread_t t;
  burn(0.1);
  if (argc > 1) pthread_create(&t, NULL, worker, NULL);
  printf("main calls pthread_exit\n"); fflush(stdout);
  pthread_exit(NULL);
}
"#;

/// A program whose `main` ends with `pthread_exit` exits (status 0) once
/// its last thread ends, as it does unrecorded: the recorder's writer, the
/// last thread left, ends the process as the C library would have (before,
/// it kept the process, and `spulse record` with it, forever), with every
/// engine, and says nothing false about its descriptors.
#[test]
fn a_main_ending_in_pthread_exit_still_exits() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c(tmp.path(), "pexit", PTHREAD_EXIT_MAIN, &["-pthread"]);
    for (engine, args) in
        [("perf-event", &[][..]), ("perf-event", &["worker"][..]), ("thread-timer", &["worker"][..])]
    {
        let out = tmp.path().join(format!("p-{engine}-{}.spool", args.len()));
        let mut c = record(tmp.path(), tmp.path(), &["-o".as_ref(), out.as_os_str(), "--".as_ref()]);
        c.arg(&exe).args(args).env("SPULSE_ENGINE", engine);
        let o = run_bounded(c, Duration::from_secs(30));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(0), "{engine} {args:?}: {err}");
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains("main calls pthread_exit"), "{text}");
        assert_eq!(text.contains("worker done"), !args.is_empty(), "{text}");
        assert!(!err.contains("closed the recorder's"), "{engine} {args:?}: {err}");
        let s = spulse::Snapshot::open(&out).unwrap();
        // 0.1 s of main, and 0.2 s of the worker, at 999 Hz.
        let least = if args.is_empty() { 50 } else { 150 };
        assert!(s.samples().count() >= least, "{engine} {args:?}: {} samples", s.samples().count());
    }
}

/// A thread burns CPU (so the profiling signal's handler often runs on it)
/// while `main` forks children that call `exit` at once; prints the slowest
/// fork-to-reap time in ms.
const FORK_EXIT_BESIDE_A_BUSY_THREAD: &str = r#"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/wait.h>
static volatile int stop;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }
static void *spin(void *a) { while (!stop) burn(0.001); return a; }
int main(void) {
  pthread_t t; pthread_create(&t, NULL, spin, NULL);
  double worst = 0;
  for (int i = 0; i < 150; i++) {
    double a = now();
    pid_t p = fork();
    if (p == 0) exit(0);
    int st; waitpid(p, &st, 0);
    if (now() - a > worst) worst = now() - a;
  }
  stop = 1; pthread_join(t, NULL);
  printf("%.0f\n", worst);
  return 0;
}
"#;

/// Children forked beside a thread that the profiling signal interrupts
/// exit promptly: the parent's count of handlers running, copied into the
/// child by `fork`, is reset there (a child forked while the busy thread was
/// in the handler waited 2 s, twice, in `exit` for a handler that would never
/// leave: 1-6 of 200 children took 3-5 s).
#[test]
fn children_forked_beside_a_sampled_thread_exit_promptly() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile_c(tmp.path(), "forkexit", FORK_EXIT_BESIDE_A_BUSY_THREAD, &["-pthread"]);
    let out = tmp.path().join("f.spool");
    let mut c = record(
        tmp.path(),
        tmp.path(),
        &["-F".as_ref(), "5000".as_ref(), "-o".as_ref(), out.as_os_str(), "--".as_ref()],
    );
    c.arg(&exe).env("SPULSE_ENGINE", "perf-event");
    let o = run_bounded(c, Duration::from_secs(120));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let worst: f64 = String::from_utf8_lossy(&o.stdout).trim().parse().expect("the slowest fork in ms");
    // Unrecorded: 15 ms at worst; recorded, each child starts and finishes
    // a recorder (a few ms, more on a loaded machine), far below 2 s.
    assert!(worst < 1500.0, "a child took {worst} ms from fork to reap");
}
