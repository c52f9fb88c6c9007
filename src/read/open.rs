//! Opening spool files, which are untrusted: which kinds of file a reader
//! accepts, and how much of a stream it is willing to read.
//!
//! * Every reader accepts a regular file. It reads at most the length the file
//!   has when opened (`Snapshot`, `Replay`) or follows its growth (`Tail`), and
//!   decides on the header from its first [`MAX_HEADER_LEN`] bytes before
//!   reading any further.
//! * `Snapshot` also accepts a FIFO or pipe (`<(zcat a.spool.gz)` in a shell,
//!   `/dev/stdin`), read to its end but never beyond
//!   [`Snapshot::MAX_STREAM_BYTES`](crate::Snapshot::MAX_STREAM_BYTES).
//!   `Replay` and `Tail` re-read the file at offsets, which a pipe cannot do, so
//!   they refuse one.
//! * Anything else (character and block devices, sockets, directories) is
//!   refused before it is opened: `/dev/zero` would never end and a terminal
//!   would wait for typing.
//!
//! Files are opened with `O_NONBLOCK`, so opening a FIFO that has no writer
//! returns at once (a blocking open would wait for a writer forever), and with
//! `O_NOCTTY`. `O_NONBLOCK` is cleared once the file is known to be acceptable:
//! reading a pipe then waits for data from a connected writer, as `cat` would,
//! and ends at once when there is no writer.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use crate::format::{record, MAX_HEADER_LEN};
use crate::Error;

/// An opened spool file.
#[derive(Debug)]
pub(crate) enum Opened {
    /// A regular file and its length when it was opened.
    Regular { file: File, len: u64 },
    /// A FIFO or pipe (only when the caller accepts one).
    Pipe(File),
}

/// Open `path` for `reader` (named in errors), accepting a regular file and,
/// when `pipes` is true, a FIFO or pipe.
pub(crate) fn open(path: &Path, reader: &str, pipes: bool) -> Result<Opened, Error> {
    let io_err = |e: io::Error| Error::io(Some(path), e);
    // Check the kind before opening: opening some devices has side effects, and
    // a refused file should not be touched at all.
    check_kind(&std::fs::metadata(path).map_err(io_err)?.file_type(), reader, pipes).map_err(io_err)?;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(io_err)?;
    // The path may name something else by now: decide on what was opened.
    let meta = file.metadata().map_err(io_err)?;
    check_kind(&meta.file_type(), reader, pipes).map_err(io_err)?;
    clear_nonblocking(&file).map_err(io_err)?;
    if meta.file_type().is_file() {
        Ok(Opened::Regular { file, len: meta.len() })
    } else {
        Ok(Opened::Pipe(file))
    }
}

/// Open `path` for `reader` (named in errors) as a regular file; anything else
/// is refused with an error naming it.
pub(crate) fn open_regular(path: &Path, reader: &str) -> Result<(File, u64), Error> {
    match open(path, reader, false)? {
        Opened::Regular { file, len } => Ok((file, len)),
        // `open` refuses pipes when they are not accepted.
        Opened::Pipe(_) => Err(Error::io(Some(path), refusal(FIFO, reader, false))),
    }
}

const FIFO: &str = "a FIFO or pipe";

fn check_kind(t: &std::fs::FileType, reader: &str, pipes: bool) -> io::Result<()> {
    let what = if t.is_file() {
        return Ok(());
    } else if t.is_fifo() {
        if pipes {
            return Ok(());
        }
        FIFO
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    };
    Err(refusal(what, reader, pipes))
}

fn refusal(what: &str, reader: &str, pipes: bool) -> io::Error {
    let msg = if pipes {
        format!("refusing to read {what}: {reader} reads only regular files and pipes")
    } else if what == FIFO {
        format!(
            "refusing to read {what}: {reader} reads only regular files (it re-reads them at \
             offsets); save the stream to a file first"
        )
    } else {
        format!("refusing to read {what}: {reader} reads only regular files")
    };
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

fn clear_nonblocking(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open (owned by `file`, alive for this call); F_GETFL only
    // reads its status flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is open (owned by `file`, alive for this call); F_SETFL only
    // changes its status flags.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Check the header of a regular file from its first bytes, so that a file
/// that is not a spool is rejected without reading the rest of it. Returns
/// whether it is a packed file instead (whose frame its reader checks).
pub(crate) fn check_header_at_start(file: &File, path: &Path) -> Result<bool, Error> {
    let mut head = [0u8; MAX_HEADER_LEN];
    let mut n = 0;
    while n < head.len() {
        match file.read_at(&mut head[n..], n as u64) {
            Ok(0) => break,
            Ok(got) => n += got,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(Some(path), e)),
        }
    }
    if crate::format::packed::is_packed(&head[..n]) {
        return Ok(true);
    }
    record::decode_header(&head[..n]).map_err(|(at, k)| Error::format(at as u64, k).with_path(path))?;
    Ok(false)
}

/// Read a pipe to its end: first enough bytes to decide on the header (so a
/// stream that is not a spool is rejected after a few bytes), then the rest,
/// but never more than `limit` bytes in all.
pub(crate) fn read_stream(file: File, path: &Path, limit: u64) -> Result<Vec<u8>, Error> {
    let io_err = |e: io::Error| Error::io(Some(path), e);
    let mut bytes = Vec::new();
    (&file).take(MAX_HEADER_LEN as u64).read_to_end(&mut bytes).map_err(io_err)?;
    // A packed file streamed through a pipe is read whole, then checked.
    if !crate::format::packed::is_packed(&bytes) {
        record::decode_header(&bytes).map_err(|(at, k)| Error::format(at as u64, k).with_path(path))?;
    }
    // One byte beyond the limit tells a stream of exactly `limit` bytes from a
    // longer one.
    let rest = limit.saturating_sub(bytes.len() as u64).saturating_add(1);
    (&file).take(rest).read_to_end(&mut bytes).map_err(io_err)?;
    if bytes.len() as u64 > limit {
        return Err(Error::io(
            Some(path),
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the stream is longer than {limit} bytes, the most a Snapshot reads from a pipe; \
                     save it to a regular file first"
                ),
            ),
        ));
    }
    Ok(bytes)
}
