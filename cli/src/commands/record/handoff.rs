//! The collector's private directory (the hand-off between the recorded
//! processes and the collector): its creation, lock and removal, the
//! clean-up of directories that killed collectors left, and reading what
//! the (untrusted) recorded processes put there: file names, and small
//! files opened without following links or waiting on FIFOs.

use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::CliError;

/// `<pid>.<ns>.<ext>` with decimal numbers.
pub(super) fn parse_name(name: &std::ffi::OsStr, ext: &str) -> Option<(u32, u64)> {
    let name = name.to_str()?;
    let stem = name.strip_suffix(ext)?.strip_suffix('.')?;
    let (pid, ns) = stem.split_once('.')?;
    Some((pid.parse().ok()?, ns.parse().ok()?))
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
pub(super) struct HandoffDir {
    pub(super) path: PathBuf,
    /// Holds the lock.
    _lock: File,
    /// `<path>.users`, made by a collector running as root: see [`Users`].
    users: Option<Users>,
}

/// The directories of processes that switched from root to another user
/// (who cannot use the private directory): `<path>.users`, mode 0711 and
/// ours, holding a `collector` file (0644: this process's pid and start
/// time, which tell the switched processes, who cannot test the private
/// directory's lock, whether the collector still runs; no descriptor is
/// held for it, since the collector may run under `ulimit -n 8`) and a
/// directory for each user, `<uid>`, mode 0700 and that user's, which a
/// process of the tree made while still root (see the preload library's
/// `handoff.rs`). Only the `<uid>` directories are read, and in each only
/// that user's files. Removed with the private directory, and by
/// `clean_stale_dirs` once that is gone.
struct Users {
    path: PathBuf,
}

impl Users {
    fn create(private: &Path) -> Option<Users> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let path = users_dir(private);
        std::fs::DirBuilder::new().mode(0o700).create(&path).ok()?;
        let made = (|| {
            let me = super::process::proc_starttime(std::process::id())
                .ok_or_else(|| std::io::Error::other("no start time in /proc/self/stat"))?;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(path.join("collector"))?;
            f.set_permissions(std::fs::Permissions::from_mode(0o644))?;
            std::io::Write::write_all(&mut f, format!("{} {me}\n", std::process::id()).as_bytes())?;
            // Last: only now may other users enter.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o711))
        })();
        match made {
            Ok(()) => Some(Users { path }),
            Err(_) => {
                let _ = std::fs::remove_dir_all(&path);
                None
            }
        }
    }
}

/// `<private>.users`.
fn users_dir(private: &Path) -> PathBuf {
    let mut s = private.as_os_str().to_os_string();
    s.push(".users");
    PathBuf::from(s)
}

/// The directories the recorded processes write into: the private one, and
/// each `<users>/<uid>` that is a real directory owned by `uid`, `users`
/// being the `.users` directory this collector made (another's, made first
/// under the predictable name by someone else, is never read).
pub(super) fn process_dirs(private: &Path, users: Option<&Path>) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut dirs = vec![private.to_path_buf()];
    let Some(users) = users else { return dirs };
    let Ok(rd) = std::fs::read_dir(users) else { return dirs };
    for e in rd.flatten() {
        let Some(uid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let path = e.path();
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir() && m.uid() == uid) {
            dirs.push(path);
        }
    }
    dirs
}

/// The user whose files `path` (in one of [`process_dirs`]) may be: the
/// user named by its directory in `<private>.users`, if it owns that
/// directory; this user otherwise.
fn owner_of(path: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    (|| {
        let parent = path.parent()?;
        let uid: u32 = parent.file_name()?.to_str()?.parse().ok()?;
        if !parent.parent()?.as_os_str().as_encoded_bytes().ends_with(b".users") {
            return None;
        }
        let m = std::fs::symlink_metadata(parent).ok()?;
        (m.is_dir() && m.uid() == uid).then_some(uid)
    })()
    .unwrap_or(me)
}

impl HandoffDir {
    pub(super) fn create() -> Result<HandoffDir, CliError> {
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
            Ok(lock) => {
                // SAFETY: geteuid has no preconditions.
                let root = unsafe { libc::geteuid() } == 0;
                let users = if root { Users::create(&path) } else { None };
                Ok(HandoffDir { path, _lock: lock, users })
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&path);
                Err(fail(e))
            }
        }
    }
}

impl HandoffDir {
    /// The `.users` directory this collector made, if it did.
    pub(super) fn users_path(&self) -> Option<PathBuf> {
        self.users.as_ref().map(|u| u.path.clone())
    }
}

impl Drop for HandoffDir {
    fn drop(&mut self) {
        if let Some(users) = &self.users {
            let _ = std::fs::remove_dir_all(&users.path);
        }
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
        if let Some(private) = path.as_os_str().as_bytes().strip_suffix(b".users") {
            // A `.users` directory goes once its private directory has gone
            // (a collector makes it after that one and removes it first).
            let private = Path::new(std::ffi::OsStr::from_bytes(private));
            if std::fs::symlink_metadata(private).is_err() {
                let _ = std::fs::remove_dir_all(&path);
            }
            continue;
        }
        let Ok(dir) = open_dir(&path) else { continue };
        let same = dir.metadata().is_ok_and(|d| d.dev() == m.dev() && d.ino() == m.ino());
        if same && rustix::fs::flock(&dir, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok() {
            // remove_dir_all never follows symlinks inside.
            let users = users_dir(&path);
            if std::fs::symlink_metadata(&users).is_ok_and(|u| u.is_dir() && u.uid() == me) {
                let _ = std::fs::remove_dir_all(&users);
            }
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// Largest `.error` or `.stats` file read from the private directory.
const SMALL_FILE_MAX: u64 = 4096;

/// Whether `path` (in one of [`process_dirs`]) is a regular file of the
/// user it belongs to there ([`owner_of`]); otherwise what it is.
pub(super) fn check_entry(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    let me = owner_of(path);
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
        return Err(format!("it belongs to user {}, not to user {me}", m.uid()));
    }
    Ok(())
}

/// Read a small file from the private directory: opened without following
/// a symlink or waiting on a FIFO, accepted only as a regular file of ours,
/// read up to [`SMALL_FILE_MAX`] bytes (the rest is cut, and said so).
/// `Err(None)` when there is no such file, `Err(Some(why))` when it was refused.
pub(super) fn read_small(path: &Path) -> Result<String, Option<String>> {
    use std::io::Read;
    let (f, m) = open_entry(path)?;
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

/// Open a process's spool (in one of [`process_dirs`]) to follow it, as
/// [`open_entry`] opens any of its files: the collector reads what it
/// checked, not what a link put at the path since.
pub(super) fn open_spool(path: &Path) -> Result<File, String> {
    open_entry(path).map(|(f, _)| f).map_err(|e| e.unwrap_or_else(|| "no such file".into()))
}

/// Open a file of the private directory to read it: without following a
/// symlink or waiting on a FIFO, accepted only as a regular file of ours.
/// `Err(None)` when there is no such file, `Err(Some(why))` when it was refused.
fn open_entry(path: &Path) -> Result<(File, std::fs::Metadata), Option<String>> {
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
    let me = owner_of(path);
    if !m.file_type().is_file() {
        let what = if m.file_type().is_fifo() { "a FIFO" } else { "not a regular file" };
        return Err(Some(format!("it is {what}")));
    }
    if m.uid() != me {
        return Err(Some(format!("it belongs to user {}, not to user {me}", m.uid())));
    }
    Ok((f, m))
}

/// Most characters of one warning line a process wrote that the collector
/// shows (the recorder's longest warnings are about 500).
pub(super) const WARNING_CHARS_MAX: usize = 1000;

/// One warning line a process wrote, made safe to print: control characters
/// dropped, cut at [`WARNING_CHARS_MAX`] characters with `…` to say so.
pub(super) fn warning_line(line: &str) -> String {
    let mut chars = line.chars().filter(|c| !c.is_control());
    let mut out: String = chars.by_ref().take(WARNING_CHARS_MAX).collect();
    if chars.next().is_some() {
        out.push('…');
    }
    out
}

/// Most bytes of a process's live warnings file (`<pid>.<ns>.warnings`) the
/// collector reads, in all (the preloaded library writes no more).
pub(super) const LIVE_WARNINGS_MAX: u64 = 16 * 1024;

/// The complete lines a process's live warnings file gained after `offset`
/// (checked as [`read_small`] checks, read no further than
/// [`LIVE_WARNINGS_MAX`]), and the offset after them. A line still being
/// written (no newline yet) is left for the next call; a file that is not a
/// regular file of ours, or is gone, gives nothing.
pub(super) fn read_new_lines(path: &Path, offset: u64) -> (Vec<String>, u64) {
    use std::io::{Read, Seek, SeekFrom};
    if offset >= LIVE_WARNINGS_MAX {
        return (Vec::new(), offset);
    }
    let Ok((mut f, _)) = open_entry(path) else { return (Vec::new(), offset) };
    if f.seek(SeekFrom::Start(offset)).is_err() {
        return (Vec::new(), offset);
    }
    let mut buf = Vec::new();
    if f.take(LIVE_WARNINGS_MAX - offset).read_to_end(&mut buf).is_err() {
        return (Vec::new(), offset);
    }
    let Some(end) = buf.iter().rposition(|&b| b == b'\n') else {
        // No line yet; a file that fills the bound without one is not read again.
        let full = offset + buf.len() as u64 >= LIVE_WARNINGS_MAX;
        return (Vec::new(), if full { LIVE_WARNINGS_MAX } else { offset });
    };
    let lines = buf[..end]
        .split(|&b| b == b'\n')
        .map(|l| warning_line(&String::from_utf8_lossy(l)))
        .filter(|l| !l.trim().is_empty())
        .collect();
    (lines, offset + end as u64 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `.users` directory the collector did not make is never read, even
    /// with a directory of this user's in it; the collector's own is.
    #[test]
    fn only_the_collectors_own_users_directory_is_read() {
        let tmp = tempfile::tempdir().unwrap();
        let private = tmp.path().join("spulse-rec-x");
        std::fs::create_dir(&private).unwrap();
        let users = users_dir(&private);
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        std::fs::create_dir_all(users.join(me.to_string())).unwrap();
        std::fs::create_dir_all(users.join("not-a-uid")).unwrap();
        assert_eq!(
            process_dirs(&private, None),
            std::slice::from_ref(&private),
            "made by someone else: not read"
        );
        assert_eq!(process_dirs(&private, Some(&users)), [private.clone(), users.join(me.to_string())]);
        // A uid directory owned by another user than it names is not read.
        let other = if me == 0 { 1 } else { 0 };
        std::fs::create_dir(users.join(other.to_string())).unwrap();
        assert_eq!(process_dirs(&private, Some(&users)).len(), 2);
    }

    /// A spool is opened without following a link or waiting on a FIFO, and
    /// only as a regular file: what is checked is what is followed.
    #[test]
    fn a_spool_is_opened_only_as_a_regular_file_not_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("secret");
        std::fs::write(&target, b"not for the collector").unwrap();
        let link = dir.path().join("1.2.spool");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = open_spool(&link).unwrap_err();
        assert!(e.contains("symbolic link"), "{e}");
        let fifo = dir.path().join("3.4.spool");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(open_spool(&fifo).unwrap_err().contains("FIFO"));
        assert!(open_spool(&dir.path().join("5.6.spool")).is_err(), "a missing spool");
        let real = dir.path().join("7.8.spool");
        std::fs::write(&real, b"x").unwrap();
        assert!(open_spool(&real).is_ok());
    }

    #[test]
    fn live_lines_are_read_whole_bounded_and_only_from_regular_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("1.2.warnings");
        assert_eq!(read_new_lines(&p, 0), (Vec::<String>::new(), 0), "no file yet");
        std::fs::write(&p, "first\nsecond\nthi").unwrap();
        let (lines, at) = read_new_lines(&p, 0);
        assert_eq!(lines, ["first", "second"]);
        assert_eq!(at, 13, "the line still being written is left");
        std::fs::write(&p, "first\nsecond\nthird\x1b[2J\n").unwrap();
        assert_eq!(read_new_lines(&p, at), (vec!["third[2J".to_string()], 23));
        // No newline within the bound: given up, never read again.
        let big = dir.path().join("3.4.warnings");
        std::fs::write(&big, vec![b'x'; 100_000]).unwrap();
        assert_eq!(read_new_lines(&big, 0), (Vec::new(), LIVE_WARNINGS_MAX));
        // A long line is cut, and says so.
        let long = dir.path().join("9.9.warnings");
        std::fs::write(&long, format!("{}\n{}\n", "y".repeat(WARNING_CHARS_MAX), "z".repeat(1500))).unwrap();
        let (lines, _) = read_new_lines(&long, 0);
        assert_eq!(lines[0], "y".repeat(WARNING_CHARS_MAX), "a line of the bound is whole");
        assert_eq!(lines[1], format!("{}…", "z".repeat(WARNING_CHARS_MAX)));
        // A symlink to a file of lines, and a FIFO, give nothing (and do not block).
        let link = dir.path().join("5.6.warnings");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert_eq!(read_new_lines(&link, 0).0.len(), 0);
        let fifo = dir.path().join("7.8.warnings");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(read_new_lines(&fifo, 0).0.len(), 0);
    }
}
