//! `spulse export`: write a spool in a format other tools read.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use super::{FilterArgs, InputArgs, SymbolArgs, TimeArgs};
use crate::display::escape;
use crate::export::{self, Exporter, Job};
use crate::input::open_inputs;
use crate::output;
use crate::report::Shape;
use crate::symbolize::Symbolizer;
use crate::CliError;
use spulse::Replay;

/// Export formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Gzipped pprof `profile.proto` (go tool pprof, Pyroscope, Parca, Grafana).
    Pprof,
    /// Firefox Profiler processed format, for profiler.firefox.com: JSON, or
    /// the JsonSlabs container (JSON skeleton plus typed-array slabs, faster
    /// to load) when OUT ends in `.jslb`, gzipped when it ends in `.jslb.gz`.
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
    after_help = "Examples:\n  spulse export app.spool -o flame.svg    (the format from the name)\n  spulse export app.spool --format pprof -o app.pb.gz && go tool pprof -top app.pb.gz\n  spulse export app.spool --format firefox -o app.json\n  spulse export app.spool --format firefox -o app.jslb.gz\n  spulse export app.spool --format collapsed -o app.folded\n  spulse export app.spool -o threads.svg --per-thread\n  spulse export app.spool --format svg -o app.svg --symbols /usr/lib/debug\n  spulse export app.spool --format speedscope -o app.speedscope.json --thread 4242\n  spulse export app.spool --format pprof -o app.pb.gz --pid 4200 --from 1000000"
)]
pub struct ExportArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Output format. Default: from OUT's name: `.svg`; `.pb.gz`, `.pb` or
    /// `.pprof` (pprof); `.speedscope.json` (speedscope); `.json`,
    /// `.jslb`, `.jslb.gz` (firefox); `.folded`, `.collapsed` or `.txt` (collapsed).
    #[arg(short, long, value_enum)]
    pub format: Option<Format>,
    /// Output file (`-` for stdout). With `--format firefox`, a name ending in
    /// `.jslb` or `.jslb.gz` selects the JsonSlabs container.
    #[arg(short, long, value_name = "OUT")]
    pub output: PathBuf,
    /// Collapsed and svg: a root frame per thread, `name (tid N)`, above its
    /// stacks (under the process's root frame with `--per-process`).
    #[arg(long)]
    pub per_thread: bool,
    /// Collapsed and svg: a root frame per process, `program (pid N)`, above
    /// its stacks.
    #[arg(long)]
    pub per_process: bool,
    #[command(flatten)]
    pub filter: FilterArgs,
    #[command(flatten)]
    pub time: TimeArgs,
    #[command(flatten)]
    pub symbols: SymbolArgs,
}

/// Run `spulse export`.
pub fn run(args: &ExportArgs) -> Result<(), CliError> {
    args.filter.filter().check_window()?;
    let format = args.format()?;
    format.exporter(&args.output)?;
    if args.time.spread_blocked && !args.time.mode().is_time() && format != Format::Pprof {
        return Err(CliError::input(
            "--spread-blocked needs --off-cpu or --wall (or the pprof format, whose off-cpu values it changes)",
        ));
    }
    if (args.per_thread || args.per_process) && !matches!(format, Format::Collapsed | Format::Svg) {
        return Err(CliError::input(format!(
            "--{} adds root frames to the collapsed and svg exports only (pprof, Firefox and \
             speedscope keep threads apart by themselves)",
            if args.per_thread { "per-thread" } else { "per-process" }
        )));
    }
    if args.time.mode().is_time() && format == Format::Pprof {
        // Not an error: the profile has both already.
        eprintln!(
            "spulse: export: --{} changes nothing in pprof, which always carries a cpu and an \
             off-cpu sample type (go tool pprof -sample_index=off-cpu)",
            if args.time.wall { "wall" } else { "off-cpu" }
        );
    }
    // The output may be none of the inputs.
    let mut target_of = None;
    for f in &args.input.files {
        target_of = Some(output::target(f, &args.output)?);
    }
    let target = target_of.ok_or_else(|| CliError::input("no spool given"))?;
    let inputs = open_inputs(&args.input.files)?;
    let replay = &inputs.replay;
    // Rejected here, before any output is opened, as `top` rejects them.
    args.filter.filter().validate(replay, &inputs.name)?;
    let out_name = escape(&args.output.display().to_string()).into_owned();
    if let Some(w) =
        output::write(target, &out_name, "export", |out| write_export(args, replay, &inputs.name, out))?
    {
        // The collapsed, svg and speedscope exports weigh by time with
        // --off-cpu/--wall: their count is microseconds, not samples.
        let by_time = args.time.mode().is_time()
            && matches!(format, Format::Collapsed | Format::Svg | Format::Speedscope);
        let what = if by_time { "us of time" } else { "samples" };
        eprintln!("spulse: export: {} {what} written to {} ({} bytes)", w.value, w.name, w.bytes);
    }
    Ok(())
}

impl ExportArgs {
    /// `--format`, else the format OUT's name says.
    pub fn format(&self) -> Result<Format, CliError> {
        if let Some(f) = self.format {
            return Ok(f);
        }
        Format::from_file_name(&self.output).ok_or_else(|| {
            CliError::input(format!(
                "{}: cannot tell the export format from this name; give --format (pprof, firefox, collapsed, svg or speedscope)",
                escape(&self.output.display().to_string())
            ))
        })
    }
}

impl Format {
    /// The format a file name's extension says, if any (ASCII case ignored).
    pub fn from_file_name(path: &Path) -> Option<Format> {
        let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
        let ends = |suffixes: &[&str]| suffixes.iter().any(|s| name.len() > s.len() && name.ends_with(s));
        Some(if ends(&[".svg"]) {
            Format::Svg
        } else if ends(&[".pb.gz", ".pb", ".pprof", ".pprof.gz"]) {
            Format::Pprof
        } else if ends(&[".speedscope.json"]) {
            Format::Speedscope
        } else if ends(&[".json", ".jslb", ".jslb.gz"]) {
            Format::Firefox
        } else if ends(&[".folded", ".collapsed", ".txt"]) {
            Format::Collapsed
        } else {
            return None;
        })
    }

    /// The exporter that writes this format to `output`: the Firefox format
    /// goes in the JsonSlabs container when `output` ends in `.jslb` or
    /// `.jslb.gz`, which no other format can be written in.
    fn exporter(self, output: &Path) -> Result<Exporter, CliError> {
        let jslb = export::jslb::container(output);
        Ok(match (self, jslb) {
            (Format::Firefox, None) => export::firefox::export,
            (Format::Firefox, Some(false)) => export::jslb::export,
            (Format::Firefox, Some(true)) => export::jslb::export_gz,
            (_, Some(_)) => {
                return Err(CliError::input(format!(
                    "{}: a .jslb file holds a Firefox Profiler profile; use --format firefox \
                     (or another file name for --format {})",
                    escape(&output.display().to_string()),
                    self.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default()
                )))
            }
            (Format::Pprof, None) => export::pprof::export,
            (Format::Collapsed, None) => export::collapsed::export,
            (Format::Svg, None) => export::svg::export,
            (Format::Speedscope, None) => export::speedscope::export,
        })
    }
}

/// Write the export; returns how many samples it holds.
fn write_export(
    args: &ExportArgs,
    replay: &Replay,
    name: &Path,
    out: &mut dyn Write,
) -> Result<u64, CliError> {
    let mut sym = Symbolizer::new(args.symbols.options());
    let title = format!("spulse {}", name.display());
    let output = escape(&args.output.display().to_string()).into_owned();
    let shape =
        Shape { process_root: args.per_process, thread_root: args.per_thread, ..args.symbols.shape() };
    let filter = args.time.filter(args.filter.filter());
    let job = Job { replay, filter: &filter, title: &title, output: &output, shape };
    (args.format()?.exporter(&args.output)?)(&job, &mut sym, out)
}
