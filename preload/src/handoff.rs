//! The collector's directory under `spulse record`, as this process uses it.
//!
//! `SPULSE_RECORD_DIR` is read once, when this library loads ([`init`]): a
//! program that changes its environment afterwards (Python's
//! `os.environ.clear()` before a fork) no longer turns its forked children
//! into recordings of their own in its working directory (they wrote
//! `spulse-<pid>.spool` there, as a library preloaded by hand does, and
//! were missing from the recording).
//!
//! The directory is the collector's, mode 0700, so a process that switched
//! to another user (a daemon dropping root, `su`, `setpriv`, `gosu`) cannot
//! use it. A collector running as root also makes `<dir>.users` (mode 0711,
//! root's, with a `collector` file in it naming the collector's pid and
//! start time, by which its processes tell whether it still runs), and a
//! process of the tree about to change its effective user from root to U
//! makes `<dir>.users/U` first, mode 0700 and U's ([`prepare`], from the
//! interposed `setuid` family). A process whose effective user is not the
//! directory's owner records into that directory ([`own_dir`]). Where there
//! is none (a collector that is not root, a switch made by a program this
//! library is not in), the process is not recorded and says nothing: its
//! stderr is the program's, and the collector's "not seen" line counts its
//! CPU.

use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// `SPULSE_RECORD_DIR` as it was when this library loaded (`None`: not under
/// `spulse record`).
static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();

/// `<dir>.users`, NUL-terminated, for [`prepare`] (which may run in a signal
/// handler or a `vfork` child, and so allocates nothing).
static USERS: OnceLock<Option<CString>> = OnceLock::new();

/// The user [`prepare`] last made (or found) a directory for: a program that
/// moves its effective user back and forth makes one system call for it.
static PREPARED: AtomicU32 = AtomicU32::new(u32::MAX);

/// Read `SPULSE_RECORD_DIR` (from the constructor, once).
pub(crate) fn init() {
    let dir = DIR
        .get_or_init(|| std::env::var_os("SPULSE_RECORD_DIR").filter(|d| !d.is_empty()).map(PathBuf::from));
    USERS.get_or_init(|| dir.as_deref().and_then(|d| CString::new(users_of(d).into_vec()).ok()));
}

/// The collector's directory, if this process runs under `spulse record`.
pub(crate) fn dir() -> Option<&'static Path> {
    DIR.get().and_then(|d| d.as_deref())
}

/// `<dir>.users`.
fn users_of(dir: &Path) -> OsString {
    let mut s = dir.as_os_str().to_os_string();
    s.push(".users");
    s
}

/// Where this process writes its files under the collector's directory
/// `dir`: `dir` itself when this process's effective user owns it, else
/// `<dir>.users/<euid>`. `Err(None)`: not recorded, and nothing to say (the
/// collector is gone, or this user has no directory); `Err(Some(why))`: not
/// recorded, and why, for stderr (the collector's own user cannot use its
/// directory).
pub(crate) fn own_dir(dir: &Path) -> Result<PathBuf, Option<String>> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let owner = match std::fs::symlink_metadata(dir) {
        Ok(m) => m.uid(),
        // Removed: the collector has ended (a daemon the command left behind
        // forks or execs later). Nobody reads a spool.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(None),
        // The directory's parent is closed to this user: one that switched.
        Err(_) => return Err(None),
    };
    if owner == me {
        return collector_alive(dir)
            .map(|()| dir.to_path_buf())
            .map_err(|(why, gone)| (!gone).then_some(why));
    }
    let users = PathBuf::from(users_of(dir));
    let from_collector = |p: &Path, want_dir: bool| {
        std::fs::symlink_metadata(p).is_ok_and(|m| {
            m.uid() == owner && m.mode() & 0o022 == 0 && if want_dir { m.is_dir() } else { m.is_file() }
        })
    };
    let collector = users.join("collector");
    if !from_collector(&users, true) || !from_collector(&collector, false) || !still_runs(&collector) {
        return Err(None);
    }
    let own = users.join(me.to_string());
    let mine =
        std::fs::symlink_metadata(&own).is_ok_and(|m| m.is_dir() && m.uid() == me && m.mode() & 0o077 == 0);
    if mine {
        Ok(own)
    } else {
        Err(None)
    }
}

/// Whether the collector named in `<dir>.users/collector` (its pid and start
/// time) still runs, as `/proc/<pid>/stat` says (false where `/proc` hides
/// other users' processes, `hidepid`: such a process is not recorded).
fn still_runs(collector: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(collector) else { return false };
    let mut words = text.split_ascii_whitespace();
    let (Some(Ok(pid)), Some(Ok(start))) =
        (words.next().map(str::parse::<u32>), words.next().map(str::parse::<u64>))
    else {
        return false;
    };
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // The command name may hold spaces and parentheses: fields are counted
    // after its closing parenthesis; the start time is field 22.
    let rest = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
    rest.split_ascii_whitespace().nth(19).and_then(|v| v.parse::<u64>().ok()) == Some(start)
}

/// `Ok` while the collector that made `dir` runs (it holds `flock(LOCK_EX)`
/// on the directory); otherwise why this process is not recorded, and
/// whether the collector is gone (its directory removed or no longer
/// locked).
fn collector_alive(dir: &Path) -> Result<(), (String, bool)> {
    use std::os::fd::AsRawFd;
    let d = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| {
            let gone = e.kind() == std::io::ErrorKind::NotFound;
            (format!("cannot use the directory of `spulse record`, {}: {e}", dir.display()), gone)
        })?;
    // SAFETY: flock on the descriptor `d` keeps open for the call.
    let r = unsafe { libc::flock(d.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    if r == 0 {
        let why = format!(
            "the `spulse record` that made {} is gone (the directory is no longer locked); the next \
             `spulse record` removes it",
            dir.display()
        );
        return Err((why, true));
    }
    Ok(())
}

/// Before this process's effective user becomes `uid` (the interposed
/// `setuid` family calls it): while it is still root, make
/// `<dir>.users/<uid>` (mode 0700, `uid`'s) if the collector made
/// `<dir>.users`, so that the process and the ones it starts as that user
/// can record there. Nothing when this process is not root, `uid` is root
/// or unchanged (`-1`), or the directory is not the collector's (root's,
/// writable by root only; a symlink is not followed). Async-signal-safe and
/// allocation-free (these calls may be made from a signal handler or a
/// `vfork` child); `errno` is kept.
pub(crate) fn prepare(uid: libc::uid_t) {
    if uid == 0 || uid == libc::uid_t::MAX || PREPARED.load(Ordering::Relaxed) == uid {
        return;
    }
    let Some(Some(users)) = USERS.get() else { return };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    // SAFETY: reads this thread's errno, an lvalue the C library provides.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: a NUL-terminated path; the flags make no file.
    let fd = unsafe {
        libc::open(users.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
    };
    if fd >= 0 {
        make_user_dir(fd, uid);
        // SAFETY: closes the descriptor opened above, which nothing else holds.
        unsafe { libc::close(fd) };
    }
    // SAFETY: restores this thread's errno, as above.
    unsafe { *libc::__errno_location() = errno };
}

/// [`prepare`]'s work in the open directory `fd`.
fn make_user_dir(fd: libc::c_int, uid: libc::uid_t) {
    // SAFETY: an all-zero `stat` is a valid value for fstat to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open; `st` is ours and writable.
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_uid != 0 || st.st_mode & 0o022 != 0 {
        return;
    }
    let mut name = [0u8; 12];
    let len = crate::exec_cpu::put(&mut name, 0, u64::from(uid));
    name[len] = 0;
    let name = name.as_ptr().cast::<libc::c_char>();
    // SAFETY: `fd` is an open directory and `name` a NUL-terminated name in it.
    if unsafe { libc::mkdirat(fd, name, 0o700) } == 0 {
        // SAFETY: as above; the new directory, not followed if replaced by a link.
        let owned = unsafe {
            libc::fchmodat(fd, name, 0o700, 0) == 0
                && libc::fchownat(fd, name, uid, libc::gid_t::MAX, libc::AT_SYMLINK_NOFOLLOW) == 0
        };
        if !owned {
            // SAFETY: as above: removes the directory just made.
            unsafe { libc::unlinkat(fd, name, libc::AT_REMOVEDIR) };
            return;
        }
    } else {
        // SAFETY: reads this thread's errno.
        let e = unsafe { *libc::__errno_location() };
        // SAFETY: an all-zero `stat` is a valid value for fstatat to overwrite.
        let mut sub: libc::stat = unsafe { std::mem::zeroed() };
        let there = e == libc::EEXIST
            && {
                // SAFETY: `fd` is open, `name` NUL-terminated, `sub` ours; a link is not followed.
                unsafe { libc::fstatat(fd, name, &mut sub, libc::AT_SYMLINK_NOFOLLOW) == 0 }
            }
            && sub.st_uid == uid;
        if !there {
            return;
        }
    }
    PREPARED.store(uid, Ordering::Relaxed);
}
