#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod error;
pub mod format;
mod preloaded;
pub mod read;
mod recorder;
pub mod write;

pub use error::{Error, FormatErrorKind};
pub use format::defs::{Definitions, StackFrames};
pub use format::{
    Deactivation, Engine, Frame, FrameId, Header, Module, ModuleId, PythonRuntimeEvent, Sample, StackId,
    StackNode, Thread, ThreadId,
};
pub use read::{Replay, ReplayOptions, ReplaySamples, Snapshot, SnapshotSamples, Tail};
#[doc(hidden)]
pub use recorder::bench_support as __bench;
pub use recorder::{
    python_runtime_enter, python_runtime_leave, start, EngineChoice, Guard, LostSamples, Recorder,
    RecorderBuilder, Stats, DEFAULT_FREQUENCY_HZ, MAX_RING_BYTES,
};
pub use write::{NewModule, SpoolWriter};
