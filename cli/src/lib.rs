//! The spulse tool as a library: the binary (`src/main.rs`) parses arguments and
//! calls into these modules; benches and tests call them directly.
//!
//! - [`input`]: opening spools, the truncated-tail warning, progress bars.
//! - [`select`]: which samples count (thread, pid, time window) and the
//!   context (process, Python-runtime state) their stacks are symbolized in;
//!   every command selects through it.
//! - [`spread`]: `--spread-blocked`, the estimate of where stackless blocked time went.
//! - [`aggregate`]: streaming the selected samples of a `Replay` into counts per stack.
//! - [`symbolize`]: offline symbolization of frames (addr2line + object, perf maps).
//! - [`report`]: function tables (`top`) and folded stacks built from the above.
//! - [`export`]: the export formats (pprof, firefox, collapsed, svg, speedscope).
//! - [`display`]: escaping untrusted text for the terminal and XML, fitting it to a width.
//! - [`processes`]: the processes of a spool (pid, program, samples, ended).
//! - [`merge`]: merging per-process spools into one (`record`).
//! - [`preload_lib`]: where `record` gets `libspulse_preload.so` (beside the
//!   tool, or the copy inside it, written to a verified cache path).
//! - [`output`]: writing an output file through a temporary file and a rename
//!   (`export`, `pack`), never over the input.
//! - [`commands`]: one module per subcommand.

pub mod aggregate;
pub mod commands;
pub mod display;
pub mod error;
pub mod export;
pub mod input;
pub mod merge;
pub mod output;
pub mod preload_lib;
pub mod processes;
pub mod report;
pub mod select;
pub mod spread;
pub mod symbolize;

pub use error::CliError;
