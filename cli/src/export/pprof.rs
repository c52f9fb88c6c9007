//! pprof export: a gzipped `profile.proto` (messages defined here with prost
//! derive macros, field numbers from pprof's `profile.proto`).
//!
//! Samples are per distinct (thread, stack) when the aggregation is per thread,
//! labelled `pid`, `tid` and `thread` (name), else per distinct stack (value 0:
//! sample count, value 1: CPU nanoseconds = count × interval). Every module
//! becomes a `Mapping` with its address range, file offset, path and build id;
//! every frame a `Location` with its absolute address, so the file can be
//! re-symbolized. Resolved frames carry
//! `Line`s (inlined functions first, the containing function last, as pprof
//! expects); frames of modules that could not be symbolized carry none.

use std::collections::HashMap;
use std::io::Write;

use flate2::write::GzEncoder;
use flate2::Compression;
use prost::Message;
use spulse::{Definitions, Frame, FrameId};

use crate::aggregate::Aggregate;
use crate::symbolize::Symbolizer;

/// `perftools.profiles.Profile`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Profile {
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    #[prost(int64, tag = "7")]
    pub drop_frames: i64,
    #[prost(int64, tag = "8")]
    pub keep_frames: i64,
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    pub period: i64,
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
}

/// `ValueType`: indices into the string table.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

/// `Sample`: locations leaf first.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    pub label: Vec<Label>,
}

/// `Label`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Label {
    #[prost(int64, tag = "1")]
    pub key: i64,
    #[prost(int64, tag = "2")]
    pub str: i64,
    #[prost(int64, tag = "3")]
    pub num: i64,
    #[prost(int64, tag = "4")]
    pub num_unit: i64,
}

/// `Mapping`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Mapping {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    #[prost(int64, tag = "5")]
    pub filename: i64,
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

/// `Location`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Location {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    #[prost(uint64, tag = "3")]
    pub address: u64,
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
    #[prost(bool, tag = "5")]
    pub is_folded: bool,
}

/// `Line`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Line {
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    #[prost(int64, tag = "2")]
    pub line: i64,
    #[prost(int64, tag = "3")]
    pub column: i64,
}

/// `Function`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(int64, tag = "2")]
    pub name: i64,
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    #[prost(int64, tag = "4")]
    pub filename: i64,
    #[prost(int64, tag = "5")]
    pub start_line: i64,
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

/// Build the profile (not yet encoded).
pub fn build(defs: &Definitions, agg: &Aggregate, sym: &mut Symbolizer, comment: &str) -> Profile {
    let mut strings = Strings::new();
    let mut p = Profile {
        sample_type: vec![
            ValueType { r#type: strings.get("samples"), unit: strings.get("count") },
            ValueType { r#type: strings.get("cpu"), unit: strings.get("nanoseconds") },
        ],
        period_type: Some(ValueType { r#type: strings.get("cpu"), unit: strings.get("nanoseconds") }),
        period: (defs.interval_us() as i64).saturating_mul(1000),
        time_nanos: (defs.start_time_us() as i64).saturating_mul(1000),
        duration_nanos: agg
            .time_range
            .map(|(_, last)| (last.saturating_sub(defs.start_time_us()) as i64).saturating_mul(1000))
            .unwrap_or(0),
        ..Default::default()
    };
    p.comment.push(strings.get(comment));

    // One mapping per module (ids: module id + 1).
    let mut mapping_named = vec![false; defs.modules().len()];
    let mut mapping_lines = vec![false; defs.modules().len()];
    let mut mapping_inline = vec![false; defs.modules().len()];
    let mut locations: HashMap<(FrameId, u32, bool), u64> = HashMap::new();
    let mut functions: HashMap<u32, u64> = HashMap::new();
    let period = p.period;
    for (c, stack, count) in agg.iter() {
        let ctx = agg.contexts[c];
        let mut ids = Vec::with_capacity(defs.stack_depth(stack));
        for frame in defs.stack_frames(stack) {
            let (pid, allowed) = match defs.frame(frame) {
                Frame::Module { .. } => (0, false),
                Frame::Absolute { .. } => (ctx.pid, ctx.perf_map_allowed),
                Frame::Truncated => (0, false),
            };
            let next = p.location.len() as u64 + 1;
            let id = *locations.entry((frame, pid, allowed)).or_insert_with(|| {
                let r = sym.resolve(defs, frame, &ctx);
                let (mapping_id, address) = match defs.frame(frame) {
                    Frame::Module { module, file_relative } => {
                        let i = module.index();
                        if r.named {
                            mapping_named[i] = true;
                            mapping_lines[i] |= r.frames.iter().any(|f| f.line > 0);
                            mapping_inline[i] |= r.frames.len() > 1;
                        }
                        (i as u64 + 1, defs.module(module).absolute(file_relative).unwrap_or(0))
                    }
                    Frame::Absolute { address, .. } => (0, address),
                    Frame::Truncated => (0, 0),
                };
                // Frames of unsymbolized modules stay bare so pprof tools can
                // symbolize them later through the mapping and its build id.
                let is_bare_module = matches!(defs.frame(frame), Frame::Module { .. }) && !r.named;
                let mut line = Vec::new();
                if !is_bare_module {
                    for f in &r.frames {
                        let fnext = p.function.len() as u64 + 1;
                        let fid = *functions.entry(f.func).or_insert_with(|| {
                            let func = sym.function(f.func);
                            let name = strings.get(&func.name);
                            let filename = strings.get(f.file.as_deref().unwrap_or(""));
                            p.function.push(Function {
                                id: fnext,
                                name,
                                system_name: name,
                                filename,
                                start_line: 0,
                            });
                            fnext
                        });
                        line.push(Line { function_id: fid, line: f.line as i64, column: 0 });
                    }
                }
                p.location.push(Location { id: next, mapping_id, address, line, is_folded: false });
                next
            });
            ids.push(id);
        }
        let n = count as i64;
        let mut label = Vec::new();
        if let Some(t) = ctx.thread {
            let t = defs.thread(t);
            label.push(Label { key: strings.get("pid"), num: t.pid as i64, ..Default::default() });
            label.push(Label { key: strings.get("tid"), num: t.tid as i64, ..Default::default() });
            if !t.name.is_empty() {
                label.push(Label {
                    key: strings.get("thread"),
                    str: strings.get(&t.name),
                    ..Default::default()
                });
            }
        }
        p.sample.push(Sample { location_id: ids, value: vec![n, n.saturating_mul(period)], label });
    }
    for m in defs.modules() {
        let i = m.id.index();
        p.mapping.push(Mapping {
            id: i as u64 + 1,
            memory_start: m.start,
            memory_limit: m.end(),
            file_offset: m.file_offset,
            filename: strings.get(&String::from_utf8_lossy(&m.path)),
            build_id: strings.get(&m.build_id_hex()),
            has_functions: mapping_named[i],
            has_filenames: mapping_lines[i],
            has_line_numbers: mapping_lines[i],
            has_inline_frames: mapping_inline[i],
        });
    }
    p.string_table = strings.table;
    p
}

/// Write the gzipped profile.
pub fn write(
    defs: &Definitions,
    agg: &Aggregate,
    sym: &mut Symbolizer,
    comment: &str,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    let profile = build(defs, agg, sym, comment);
    let bytes = profile.encode_to_vec();
    let mut gz = GzEncoder::new(out, Compression::default());
    gz.write_all(&bytes)?;
    gz.finish()?;
    Ok(())
}
