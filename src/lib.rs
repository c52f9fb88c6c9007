#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

#[cfg(feature = "criterion")]
pub mod criterion;
mod error;
#[cfg(feature = "flamegraph")]
pub mod flamegraph;
mod format;
#[cfg(feature = "heap")]
pub mod heap;
#[cfg(feature = "http")]
pub mod http;
mod pack;
#[cfg(feature = "pprof")]
pub mod pprof;
mod read;
mod recorder;
pub mod spread;
#[cfg(feature = "pprof")]
pub mod symbolize;
mod write;

pub use error::{Error, FormatErrorKind, RecorderError};
pub use format::defs::{Definitions, StackFrames};
pub use format::{
    is_packed, Deactivation, Engine, Frame, FrameId, Header, HeapEvent, LabelId, Module, ModuleId,
    OffCpuInterval, OffCpuState, PythonRuntimeEvent, Sample, StackId, StackNode, Thread, ThreadId,
    PACKED_MAGIC, PACKED_MAGIC_V2,
};
pub use format::{limits, MAGIC as SPOOL_MAGIC};
pub use pack::{pack, PackSummary};
pub use read::{
    recording_running, segment_number, PackedStats, Replay, ReplayOptions, ReplaySamples, Snapshot,
    SnapshotSamples, Tail, SEGMENT_NUMBER_DIGITS,
};
pub use recorder::{
    python_runtime_enter, python_runtime_leave, start, warnings_path, write_warnings, EngineChoice, Guard,
    HeapEventStats, KernelTime, LostSamples, OffCpuStats, Recorder, RecorderBuilder, Stats,
    SWITCH_HEAVY_PER_CPU_SECOND,
};
pub use write::{NewModule, SpoolWriter};

#[doc(hidden)]
pub use recorder::interpose as __interpose;
/// For `libspulse_preload.so` only, not part of the API: the spool this copy
/// of spulse records to now (see `src/recorder/sys/preloaded.rs`).
#[doc(hidden)]
pub use recorder::live_spool_of_this_copy as __preload_live_spool;

/// For `libspulse_preload.so` only, not part of the API: ask this copy's
/// running recorder to write the waits still open up to a time (see
/// `src/recorder/sys/preloaded.rs`).
#[doc(hidden)]
pub use recorder::request_off_cpu_split as __preload_split_off_cpu;

/// For `libspulse_preload.so` only, not part of the API: write out the
/// running recording before an `_exit` or `exec` (see
/// `src/recorder/exit_request.rs`).
#[doc(hidden)]
pub use recorder::flush_before_exit as __preload_flush_before_exit;

/// For `libspulse_preload.so` only, not part of the API: the running
/// writer thread's id (0: none).
#[doc(hidden)]
pub use recorder::writer_tid as __preload_writer_tid;

/// Hooks for spulse's own tests and benchmarks, compiled only with the
/// `testing` cargo feature (off by default). **Unstable**: not part of the
/// API, may change or go in any release; do not enable it in a build you ship.
#[cfg(feature = "testing")]
pub mod testing {
    pub use crate::read::parallel::speculations_applied;
    pub use crate::recorder::bench_support as handler_timing;
    pub use crate::recorder::table_report as unwind_tables;
}
