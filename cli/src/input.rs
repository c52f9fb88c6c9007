//! Opening spools for the commands (with the truncated-tail warning), and the
//! progress bars that appear only when stderr is a terminal.

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use spulse::Replay;

use crate::display::escape;
use crate::CliError;

/// Samples read between progress bar updates: often enough for a smooth bar,
/// rarely enough to cost nothing per sample (a power of two, so the check is
/// a mask).
pub const PROGRESS_STEP: u64 = 1 << 16;

/// How often the spinner shown while a spool is validated moves.
const SPINNER_TICK: std::time::Duration = std::time::Duration::from_millis(100);

/// Open and validate a spool (or a packed file) for sequential reading. A
/// spool whose final record is incomplete is read up to it, with a one-line
/// warning on stderr.
pub fn open_replay(path: &Path) -> Result<Replay, CliError> {
    // Opening validates the whole file; show that something is happening.
    let spinner = if interactive() {
        let s = ProgressBar::new_spinner().with_message("validating");
        s.enable_steady_tick(SPINNER_TICK);
        s
    } else {
        ProgressBar::hidden()
    };
    let replay = Replay::open(path);
    spinner.finish_and_clear();
    let replay = replay?;
    if replay.recovered_from_truncated_tail() {
        warn_truncated(path, replay.valid_len());
    }
    Ok(replay)
}

/// Print the one-line truncated-tail warning.
pub fn warn_truncated(path: &Path, valid_len: u64) {
    let file_len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(valid_len);
    eprintln!(
        "spulse: warning: {}: ends inside a record at byte offset {valid_len}; ignoring the last {} bytes",
        escape(&path.display().to_string()),
        file_len.saturating_sub(valid_len)
    );
}

/// Whether progress bars may be drawn (stderr is a terminal).
pub fn interactive() -> bool {
    std::io::stderr().is_terminal()
}

/// A progress bar of `len` steps on stderr, hidden unless stderr is a terminal.
pub fn progress(len: u64, message: &'static str) -> ProgressBar {
    if !interactive() {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} ({eta})")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    ProgressBar::new(len).with_style(style).with_message(message)
}
