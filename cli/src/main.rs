//! The `spulse` binary: argument parsing and error reporting around the
//! `spulse_cli` library.

use clap::{Parser, Subcommand};
use spulse_cli::commands::{export, follow, info, pack, record, top};

/// Inspect, symbolize and export spulse spools.
#[derive(Debug, Parser)]
#[command(name = "spulse", version, after_help = "Example:\n  spulse top app.spool -n 15")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Header, duration and counts of a spool.
    Info(info::InfoArgs),
    /// Hottest functions by self and total samples.
    Top(top::TopArgs),
    /// Export to pprof, the Firefox Profiler, folded stacks, an SVG flame graph or speedscope.
    Export(export::ExportArgs),
    /// Write a spool as a packed file (LZ4-compressed sample columns), which loads faster.
    Pack(pack::PackArgs),
    /// Live top table of a spool that a running process is still writing.
    Follow(follow::FollowArgs),
    /// Run a command and record it and every process it starts into one spool.
    Record(record::RecordArgs),
}

/// `libspulse_preload.so`, carried so that an installed `spulse record` needs
/// nothing beside it (`cli/build.rs` says how; empty after `cargo check`).
static PRELOAD_LIB: &[u8] = include_bytes!(env!("SPULSE_PRELOAD_SO"));

fn main() {
    // Errors are reported as one line; a panic (a bug) also stays on one line.
    std::panic::set_hook(Box::new(|info| {
        follow::restore_terminal();
        eprintln!("spulse: internal error: {}", spulse_cli::display::escape(&info.to_string()));
    }));
    let cli = Cli::parse();
    let res = match &cli.command {
        Command::Info(a) => info::run(a),
        Command::Top(a) => top::run(a),
        Command::Export(a) => export::run(a),
        Command::Follow(a) => follow::run(a),
        Command::Pack(a) => pack::run(a),
        Command::Record(a) => match record::run(a, PRELOAD_LIB) {
            // The command's own exit status, or its death by a signal.
            Ok(exit) => exit.end(),
            Err(e) => Err(e),
        },
    };
    if let Err(e) = res {
        // Messages may quote spool content or paths: never let them reach the terminal raw.
        eprintln!("spulse: error: {}", spulse_cli::display::escape(&e.message));
        std::process::exit(e.code);
    }
}
