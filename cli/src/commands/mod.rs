//! One module per subcommand; each has a clap `Args` struct and a `run`.

pub mod export;
pub mod follow;
pub mod info;
pub mod pack;
pub mod record;
pub mod top;

use std::io::Write;
use std::path::PathBuf;

use clap::Args;

use crate::report::Shape;
use crate::select::Filter;
use crate::symbolize;
use crate::CliError;

/// Rows `top` and `follow` show unless `-n` says otherwise: the hot functions
/// of most profiles, on one screen.
pub const DEFAULT_LIMIT: usize = 20;

/// The recordings a command reads (`info`, `top`, `export`).
#[derive(Debug, Clone, Args)]
pub struct InputArgs {
    /// The spool (or packed) file. Several (such as the segments of a rotating
    /// recording) are merged in time order and read as one recording.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
}

/// How many rows a function table shows (`top`, `follow`).
#[derive(Debug, Clone, Copy, Args)]
pub struct LimitArgs {
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
}

/// Sample selection, the same for every command that reads samples.
#[derive(Debug, Clone, Args)]
pub struct FilterArgs {
    /// Only samples of the thread with this kernel thread id, or of every
    /// thread with this name (as `info` lists them; a name of digits only is
    /// read as a thread id).
    #[arg(long, value_name = "TID|NAME", allow_negative_numbers = true)]
    pub thread: Option<String>,
    /// Only samples of threads of the process with this id.
    #[arg(long, value_name = "PID", allow_negative_numbers = true)]
    pub pid: Option<u32>,
    /// Only samples at or after US microseconds since the profile start.
    #[arg(long, value_name = "US", value_parser = parse_u64, allow_negative_numbers = true)]
    pub from: Option<u64>,
    /// Only samples before US microseconds since the profile start.
    #[arg(long, value_name = "US", value_parser = parse_u64, allow_negative_numbers = true)]
    pub to: Option<u64>,
}

impl FilterArgs {
    /// The filter.
    pub fn filter(&self) -> Filter {
        let (tid, thread_name) = match self.thread.as_deref() {
            None => (None, None),
            Some(t) => match t.parse::<u32>() {
                Ok(tid) => (Some(tid), None),
                // Leaked once per run: `Filter` stays `Copy`.
                Err(_) => (None, Some(&*Box::leak(t.to_owned().into_boxed_str()))),
            },
        };
        Filter { tid, thread_name, pid: self.pid, from_us: self.from, to_us: self.to, ..Filter::default() }
    }
}

/// What a profile counts: CPU samples by default; off-CPU or wall-clock time
/// for a recording made with `spulse record --off-cpu`.
#[derive(Debug, Clone, Copy, Default, Args)]
pub struct TimeArgs {
    /// Count the time threads were blocked only (microseconds, shown in
    /// milliseconds in `top`'s table), charged to where they waited
    /// (`[blocked: futex]`). Time runnable but preempted (`[waiting for
    /// CPU]`) is left out, and said so: --wall counts it. Needs a recording
    /// made with `--off-cpu`.
    #[arg(long, conflicts_with = "wall")]
    pub off_cpu: bool,
    /// Count wall-clock time: CPU samples (one sampling interval each) plus
    /// off-CPU time, blocked and waiting for a CPU (microseconds, shown in
    /// milliseconds in `top`'s table).
    #[arg(long)]
    pub wall: bool,
    /// With --off-cpu or --wall (and in the pprof export's off-cpu values):
    /// charge each thread's blocked time whose stack was not read (`[blocked]`,
    /// `[blocked, under 5 ms]`) to the stacks of that thread's waits that were
    /// read, in proportion to how many were read in each among the waits of
    /// about the same length. An estimate, as a sampling profiler's is; the
    /// totals stay exact. Without it, that time is shown as measured.
    #[arg(long)]
    pub spread_blocked: bool,
}

impl TimeArgs {
    /// The mode asked for.
    pub fn mode(&self) -> crate::select::TimeMode {
        use crate::select::TimeMode;
        match (self.off_cpu, self.wall) {
            (true, _) => TimeMode::OffCpu,
            (_, true) => TimeMode::Wall,
            _ => TimeMode::Cpu,
        }
    }

    /// `filter` counting what these options ask for.
    pub fn filter(&self, filter: Filter) -> Filter {
        Filter { time: self.mode(), spread_blocked: self.spread_blocked, ..filter }
    }
}

/// A directory that exists (a mistyped `--symbols` would otherwise be
/// searched in vain, silently).
fn existing_dir(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    match std::fs::metadata(&p) {
        Ok(m) if m.is_dir() => Ok(p),
        Ok(_) => Err("not a directory".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Symbol search options shared by the commands that name functions.
#[derive(Debug, Clone, Args)]
pub struct SymbolArgs {
    /// Also look for debug files in DIR (by module name, `NAME.debug`, the
    /// module's debug link, or a `.build-id/xx/rest.debug` tree). Repeatable.
    #[arg(long = "symbols", value_name = "DIR", value_parser = existing_dir)]
    pub symbols: Vec<PathBuf>,
    /// Do not read symbols or debug info: show every module frame as
    /// `module+0xADDR`, ADDR being its address in the module's own ELF address
    /// space (from the file's program headers: what `addr2line -e FILE ADDR`,
    /// `objdump` and `nm` use), or `module+0xOFFSET (file offset)`, the byte
    /// offset in the file, when the file is missing or is not the recorded build.
    #[arg(long)]
    pub no_symbolize: bool,
    /// Show each unsymbolized address as a function of its own
    /// (`module+0xADDR`). By default the code of a module that has no symbol
    /// for it (a stripped binary) is one function, `[unknown]` of that module,
    /// as `perf report` shows it, and consecutive frames of it are one frame.
    /// Applies to `top`, `follow` and the collapsed and svg exports (pprof,
    /// Firefox and speedscope keep each address); implied by `--no-symbolize`.
    #[arg(long)]
    pub split_unknown: bool,
}

impl SymbolArgs {
    /// The symbolizer options.
    pub fn options(&self) -> symbolize::Options {
        symbolize::Options { dirs: self.symbols.clone(), disabled: self.no_symbolize }
    }

    /// The report shape these options ask for (unsymbolized addresses split or not).
    pub fn shape(&self) -> Shape {
        Shape { split_unknown: self.split_unknown || self.no_symbolize, ..Shape::default() }
    }
}

/// Run `f` against a buffered stdout; a closed pipe (`| head`) is not an error.
pub fn with_stdout(f: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<(), CliError> {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    match f(&mut out).and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(CliError::output("stdout", e)),
    }
}

/// Parse a number of seconds between `min` and `max` (inclusive) for a clap
/// value parser; the message says what was wrong.
pub fn parse_seconds(s: &str, min: f64, max: f64) -> Result<std::time::Duration, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(v >= min && v <= max) {
        return Err(format!("{s} is out of range: seconds from {min} to {max}"));
    }
    Ok(std::time::Duration::from_secs_f64(v))
}

/// Parse a whole number from 0 to `u64::MAX` for a clap value parser, with a
/// message that says the range (for `-1` or `1e3`, say).
pub fn parse_u64(s: &str) -> Result<u64, String> {
    s.trim().parse::<u64>().map_err(|_| format!("`{s}` is not a whole number from 0 to {}", u64::MAX))
}

/// Parse a count (a whole number from 0 to `usize::MAX`) for a clap value parser.
pub fn parse_count(s: &str) -> Result<usize, String> {
    s.trim().parse::<usize>().map_err(|_| format!("`{s}` is not a whole number from 0 to {}", usize::MAX))
}

/// Format unix microseconds as `YYYY-MM-DD hh:mm:ss.ffffff UTC`.
pub fn format_unix_us(us: u64) -> String {
    let secs = us / 1_000_000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:06} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        us % 1_000_000
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats_unix_microseconds() {
        assert_eq!(super::format_unix_us(0), "1970-01-01 00:00:00.000000 UTC");
        assert_eq!(super::format_unix_us(1_700_000_000_123_456), "2023-11-14 22:13:20.123456 UTC");
        assert_eq!(super::format_unix_us(951_782_400_000_000), "2000-02-29 00:00:00.000000 UTC");
    }
}
