//! `spulse export`: write a spool in a format other tools read.

use std::fs::OpenOptions;
use std::io::{BufWriter, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use clap::{Args, ValueEnum};

use super::{FilterArgs, SymbolArgs};
use crate::display::escape;
use crate::export::{self, Exporter, Job};
use crate::input::open_inputs;
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
    /// The spool file. Several (such as the segments of a rotating recording)
    /// are merged in time order and exported as one profile.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
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

/// A writer that counts the bytes it passes on and remembers whether the
/// reader went away (a closed pipe), so that the exporters' own error values
/// need not carry the error kind.
struct Counted<W: Write> {
    inner: W,
    bytes: u64,
    broken_pipe: bool,
}

impl<W: Write> Counted<W> {
    fn new(inner: W) -> Counted<W> {
        Counted { inner, bytes: 0, broken_pipe: false }
    }

    fn note<T>(&mut self, r: std::io::Result<T>) -> std::io::Result<T> {
        if let Err(e) = &r {
            self.broken_pipe |= e.kind() == std::io::ErrorKind::BrokenPipe;
        }
        r
    }
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let r = self.inner.write(buf);
        let n = self.note(r)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let r = self.inner.flush();
        self.note(r)
    }
}

/// Exit code of an export ended by Ctrl-C (128 + SIGINT, as shells report it).
const EXIT_INTERRUPTED: i32 = 130;

/// Where the export goes.
enum Target {
    Stdout,
    /// A regular file (existing or not), written through a temporary file in
    /// its directory that is renamed over it once complete.
    Replace(PathBuf),
    /// An existing file that is not a regular file (`/dev/null`, a FIFO):
    /// written in place, since renaming over it would replace the device node.
    InPlace(PathBuf),
}

/// Decide where the export goes, refusing an output that is the input itself
/// (by device and inode, so symlinks, `./` spellings and hard links are caught)
/// before anything is opened for writing.
fn target(input: &Path, output: &Path) -> Result<Target, CliError> {
    if output.as_os_str() == "-" {
        return Ok(Target::Stdout);
    }
    let shown = || escape(&output.display().to_string()).into_owned();
    let out_meta = match std::fs::metadata(output) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(CliError::output(&shown(), e)),
    };
    let Some(out_meta) = out_meta else {
        return Ok(Target::Replace(output.to_path_buf()));
    };
    if let Ok(in_meta) = std::fs::metadata(input) {
        if (in_meta.dev(), in_meta.ino()) == (out_meta.dev(), out_meta.ino()) {
            return Err(CliError::input(format!(
                "{}: is the input spool {}; refusing to overwrite the recording (choose another output)",
                shown(),
                escape(&input.display().to_string())
            )));
        }
    }
    if out_meta.is_dir() {
        return Err(CliError::other(format!("{}: is a directory", shown())));
    }
    if !out_meta.is_file() {
        return Ok(Target::InPlace(output.to_path_buf()));
    }
    // A symlink to a regular file: replace the file it points to, not the link.
    let is_link = std::fs::symlink_metadata(output).is_ok_and(|m| m.file_type().is_symlink());
    if is_link {
        let real = std::fs::canonicalize(output).map_err(|e| CliError::output(&shown(), e))?;
        return Ok(Target::Replace(real));
    }
    Ok(Target::Replace(output.to_path_buf()))
}

/// Run `spulse export`.
pub fn run(args: &ExportArgs) -> Result<(), CliError> {
    args.filter.filter().check_window()?;
    let mut target_of = None;
    for f in &args.files {
        target_of = Some(target(f, &args.output)?);
    }
    let target = target_of.ok_or_else(|| CliError::input("no spool given"))?;
    let inputs = open_inputs(&args.files)?;
    let replay = &inputs.replay;
    // Rejected here, before any output is opened, as `top` rejects them.
    args.filter.filter().validate(replay, &inputs.name)?;
    let out_name = escape(&args.output.display().to_string()).into_owned();
    match target {
        Target::Stdout => {
            let mut out = Counted::new(BufWriter::new(std::io::stdout().lock()));
            match write_export(args, replay, &inputs.name, &mut out)
                .and_then(|n| flush(&mut out, "stdout").map(|()| n))
            {
                Ok(n) => {
                    report(n, "stdout", out.bytes);
                    Ok(())
                }
                // The reader stopped reading (`| head`): not an error.
                Err(_) if out.broken_pipe => Ok(()),
                Err(e) => Err(e),
            }
        }
        Target::InPlace(path) => {
            let f = OpenOptions::new().write(true).truncate(true).open(&path);
            let f = f.map_err(|e| CliError::output(&out_name, e))?;
            let mut out = Counted::new(BufWriter::new(f));
            let n = write_export(args, replay, &inputs.name, &mut out)?;
            flush(&mut out, &out_name)?;
            report(n, &out_name, out.bytes);
            Ok(())
        }
        Target::Replace(path) => {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            let prefix = format!(".{}.", path.file_name().unwrap_or_default().to_string_lossy());
            // Ctrl-C (SIGINT, SIGTERM, SIGHUP) would end the process without
            // running drops: its handler, which ctrlc runs on a thread of its
            // own, removes the temporary file named here before exiting. It is
            // installed before the file exists, and the rename into place holds
            // the lock, so the file is either removed or complete.
            let pending: Arc<Mutex<Option<PathBuf>>> = Arc::new(Mutex::new(None));
            {
                let pending = pending.clone();
                let shown = out_name.clone();
                let _ = ctrlc::set_handler(move || {
                    let tmp = pending.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(tmp) = tmp {
                        let _ = std::fs::remove_file(tmp);
                        eprintln!("spulse: export: interrupted; {shown} left as it was");
                    }
                    std::process::exit(EXIT_INTERRUPTED);
                });
            }
            // Mode 0666 less the umask, as a file created by `File::create` gets.
            let tmp = {
                let mut guard = pending.lock().unwrap_or_else(|e| e.into_inner());
                let tmp = tempfile::Builder::new()
                    .prefix(&prefix)
                    .suffix(".tmp")
                    .permissions(std::fs::Permissions::from_mode(0o666))
                    .tempfile_in(dir)
                    .map_err(|e| CliError::output(&out_name, e))?;
                *guard = Some(tmp.path().to_path_buf());
                tmp
            };
            // On any error below `tmp` is dropped, which deletes it: an existing
            // output stays as it was.
            let mut out = Counted::new(BufWriter::new(tmp));
            let n = write_export(args, replay, &inputs.name, &mut out)?;
            flush(&mut out, &out_name)?;
            let bytes = out.bytes;
            let tmp = out.inner.into_inner().map_err(|e| CliError::output(&out_name, e.into_error()))?;
            tmp.as_file().sync_all().map_err(|e| CliError::output(&out_name, e))?;
            {
                let mut guard = pending.lock().unwrap_or_else(|e| e.into_inner());
                if guard.take().is_none() {
                    // The handler already removed it and is exiting.
                    return Err(CliError::other("interrupted"));
                }
                tmp.persist(&path).map_err(|e| CliError::output(&out_name, e.error))?;
            }
            report(n, &out_name, bytes);
            Ok(())
        }
    }
}

fn flush(out: &mut impl Write, name: &str) -> Result<(), CliError> {
    out.flush().map_err(|e| CliError::output(name, e))
}

/// The one line a successful export prints on stderr.
fn report(samples: u64, output: &str, bytes: u64) {
    eprintln!("spulse: export: {samples} samples written to {output} ({bytes} bytes)");
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
fn write_export(
    args: &ExportArgs,
    replay: &Replay,
    name: &Path,
    out: &mut dyn Write,
) -> Result<u64, CliError> {
    let mut sym = Symbolizer::new(args.symbols.options());
    let title = format!("spulse {}", name.display());
    let output = escape(&args.output.display().to_string()).into_owned();
    let job = Job { replay, filter: &args.filter.filter(), title: &title, output: &output };
    (args.format.exporter())(&job, &mut sym, out)
}
