//! The one error type of the crate.
//!
//! Read errors carry the byte offset of the record (or header field) that was
//! rejected and a [`FormatErrorKind`] saying what was wrong with it. Write-side
//! rule violations use the same kinds, with the offset at which the record would
//! have started, so a writer bug and a corrupt file are reported alike.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// What was wrong with a record or header field.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FormatErrorKind {
    /// The file does not start with `SPULSE3\0`.
    BadMagic,
    /// The file ends before the header is complete.
    TruncatedHeader,
    /// A varint is overlong (non-canonical), longer than ten bytes, or does not
    /// fit the field it encodes.
    BadVarint,
    /// An unknown record tag.
    UnknownTag(u8),
    /// An unknown frame kind inside a frame record.
    UnknownFrameKind(u64),
    /// An unknown value in an enumerated field (named).
    BadValue(&'static str, u64),
    /// A definition id that is not the next dense id of its kind.
    NonDenseId {
        /// Which kind of definition ("module", "frame", "stack", "thread").
        what: &'static str,
        /// The id found in the record.
        found: u64,
        /// The id that was expected (the count defined so far).
        expected: u64,
    },
    /// A reference to an id not defined earlier in the stream.
    UndefinedReference {
        /// Which kind of definition is referred to.
        what: &'static str,
        /// The id referred to.
        id: u64,
    },
    /// Address arithmetic overflowed 64 bits.
    AddressOverflow,
    /// A module-relative address lies outside the module's mapped span.
    OutsideModule {
        /// The module.
        module: u64,
        /// The file-relative address.
        address: u64,
    },
    /// A frame refers to a module that was already retired.
    RetiredModule(u64),
    /// A module deactivation names a module that is already retired.
    AlreadyRetired(u64),
    /// A new module overlaps a still-active mapping of the same process.
    OverlappingModule {
        /// The active module it overlaps.
        active: u64,
    },
    /// A module with a zero-sized span.
    EmptyModule,
    /// A string or byte field longer than the format allows.
    TooLong {
        /// The field.
        what: &'static str,
        /// Its declared length.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// A string field that is not valid UTF-8.
    BadUtf8(&'static str),
    /// A stack deeper than the format allows.
    StackTooDeep,
    /// The truncated-stack marker used anywhere but as a stack's root.
    MisplacedTruncationMarker,
    /// The truncated-stack marker carries a non-zero payload.
    BadTruncationMarker,
    /// A sample timestamp below zero or above `u64::MAX` microseconds.
    TimestampOverflow,
    /// An off-CPU interval (tag 9) whose start plus duration passes
    /// `u64::MAX` microseconds.
    IntervalEndOverflow,
    /// A Python-runtime record that enters while already in, or leaves while out.
    PythonRuntimeState,
    /// Too many definitions of one kind (ids are 32-bit).
    TooManyDefinitions(&'static str),
    /// A `Replay` found the file shorter or different than when it was opened
    /// and validated.
    ChangedSinceOpen,
    /// A packed file (`spulse pack`) whose frame, index or blocks are
    /// inconsistent or cut short; the text says what and where.
    PackedCorrupt(String),
}

impl fmt::Display for FormatErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use FormatErrorKind::*;
        match self {
            BadMagic => write!(
                f,
                "not a spulse spool or packed file (bad magic, expected \"SPULSE3\\0\", \"SPULSPK3\" or \"SPULSPK2\")"
            ),
            TruncatedHeader => write!(f, "file ends inside the stream header"),
            BadVarint => write!(f, "malformed varint (overlong, too long, or out of range)"),
            UnknownTag(t) => write!(f, "unknown record tag {t}"),
            UnknownFrameKind(k) => write!(f, "unknown frame kind {k}"),
            BadValue(what, v) => write!(f, "invalid {what} value {v}"),
            NonDenseId { what, found, expected } => {
                write!(f, "{what} id {found} is not the next dense id (expected {expected})")
            }
            UndefinedReference { what, id } => {
                write!(f, "reference to {what} {id}, which is not defined earlier")
            }
            AddressOverflow => write!(f, "address arithmetic overflows 64 bits"),
            OutsideModule { module, address } => {
                write!(f, "file-relative address {address:#x} is outside module {module}'s mapped span")
            }
            RetiredModule(m) => write!(f, "frame refers to retired module {m}"),
            AlreadyRetired(m) => write!(f, "module {m} is already retired"),
            OverlappingModule { active } => {
                write!(f, "module overlaps active module {active} of the same process")
            }
            EmptyModule => write!(f, "module has an empty span"),
            TooLong { what, len, limit } => {
                write!(f, "{what} length {len} exceeds the limit of {limit}")
            }
            BadUtf8(what) => write!(f, "{what} is not valid UTF-8"),
            StackTooDeep => write!(f, "stack deeper than the format's limit"),
            MisplacedTruncationMarker => {
                write!(f, "truncated-stack marker used other than as a stack root")
            }
            BadTruncationMarker => write!(f, "truncated-stack marker with a non-zero payload"),
            TimestampOverflow => write!(f, "sample timestamp out of range"),
            IntervalEndOverflow => {
                write!(f, "off-CPU interval ends out of range (its start plus its duration passes u64::MAX us)")
            }
            PythonRuntimeState => write!(f, "Python-runtime record does not alternate enter/leave"),
            TooManyDefinitions(what) => write!(f, "too many {what} definitions"),
            ChangedSinceOpen => write!(f, "the file changed since it was opened and validated"),
            PackedCorrupt(what) => write!(f, "corrupt packed file: {what}"),
        }
    }
}

/// The error type of every fallible operation in spulse.
///
/// `Debug` prints the same sentence as `Display`, so that `main` returning
/// `Result<(), spulse::Error>` reports e.g. `Error: out.spool: the spool already
/// exists; ...` rather than a struct dump. Match on the variants (or use
/// [`Error::format_kind`], [`Error::offset`], [`std::error::Error::source`])
/// for the details.
#[non_exhaustive]
pub enum Error {
    /// An I/O error, with the file it concerns when there is one.
    Io {
        /// The file, if known.
        path: Option<PathBuf>,
        /// The underlying error.
        source: io::Error,
    },
    /// The spool is malformed at `offset`.
    Format {
        /// The file, if known.
        path: Option<PathBuf>,
        /// Byte offset of the record or header field that was rejected.
        offset: u64,
        /// What was wrong.
        kind: FormatErrorKind,
    },
    /// A writer was asked to write a record that breaks a format rule; nothing
    /// was written.
    InvalidRecord {
        /// Offset at which the record would have started.
        offset: u64,
        /// Which rule it breaks.
        kind: FormatErrorKind,
    },
    /// The writer failed earlier and refuses further records, so that a
    /// partial write is never followed by more bytes.
    WriterPoisoned,
    /// The recorder could not start, stop or mark; [`RecorderError`] says why.
    Recorder(RecorderError),
}

/// Why the recorder could not start, stop or write a mark.
#[non_exhaustive]
pub enum RecorderError {
    /// A recorder is already running in this process (one at a time).
    AlreadyRunning,
    /// No recorder is running (a Python-runtime mark without one).
    NotRunning,
    /// A builder setting (or the environment variable standing for it) is
    /// invalid; nothing was created.
    InvalidConfig {
        /// The setting: `frequency_hz`, `max_stack_depth`, `ring_capacity`,
        /// `flush_interval`, `mode`, `rotate`, `retain`, `path`, `SPULSE_FREQUENCY`,
        /// `SPULSE_OUTPUT`, `SPULSE_ROTATE`, `SPULSE_RETAIN`, `SPULSE_KERNEL_TIME`,
        /// or `seconds` (a profile window's length, `spulse::http`).
        setting: &'static str,
        /// A sentence naming the setting, its value and the accepted values.
        message: String,
    },
    /// The operating system refused a sampling engine (or the signal
    /// disposition it needs); the OS error is the [`source`](std::error::Error::source).
    EngineRefused {
        /// What was refused, e.g. `"perf_event_open (task-clock, sigtrap)"`.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// Every engine tried failed (automatic choice): each one's error, in the
    /// order tried.
    NoEngine(Vec<Error>),
    /// `overwrite(true)` did not replace what is at the path.
    OverwriteRefused {
        /// The path.
        path: PathBuf,
        /// Why it was left alone.
        reason: &'static str,
    },
    /// The recorder's writer thread could not be spawned, exited, or panicked.
    WriterFailed {
        /// What happened to it.
        what: &'static str,
        /// The OS error, when there is one (a failed spawn).
        source: Option<io::Error>,
    },
    /// The Python-runtime mark repeats the current mode (enter while in, or
    /// leave while out).
    PythonModeAlready {
        /// Whether the call was `python_runtime_enter`.
        entering: bool,
    },
    /// A [`Guard`](crate::Guard) used in a process forked from the one that
    /// started the recording; the recording belongs to the parent.
    ForkedChild,
    /// `libspulse_preload.so` (`LD_PRELOAD`, `spulse record`) already records
    /// this process; nothing was started and the program runs on, recorded once.
    RecordedByPreload {
        /// This process's pid.
        pid: u32,
    },
    /// A profile window (`spulse::http`) is already being collected in this
    /// process; one is collected at a time.
    ProfileInProgress,
    /// The recording stopped writing before the end: the spool could not be
    /// written (`source`: the disk filled, or the program closed the spool's
    /// descriptor or reused its number for a file of its own, see
    /// `src/recorder/own_fd.rs`). What was written before stays a valid spool;
    /// the samples taken afterwards were counted and dropped.
    WriteStopped {
        /// What stopped it.
        source: Box<Error>,
        /// Samples in the spool (written before the failure).
        samples_written: u64,
        /// Samples taken but not in the spool: those still buffered at the
        /// failure and every one taken afterwards.
        samples_lost: u64,
        /// What did not go as configured, as [`Stats::warnings`](crate::Stats::warnings)
        /// would have held it (the first: writing stopped, and why).
        warnings: Vec<String>,
    },
}

impl fmt::Display for RecorderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use RecorderError::*;
        match self {
            AlreadyRunning => write!(
                f,
                "a spulse recorder is already running in this process; finish it before starting another"
            ),
            NotRunning => write!(f, "no spulse recorder is running"),
            InvalidConfig { message, .. } => write!(f, "{message}"),
            EngineRefused { what, source } => write!(f, "{what} was refused: {source}"),
            NoEngine(errors) => {
                write!(f, "cannot start sampling: ")?;
                for (i, e) in errors.iter().enumerate() {
                    if i > 0 {
                        write!(f, "; ")?;
                    }
                    write!(f, "{e}")?;
                }
                Ok(())
            }
            OverwriteRefused { path, reason } => write!(f, "{}: not overwritten: {reason}", path.display()),
            WriterFailed { what, source: Some(e) } => write!(f, "the spulse writer thread {what}: {e}"),
            WriterFailed { what, source: None } => write!(f, "the spulse writer thread {what}"),
            PythonModeAlready { entering: true } => {
                write!(f, "python_runtime_enter: the process is in Python-runtime mode already")
            }
            PythonModeAlready { entering: false } => {
                write!(f, "python_runtime_leave: the process is out of Python-runtime mode already")
            }
            ForkedChild => {
                write!(f, "this recorder belongs to the parent process (guard used after fork)")
            }
            RecordedByPreload { pid } => write!(
                f,
                "process {pid} is already recorded by libspulse_preload.so (LD_PRELOAD or `spulse record`); \
                 this recorder was not started and the program runs on, recorded once"
            ),
            ProfileInProgress => write!(
                f,
                "a profile is already being collected in this process (one at a time); retry when it ends"
            ),
            WriteStopped { source, samples_written, samples_lost, .. } => write!(
                f,
                "the recording stopped writing early: {source}; the spool holds the {samples_written} samples \
                 written before, {samples_lost} taken afterwards were lost"
            ),
        }
    }
}

/// `{:?}` prints the sentence of `Display` (what `main` returning the error
/// shows); `{:#?}` prints the variant and its fields.
impl fmt::Debug for RecorderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !f.alternate() {
            return fmt::Display::fmt(self, f);
        }
        use RecorderError::*;
        match self {
            AlreadyRunning => f.write_str("AlreadyRunning"),
            NotRunning => f.write_str("NotRunning"),
            InvalidConfig { setting, message } => {
                f.debug_struct("InvalidConfig").field("setting", setting).field("message", message).finish()
            }
            EngineRefused { what, source } => {
                f.debug_struct("EngineRefused").field("what", what).field("source", source).finish()
            }
            NoEngine(errors) => f.debug_tuple("NoEngine").field(errors).finish(),
            OverwriteRefused { path, reason } => {
                f.debug_struct("OverwriteRefused").field("path", path).field("reason", reason).finish()
            }
            WriterFailed { what, source } => {
                f.debug_struct("WriterFailed").field("what", what).field("source", source).finish()
            }
            PythonModeAlready { entering } => {
                f.debug_struct("PythonModeAlready").field("entering", entering).finish()
            }
            ForkedChild => f.write_str("ForkedChild"),
            RecordedByPreload { pid } => f.debug_struct("RecordedByPreload").field("pid", pid).finish(),
            ProfileInProgress => f.write_str("ProfileInProgress"),
            WriteStopped { source, samples_written, samples_lost, warnings } => f
                .debug_struct("WriteStopped")
                .field("source", source)
                .field("samples_written", samples_written)
                .field("samples_lost", samples_lost)
                .field("warnings", warnings)
                .finish(),
        }
    }
}

impl std::error::Error for RecorderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RecorderError::EngineRefused { source, .. } => Some(source),
            RecorderError::WriterFailed { source: Some(e), .. } => Some(e),
            RecorderError::NoEngine(errors) => errors.last().map(|e| e as _),
            RecorderError::WriteStopped { source, .. } => Some(&**source),
            _ => None,
        }
    }
}

impl From<RecorderError> for Error {
    fn from(e: RecorderError) -> Error {
        Error::Recorder(e)
    }
}

impl Error {
    /// A format error at `offset` of a file whose path is not known here (the
    /// opener adds it).
    pub(crate) fn format(offset: u64, kind: FormatErrorKind) -> Error {
        Error::Format { path: None, offset, kind }
    }

    /// A packed file's frame or block is corrupt at `offset`: `what` says how.
    pub(crate) fn packed_corrupt(offset: u64, what: String) -> Error {
        Error::format(offset, FormatErrorKind::PackedCorrupt(what))
    }

    /// The format error kind, for `Format` and `InvalidRecord` errors.
    pub fn format_kind(&self) -> Option<&FormatErrorKind> {
        match self {
            Error::Format { kind, .. } | Error::InvalidRecord { kind, .. } => Some(kind),
            _ => None,
        }
    }

    /// The byte offset, for `Format` and `InvalidRecord` errors.
    pub fn offset(&self) -> Option<u64> {
        match self {
            Error::Format { offset, .. } | Error::InvalidRecord { offset, .. } => Some(*offset),
            _ => None,
        }
    }

    pub(crate) fn io(path: Option<&std::path::Path>, source: io::Error) -> Error {
        Error::Io { path: path.map(|p| p.to_path_buf()), source }
    }

    /// An `io::Error` of the same kind and message, for reporting an error
    /// that is also kept elsewhere (`Error` is not `Clone`).
    pub(crate) fn to_io_error(&self) -> io::Error {
        let kind = match self {
            Error::Io { source, .. } => source.kind(),
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, self.to_string())
    }

    pub(crate) fn with_path(self, path: &std::path::Path) -> Error {
        match self {
            Error::Io { path: None, source } => Error::Io { path: Some(path.to_path_buf()), source },
            Error::Format { path: None, offset, kind } => {
                Error::Format { path: Some(path.to_path_buf()), offset, kind }
            }
            Error::Recorder(RecorderError::WriteStopped {
                source,
                samples_written,
                samples_lost,
                warnings,
            }) => Error::Recorder(RecorderError::WriteStopped {
                source: Box::new(source.with_path(path)),
                samples_written,
                samples_lost,
                warnings,
            }),
            other => other,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { path: Some(p), source } => write!(f, "{}: {source}", p.display()),
            Error::Io { path: None, source } => write!(f, "{source}"),
            Error::Format { path: Some(p), offset, kind } => {
                write!(f, "{}: at byte offset {offset}: {kind}", p.display())
            }
            Error::Format { path: None, offset, kind } => {
                write!(f, "at byte offset {offset}: {kind}")
            }
            Error::InvalidRecord { offset, kind } => {
                write!(f, "refusing to write record at byte offset {offset}: {kind}")
            }
            Error::WriterPoisoned => write!(f, "spool writer failed earlier and accepts no more records"),
            Error::Recorder(e) => write!(f, "{e}"),
        }
    }
}

/// `{:?}` prints the sentence of `Display`, so that `main` returning the
/// error reports it readably (`Error: out.spool: ...`); `{:#?}` prints the
/// variant and its fields, as a derived `Debug` would.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !f.alternate() {
            return fmt::Display::fmt(self, f);
        }
        match self {
            Error::Io { path, source } => {
                f.debug_struct("Io").field("path", path).field("source", source).finish()
            }
            Error::Format { path, offset, kind } => f
                .debug_struct("Format")
                .field("path", path)
                .field("offset", offset)
                .field("kind", kind)
                .finish(),
            Error::InvalidRecord { offset, kind } => {
                f.debug_struct("InvalidRecord").field("offset", offset).field("kind", kind).finish()
            }
            Error::WriterPoisoned => f.write_str("WriterPoisoned"),
            Error::Recorder(e) => f.debug_tuple("Recorder").field(e).finish(),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Recorder(e) => std::error::Error::source(e),
            _ => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(source: io::Error) -> Error {
        Error::Io { path: None, source }
    }
}

#[cfg(test)]
mod debug_tests {
    use super::*;

    #[test]
    fn debug_is_the_sentence_and_alternate_debug_the_fields() {
        let e = Error::Format { path: Some("a.spool".into()), offset: 7, kind: FormatErrorKind::BadMagic };
        assert_eq!(format!("{e:?}"), e.to_string());
        let alt = format!("{e:#?}");
        assert!(
            alt.starts_with("Format {") && alt.contains("offset: 7") && alt.contains("BadMagic"),
            "{alt}"
        );
        let r = Error::Recorder(RecorderError::WriteStopped {
            source: Box::new(Error::WriterPoisoned),
            samples_written: 3,
            samples_lost: 4,
            warnings: Vec::new(),
        });
        assert_eq!(format!("{r:?}"), r.to_string());
        let alt = format!("{r:#?}");
        assert!(
            alt.contains("Recorder(") && alt.contains("WriteStopped {") && alt.contains("samples_lost: 4"),
            "{alt}"
        );
        assert!(alt.contains("WriterPoisoned"), "{alt}");
    }
}
