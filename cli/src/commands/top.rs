//! `spulse top`: the hottest functions by self and total samples.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde_json::json;

use super::{parse_count, with_stdout, FilterArgs, SymbolArgs, DEFAULT_LIMIT};
use crate::aggregate::aggregate;
use crate::display::{escape, fit};
use crate::input::open_inputs;
use crate::processes::processes;
use crate::report::{symbolize_all, top_with, FunctionStats};
use crate::select::Filter;
use crate::symbolize::Symbolizer;
use crate::CliError;

/// Column to sort by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SortBy {
    /// Samples in the function itself.
    #[value(name = "self")]
    SelfSamples,
    /// Samples with the function anywhere on the stack.
    Total,
}

/// Arguments of `spulse top`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  spulse top app.spool\n  spulse top app.spool -n 10 --thread 4242 --from 1000000 --to 3000000\n  spulse top app.spool --pid 4200\n  spulse top app.spool --json --symbols /usr/lib/debug\n  spulse top app.spool --inlines\n  spulse top tree.spool --per-process -n 5"
)]
pub struct TopArgs {
    /// The spool (or packed) file. Several (such as the segments of a rotating recording)
    /// are merged in time order and shown as one profile.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    pub json: bool,
    /// How many functions to show (0: all).
    #[arg(
        short = 'n',
        long = "limit",
        value_name = "N",
        default_value_t = DEFAULT_LIMIT,
        value_parser = parse_count,
        allow_negative_numbers = true
    )]
    pub n: usize,
    /// Sort column.
    #[arg(long, value_enum, default_value_t = SortBy::SelfSamples)]
    pub sort: SortBy,
    /// List inlined functions as rows of their own (by default their samples
    /// count for the function they were inlined into).
    #[arg(long)]
    pub inlines: bool,
    /// One table per process (pid, program), each with its own percentages.
    #[arg(long)]
    pub per_process: bool,
    #[command(flatten)]
    pub filter: FilterArgs,
    #[command(flatten)]
    pub symbols: SymbolArgs,
}

/// Sort function stats by the chosen column (stable on the default order).
pub fn sort_stats(stats: &mut [FunctionStats], by: SortBy) {
    if by == SortBy::Total {
        stats.sort_by(|a, b| b.total_samples.cmp(&a.total_samples).then(b.self_samples.cmp(&a.self_samples)));
    }
}

fn pct(n: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        n as f64 * 100.0 / total as f64
    }
}

/// Write a top table (shared with `follow`): at most `limit` rows (0: all),
/// each line cut to `width` columns when given. Names are escaped for display.
pub fn write_table(
    out: &mut dyn Write,
    stats: &[FunctionStats],
    sym: &Symbolizer,
    total: u64,
    limit: usize,
    width: Option<usize>,
) -> std::io::Result<()> {
    let mut line = |text: String| match width {
        Some(w) => writeln!(out, "{}", fit(&text, w)),
        None => writeln!(out, "{text}"),
    };
    line(format!("{:>10} {:>7} {:>10} {:>7}  FUNCTION (MODULE)", "SELF", "SELF%", "TOTAL", "TOTAL%"))?;
    let shown = if limit == 0 { stats.len() } else { limit.min(stats.len()) };
    for s in &stats[..shown] {
        let f = sym.function(s.func);
        line(format!(
            "{:>10} {:>6.2}% {:>10} {:>6.2}%  {} ({})",
            s.self_samples,
            pct(s.self_samples, total),
            s.total_samples,
            pct(s.total_samples, total),
            escape(&f.name),
            escape(&f.module)
        ))?;
    }
    Ok(())
}

/// Run `spulse top`.
pub fn run(args: &TopArgs) -> Result<(), CliError> {
    let filter = args.filter.filter();
    filter.check_window()?;
    let inputs = open_inputs(&args.files)?;
    let replay = &inputs.replay;
    filter.validate(replay, &inputs.name)?;
    let mut sym = Symbolizer::new(args.symbols.options());
    if !args.per_process {
        let (stats, total) = table(replay, &filter, args, &mut sym)?;
        return with_stdout(|out| {
            if args.json {
                writeln!(
                    out,
                    "{}",
                    serde_json::to_string_pretty(&json_rows(&stats, &sym, total, args.n)).expect("json")
                )
            } else {
                writeln!(out, "{total} samples")?;
                write_table(out, &stats, &sym, total, args.n, None)
            }
        });
    }
    // One table per process that matches the filter.
    let mut per_thread = vec![0u64; replay.threads().len()];
    for s in replay.samples() {
        per_thread[s?.thread.index()] += 1;
    }
    let mut sections = Vec::new();
    for p in processes(replay, &per_thread) {
        if filter.pid.is_some_and(|pid| pid != p.pid) || p.threads == 0 {
            continue;
        }
        let (stats, total) = table(replay, &Filter { pid: Some(p.pid), ..filter }, args, &mut sym)?;
        sections.push((p, stats, total));
    }
    with_stdout(|out| {
        if args.json {
            let v: Vec<_> = sections
                .iter()
                .map(|(p, stats, total)| {
                    json!({"pid": p.pid, "program": p.program, "samples": total, "ended": p.ended,
                           "functions": json_rows(stats, &sym, *total, args.n)})
                })
                .collect();
            return writeln!(out, "{}", serde_json::to_string_pretty(&v).expect("json"));
        }
        for (i, (p, stats, total)) in sections.iter().enumerate() {
            if i > 0 {
                writeln!(out)?;
            }
            writeln!(out, "process {} ({}): {total} samples", p.pid, escape(&p.program))?;
            write_table(out, stats, &sym, *total, args.n, None)?;
        }
        Ok(())
    })
}

/// Aggregate, symbolize and sort the samples `filter` selects.
fn table(
    replay: &spulse::Replay,
    filter: &Filter,
    args: &TopArgs,
    sym: &mut Symbolizer,
) -> Result<(Vec<FunctionStats>, u64), CliError> {
    let agg = aggregate(replay, filter, false)?;
    symbolize_all(replay, &agg, sym);
    let mut stats = top_with(replay, &agg, sym, args.inlines);
    sort_stats(&mut stats, args.sort);
    Ok((stats, agg.total))
}

/// The JSON rows of a top table.
fn json_rows(stats: &[FunctionStats], sym: &Symbolizer, total: u64, n: usize) -> Vec<serde_json::Value> {
    let shown = if n == 0 { stats.len() } else { n.min(stats.len()) };
    stats[..shown]
        .iter()
        .map(|s| {
            let f = sym.function(s.func);
            json!({
                "function": f.name, "module": f.module,
                "self": s.self_samples, "total": s.total_samples,
                "self_percent": pct(s.self_samples, total),
                "total_percent": pct(s.total_samples, total),
            })
        })
        .collect()
}
