//! Export formats. Every format has the same entry point, an [`Exporter`]:
//! it is given the spool, the sample [`Filter`] and a title, selects and
//! aggregates the samples it needs through [`crate::aggregate`] (or, for the
//! Firefox Profiler, streams them through [`crate::select`]), and returns how
//! many samples it wrote. The Firefox profile is written as JSON
//! ([`firefox`]) or in the JsonSlabs container ([`jslb`]).

pub mod collapsed;
pub mod firefox;
pub mod jslb;
pub mod pprof;
pub mod speedscope;
pub mod svg;

use std::io::Write;

use spulse::Replay;

use crate::aggregate::{aggregate, Aggregate};
use crate::report::{symbolize_all, Shape};
use crate::select::Filter;
use crate::symbolize::Symbolizer;
use crate::CliError;

/// What an export is made from.
pub struct Job<'a> {
    /// The spool.
    pub replay: &'a Replay,
    /// The samples to export.
    pub filter: &'a Filter,
    /// The profile's title (pprof comment, SVG title, speedscope and Firefox
    /// product name).
    pub title: &'a str,
    /// The output as shown in error messages (already escaped).
    pub output: &'a str,
    /// For the collapsed and svg exports: root frames per process or thread,
    /// unsymbolized addresses split (`inlines` and `by_name` are theirs).
    pub shape: Shape,
}

/// The signature every format shares: write `job` to `out`, returning the
/// number of samples exported.
pub type Exporter = fn(&Job<'_>, &mut Symbolizer, &mut dyn Write) -> Result<u64, CliError>;

impl Job<'_> {
    /// The selected samples counted per stack (per thread and stack with
    /// `per_thread`), every frame symbolized.
    pub fn aggregate(&self, sym: &mut Symbolizer, per_thread: bool) -> Result<Aggregate, CliError> {
        let agg = aggregate(self.replay, self.filter, per_thread)?;
        symbolize_all(self.replay, &agg, sym);
        Ok(agg)
    }

    /// An error writing the output.
    pub fn write_error(&self, e: std::io::Error) -> CliError {
        CliError::output(self.output, e)
    }
}
