//! The two rules a follower of a live recording shares with the recorder:
//! how a rotating recording's segments are numbered in their file names, and
//! how a reader tells whether the writer still runs (the followers' lock; see
//! "Followers' lock" in the recorder's doc). The recorder and `spulse follow`
//! both use these, so the rule is written once.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Fewest digits of a segment number in a file name: the recorder writes
/// segment `n` as `n` zero-padded to this width (`000000`, `000001`, ...,
/// wider only past 999999), in place of `{seq}`.
pub const SEGMENT_NUMBER_DIGITS: usize = 6;

/// Segment `seq`'s number as it appears in its file name (see
/// [`SEGMENT_NUMBER_DIGITS`]).
pub fn segment_number(seq: u64) -> String {
    format!("{seq:0width$}", width = SEGMENT_NUMBER_DIGITS)
}

/// Whether a recorder still writes the spool `file` (the caller's own open
/// descriptor of it): the recorder holds `flock(LOCK_EX)` on its descriptor
/// from creation until the spool is complete, so `flock(LOCK_SH | LOCK_NB)`
/// fails with `EWOULDBLOCK` exactly while it runs (or while a child it forked
/// meanwhile lives). A shared lock that is granted is released at once, so a
/// new recording into the same file is never held up by the caller. Other
/// `flock` errors are returned.
pub fn recording_running(file: &File) -> std::io::Result<bool> {
    let fd = file.as_raw_fd();
    // SAFETY: flock on a descriptor `file` keeps open for the call.
    if unsafe { libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) } == 0 {
        // SAFETY: as above; releases the shared lock just taken.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
        return Ok(false);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(true)
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_numbers_are_padded_to_six_digits() {
        assert_eq!(segment_number(0), "000000");
        assert_eq!(segment_number(42), "000042");
        assert_eq!(segment_number(1_234_567), "1234567");
    }

    #[test]
    fn running_while_another_description_holds_the_exclusive_lock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.spool");
        let writer = File::create(&path).unwrap();
        let reader = File::open(&path).unwrap();
        assert!(!recording_running(&reader).unwrap(), "no lock held");
        // SAFETY: flock on a descriptor `writer` keeps open.
        assert_eq!(unsafe { libc::flock(writer.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        assert!(recording_running(&reader).unwrap(), "the writer's lock is held");
        drop(writer);
        assert!(!recording_running(&reader).unwrap(), "released when the writer's description closes");
        // The probe released its shared lock: a new recorder (another open
        // file description) gets its exclusive lock at once.
        let next = File::options().write(true).open(&path).unwrap();
        // SAFETY: as above, on `next`.
        assert_eq!(unsafe { libc::flock(next.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    }
}
