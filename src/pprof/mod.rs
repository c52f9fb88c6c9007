//! The pprof encoder (cargo feature `pprof`): a gzipped `profile.proto`
//! (its messages in [`proto`], defined with prost derive macros, field
//! numbers from pprof's `profile.proto`). `spulse export --format pprof` and the `http`
//! endpoint both write through [`write()`].
//!
//! One pprof sample per distinct (context, stack) of the [`Counts`]; when the
//! context names a thread, labelled `pid`, `tid` and `thread` (name) (value 0:
//! sample count, value 1: CPU nanoseconds = count × interval). Every module
//! becomes a `Mapping` with its address range, file offset, path and build id;
//! every frame a `Location` with its absolute address, so the file can be
//! re-symbolized. Resolved frames carry
//! `Line`s (inlined functions first, the containing function last, as pprof
//! expects); frames of modules that could not be symbolized carry none. A
//! `Function`'s `system_name` is its linkage (mangled) name, or empty when it
//! has none (perf-map and unresolved names) or it equals the display name.
//!
//! Memory is bounded by the distinct frames and stacks: the tables are built
//! first, then the samples are encoded and compressed one at a time (the
//! uncompressed output spells every distinct stack in full).

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::rc::Rc;

use flate2::write::GzEncoder;
use flate2::Compression;
use prost::Message;

use crate::symbolize::{Context, Symbolizer};
use crate::{Definitions, Frame, FrameId, StackId};

pub mod proto;
use proto::{Function, Label, Line, Location, Mapping, Profile, Sample, ValueType};

/// Nanoseconds per microsecond: spool times are microseconds, pprof's nanoseconds.
const NS_PER_US: i64 = 1000;

/// `us` microseconds in nanoseconds, as pprof's signed values: saturated at
/// `i64::MAX` (a spool's durations and interval are untrusted: a cast
/// turned the largest into negative times).
fn ns(us: u64) -> i64 {
    i64::try_from(us).unwrap_or(i64::MAX).saturating_mul(NS_PER_US)
}

#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Strings {
        let mut s = Strings::default();
        s.get("");
        s
    }
    fn get(&mut self, v: &str) -> i64 {
        if let Some(&i) = self.index.get(v) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(v.to_string());
        self.index.insert(v.to_string(), i);
        i
    }
}

/// Location key: the frame, and for absolute frames the process and whether
/// its perf map applies (their names depend on both).
type LocationKey = (FrameId, u32, bool);

fn location_key(defs: &Definitions, frame: FrameId, ctx: &Context) -> LocationKey {
    match defs.frame(frame) {
        Frame::Absolute { .. } => (frame, ctx.pid, ctx.perf_map_allowed),
        Frame::Module { .. } | Frame::Truncated | Frame::Label(_) => (frame, 0, false),
    }
}

/// Everything of the profile but its samples: built in a first pass over the
/// distinct stacks, so its size is bounded by the distinct frames.
struct Tables {
    p: Profile,
    strings: Strings,
    locations: HashMap<LocationKey, u64>,
    /// pprof function id by (function, linkage name).
    functions: HashMap<(u32, Option<Rc<str>>), u64>,
    mapping_named: Vec<bool>,
    mapping_lines: Vec<bool>,
    mapping_inline: Vec<bool>,
    /// See [`Head::trim_inlined`].
    trim_inlined: Option<fn(&str) -> bool>,
}

impl Tables {
    fn location(&mut self, defs: &Definitions, sym: &mut Symbolizer, frame: FrameId, ctx: &Context) {
        let key = location_key(defs, frame, ctx);
        if self.locations.contains_key(&key) {
            return;
        }
        let id = self.p.location.len() as u64 + 1;
        let r = sym.resolve(defs, frame, ctx);
        let (mapping_id, address) = match defs.frame(frame) {
            Frame::Module { module, file_relative } => {
                let i = module.index();
                if r.named {
                    self.mapping_named[i] = true;
                    self.mapping_lines[i] |= r.frames.iter().any(|f| f.line > 0);
                    self.mapping_inline[i] |= r.frames.len() > 1;
                }
                (i as u64 + 1, defs.module(module).absolute(file_relative).unwrap_or(0))
            }
            Frame::Absolute { address, .. } => (0, address),
            Frame::Truncated | Frame::Label(_) => (0, 0),
        };
        // Frames of unsymbolized modules stay bare so pprof tools can
        // symbolize them later through the mapping and its build id.
        let is_bare_module = matches!(defs.frame(frame), Frame::Module { .. }) && !r.named;
        let mut line = Vec::new();
        if !is_bare_module {
            // Inlined frames first: trim the innermost the head asks to drop,
            // keeping at least the containing function.
            let mut skip = 0;
            if let Some(trim) = self.trim_inlined {
                while skip + 1 < r.frames.len() && trim(&sym.function(r.frames[skip].func).name) {
                    skip += 1;
                }
            }
            for f in &r.frames[skip..] {
                let fnext = self.p.function.len() as u64 + 1;
                let fid = *self.functions.entry((f.func, f.linkage.clone())).or_insert_with(|| {
                    let func = sym.function(f.func);
                    let name = self.strings.get(&func.name);
                    // The linkage name, so that pprof neither re-demangles nor
                    // "simplifies" the display name (it strips `<...>` from a
                    // name equal to its system name, merging unrelated
                    // functions); empty when there is none or it is the
                    // display name itself (a C function's DWARF name).
                    let linkage = f.linkage.as_deref().filter(|l| *l != func.name);
                    let system_name = self.strings.get(linkage.unwrap_or(""));
                    let filename = self.strings.get(f.file.as_deref().unwrap_or(""));
                    self.p.function.push(Function { id: fnext, name, system_name, filename, start_line: 0 });
                    fnext
                });
                line.push(Line { function_id: fid, line: f.line as i64, column: 0 });
            }
        }
        self.p.location.push(Location { id, mapping_id, address, line, is_folded: false });
        self.locations.insert(key, id);
    }
}

/// What the profile covers: its start and duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// Start, unix microseconds (`time_nanos`).
    pub start_us: u64,
    /// Length in microseconds (`duration_nanos`).
    pub duration_us: u64,
}

/// Counted samples: the contexts they are symbolized in, and every
/// (context index, stack, count) with a non-zero count.
pub trait Counts {
    /// The contexts, indexed by the context indices of [`Counts::iter`].
    fn contexts(&self) -> &[Context];
    /// Every (context index, stack, count), in the order the samples are
    /// written (called twice; both calls must give the same sequence).
    fn iter(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_;
    /// Every (context index, stack, off-CPU microseconds) (FORMAT.md, tag 9),
    /// in a stable order; when there is any, the profile has a third sample
    /// type, `off-cpu` in nanoseconds (CPU samples carry 0 there, off-CPU
    /// samples 0 in the first two).
    fn off_cpu(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        std::iter::empty()
    }
}

/// Write the gzipped profile of `counts` (stacks of `defs`) covering
/// `window`, with `comment`. Locations, functions, mappings and strings are
/// built first (bounded by the distinct frames); the samples, one per distinct
/// (context, stack), are then encoded and compressed one at a time.
pub fn write(
    defs: &Definitions,
    counts: &impl Counts,
    window: Window,
    sym: &mut Symbolizer,
    comment: &str,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let period = ns(defs.interval_us());
    let head = Head {
        sample_types: &[("samples", "count"), ("cpu", "nanoseconds")],
        period_type: ("cpu", "nanoseconds"),
        period,
        trim_inlined: None,
    };
    let values = |n: u64| {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        vec![n, n.saturating_mul(period)]
    };
    write_with(defs, counts, &head, &values, window, sym, comment, out)
}

/// A profile's sample types and period (as (type, unit) pairs).
pub(crate) struct Head<'a> {
    pub sample_types: &'a [(&'a str, &'a str)],
    pub period_type: (&'a str, &'a str),
    pub period: i64,
    /// Inlined functions to leave out of a location's lines when they are
    /// its innermost (the containing function always stays).
    pub trim_inlined: Option<fn(&str) -> bool>,
}

/// [`write`] with other sample types: a sample's values are `values(count)`
/// for each (context, stack, count) of `counts`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_with(
    defs: &Definitions,
    counts: &impl Counts,
    head: &Head<'_>,
    values: &dyn Fn(u64) -> Vec<i64>,
    window: Window,
    sym: &mut Symbolizer,
    comment: &str,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let contexts = counts.contexts();
    let mut strings = Strings::new();
    // Off-CPU intervals (FORMAT.md, tag 9), when there are any, add a sample
    // type after the head's: off-CPU time in nanoseconds.
    let has_off_cpu = counts.off_cpu().next().is_some();
    let mut sample_type: Vec<ValueType> = head
        .sample_types
        .iter()
        .map(|(t, u)| ValueType { r#type: strings.get(t), unit: strings.get(u) })
        .collect();
    if has_off_cpu {
        sample_type.push(ValueType { r#type: strings.get("off-cpu"), unit: strings.get("nanoseconds") });
    }
    let head_types = head.sample_types.len();
    let mut p = Profile {
        sample_type,
        period_type: Some(ValueType {
            r#type: strings.get(head.period_type.0),
            unit: strings.get(head.period_type.1),
        }),
        period: head.period,
        time_nanos: ns(window.start_us),
        duration_nanos: ns(window.duration_us),
        ..Default::default()
    };
    p.comment.push(strings.get(comment));
    let n = defs.modules().len();
    let mut t = Tables {
        p,
        strings,
        locations: HashMap::new(),
        functions: HashMap::new(),
        mapping_named: vec![false; n],
        mapping_lines: vec![false; n],
        mapping_inline: vec![false; n],
        trim_inlined: head.trim_inlined,
    };

    // Pass 1: every location of every stack. A stack prefix already seen with
    // the same location keys is not walked again.
    let mut seen: HashSet<(StackId, u32, bool)> = HashSet::new();
    for (c, stack, _) in counts.iter().chain(counts.off_cpu()) {
        let ctx = contexts[c];
        let mut cur = Some(stack);
        while let Some(id) = cur {
            if !seen.insert((id, ctx.pid, ctx.perf_map_allowed)) {
                break;
            }
            let s = defs.stack(id);
            t.location(defs, sym, s.frame, &ctx);
            cur = s.parent;
        }
        if let Some(th) = ctx.thread {
            let th = defs.thread(th);
            for k in ["pid", "tid", "thread"] {
                t.strings.get(k);
            }
            t.strings.get(&th.name);
        }
    }
    for m in defs.modules() {
        let i = m.id.index();
        let mapping = Mapping {
            id: i as u64 + 1,
            memory_start: m.start,
            memory_limit: m.end(),
            file_offset: m.file_offset,
            filename: t.strings.get(&String::from_utf8_lossy(&m.path)),
            build_id: t.strings.get(&m.build_id_hex()),
            has_functions: t.mapping_named[i],
            has_filenames: t.mapping_lines[i],
            has_line_numbers: t.mapping_lines[i],
            has_inline_frames: t.mapping_inline[i],
        };
        t.p.mapping.push(mapping);
    }
    // pprof takes the first mapping for the main binary (`File:` in its
    // reports, and the binary it symbolizes first): the executable of the
    // process with the most samples, not the first process's (a shell or
    // `env` in a recorded tree).
    let mut per_pid: HashMap<u32, u64> = HashMap::new();
    for (c, _, n) in counts.iter() {
        *per_pid.entry(contexts[c].pid).or_insert(0) += n;
    }
    let busiest = per_pid.into_iter().max_by_key(|&(pid, n)| (n, std::cmp::Reverse(pid))).map(|(pid, _)| pid);
    if let Some(exe) = busiest.and_then(|pid| defs.executable_of(pid)) {
        let i = exe.id.index();
        if i < t.p.mapping.len() {
            let main = t.p.mapping.remove(i);
            t.p.mapping.insert(0, main);
        }
    }
    let Tables { mut p, strings, locations, .. } = t;
    p.string_table = strings.table;
    let string_index = strings.index;
    let str_id = |s: &str| string_index.get(s).copied().unwrap_or(0);

    let mut gz = GzEncoder::new(out, Compression::default());
    // A protobuf message is the concatenation of its fields in any order:
    // the tables first, then each sample as one more `sample` field.
    gz.write_all(&p.encode_to_vec())?;
    let mut buf = Vec::new();
    let mut ids = Vec::new();
    let cpu = counts.iter().map(|(c, s, n)| (c, s, n, false));
    let off = counts.off_cpu().map(|(c, s, n)| (c, s, n, true));
    for (c, stack, count, is_off) in cpu.chain(off) {
        let ctx = contexts[c];
        ids.clear();
        ids.extend(defs.stack_frames(stack).map(|f| locations[&location_key(defs, f, &ctx)]));
        let mut label = Vec::new();
        if let Some(t) = ctx.thread {
            let t = defs.thread(t);
            label.push(Label { key: str_id("pid"), num: t.pid as i64, ..Default::default() });
            label.push(Label { key: str_id("tid"), num: t.tid as i64, ..Default::default() });
            if !t.name.is_empty() {
                label.push(Label { key: str_id("thread"), str: str_id(&t.name), ..Default::default() });
            }
        }
        let value = if is_off {
            let mut v = vec![0; head_types];
            v.push(ns(count));
            v
        } else {
            let mut v = values(count);
            if has_off_cpu {
                v.push(0);
            }
            v
        };
        let sample = Sample { location_id: std::mem::take(&mut ids), value, label };
        buf.clear();
        prost::encoding::message::encode(2, &sample, &mut buf);
        gz.write_all(&buf)?;
        ids = sample.location_id;
    }
    gz.finish()?;
    Ok(())
}
