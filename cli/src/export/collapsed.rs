//! Folded stacks (`a;b;c 42`), the input format of flame graph tools.

use std::io::Write;

use spulse::Definitions;

use crate::aggregate::Aggregate;
use crate::report::folded;
use crate::symbolize::Symbolizer;

/// Write folded stacks, one `root;...;leaf count` line per distinct stack.
pub fn write(
    defs: &Definitions,
    agg: &Aggregate,
    sym: &mut Symbolizer,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    for (stack, count) in folded(defs, agg, sym) {
        writeln!(out, "{stack} {count}")?;
    }
    Ok(())
}
