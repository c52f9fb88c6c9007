//! Interactive SVG flame graph through `inferno`, from the folded stacks.
//!
//! inferno holds its whole input, so the stacks handed to it are bounded: only
//! frames at least [`MIN_FRACTION`] of the samples wide (narrower ones are not
//! drawn), widest first, within [`TEXT_BUDGET`] bytes of folded text; the
//! samples of frames left out count in their nearest drawn caller.

use std::io::Write;

use spulse::Definitions;

use super::Job;
use crate::aggregate::Aggregate;
use crate::display::xml_text;
use crate::report::{CallTree, Shape};
use crate::symbolize::Symbolizer;
use crate::CliError;

/// Frames narrower than this fraction of all samples are not drawn (inferno's
/// default minimum width, 0.1 px, of its default 1200 px image).
pub const MIN_FRACTION: f64 = 0.1 / 1200.0;

/// The most folded-stack text handed to inferno.
pub const TEXT_BUDGET: usize = 64 << 20;

/// Write an SVG flame graph of the selected samples.
pub fn export(job: &Job<'_>, sym: &mut Symbolizer, out: &mut dyn Write) -> Result<u64, CliError> {
    let agg = job.aggregate(sym, job.shape.thread_root)?;
    // With --off-cpu/--wall the widths are microseconds, not samples.
    let count_name = if job.filter.time.is_time() { "us" } else { "samples" };
    write(job.replay, &agg, sym, job.shape, job.title, count_name, out).map_err(|e| job.write_error(e))?;
    Ok(agg.total)
}

/// Write an SVG flame graph titled `title`.
fn write(
    defs: &Definitions,
    agg: &Aggregate,
    sym: &mut Symbolizer,
    shape: Shape,
    title: &str,
    count_name: &str,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let tree = CallTree::build_shaped(defs, agg, sym, Shape { inlines: true, by_name: true, ..shape });
    let lines: Vec<String> = tree
        .folded_lines_within(sym, MIN_FRACTION, TEXT_BUDGET)
        .into_iter()
        // inferno escapes XML's markup characters but passes control characters
        // through, and XML 1.0 forbids most of them even as character references.
        .map(|(s, n)| format!("{} {n}", xml_text(&s)))
        .collect();
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = xml_text(title).into_owned();
    opts.count_name = count_name.to_string();
    if lines.is_empty() {
        // inferno refuses empty input; an empty profile still gets a valid SVG.
        return inferno::flamegraph::from_lines(&mut opts, std::iter::once("[no samples] 1"), out);
    }
    inferno::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), out)
}
