//! SVG flame graphs of a recording, in process (cargo feature `flamegraph`,
//! which brings in `inferno`; off by default, so an embedding that does not
//! ask for it links none of it).
//!
//! ```no_run
//! # fn work() {}
//! let guard = spulse::start("app.spool")?;
//! work();
//! let stats = guard.finish_with_flamegraph("app.svg")?; // the spool stays too
//! # Ok::<(), spulse::Error>(())
//! ```
//!
//! The graph is that of `spulse export app.spool -o app.svg` in its plain
//! form: every thread of every process, one frame per function (inlined
//! functions nested under their caller), symbolized with [`crate::symbolize`]
//! from the module files on this machine. The `spulse` tool adds choices
//! (threads, time windows, root frames per thread, `[unknown]` grouping);
//! this is the one-call version. Memory is bounded by the distinct sampled
//! stacks (each kept as its folded text once), not by the samples.

use std::collections::HashMap;
use std::path::Path;

use crate::symbolize::{Context, Options, Symbolizer};
use crate::{Error, Guard, Replay, StackId, Stats};

impl Guard {
    /// [`Guard::finish`], then write an SVG flame graph of the spool to
    /// `svg` (see [`write_flamegraph`]). Of a rotating recording, the graph
    /// covers the first segment ([`Guard::path`]). The recording's own
    /// errors come first; an error writing the graph names `svg`.
    pub fn finish_with_flamegraph(self, svg: impl AsRef<Path>) -> Result<Stats, Error> {
        let spool = self.path().to_path_buf();
        let stats = self.finish()?;
        write_flamegraph(&spool, svg.as_ref())?;
        Ok(stats)
    }
}

/// Write an SVG flame graph of the spool (or packed file) `spool` to `svg`,
/// titled with the spool's name; returns the number of samples drawn. The
/// file is written beside `svg` under a temporary name and renamed over it
/// once complete.
pub fn write_flamegraph(spool: &Path, svg: &Path) -> Result<u64, Error> {
    let replay = Replay::open(spool)?;
    let lines = folded(&replay)?;
    let total = lines.values().sum();
    let mut sorted: Vec<String> = lines.into_iter().map(|(stack, n)| format!("{stack} {n}")).collect();
    sorted.sort_unstable();
    let io = |source: std::io::Error| Error::Io { path: Some(svg.to_path_buf()), source };
    let dir = match svg.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp_name = format!(
        ".{}.{}.tmp",
        svg.file_name().map_or_else(|| "flamegraph".into(), |n| n.to_string_lossy()),
        std::process::id()
    );
    let tmp = dir.join(tmp_name);
    let result = (|| {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        let mut opts = inferno::flamegraph::Options::default();
        opts.title = xml_text(&format!("spulse {}", spool.display()));
        opts.count_name = "samples".to_string();
        let drawn = if sorted.is_empty() {
            // inferno refuses empty input; an empty recording still gets a valid SVG.
            inferno::flamegraph::from_lines(&mut opts, std::iter::once("[no samples] 1"), &mut out)
        } else {
            inferno::flamegraph::from_lines(&mut opts, sorted.iter().map(String::as_str), &mut out)
        };
        drawn.map_err(std::io::Error::other)?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, svg)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(total)
}

/// Folded stacks (`root;...;leaf` to samples) of every sample of `replay`.
fn folded(replay: &Replay) -> Result<HashMap<String, u64>, Error> {
    let defs = &**replay;
    // Perf-map names are trusted for the whole recording only when it has
    // no Python-runtime intervals (see `Context::perf_map_allowed`).
    let perf_map_allowed = defs.python_runtime_events().is_empty();
    let mut counts: HashMap<(u32, StackId), u64> = HashMap::new();
    for s in replay.samples() {
        let s = s?;
        *counts.entry((defs.thread(s.thread).pid, s.stack)).or_insert(0) += 1;
    }
    let mut sym = Symbolizer::new(Options::default());
    let mut lines: HashMap<String, u64> = HashMap::new();
    let mut frames = Vec::new();
    for ((pid, stack), n) in counts {
        let ctx = Context { thread: None, pid, perf_map_allowed };
        frames.clear();
        frames.extend(defs.stack_frames(stack));
        let mut line = String::new();
        // Outermost frame first; at each frame, the function containing the
        // code first and the functions inlined into it after.
        for &frame in frames.iter().rev() {
            let r = sym.resolve(defs, frame, &ctx);
            for f in r.frames.iter().rev() {
                if !line.is_empty() {
                    line.push(';');
                }
                line.push_str(&folded_name(&sym.function(f.func).name));
            }
        }
        *lines.entry(line).or_insert(0) += n;
    }
    Ok(lines)
}

/// A function name made safe for one field of a folded line and for XML:
/// `;` and line breaks would split the line, and XML 1.0 forbids most
/// control characters (inferno passes them through), so they are written as
/// escapes.
fn folded_name(name: &str) -> String {
    xml_text(&name.replace(';', ":").replace(['\n', '\r'], " "))
}

/// `s` with control characters (and the two non-characters XML forbids)
/// written as `\u{..}` escapes.
fn xml_text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() || c == '\u{fffe}' || c == '\u{ffff}' {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}
