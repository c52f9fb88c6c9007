//! `libspulse_preload.so`: records a program it is preloaded into, from before
//! `main` to its exit, and every process that program forks or execs (they
//! inherit `LD_PRELOAD`).
//!
//! ```text
//! LD_PRELOAD=/path/to/libspulse_preload.so SPULSE_OUTPUT='prof-{pid}.spool' ./app
//! ```
//!
//! * At load (an `.init_array` constructor, before `main`), it starts the
//!   ordinary spulse recorder (same engines, same crash-tolerant spool). The
//!   frequency comes from `SPULSE_FREQUENCY`, the path from `SPULSE_OUTPUT` (a
//!   template: give it `{pid}` so that each process of a tree gets its own
//!   spool), default `spulse-{pid}.spool`. `SPULSE_ROTATE` (seconds) and
//!   `SPULSE_RETAIN` (segments) make it a rotating recording, whose
//!   `SPULSE_OUTPUT` then needs `{seq}` as well (see `RecorderBuilder::rotate`).
//! * At `exit` (an `atexit` handler) it finishes the recording: stop, drain,
//!   flush, sync. `_exit`, `_Exit` and the `exec` functions are interposed
//!   to have it written out first, where the writer can be woken at once
//!   (the off-CPU mode, the perf-stack engine; `exits.rs`). `unshare` and
//!   `setns` are interposed too (`namespaces.rs`): entering a user
//!   namespace needs a process of one thread, so where such a call fails
//!   with `EINVAL` the recording is finished, the call made again, and a new
//!   recording started. So are the C library's changes of user and group
//!   (`setxid.rs`): it makes them in every thread and aborts if they differ,
//!   so where the threads' credentials differ (a program that raised its own
//!   capabilities) the recording is finished around the call. One that
//!   enters a seccomp mode (`prctl`, `syscall(SYS_seccomp)`: `seccomp.rs`)
//!   has its recording finished for good first. A process that dies
//!   by a signal keeps what was flushed (the recorder flushes every 100 ms).
//! * In a child made by `fork` it starts a new recorder for the child (the
//!   parent's recorder withdraws itself in the child). A program started by
//!   `exec` loads this library again and starts afresh.
//! * While it records a process it publishes that process's pid in the symbol
//!   `spulse_preload_recorded_pid`; a copy of spulse linked into the program
//!   finds it with `dlsym` and refuses to start a second recorder, so an
//!   embedded `spulse::start` returns an `Err` saying the process is already
//!   recorded, and the program keeps running.
//!   Its `http` endpoint (`spulse::http`) finds the recording's current spool
//!   through `spulse_preload_live_spool` and cuts its profile windows from it.
//!
//! It records only when it was preloaded: its constructor also runs when a
//! program loads it with `dlopen` (Python's `ctypes.CDLL(path)`, a plugin
//! loader), and a recorder started there would record a program that did not
//! ask for it. So the constructor first finds this library's own file (`dladdr`
//! on one of its symbols) and looks for it among the entries of `LD_PRELOAD`
//! (separated by spaces or colons) and of `/etc/ld.so.preload` (separated by
//! whitespace or colons). An entry with a slash matches when it names the same
//! file, compared by (device, inode), so a relative path, a path with `..` or
//! doubled slashes, or a symlink all match; an entry without a slash (which the
//! loader searches for in the library path), or one holding a `$` token such as
//! `$LIB`, matches by file name. If no entry matches, the library starts
//! nothing, registers no exit or fork handler, and prints one line to stderr
//! saying why.
//!
//! Under `spulse record`, `SPULSE_RECORD_DIR` names the collector's private
//! directory: each process (each exec image) writes `<pid>.<ns>.spool` there,
//! `<ns>` being `CLOCK_MONOTONIC` nanoseconds at start, so the images one pid
//! runs through `exec` sort in order. A recorder that cannot start leaves a
//! `<pid>.<ns>.error` file with the reason for the collector to report. Each
//! warning of a recorder (`RecorderBuilder::on_warning`) is appended to
//! `<pid>.<ns>.warnings` as it is found, one a line, which the collector
//! prints while the command runs; at exit `<pid>.<ns>.stats` holds the
//! counts and every warning again. A process that switched from root to
//! another user writes them into that user's directory beside the
//! collector's instead (`handoff.rs`).

mod exec_cpu;
mod exits;
mod handoff;
mod namespaces;
mod seccomp;
mod setxid;
mod signals;

use std::ffi::{CStr, OsStr};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

/// The pid this library records (0: none). Looked up by name with `dlsym` by
/// any spulse copy in the process (see `spulse::start`).
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static spulse_preload_recorded_pid: AtomicU32 = AtomicU32::new(0);

/// Where the recording of this process is written now, for the `http`
/// endpoint of a spulse copy linked into the program (found with `dlsym`, see
/// spulse's `src/recorder/sys/preloaded.rs`), which cuts its profile windows from it.
/// Writes the spool path's bytes into `buf` when they fit in `cap` bytes and
/// the recorder's flush interval in microseconds into `*flush_us`; returns
/// the path's length, 0 when nothing is being recorded.
///
/// # Safety
///
/// `buf` must be valid for `cap` writable bytes and `flush_us` for one
/// writable `u64`.
#[no_mangle]
pub unsafe extern "C" fn spulse_preload_live_spool(buf: *mut u8, cap: usize, flush_us: *mut u64) -> usize {
    // Nothing below is expected to panic; a panic must not unwind into C.
    let live = std::panic::catch_unwind(spulse::__preload_live_spool).ok().flatten();
    let Some((path, flush)) = live else { return 0 };
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() <= cap && !buf.is_null() {
        // `bytes.len() <= cap`; a Rust path never overlaps the caller's buffer.
        // SAFETY: the caller gives `cap` writable bytes at `buf`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
    }
    if !flush_us.is_null() {
        // SAFETY: the caller gives one writable u64 at `flush_us`.
        unsafe { *flush_us = u64::try_from(flush.as_micros()).unwrap_or(u64::MAX) };
    }
    bytes.len()
}

/// Ask the recording of this process to write, within a flush interval, the
/// part up to `at_ns` (unix nanoseconds) of every off-CPU wait still open:
/// the `http` endpoint of a spulse copy in the program calls it (found with
/// `dlsym`) when a wall-clock window it cut from this recording closes, so
/// that threads still blocked are counted in it. Only stores the value.
#[no_mangle]
pub extern "C" fn spulse_preload_split_off_cpu(at_ns: u64) {
    spulse::__preload_split_off_cpu(at_ns);
}

/// The running recording of this process.
static GUARD: Mutex<Option<spulse::Guard>> = Mutex::new(None);

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

/// User and system CPU time (microseconds) the process had spent when this
/// library's constructor began: exec, the dynamic loader, and the
/// constructors that ran before this one. No sample can cover it; it goes to
/// the collector in the stats file. Zero in a forked child (its counters
/// start at the fork).
static BEFORE_USER_US: AtomicU64 = AtomicU64::new(0);
static BEFORE_SYS_US: AtomicU64 = AtomicU64::new(0);

/// This process's user and system CPU time so far, in microseconds.
fn cpu_so_far() -> (u64, u64) {
    // SAFETY: getrusage writes into the zeroed `ru`, which it may fully overwrite.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid, writable rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return (0, 0);
    }
    let us = |t: libc::timeval| (t.tv_sec.max(0) as u64) * 1_000_000 + t.tv_usec.max(0) as u64;
    (us(ru.ru_utime), us(ru.ru_stime))
}

extern "C" fn init() {
    // Before anything else: the interposed `exec` functions need them even
    // where this library records nothing.
    exits::resolve();
    handoff::init();
    namespaces::resolve();
    setxid::resolve();
    seccomp::resolve();
    let (user, sys) = cpu_so_far();
    // CPU an earlier image of this process spent (and its recorder sampled)
    // before it exec'd this one is not "before the recorder".
    let (user, sys) = exec_cpu::take_earlier(user, sys);
    BEFORE_USER_US.store(user, Ordering::Relaxed);
    BEFORE_SYS_US.store(sys, Ordering::Relaxed);
    if let Err(why) = preloaded() {
        signals::init_masks(false);
        let _ = writeln!(std::io::stderr(), "spulse: not recording: {why}");
        return;
    }
    signals::init();
    signals::init_masks(true);
    start_here();
    // Both functions stay valid for the life of the process: this library is
    // preloaded, never unloaded while the process runs.
    // SAFETY: both register plain `extern "C"` functions with no arguments.
    unsafe {
        libc::atexit(at_exit);
        libc::pthread_atfork(None, None, Some(in_child));
    }
}

extern "C" fn at_exit() {
    finish_recording();
}

/// Whether this library records the calling process (not a `vfork` child,
/// which shares the parent's memory but has a pid of its own).
fn records_this_process() -> bool {
    // The pid first: no system call at all when nothing is recorded (after a
    // seccomp filter, `getpid` itself may be refused).
    let recorded = spulse_preload_recorded_pid.load(Ordering::SeqCst);
    if recorded == 0 {
        return false;
    }
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    pid == recorded
}

/// Record this process anew after [`finish_recording`] (`namespaces.rs`):
/// a new spool, whose "CPU before the recorder" is none.
fn record_again() {
    BEFORE_USER_US.store(0, Ordering::Relaxed);
    BEFORE_SYS_US.store(0, Ordering::Relaxed);
    start_here();
}

/// Finish the recording of this process for `why`, said first: under
/// `spulse record` in the collector's warnings file, else on stderr.
fn finish_recording_because(why: &str) {
    let path = match GUARD.lock() {
        Ok(g) => g.as_ref().map(|g| g.path().to_path_buf()),
        Err(p) => p.into_inner().as_ref().map(|g| g.path().to_path_buf()),
    };
    if let Some(path) = path {
        if handoff::dir().is_some() {
            append_warning(&path.with_extension("warnings"), why);
        } else {
            let _ = writeln!(std::io::stderr(), "spulse: {why}");
        }
    }
    finish_recording();
}

/// Finish the recording of this process, if there is one: stop, drain,
/// flush, sync, and under `spulse record` write its stats (at exit, and
/// before a call that needs the process to have one thread).
fn finish_recording() {
    without_sigxfsz(finish_recording_now)
}

fn finish_recording_now() {
    spulse_preload_recorded_pid.store(0, Ordering::SeqCst);
    let guard = match GUARD.lock() {
        Ok(mut g) => g.take(),
        Err(p) => p.into_inner().take(),
    };
    if let Some(g) = guard {
        let stats_path = g.path().with_extension("stats");
        // A failure here has nobody to report to but stderr, and the program
        // is exiting with its own status: the spool keeps what was flushed.
        let collected = handoff::dir().is_some();
        match g.finish() {
            // Under `spulse record`, the collector adds the lost samples to its
            // summary (and a failure's message to its warnings).
            Ok(stats) if collected => {
                let kernel = match &stats.kernel_time {
                    spulse::KernelTime::Sampled => 1,
                    spulse::KernelTime::Off => 2,
                    // The perf-stack engine samples user time only: not
                    // the kernel's refusal (the summary would blame the
                    // privileges).
                    spulse::KernelTime::Refused(_) if stats.engine == spulse::Engine::PerfStack => 5,
                    // The descriptor budget (an eighth of `ulimit -n`) had
                    // no room: not the kernel's refusal either.
                    spulse::KernelTime::Refused(why) if why.contains("descriptors than the budget") => 6,
                    spulse::KernelTime::Refused(_) => 3,
                    spulse::KernelTime::Unmarked => 4,
                    _ => 0,
                };
                let writer_us = stats.writer_cpu.as_micros().min(u64::MAX as u128) as u64;
                write_stats(
                    &stats_path,
                    stats.samples_written,
                    stats.lost(),
                    kernel,
                    writer_us,
                    None,
                    &stats.warnings,
                );
            }
            Ok(_) => {}
            Err(e) => {
                if collected {
                    let (written, lost, warnings, message) = match &e {
                        // Why it stopped is the warning the writer gave then
                        // (among `warnings`, which `spulse record` prints
                        // once): the failure says what it cost, not why again.
                        spulse::Error::Recorder(spulse::RecorderError::WriteStopped {
                            samples_written,
                            samples_lost,
                            warnings,
                            ..
                        }) => (
                            *samples_written,
                            *samples_lost,
                            &warnings[..],
                            format!(
                                "the recording stopped writing early (its warning says why); the spool holds the {samples_written} samples written before, \
                                 {samples_lost} taken afterwards were lost"
                            ),
                        ),
                        _ => (0, 0, &[][..], e.to_string()),
                    };
                    write_stats(&stats_path, written, lost, 0, 0, Some(&message), warnings);
                } else {
                    let _ = writeln!(std::io::stderr(), "spulse: finishing the recording failed: {e}");
                }
            }
        }
    }
}

/// Largest `.stats` file the collector reads (see `spulse record`); a
/// failure's message is cut to fit.
const STATS_MAX: usize = 4096;

/// This process's `.stats` file, created at start, `STATS_MAX` zero bytes
/// mapped shared (its descriptor closed at once): [`write_stats`] writes
/// into it at exit without opening anything. Null when it could not be made
/// (then a file is created at exit, as before) or once written.
static STATS_PAGE: std::sync::atomic::AtomicPtr<u8> = std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());

/// Create `path` (`<pid>.<ns>.stats`, new, never through a symlink, 0600),
/// size it to [`STATS_MAX`] zero bytes (which the collector reads as "no
/// stats" until written) and map it for [`write_stats`].
fn map_stats_page(path: &Path) {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path);
    let Ok(f) = f else { return };
    if f.set_len(STATS_MAX as u64).is_err() {
        let _ = std::fs::remove_file(path);
        return;
    }
    // (The mapping outlives the descriptor, closed on return.)
    // SAFETY: a new shared mapping of the file's STATS_MAX bytes, at an address the kernel chooses.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            STATS_MAX,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        let _ = std::fs::remove_file(path);
        return;
    }
    STATS_PAGE.store(p.cast(), Ordering::SeqCst);
}

/// `<pid>.<ns>.stats` for the collector: `written lost before_user_us
/// before_sys_us kernel own_us` on the first line (`before_*`: CPU time before the
/// recorder started, [`BEFORE_USER_US`]; `kernel`: what became of kernel
/// time, `Stats::kernel_time`: 1 sampled, 2 off, 3 refused by the kernel, 4
/// in the samples unmarked, 5 not sampled by the perf-stack engine, 0 not known; `own_us`: spulse's own CPU, its
/// start ([`OWN_START_US`]) and its writer thread's), then the failure's message if the
/// recording failed, then the recorder's warnings. Into the page mapped at
/// start ([`STATS_PAGE`]), else a file created new, never through a symlink,
/// mode 0600.
fn write_stats(
    path: &Path,
    written: u64,
    lost: u64,
    kernel: u8,
    writer_us: u64,
    failure: Option<&str>,
    warnings: &[String],
) {
    use std::os::unix::fs::OpenOptionsExt;
    let (user, sys) = (BEFORE_USER_US.load(Ordering::Relaxed), BEFORE_SYS_US.load(Ordering::Relaxed));
    let own = OWN_START_US.load(Ordering::Relaxed).saturating_add(writer_us);
    let mut text = format!("{written} {lost} {user} {sys} {kernel} {own}\n");
    if let Some(m) = failure {
        text.push_str(&m.replace('\n', " "));
        text.push('\n');
    }
    // The recorder's `Stats::warnings`, one a line.
    for w in warnings {
        text.push_str(&w.replace('\n', " "));
        text.push('\n');
    }
    // (One byte short of the page: the zero after the text ends it there.)
    let mut end = text.len().min(STATS_MAX - 1);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    // The page mapped at start, if any: no descriptor is needed now (a
    // program that filled its descriptor table, `dup2` over every number
    // below its limit, could not have a stats file created at its exit: its
    // losses and warnings went unreported).
    let page = STATS_PAGE.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if !page.is_null() {
        // (Swapped out above: written once. `end` < STATS_MAX leaves the
        // page's last bytes zero, ending the text.)
        // SAFETY: `page` is `map_stats_page`'s writable shared mapping of STATS_MAX bytes; `end` < STATS_MAX.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), page, end) };
        return;
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path);
    if let Ok(mut f) = f {
        let _ = f.write_all(&text.as_bytes()[..end]);
    }
}

/// Most bytes of `<pid>.<ns>.warnings` (warnings are a few short sentences;
/// the collector reads no more than this either). The rest reach the
/// collector in the stats file at exit.
const LIVE_WARNINGS_MAX: u64 = 16 * 1024;

/// Append one warning line to `path` for the collector, which prints it while
/// the command runs. Called on the recorder's writer thread: the file is
/// opened for the one write and closed again (no descriptor is kept that the
/// program could close or reuse), never through a symlink, never waiting on a
/// FIFO, created 0600. A failure is not reported: the warning is in the stats
/// file at exit anyway.
fn append_warning(path: &Path, w: &str) {
    without_sigxfsz(|| append_warning_now(path, w))
}

fn append_warning_now(path: &Path, w: &str) {
    use std::os::unix::fs::OpenOptionsExt;
    let mut line = w.replace('\n', " ");
    line.push('\n');
    let f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path);
    let Ok(mut f) = f else { return };
    let fits = f.metadata().is_ok_and(|m| m.is_file() && m.len() + line.len() as u64 <= LIVE_WARNINGS_MAX);
    if fits {
        // One write of the whole line (O_APPEND): the collector never sees
        // two lines interleaved.
        let _ = f.write_all(line.as_bytes());
    }
}

extern "C" fn in_child() {
    // The parent's guard belongs to the parent's recorder, which withdrew
    // itself in this child: forget it (dropping it here would do nothing
    // anyway), then record the child on its own.
    let old = match GUARD.try_lock() {
        Ok(mut g) => g.take(),
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().take(),
        // Another thread of the parent held the lock while forking: the child
        // cannot take it, so it goes unrecorded rather than risk a deadlock.
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    std::mem::forget(old);
    // The parent's stats page came with the fork: never the child's to write.
    STATS_PAGE.store(std::ptr::null_mut(), Ordering::SeqCst);
    if UNDER_SECCOMP.load(Ordering::SeqCst) {
        // The filter came with the fork: not even a read of /proc here.
        return;
    }
    BEFORE_USER_US.store(0, Ordering::Relaxed);
    BEFORE_SYS_US.store(0, Ordering::Relaxed);
    start_here();
}

/// Set once this process (or the process it was forked from) entered a
/// seccomp mode (`seccomp.rs`): a forked child inherits the filter, and no
/// recorder may start there (its system calls would be refused, or kill it).
static UNDER_SECCOMP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process runs under a seccomp mode: set by this library, or
/// inherited across `exec` (the `Seccomp:` line of `/proc/self/status`; the
/// loader opened and read files to load this library, so that much is
/// allowed).
fn under_seccomp() -> bool {
    if UNDER_SECCOMP.load(Ordering::SeqCst) {
        return true;
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("Seccomp:")).is_some_and(|v| v.trim() != "0")
}

fn start_here() {
    let (u0, s0) = cpu_so_far();
    without_sigxfsz(start_here_now);
    let (u1, s1) = cpu_so_far();
    OWN_START_US.store((u1 + s1).saturating_sub(u0 + s0), Ordering::Relaxed);
}

/// The process's CPU (user and system, microseconds, every thread) while
/// its recorder started: spulse's own, reported in the stats with the
/// writer thread's so that the collector can tell the program's time from
/// ours.
static OWN_START_US: AtomicU64 = AtomicU64::new(0);

/// Run `f`, which writes the recorder's files (a spool's header, the last
/// flush, the stats) on a thread of the program, with `SIGXFSZ` blocked in
/// that thread. A program that lowered `RLIMIT_FSIZE` below a spool's size
/// was killed by our write (the kernel sends `SIGXFSZ` to the writing thread,
/// whose default action ends the process: a forked child died before its
/// `exec`, the program at its exit); blocked, the write fails with `EFBIG`,
/// which the recorder reports as any failed write. A `SIGXFSZ` our writes
/// left pending is taken back before the mask is restored, unless one was
/// pending before (then it is the program's, and stays). The writer thread
/// blocks every signal already (`spawn_quiet`).
fn without_sigxfsz<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: a zeroed `sigset_t` is a valid value for sigemptyset to fill.
    let mut xfsz: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: a zeroed `sigset_t` is a valid value for pthread_sigmask to overwrite with the old mask.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: both sets live on this frame; the calls only write them.
    let blocked = unsafe {
        libc::sigemptyset(&mut xfsz);
        libc::sigaddset(&mut xfsz, libc::SIGXFSZ);
        libc::pthread_sigmask(libc::SIG_BLOCK, &xfsz, &mut old) == 0
    };
    let pending = || {
        // SAFETY: a zeroed `sigset_t` is a valid value for sigpending to overwrite.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` lives on this frame; sigpending only writes it.
        unsafe { libc::sigpending(&mut set) == 0 && libc::sigismember(&set, libc::SIGXFSZ) == 1 }
    };
    let before = blocked && pending();
    let r = f();
    if blocked {
        if !before && pending() {
            let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: takes the pending SIGXFSZ of `xfsz`; the info pointer may be null.
            unsafe { libc::sigtimedwait(&xfsz, std::ptr::null_mut(), &zero) };
        }
        // SAFETY: restores the mask saved above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
    r
}

fn start_here_now() {
    if under_seccomp() {
        // Nothing is said: the program's stderr stays its own, and the
        // collector reads no spool it was not given.
        UNDER_SECCOMP.store(true, Ordering::SeqCst);
        return;
    }
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    // (Read when this library loaded: see `handoff.rs`.)
    let dir = match handoff::dir().map(handoff::own_dir) {
        None => None,
        Some(Ok(dir)) => Some(dir),
        // The collector has ended (a daemon the command left behind forks or
        // execs later), or this process switched to a user with no
        // directory: nobody reads a spool, and the program's stderr is its
        // own. Nothing is said.
        Some(Err(None)) => return,
        Some(Err(Some(why))) => {
            let _ = writeln!(std::io::stderr(), "spulse: not recording process {pid}: {why}");
            return;
        }
    };
    if let Some(dir) = &dir {
        exec_cpu::set_note_path(&dir.join(format!("{pid}.cpu-at-exec")));
    }
    let (path, error_path) = match &dir {
        Some(dir) => {
            let ns = monotonic_ns();
            // The recorder expands `{`/`}` templates: double any brace in the
            // directory (bytes, not text: the path need not be UTF-8).
            let mut escaped = Vec::new();
            for &b in dir.as_os_str().as_bytes() {
                escaped.push(b);
                if b == b'{' || b == b'}' {
                    escaped.push(b);
                }
            }
            escaped.extend_from_slice(format!("/{pid}.{ns}.spool").as_bytes());
            (PathBuf::from(OsStr::from_bytes(&escaped)), Some(dir.join(format!("{pid}.{ns}.error"))))
        }
        None => (PathBuf::from("spulse-{pid}.spool"), None),
    };
    // Under `spulse record` the spool is a handoff that the collector copies
    // and deletes; the collector syncs the output it writes.
    let mut builder = spulse::Recorder::builder().sync_at_finish(dir.is_none());
    if let Some(live) = error_path.as_ref().map(|p| p.with_extension("warnings")) {
        builder = builder.on_warning(move |w| append_warning(&live, w));
    }
    match builder.start(&path) {
        Ok(g) => {
            // (A forked child maps a page of its own: the parent's, inherited,
            // is left alone.)
            STATS_PAGE.store(std::ptr::null_mut(), Ordering::SeqCst);
            if dir.is_some() {
                map_stats_page(&g.path().with_extension("stats"));
            }
            if let Ok(mut slot) = GUARD.lock() {
                *slot = Some(g);
            }
            spulse_preload_recorded_pid.store(pid, Ordering::SeqCst);
        }
        Err(e) => {
            // Under `spulse record` the reason goes to the collector, in one
            // write; when even that fails (a full file system, a process that
            // switched to a user who cannot write the directory), to stderr.
            let told = error_path.is_some_and(|p| {
                use std::os::unix::fs::OpenOptionsExt;
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                    .open(&p)
                    .and_then(|mut f| f.write_all(e.to_string().as_bytes()))
                    .is_ok()
            });
            // (Not when the collector ended meanwhile: nobody reads it, and
            // the program's stderr is its own.)
            let gone = handoff::dir().is_some_and(|d| matches!(handoff::own_dir(d), Err(None)));
            if !told && !gone {
                let _ = writeln!(std::io::stderr(), "spulse: not recording process {pid}: {e}");
            }
        }
    }
}

/// `/etc/ld.so.preload`, read up to this many bytes (the loader's own list is
/// a few paths; a larger file is not a preload list this library must honour).
const LD_SO_PRELOAD_MAX: u64 = 64 * 1024;

/// `Ok` when this library is named in `LD_PRELOAD` or `/etc/ld.so.preload`;
/// otherwise the reason it is not recording (it was loaded with `dlopen`).
fn preloaded() -> Result<(), String> {
    let own = own_path()
        .ok_or_else(|| "cannot find the file of libspulse_preload.so (dladdr failed)".to_string())?;
    let own_id = std::fs::metadata(&own).ok().map(|m| (m.dev(), m.ino()));
    let own_name = own.file_name().map(OsStr::to_os_string);
    let matches = |entry: &[u8]| -> bool {
        if entry.is_empty() {
            return false;
        }
        let path = Path::new(OsStr::from_bytes(entry));
        if entry.contains(&b'/') && !entry.contains(&b'$') {
            let id = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
            id.is_some() && id == own_id
        } else {
            path.file_name().is_some() && path.file_name().map(OsStr::to_os_string) == own_name
        }
    };
    if let Some(list) = std::env::var_os("LD_PRELOAD") {
        if list.as_bytes().split(|&b| b == b' ' || b == b':').any(matches) {
            return Ok(());
        }
    }
    let mut system = Vec::new();
    if let Ok(f) = std::fs::File::open("/etc/ld.so.preload") {
        let _ = f.take(LD_SO_PRELOAD_MAX).read_to_end(&mut system);
    }
    if system.split(|&b| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b':')).any(matches) {
        return Ok(());
    }
    Err(format!(
        "{} was loaded without being preloaded (with dlopen?): it is not named in LD_PRELOAD or /etc/ld.so.preload, \
         so it records nothing in process {}",
        own.display(),
        std::process::id()
    ))
}

/// The path this library was loaded from, as the dynamic loader recorded it.
fn own_path() -> Option<PathBuf> {
    // `Dl_info` is plain data (pointers and integers); dladdr fills it on success.
    // SAFETY: all zero bytes is a valid value of such a struct.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let addr = &spulse_preload_recorded_pid as *const AtomicU32 as *const libc::c_void;
    // dladdr only reads the loader's tables.
    // SAFETY: `addr` points into this library's data; `info` is ours, writable.
    let found = unsafe { libc::dladdr(addr, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // On success `dli_fname` is owned by the loader and lives as long as this
    // library stays loaded, which covers this whole call.
    // SAFETY: a NUL-terminated string, valid for the lifetime used here.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let bytes = name.to_bytes();
    (!bytes.is_empty()).then(|| PathBuf::from(OsStr::from_bytes(bytes)))
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
