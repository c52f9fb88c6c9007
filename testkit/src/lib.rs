//! Helpers shared by spulse's integration tests, benchmarks and examples; not
//! published, and not part of spulse's API. It enables spulse's unstable
//! `testing` feature, so nothing here is compiled into a user's build.
//!
//! - [`emulator`]: re-running the test binary as a child, through cargo's
//!   runner when it was cross-built and runs under an emulator (qemu-user).
//! - [`fuzz`]: the per-reader consistency checks that the corpus regression
//!   test (`tests/format_fuzz_corpus.rs`) runs on every committed fuzz input.
//! - [`spool`]: a generator of random valid spools with a model of what every
//!   reader must return for them (the format tests).
//! - [`profile`]: a synthetic spool shaped like a real profile (the spool
//!   benchmark, the size test and `examples/spool_rss.rs`).
//! - [`symbols`]: a minimal offline symbolizer, a test plugin library and CPU
//!   time helpers (the examples, the recorder tests and the recorder bench).

pub mod alloc;
pub mod emulator;
pub mod fuzz;
pub mod packed;
pub mod profile;
pub mod spool;
pub mod symbols;
