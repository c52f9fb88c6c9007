//! `spulse follow`: a live top table of a spool that is still being written,
//! read incrementally with `Tail`.
//!
//! It stops, printing the final table, when
//! - Ctrl-C is pressed (SIGINT), or
//! - the writer is gone: everything written so far was read and no process
//!   named by the spool's thread or module records is alive any more
//!   (`/proc/<pid>` is absent), or
//! - the file has not grown for `--idle-exit` seconds (0 disables this).
//!
//! Perf maps (`/tmp/perf-<pid>.map`) are re-read for every table, since a JIT
//! keeps appending to its map. On a terminal the table is redrawn in place; on a pipe one table is printed
//! per interval, separated by a header line.

use std::collections::{BTreeSet, HashMap};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use spulse::{Sample, StackId, Tail};

use super::top::write_table;
use super::{with_stdout, SymbolArgs};
use crate::aggregate::{Aggregate, Context};
use crate::input::warn_truncated;
use crate::report::top;
use crate::symbolize::Symbolizer;
use crate::CliError;

/// Arguments of `spulse follow`.
#[derive(Debug, Args)]
#[command(
    after_help = "Examples:\n  spulse follow /tmp/app.spool\n  spulse follow /tmp/app.spool --interval 5 -n 10 | tee top.log\n\n\
Stops on Ctrl-C, when no process recorded in the spool is alive and everything\n\
was read, or when the file has not grown for --idle-exit seconds."
)]
pub struct FollowArgs {
    /// The spool file (being written by a running process).
    pub file: PathBuf,
    /// Seconds between tables.
    #[arg(long, value_name = "SECS", default_value_t = 1.0)]
    pub interval: f64,
    /// Stop when the file has not grown for this many seconds (0: never).
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    pub idle_exit: f64,
    /// How many functions to show.
    #[arg(short = 'n', long = "limit", value_name = "N", default_value_t = 20)]
    pub n: usize,
    #[command(flatten)]
    pub symbols: SymbolArgs,
}

/// Counts per (context, stack) gathered while tailing.
struct Live {
    contexts: Vec<Context>,
    ctx_index: HashMap<Context, u32>,
    counts: HashMap<(u32, StackId), u64>,
    /// Samples read (ordinal of the next one).
    read: u64,
    next_event: usize,
    inside: HashMap<u32, bool>,
}

impl Live {
    fn add(&mut self, tail: &Tail, batch: &[Sample]) {
        let events = tail.python_runtime_events();
        for s in batch {
            while self.next_event < events.len() && events[self.next_event].samples_before <= self.read {
                let e = events[self.next_event];
                self.inside.insert(e.pid, e.entering);
                self.next_event += 1;
            }
            self.read += 1;
            let pid = tail.thread(s.thread).pid;
            let allowed = self.inside.get(&pid).copied().unwrap_or(true);
            let c = Context { thread: None, pid, perf_map_allowed: allowed };
            let next = self.contexts.len() as u32;
            let ci = *self.ctx_index.entry(c).or_insert_with(|| {
                self.contexts.push(c);
                next
            });
            *self.counts.entry((ci, s.stack)).or_insert(0) += 1;
        }
    }
}

fn pids_alive(tail: &Tail) -> Option<bool> {
    let pids: BTreeSet<u32> =
        tail.threads().iter().map(|t| t.pid).chain(tail.modules().iter().map(|m| m.pid)).collect();
    if pids.is_empty() {
        return None;
    }
    Some(pids.iter().any(|p| std::path::Path::new(&format!("/proc/{p}")).exists()))
}

/// Run `spulse follow`.
pub fn run(args: &FollowArgs) -> Result<(), CliError> {
    if !(args.interval > 0.0 && args.interval.is_finite()) {
        return Err(CliError::input(format!(
            "--interval {} must be a positive number of seconds",
            args.interval
        )));
    }
    if !(args.idle_exit >= 0.0 && args.idle_exit.is_finite()) {
        return Err(CliError::input(format!("--idle-exit {} must be zero or more seconds", args.idle_exit)));
    }
    let mut tail = Tail::open(&args.file)?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        // If a handler cannot be installed (one already is), Ctrl-C simply kills us.
        let _ = ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst));
    }
    let terminal = std::io::stdout().is_terminal();
    let mut sym = Symbolizer::new(args.symbols.options());
    let mut live = Live {
        contexts: Vec::new(),
        ctx_index: HashMap::new(),
        counts: HashMap::new(),
        read: 0,
        next_event: 0,
        inside: HashMap::new(),
    };
    let interval = Duration::from_secs_f64(args.interval);
    let idle_limit = (args.idle_exit > 0.0).then(|| Duration::from_secs_f64(args.idle_exit));
    let started = Instant::now();
    let mut last_growth = Instant::now();
    let mut last_pos = tail.position();
    let mut last_len = std::fs::metadata(&args.file).map(|m| m.len()).unwrap_or(0);
    let mut batch: Vec<Sample> = Vec::new();
    let mut prev_read = 0u64;
    let reason;
    loop {
        let tick = Instant::now();
        // Drain everything complete.
        loop {
            batch.clear();
            batch.extend_from_slice(tail.poll()?);
            if batch.is_empty() {
                break;
            }
            live.add(&tail, &batch);
        }
        let len = std::fs::metadata(&args.file).map(|m| m.len()).unwrap_or(last_len);
        if tail.position() != last_pos || len != last_len {
            last_growth = Instant::now();
            last_pos = tail.position();
            last_len = len;
        }
        // JIT runtimes append to their perf maps while they run.
        sym.refresh_perf_maps();
        print_table(&tail, &live, &mut sym, args, terminal, started.elapsed(), live.read - prev_read)?;
        prev_read = live.read;

        let caught_up = !tail.has_incomplete_record();
        if stop.load(Ordering::SeqCst) {
            reason = "interrupted".to_string();
            break;
        }
        if caught_up && pids_alive(&tail) == Some(false) {
            reason = "writer gone (no process recorded in the spool is running)".to_string();
            break;
        }
        if let Some(limit) = idle_limit {
            if last_growth.elapsed() >= limit {
                reason = format!("file idle for {:.1} s", limit.as_secs_f64());
                break;
            }
        }
        // Sleep until the next tick in small steps, so Ctrl-C is prompt.
        while tick.elapsed() < interval && !stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(20).min(interval));
        }
    }
    if tail.has_incomplete_record() {
        warn_truncated(&args.file, tail.position());
    }
    eprintln!("spulse: follow: {}: stopped: {reason}; {} samples", args.file.display(), live.read);
    Ok(())
}

fn print_table(
    tail: &Tail,
    live: &Live,
    sym: &mut Symbolizer,
    args: &FollowArgs,
    terminal: bool,
    elapsed: Duration,
    new: u64,
) -> Result<(), CliError> {
    let agg = Aggregate::from_counts(live.contexts.clone(), live.counts.clone());
    let stats = top(tail, &agg, sym);
    with_stdout(|out| {
        if terminal {
            write!(out, "\x1b[2J\x1b[H")?;
        }
        writeln!(
            out,
            "--- {} at {:.1} s: {} samples (+{new}), {} threads ---",
            args.file.display(),
            elapsed.as_secs_f64(),
            live.read,
            tail.threads().len()
        )?;
        write_table(out, &stats, sym, agg.total, args.n)?;
        if !terminal {
            writeln!(out)?;
        }
        Ok(())
    })
}
