//! `spulse follow`: a live top table of a spool that is still being written,
//! read incrementally with `Tail`.
//!
//! While it records, the recorder holds an exclusive `flock` on the spool. The
//! follower tries a non-blocking shared lock on its own descriptor of the file:
//! `EWOULDBLOCK` means the recording is still running; success means it ended
//! (the lock is released at once). This works across PID namespaces and does
//! not depend on `/proc`.
//!
//! It stops, printing the final table, when
//! - Ctrl-C is pressed (SIGINT; also SIGTERM and SIGHUP), or
//! - the recording ended (nobody holds the lock) and everything was read, or
//! - the file has not grown for `--idle-exit` seconds (off by default).
//!
//! With `--wait` a spool that does not exist yet (or whose header is not yet
//! complete) is waited for, up to `--wait-timeout` seconds or until Ctrl-C.
//!
//! # Rotating recordings
//! Given the segment pattern (a file name with `{seq}`, such as
//! `app-1234-{seq}.spool`) or, with `--segments`, one segment (a file name
//! whose last run of six or more digits is the segment number, such as
//! `app-1234-000003.spool`; the flag is needed since a plain spool's name may
//! hold a long process id), `follow` reads the segments in order: from the
//! oldest one that exists (the pattern) or from the one given, and on to the lowest-numbered later one
//! whenever the current one is complete (unlocked). The recorder creates the
//! next segment before it unlocks the current one, so a complete segment with
//! no later one means the recording ended. Segments are copied into one
//! merged spool as they are read ([`crate::merge`], identical definitions
//! shared), a temporary file in `TMPDIR` that the table is computed from and
//! that is removed on exit; segments that retention deleted before they were
//! reached are skipped.
//!
//! Perf maps (`/tmp/perf-<pid>.map`) are re-read for every table, since a JIT
//! keeps appending to its map. On a terminal the table is drawn on the
//! alternate screen, fitted to the terminal's width and height (the header
//! always stays on screen), and the normal screen is restored on exit, where
//! the final table is printed once. On a pipe one table is printed per
//! interval, separated by a header line.

use std::collections::HashMap;
use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use spulse::{FormatErrorKind, Header, Sample, SpoolWriter, StackId, Tail};

use super::top::write_table;
use super::{parse_seconds, with_stdout, FilterArgs, LimitArgs, SymbolArgs};
use crate::aggregate::Aggregate;
use crate::display::{escape, fit};
use crate::input::warn_truncated;
use crate::merge::{MergeError, Shared, Source};
use crate::report::top_with;
use crate::select::{Contexts, Filter, Selector};
use crate::symbolize::Symbolizer;
use crate::CliError;

mod display;
mod segments;

pub use display::restore_terminal;
use display::*;
use segments::*;

/// How often `--wait` looks for the spool again.
const WAIT_POLL: Duration = Duration::from_millis(50);

/// Longest sleep between checks for Ctrl-C while waiting for the next table,
/// short enough that stopping feels immediate.
const STOP_POLL: Duration = Duration::from_millis(20);

/// Rows of a fitted screen that are not function rows: the header line, the
/// table's column line, and the last row, left empty so the final newline
/// never scrolls the screen.
const NON_TABLE_ROWS: usize = 3;

/// Longest `--interval`, `--idle-exit` and `--wait-timeout`: one week.
const MAX_SECS: f64 = 7.0 * 86_400.0;

fn interval_secs(s: &str) -> Result<Duration, String> {
    parse_seconds(s, 0.01, MAX_SECS)
}

fn idle_secs(s: &str) -> Result<Duration, String> {
    parse_seconds(s, 0.0, MAX_SECS)
}

/// Arguments of `spulse follow`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  spulse follow /tmp/app.spool\n  spulse follow /tmp/app.spool --interval 5 -n 10 | tee top.log\n  spulse follow --wait --wait-timeout 60 /tmp/app.spool\n\n\
Stops on Ctrl-C, when the recording has ended (the recorder no longer holds its\n\
lock on the spool) and everything was read, or when the file has not grown for\n\
--idle-exit seconds. On a terminal, -n shows no more rows than fit its height.\n\n\
A rotating recording (RecorderBuilder::rotate) is followed across its segments:\n\
give its pattern, with {seq} standing for the segment number, to start at the\n\
oldest segment still there, or one segment with --segments (the last run of 6 or\n\
more digits in its name being the number) to start there:\n\
  spulse follow '/var/tmp/app-1234-{seq}.spool'\n\
  spulse follow --segments /var/tmp/app-1234-000007.spool\n\
It moves on to the next segment when the current one is complete, and stops when\n\
the last one is complete and no later one exists."
)]
pub struct FollowArgs {
    /// The spool file (being written by a running process), or a rotating
    /// recording's segment pattern (with `{seq}`), or with --segments one of
    /// its segments.
    pub file: PathBuf,
    /// FILE is one segment of a rotating recording: follow it and the
    /// segments after it.
    #[arg(long)]
    pub segments: bool,
    /// Seconds between tables (0.01 to 604800).
    #[arg(long, value_name = "SECS", default_value = "1", value_parser = interval_secs, allow_negative_numbers = true)]
    pub interval: Duration,
    /// Stop when the file has not grown for this many seconds (0: never).
    #[arg(long, value_name = "SECS", default_value = "0", value_parser = idle_secs, allow_negative_numbers = true)]
    pub idle_exit: Duration,
    #[command(flatten)]
    pub limit: LimitArgs,
    /// Wait for the spool to appear if it does not exist yet (until Ctrl-C, or
    /// for --wait-timeout seconds).
    #[arg(long)]
    pub wait: bool,
    /// With --wait: give up after this many seconds (0 to 604800).
    #[arg(long, value_name = "SECS", requires = "wait", value_parser = idle_secs, allow_negative_numbers = true)]
    pub wait_timeout: Option<Duration>,
    #[command(flatten)]
    pub filter: FilterArgs,
    #[command(flatten)]
    pub symbols: SymbolArgs,
}

/// Counts per (context, stack) of the selected samples, gathered while tailing.
struct Live {
    select: Selector,
    contexts: Contexts,
    counts: HashMap<(u32, StackId), u64>,
}

impl Live {
    fn new(filter: &Filter, tail: &Tail) -> Live {
        Live {
            select: Selector::new(filter, tail.start_time_us()),
            contexts: Contexts::new(tail, false),
            counts: HashMap::new(),
        }
    }

    fn add(&mut self, tail: &Tail, batch: &[Sample]) {
        for s in batch {
            let Some(sel) = self.select.next(tail, s) else { continue };
            *self.counts.entry((self.contexts.id(tail, &sel), s.stack)).or_insert(0) += 1;
        }
    }

    /// The counts so far as an aggregation.
    fn aggregate(&self) -> Aggregate {
        Aggregate::from_counts(self.contexts.list().to_vec(), self.counts.clone())
    }
}

/// Whether a recorder still holds its exclusive lock on the spool (`lock` is
/// the follower's own descriptor of it).
fn recording_running(lock: &File, path: &Path) -> Result<bool, CliError> {
    spulse::recording_running(lock).map_err(|e| {
        CliError::other(format!(
            "{}: cannot check whether the recording is running (flock): {e}",
            path.display()
        ))
    })
}

/// Whether opening failed only because the spool is not there yet, or its
/// header is not complete yet (the recorder just created it).
fn not_there_yet(e: &spulse::Error) -> bool {
    match e {
        spulse::Error::Io { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
        _ => matches!(e.format_kind(), Some(FormatErrorKind::TruncatedHeader)),
    }
}

/// Open the spool for tailing. With `--wait`, wait for it to appear; `None`
/// when Ctrl-C ended the wait. Without `--wait`, a header still being written
/// by a running recorder is waited for too.
fn open_tail(args: &FollowArgs, stop: &AtomicBool) -> Result<Option<Tail>, CliError> {
    wait_for(args, stop, &mut |_| Tail::open(&args.file))
}

/// Call `open` until it succeeds: while the spool's header is still being
/// written, and with `--wait` while the spool is not there yet (`None` when
/// Ctrl-C ended the wait). `open` is given whether the wait announced itself.
fn wait_for<T>(
    args: &FollowArgs,
    stop: &AtomicBool,
    open: &mut dyn FnMut(bool) -> Result<T, spulse::Error>,
) -> Result<Option<T>, CliError> {
    let started = Instant::now();
    let mut announced = false;
    loop {
        let e = match open(announced) {
            Ok(t) => return Ok(Some(t)),
            Err(e) => e,
        };
        let header_pending = matches!(e.format_kind(), Some(FormatErrorKind::TruncatedHeader))
            && File::open(&args.file).is_ok_and(|f| recording_running(&f, &args.file).unwrap_or(false));
        let wanted = header_pending || (args.wait && not_there_yet(&e));
        if !wanted {
            return Err(e.into());
        }
        if !announced {
            let what = if header_pending {
                "the recorder to write the spool's header"
            } else {
                "the spool to appear"
            };
            eprintln!(
                "spulse: follow: {}: waiting for {what}{}",
                escape(&args.file.display().to_string()),
                match args.wait_timeout {
                    Some(t) => format!(" (up to {} s; Ctrl-C to stop)", t.as_secs_f64()),
                    None => " (Ctrl-C to stop)".to_string(),
                }
            );
            announced = true;
        }
        if stop.load(Ordering::SeqCst) {
            return Ok(None);
        }
        if let Some(limit) = args.wait_timeout {
            if started.elapsed() >= limit {
                return Err(CliError::input(format!(
                    "{}: did not appear within {} s (--wait-timeout)",
                    args.file.display(),
                    limit.as_secs_f64()
                )));
            }
        }
        std::thread::sleep(WAIT_POLL);
    }
}

/// Run `spulse follow`.
pub fn run(args: &FollowArgs) -> Result<(), CliError> {
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        // If a handler cannot be installed (one already is), Ctrl-C simply kills us.
        let _ = ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst));
    }
    let filter = args.filter.filter();
    // A thread or process id is not checked against the spool: its thread
    // record may be written later in the recording.
    filter.check_window()?;
    let shown = escape(&args.file.display().to_string()).into_owned();
    let interrupted = || {
        eprintln!("spulse: follow: {shown}: stopped: interrupted while waiting for the spool");
        Ok(())
    };
    let mut feed = match Segments::parse(&args.file, args.segments)? {
        None => {
            let Some(tail) = open_tail(args, &stop)? else { return interrupted() };
            let lock = File::open(&args.file)
                .map_err(|e| CliError::input(format!("{}: {e}", args.file.display())))?;
            Feed::Direct { lock, tail: Box::new(tail) }
        }
        Some((segments, first)) => {
            let Some(chain) = Chain::open(args, &stop, segments, first)? else { return interrupted() };
            Feed::Chain(Box::new(chain))
        }
    };
    let terminal = std::io::stdout().is_terminal();
    let screen = terminal.then(AltScreen::enter);
    let mut sym = Symbolizer::new(args.symbols.options());
    let mut live = Live::new(&filter, feed.tail());
    let idle_limit = (!args.idle_exit.is_zero()).then_some(args.idle_exit);
    let started = Instant::now();
    let mut last_growth = Instant::now();
    let mut last_pos = feed.tail().position();
    let mut last_len = std::fs::metadata(feed.grows(&args.file)).map(|m| m.len()).unwrap_or(0);
    let mut batch: Vec<Sample> = Vec::new();
    let mut prev_read = 0u64;
    let reason;
    loop {
        let tick = Instant::now();
        // Asked before draining: when the lock is free, the recorder wrote its
        // last bytes before releasing it, so the drain below reads them all.
        let running = feed.running(&args.file)?;
        let tail = feed.tail();
        loop {
            batch.clear();
            batch.extend_from_slice(tail.poll()?);
            if batch.is_empty() {
                break;
            }
            live.add(tail, &batch);
        }
        let len = std::fs::metadata(feed.grows(&args.file)).map(|m| m.len()).unwrap_or(last_len);
        let tail: &Tail = feed.tail();
        if tail.position() != last_pos || len != last_len {
            last_growth = Instant::now();
            last_pos = tail.position();
            last_len = len;
        }
        // JIT runtimes append to their perf maps while they run.
        sym.refresh_perf_maps();
        let (width, rows) = match terminal.then(terminal_size::terminal_size).flatten() {
            Some((w, h)) => (Some(w.0 as usize), Some(h.0 as usize)),
            None => (None, None),
        };
        let fitted = Fit { width, rows };
        print_table(
            tail,
            &live,
            &mut sym,
            args,
            fitted,
            terminal,
            started.elapsed(),
            live.select.selected() - prev_read,
        )?;
        prev_read = live.select.selected();

        if stop.load(Ordering::SeqCst) {
            reason = "interrupted".to_string();
            break;
        }
        if !running {
            reason = match feed {
                Feed::Direct { .. } => {
                    let mut r = "recording ended (the recorder no longer holds the spool's lock)".to_string();
                    if let Some(later) = later_segment(&args.file) {
                        r += &format!(
                            "; {} looks like a later segment: --segments follows a rotating recording \
                             across its segments",
                            escape(&later.display().to_string())
                        );
                    }
                    r
                }
                Feed::Chain(_) => {
                    "recording ended (the recorder no longer holds the last segment's lock and \
                                   no later segment exists)"
                        .to_string()
                }
            };
            break;
        }
        if let Some(limit) = idle_limit {
            if last_growth.elapsed() >= limit {
                reason = format!("file idle for {:.1} s", limit.as_secs_f64());
                break;
            }
        }
        // Sleep until the next tick in small steps, so Ctrl-C is prompt.
        while tick.elapsed() < args.interval && !stop.load(Ordering::SeqCst) {
            std::thread::sleep(STOP_POLL.min(args.interval));
        }
    }
    if let Some(screen) = screen {
        // Back on the normal screen, leave the final table there once, cut to
        // the terminal's width (it may scroll: it stays in the scrollback).
        drop(screen);
        let width = terminal_size::terminal_size().map(|(w, _)| w.0 as usize);
        let fitted = Fit { width, rows: None };
        print_table(
            feed.tail(),
            &live,
            &mut sym,
            args,
            fitted,
            false,
            started.elapsed(),
            live.select.selected() - prev_read,
        )?;
    }
    if let Feed::Direct { tail, .. } = &feed {
        if tail.has_incomplete_record() {
            warn_truncated(&args.file, tail.position());
        }
    }
    eprintln!("spulse: follow: {shown}: stopped: {reason}; {} samples", live.select.selected());
    Ok(())
}

/// Where the followed samples come from.
enum Feed {
    /// One spool, tailed directly; `lock` is the follower's own descriptor of it.
    Direct { lock: File, tail: Box<Tail> },
    /// The segments of a rotating recording, merged as they are read.
    Chain(Box<Chain>),
}

impl Feed {
    /// The tail the table is computed from.
    fn tail(&mut self) -> &mut Tail {
        match self {
            Feed::Direct { tail, .. } => tail,
            Feed::Chain(c) => &mut c.tail,
        }
    }

    /// The file whose growth `--idle-exit` watches.
    fn grows<'a>(&'a self, file: &'a Path) -> &'a Path {
        match self {
            Feed::Direct { .. } => file,
            Feed::Chain(c) => c.merged.path(),
        }
    }

    /// Whether the recording is still running (for a chain, after copying what
    /// the segments gained, moving on to the next segment when one is complete).
    fn running(&mut self, file: &Path) -> Result<bool, CliError> {
        match self {
            Feed::Direct { lock, .. } => recording_running(lock, file),
            Feed::Chain(c) => c.advance(),
        }
    }
}
