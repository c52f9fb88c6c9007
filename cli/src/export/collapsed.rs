//! Folded stacks (`a;b;c 42`), the input format of flame graph tools.
//!
//! Written line by line from the [`crate::report::CallTree`]: memory is bounded
//! by the distinct stacks; the output is the sum of the depths of the distinct
//! sampled stacks (each line spells its stack in full). Inlined functions are
//! frames of their own, under the function they were inlined into. Root frames
//! per process or thread and the grouping of unsymbolized code are the
//! job's [`crate::report::Shape`].

use std::io::Write;

use super::Job;
use crate::report::write_folded;
use crate::symbolize::Symbolizer;
use crate::CliError;

/// Write folded stacks, one `root;...;leaf count` line per distinct stack.
pub fn export(job: &Job<'_>, sym: &mut Symbolizer, out: &mut dyn Write) -> Result<u64, CliError> {
    let agg = job.aggregate(sym, job.shape.thread_root)?;
    write_folded(job.replay, &agg, sym, job.shape, out).map_err(|e| job.write_error(e))?;
    Ok(agg.total)
}
