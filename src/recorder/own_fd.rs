//! Descriptors the recorder writes to, kept out of the program's way and
//! checked before each use.
//!
//! The recorder shares the descriptor table with the program it records, and
//! some programs close every descriptor above 2 (daemons, test harnesses,
//! `close_range(3, ~0U, 0)`) and then open files of their own, which the
//! kernel numbers from the lowest free slot: exactly the numbers the
//! recorder's spool and wake-up eventfd had. Writing to those numbers would
//! put spool records into the program's files (and closing them at the end
//! would close the program's files). So:
//! * each such descriptor is moved to a high number ([`move_high`]:
//!   `F_DUPFD_CLOEXEC` near the top of the soft `RLIMIT_NOFILE`, at most
//!   [`HIGH_FD_CAP`]), out of reach of the program's next `open`s;
//! * [`OwnFd`] remembers what the descriptor was opened as (`st_dev`,
//!   `st_ino`, file type) and checks it with one `fstat` before each write
//!   batch, sync, unlock and close; when it no longer matches (closed, or
//!   the number now names another file), nothing more is done through it and
//!   it is never closed (it is not ours any more).
//!
//! A program that closes the descriptor and opens a file that lands on the
//! same number between the check and the write is not caught; that window
//! is one system call wide, and the high number keeps the program's opens
//! away from it.

use std::fs::File;
use std::io::{self, Write};
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

use super::sys;
use super::writer::Sink;

/// Highest number [`move_high`] aims for: a larger soft limit is not used in
/// full, since the kernel sizes the descriptor table to the highest number in
/// use (4096 slots: 32 KiB).
pub(crate) const HIGH_FD_CAP: u64 = 4096;

/// Slots left free below the aim for the recorder's later descriptors (at
/// most a quarter of the limit: see [`target_for`]).
const HIGH_FD_ROOM: u64 = 32;

/// The lowest number [`move_high`] asks `F_DUPFD_CLOEXEC` for.
fn high_target() -> i32 {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the valid `rl`.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0;
    target_for(if ok { rl.rlim_cur } else { 1024 })
}

/// [`high_target`] for the soft limit `soft`: [`HIGH_FD_ROOM`] below it
/// (below [`HIGH_FD_CAP`]), or a quarter of it below when that is less, so
/// that a small limit still puts the recorder's descriptors at its top (at
/// `ulimit -n 32` the room of 32 left the spool at descriptor 3, which a
/// shell's `exec 3>file` took over).
fn target_for(soft: u64) -> i32 {
    let soft = soft.min(HIGH_FD_CAP);
    soft.saturating_sub(HIGH_FD_ROOM.min(soft / 4)).max(3) as i32
}

/// `fd` moved to a high, close-on-exec number (the original is closed), or
/// `fd` itself when no high number is free.
pub(crate) fn move_high(fd: OwnedFd) -> OwnedFd {
    let target = high_target();
    if fd.as_raw_fd() >= target {
        return fd;
    }
    // F_DUPFD_CLOEXEC returns a new descriptor (the lowest free one >= target) or -1.
    // SAFETY: a descriptor we own; the call does not touch `fd`.
    let high = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, target) };
    if high < 0 {
        return fd;
    }
    // SAFETY: a fresh descriptor that nothing else owns; `fd` is closed by its drop.
    unsafe { OwnedFd::from_raw_fd(high) }
}

/// What a descriptor refers to: device, inode and file type (`st_mode`'s type
/// bits; every eventfd is the same anonymous inode, a regular file is not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    kind: u32,
}

fn identity(fd: RawFd) -> Option<Identity> {
    // SAFETY: all-zero bytes are a valid `stat` (plain integers) for fstat to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat only writes into `st`; an fd that is not open gives EBADF.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some(Identity { dev: st.st_dev, ino: st.st_ino, kind: st.st_mode & libc::S_IFMT })
}

/// `fd`'s device, inode and file type, as plain words (for a check made
/// where no [`OwnFd`] can be reached: `exit_request.rs`). Async-signal-safe.
pub(crate) fn identity_words(fd: RawFd) -> Option<(u64, u64, u32)> {
    identity(fd).map(|id| (id.dev, id.ino, id.kind))
}

/// A descriptor the recorder opened, used only while it still refers to what
/// it was opened as (see the module doc).
#[derive(Debug)]
pub(crate) struct OwnFd {
    fd: RawFd,
    id: Option<Identity>,
}

impl OwnFd {
    /// Take `fd`, move it to a high number and remember what it refers to.
    pub(crate) fn new(fd: OwnedFd) -> OwnFd {
        let fd = move_high(fd).into_raw_fd();
        OwnFd { fd, id: identity(fd) }
    }

    /// Whether the descriptor still refers to what it was opened as.
    pub(crate) fn is_ours(&self) -> bool {
        self.id.is_some() && identity(self.fd) == self.id
    }

    /// The error for a descriptor that is no longer ours.
    pub(crate) fn taken_error(&self, what: &str) -> io::Error {
        io::Error::other(format!(
            "the {what}'s descriptor {} was closed or reused by the program (it no longer refers to the \
             file the recorder opened); nothing more was written through it",
            self.fd
        ))
    }
}

impl AsRawFd for OwnFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd
    }
}

impl Drop for OwnFd {
    fn drop(&mut self) {
        if self.is_ours() {
            // SAFETY: still what we opened (checked just above), and this is its only owner.
            drop(unsafe { OwnedFd::from_raw_fd(self.fd) });
        }
        // Otherwise the number is not ours any more: closing it would close
        // the program's file. Leave it.
    }
}

/// The recorder's spool file as the writer's [`Sink`]: every write batch,
/// sync and unlock first checks that the descriptor is still the spool's.
/// Once it is not, every write fails (the writer is poisoned by the first)
/// and `taken` is set.
#[derive(Debug)]
pub(crate) struct SpoolFile {
    fd: OwnFd,
    /// The spool's descriptor was found taken away.
    taken: bool,
}

impl SpoolFile {
    /// The sink for a spool just created by `create_spool` (its descriptor
    /// already moved high there, so the move here is a no-op).
    pub(crate) fn new(file: File) -> SpoolFile {
        SpoolFile { fd: OwnFd::new(file.into()), taken: false }
    }

    /// The file, borrowed for one call (never dropped: closing is `OwnFd`'s).
    fn file(&self) -> ManuallyDrop<File> {
        // Callers check `is_ours` first; ManuallyDrop never closes it.
        // SAFETY: the descriptor is open and ours for the duration of the borrow.
        ManuallyDrop::new(unsafe { File::from_raw_fd(self.fd.as_raw_fd()) })
    }

    fn check(&mut self) -> io::Result<()> {
        if !self.taken && !self.fd.is_ours() {
            self.taken = true;
        }
        if self.taken {
            return Err(self.fd.taken_error("spool"));
        }
        Ok(())
    }
}

impl Write for SpoolFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.check()?;
        self.file().write(buf)
    }

    /// Called at every flush of the writer (each time the file is due:
    /// every flush interval), so a descriptor taken away is found even when
    /// there is nothing to write. A spool that no name links to any more
    /// (deleted: by hand, or by `spulse record`'s collector as it ends,
    /// with processes of the tree still running) is written no more: every
    /// byte would only take disk space nobody can reach, until the process
    /// ends.
    fn flush(&mut self) -> io::Result<()> {
        self.check()?;
        use std::os::unix::fs::MetadataExt;
        if self.file().metadata().is_ok_and(|m| m.nlink() == 0) {
            return Err(io::Error::other(
                "the spool file was deleted (no name links to it any more); nothing more is written to it",
            ));
        }
        Ok(())
    }
}

impl Sink for SpoolFile {
    fn sync(&self) -> io::Result<()> {
        if self.taken || !self.fd.is_ours() {
            return Err(self.fd.taken_error("spool"));
        }
        self.file().sync_all()
    }

    /// Drops the followers' lock (`flock(LOCK_EX)`, taken at creation) now
    /// rather than at close, which a forked child holding a copy of the
    /// descriptor would delay. Not through a descriptor that is no longer
    /// the spool's (that would drop the program's own lock).
    fn release(&self) {
        if !self.taken && self.fd.is_ours() {
            // SAFETY: open and ours (checked just above) for this call.
            sys::unlock(unsafe { BorrowedFd::borrow_raw(self.fd.as_raw_fd()) });
        }
    }

    fn metadata(&self) -> Option<std::fs::Metadata> {
        if self.taken || !self.fd.is_ours() {
            return None;
        }
        self.file().metadata().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_limits_keep_the_recorders_descriptors_at_their_top() {
        assert_eq!(target_for(1024), 992);
        assert_eq!(target_for(1 << 20), 4064, "capped");
        assert_eq!(target_for(64), 48);
        assert_eq!(target_for(32), 24, "not 3, where a shell's `exec 3>` lands");
        assert_eq!(target_for(16), 12);
        assert_eq!(target_for(4), 3);
        assert_eq!(target_for(0), 3);
    }

    #[test]
    fn a_spool_descriptor_closed_and_reused_is_never_written_or_closed() {
        let dir = tempfile::tempdir().unwrap();
        let mine = File::create(dir.path().join("mine")).unwrap();
        let mut sink = SpoolFile::new(mine);
        let fd = sink.fd.as_raw_fd();
        assert!(fd >= 3);
        sink.write_all(b"ok").unwrap();
        // The program closes it and its next file lands on the same number.
        // SAFETY: test: closing the descriptor from under the sink on purpose.
        unsafe { libc::close(fd) };
        let theirs = File::create(dir.path().join("theirs")).unwrap();
        let theirs_fd = theirs.into_raw_fd();
        // SAFETY: test: dup2 onto the freed number, as a reused slot.
        assert_eq!(unsafe { libc::dup2(theirs_fd, fd) }, fd);
        let e = sink.write_all(b"spool bytes").unwrap_err();
        assert!(e.to_string().contains("closed or reused"), "{e}");
        assert!(sink.taken);
        assert!(sink.sync().is_err());
        sink.release();
        drop(sink);
        // Still open (not closed by the sink's drop) and untouched.
        // SAFETY: test: write to the program's descriptor, which must still be open.
        assert_eq!(unsafe { libc::write(fd, b"x".as_ptr().cast(), 1) }, 1);
        assert_eq!(std::fs::read(dir.path().join("theirs")).unwrap(), b"x");
        assert_eq!(std::fs::read(dir.path().join("mine")).unwrap(), b"ok");
        // SAFETY: test cleanup of the two descriptors made above.
        unsafe {
            libc::close(fd);
            libc::close(theirs_fd);
        }
    }
}
