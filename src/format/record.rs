//! The record codec: one `Record` enum, decoded from and encoded into bytes.
//!
//! Decoding only checks the syntax of a record (tags, varints, lengths against
//! the format's limits). The rules that relate a record to earlier ones live in
//! [`super::defs`].

use super::limits::*;
use super::varint::{self, VarintError};
use super::{frame_kind, tag};
use crate::FormatErrorKind;

/// A decoded record, borrowing its strings from the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Record<'a> {
    Module {
        id: u64,
        pid: u64,
        start: u64,
        size: u64,
        file_offset: u64,
        generation: u64,
        path: &'a [u8],
        build_id: &'a [u8],
    },
    Frame {
        id: u64,
        frame: RawFrame,
    },
    Stack {
        id: u64,
        /// `None` for a root node.
        parent: Option<u64>,
        frame: u64,
    },
    Thread {
        id: u64,
        pid: u64,
        tid: u64,
        name: &'a [u8],
    },
    Sample {
        delta_us: i64,
        thread: u64,
        stack: u64,
    },
    PythonRuntime {
        pid: u64,
        time_us: u64,
        entering: bool,
    },
    ProcessModuleDeactivation {
        pid: u64,
    },
    ModuleDeactivation {
        module: u64,
    },
}

/// A frame's payload before its references are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RawFrame {
    Module { module: u64, file_relative: u64 },
    Absolute { address: u64, kernel: bool },
    Truncated,
}

/// Why a record could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecodeError {
    /// The input ends inside the record.
    Incomplete,
    /// The record is malformed; `at` is the offset within the record of the
    /// field that is wrong.
    Bad { at: usize, kind: FormatErrorKind },
}

/// A read position inside one record. Every read either yields a complete,
/// canonical field, reports that the input ends inside it (`Incomplete`), or
/// reports a malformed field with its offset within the record.
pub(crate) struct Cursor<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Cursor<'a> {
    #[inline]
    pub(crate) fn new(buf: &'a [u8], pos: usize) -> Cursor<'a> {
        Cursor { buf, pos }
    }

    #[inline]
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        match varint::decode_u64(&self.buf[self.pos..]) {
            Ok((v, n)) => {
                self.pos += n;
                Ok(v)
            }
            Err(VarintError::Incomplete) => Err(DecodeError::Incomplete),
            Err(VarintError::Bad) => Err(DecodeError::Bad { at: self.pos, kind: FormatErrorKind::BadVarint }),
        }
    }

    #[inline]
    pub(crate) fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(varint::unzigzag(self.u64()?))
    }

    /// The rest of an absolute frame after its kind: the address and the
    /// user/kernel mode bit.
    pub(crate) fn absolute_frame(&mut self) -> Result<(u64, bool), DecodeError> {
        let address = self.u64()?;
        let mode_at = self.pos;
        let mode = self.u64()?;
        if mode > 1 {
            return Err(self.bad(mode_at, FormatErrorKind::BadValue("frame mode bit", mode)));
        }
        Ok((address, mode == 1))
    }

    /// The zero payload of a truncated-stack marker.
    pub(crate) fn truncation_payload(&mut self) -> Result<(), DecodeError> {
        let payload_at = self.pos;
        if self.u64()? != 0 {
            return Err(self.bad(payload_at, FormatErrorKind::BadTruncationMarker));
        }
        Ok(())
    }

    /// A length-prefixed byte string of at most `limit` bytes. The length is
    /// checked against the limit before the bytes are needed.
    pub(crate) fn bytes(&mut self, what: &'static str, limit: u64) -> Result<&'a [u8], DecodeError> {
        match self.bytes_or_partial(what, limit)? {
            Ok(s) => Ok(s),
            Err(_) => Err(DecodeError::Incomplete),
        }
    }

    /// Like [`Cursor::bytes`], but when the input ends inside the string itself
    /// returns `Ok(Err(prefix))` with the bytes that are present, so a caller
    /// can reject a prefix no completion could make valid.
    pub(crate) fn bytes_or_partial(
        &mut self,
        what: &'static str,
        limit: u64,
    ) -> Result<Result<&'a [u8], &'a [u8]>, DecodeError> {
        let at = self.pos;
        let len = self.u64()?;
        if len > limit {
            return Err(DecodeError::Bad { at, kind: FormatErrorKind::TooLong { what, len, limit } });
        }
        let len = len as usize;
        if self.buf.len() - self.pos < len {
            return Ok(Err(&self.buf[self.pos..]));
        }
        let s = &self.buf[self.pos..self.pos + len];
        self.pos += len;
        Ok(Ok(s))
    }

    pub(crate) fn bad(&self, at: usize, kind: FormatErrorKind) -> DecodeError {
        DecodeError::Bad { at, kind }
    }
}

/// Decode one record from the start of `buf`, returning it and its length.
#[inline]
pub(crate) fn decode(buf: &[u8]) -> Result<(Record<'_>, usize), DecodeError> {
    let Some(&t) = buf.first() else {
        return Err(DecodeError::Incomplete);
    };
    let mut c = Cursor { buf, pos: 1 };
    let rec = match t {
        tag::SAMPLE => {
            let delta_us = c.i64()?;
            let thread = c.u64()?;
            let stack = c.u64()?;
            Record::Sample { delta_us, thread, stack }
        }
        tag::STACK => {
            let id = c.u64()?;
            let parent = c.u64()?;
            let frame = c.u64()?;
            Record::Stack { id, parent: parent.checked_sub(1), frame }
        }
        tag::FRAME => {
            let id = c.u64()?;
            let kind_at = c.pos;
            let kind = c.u64()?;
            let frame = match kind {
                frame_kind::MODULE => {
                    let module = c.u64()?;
                    let file_relative = c.u64()?;
                    RawFrame::Module { module, file_relative }
                }
                frame_kind::ABSOLUTE => {
                    let (address, kernel) = c.absolute_frame()?;
                    RawFrame::Absolute { address, kernel }
                }
                frame_kind::TRUNCATED => {
                    c.truncation_payload()?;
                    RawFrame::Truncated
                }
                other => return Err(c.bad(kind_at, FormatErrorKind::UnknownFrameKind(other))),
            };
            Record::Frame { id, frame }
        }
        tag::MODULE => {
            let id = c.u64()?;
            let pid = c.u64()?;
            let start = c.u64()?;
            let size = c.u64()?;
            let file_offset = c.u64()?;
            let generation = c.u64()?;
            let path = c.bytes("module path", MAX_PATH_LEN)?;
            let build_id = c.bytes("build id", MAX_BUILD_ID_LEN)?;
            Record::Module { id, pid, start, size, file_offset, generation, path, build_id }
        }
        tag::THREAD => {
            let id = c.u64()?;
            let pid = c.u64()?;
            let tid = c.u64()?;
            let name_at = c.pos;
            let name = c.bytes("thread name", MAX_THREAD_NAME_LEN)?;
            if std::str::from_utf8(name).is_err() {
                return Err(c.bad(name_at, FormatErrorKind::BadUtf8("thread name")));
            }
            Record::Thread { id, pid, tid, name }
        }
        tag::PYTHON_RUNTIME => {
            let pid = c.u64()?;
            let time_us = c.u64()?;
            let state_at = c.pos;
            let state = c.u64()?;
            if state > 1 {
                return Err(c.bad(state_at, FormatErrorKind::BadValue("Python-runtime state", state)));
            }
            Record::PythonRuntime { pid, time_us, entering: state == 1 }
        }
        tag::PROCESS_MODULE_DEACTIVATION => Record::ProcessModuleDeactivation { pid: c.u64()? },
        tag::MODULE_DEACTIVATION => Record::ModuleDeactivation { module: c.u64()? },
        other => return Err(DecodeError::Bad { at: 0, kind: FormatErrorKind::UnknownTag(other) }),
    };
    Ok((rec, c.pos))
}

/// Append the encoding of `rec` to `out`.
pub(crate) fn encode(rec: &Record<'_>, out: &mut Vec<u8>) {
    use varint::{put_i64, put_u64};
    match *rec {
        Record::Module { id, pid, start, size, file_offset, generation, path, build_id } => {
            out.push(tag::MODULE);
            for v in [id, pid, start, size, file_offset, generation] {
                put_u64(out, v);
            }
            put_u64(out, path.len() as u64);
            out.extend_from_slice(path);
            put_u64(out, build_id.len() as u64);
            out.extend_from_slice(build_id);
        }
        Record::Frame { id, frame } => {
            out.push(tag::FRAME);
            put_u64(out, id);
            match frame {
                RawFrame::Module { module, file_relative } => {
                    put_u64(out, frame_kind::MODULE);
                    put_u64(out, module);
                    put_u64(out, file_relative);
                }
                RawFrame::Absolute { address, kernel } => {
                    put_u64(out, frame_kind::ABSOLUTE);
                    put_u64(out, address);
                    put_u64(out, kernel as u64);
                }
                RawFrame::Truncated => {
                    put_u64(out, frame_kind::TRUNCATED);
                    put_u64(out, 0);
                }
            }
        }
        Record::Stack { id, parent, frame } => {
            out.push(tag::STACK);
            put_u64(out, id);
            put_u64(out, parent.map_or(0, |p| p + 1));
            put_u64(out, frame);
        }
        Record::Thread { id, pid, tid, name } => {
            out.push(tag::THREAD);
            put_u64(out, id);
            put_u64(out, pid);
            put_u64(out, tid);
            put_u64(out, name.len() as u64);
            out.extend_from_slice(name);
        }
        Record::Sample { delta_us, thread, stack } => {
            out.push(tag::SAMPLE);
            put_i64(out, delta_us);
            put_u64(out, thread);
            put_u64(out, stack);
        }
        Record::PythonRuntime { pid, time_us, entering } => {
            out.push(tag::PYTHON_RUNTIME);
            put_u64(out, pid);
            put_u64(out, time_us);
            put_u64(out, entering as u64);
        }
        Record::ProcessModuleDeactivation { pid } => {
            out.push(tag::PROCESS_MODULE_DEACTIVATION);
            put_u64(out, pid);
        }
        Record::ModuleDeactivation { module } => {
            out.push(tag::MODULE_DEACTIVATION);
            put_u64(out, module);
        }
    }
}

/// Decode the stream header from the start of `buf`: returns it and its length.
pub(crate) fn decode_header(buf: &[u8]) -> Result<(crate::Header, usize), (usize, FormatErrorKind)> {
    use super::MAGIC;
    if buf.len() < MAGIC.len() {
        if MAGIC.starts_with(buf) {
            return Err((0, FormatErrorKind::TruncatedHeader));
        }
        return Err((0, FormatErrorKind::BadMagic));
    }
    if buf[..MAGIC.len()] != MAGIC {
        return Err((0, FormatErrorKind::BadMagic));
    }
    let mut c = Cursor { buf, pos: MAGIC.len() };
    let field = |c: &mut Cursor<'_>| -> Result<(u64, usize), (usize, FormatErrorKind)> {
        let at = c.pos;
        match c.u64() {
            Ok(v) => Ok((v, at)),
            Err(DecodeError::Incomplete) => Err((at, FormatErrorKind::TruncatedHeader)),
            Err(DecodeError::Bad { at, kind }) => Err((at, kind)),
        }
    };
    let (start_time_us, _) = field(&mut c)?;
    let (interval_us, _) = field(&mut c)?;
    Ok((crate::Header { start_time_us, interval_us }, c.pos))
}

/// Append the stream header to `out`.
pub(crate) fn encode_header(h: &crate::Header, out: &mut Vec<u8>) {
    out.extend_from_slice(&super::MAGIC);
    varint::put_u64(out, h.start_time_us);
    varint::put_u64(out, h.interval_us);
}
