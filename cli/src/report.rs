//! Reports built from an aggregation and a symbolizer: the function table of
//! `top` and the folded stacks of `collapsed`/`svg`.
//!
//! Both go through a [`CallTree`]: every distinct spool stack (per context) is
//! symbolized once, walking up only to the nearest prefix already placed, so
//! building the tree costs time and memory linear in the distinct stack
//! *nodes* (spool stack records times inline depth), never in the sum of the
//! stacks' depths. `top` then visits each tree node once; the folded stacks
//! are written depth-first from the tree, one line at a time, so their memory
//! is the tree plus one line, while their *output* is inherently the sum of the
//! depths of the distinct sampled stacks (the folded format spells each stack
//! in full).
//!
//! Inlined functions: the ranking views (`top`, `follow`) fold every inlined
//! function into the function it was inlined into, so self time goes to the
//! function the code belongs to; `--inlines` lists them as functions of their
//! own. The stack-shaped exports (folded, SVG, speedscope, pprof lines,
//! Firefox) keep inlined functions, nested under their caller.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::io::Write;

use spulse::{Definitions, Frame, StackId};

use crate::aggregate::Aggregate;
use crate::input::progress;
use crate::select::Context;
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
/// Frames shared by several stacks are resolved once (the symbolizer caches them).
pub fn symbolize_all(defs: &Definitions, agg: &Aggregate, sym: &mut Symbolizer) {
    let bar = progress(agg.distinct() as u64, "symbolizing");
    let mut done: HashSet<(usize, StackId)> = HashSet::new();
    for (i, (c, stack, _)) in agg.iter().enumerate() {
        let ctx = agg.contexts[c];
        // Walk up to the first stack already visited in this context: its
        // frames (and its ancestors') are resolved.
        let mut cur = Some(stack);
        while let Some(id) = cur {
            if !done.insert((c, id)) {
                break;
            }
            let s = defs.stack(id);
            sym.resolve(defs, s.frame, &ctx);
            cur = s.parent;
        }
        if i.is_multiple_of(SYMBOLIZE_PROGRESS_STEP) {
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

const NO_NODE: u32 = u32::MAX;

/// Stacks symbolized between progress bar updates (a stack can load a module,
/// so updates are more frequent than while reading samples).
const SYMBOLIZE_PROGRESS_STEP: usize = 256;

/// Bytes a folded line takes beyond its stack text: a space, a count of up to
/// 20 digits and a newline, rounded up.
const FOLDED_LINE_EXTRA: usize = 24;

/// Symbolized stacks as a tree: one node per distinct (parent node, function),
/// with the samples whose innermost function is that node.
pub struct CallTree {
    /// Per node: parent (`NO_NODE` for roots) and function. A parent always
    /// has a smaller index than its children.
    nodes: Vec<(u32, u32)>,
    index: HashMap<(u32, u32), u32>,
    /// Per node: samples whose innermost function is the node.
    self_count: Vec<u64>,
}

/// What a [`CallTree`]'s nodes are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shape {
    /// Inlined functions are nodes of their own (under their caller); without,
    /// each frame is the function that contains its code.
    pub inlines: bool,
    /// Functions with the same name (in different modules) are one node: the
    /// text views (folded stacks, flame graphs) show names only.
    pub by_name: bool,
    /// Each unsymbolized address of a module is a function of its own
    /// (`module+0xADDR`). By default the unsymbolized code of one module is one
    /// function, `[unknown]` of that module (`[unknown] (module)` in the
    /// text views), as `perf report` shows it, and consecutive frames of it
    /// are one frame. Code outside any module (JIT code without a perf map)
    /// stays `[unknown] 0xADDR`, one function per address.
    pub split_unknown: bool,
    /// A root frame per process, `program (pid N)`.
    pub process_root: bool,
    /// A root frame per thread, `name (tid N)` (under the process root, if
    /// any). The aggregation must be per thread.
    pub thread_root: bool,
}

impl Shape {
    /// The shape of the folded and flame graph views: inlined functions
    /// expanded, one node per name.
    pub fn text() -> Shape {
        Shape { inlines: true, by_name: true, ..Shape::default() }
    }
}

/// Name of the function [`Shape::split_unknown`] groups a module's unsymbolized code into.
const UNKNOWN: &str = "[unknown]";

/// Module name of the root frames of [`Shape::thread_root`] and [`Shape::process_root`].
const ROOT_MODULE: &str = "[root]";

impl CallTree {
    /// Build the tree of an aggregation. With `inlines`, inlined functions are
    /// nodes of their own (under their caller); without, each frame is the
    /// function that contains its code.
    pub fn build(defs: &Definitions, agg: &Aggregate, sym: &mut Symbolizer, inlines: bool) -> CallTree {
        Self::build_shaped(defs, agg, sym, Shape { inlines, ..Shape::default() })
    }

    /// [`CallTree::build`] for the text views (folded stacks, flame graphs),
    /// which show names only: functions with the same name (in different
    /// modules) are one node.
    pub fn build_by_name(defs: &Definitions, agg: &Aggregate, sym: &mut Symbolizer) -> CallTree {
        Self::build_shaped(defs, agg, sym, Shape::text())
    }

    /// The tree of an aggregation, shaped as `shape` says.
    pub fn build_shaped(defs: &Definitions, agg: &Aggregate, sym: &mut Symbolizer, shape: Shape) -> CallTree {
        let mut t = CallTree { nodes: Vec::new(), index: HashMap::new(), self_count: Vec::new() };
        // With `by_name`: the first function seen with each name stands for all.
        let mut canonical: HashMap<String, u32> = HashMap::new();
        let mut canon = |sym: &Symbolizer, f: u32| -> u32 {
            if !shape.by_name {
                return f;
            }
            let name = &sym.function(f).name;
            match canonical.get(name) {
                Some(&c) => c,
                None => {
                    canonical.insert(name.clone(), f);
                    f
                }
            }
        };
        // Per unsymbolized function: the `[unknown]` function of its module.
        let mut unknown_of: HashMap<u32, u32> = HashMap::new();
        // Root node per context (with root frames).
        let mut roots: HashMap<usize, u32> = HashMap::new();
        // Tree node of each (context, spool stack) placed so far.
        let mut placed: HashMap<(usize, StackId), u32> = HashMap::new();
        let mut path: Vec<StackId> = Vec::new();
        for (c, stack, count) in agg.iter() {
            let ctx = agg.contexts[c];
            path.clear();
            let mut cur = Some(stack);
            let mut node = NO_NODE;
            while let Some(id) = cur {
                if let Some(&n) = placed.get(&(c, id)) {
                    node = n;
                    break;
                }
                path.push(id);
                cur = defs.stack(id).parent;
            }
            if node == NO_NODE && (shape.process_root || shape.thread_root) {
                node = match roots.get(&c) {
                    Some(&n) => n,
                    None => {
                        let mut n = NO_NODE;
                        if shape.process_root {
                            let f = sym.function_id(process_root_name(defs, ctx.pid), ROOT_MODULE.into());
                            n = t.child(n, f);
                        }
                        if let Some(thread) = ctx.thread.filter(|_| shape.thread_root) {
                            let th = defs.thread(thread);
                            // Names from the spool: control characters escaped, as in
                            // `info` (collapsed lines and pprof strings reach terminals).
                            let name = crate::display::escape(&th.name);
                            let f = sym.function_id(format!("{name} (tid {})", th.tid), ROOT_MODULE.into());
                            n = t.child(n, f);
                        }
                        roots.insert(c, n);
                        n
                    }
                };
            }
            for &id in path.iter().rev() {
                let frame = defs.stack(id).frame;
                let r = sym.resolve(defs, frame, &ctx);
                let groupable =
                    !shape.split_unknown && !r.named && matches!(defs.frame(frame), Frame::Module { .. });
                if groupable {
                    let f = r.outer().func;
                    let g = match unknown_of.get(&f) {
                        Some(&g) => g,
                        None => {
                            let module = sym.function(f).module.clone();
                            let name = if shape.by_name {
                                format!("{UNKNOWN} ({module})")
                            } else {
                                UNKNOWN.to_string()
                            };
                            let id = sym.function_id(name, module);
                            let g = canon(sym, id);
                            unknown_of.insert(f, g);
                            g
                        }
                    };
                    // Consecutive frames of one module's unknown code are one frame.
                    if node == NO_NODE || t.nodes[node as usize].1 != g {
                        node = t.child(node, g);
                    }
                } else if shape.inlines {
                    for f in r.frames.iter().rev() {
                        node = t.child(node, canon(sym, f.func));
                    }
                } else {
                    node = t.child(node, canon(sym, r.outer().func));
                }
                placed.insert((c, id), node);
            }
            if node != NO_NODE {
                // (Saturating: a spool's weights are untrusted.)
                t.self_count[node as usize] = t.self_count[node as usize].saturating_add(count);
            }
        }
        t
    }

    fn child(&mut self, parent: u32, func: u32) -> u32 {
        let next = self.nodes.len() as u32;
        let n = *self.index.entry((parent, func)).or_insert(next);
        if n == next {
            self.nodes.push((parent, func));
            self.self_count.push(0);
        }
        n
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the tree has no node.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Samples in each node's subtree.
    fn subtree_counts(&self) -> Vec<u64> {
        let mut sub = self.self_count.clone();
        for n in (0..self.nodes.len()).rev() {
            let p = self.nodes[n].0;
            if p != NO_NODE {
                sub[p as usize] = sub[p as usize].saturating_add(sub[n]);
            }
        }
        sub
    }

    /// Children of every node (and the roots, last), sorted by function name
    /// then function id, as offsets into one array.
    fn children(&self, sym: &Symbolizer) -> (Vec<usize>, Vec<u32>) {
        let n = self.nodes.len();
        // Slot n holds the roots.
        let slot = |p: u32| if p == NO_NODE { n } else { p as usize };
        let mut start = vec![0usize; n + 2];
        for &(p, _) in &self.nodes {
            start[slot(p) + 1] += 1;
        }
        for i in 0..=n {
            start[i + 1] += start[i];
        }
        let mut fill = start.clone();
        let mut kids = vec![0u32; n];
        for (i, &(p, _)) in self.nodes.iter().enumerate() {
            kids[fill[slot(p)]] = i as u32;
            fill[slot(p)] += 1;
        }
        for s in 0..=n {
            kids[start[s]..start[s + 1]].sort_by(|&a, &b| {
                let (fa, fb) = (self.nodes[a as usize].1, self.nodes[b as usize].1);
                sym.function(fa).name.cmp(&sym.function(fb).name).then(fa.cmp(&fb))
            });
        }
        (start, kids)
    }

    /// Visit the nodes depth-first (children in name order): `visit(Some((node,
    /// function)))` on the way down and `visit(None)` on the way up.
    fn walk<V>(&self, sym: &Symbolizer, mut visit: V) -> std::io::Result<()>
    where
        V: FnMut(Option<(u32, u32)>) -> std::io::Result<()>,
    {
        let n = self.nodes.len();
        let (start, kids) = self.children(sym);
        // (node, next child position); the roots' pseudo node is `n`.
        let mut stack: Vec<(usize, usize)> = vec![(n, start[n])];
        while let Some(top) = stack.last_mut() {
            let (node, pos) = *top;
            if pos < start[node + 1] {
                top.1 += 1;
                let k = kids[pos];
                visit(Some((k, self.nodes[k as usize].1)))?;
                stack.push((k as usize, start[k as usize]));
            } else {
                stack.pop();
                if node != n {
                    visit(None)?;
                }
            }
        }
        Ok(())
    }

    /// Self and total counts per function, hottest (by self, then total, then
    /// name) first. Each node is visited once.
    pub fn function_stats(&self, sym: &Symbolizer) -> Vec<FunctionStats> {
        let sub = self.subtree_counts();
        let mut stats: HashMap<u32, (u64, u64)> = HashMap::new();
        // How many nodes of each function are on the current path: a node adds
        // its subtree to its function's total only when no ancestor already did
        // (recursion counts a sample once).
        let mut active: HashMap<u32, u32> = HashMap::new();
        let mut path: Vec<u32> = Vec::new();
        let walked = self.walk(sym, |v| {
            match v {
                Some((node, func)) => {
                    let e = stats.entry(func).or_default();
                    e.0 = e.0.saturating_add(self.self_count[node as usize]);
                    let a = active.entry(func).or_insert(0);
                    if *a == 0 {
                        e.1 = e.1.saturating_add(sub[node as usize]);
                    }
                    *a += 1;
                    path.push(func);
                }
                None => {
                    if let Some(a) = path.pop().and_then(|f| active.get_mut(&f)) {
                        *a -= 1;
                    }
                }
            }
            Ok(())
        });
        walked.expect("the visitors do not fail");
        let mut out: Vec<FunctionStats> = stats
            .into_iter()
            .map(|(func, (s, t))| FunctionStats { func, self_samples: s, total_samples: t })
            .collect();
        out.sort_by(|a, b| {
            b.self_samples
                .cmp(&a.self_samples)
                .then(b.total_samples.cmp(&a.total_samples))
                .then_with(|| sym.function(a.func).name.cmp(&sym.function(b.func).name))
                .then(a.func.cmp(&b.func))
        });
        out
    }

    /// Write every node with samples of its own as a folded line
    /// (`root;...;leaf count`), depth-first with children in name order.
    /// Memory beyond the tree is one line.
    pub fn write_folded(&self, sym: &Symbolizer, out: &mut dyn Write) -> std::io::Result<()> {
        let mut line = String::new();
        let mut ends: Vec<usize> = Vec::new();
        // Sibling names that differ only in characters a folded line cannot
        // hold (`;`, line breaks) give the same text: merge consecutive equal
        // lines.
        let mut pending: Option<(String, u64)> = None;
        self.walk(sym, |v| match v {
            Some((node, func)) => {
                ends.push(line.len());
                if !line.is_empty() {
                    line.push(';');
                }
                line.push_str(&folded_name(&sym.function(func).name));
                let n = self.self_count[node as usize];
                if n > 0 {
                    match &mut pending {
                        Some((text, count)) if *text == line => *count += n,
                        _ => {
                            if let Some((text, count)) = pending.take() {
                                writeln!(out, "{text} {count}")?;
                            }
                            pending = Some((line.clone(), n));
                        }
                    }
                }
                Ok(())
            }
            None => {
                line.truncate(ends.pop().unwrap_or(0));
                Ok(())
            }
        })?;
        if let Some((text, count)) = pending {
            writeln!(out, "{text} {count}")?;
        }
        Ok(())
    }

    /// Folded lines for a flame graph, within `budget` bytes of text. Nodes
    /// are taken widest first (a parent is never narrower than its child, so
    /// it is taken first) while their line fits the budget, and only when at
    /// least `min_fraction` of all samples wide (a flame graph draws nothing
    /// narrower anyway). The samples of a node not taken are given to its
    /// nearest taken ancestor (or to an `[other]` root), so the total stays.
    pub fn folded_lines_within(
        &self,
        sym: &Symbolizer,
        min_fraction: f64,
        budget: usize,
    ) -> Vec<(String, u64)> {
        let n = self.nodes.len();
        let sub = self.subtree_counts();
        let total: u64 = self.self_count.iter().sum();
        let min = ((total as f64 * min_fraction).ceil() as u64).max(1);
        // Length of each node's line text (parents come first in index order).
        let mut cost = vec![0usize; n];
        for i in 0..n {
            let (p, f) = self.nodes[i];
            let name = folded_name(&sym.function(f).name).len();
            cost[i] = if p == NO_NODE { name } else { cost[p as usize] + 1 + name };
        }
        let mut order: Vec<u32> = (0..n as u32).filter(|&i| sub[i as usize] >= min).collect();
        order.sort_by(|&a, &b| sub[b as usize].cmp(&sub[a as usize]).then(a.cmp(&b)));
        let mut taken = vec![false; n];
        let mut used = 0usize;
        for &i in &order {
            let i = i as usize;
            let p = self.nodes[i].0;
            if p != NO_NODE && !taken[p as usize] {
                continue;
            }
            used += cost[i] + FOLDED_LINE_EXTRA;
            if used > budget {
                break;
            }
            taken[i] = true;
        }
        let mut lines: Vec<(String, u64)> = Vec::new();
        let mut other = 0u64;
        let mut line = String::new();
        let mut ends: Vec<usize> = Vec::new();
        // Per open node: the index in `lines` of its nearest taken ancestor-or-self.
        let mut owner: Vec<Option<usize>> = Vec::new();
        let walked = self.walk(sym, |v| match v {
            Some((node, func)) => {
                let own = self.self_count[node as usize];
                ends.push(line.len());
                if taken[node as usize] {
                    if !line.is_empty() {
                        line.push(';');
                    }
                    line.push_str(&folded_name(&sym.function(func).name));
                    lines.push((line.clone(), own));
                    owner.push(Some(lines.len() - 1));
                } else {
                    let o = owner.last().copied().flatten();
                    match o {
                        Some(i) => lines[i].1 += own,
                        None => other += own,
                    }
                    owner.push(o);
                }
                Ok(())
            }
            None => {
                owner.pop();
                line.truncate(ends.pop().unwrap_or(0));
                Ok(())
            }
        });
        walked.expect("the visitors do not fail");
        if other > 0 {
            lines.push(("[other]".to_string(), other));
        }
        lines.retain(|l| l.1 > 0);
        lines
    }
}

/// The root frame of a process: `program (pid N)`, the program being the file
/// name of its executable (see [`crate::processes::program_module`]), else
/// its main thread's name.
fn process_root_name(defs: &Definitions, pid: u32) -> String {
    let program = match crate::processes::program_module(defs, pid) {
        Some(m) => m.path().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        None => defs
            .threads()
            .iter()
            .rev()
            .find(|t| t.pid == pid && t.tid == pid)
            .map(|t| t.name.clone())
            .unwrap_or_default(),
    };
    if program.is_empty() {
        format!("[process] (pid {pid})")
    } else {
        format!("{} (pid {pid})", crate::display::escape(&program))
    }
}

/// Self and total counts per function, hottest (by self, then total) first,
/// with inlined functions folded into their callers and the unsymbolized code
/// of each module one function.
pub fn top(defs: &Definitions, agg: &Aggregate, sym: &mut Symbolizer) -> Vec<FunctionStats> {
    top_with(defs, agg, sym, Shape::default())
}

/// [`top`] with the functions `shape` says (inlined functions as functions of
/// their own, unsymbolized addresses split).
pub fn top_with(
    defs: &Definitions,
    agg: &Aggregate,
    sym: &mut Symbolizer,
    shape: Shape,
) -> Vec<FunctionStats> {
    CallTree::build_shaped(defs, agg, sym, Shape { by_name: false, ..shape }).function_stats(sym)
}

/// Make a function name safe for one field of a folded line.
fn folded_name(name: &str) -> Cow<'_, str> {
    let name = if name.contains([';', '\n', '\r']) {
        Cow::Owned(name.replace(';', ":").replace(['\n', '\r'], " "))
    } else {
        Cow::Borrowed(name)
    };
    // Other control characters (ESC, BEL, C1) escaped as `info` shows them:
    // folded lines are read on terminals.
    match crate::display::escape(&name) {
        Cow::Borrowed(_) => name,
        Cow::Owned(escaped) => Cow::Owned(escaped),
    }
}

/// Write folded stacks (inlined functions expanded, root frames and
/// unsymbolized code as `shape` says): one `root;...;leaf count` line per
/// distinct symbolized stack, depth-first in name order.
pub fn write_folded(
    defs: &Definitions,
    agg: &Aggregate,
    sym: &mut Symbolizer,
    shape: Shape,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    CallTree::build_shaped(defs, agg, sym, Shape { inlines: true, by_name: true, ..shape })
        .write_folded(sym, out)
}
