//! `spulse pack`: write a spool as a packed file (`FORMAT.md`, section 10),
//! which every command reads like the spool and which loads without decoding
//! a record stream.

use std::path::PathBuf;

use clap::Args;

use crate::display::escape;
use crate::input::open_replay;
use crate::output;
use crate::CliError;

/// Arguments of `spulse pack`.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  spulse pack app.spool -o app.spk && spulse info app.spk")]
pub struct PackArgs {
    /// The spool file.
    pub file: PathBuf,
    /// Output file (`-` for stdout).
    #[arg(short, long, value_name = "OUT")]
    pub output: PathBuf,
}

/// Run `spulse pack`.
pub fn run(args: &PackArgs) -> Result<(), CliError> {
    let target = output::target(&args.file, &args.output)?;
    let replay = open_replay(&args.file)?;
    if replay.is_packed() {
        return Err(CliError::input(format!(
            "{}: is already a packed file",
            escape(&args.file.display().to_string())
        )));
    }
    let out_name = escape(&args.output.display().to_string()).into_owned();
    let written = output::write(target, &out_name, "pack", |out| {
        spulse::pack(&replay, out).map_err(|e| match e {
            // Errors without a file are the output's; the input's name it.
            spulse::Error::Io { path: None, source } => CliError::output(&out_name, source),
            e => CliError::from(e),
        })
    })?;
    if let Some(w) = written {
        let s = w.value;
        eprintln!(
            "spulse: pack: {} in {} written to {} ({} bytes, {:.1}% of the spool's {} bytes)",
            crate::display::count(s.samples, "sample"),
            crate::display::count(s.blocks, "block"),
            w.name,
            w.bytes,
            100.0 * w.bytes as f64 / s.spool_bytes.max(1) as f64,
            s.spool_bytes
        );
    }
    Ok(())
}
