//! `Tail`: follows a spool while its writer is still appending.
//!
//! Each [`Tail::poll`] reads whatever the file gained, validates every record
//! that became complete, and returns at most [`Tail::MAX_BATCH`] samples in a
//! buffer that the next poll clears and reuses. An incomplete final record is
//! left unconsumed and retried once the file grows. Definitions stay resident,
//! since later records may refer to any earlier one.

use std::fs::File;
use std::ops::Deref;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::open;
use super::scan::{scan_from, Stop};
use crate::format::defs::Definitions;
use crate::format::record;
use crate::format::{Sample, MAX_HEADER_LEN};
use crate::Error;

const READ_CHUNK: usize = 1 << 20;
const MAX_CHUNKS_PER_POLL: usize = 1024;

/// A live reader of a growing spool.
#[derive(Debug)]
pub struct Tail {
    path: PathBuf,
    file: File,
    defs: Definitions,
    /// Bytes read from the file but not yet consumed (starting at `consumed`).
    pending: Vec<u8>,
    pending_start: usize,
    /// File offset of the first unconsumed byte.
    consumed: u64,
    /// File offset up to which bytes were read.
    read_to: u64,
    batch: Vec<Sample>,
    error: Option<(u64, crate::FormatErrorKind)>,
}

impl Tail {
    /// Most samples one poll returns.
    pub const MAX_BATCH: usize = 16_384;

    /// Open `path` and read its header. A file shorter than its header is an
    /// error. `path` must be a regular file: a `Tail` reads it at offsets as it
    /// grows, so a FIFO, a device or a socket is refused with an error naming
    /// it.
    pub fn open(path: impl AsRef<Path>) -> Result<Tail, Error> {
        let path = path.as_ref();
        let (file, _) = open::open_regular(path, "Tail")?;
        Self::from_regular(file, path)
    }

    /// Follow the spool already open as `file` (read from offset 0; `path`
    /// names it in errors): for a caller that opened it its own way, such as
    /// without following a symbolic link, and checked what it opened. A file
    /// that is not a regular file is refused, as by [`Tail::open`].
    pub fn open_file(file: File, path: impl AsRef<Path>) -> Result<Tail, Error> {
        let path = path.as_ref();
        let meta = file.metadata().map_err(|e| Error::io(Some(path), e))?;
        if !meta.file_type().is_file() {
            return Err(Error::io(
                Some(path),
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "Tail follows regular files only (a spool it reads at offsets as it grows)",
                ),
            ));
        }
        Self::from_regular(file, path)
    }

    fn from_regular(file: File, path: &Path) -> Result<Tail, Error> {
        let mut head = [0u8; MAX_HEADER_LEN];
        let mut n = 0;
        while n < head.len() {
            let got = file.read_at(&mut head[n..], n as u64).map_err(|e| Error::io(Some(path), e))?;
            if got == 0 {
                break;
            }
            n += got;
        }
        if crate::format::packed::is_packed(&head[..n]) {
            return Err(Error::io(
                Some(path),
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "a packed file (spulse pack) never grows, so there is nothing to follow: Tail reads \
                     spools only (read a packed file with Snapshot or Replay)",
                ),
            ));
        }
        let (header, hlen) = record::decode_header(&head[..n])
            .map_err(|(at, k)| Error::format(at as u64, k).with_path(path))?;
        Ok(Tail {
            path: path.to_path_buf(),
            file,
            defs: Definitions::new(header),
            pending: Vec::new(),
            pending_start: 0,
            consumed: hlen as u64,
            read_to: hlen as u64,
            batch: Vec::with_capacity(Self::MAX_BATCH),
            error: None,
        })
    }

    /// Read what the file gained and return the next batch of samples (at most
    /// [`Tail::MAX_BATCH`]; empty when nothing new is complete). A complete
    /// but invalid record is an error, and every later poll returns it again;
    /// samples that precede it in the same read are returned first. One poll
    /// reads at most 1 GiB, so it returns even while a writer appends faster
    /// than the reader keeps up (an empty batch then does not mean caught up:
    /// compare [`Tail::position`] with the file length for that). A file
    /// shorter than what was read (truncated or rewritten in place) is an
    /// I/O error saying so.
    pub fn poll(&mut self) -> Result<&[Sample], Error> {
        self.batch.clear();
        self.defs.clear_off_cpu();
        self.defs.clear_heap();
        if let Some((offset, kind)) = &self.error {
            return Err(Error::Format { path: Some(self.path.clone()), offset: *offset, kind: kind.clone() });
        }
        let mut reads = 0;
        loop {
            let slice = &self.pending[self.pending_start..];
            let batch = &mut self.batch;
            let mut used = 0;
            let res = scan_from(slice, &mut used, self.consumed, &mut self.defs, |s, _| {
                batch.push(s);
                batch.len() < Self::MAX_BATCH
            });
            self.pending_start += used;
            self.consumed += used as u64;
            match res {
                Ok(Stop::Limit) => return Ok(&self.batch),
                Ok(_) => {}
                Err(e) => {
                    if let Error::Format { offset, kind, .. } = &e {
                        self.error = Some((*offset, kind.clone()));
                    }
                    // Hand out the samples before the bad record first; the
                    // next poll reports the error.
                    if !self.batch.is_empty() {
                        return Ok(&self.batch);
                    }
                    return Err(e.with_path(&self.path));
                }
            }
            // Everything complete was consumed: read more, if the file grew
            // (at most MAX_CHUNKS_PER_POLL chunks, so that a poll returns even
            // while a writer appends definitions faster than we read them).
            reads += 1;
            if reads > MAX_CHUNKS_PER_POLL || !self.read_more()? {
                return Ok(&self.batch);
            }
        }
    }

    /// Read up to one chunk of new bytes; false when the file has not grown.
    fn read_more(&mut self) -> Result<bool, Error> {
        // Size the read by what the file gained, so that a poll of a file that
        // grew by a few bytes (or not at all) does not zero a whole chunk.
        let len = self.file.metadata().map_err(|e| Error::io(Some(&self.path), e))?.len();
        if len < self.read_to {
            // A spool only grows: this one was truncated or rewritten in
            // place, and what was read no longer describes it.
            return Err(Error::io(
                Some(&self.path),
                std::io::Error::other(format!(
                    "the file shrank to {len} bytes after {} were read (truncated or rewritten in place; a spool only grows)",
                    self.read_to
                )),
            ));
        }
        let want = len.saturating_sub(self.read_to).min(READ_CHUNK as u64) as usize;
        if want == 0 {
            return Ok(false);
        }
        // Keep only the unconsumed tail (an incomplete record, at most a few KiB).
        self.pending.drain(..self.pending_start);
        self.pending_start = 0;
        let old = self.pending.len();
        self.pending.resize(old + want, 0);
        let n = loop {
            match self.file.read_at(&mut self.pending[old..], self.read_to) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.pending.truncate(old);
                    return Err(Error::io(Some(&self.path), e));
                }
            }
        };
        self.pending.truncate(old + n);
        self.read_to += n as u64;
        Ok(n > 0)
    }

    /// The off-CPU intervals (FORMAT.md, tag 9) the last [`Tail::poll`] read,
    /// in stream order (each poll forgets the previous poll's, so a follower's
    /// memory does not grow with them; `samples_before` places each among the
    /// samples). [`Definitions::off_cpu_count`] counts them all.
    pub fn off_cpu(&self) -> &[crate::OffCpuInterval] {
        self.defs.off_cpu_intervals()
    }

    /// The heap events (FORMAT.md, tag 10) the last [`Tail::poll`] read, in
    /// stream order, forgotten at the next poll as [`Tail::off_cpu`]'s are.
    /// [`Definitions::heap_count`] counts them all.
    pub fn heap(&self) -> &[crate::HeapEvent] {
        self.defs.heap_events()
    }

    /// The definitions read so far (also reachable through `Deref`).
    pub fn definitions(&self) -> &Definitions {
        &self.defs
    }

    /// File offset up to which every record was validated and consumed.
    pub fn position(&self) -> u64 {
        self.consumed
    }

    /// Whether bytes of an incomplete record wait for the file to grow.
    pub fn has_incomplete_record(&self) -> bool {
        self.pending.len() > self.pending_start
    }
}

impl Deref for Tail {
    type Target = Definitions;
    fn deref(&self) -> &Definitions {
        &self.defs
    }
}
