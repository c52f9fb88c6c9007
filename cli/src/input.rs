//! Opening spools for the commands (with the truncated-tail warning; several
//! spools are merged into one), and the progress bars that appear only when
//! stderr is a terminal.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

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
    warn_if_recording(path);
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

/// The spools a command reads, opened as one.
pub struct Inputs {
    /// The samples of all of them, in time order.
    pub replay: Replay,
    /// How to name them in messages and titles: the one path, or the first
    /// with the number of others.
    pub name: PathBuf,
}

/// Open the spools `files` for sequential reading. One spool is opened as
/// [`open_replay`] does. Several (the segments of a rotating recording, or
/// spools of different processes or recordings) are merged in time order
/// into a temporary file (in `TMPDIR`, removed once it is opened: its space
/// is freed when the command ends), with their ids kept apart and identical
/// definitions shared (see [`crate::merge`]); each is validated as it is
/// read, and an unreadable or corrupt one is an error naming it.
pub fn open_inputs(files: &[PathBuf]) -> Result<Inputs, CliError> {
    let (first, rest) = match files {
        [] => return Err(CliError::input("no spool given")),
        [one] => return Ok(Inputs { replay: open_replay(one)?, name: one.clone() }),
        [first, rest @ ..] => (first, rest),
    };
    // One file given twice (by two names, a link) would count twice.
    let mut ids: Vec<((u64, u64), &PathBuf)> = Vec::new();
    for f in files {
        use std::os::unix::fs::MetadataExt;
        if let Ok(m) = std::fs::metadata(f) {
            if let Some((_, other)) = ids.iter().find(|(id, _)| *id == (m.dev(), m.ino())) {
                return Err(CliError::input(format!(
                    "{} and {} are the same file: its samples would count twice",
                    escape(&other.display().to_string()),
                    escape(&f.display().to_string())
                )));
            }
            ids.push(((m.dev(), m.ino()), f));
        }
        warn_if_recording(f);
    }
    let tmp = tempfile::Builder::new()
        .prefix("spulse-merged-")
        .suffix(".spool")
        .tempfile()
        .map_err(|e| CliError::other(format!("cannot create a temporary file for merging: {e}")))?;
    let file =
        tmp.as_file().try_clone().map_err(|e| CliError::other(format!("{}: {e}", tmp.path().display())))?;
    let spinner = if interactive() {
        let s = ProgressBar::new_spinner().with_message("merging");
        s.enable_steady_tick(SPINNER_TICK);
        s
    } else {
        ProgressBar::hidden()
    };
    let merged = crate::merge::merge_files(files, file);
    spinner.finish_and_clear();
    let (out, merged) = match merged {
        Ok(m) => m,
        Err(crate::merge::MergeError::Source(msg)) => return Err(CliError::input(msg)),
        Err(crate::merge::MergeError::Output(e)) => {
            return Err(CliError::other(format!("writing the merged spool {}: {e}", tmp.path().display())))
        }
    };
    drop(out);
    for (a, b) in &merged.same_start {
        eprintln!(
            "spulse: warning: {} and {} start at the same microsecond: most likely one recording given \
             twice (a spool and its packed copy?), whose samples are then counted twice",
            escape(&a.display().to_string()),
            escape(&b.display().to_string())
        );
    }
    for (path, valid_len) in &merged.truncated {
        warn_truncated(path, *valid_len);
    }
    if merged.dropped > 0 {
        eprintln!(
            "spulse: warning: {} of {} samples could not be merged (a definition they need conflicts with \
             another spool's)",
            merged.dropped,
            merged.samples + merged.dropped
        );
    }
    // The replay keeps its own descriptor: the file can go now.
    let replay = Replay::open(tmp.path())?;
    drop(tmp);
    let name = PathBuf::from(format!("{} (+{} more)", first.display(), rest.len()));
    Ok(Inputs { replay, name })
}

/// Say on stderr when a recorder still writes `path` (it holds the spool's
/// lock): what is read is what it holds so far (`pack` of it is not the
/// whole recording), and `spulse follow` shows it live.
fn warn_if_recording(path: &Path) {
    // Only a regular file, opened without blocking (a FIFO or a device is
    // refused later by the reader, never waited on here).
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return;
    }
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path);
    let running = file.ok().and_then(|f| spulse::recording_running(&f).ok());
    if running == Some(true) {
        eprintln!(
            "spulse: warning: {}: still being recorded: this reads what it holds so far \
             (spulse follow shows it live)",
            escape(&path.display().to_string())
        );
    }
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
