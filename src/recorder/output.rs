//! The recording's files: the output-path template (`{pid}`, `{timestamp}`,
//! `{seq}`), the segment path of a rotating recording, and the spool's creation
//! (exclusive, never through a symlink, locked for followers; `overwrite`).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use std::os::fd::AsFd;

use super::{own_fd, sys};
use crate::{Error, RecorderError};

/// The path of segment `seq`: the pieces joined by the zero-padded number.
pub(crate) fn segment_path(pieces: &[Vec<u8>], seq: u64) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let num = crate::segment_number(seq);
    let mut out = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(num.as_bytes());
        }
        out.extend_from_slice(p);
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Replace `{pid}` and `{timestamp}` in `template` (`{{`/`}}` are literal
/// braces) and split it at each `{seq}`: the pieces to join with a segment
/// number (one piece when there is no `{seq}`).
pub(super) fn expand_template(template: &Path, pid: u32, unix_secs: u64) -> Result<Vec<Vec<u8>>, String> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = template.as_os_str().as_bytes();
    let shown = template.display();
    let mut pieces = Vec::new();
    let mut out = Vec::with_capacity(bytes.len() + 16);
    let mut i = 0;
    while i < bytes.len() {
        let rest = &bytes[i..];
        if rest.starts_with(b"{{") || rest.starts_with(b"}}") {
            out.push(rest[0]);
            i += 2;
        } else if rest.starts_with(b"{pid}") {
            out.extend_from_slice(pid.to_string().as_bytes());
            i += 5;
        } else if rest.starts_with(b"{timestamp}") {
            out.extend_from_slice(unix_secs.to_string().as_bytes());
            i += 11;
        } else if rest.starts_with(b"{seq}") {
            pieces.push(std::mem::take(&mut out));
            i += 5;
        } else if rest[0] == b'{' || rest[0] == b'}' {
            let end = rest.iter().position(|&b| b == b'}').map_or(rest.len(), |e| e + 1);
            return Err(format!(
                "path template \"{shown}\" has an unknown placeholder \"{}\" at byte {i} \
                 (known: {{pid}}, {{timestamp}}, {{seq}}; write {{{{ or }}}} for a literal brace)",
                String::from_utf8_lossy(&rest[..end.min(40)])
            ));
        } else {
            out.push(rest[0]);
            i += 1;
        }
    }
    pieces.push(out);
    Ok(pieces)
}

/// Create the spool file: new (`O_EXCL`), never through a symlink, close-on-exec,
/// and locked (`flock(LOCK_EX)`) for as long as the recording runs.
pub(crate) fn create_spool(path: &Path, mode: u32, overwrite: bool) -> Result<File, Error> {
    let io_err = |source| Error::io(Some(path), source);
    if overwrite {
        remove_for_overwrite(path)?;
    }
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                io_err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the spool already exists; use a path template such as \"out-{pid}.spool\" \
                     (or \"{timestamp}\"), set SPULSE_OUTPUT, or replace it with \
                     Recorder::builder().overwrite(true)",
                ))
            } else {
                io_err(e)
            }
        })?;
    if let Err(e) = sys::try_lock(file.as_fd(), sys::Lock::Exclusive) {
        let _ = std::fs::remove_file(path);
        return Err(io_err(e));
    }
    // Out of the way of the program's own descriptors (see `own_fd.rs`).
    Ok(File::from(own_fd::move_high(file.into())))
}

/// For `overwrite(true)`: unlink what is at `path` if it is a regular file
/// that no running recorder holds, or a symlink (removed, not followed).
fn remove_for_overwrite(path: &Path) -> Result<(), Error> {
    let io_err = |source| Error::io(Some(path), source);
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(e)),
    };
    let ft = meta.file_type();
    if ft.is_file() {
        // O_NONBLOCK: never wait on the open; O_NOFOLLOW: it may have been
        // replaced by a symlink since the lstat.
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)
            .map_err(io_err)?;
        if !matches!(crate::recording_running(&f), Ok(false)) {
            return Err(Error::Recorder(RecorderError::OverwriteRefused {
                path: path.to_path_buf(),
                reason: "a running recorder is still writing it (it holds the spool's lock)",
            }));
        }
    } else if !ft.is_symlink() {
        return Err(Error::Recorder(RecorderError::OverwriteRefused {
            path: path.to_path_buf(),
            reason: "it is not a regular file or symlink",
        }));
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(e)),
    }
}
