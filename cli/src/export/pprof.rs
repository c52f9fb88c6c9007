//! pprof export: the library's encoder (`spulse::pprof`, shared with the
//! `http` endpoint) over the selected samples, one pprof sample per distinct
//! (thread, stack). The profile starts at the spool's start and lasts until
//! its last selected sample.

use std::io::Write;

use spulse::pprof::{Counts, Window};
use spulse::StackId;

pub use spulse::pprof::{Function, Label, Line, Location, Mapping, Profile, Sample, ValueType};

use super::Job;
use crate::aggregate::Aggregate;
use crate::select::Context;
use crate::symbolize::Symbolizer;
use crate::CliError;

impl Counts for Aggregate {
    fn contexts(&self) -> &[Context] {
        &self.contexts
    }
    fn iter(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        Aggregate::iter(self)
    }
    fn off_cpu(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        Aggregate::iter_off_cpu(self)
    }
}

/// Write the gzipped profile of the selected samples, one pprof sample per
/// distinct (thread, stack).
///
/// A recording made in off-CPU mode gets a third sample type, `off-cpu` in
/// nanoseconds, beside `samples` and `cpu` (whatever `--off-cpu`/`--wall`
/// say: the viewer picks the type).
pub fn export(job: &Job<'_>, sym: &mut Symbolizer, out: &mut dyn Write) -> Result<u64, CliError> {
    let filter = crate::select::Filter { time: crate::select::TimeMode::Cpu, ..*job.filter };
    let agg = Job { filter: &filter, ..*job }.aggregate(sym, true)?;
    let start_us = job.replay.start_time_us();
    let window =
        Window { start_us, duration_us: agg.time_range.map_or(0, |(_, last)| last.saturating_sub(start_us)) };
    spulse::pprof::write(job.replay, &agg, window, sym, job.title, out).map_err(|e| job.write_error(e))?;
    Ok(agg.total)
}
