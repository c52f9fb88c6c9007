//! Folded stacks (`a;b;c 42`), the input format of flame graph tools.
//!
//! Written line by line from the [`crate::report::CallTree`]: memory is bounded
//! by the distinct stacks; the output is the sum of the depths of the distinct
//! sampled stacks (each line spells its stack in full). Inlined functions are
//! frames of their own, under the function they were inlined into.

use std::io::Write;

use spulse::Definitions;

use crate::aggregate::Aggregate;
use crate::report::write_folded;
use crate::symbolize::Symbolizer;

/// Write folded stacks, one `root;...;leaf count` line per distinct stack.
pub fn write(
    defs: &Definitions,
    agg: &Aggregate,
    sym: &mut Symbolizer,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    write_folded(defs, agg, sym, out)
}
