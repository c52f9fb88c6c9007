//! A [criterion](https://docs.rs/criterion/0.5) profiler (cargo feature
//! `criterion`): `cargo bench -- --profile-time 5` records each benchmark and
//! writes its flame graph.
//!
//! ```no_run
//! use criterion::{criterion_group, criterion_main, Criterion};
//!
//! fn fib(n: u64) -> u64 {
//!     if n < 2 { n } else { fib(n - 1) + fib(n - 2) }
//! }
//!
//! fn bench(c: &mut Criterion) {
//!     c.bench_function("fib 20", |b| b.iter(|| fib(std::hint::black_box(20))));
//! }
//!
//! criterion_group! {
//!     name = benches;
//!     config = Criterion::default().with_profiler(spulse::criterion::Profiler::new());
//!     targets = bench
//! }
//! criterion_main!(benches);
//! ```
//!
//! In profile mode (`--profile-time SECONDS`) criterion runs each benchmark
//! for that long and calls the profiler around it; in its ordinary mode the
//! profiler is never called, so measurements are not disturbed. For each
//! benchmark this writes, in the directory criterion gives
//! (`target/criterion/<benchmark>/profile/`):
//!
//! - `profile.spool`: the recording, for `spulse top`, `spulse export` and the
//!   other views (replaced on each run);
//! - `flamegraph.svg`: its flame graph ([`crate::flamegraph::write_flamegraph`]).
//!
//! Criterion's profiler interface cannot return an error: one that stops a
//! benchmark's recording (a recorder already running in the process, as under
//! `spulse record`; a directory that cannot be written) is printed to stderr
//! naming the benchmark, and the benchmark itself still runs.

use std::path::Path;

use crate::recorder::{Guard, Recorder};

/// The criterion profiler: see the [module documentation](self).
pub struct Profiler {
    frequency_hz: u32,
    running: Option<Guard>,
}

impl Profiler {
    /// A profiler that samples at the recorder's default frequency
    /// ([`RecorderBuilder::DEFAULT_FREQUENCY_HZ`](crate::RecorderBuilder::DEFAULT_FREQUENCY_HZ)).
    pub fn new() -> Self {
        Self::with_frequency(crate::RecorderBuilder::DEFAULT_FREQUENCY_HZ)
    }

    /// A profiler that samples each thread at `hz` samples per second of its
    /// CPU time (checked by [`Recorder`] when a benchmark starts).
    pub fn with_frequency(hz: u32) -> Self {
        Profiler { frequency_hz: hz, running: None }
    }
}

impl Default for Profiler {
    fn default() -> Self {
        Self::new()
    }
}

impl criterion::profiler::Profiler for Profiler {
    fn start_profiling(&mut self, benchmark_id: &str, benchmark_dir: &Path) {
        // A recording left running (criterion always pairs the calls; this is
        // for a caller that does not) is finished first.
        if let Some(old) = self.running.take() {
            drop(old.finish());
        }
        let started = std::fs::create_dir_all(benchmark_dir)
            .map_err(|e| crate::Error::io(Some(benchmark_dir), e))
            .and_then(|()| {
                Recorder::builder()
                    .frequency_hz(self.frequency_hz)
                    .overwrite(true)
                    .start(benchmark_dir.join("profile.spool"))
            });
        match started {
            Ok(guard) => self.running = Some(guard),
            Err(e) => eprintln!("spulse: not profiling benchmark {benchmark_id}: {e}"),
        }
    }

    fn stop_profiling(&mut self, benchmark_id: &str, benchmark_dir: &Path) {
        let Some(guard) = self.running.take() else { return };
        let svg = benchmark_dir.join("flamegraph.svg");
        if let Err(e) = guard.finish_with_flamegraph(&svg) {
            eprintln!("spulse: profile of benchmark {benchmark_id}: {e}");
        }
    }
}
