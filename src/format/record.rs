//! The record codec: one `Record` enum, decoded from and encoded into bytes.
//!
//! Decoding only checks the syntax of a record (tags, varints, lengths against
//! the format's limits, the values of flags, UTF-8 of thread names). It reads
//! the fields in stream order into the record, so a record that does not decode
//! completely comes back as a [`Partial`] holding the fields before the one
//! that failed. The rules that relate a record to earlier ones live in
//! [`super::defs`], which checks what this module decoded, partial records
//! included. The sample record's layout and the fast decoders of it that the
//! readers' sample loops use are in [`sample`].

use super::limits::*;
use super::varint::{self, VarintError};
use super::{frame_kind, tag};
use crate::FormatErrorKind;

pub(crate) mod sample;

pub(crate) use sample::SampleFields;

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
        frame: RawFrame<'a>,
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
    Sample(SampleFields),
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
    OffCpu {
        thread: u64,
        stack: u64,
        start_us: u64,
        duration_us: u64,
        preempted: bool,
    },
    Heap {
        thread: u64,
        stack: u64,
        time_us: u64,
        address: u64,
        size: u64,
        bytes: u64,
        freed: bool,
    },
}

impl Record<'_> {
    /// A record of kind `tag` with every field zero or empty, which the
    /// decoder fills in stream order; `None` for an unknown tag.
    fn empty(tag: u8) -> Option<Record<'static>> {
        Some(match tag {
            tag::MODULE => Record::Module {
                id: 0,
                pid: 0,
                start: 0,
                size: 0,
                file_offset: 0,
                generation: 0,
                path: &[],
                build_id: &[],
            },
            tag::FRAME => Record::Frame { id: 0, frame: RawFrame::Truncated },
            tag::STACK => Record::Stack { id: 0, parent: None, frame: 0 },
            tag::THREAD => Record::Thread { id: 0, pid: 0, tid: 0, name: &[] },
            tag::SAMPLE => Record::Sample(SampleFields::default()),
            tag::PYTHON_RUNTIME => Record::PythonRuntime { pid: 0, time_us: 0, entering: false },
            tag::PROCESS_MODULE_DEACTIVATION => Record::ProcessModuleDeactivation { pid: 0 },
            tag::MODULE_DEACTIVATION => Record::ModuleDeactivation { module: 0 },
            tag::OFF_CPU => {
                Record::OffCpu { thread: 0, stack: 0, start_us: 0, duration_us: 0, preempted: false }
            }
            tag::HEAP => {
                Record::Heap { thread: 0, stack: 0, time_us: 0, address: 0, size: 0, bytes: 0, freed: false }
            }
            _ => return None,
        })
    }
}

/// A frame's payload before its references are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RawFrame<'a> {
    Module { module: u64, file_relative: u64 },
    Absolute { address: u64, kernel: bool },
    Truncated,
    Label(&'a [u8]),
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

/// A record that did not decode completely: the fields before the one that
/// failed, and why it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Partial<'a> {
    /// The record with its first `fields` fields decoded (in stream order, as
    /// FORMAT.md lists them) and the rest zero or empty; `None` when the tag
    /// itself is missing or unknown.
    pub(crate) record: Option<Record<'a>>,
    /// How many fields are complete and syntactically valid.
    pub(crate) fields: usize,
    pub(crate) error: DecodeError,
}

/// A read position inside one record. Every read either yields a complete,
/// canonical field, reports that the input ends inside it (`Incomplete`), or
/// reports a malformed field with its offset within the record. It counts the
/// fields it has read completely and validly.
pub(crate) struct Cursor<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
    pub(crate) fields: usize,
}

impl<'a> Cursor<'a> {
    #[inline]
    pub(crate) fn new(buf: &'a [u8], pos: usize) -> Cursor<'a> {
        Cursor { buf, pos, fields: 0 }
    }

    /// A varint, not yet counted as a field (its value may still be checked).
    #[inline(always)]
    fn varint(&mut self) -> Result<u64, DecodeError> {
        match varint::decode_u64(&self.buf[self.pos..]) {
            Ok((v, n)) => {
                self.pos += n;
                Ok(v)
            }
            Err(VarintError::Incomplete) => Err(DecodeError::Incomplete),
            Err(VarintError::Bad) => Err(DecodeError::Bad { at: self.pos, kind: FormatErrorKind::BadVarint }),
        }
    }

    /// An unsigned varint field.
    #[inline(always)]
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        let v = self.varint()?;
        self.fields += 1;
        Ok(v)
    }

    /// A varint field that must be 0 or 1 (`what` names it in the error).
    fn flag(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        let at = self.pos;
        let v = self.varint()?;
        if v > 1 {
            return Err(self.bad(at, FormatErrorKind::BadValue(what, v)));
        }
        self.fields += 1;
        Ok(v == 1)
    }

    /// The zero payload of a truncated-stack marker.
    fn truncation_payload(&mut self) -> Result<(), DecodeError> {
        let at = self.pos;
        if self.varint()? != 0 {
            return Err(self.bad(at, FormatErrorKind::BadTruncationMarker));
        }
        self.fields += 1;
        Ok(())
    }

    /// A length-prefixed byte string of at most `limit` bytes. The length is
    /// checked against the limit before the bytes are needed.
    fn bytes(&mut self, what: &'static str, limit: u64) -> Result<&'a [u8], DecodeError> {
        match self.bytes_or_partial(what, limit)? {
            Ok(s) => {
                self.fields += 1;
                Ok(s)
            }
            Err(_) => Err(DecodeError::Incomplete),
        }
    }

    /// The string of [`Cursor::bytes`], not yet counted as a field; when the
    /// input ends inside the string itself, `Ok(Err(prefix))` with the bytes
    /// that are present, so the caller can reject a prefix no completion could
    /// make valid.
    fn bytes_or_partial(
        &mut self,
        what: &'static str,
        limit: u64,
    ) -> Result<Result<&'a [u8], &'a [u8]>, DecodeError> {
        let at = self.pos;
        let len = self.varint()?;
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

    /// A byte string of valid UTF-8 (see [`Cursor::bytes`]). When the input
    /// ends inside it, the bytes present must still be able to start valid
    /// UTF-8 (only a final character may be cut off): otherwise no completion
    /// could be valid.
    fn utf8(&mut self, what: &'static str, limit: u64) -> Result<&'a [u8], DecodeError> {
        let at = self.pos;
        let bad_utf8 = DecodeError::Bad { at, kind: FormatErrorKind::BadUtf8(what) };
        match self.bytes_or_partial(what, limit)? {
            Ok(s) => {
                std::str::from_utf8(s).map_err(|_| bad_utf8)?;
                self.fields += 1;
                Ok(s)
            }
            Err(prefix) => match std::str::from_utf8(prefix) {
                Err(e) if e.error_len().is_some() => Err(bad_utf8),
                _ => Err(DecodeError::Incomplete),
            },
        }
    }

    fn bad(&self, at: usize, kind: FormatErrorKind) -> DecodeError {
        DecodeError::Bad { at, kind }
    }
}

/// Decode one record from the start of `buf`, returning it and its length.
#[inline]
pub(crate) fn decode(buf: &[u8]) -> Result<(Record<'_>, usize), DecodeError> {
    decode_fields(buf).map_err(|p| p.error)
}

/// A stack record's id, parent (`None` for a root node) and frame.
pub(crate) type StackFields = (u64, Option<u64>, u64);

/// The fields of a stack record (the tag at `buf[0]` is [`tag::STACK`]): the
/// id, the parent (`None` for a root node) and the frame, and the record's
/// length. `None` when a field is incomplete or malformed: [`decode_fields`]
/// then decides, with the error that names the field. Stack definitions are
/// the most frequent records after samples, and this path skips building a
/// [`Record`].
#[inline]
pub(crate) fn decode_stack(buf: &[u8]) -> Option<(StackFields, usize)> {
    debug_assert_eq!(buf.first(), Some(&tag::STACK));
    let mut c = Cursor::new(buf, 1);
    let (mut id, mut parent, mut frame) = (0, None, 0);
    stack_fields(&mut c, &mut id, &mut parent, &mut frame).ok()?;
    Some(((id, parent, frame), c.pos))
}

/// The stack record's layout after its tag: id, parent + 1 (0 for a root),
/// frame. Each field is stored as soon as it is read, so that a record cut
/// short keeps the fields before the failing one.
#[inline(always)]
fn stack_fields(
    c: &mut Cursor<'_>,
    id: &mut u64,
    parent: &mut Option<u64>,
    frame: &mut u64,
) -> Result<(), DecodeError> {
    *id = c.u64()?;
    *parent = c.u64()?.checked_sub(1);
    *frame = c.u64()?;
    Ok(())
}

/// [`decode`], but a record that does not decode completely comes back as a
/// [`Partial`] with the fields before the one that failed, so that the rules
/// on those fields can still be checked (a complete field is checked even if
/// its record is not; FORMAT.md, section 6).
// The error carries the partial record by value, as large as the record
// itself: it is consumed by the caller at once (`Definitions::read_record`),
// never propagated up a call chain, and boxing it would allocate per error.
#[allow(clippy::result_large_err)]
pub(crate) fn decode_fields(buf: &[u8]) -> Result<(Record<'_>, usize), Partial<'_>> {
    let Some(&t) = buf.first() else {
        return Err(Partial { record: None, fields: 0, error: DecodeError::Incomplete });
    };
    let Some(mut rec) = Record::empty(t) else {
        let error = DecodeError::Bad { at: 0, kind: FormatErrorKind::UnknownTag(t) };
        return Err(Partial { record: None, fields: 0, error });
    };
    let mut c = Cursor::new(buf, 1);
    match read_fields(&mut rec, &mut c) {
        Ok(()) => Ok((rec, c.pos)),
        Err(error) => Err(Partial { record: Some(rec), fields: c.fields, error }),
    }
}

/// Fill the fields of `rec` (an empty record of its kind) from `c`, in stream
/// order, checking the syntax of each as it is read.
fn read_fields<'a>(rec: &mut Record<'a>, c: &mut Cursor<'a>) -> Result<(), DecodeError> {
    match rec {
        Record::Sample(f) => {
            let q = c.pos;
            let mut r = sample::Recording::new(c);
            match sample::read_fields(&mut r, q) {
                Ok((fields, end)) => (*f, c.pos) = (fields, end),
                Err(e) => {
                    *f = r.partial();
                    return Err(e);
                }
            }
        }
        Record::Stack { id, parent, frame } => stack_fields(c, id, parent, frame)?,
        Record::Frame { id, frame } => {
            *id = c.u64()?;
            let kind_at = c.pos;
            match c.varint()? {
                frame_kind::MODULE => {
                    c.fields += 1;
                    *frame = RawFrame::Module { module: 0, file_relative: 0 };
                    let module = c.u64()?;
                    *frame = RawFrame::Module { module, file_relative: 0 };
                    let file_relative = c.u64()?;
                    *frame = RawFrame::Module { module, file_relative };
                }
                frame_kind::ABSOLUTE => {
                    c.fields += 1;
                    *frame = RawFrame::Absolute { address: 0, kernel: false };
                    let address = c.u64()?;
                    *frame = RawFrame::Absolute { address, kernel: false };
                    let kernel = c.flag("frame mode bit")?;
                    *frame = RawFrame::Absolute { address, kernel };
                }
                frame_kind::TRUNCATED => {
                    c.fields += 1;
                    *frame = RawFrame::Truncated;
                    c.truncation_payload()?;
                }
                frame_kind::LABEL => {
                    c.fields += 1;
                    *frame = RawFrame::Label(&[]);
                    *frame = RawFrame::Label(c.utf8("frame label", MAX_LABEL_LEN)?);
                }
                other => return Err(c.bad(kind_at, FormatErrorKind::UnknownFrameKind(other))),
            }
        }
        Record::Module { id, pid, start, size, file_offset, generation, path, build_id } => {
            *id = c.u64()?;
            *pid = c.u64()?;
            *start = c.u64()?;
            *size = c.u64()?;
            *file_offset = c.u64()?;
            *generation = c.u64()?;
            *path = c.bytes("module path", MAX_PATH_LEN)?;
            *build_id = c.bytes("build id", MAX_BUILD_ID_LEN)?;
        }
        Record::Thread { id, pid, tid, name } => {
            *id = c.u64()?;
            *pid = c.u64()?;
            *tid = c.u64()?;
            *name = c.utf8("thread name", MAX_THREAD_NAME_LEN)?;
        }
        Record::PythonRuntime { pid, time_us, entering } => {
            *pid = c.u64()?;
            *time_us = c.u64()?;
            *entering = c.flag("Python-runtime state")?;
        }
        Record::ProcessModuleDeactivation { pid } => *pid = c.u64()?,
        Record::ModuleDeactivation { module } => *module = c.u64()?,
        Record::OffCpu { thread, stack, start_us, duration_us, preempted } => {
            *thread = c.u64()?;
            *stack = c.u64()?;
            *start_us = c.u64()?;
            *duration_us = c.u64()?;
            *preempted = c.flag("off-CPU state")?;
        }
        Record::Heap { thread, stack, time_us, address, size, bytes, freed } => {
            *thread = c.u64()?;
            *stack = c.u64()?;
            *time_us = c.u64()?;
            *address = c.u64()?;
            *size = c.u64()?;
            *bytes = c.u64()?;
            *freed = c.flag("heap event state")?;
        }
    }
    Ok(())
}

/// Append the encoding of `rec` to `out`.
pub(crate) fn encode(rec: &Record<'_>, out: &mut Vec<u8>) {
    use varint::put_u64;
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
                RawFrame::Label(label) => {
                    put_u64(out, frame_kind::LABEL);
                    put_u64(out, label.len() as u64);
                    out.extend_from_slice(label);
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
        Record::Sample(ref fields) => sample::encode(fields, out),
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
        Record::OffCpu { thread, stack, start_us, duration_us, preempted } => {
            // The reference for `encode_off_cpu` (which a recorder uses).
            out.push(tag::OFF_CPU);
            for v in [thread, stack, start_us, duration_us, preempted as u64] {
                put_u64(out, v);
            }
        }
        Record::Heap { thread, stack, time_us, address, size, bytes, freed } => {
            out.push(tag::HEAP);
            for v in [thread, stack, time_us, address, size, bytes, freed as u64] {
                put_u64(out, v);
            }
        }
    }
}

/// Append the encoding of an off-CPU record (tag 9) to `out`: the bytes
/// [`encode`] writes for `Record::OffCpu` with these fields, without a
/// [`Record`] to build and match (a recorder writes one a blocking: the
/// generic encoder was a third of the writer's cost of an interval). The
/// buffer grows by the longest such record at once (one capacity check, not
/// one a byte) and the fields are written in place.
#[inline]
pub(crate) fn encode_off_cpu(
    out: &mut Vec<u8>,
    thread: u64,
    stack: u64,
    start_us: u64,
    duration_us: u64,
    preempted: bool,
) {
    const LONGEST: usize = 1 + 4 * varint::MAX_LEN + 1;
    out.reserve(LONGEST);
    let spare = &mut out.spare_capacity_mut()[..LONGEST];
    spare[0].write(tag::OFF_CPU);
    let mut n = 1;
    for v in [thread, stack, start_us, duration_us] {
        n += varint::write_u64_uninit(&mut spare[n..], v);
    }
    // The state: 0 or 1, one byte.
    spare[n].write(preempted as u8);
    n += 1;
    let len = out.len() + n;
    // SAFETY: `len` is within the capacity (`LONGEST` bytes were reserved
    // past the old length, and `n <= LONGEST`), and the `n` bytes after the
    // old length were all written just above.
    unsafe { out.set_len(len) };
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
    let mut c = Cursor::new(buf, MAGIC.len());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The recorder's off-CPU encoder writes the generic encoder's bytes,
    /// at each varint length's edges of each field and at the largest
    /// values, and appends to what the buffer held (also when it must grow).
    #[test]
    fn the_off_cpu_encoder_writes_the_generic_encoders_bytes() {
        let mut edges = vec![0u64, 1, u64::MAX - 1, u64::MAX];
        for bits in (7..64).step_by(7) {
            edges.extend([(1u64 << bits) - 1, 1u64 << bits]);
        }
        edges.push(1_764_000_000_000_000);
        let mut records = 0;
        for (i, &a) in edges.iter().enumerate() {
            for &b in &edges {
                let c = edges[(i * 7 + 3) % edges.len()];
                for fields in [[a, b, c, b], [b, a, b, c], [c, c, a, b], [b, c, c, a]] {
                    for preempted in [false, true] {
                        let [thread, stack, start_us, duration_us] = fields;
                        let mut want = vec![7u8; 3];
                        encode(
                            &Record::OffCpu { thread, stack, start_us, duration_us, preempted },
                            &mut want,
                        );
                        // Full but for a byte: the record does not fit.
                        let mut got = Vec::with_capacity(4);
                        got.extend_from_slice(&[7u8; 3]);
                        encode_off_cpu(&mut got, thread, stack, start_us, duration_us, preempted);
                        assert_eq!(got, want, "{fields:?} {preempted}");
                        records += 1;
                    }
                }
            }
        }
        assert!(records > 1000);
    }

    /// An off-CPU record has the bytes of its fields written one varint
    /// after the other, the largest values included, and appends to what
    /// the buffer held.
    #[test]
    fn off_cpu_records_encode_field_by_field() {
        for (thread, stack, start_us, duration_us, preempted) in [
            (0, 0, 0, 0, false),
            (1, 300, 1_764_000_000_000_000, 2_000, true),
            (u64::MAX, u64::MAX, u64::MAX, u64::MAX, true),
        ] {
            let mut want = vec![7u8];
            want.push(tag::OFF_CPU);
            for v in [thread, stack, start_us, duration_us, preempted as u64] {
                varint::put_u64(&mut want, v);
            }
            let mut got = vec![7u8];
            encode(&Record::OffCpu { thread, stack, start_us, duration_us, preempted }, &mut got);
            assert_eq!(got, want);
            let (rec, n) = decode_fields(&got[1..]).expect("decodes");
            assert_eq!(n, got.len() - 1);
            assert!(
                matches!(rec, Record::OffCpu { thread: t, duration_us: d, .. } if t == thread && d == duration_us)
            );
        }
    }

    /// A heap record is its fields' varints one after the other, decodes
    /// back to them, and a state other than 0 or 1 is refused at its byte.
    #[test]
    fn heap_records_encode_field_by_field() {
        for (fields, freed) in [
            ([0u64, 0, 0, 0, 0, 0], false),
            ([3, 70, 1_764_000_000_000_000, 0x7f12_3456_7000, 1024, 524_288], true),
            ([u64::MAX; 6], true),
        ] {
            let [thread, stack, time_us, address, size, bytes] = fields;
            let rec = Record::Heap { thread, stack, time_us, address, size, bytes, freed };
            let mut want = vec![7u8, tag::HEAP];
            for v in fields.into_iter().chain([freed as u64]) {
                varint::put_u64(&mut want, v);
            }
            let mut got = vec![7u8];
            encode(&rec, &mut got);
            assert_eq!(got, want);
            let (back, n) = decode_fields(&got[1..]).expect("decodes");
            assert_eq!((back, n), (rec, got.len() - 1));
            // The state byte is the last: 2 is not a state.
            let mut bad = got[1..].to_vec();
            *bad.last_mut().unwrap() = 2;
            let e = decode_fields(&bad).expect_err("state 2");
            assert_eq!(e.fields, 6);
            assert!(
                matches!(e.error, DecodeError::Bad { at, kind: FormatErrorKind::BadValue("heap event state", 2) } if at == bad.len() - 1),
                "{e:?}"
            );
        }
    }
}
