//! `SpoolWriter`: emits the header and records of a spool over any `io::Write`.
//!
//! Every record is checked against the same [`Definitions`] rules the readers
//! enforce before a byte of it reaches the sink (a sample before it is encoded;
//! any other record by decoding its encoding as a reader does), so a writer bug surfaces as
//! [`Error::InvalidRecord`] instead of a file readers reject. Records are encoded
//! into one reusable buffer (no allocation per record once it has grown) and
//! handed to the sink in appends of at most [`SpoolWriter::AUTO_FLUSH_BYTES`];
//! bytes already handed over are never rewritten. After a failed write the
//! writer is poisoned: a partial record is never followed by more bytes.

use std::io::Write;

use crate::format::defs::Definitions;
use crate::format::limits::{MAX_BUILD_ID_LEN, MAX_LABEL_LEN, MAX_PATH_LEN, MAX_THREAD_NAME_LEN};
use crate::format::record::sample::{self, SampleFields};
use crate::format::record::{self, DecodeError, RawFrame, Record};
use crate::format::{Frame, FrameId, Header, ModuleId, StackId, ThreadId, MAX_RECORD_LEN};
use crate::{Error, FormatErrorKind};

/// A module to define (see [`SpoolWriter::define_module`]).
#[derive(Debug, Clone, Copy)]
pub struct NewModule<'a> {
    /// Process that maps it.
    pub pid: u32,
    /// First mapped address.
    pub start: u64,
    /// Mapped span in bytes.
    pub size: u64,
    /// File offset of the first mapped byte.
    pub file_offset: u64,
    /// Module-table generation in which it appeared.
    pub generation: u64,
    /// Path of the mapped file.
    pub path: &'a [u8],
    /// GNU build id (may be empty).
    pub build_id: &'a [u8],
}

/// A module read from a spool, to define again in another (its id is the
/// new spool's to give).
impl<'a> From<&'a crate::format::Module> for NewModule<'a> {
    fn from(m: &'a crate::format::Module) -> NewModule<'a> {
        NewModule {
            pid: m.pid,
            start: m.start,
            size: m.size,
            file_offset: m.file_offset,
            generation: m.generation,
            path: &m.path,
            build_id: &m.build_id,
        }
    }
}

/// Appends a valid spool to `W`.
///
/// Ids are assigned densely in definition order and returned by the `define_*`
/// methods. A record that breaks a format rule is refused with
/// [`Error::InvalidRecord`] and nothing of it is written; the writer stays
/// usable. After an I/O error it is poisoned ([`Error::WriterPoisoned`]).
///
/// # Example
///
/// ```
/// use spulse::{Error, Frame, Header, NewModule, SpoolWriter};
///
/// let header = Header { start_time_us: 1_700_000_000_000_000, interval_us: 1_000 };
/// let mut w = SpoolWriter::new(Vec::new(), header)?;
/// let libc = w.define_module(&NewModule {
///     pid: 42,
///     start: 0x7f00_0000_0000,
///     size: 0x1000,
///     file_offset: 0,
///     generation: 0,
///     path: b"/usr/lib/libc.so.6",
///     build_id: b"",
/// })?;
/// let frame = w.define_frame(Frame::Module { module: libc, file_relative: 0x123 })?;
/// let stack = w.define_stack(None, frame)?;
/// let thread = w.define_thread(42, 43, "worker")?;
/// w.sample(1_700_000_000_001_000, thread, stack)?;
///
/// // Rule violations are refused before a byte is written.
/// let outside = w.define_frame(Frame::Module { module: libc, file_relative: 0x5000 });
/// assert!(matches!(outside, Err(Error::InvalidRecord { .. })));
///
/// let bytes = w.into_inner()?;
/// assert_eq!(&bytes[..8], b"SPULSE3\0");
/// # Ok::<(), Error>(())
/// ```
#[derive(Debug)]
pub struct SpoolWriter<W: Write> {
    out: W,
    defs: Definitions,
    buf: Vec<u8>,
    /// Bytes handed to `out` so far.
    flushed: u64,
    poisoned: bool,
}

impl<W: Write> SpoolWriter<W> {
    /// The buffer is handed to the sink once it holds this many bytes, even
    /// without an explicit [`flush`](Self::flush).
    pub const AUTO_FLUSH_BYTES: usize = 64 * 1024;

    /// Start a spool: writes the header to `out` at once.
    pub fn new(out: W, header: Header) -> Result<Self, Error> {
        let mut w = SpoolWriter {
            out,
            defs: Definitions::new(header),
            // Room for the record that crosses the flush threshold.
            buf: Vec::with_capacity(Self::AUTO_FLUSH_BYTES + MAX_RECORD_LEN),
            flushed: 0,
            poisoned: false,
        };
        record::encode_header(&header, &mut w.buf);
        w.flush()?;
        Ok(w)
    }

    /// Everything defined so far.
    pub fn definitions(&self) -> &Definitions {
        &self.defs
    }

    /// Total bytes of the spool so far, buffered or written (never zero: the
    /// header is written at creation, which is why there is no `is_empty`).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u64 {
        self.flushed + self.buf.len() as u64
    }

    /// Bytes encoded but not yet handed to the sink.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The sink.
    pub fn get_ref(&self) -> &W {
        &self.out
    }

    /// Flush and return the sink.
    pub fn into_inner(mut self) -> Result<W, Error> {
        self.flush()?;
        Ok(self.out)
    }

    fn check_len(&self, what: &'static str, len: usize, limit: u64) -> Result<(), Error> {
        if len as u64 > limit {
            let kind = FormatErrorKind::TooLong { what, len: len as u64, limit };
            return Err(Error::InvalidRecord { offset: self.len(), kind });
        }
        Ok(())
    }

    fn check_poison(&self) -> Result<(), Error> {
        if self.poisoned {
            Err(Error::WriterPoisoned)
        } else {
            Ok(())
        }
    }

    /// Encode `rec` at the end of the buffer, then run the encoded bytes through
    /// the readers' own validation ([`Definitions::read_record`]); a record that
    /// fails is removed from the buffer again, so nothing invalid is ever handed
    /// to the sink.
    fn push(&mut self, rec: Record<'_>) -> Result<(), Error> {
        self.check_poison()?;
        let offset = self.len();
        let at = self.buf.len();
        record::encode(&rec, &mut self.buf);
        match self.defs.read_record(&self.buf[at..]) {
            Ok((_, n)) => debug_assert_eq!(n, self.buf.len() - at),
            Err(e) => {
                self.buf.truncate(at);
                let kind = match e {
                    DecodeError::Bad { kind, .. } => kind,
                    // Unreachable: the encoder always emits whole records.
                    DecodeError::Incomplete => FormatErrorKind::BadValue("incomplete encoding", 0),
                };
                return Err(Error::InvalidRecord { offset, kind });
            }
        }
        self.maybe_flush()
    }

    #[inline]
    fn maybe_flush(&mut self) -> Result<(), Error> {
        if self.buf.len() >= Self::AUTO_FLUSH_BYTES {
            self.write_out()?;
        }
        Ok(())
    }

    fn write_out(&mut self) -> Result<(), Error> {
        if self.buf.is_empty() {
            return Ok(());
        }
        match self.out.write_all(&self.buf) {
            Ok(()) => {
                self.flushed += self.buf.len() as u64;
                self.buf.clear();
                Ok(())
            }
            Err(e) => {
                self.poisoned = true;
                Err(Error::from(e))
            }
        }
    }

    /// Hand every buffered record to the sink and flush it.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.check_poison()?;
        self.write_out()?;
        self.out.flush().map_err(|e| {
            self.poisoned = true;
            Error::from(e)
        })
    }

    /// Define a module; returns its id.
    pub fn define_module(&mut self, m: &NewModule<'_>) -> Result<ModuleId, Error> {
        // Refuse oversized strings before copying them into the buffer.
        self.check_len("module path", m.path.len(), MAX_PATH_LEN)?;
        self.check_len("build id", m.build_id.len(), MAX_BUILD_ID_LEN)?;
        let id = self.defs.modules().len() as u64;
        self.push(Record::Module {
            id,
            pid: m.pid as u64,
            start: m.start,
            size: m.size,
            file_offset: m.file_offset,
            generation: m.generation,
            path: m.path,
            build_id: m.build_id,
        })?;
        Ok(ModuleId(id as u32))
    }

    /// Define a frame; returns its id.
    pub fn define_frame(&mut self, frame: Frame) -> Result<FrameId, Error> {
        let id = self.defs.frames().len() as u64;
        let raw = match frame {
            Frame::Module { module, file_relative } => {
                RawFrame::Module { module: module.get() as u64, file_relative }
            }
            Frame::Absolute { address, kernel } => RawFrame::Absolute { address, kernel },
            Frame::Truncated => RawFrame::Truncated,
            Frame::Label(_) => {
                // A label id names a reader's table; the text is what is written.
                let kind = FormatErrorKind::BadValue("label frame given by id (use define_label)", 3);
                return Err(Error::InvalidRecord { offset: self.len(), kind });
            }
        };
        self.push(Record::Frame { id, frame: raw })?;
        Ok(FrameId(id as u32))
    }

    /// Define a label frame (FORMAT.md, frame kind 3): `label` (UTF-8, at most
    /// 64 bytes, written without brackets) stands where an address would, as
    /// the leaf of an off-CPU stack (`blocked: futex`, `waiting for CPU`).
    pub fn define_label(&mut self, label: &str) -> Result<FrameId, Error> {
        self.check_len("frame label", label.len(), MAX_LABEL_LEN)?;
        let id = self.defs.frames().len() as u64;
        self.push(Record::Frame { id, frame: RawFrame::Label(label.as_bytes()) })?;
        Ok(FrameId(id as u32))
    }

    /// Write an off-CPU interval (tag 9): `thread` was off the CPU from
    /// `start_us` (unix microseconds) for `duration_us`, having left it in
    /// `stack`; `preempted` when it was runnable (waiting for a CPU) rather
    /// than blocked. Does not change the running sample time.
    pub fn off_cpu(
        &mut self,
        thread: ThreadId,
        stack: StackId,
        start_us: u64,
        duration_us: u64,
        preempted: bool,
    ) -> Result<(), Error> {
        // Checked by the readers' rules, but not decoded again nor kept in
        // the definitions: a recorder writes one a blocking, for as long as it
        // runs (decoding was most of the writer's cost of an interval, and the
        // kept intervals grew without bound).
        self.check_poison()?;
        let (thread, stack) = (thread.get() as u64, stack.get() as u64);
        if let Err(kind) = self.defs.count_off_cpu(thread, stack, start_us, duration_us) {
            return Err(Error::InvalidRecord { offset: self.len(), kind });
        }
        let at = self.buf.len();
        record::encode_off_cpu(&mut self.buf, thread, stack, start_us, duration_us, preempted);
        debug_assert!(
            record::decode_fields(&self.buf[at..]).is_ok_and(|(_, n)| n == self.buf.len() - at),
            "an off-CPU record that does not decode"
        );
        self.maybe_flush()
    }

    /// Write a heap event (tag 10): a sampled allocation of the block at
    /// `address` of `size` bytes by `thread` in `stack`, standing for
    /// `bytes` of allocation, at `time_us` (unix microseconds); with `freed`,
    /// that block's free (`stack` and `bytes` its allocation's). Does not
    /// change the running sample time. Counted, not kept (as off-CPU ones).
    #[allow(clippy::too_many_arguments)] // the record's fields, in stream order
    pub fn heap_event(
        &mut self,
        thread: ThreadId,
        stack: StackId,
        time_us: u64,
        address: u64,
        size: u64,
        bytes: u64,
        freed: bool,
    ) -> Result<(), Error> {
        self.check_poison()?;
        let (thread, stack) = (thread.get() as u64, stack.get() as u64);
        if let Err(kind) = self.defs.count_heap(thread, stack) {
            return Err(Error::InvalidRecord { offset: self.len(), kind });
        }
        let at = self.buf.len();
        record::encode(&Record::Heap { thread, stack, time_us, address, size, bytes, freed }, &mut self.buf);
        debug_assert!(
            record::decode_fields(&self.buf[at..]).is_ok_and(|(_, n)| n == self.buf.len() - at),
            "a heap record that does not decode"
        );
        self.maybe_flush()
    }

    /// Define a stack node: `frame` called from the stack `parent` (or a root).
    pub fn define_stack(&mut self, parent: Option<StackId>, frame: FrameId) -> Result<StackId, Error> {
        let id = self.defs.stack_count() as u64;
        self.push(Record::Stack { id, parent: parent.map(|p| p.get() as u64), frame: frame.get() as u64 })?;
        Ok(StackId(id as u32))
    }

    /// Define a thread identity; returns its id.
    pub fn define_thread(&mut self, pid: u32, tid: u32, name: &str) -> Result<ThreadId, Error> {
        self.check_len("thread name", name.len(), MAX_THREAD_NAME_LEN)?;
        let id = self.defs.threads().len() as u64;
        self.push(Record::Thread { id, pid: pid as u64, tid: tid as u64, name: name.as_bytes() })?;
        Ok(ThreadId(id as u32))
    }

    /// Append a sample taken at `time_us` (unix microseconds).
    #[inline]
    pub fn sample(&mut self, time_us: u64, thread: ThreadId, stack: StackId) -> Result<(), Error> {
        self.check_poison()?;
        let delta = time_us as i128 - self.defs.last_time_us() as i128;
        let Ok(delta_us) = i64::try_from(delta) else {
            return Err(Error::InvalidRecord {
                offset: self.len(),
                kind: FormatErrorKind::TimestampOverflow,
            });
        };
        // The readers' own sample rule (`apply_sample` is what their sample
        // loop checks, field for field).
        if let Err(kind) = self.defs.apply_sample(delta_us, thread.get() as u64, stack.get() as u64) {
            return Err(Error::InvalidRecord { offset: self.len(), kind });
        }
        let fields = SampleFields { delta_us, thread: thread.get() as u64, stack: stack.get() as u64 };
        sample::encode(&fields, &mut self.buf);
        self.maybe_flush()
    }

    /// Mark process `pid` entering (`true`) or leaving Python-runtime mode.
    pub fn python_runtime(&mut self, pid: u32, time_us: u64, entering: bool) -> Result<(), Error> {
        self.push(Record::PythonRuntime { pid: pid as u64, time_us, entering })
    }

    /// Retire every active module of process `pid`.
    pub fn deactivate_process_modules(&mut self, pid: u32) -> Result<(), Error> {
        self.push(Record::ProcessModuleDeactivation { pid: pid as u64 })
    }

    /// Retire one module.
    pub fn deactivate_module(&mut self, module: ModuleId) -> Result<(), Error> {
        self.push(Record::ModuleDeactivation { module: module.get() as u64 })
    }
}
