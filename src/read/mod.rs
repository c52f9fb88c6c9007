//! The read side: [`Snapshot`] (whole file in memory), [`Replay`] (sequential,
//! bounded memory) and [`Tail`] (follows a growing file), all built on one
//! record loop.

mod columns;
mod fuzz;
mod open;
pub(crate) mod parallel;
mod replay;
pub(crate) mod scan;
mod snapshot;
mod tail;

pub use columns::Samples as SnapshotSamples;
#[doc(hidden)]
pub use fuzz::{fuzz_check_replay, fuzz_check_snapshot, fuzz_check_tail};
#[doc(hidden)]
pub use parallel::speculations_applied;
pub use replay::{Replay, ReplayOptions, ReplaySamples};
pub use snapshot::Snapshot;
pub use tail::Tail;
