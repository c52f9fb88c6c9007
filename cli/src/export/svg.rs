//! Interactive SVG flame graph through `inferno`, from the folded stacks.

use std::io::Write;

use spulse::Definitions;

use crate::aggregate::Aggregate;
use crate::display::xml_text;
use crate::report::folded;
use crate::symbolize::Symbolizer;

/// Write an SVG flame graph titled `title`.
pub fn write(
    defs: &Definitions,
    agg: &Aggregate,
    sym: &mut Symbolizer,
    title: &str,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    // inferno escapes XML's markup characters but passes control characters
    // through, and XML 1.0 forbids most of them even as character references.
    let lines: Vec<String> =
        folded(defs, agg, sym).into_iter().map(|(s, n)| format!("{} {n}", xml_text(&s))).collect();
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = xml_text(title).into_owned();
    opts.count_name = "samples".to_string();
    if lines.is_empty() {
        // inferno refuses empty input; an empty profile still gets a valid SVG.
        return inferno::flamegraph::from_lines(&mut opts, std::iter::once("[no samples] 1"), out);
    }
    inferno::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), out)
}
