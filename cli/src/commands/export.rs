//! `spulse export`: write a spool in a format other tools read.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::top::FilterArgs;
use super::SymbolArgs;
use crate::aggregate::aggregate;
use crate::export;
use crate::input::open_replay;
use crate::report::symbolize_all;
use crate::symbolize::Symbolizer;
use crate::CliError;

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
    after_help = "Examples:\n  spulse export app.spool --format pprof -o app.pb.gz && go tool pprof -top app.pb.gz\n  spulse export app.spool --format firefox -o app.json\n  spulse export app.spool --format collapsed -o app.folded\n  spulse export app.spool --format svg -o app.svg --symbols /usr/lib/debug\n  spulse export app.spool --format speedscope -o app.speedscope.json --thread 4242"
)]
pub struct ExportArgs {
    /// The spool file.
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
    let replay = open_replay(&args.file)?;
    let mut sym = Symbolizer::new(args.symbols.options());
    let out_name = args.output.display().to_string();
    let mut out: Box<dyn Write> = if args.output.as_os_str() == "-" {
        Box::new(BufWriter::new(std::io::stdout().lock()))
    } else {
        let f = File::create(&args.output).map_err(|e| CliError::output(&out_name, e))?;
        Box::new(BufWriter::new(f))
    };
    let title = format!("spulse {}", args.file.display());
    let filter = args.filter.filter();
    let res = if args.format == Format::Firefox {
        export::firefox::write(&replay, &filter, &mut sym, &title, &mut *out)?;
        Ok(())
    } else {
        let per_thread = matches!(args.format, Format::Speedscope | Format::Pprof);
        let agg = aggregate(&replay, &filter, per_thread)?;
        symbolize_all(&replay, &agg, &mut sym);
        match args.format {
            Format::Pprof => export::pprof::write(&replay, &agg, &mut sym, &title, &mut *out),
            Format::Svg => export::svg::write(&replay, &agg, &mut sym, &title, &mut *out),
            Format::Speedscope => export::speedscope::write(&replay, &agg, &mut sym, &title, &mut *out),
            Format::Collapsed | Format::Firefox => {
                export::collapsed::write(&replay, &agg, &mut sym, &mut *out)
            }
        }
    };
    res.and_then(|()| out.flush()).map_err(|e| CliError::output(&out_name, e))
}
