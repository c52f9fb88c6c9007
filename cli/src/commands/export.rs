//! `spulse export`: write a spool in a format other tools read.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::{FilterArgs, SymbolArgs};
use crate::display::escape;
use crate::export::{self, Exporter, Job};
use crate::input::open_replay;
use crate::output;
use crate::symbolize::Symbolizer;
use crate::CliError;
use spulse::Replay;

/// Export formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Gzipped pprof `profile.proto` (go tool pprof, Pyroscope, Parca, Grafana).
    Pprof,
    /// Firefox Profiler processed format (JSON), for profiler.firefox.com.
    Firefox,
    /// Folded stacks, `root;...;leaf COUNT` per line.
    Collapsed,
    /// Interactive SVG flame graph.
    Svg,
    /// speedscope JSON file format, for speedscope.app.
    Speedscope,
}

/// Arguments of `spulse export`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  spulse export app.spool --format pprof -o app.pb.gz && go tool pprof -top app.pb.gz\n  spulse export app.spool --format firefox -o app.json\n  spulse export app.spool --format collapsed -o app.folded\n  spulse export app.spool --format svg -o app.svg --symbols /usr/lib/debug\n  spulse export app.spool --format speedscope -o app.speedscope.json --thread 4242\n  spulse export app.spool --format pprof -o app.pb.gz --pid 4200 --from 1000000"
)]
pub struct ExportArgs {
    /// The spool (or packed) file.
    pub file: PathBuf,
    /// Output format.
    #[arg(short, long, value_enum)]
    pub format: Format,
    /// Output file (`-` for stdout).
    #[arg(short, long, value_name = "OUT")]
    pub output: PathBuf,
    #[command(flatten)]
    pub filter: FilterArgs,
    #[command(flatten)]
    pub symbols: SymbolArgs,
}

/// Run `spulse export`.
pub fn run(args: &ExportArgs) -> Result<(), CliError> {
    args.filter.filter().check_window()?;
    let target = output::target(&args.file, &args.output)?;
    let replay = open_replay(&args.file)?;
    // Rejected here, before any output is opened, as `top` rejects them.
    args.filter.filter().validate(&replay, &args.file)?;
    let out_name = escape(&args.output.display().to_string()).into_owned();
    if let Some(w) = output::write(target, &out_name, "export", |out| write_export(args, &replay, out))? {
        eprintln!("spulse: export: {} samples written to {} ({} bytes)", w.value, w.name, w.bytes);
    }
    Ok(())
}

impl Format {
    /// The exporter that writes this format.
    fn exporter(self) -> Exporter {
        match self {
            Format::Pprof => export::pprof::export,
            Format::Firefox => export::firefox::export,
            Format::Collapsed => export::collapsed::export,
            Format::Svg => export::svg::export,
            Format::Speedscope => export::speedscope::export,
        }
    }
}

/// Write the export; returns how many samples it holds.
fn write_export(args: &ExportArgs, replay: &Replay, out: &mut dyn Write) -> Result<u64, CliError> {
    let mut sym = Symbolizer::new(args.symbols.options());
    let title = format!("spulse {}", args.file.display());
    let output = escape(&args.output.display().to_string()).into_owned();
    let job = Job { replay, filter: &args.filter.filter(), title: &title, output: &output };
    (args.format.exporter())(&job, &mut sym, out)
}
