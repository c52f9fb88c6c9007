//! `Replay`: sequential decoding of a spool from disk with bounded memory.
//!
//! Opening validates the complete prefix once, keeping the definitions and a
//! sample-range index of at most [`ReplayOptions::index_limit`] entries. Each
//! entry covers `stride` consecutive samples; when the index is full, adjacent
//! entries are merged and the stride doubles, so the index stays bounded while
//! still covering the whole validated suffix. Iteration then re-reads the file
//! in fixed-size chunks and only visits the validated prefix.
//!
//! A packed file (`read/packed.rs`) is opened by checking its frame and every
//! block, one block in memory at a time; its own block index takes the place
//! of the sample-range index, and iteration decodes one block at a time.

use std::fs::File;
use std::ops::Deref;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::open;
use super::packed::{self, BlockBuf};
use super::scan::{next_validated, scan, Stop};
use crate::format::defs::Definitions;
use crate::format::record;
use crate::format::record::sample::{self, SampleFields, WINDOW};
use crate::format::{tag, MAX_BLOCK_SAMPLES, MAX_HEADER_LEN, MAX_RECORD_LEN};
use crate::format::{Sample, StackId, ThreadId};
use crate::{Error, FormatErrorKind};

const DEFAULT_CHUNK: usize = 1 << 20;
/// Samples per index entry until the index first fills: a seek then decodes
/// at most this many samples before the one it wants, while a file has to hold
/// 2^26 (67 M) samples before the default index limit doubles the stride.
const INITIAL_STRIDE: u64 = 1024;
/// The smallest read buffer. Opening refills the buffer around an incomplete
/// record, so the buffer must hold the longest record whole.
const MIN_CHUNK: usize = 64 * 1024;
const _: () = assert!(MIN_CHUNK >= MAX_RECORD_LEN);

/// Options for [`Replay`].
#[derive(Debug, Clone, Copy)]
pub struct ReplayOptions {
    index_limit: usize,
    chunk_size: usize,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions { index_limit: 1 << 16, chunk_size: DEFAULT_CHUNK }
    }
}

impl ReplayOptions {
    /// Most entries the sample-range index holds (at least 2; default 65,536,
    /// which is 2 MiB).
    pub fn index_limit(mut self, n: usize) -> Self {
        self.index_limit = n.max(2);
        self
    }

    /// Size of the read buffer (at least 64 KiB; default 1 MiB).
    pub fn chunk_size(mut self, n: usize) -> Self {
        self.chunk_size = n.max(MIN_CHUNK);
        self
    }

    /// Open and validate `path`.
    pub fn open(self, path: impl AsRef<Path>) -> Result<Replay, Error> {
        let path = path.as_ref();
        Replay::open_with(path, self).map_err(|e| e.with_path(path))
    }
}

#[derive(Debug, Clone, Copy)]
struct IndexEntry {
    /// File offset of the range's first sample record.
    offset: u64,
    /// Ordinal of that sample.
    first_sample: u64,
    /// Running timestamp before that sample.
    prev_time_us: u64,
    /// Largest timestamp in the range.
    max_time_us: u64,
}

/// A validated spool, replayed sequentially from disk.
#[derive(Debug)]
pub struct Replay {
    path: PathBuf,
    file: File,
    defs: Definitions,
    index: Vec<IndexEntry>,
    stride: u64,
    data_start: u64,
    valid_end: u64,
    recovered: bool,
    chunk_size: usize,
    /// The frame of a packed file (its samples are read block by block).
    packed: Option<packed::Frame>,
}

/// Sizes of a packed file, for [`Replay::packed_stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedStats {
    /// Blocks of samples.
    pub blocks: u64,
    /// The whole file's length.
    pub file_bytes: u64,
    /// The blocks' compressed payloads.
    pub compressed_bytes: u64,
    /// The samples as decoded columns (16 bytes a sample: time, thread, stack).
    pub column_bytes: u64,
}

impl Replay {
    /// Open and validate `path` with default options.
    pub fn open(path: impl AsRef<Path>) -> Result<Replay, Error> {
        ReplayOptions::default().open(path)
    }

    /// Options builder.
    pub fn options() -> ReplayOptions {
        ReplayOptions::default()
    }

    fn open_with(path: &Path, opts: ReplayOptions) -> Result<Replay, Error> {
        // A regular file only (see `open.rs`): iteration re-reads it at offsets.
        // Validate the file as it is now: bytes appended while opening are not
        // part of the retained prefix (so opening always terminates).
        let (file, file_len) = open::open_regular(path, "Replay")?;
        let mut buf = vec![0u8; opts.chunk_size];
        let mut filled = 0usize;
        let mut file_pos = 0u64;
        let mut eof = false;
        let read_at = |buf: &mut [u8], pos: u64| -> Result<usize, Error> {
            let want = (file_len.saturating_sub(pos)).min(buf.len() as u64) as usize;
            read_at(&file, &mut buf[..want], pos)
        };
        // Read just enough to decide on the header, so that a file that is not
        // a spool is rejected before more of it is read.
        while !eof && filled < MAX_HEADER_LEN {
            let n = read_at(&mut buf[filled..MAX_HEADER_LEN], file_pos)?;
            if n == 0 {
                eof = true;
            }
            filled += n;
            file_pos += n as u64;
        }
        if crate::format::packed::is_packed(&buf[..filled]) {
            return Replay::open_packed(path, file, file_len, opts);
        }
        let (header, hlen) =
            record::decode_header(&buf[..filled]).map_err(|(at, k)| Error::format(at as u64, k))?;
        let mut defs = Definitions::new(header);
        let mut ix = Indexer {
            index: Vec::new(),
            stride: INITIAL_STRIDE,
            limit: opts.index_limit,
            count: 0,
            last_time: header.start_time_us,
            next_at: 0,
            cur_max: 0,
        };

        let mut start = hlen;
        let mut base = hlen as u64;
        let recovered;
        loop {
            let (used, stop) = scan(&buf[start..filled], base, &mut defs, |s, at| {
                ix.add(s.time_us, at);
                true
            })?;
            start += used;
            base += used as u64;
            match stop {
                Stop::End | Stop::Incomplete if eof => {
                    recovered = start < filled;
                    break;
                }
                _ => {
                    // Move the unconsumed tail to the front and read more.
                    buf.copy_within(start..filled, 0);
                    filled -= start;
                    start = 0;
                    let n = read_at(&mut buf[filled..], file_pos)?;
                    if n == 0 {
                        eof = true;
                    }
                    filled += n;
                    file_pos += n as u64;
                }
            }
        }
        ix.finish();
        Ok(Replay {
            path: path.to_path_buf(),
            file,
            defs,
            index: ix.index,
            stride: ix.stride,
            data_start: hlen as u64,
            valid_end: base,
            recovered,
            chunk_size: opts.chunk_size,
            packed: None,
        })
    }

    /// Open a packed file: check its frame and every block, one block in
    /// memory at a time.
    fn open_packed(path: &Path, file: File, file_len: u64, opts: ReplayOptions) -> Result<Replay, Error> {
        let mut frame = packed::open_frame(&file, file_len)?;
        if let Some(last) = packed::validate_all(&file, &frame)? {
            frame.finish(last);
        }
        let header = *frame.defs.header();
        let defs = std::mem::replace(&mut frame.defs, Definitions::new(header));
        Ok(Replay {
            path: path.to_path_buf(),
            file,
            defs,
            index: Vec::new(),
            stride: MAX_BLOCK_SAMPLES as u64,
            data_start: 0,
            valid_end: file_len,
            recovered: false,
            chunk_size: opts.chunk_size,
            packed: Some(frame),
        })
    }

    /// Whether the file is a packed file (`spulse pack`) rather than a spool.
    pub fn is_packed(&self) -> bool {
        self.packed.is_some()
    }

    /// Sizes of a packed file (`None` for a spool).
    pub fn packed_stats(&self) -> Option<PackedStats> {
        self.packed.as_ref().map(|f| PackedStats {
            blocks: f.index.len() as u64,
            file_bytes: f.file_len,
            compressed_bytes: f.payload_bytes,
            column_bytes: f.samples * crate::format::packed::SAMPLE_BYTES as u64,
        })
    }

    /// Where the records after the header start and where the validated
    /// prefix ends (a spool's).
    pub(crate) fn data_range(&self) -> (u64, u64) {
        (self.data_start, self.valid_end)
    }

    /// Read the file at `pos` (for the packer).
    pub(crate) fn read_at(&self, buf: &mut [u8], pos: u64) -> Result<usize, Error> {
        read_at(&self.file, buf, pos).map_err(|e| e.with_path(&self.path))
    }

    /// Whether the file ended partway through its final record.
    pub fn recovered_from_truncated_tail(&self) -> bool {
        self.recovered
    }

    /// The definitions (also reachable through `Deref`).
    pub fn definitions(&self) -> &Definitions {
        &self.defs
    }

    /// Length of the validated prefix in bytes.
    pub fn valid_len(&self) -> u64 {
        self.valid_end
    }

    /// Entries currently held by the sample-range index (for a packed file,
    /// its blocks).
    pub fn index_len(&self) -> usize {
        match &self.packed {
            Some(f) => f.index.len(),
            None => self.index.len(),
        }
    }

    /// Samples covered by one index entry (for a packed file, the most a
    /// block holds).
    pub fn index_stride(&self) -> u64 {
        self.stride
    }

    /// Every sample, decoded sequentially from disk.
    pub fn samples(&self) -> ReplaySamples<'_> {
        if self.packed.is_some() {
            return self.iter_packed(0, None);
        }
        self.iter_at(self.data_start, self.defs.start_time_us(), None)
    }

    /// Samples from the first one (in stream order) whose timestamp is at or
    /// after `time_us`, found through the index.
    pub fn samples_from(&self, time_us: u64) -> ReplaySamples<'_> {
        if let Some(f) = &self.packed {
            let first = f.index.iter().position(|e| e.max_time_us >= time_us).unwrap_or(f.index.len());
            return self.iter_packed(first, Some(time_us));
        }
        match self.index.iter().find(|e| e.max_time_us >= time_us) {
            Some(e) => self.iter_at(e.offset, e.prev_time_us, Some(time_us)),
            None => self.iter_at(self.valid_end, self.defs.last_time_us(), None),
        }
    }

    fn iter_at(&self, offset: u64, time: u64, skip_before: Option<u64>) -> ReplaySamples<'_> {
        ReplaySamples {
            replay: self,
            buf: Vec::new(),
            pos: 0,
            filled: 0,
            file_pos: offset,
            time,
            skip_before,
            pending_error: None,
            done: false,
            direct_limit: 0,
            threads: self.defs.threads().len() as u64,
            stacks: self.defs.stack_count() as u64,
            packed: None,
        }
    }

    fn iter_packed(&self, first_block: usize, skip_before: Option<u64>) -> ReplaySamples<'_> {
        let mut it = self.iter_at(self.valid_end, self.defs.last_time_us(), None);
        it.packed = Some(Box::new(PackedCursor {
            next_block: first_block,
            pos: 0,
            skip_before,
            buf: BlockBuf::default(),
        }));
        it
    }
}

/// Where iteration over a packed file is: the decoded block and the next one.
#[derive(Debug)]
struct PackedCursor {
    next_block: usize,
    /// Next sample of `buf` to hand out.
    pos: usize,
    skip_before: Option<u64>,
    buf: BlockBuf,
}

impl PackedCursor {
    fn next(&mut self, replay: &Replay) -> Option<Result<Sample, Error>> {
        let frame = replay.packed.as_ref()?;
        loop {
            if self.pos < self.buf.times.len() {
                let i = self.pos;
                self.pos += 1;
                let time_us = self.buf.times[i];
                if self.skip_before.is_some_and(|t| time_us < t) {
                    continue;
                }
                self.skip_before = None;
                return Some(Ok(Sample {
                    time_us,
                    thread: ThreadId(self.buf.threads[i]),
                    stack: StackId(self.buf.stacks[i]),
                }));
            }
            if self.next_block >= frame.index.len() {
                return None;
            }
            let i = self.next_block;
            self.next_block = frame.index.len();
            self.pos = 0;
            if let Err(e) = self.buf.load(frame, &replay.file, i) {
                // Validated at open: the file changed since.
                self.buf.times.clear();
                let offset = e.offset().unwrap_or(frame.index[i].offset);
                return Some(Err(Error::Format {
                    path: Some(replay.path.clone()),
                    offset,
                    kind: FormatErrorKind::ChangedSinceOpen,
                }));
            }
            self.next_block = i + 1;
        }
    }
}

/// Builds the sample-range index while the file is validated.
struct Indexer {
    index: Vec<IndexEntry>,
    /// Samples per entry.
    stride: u64,
    limit: usize,
    /// Samples seen so far.
    count: u64,
    /// Timestamp of the last sample seen.
    last_time: u64,
    /// Sample ordinal at which the next entry starts.
    next_at: u64,
    /// Largest timestamp of the open (last) entry so far.
    cur_max: u64,
}

impl Indexer {
    #[inline(always)]
    fn add(&mut self, time: u64, at: u64) {
        if self.count == self.next_at {
            self.start_entry(time, at);
        }
        self.cur_max = self.cur_max.max(time);
        self.last_time = time;
        self.count += 1;
    }

    #[inline(never)]
    fn start_entry(&mut self, time: u64, at: u64) {
        self.finish();
        if self.index.len() >= self.limit {
            merge_pairs(&mut self.index);
            self.stride *= 2;
            let last = *self.index.last().expect("the limit is at least 2");
            if self.count - last.first_sample < self.stride {
                // The merged last entry is still open: keep extending it.
                self.cur_max = last.max_time_us;
                self.next_at = last.first_sample + self.stride;
                return;
            }
        }
        self.index.push(IndexEntry {
            offset: at,
            first_sample: self.count,
            prev_time_us: self.last_time,
            max_time_us: time,
        });
        self.cur_max = time;
        self.next_at = self.count + self.stride;
    }

    /// Fold the open entry's running maximum into it.
    fn finish(&mut self) {
        if let Some(e) = self.index.last_mut() {
            e.max_time_us = e.max_time_us.max(self.cur_max);
        }
    }
}

fn merge_pairs(index: &mut Vec<IndexEntry>) {
    let n = index.len();
    let mut w = 0;
    let mut r = 0;
    while r < n {
        let mut e = index[r];
        if r + 1 < n {
            e.max_time_us = e.max_time_us.max(index[r + 1].max_time_us);
        }
        index[w] = e;
        w += 1;
        r += 2;
    }
    index.truncate(w);
}

fn read_at(file: &File, buf: &mut [u8], pos: u64) -> Result<usize, Error> {
    loop {
        match file.read_at(buf, pos) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::from(e)),
        }
    }
}

impl Deref for Replay {
    type Target = Definitions;
    fn deref(&self) -> &Definitions {
        &self.defs
    }
}

/// Iterator over a [`Replay`]'s samples.
///
/// The prefix was validated when the replay was opened, so iteration only
/// decodes: each sample record is read straight from a fixed-size read
/// buffer; definition records are skipped, and
/// the ends of read chunks and seeks go through a general one-record step.
/// References are still bounds-checked, so that a file changed since it was
/// opened gives wrong samples or a `ChangedSinceOpen` error, never a panic.
#[derive(Debug)]
pub struct ReplaySamples<'a> {
    replay: &'a Replay,
    buf: Vec<u8>,
    pos: usize,
    filled: usize,
    file_pos: u64,
    time: u64,
    /// While seeking: samples before this timestamp are not handed out.
    skip_before: Option<u64>,
    /// An error to report once the samples before it were handed out.
    pending_error: Option<Error>,
    done: bool,
    /// See [`ReplaySamples::update_direct_limit`].
    direct_limit: usize,
    /// Thread and stack counts of the definitions, for the reference checks.
    threads: u64,
    stacks: u64,
    /// Iteration over a packed file (the spool fields above are then unused).
    packed: Option<Box<PackedCursor>>,
}

/// What one general decoding step found at the read position.
enum Step {
    Sample(Sample),
    /// A definition record (already applied at open), now skipped.
    Definition,
    /// The buffer ends inside the record, or it does not decode (the file
    /// changed): read more, which tells the two apart.
    NeedMore,
    /// A sample whose reference or timestamp is out of range: the file changed.
    Changed,
}

impl ReplaySamples<'_> {
    fn offset(&self) -> u64 {
        self.file_pos - (self.filled - self.pos) as u64
    }

    fn changed(&self) -> Error {
        Error::Format {
            path: Some(self.replay.path.clone()),
            offset: self.offset(),
            kind: FormatErrorKind::ChangedSinceOpen,
        }
    }

    /// Read more of the validated prefix; false at its end.
    fn refill(&mut self) -> Result<bool, Error> {
        let end = self.replay.valid_end;
        if self.file_pos >= end {
            return Ok(false);
        }
        if self.buf.is_empty() {
            self.buf = vec![0u8; self.replay.chunk_size];
        }
        self.buf.copy_within(self.pos..self.filled, 0);
        self.filled -= self.pos;
        self.pos = 0;
        let want = ((end - self.file_pos) as usize).min(self.buf.len() - self.filled);
        let n = read_at(&self.replay.file, &mut self.buf[self.filled..self.filled + want], self.file_pos)
            .map_err(|e| e.with_path(&self.replay.path))?;
        if n == 0 {
            // The file is shorter than the prefix validated at open.
            return Err(self.changed());
        }
        self.filled += n;
        self.file_pos += n as u64;
        Ok(true)
    }

    /// Where the direct path may start decoding: a position `pos` with
    /// `pos < direct_limit` has a full window of [`WINDOW`] bytes in the read
    /// buffer. It is zero (the direct path is off) while a seek skips early
    /// samples, so `next` tests one bound only.
    fn update_direct_limit(&mut self) {
        self.direct_limit =
            if self.skip_before.is_none() { (self.filled + 1).saturating_sub(WINDOW) } else { 0 };
    }

    /// Decode the sample record at `pos` straight from the read buffer: the
    /// steady state of a scan. `None` leaves everything else (definitions,
    /// the end of the buffer, a seek in progress, a varint longer than three
    /// bytes) to [`next_slow`](Self::next_slow).
    #[inline(always)]
    fn decode_direct(&mut self) -> Option<Sample> {
        let pos = self.pos;
        if pos >= self.direct_limit {
            return None;
        }
        let window: &[u8; WINDOW] = self.buf.get(pos..pos.wrapping_add(WINDOW))?.try_into().ok()?;
        if window[0] != tag::SAMPLE {
            return None;
        }
        let (SampleFields { delta_us: delta, thread, stack }, end) = sample::decode_validated(window)?;
        // No overflow in the validated prefix; wrapping keeps a file changed
        // since then from panicking.
        let time = self.time.wrapping_add_signed(delta);
        if thread >= self.threads || stack >= self.stacks {
            return None;
        }
        self.pos = pos + end;
        self.time = time;
        Some(Sample { time_us: time, thread: ThreadId(thread as u32), stack: StackId(stack as u32) })
    }

    /// Decode the one record at `pos` with the general decoder.
    fn step(&mut self) -> Step {
        let Some((fields, len)) =
            self.buf.get(self.pos..self.filled).filter(|b| !b.is_empty()).and_then(next_validated)
        else {
            return Step::NeedMore;
        };
        let Some(SampleFields { delta_us: delta, thread, stack }) = fields else {
            self.pos += len;
            return Step::Definition;
        };
        let Some(time) = self.time.checked_add_signed(delta) else { return Step::Changed };
        if thread >= self.threads || stack >= self.stacks {
            return Step::Changed;
        }
        self.pos += len;
        self.time = time;
        Step::Sample(Sample { time_us: time, thread: ThreadId(thread as u32), stack: StackId(stack as u32) })
    }

    /// Everything but the direct path, one record at a time.
    #[inline(never)]
    fn next_slow(&mut self) -> Option<Result<Sample, Error>> {
        // A packed file never takes the direct path (`direct_limit` stays 0).
        if let Some(p) = &mut self.packed {
            return p.next(self.replay);
        }
        while !self.done {
            if let Some(s) = self.decode_direct() {
                return Some(Ok(s));
            }
            match self.step() {
                Step::Sample(s) => match self.skip_before {
                    Some(first) if s.time_us < first => {}
                    Some(_) => {
                        self.skip_before = None;
                        self.update_direct_limit();
                        return Some(Ok(s));
                    }
                    None => return Some(Ok(s)),
                },
                Step::Definition => {}
                Step::NeedMore => match self.refill() {
                    Ok(true) => self.update_direct_limit(),
                    Ok(false) => {
                        if self.pos < self.filled {
                            self.pending_error = Some(self.changed());
                        }
                        self.done = true;
                    }
                    Err(e) => {
                        self.pending_error = Some(e);
                        self.done = true;
                    }
                },
                Step::Changed => {
                    self.pending_error = Some(self.changed());
                    self.done = true;
                }
            }
        }
        self.pending_error.take().map(Err)
    }
}

impl Iterator for ReplaySamples<'_> {
    type Item = Result<Sample, Error>;

    #[inline]
    fn next(&mut self) -> Option<Result<Sample, Error>> {
        if let Some(s) = self.decode_direct() {
            return Some(Ok(s));
        }
        self.next_slow()
    }
}
