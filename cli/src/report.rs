//! Reports built from an aggregation and a symbolizer: the function table of
//! `top` and the folded stacks of `collapsed`/`svg`. Both walk each distinct
//! stack once, so their cost is bounded by the distinct stacks.

use std::collections::HashMap;

use spulse::{Definitions, StackId};

use crate::aggregate::{Aggregate, Context};
use crate::input::progress;
use crate::symbolize::Symbolizer;

/// Self and total sample counts of one function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FunctionStats {
    /// Index into [`Symbolizer::functions`].
    pub func: u32,
    /// Samples whose innermost frame is this function.
    pub self_samples: u64,
    /// Samples with this function anywhere on the stack (counted once per sample).
    pub total_samples: u64,
}

/// Resolve every frame of every aggregated stack up front, with a progress bar
/// on a terminal (loading large modules is the slow part of most reports).
pub fn symbolize_all(defs: &Definitions, agg: &Aggregate, sym: &mut Symbolizer) {
    let bar = progress(agg.distinct() as u64, "symbolizing");
    for (i, (c, stack, _)) in agg.iter().enumerate() {
        let ctx = agg.contexts[c];
        for frame in defs.stack_frames(stack) {
            sym.resolve(defs, frame, &ctx);
        }
        if i & 0xff == 0 {
            bar.set_position(i as u64);
        }
    }
    bar.finish_and_clear();
}

/// The functions of a stack, innermost first, inlined frames expanded.
pub fn expand(defs: &Definitions, sym: &mut Symbolizer, ctx: &Context, stack: StackId, out: &mut Vec<u32>) {
    out.clear();
    for frame in defs.stack_frames(stack) {
        let r = sym.resolve(defs, frame, ctx);
        out.extend(r.frames.iter().map(|f| f.func));
    }
}

/// Self and total counts per function, hottest (by self, then total) first.
pub fn top(defs: &Definitions, agg: &Aggregate, sym: &mut Symbolizer) -> Vec<FunctionStats> {
    let mut stats: HashMap<u32, (u64, u64)> = HashMap::new();
    let mut funcs = Vec::new();
    let mut seen: Vec<u32> = Vec::new();
    for (c, stack, count) in agg.iter() {
        let ctx = agg.contexts[c];
        expand(defs, sym, &ctx, stack, &mut funcs);
        if let Some(&leaf) = funcs.first() {
            stats.entry(leaf).or_default().0 += count;
        }
        seen.clear();
        for &f in &funcs {
            if !seen.contains(&f) {
                seen.push(f);
                stats.entry(f).or_default().1 += count;
            }
        }
    }
    let mut out: Vec<FunctionStats> = stats
        .into_iter()
        .map(|(func, (s, t))| FunctionStats { func, self_samples: s, total_samples: t })
        .collect();
    out.sort_by(|a, b| {
        b.self_samples
            .cmp(&a.self_samples)
            .then(b.total_samples.cmp(&a.total_samples))
            .then_with(|| sym.function(a.func).name.cmp(&sym.function(b.func).name))
    });
    out
}

/// Make a function name safe for one field of a folded line.
fn folded_name(name: &str) -> Cow<'_, str> {
    if name.contains([';', '\n', '\r']) {
        Cow::Owned(name.replace(';', ":").replace(['\n', '\r'], " "))
    } else {
        Cow::Borrowed(name)
    }
}

use std::borrow::Cow;

/// Folded stacks (`root;...;leaf` and a count), sorted by stack text. Stacks
/// that symbolize to the same text are merged.
pub fn folded(defs: &Definitions, agg: &Aggregate, sym: &mut Symbolizer) -> Vec<(String, u64)> {
    let mut lines: HashMap<String, u64> = HashMap::new();
    let mut funcs = Vec::new();
    let mut text = String::new();
    for (c, stack, count) in agg.iter() {
        let ctx = agg.contexts[c];
        expand(defs, sym, &ctx, stack, &mut funcs);
        text.clear();
        for (i, &f) in funcs.iter().rev().enumerate() {
            if i > 0 {
                text.push(';');
            }
            text.push_str(&folded_name(&sym.function(f).name));
        }
        match lines.get_mut(text.as_str()) {
            Some(n) => *n += count,
            None => {
                lines.insert(text.clone(), count);
            }
        }
    }
    let mut out: Vec<(String, u64)> = lines.into_iter().collect();
    out.sort_unstable();
    out
}
