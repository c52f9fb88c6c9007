//! One profile window: where its samples come from (the running
//! recorder's spool, the preload library's, or a temporary recording), their
//! counts per (thread, stack), and the pprof profile made of them.

use std::collections::HashMap;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{now_us, POLL, PROFILE_PATH, WALL_PATH};
use crate::pprof::{Counts, Window};
use crate::spread::{BlockedSpread, Stratum};
use crate::symbolize::{Context, Symbolizer};
use crate::{Error, Guard, Recorder, Sample, StackId, Tail, ThreadId};

/// A recorder this module started for one window, and its temporary spool
/// (removed on drop).
struct TempRecording {
    guard: Option<Guard>,
    path: PathBuf,
}

impl TempRecording {
    fn start(off_cpu: bool) -> Result<TempRecording, Error> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "spulse-http-{}-{}-{}.spool",
            std::process::id(),
            now_us(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        // The recorder expands `{...}` templates: double any brace of the
        // directory. The process's SPULSE_* settings are for its own
        // recordings, not this one (SPULSE_OUTPUT would take its path).
        let mut template = Vec::new();
        for &b in path.as_os_str().as_bytes() {
            template.push(b);
            if b == b'{' || b == b'}' {
                template.push(b);
            }
        }
        let template = PathBuf::from(std::ffi::OsString::from_vec(template));
        let guard = Recorder::builder().without_environment().off_cpu(off_cpu).start(&template)?;
        Ok(TempRecording { guard: Some(guard), path })
    }

    /// Stop the recorder: every sample it took is in the spool afterwards.
    fn finish(&mut self) -> Result<(), Error> {
        match self.guard.take() {
            Some(g) => g.finish().map(|_| ()),
            None => Ok(()),
        }
    }
}

impl Drop for TempRecording {
    fn drop(&mut self) {
        drop(self.guard.take());
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The samples of one window, counted per (thread, stack), and the spool
/// definitions they refer to.
pub(super) struct Collected {
    tail: Tail,
    window: Window,
    contexts: Vec<Context>,
    by_thread: HashMap<ThreadId, usize>,
    counts: HashMap<(usize, StackId), u64>,
    /// `counts` sorted by (context, stack), built when the window closes.
    sorted: Vec<(usize, StackId, u64)>,
    /// For a wall-clock window: off-CPU microseconds per (context, stack),
    /// and sorted when the window closes.
    wall: bool,
    off: HashMap<(usize, StackId), u64>,
    sorted_off: Vec<(usize, StackId, u64)>,
    /// With `spread_blocked=1`: the window's waits with a stack, to charge
    /// its blocked time without a stack to ([`crate::spread`]), and that time
    /// by (context, its stack, the stratum of the wait's length).
    spread: Option<BlockedSpread>,
    stackless: HashMap<(usize, StackId, Stratum), u64>,
}

impl Counts for Collected {
    fn contexts(&self) -> &[Context] {
        &self.contexts
    }
    fn iter(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        self.sorted.iter().copied()
    }
    fn off_cpu(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        self.sorted_off.iter().copied()
    }
}

impl Collected {
    fn count(&mut self, samples: &[Sample]) {
        let (start_us, end_us) = (self.window.start_us, self.window.start_us + self.window.duration_us);
        for s in samples.iter().filter(|s| s.time_us >= start_us && s.time_us < end_us) {
            let c = self.context(s.thread);
            *self.counts.entry((c, s.stack)).or_insert(0) += 1;
        }
        if self.wall {
            // The off-CPU intervals the last poll read, by their start; one
            // that began before the window counts the part inside it.
            let intervals: Vec<_> = self.tail.off_cpu().to_vec();
            for o in intervals {
                let from = o.start_us.max(self.window.start_us);
                let to = (o.start_us + o.duration_us).min(end_us);
                if to <= from {
                    continue;
                }
                let c = self.context(o.thread);
                if let Some(spread) = &mut self.spread {
                    let defs = self.tail.definitions();
                    spread.observe(defs, &o);
                    if let Some(st) = spread.stratum(defs, o.stack, o.state, o.duration_us) {
                        *self.stackless.entry((c, o.stack, st)).or_insert(0) += to - from;
                        continue;
                    }
                }
                *self.off.entry((c, o.stack)).or_insert(0) += to - from;
            }
        }
    }

    /// The context of `thread`, made on first use.
    fn context(&mut self, thread: ThreadId) -> usize {
        if let Some(&c) = self.by_thread.get(&thread) {
            return c;
        }
        let pid = self.tail.thread(thread).pid;
        // Perf-map names of anonymous code are trusted unless the spool marks
        // Python-runtime intervals for the process (CPython's trampolines are
        // unmapped and reused outside them); the endpoint does not track the
        // intervals.
        let perf_map_allowed = !self.tail.python_runtime_events().iter().any(|e| e.pid == pid);
        let c = self.contexts.len();
        self.contexts.push(Context { thread: Some(thread), pid, perf_map_allowed });
        self.by_thread.insert(thread, c);
        c
    }

    pub(super) fn encode(&self, sym: &mut Symbolizer) -> Result<Vec<u8>, Error> {
        sym.next_spool();
        let mut out = Vec::new();
        let path = if self.wall { WALL_PATH } else { PROFILE_PATH };
        let spread = if self.spread.is_some() { "&spread_blocked=1" } else { "" };
        let comment =
            format!("spulse {path}?seconds={}{spread}", self.window.duration_us.div_ceil(1_000_000));
        crate::pprof::write(self.tail.definitions(), self, self.window, sym, &comment, &mut out)
            .map_err(|e| Error::io(None, e))?;
        Ok(out)
    }
}

/// Count the samples of the next `duration`, from the running recorder's
/// spool, the preload library's, or a temporary recording. `wait` is called
/// between polls of the spool (it waits about [`POLL`]); when it returns an
/// error (why) the window is abandoned.
pub(super) fn collect(
    duration: Duration,
    wall: bool,
    spread_blocked: bool,
    wait: &mut dyn FnMut() -> Result<(), &'static str>,
) -> Result<Collected, Error> {
    let abandoned = |why: &str| {
        Error::io(None, io::Error::new(io::ErrorKind::Interrupted, format!("profile abandoned: {why}")))
    };
    // How to ask the running recorder to write the waits still open at the
    // window's end (off-CPU mode; see `recorder::request_off_cpu_split`):
    // a thread blocked past the end is written only when it wakes otherwise.
    let split: fn(u64) = crate::recorder::request_off_cpu_split;
    let (path, flush, mut temp, split) = match crate::recorder::live_spool() {
        Some((path, flush)) => (path, flush, None, Some(split)),
        None => match crate::recorder::preload_live_spool() {
            Some(Ok((path, flush))) => {
                (path, flush, None, Some(crate::recorder::preload_split_off_cpu as fn(u64)))
            }
            Some(Err(why)) => return Err(Error::io(None, io::Error::other(why))),
            None => {
                // Its stop closes every wait still open.
                let t = TempRecording::start(wall)?;
                (t.path.clone(), Duration::ZERO, Some(t), None)
            }
        },
    };
    let mut tail = Tail::open(&path)?;
    // Everything in the spool so far precedes the window: read it for the
    // definitions its samples may refer to.
    while !tail.poll()?.is_empty() {}
    let start = Instant::now();
    let window = Window { start_us: now_us(), duration_us: duration.as_micros() as u64 };
    if let (true, Some(split)) = (wall, split) {
        // At the start too: the short waits summed before it are written
        // then, and those after it sum anew (FORMAT.md, tag 9), so that
        // none is placed across the window's start.
        split(window.start_us.saturating_mul(1000));
    }
    let mut c = Collected {
        tail,
        window,
        contexts: Vec::new(),
        by_thread: HashMap::new(),
        counts: HashMap::new(),
        sorted: Vec::new(),
        wall,
        off: HashMap::new(),
        sorted_off: Vec::new(),
        spread: (wall && spread_blocked).then(BlockedSpread::default),
        stackless: HashMap::new(),
    };
    let mut batch: Vec<Sample> = Vec::new();
    let mut poll = |c: &mut Collected| -> Result<bool, Error> {
        batch.clear();
        batch.extend_from_slice(c.tail.poll()?);
        c.count(&batch);
        Ok(!batch.is_empty())
    };
    while start.elapsed() < duration {
        poll(&mut c)?;
        wait().map_err(abandoned)?;
    }
    if let (true, Some(split)) = (wall, split) {
        split(window.start_us.saturating_add(window.duration_us).saturating_mul(1000));
    }
    match &mut temp {
        Some(t) => {
            // The recorder stops: every sample it took is in the spool.
            t.finish()?;
            while poll(&mut c)? {}
        }
        None => {
            // A sample taken before the window closed reaches the spool
            // within about one flush interval of the running recorder (a
            // tenth more in off-CPU mode, whose ticks are jittered).
            let drained = Instant::now() + flush * 2 + POLL;
            loop {
                while poll(&mut c)? {}
                if Instant::now() >= drained {
                    break;
                }
                wait().map_err(abandoned)?;
            }
        }
    }
    drop(temp);
    let mut sorted: Vec<_> = c.counts.iter().map(|(&(ctx, s), &n)| (ctx, s, n)).collect();
    sorted.sort_unstable_by_key(|&(ctx, s, _)| (ctx, s.index()));
    c.sorted = sorted;
    if let Some(spread) = &c.spread {
        // Each context is one thread: its time without a stack goes to its
        // waits with one (the charge is linear, so the time of a stratum is
        // charged at once).
        for (&(ctx, stack, st), &us) in &c.stackless {
            let off = &mut c.off;
            match c.contexts[ctx].thread {
                Some(thread) => {
                    spread.charge_stratum(thread, st, us, |s, d| {
                        *off.entry((ctx, s.unwrap_or(stack))).or_insert(0) += d;
                    });
                }
                None => *off.entry((ctx, stack)).or_insert(0) += us,
            }
        }
    }
    let mut sorted: Vec<_> = c.off.iter().map(|(&(ctx, s), &n)| (ctx, s, n)).collect();
    sorted.sort_unstable_by_key(|&(ctx, s, _)| (ctx, s.index()));
    c.sorted_off = sorted;
    Ok(c)
}
