//! `Snapshot`: a whole spool decoded into memory for random access.
//!
//! A spool's samples are stored column-wise (`columns.rs`: timestamps,
//! threads, stacks), so loading a large profile allocates a few vectors sized
//! once from the file length, not one object per sample. Large spools are
//! read and loaded on two threads (`parallel.rs`). A packed file's samples
//! stay in their coded form, checked in full at open and decoded a chunk at
//! a time when read (`coded.rs`).

use std::ops::Deref;
use std::path::Path;

use super::coded::CodedSamples;
use super::columns::{Block, SampleColumns, Samples};
use super::memory::{advise_huge_pages, no_memory, zeroed_buffer};
use super::open;
use super::packed;
use super::parallel;
use crate::format::defs::Definitions;
use crate::format::record;
use crate::format::{Sample, MIN_SAMPLE_RECORD_LEN};
use crate::Error;

/// A fully decoded spool.
///
/// Definitions are reachable through `Deref<Target = Definitions>`; samples are
/// stored column-wise.
///
/// # Example
///
/// ```
/// use spulse::{Frame, Header, Snapshot, SpoolWriter};
///
/// // A spool with one thread, a two-frame stack and two samples.
/// let header = Header { start_time_us: 1_000_000, interval_us: 1_000 };
/// let mut w = SpoolWriter::new(Vec::new(), header)?;
/// let main = w.define_thread(7, 7, "main")?;
/// let outer = w.define_frame(Frame::Absolute { address: 0x40_1000, kernel: false })?;
/// let inner = w.define_frame(Frame::Absolute { address: 0x40_2000, kernel: false })?;
/// let root = w.define_stack(None, outer)?;
/// let leaf = w.define_stack(Some(root), inner)?;
/// w.sample(1_001_000, main, leaf)?;
/// w.sample(1_000_900, main, root)?; // samples may arrive out of order
/// let bytes = w.into_inner()?;
///
/// let snap = Snapshot::from_bytes(&bytes)?;
/// assert!(!snap.recovered_from_truncated_tail());
/// assert_eq!(snap.start_time_us(), 1_000_000);
/// let first = snap.samples().next().unwrap();
/// assert_eq!(first.time_us, 1_001_000);
/// assert_eq!(snap.thread(first.thread).name, "main");
/// // Walk the stack from leaf to root.
/// let addresses: Vec<u64> =
///     snap.stack_frames(first.stack).filter_map(|f| snap.frame_address(f)).collect();
/// assert_eq!(addresses, [0x40_2000, 0x40_1000]);
///
/// // A file cut inside its final record keeps the complete prefix.
/// let cut = Snapshot::from_bytes(&bytes[..bytes.len() - 1])?;
/// assert!(cut.recovered_from_truncated_tail());
/// assert_eq!(cut.len(), 1);
/// # Ok::<(), spulse::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Snapshot {
    defs: Definitions,
    samples: Store,
    recovered: bool,
    valid_len: u64,
    file_len: u64,
}

/// Where a snapshot's samples are.
#[derive(Debug, Clone)]
enum Store {
    /// A spool's, decoded into columns.
    Columns(SampleColumns),
    /// A packed file's, checked and kept coded.
    Coded(CodedSamples),
}

impl Snapshot {
    /// The most bytes [`Snapshot::open`] reads from a FIFO or pipe (1 GiB). A
    /// stream gives no length up front, so this bounds the memory a hostile or
    /// endless one can cost; a longer spool is refused with an error naming the
    /// path, and can still be read as a regular file
    /// or with [`Snapshot::open_with_stream_limit`].
    pub const MAX_STREAM_BYTES: u64 = 1 << 30;

    /// Read and validate the spool or packed file at `path` (told apart by
    /// its magic; both give the same samples and definitions).
    ///
    /// `path` may be a regular file, read up to its length when opened, or a
    /// FIFO or pipe, read to its end (at most [`Snapshot::MAX_STREAM_BYTES`]);
    /// a FIFO with no writer reads as empty. Anything else (a device, a socket,
    /// a directory) is refused. Either way the header is checked on the first
    /// few bytes, so something that is not a spool is rejected without being
    /// read in full.
    pub fn open(path: impl AsRef<Path>) -> Result<Snapshot, Error> {
        Snapshot::open_with_stream_limit(path, Self::MAX_STREAM_BYTES)
    }

    /// [`Snapshot::open`] with another bound (`limit` bytes) on the length of
    /// a FIFO or pipe, for a spool streamed through a pipe that may be longer
    /// than [`Snapshot::MAX_STREAM_BYTES`], or to bound the memory a stream
    /// can cost more tightly. A regular file is read whole, as by `open`.
    pub fn open_with_stream_limit(path: impl AsRef<Path>, limit: u64) -> Result<Snapshot, Error> {
        let path = path.as_ref();
        let bytes = match open::open(path, "Snapshot", true)? {
            open::Opened::Regular { file, len } => {
                if open::check_header_at_start(&file, path)? {
                    // Packed: decoded block by block straight from the file.
                    return Snapshot::from_packed(&file, len).map_err(|e| e.with_path(path));
                }
                read_file(file, len).map_err(|e| Error::io(Some(path), e))?
            }
            open::Opened::Pipe(file) => open::read_stream(file, path, limit)?,
        };
        Snapshot::from_bytes(&bytes).map_err(|e| e.with_path(path))
    }

    /// Decode and validate a spool (or a packed file) held in memory. A spool of more than a few
    /// MiB is decoded on two threads (see `src/read/parallel.rs`), with exactly
    /// the result, errors included, of reading it sequentially.
    pub fn from_bytes(bytes: &[u8]) -> Result<Snapshot, Error> {
        Snapshot::load(bytes, parallel::PARALLEL_MIN_BYTES)
    }

    /// [`Snapshot::from_bytes`] with the size from which a second thread is
    /// used (`usize::MAX`: never), for tests that compare the two ways
    /// (`testing` feature only; unstable).
    #[cfg(feature = "testing")]
    pub fn from_bytes_split(bytes: &[u8], min_parallel_bytes: usize) -> Result<Snapshot, Error> {
        Snapshot::load(bytes, min_parallel_bytes)
    }

    fn load(bytes: &[u8], min_parallel_bytes: usize) -> Result<Snapshot, Error> {
        if crate::format::packed::is_packed(bytes) {
            return Snapshot::from_packed(bytes, bytes.len() as u64);
        }
        let (header, hlen) = record::decode_header(bytes).map_err(|(at, k)| Error::format(at as u64, k))?;
        let mut defs = Definitions::new(header);
        // An upper bound on the samples (see `MIN_SAMPLE_RECORD_LEN`): the
        // columns never grow (and never copy) while loading. Pages of unused
        // capacity are never touched; the columns are shrunk to fit at the end.
        let bound = (bytes.len() - hlen) / MIN_SAMPLE_RECORD_LEN;
        let mut samples = SampleColumns::new(Block::new(header.start_time_us, bound));
        let (valid_len, recovered) =
            parallel::load(bytes, hlen, &mut defs, &mut samples, min_parallel_bytes)?;
        samples.finish();
        Ok(Snapshot {
            defs,
            samples: Store::Columns(samples),
            recovered,
            valid_len: valid_len as u64,
            file_len: bytes.len() as u64,
        })
    }

    /// Check a whole packed file (`FORMAT.md`, section 10) of `len` bytes,
    /// every block in full (on two threads for a large file), keeping the
    /// blocks in their coded form (`coded.rs`).
    fn from_packed(src: &(impl packed::Source + ?Sized), len: u64) -> Result<Snapshot, Error> {
        let mut frame = packed::open_frame(src, len)?;
        let samples = CodedSamples::new(packed::load_coded(src, &frame)?);
        if let Some(last) = samples.last_time() {
            frame.finish(last);
        }
        Ok(Snapshot {
            defs: frame.defs,
            samples: Store::Coded(samples),
            recovered: false,
            valid_len: len,
            file_len: len,
        })
    }

    /// Whether the file was a packed file (`spulse pack`) rather than a spool.
    pub fn is_packed(&self) -> bool {
        matches!(self.samples, Store::Coded(_))
    }

    /// Whether the file ended partway through its final record (which was dropped).
    pub fn recovered_from_truncated_tail(&self) -> bool {
        self.recovered
    }

    /// Length of the complete, validated prefix in bytes.
    pub fn valid_len(&self) -> u64 {
        self.valid_len
    }

    /// Length of the file as read.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The definitions (also reachable through `Deref`).
    pub fn definitions(&self) -> &Definitions {
        &self.defs
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        match &self.samples {
            Store::Columns(c) => c.len(),
            Store::Coded(c) => c.len(),
        }
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One sample by index (stream order). For a packed file this decodes
    /// the chunk of 1,024 samples it is in (the last chunk read is kept, so
    /// reading samples in order decodes each chunk once).
    ///
    /// # Panics
    ///
    /// If `i >= self.len()`.
    pub fn sample(&self, i: usize) -> Sample {
        let s = match &self.samples {
            Store::Columns(c) => c.get(i),
            Store::Coded(c) => c.get(i),
        };
        match s {
            Some(s) => s,
            None => panic!("sample index {i} out of range for a snapshot of {} samples", self.len()),
        }
    }

    /// Every sample in stream order (for a packed file, decoded a chunk of
    /// 1,024 samples at a time).
    pub fn samples(&self) -> Samples<'_> {
        match &self.samples {
            Store::Columns(c) => c.iter(),
            Store::Coded(c) => Samples::coded(c.iter()),
        }
    }

    /// Sample timestamps (unix microseconds), stream order.
    pub fn sample_times(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.samples().map(|s| s.time_us)
    }

    /// First and last sample timestamps, if any (samples may be out of order
    /// across threads: these are the minimum and maximum).
    pub fn time_range(&self) -> Option<(u64, u64)> {
        if let Store::Coded(c) = &self.samples {
            // Every block's extremes, checked against its samples at open.
            return c.time_range();
        }
        let min = self.sample_times().min()?;
        let max = self.sample_times().max()?;
        Some((min, max))
    }

    /// How many blocks the samples are stored in and how many of those use
    /// the narrow (10 bytes per sample) columns; for a packed file, its
    /// blocks and 0 (`testing` feature only; unstable).
    #[cfg(feature = "testing")]
    pub fn column_blocks(&self) -> (usize, usize) {
        match &self.samples {
            Store::Columns(c) => {
                let b = c.blocks();
                (b.len(), b.iter().filter(|b| b.is_narrow()).count())
            }
            Store::Coded(c) => (c.block_count(), 0),
        }
    }
}

/// Read a regular file of `len` bytes (its length when opened; bytes appended
/// since are not read), with the buffer backed by huge pages where possible. A
/// file large enough to be loaded on two threads is also read by two: the
/// copy out of the page cache (and the page faults of the fresh buffer) is a
/// fifth of the time to open a large spool.
fn read_file(file: std::fs::File, len: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::FileExt;
    let limit = len;
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    let two_cores = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    if len >= parallel::PARALLEL_MIN_BYTES && two_cores {
        // Zero-filled by the allocator without touching the pages (fresh
        // mapping), so this costs no more than reading into spare capacity.
        let mut bytes = zeroed_buffer(len)?;
        advise_huge_pages(&mut bytes);
        let (first, second) = bytes.split_at_mut(len / 2);
        let read_all = |buf: &mut [u8], at: u64| -> std::io::Result<usize> {
            let mut done = 0;
            while done < buf.len() {
                match file.read_at(&mut buf[done..], at + done as u64) {
                    Ok(0) => break,
                    Ok(n) => done += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(done)
        };
        let halves = std::thread::scope(|s| {
            // No thread to be had (resource limits): read it in one piece below.
            let other = std::thread::Builder::new()
                .name("spulse-read".into())
                .spawn_scoped(s, || read_all(second, (len / 2) as u64))
                .ok()?;
            let a = read_all(first, 0);
            Some((a, other.join().unwrap_or_else(|_| Err(std::io::Error::other("reader thread failed")))))
        });
        if let Some((a, b)) = halves {
            match (a?, b?) {
                // The file as long as it was at open: its snapshot is complete.
                (a, b) if a == len / 2 => {
                    bytes.truncate(a + b);
                    return Ok(bytes);
                }
                // It shrank while being read: read it again in one piece.
                _ => {}
            }
        }
    }
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(len).map_err(|_| no_memory(len))?;
    advise_huge_pages(&mut bytes);
    file.take(limit).read_to_end(&mut bytes)?;
    Ok(bytes)
}

impl Deref for Snapshot {
    type Target = Definitions;
    fn deref(&self) -> &Definitions {
        &self.defs
    }
}
