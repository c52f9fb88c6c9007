//! The read side: [`Snapshot`] (whole file in memory), [`Replay`] (sequential,
//! bounded memory) and [`Tail`] (follows a growing file), all built on one
//! record loop. `Snapshot` and `Replay` also read the packed container
//! (`packed.rs`), chosen by the file's magic.

mod coded;
mod columns;
mod live;
mod memory;
mod open;
pub(crate) mod packed;
pub(crate) mod parallel;
mod replay;
pub(crate) mod scan;
mod snapshot;
mod tail;

pub use columns::Samples as SnapshotSamples;
pub use live::{recording_running, segment_number, SEGMENT_NUMBER_DIGITS};
pub use replay::{PackedStats, Replay, ReplayOptions, ReplaySamples};
pub use snapshot::Snapshot;
pub use tail::Tail;
