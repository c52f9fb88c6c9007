//! `spulse top`: the hottest functions by self and total samples.

use std::io::{IsTerminal, Write};

use clap::{Args, ValueEnum};
use serde_json::json;

use super::{with_stdout, FilterArgs, InputArgs, LimitArgs, SymbolArgs, TimeArgs};
use crate::aggregate::{aggregate, SpreadTotals};
use crate::display::{escape, fit};
use crate::input::open_inputs;
use crate::processes::processes;
use crate::report::{symbolize_all, top_with, FunctionStats, Shape};
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
    after_help = "Examples:\n  spulse top app.spool\n  spulse top app.spool -n 10 --thread 4242 --from 1000000 --to 3000000\n  spulse top app.spool --pid 4200\n  spulse top app.spool --json --symbols /usr/lib/debug\n  spulse top app.spool --inlines\n  spulse top tree.spool --per-process -n 5\n  spulse top app.spool --wide            (full C++ names on a terminal)\n  spulse top stripped.spool --split-unknown   (one row per unsymbolized address)"
)]
pub struct TopArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Print a JSON array instead of a table: one object per function
    /// (`self_us`, `total_us` in every mode); with --per-process, one per
    /// process (`pid`, `program`, `total_us`, `samples` in the CPU mode,
    /// `functions`).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub limit: LimitArgs,
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
    /// Never shorten a line: show every function name in full. By default, on
    /// a terminal, a name too long for the terminal's width is cut with `…`
    /// (the module after it stays); into a pipe or file names are in full.
    #[arg(long, conflicts_with = "width")]
    pub wide: bool,
    /// Fit each line to COLS columns (a long function name is cut with `…`,
    /// its module kept), whether or not the output is a terminal.
    #[arg(long, value_name = "COLS", value_parser = parse_width)]
    pub width: Option<usize>,
    #[command(flatten)]
    pub filter: FilterArgs,
    #[command(flatten)]
    pub time: TimeArgs,
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

/// Narrowest column a function name is cut to before the whole line is cut instead.
const MIN_NAME_COLUMNS: usize = 12;

/// Write a top table (shared with `follow`): at most `limit` rows (0: all),
/// each line fitted to `width` columns when given: a function name too long
/// is cut with `…` so that its module still shows, and only when even a short
/// name leaves no room is the line itself cut. Names are escaped for display.
pub fn write_table(
    out: &mut dyn Write,
    stats: &[FunctionStats],
    sym: &Symbolizer,
    total: u64,
    limit: usize,
    width: Option<usize>,
) -> std::io::Result<()> {
    write_table_in(out, stats, sym, total, limit, width, false)
}

/// Milliseconds of `us` microseconds, for a table in a time mode.
fn ms(us: u64) -> String {
    format!("{:.1}", us as f64 / 1000.0)
}

/// [`write_table`], with `time`: the counts are microseconds, shown as
/// milliseconds (`--off-cpu`, `--wall`).
fn write_table_in(
    out: &mut dyn Write,
    stats: &[FunctionStats],
    sym: &Symbolizer,
    total: u64,
    limit: usize,
    width: Option<usize>,
    time: bool,
) -> std::io::Result<()> {
    let mut line = |text: &str| match width {
        Some(w) => writeln!(out, "{}", fit(text, w)),
        None => writeln!(out, "{text}"),
    };
    let (h_self, h_total) = if time { ("SELF ms", "TOTAL ms") } else { ("SELF", "TOTAL") };
    line(&format!("{h_self:>10} {:>7} {h_total:>10} {:>7}  FUNCTION (MODULE)", "SELF%", "TOTAL%"))?;
    let shown = if limit == 0 { stats.len() } else { limit.min(stats.len()) };
    for s in &stats[..shown] {
        let f = sym.function(s.func);
        let (a, b) = if time {
            (ms(s.self_samples), ms(s.total_samples))
        } else {
            (s.self_samples.to_string(), s.total_samples.to_string())
        };
        let numbers = format!(
            "{a:>10} {:>6.2}% {b:>10} {:>6.2}%  ",
            pct(s.self_samples, total),
            pct(s.total_samples, total),
        );
        let module = format!(" ({})", escape(&f.module));
        let name = escape(&f.name);
        let name = match width {
            Some(w) => {
                let room = w.saturating_sub(columns(&numbers) + columns(&module));
                if room >= MIN_NAME_COLUMNS {
                    fit(&name, room).into_owned().into()
                } else {
                    name
                }
            }
            None => name,
        };
        line(&format!("{numbers}{name}{module}"))?;
    }
    Ok(())
}

/// Width of `s` in terminal columns.
fn columns(s: &str) -> usize {
    unicode_width::UnicodeWidthStr::width(s)
}

/// Parse `--width`: a number of columns from 20 up.
fn parse_width(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(w) if w >= 20 => Ok(w),
        _ => Err(format!("`{s}` is not a number of columns from 20 to {}", usize::MAX)),
    }
}

impl TopArgs {
    /// The width lines are fitted to: `--width`, else the terminal's when
    /// stdout is one (and not `--wide`), else none.
    fn fit_width(&self) -> Option<usize> {
        if self.wide {
            return None;
        }
        if self.width.is_some() {
            return self.width;
        }
        if !std::io::stdout().is_terminal() {
            return None;
        }
        terminal_size::terminal_size().map(|(w, _)| (w.0 as usize).max(20))
    }

    /// The report shape: inlined functions and unsymbolized addresses as asked.
    fn shape(&self) -> Shape {
        Shape { inlines: self.inlines, ..self.symbols.shape() }
    }
}

/// Run `spulse top`.
pub fn run(args: &TopArgs) -> Result<(), CliError> {
    let filter = args.time.filter(args.filter.filter());
    filter.check_window()?;
    if filter.spread_blocked && !filter.time.is_time() {
        return Err(CliError::input(
            "--spread-blocked needs --off-cpu or --wall (CPU samples have no [blocked])",
        ));
    }
    let inputs = open_inputs(&args.input.files)?;
    let replay = &inputs.replay;
    filter.validate(replay, &inputs.name)?;
    let mut sym = Symbolizer::new(args.symbols.options());
    let width = args.fit_width();
    let time = filter.time.is_time();
    // Microseconds a count stands for (a CPU sample: one sampling interval).
    let us_per = if time { 1 } else { replay.interval_us() };
    if time && replay.definitions().off_cpu_count() == 0 {
        eprintln!(
            "spulse: {}: no off-CPU intervals (recorded without --off-cpu, or none was written: `spulse info` says why): {}",
            crate::display::escape(&inputs.name.display().to_string()),
            if filter.time == crate::select::TimeMode::Wall { "CPU time only" } else { "nothing to show" }
        );
    }
    if time && !filter.spread_blocked {
        hint_spread(replay.definitions());
    }
    if !args.per_process {
        let (stats, total, spread, left_out_us) = table(replay, &filter, args, &mut sym)?;
        let left_out = (left_out_us > 0).then(|| {
            format!("{} ms waiting for a CPU (preempted) not counted: --wall counts it", ms(left_out_us))
        });
        return with_stdout(|out| {
            if args.json {
                // The rows are the estimate's: say so beside them.
                for line in spread_line(spread).iter().flat_map(|l| l.lines()) {
                    eprintln!("spulse: {line}");
                }
                if let Some(l) = &left_out {
                    eprintln!("spulse: {l}");
                }
                writeln!(
                    out,
                    "{}",
                    serde_json::to_string_pretty(&json_rows(&stats, &sym, total, args.limit.n, us_per))
                        .expect("json")
                )
            } else {
                match filter.time {
                    crate::select::TimeMode::Cpu => {
                        writeln!(out, "{}", crate::display::count(total, "sample"))?
                    }
                    crate::select::TimeMode::OffCpu => {
                        writeln!(out, "{} ms off-CPU, blocked", ms(total))?;
                        if let Some(l) = &left_out {
                            writeln!(out, "({l})")?;
                        }
                    }
                    crate::select::TimeMode::Wall => {
                        writeln!(out, "{} ms wall-clock (CPU and off-CPU)", ms(total))?
                    }
                }
                if let Some(line) = spread_line(spread) {
                    writeln!(out, "{line}")?;
                }
                write_table_in(out, &stats, &sym, total, args.limit.n, width, time)
            }
        });
    }
    // One table per process that matches the filter.
    let mut per_thread = vec![0u64; replay.threads().len()];
    for s in replay.samples() {
        per_thread[s?.thread.index()] += 1;
    }
    if time {
        for o in replay.definitions().off_cpu_intervals() {
            per_thread[o.thread.index()] += 1;
        }
    }
    let mut sections = Vec::new();
    // Without --spread-blocked, one pass over the samples, split by process;
    // with it (its totals are per aggregation), each process alone.
    let mut split = if filter.spread_blocked {
        None
    } else {
        let agg = aggregate(replay, &filter, false)?;
        symbolize_all(replay, &agg, &mut sym);
        Some(agg.split_by_pid())
    };
    for p in processes(replay, &per_thread) {
        if filter.pid.is_some_and(|pid| pid != p.pid) || p.threads == 0 {
            continue;
        }
        let (stats, total, spread) = match &mut split {
            Some(by_pid) => match by_pid.remove(&p.pid) {
                Some(agg) => {
                    let mut stats = top_with(replay, &agg, &mut sym, args.shape());
                    sort_stats(&mut stats, args.sort);
                    (stats, agg.total, None)
                }
                None => (Vec::new(), 0, None),
            },
            None => {
                let (stats, total, spread, _) =
                    table(replay, &Filter { pid: Some(p.pid), ..filter }, args, &mut sym)?;
                (stats, total, spread)
            }
        };
        sections.push((p, stats, total, spread));
    }
    with_stdout(|out| {
        if args.json {
            let v: Vec<_> = sections
                .iter()
                .map(|(p, stats, total, spread)| {
                    // `total_us` in every mode, as the rows' own; `samples`
                    // only where the total counts samples (CPU mode).
                    let mut v = json!({"pid": p.pid, "program": p.program,
                           "total_us": total.saturating_mul(us_per), "ended": p.ended,
                           "functions": json_rows(stats, &sym, *total, args.limit.n, us_per)});
                    if !time {
                        v["samples"] = json!(total);
                    }
                    if let Some(t) = spread {
                        v["spread_blocked"] =
                            json!({"moved_us": t.moved_us, "kept_us": t.kept_us, "waits_with_a_stack": t.captures});
                    }
                    v
                })
                .collect();
            return writeln!(out, "{}", serde_json::to_string_pretty(&v).expect("json"));
        }
        for (i, (p, stats, total, spread)) in sections.iter().enumerate() {
            if i > 0 {
                writeln!(out)?;
            }
            let what =
                if time { format!("{} ms", ms(*total)) } else { crate::display::count(*total, "sample") };
            writeln!(out, "process {} ({}): {what}", p.pid, escape(&p.program))?;
            if let Some(line) = spread_line(*spread) {
                writeln!(out, "{line}")?;
            }
            write_table_in(out, stats, &sym, *total, args.limit.n, width, time)?;
        }
        Ok(())
    })
}

/// Aggregate, symbolize and sort the samples `filter` selects; with
/// `--spread-blocked`, also the microseconds it moved and kept.
fn table(
    replay: &spulse::Replay,
    filter: &Filter,
    args: &TopArgs,
    sym: &mut Symbolizer,
) -> Result<(Vec<FunctionStats>, u64, Option<SpreadTotals>, u64), CliError> {
    let agg = aggregate(replay, filter, false)?;
    symbolize_all(replay, &agg, sym);
    let mut stats = top_with(replay, &agg, sym, args.shape());
    sort_stats(&mut stats, args.sort);
    Ok((stats, agg.total, agg.spread, agg.left_out_us))
}

/// Say on stderr when a fifth or more of the spool's blocked time has no
/// stack, that `--spread-blocked` estimates where it went.
fn hint_spread(defs: &spulse::Definitions) {
    let (mut blocked, mut stackless) = (0u64, 0u64);
    for o in defs.off_cpu_intervals().iter().filter(|o| o.state == spulse::OffCpuState::Blocked) {
        blocked = blocked.saturating_add(o.duration_us);
        if spulse::spread::is_stackless(defs, o.stack, o.state) {
            stackless = stackless.saturating_add(o.duration_us);
        }
    }
    // Without a single wait with a stack there is nothing to estimate from
    // (a process that is not dumpable, a kernel that refused the reads).
    let with_a_stack = defs.off_cpu_intervals().iter().any(|o| {
        o.state == spulse::OffCpuState::Blocked && !spulse::spread::is_stackless(defs, o.stack, o.state)
    });
    if blocked > 0 && !with_a_stack {
        eprintln!(
            "spulse: no blocked wait in this spool has a stack: `spulse info` says why\n\
             spulse: (a process that is not dumpable, a read the kernel refused, or a process\n\
             spulse: stopped by SIGSTOP or a debugger, whose recorder stopped with it)"
        );
    } else if blocked > 0 && stackless.saturating_mul(5) >= blocked {
        eprintln!(
            "spulse: {:.0}% of the spool's blocked time has no stack (waits no tick of the\n\
             spulse: recorder saw); --spread-blocked estimates where it went",
            100.0 * stackless as f64 / blocked as f64
        );
    }
}

/// The header line saying what `--spread-blocked` estimated.
fn spread_line(spread: Option<SpreadTotals>) -> Option<String> {
    // Nothing without a stack in the view: nothing to say.
    let t = spread.filter(|t| t.moved_us > 0 || t.kept_us > 0)?;
    // Lines that fit 80 columns: what moved and on what; what stayed.
    let kept = |t: SpreadTotals| {
        format!("{} ms blocked, no stack: kept (no wait of its threads had one)", ms(t.kept_us))
    };
    if t.moved_us == 0 {
        return Some(kept(t));
    }
    let mut line = format!(
        "{} ms blocked, no stack: estimated from {} wait(s) with one (--spread-blocked)",
        ms(t.moved_us),
        t.captures
    );
    if t.kept_us > 0 {
        line.push('\n');
        line.push_str(&kept(t));
    }
    Some(line)
}

/// The JSON rows of a top table: `self` and `total` as counted (samples, or
/// microseconds in a time mode), and `self_us`/`total_us` in microseconds in
/// every mode (a CPU sample counts one sampling interval, `us_per`).
fn json_rows(
    stats: &[FunctionStats],
    sym: &Symbolizer,
    total: u64,
    n: usize,
    us_per: u64,
) -> Vec<serde_json::Value> {
    let shown = if n == 0 { stats.len() } else { n.min(stats.len()) };
    stats[..shown]
        .iter()
        .map(|s| {
            let f = sym.function(s.func);
            json!({
                "function": f.name, "module": f.module,
                "self": s.self_samples, "total": s.total_samples,
                "self_us": s.self_samples.saturating_mul(us_per),
                "total_us": s.total_samples.saturating_mul(us_per),
                "self_percent": pct(s.self_samples, total),
                "total_percent": pct(s.total_samples, total),
            })
        })
        .collect()
}
