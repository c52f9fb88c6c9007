//! speedscope's JSON file format: one sampled profile per thread, frames shared.
//! Samples are aggregated per distinct stack (weights in microseconds: count ×
//! interval), which keeps the file small; speedscope's "left heavy" and
//! "sandwich" views are unaffected, the "time order" view shows stacks in
//! aggregate order instead of time order.

use std::collections::HashMap;
use std::io::Write;

use serde_json::{json, Value};
use spulse::Definitions;

use crate::aggregate::Aggregate;
use crate::report::expand;
use crate::symbolize::Symbolizer;

/// A thread's stacks (frame indices, root first) and their weights.
type ThreadProfile = (Option<spulse::ThreadId>, Vec<Vec<usize>>, Vec<u64>);

/// The `$schema` URL speedscope files declare.
pub const SCHEMA_URL: &str = "https://www.speedscope.app/file-format-schema.json";

/// Write a speedscope file. `agg` must be a per-thread aggregation.
pub fn write(
    defs: &Definitions,
    agg: &Aggregate,
    sym: &mut Symbolizer,
    name: &str,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let interval = defs.interval_us().max(1);
    let mut frame_index: HashMap<u32, usize> = HashMap::new();
    let mut frames: Vec<Value> = Vec::new();
    // Per thread: (thread, samples, weights).
    let mut profiles: Vec<ThreadProfile> = Vec::new();
    let mut profile_of: HashMap<Option<spulse::ThreadId>, usize> = HashMap::new();
    let mut funcs = Vec::new();
    for (c, stack, count) in agg.iter() {
        let ctx = agg.contexts[c];
        expand(defs, sym, &ctx, stack, &mut funcs);
        let stack_frames: Vec<usize> = funcs
            .iter()
            .rev()
            .map(|&f| {
                *frame_index.entry(f).or_insert_with(|| {
                    let func = sym.function(f);
                    frames.push(json!({"name": func.name, "file": func.module}));
                    frames.len() - 1
                })
            })
            .collect();
        let pi = *profile_of.entry(ctx.thread).or_insert_with(|| {
            profiles.push((ctx.thread, Vec::new(), Vec::new()));
            profiles.len() - 1
        });
        profiles[pi].1.push(stack_frames);
        profiles[pi].2.push(count * interval);
    }
    let profiles: Vec<Value> = profiles
        .into_iter()
        .map(|(thread, samples, weights)| {
            let title = match thread {
                Some(t) => {
                    let t = defs.thread(t);
                    if t.name.is_empty() {
                        format!("tid {} (pid {})", t.tid, t.pid)
                    } else {
                        format!("{} (tid {}, pid {})", t.name, t.tid, t.pid)
                    }
                }
                None => "all threads".to_string(),
            };
            let end: u64 = weights.iter().sum();
            json!({
                "type": "sampled",
                "name": title,
                "unit": "microseconds",
                "startValue": 0,
                "endValue": end,
                "samples": samples,
                "weights": weights,
            })
        })
        .collect();
    let doc = json!({
        "$schema": SCHEMA_URL,
        "shared": {"frames": frames},
        "profiles": profiles,
        "name": name,
        "activeProfileIndex": 0,
        "exporter": concat!("spulse ", env!("CARGO_PKG_VERSION")),
    });
    serde_json::to_writer(&mut *out, &doc)?;
    writeln!(out)
}
