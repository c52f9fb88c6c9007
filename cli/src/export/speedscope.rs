//! speedscope's JSON file format: one sampled profile per thread, frames shared.
//! Samples are aggregated per distinct stack (weights in microseconds: count ×
//! interval; with `--off-cpu`/`--wall`, CPU samples and off-CPU intervals by
//! their time), which keeps the file small; speedscope's "left heavy" and
//! "sandwich" views are unaffected, the "time order" view shows stacks in
//! aggregate order instead of time order. Inlined functions are frames of
//! their own, under the function they were inlined into.
//!
//! The document is written as it is produced, one stack at a time (the frames
//! table last): memory is bounded by the distinct stacks and functions, while
//! the output spells every distinct stack in full.

use std::collections::HashMap;
use std::io::Write;

use serde_json::json;
use spulse::{Definitions, ThreadId};

use super::Job;
use crate::aggregate::Aggregate;
use crate::report::expand;
use crate::symbolize::Symbolizer;
use crate::CliError;

/// The `$schema` URL speedscope files declare.
pub const SCHEMA_URL: &str = "https://www.speedscope.app/file-format-schema.json";

fn title(defs: &Definitions, thread: Option<ThreadId>) -> String {
    match thread {
        Some(t) => {
            let t = defs.thread(t);
            if t.name.is_empty() {
                format!("tid {} (pid {})", t.tid, t.pid)
            } else {
                format!("{} (tid {}, pid {})", t.name, t.tid, t.pid)
            }
        }
        None => "all threads".to_string(),
    }
}

/// Write a speedscope file of the selected samples, one profile per thread.
pub fn export(job: &Job<'_>, sym: &mut Symbolizer, out: &mut dyn Write) -> Result<u64, CliError> {
    let agg = job.aggregate(sym, true)?;
    // With --off-cpu/--wall the counts are microseconds already.
    let per_count = if job.filter.time.is_time() { 1 } else { job.replay.interval_us().max(1) };
    write(job.replay, &agg, per_count, sym, job.title, out).map_err(|e| job.write_error(e))?;
    Ok(agg.total)
}

/// Write a speedscope file. `agg` must be a per-thread aggregation; each of
/// its counts weighs `per_count` microseconds (a sample's interval, or 1 when
/// the counts are microseconds: `--off-cpu`, `--wall`).
fn write(
    defs: &Definitions,
    agg: &Aggregate,
    per_count: u64,
    sym: &mut Symbolizer,
    name: &str,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    // The aggregation's entries, grouped by thread in first-seen order.
    let mut order: Vec<Option<ThreadId>> = Vec::new();
    let mut by_thread: HashMap<Option<ThreadId>, Vec<(usize, spulse::StackId, u64)>> = HashMap::new();
    for (c, stack, count) in agg.iter() {
        let t = agg.contexts[c].thread;
        by_thread
            .entry(t)
            .or_insert_with(|| {
                order.push(t);
                Vec::new()
            })
            .push((c, stack, count));
    }
    let mut frame_index: HashMap<u32, usize> = HashMap::new();
    let mut frames: Vec<u32> = Vec::new();
    let mut funcs = Vec::new();
    write!(out, "{{\"$schema\":")?;
    serde_json::to_writer(&mut *out, SCHEMA_URL)?;
    write!(out, ",\"profiles\":[")?;
    for (pi, thread) in order.iter().enumerate() {
        let entries = &by_thread[thread];
        if pi > 0 {
            write!(out, ",")?;
        }
        write!(out, "{{\"type\":\"sampled\",\"name\":")?;
        serde_json::to_writer(&mut *out, &title(defs, *thread))?;
        write!(out, ",\"unit\":\"microseconds\",\"startValue\":0,\"samples\":[")?;
        for (i, &(c, stack, _)) in entries.iter().enumerate() {
            expand(defs, sym, &agg.contexts[c], stack, &mut funcs);
            write!(out, "{}[", if i > 0 { "," } else { "" })?;
            for (j, &f) in funcs.iter().rev().enumerate() {
                let next = frames.len();
                let k = *frame_index.entry(f).or_insert(next);
                if k == next {
                    frames.push(f);
                }
                write!(out, "{}{k}", if j > 0 { "," } else { "" })?;
            }
            write!(out, "]")?;
        }
        write!(out, "],\"weights\":[")?;
        let mut end = 0u64;
        for (i, &(_, _, count)) in entries.iter().enumerate() {
            let w = count * per_count;
            end += w;
            write!(out, "{}{w}", if i > 0 { "," } else { "" })?;
        }
        write!(out, "],\"endValue\":{end}}}")?;
    }
    write!(out, "],\"shared\":{{\"frames\":[")?;
    for (i, &f) in frames.iter().enumerate() {
        let func = sym.function(f);
        if i > 0 {
            write!(out, ",")?;
        }
        serde_json::to_writer(&mut *out, &json!({"name": func.name, "file": func.module}))?;
    }
    write!(out, "]}},\"name\":")?;
    serde_json::to_writer(&mut *out, name)?;
    write!(out, ",\"activeProfileIndex\":0,\"exporter\":")?;
    serde_json::to_writer(&mut *out, concat!("spulse ", env!("CARGO_PKG_VERSION")))?;
    writeln!(out, "}}")
}
