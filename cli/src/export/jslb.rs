//! Firefox Profiler export in the JsonSlabs (JSLB) container: `.jslb`, and
//! `.jslb.gz` (the same bytes gzipped), written through the `json-slabs` crate.
//!
//! The profile is the one the JSON export builds ([`firefox::profile`],
//! processed format [`firefox::PROFILE_VERSION`]), brought to processed format
//! [`VERSION`] as the Firefox Profiler's own upgraders would bring it: one
//! string array and one stack, frame, function, resource and native-symbol
//! table shared by all threads (versions 56 and 60), a sources table in place
//! of the functions' file names (58, 61, 64), empty original-location columns
//! (64), stack prefixes as backward offsets (66) and each frame's library on
//! the frame table (70). Equal frames and stacks of different threads become
//! one, and a weight column of ones is left out (`null`: every sample counts
//! 1), which the JSON export does not do (an `--off-cpu` or `--wall`
//! profile's weights are milliseconds, [`firefox`], and kept). The profiler accepts typed arrays
//! only in the columns and versions that say so (65 to 70), hence the newer
//! version here.
//!
//! Columns the profiler accepts as typed arrays are binary slabs: the stack
//! table's `frame` and `prefixOffset` (Int32); the frame table's `func`,
//! `address` (-1: none) and `lib` (-1: none) (Int32) and `inlineDepth`
//! (Uint8); the threads' sample `time` or `timeDeltas`, their allocation
//! `time`s and marker `startTime` and `endTime` (Float64, a marker's unused
//! `null` time as 0); counters' sample times (Float64). A column with a value
//! its type cannot hold (an address past 2^31 - 1) stays a JSON array, which
//! the profiler also accepts. Every other column of scalars that takes at
//! least [`SPLIT_BYTES`] of JSON (sample stacks, weights and CPU deltas, the
//! string array, the frame and function tables' other columns) is a JSON slab
//! of its own, so the root JSON, the skeleton, holds the profile's structure,
//! metadata and small columns only, and every placeholder in it refers to a
//! slab that holds no placeholders itself.

use std::collections::HashMap;
use std::io::Write;

use flate2::write::GzEncoder;
use json_slabs::{Builder, SlabPlaceholder, SlabPrimitive, SLAB_REF_KEY};
use serde_json::{Map, Value};

use super::{firefox, Job};
use crate::symbolize::Symbolizer;
use crate::CliError;

/// The processed-profile format version the container holds.
pub const VERSION: u64 = 70;

/// Columns of scalars with at least this many bytes of JSON get a JSON slab of
/// their own; smaller ones stay in the skeleton (a slab costs a table entry
/// and a parse call of its own).
pub const SPLIT_BYTES: usize = 256;

/// Samples tables of at least this many samples are written as slabs
/// directly ([`Slabs::samples`]); each of their JSON columns takes at least
/// two bytes a sample, so [`SPLIT_BYTES`] would make slabs of them anyway.
const LARGE_SAMPLES: usize = SPLIT_BYTES / 2;

/// A `Vec<u8>` writer whose growth fails with an error (`OutOfMemory`)
/// instead of aborting the process.
struct TryVec(Vec<u8>);

impl Write for TryVec {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .try_reserve(buf.len())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e.to_string()))?;
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Whether `output` names a JSLB container (`.jslb` or `.jslb.gz`), and if so
/// whether it is gzipped.
pub fn container(output: &std::path::Path) -> Option<bool> {
    let name = output.file_name()?.to_string_lossy().to_ascii_lowercase();
    if name.ends_with(".jslb.gz") {
        Some(true)
    } else if name.ends_with(".jslb") {
        Some(false)
    } else {
        None
    }
}

/// Write the Firefox profile of the selected samples as a `.jslb` file.
pub fn export(job: &Job<'_>, sym: &mut Symbolizer, out: &mut dyn Write) -> Result<u64, CliError> {
    write(job, sym, out, false)
}

/// Write the Firefox profile of the selected samples as a `.jslb.gz` file.
pub fn export_gz(job: &Job<'_>, sym: &mut Symbolizer, out: &mut dyn Write) -> Result<u64, CliError> {
    write(job, sym, out, true)
}

fn write(job: &Job<'_>, sym: &mut Symbolizer, out: &mut dyn Write, gzip: bool) -> Result<u64, CliError> {
    let (doc, samples, selected) = firefox::profile(job, sym)?;
    let (mut doc, stack_maps) = upgrade_with_stacks(doc)
        .map_err(|e| CliError::other(format!("converting the Firefox profile to format {VERSION}: {e}")))?;
    let mut slabs = Slabs::default();
    slabs.samples(&mut doc, samples, &stack_maps)?;
    slabs.split(&mut doc);
    let root =
        serde_json::to_vec(&doc).map_err(|e| CliError::other(format!("serializing the profile: {e}")))?;
    let size = slabs.file_size(root.len());
    if size > u64::from(u32::MAX) {
        return Err(CliError::other(format!(
            "{}: the profile needs {size} bytes, and a JSLB file addresses its slabs with 32-bit \
             offsets (at most 4 GiB); export fewer samples (--from/--to, --thread) or write .json",
            job.output
        )));
    }
    if gzip {
        let mut gz = GzEncoder::new(&mut *out, flate2::Compression::default());
        slabs.builder.to_writer(&root, &mut gz).map_err(|e| job.write_error(e))?;
        gz.finish().map_err(|e| job.write_error(e))?;
    } else {
        slabs.builder.to_writer(&root, &mut &mut *out).map_err(|e| job.write_error(e))?;
    }
    Ok(selected)
}

/// The slabs added so far, and their sizes (to know the file's size before
/// writing it).
#[derive(Default)]
struct Slabs {
    builder: Builder<'static>,
    /// (alignment, byte length) of each added slab, in order.
    sizes: Vec<(u64, u64)>,
}

/// How a typed column's JSON values become slab elements.
#[derive(Clone, Copy)]
enum Typed {
    I32,
    U8,
    F64,
    /// Float64, `null` as 0 (marker times whose phase says they are unused).
    F64NullZero,
}

impl Slabs {
    /// The placeholder value of a slab.
    fn placeholder(p: SlabPlaceholder) -> Value {
        let mut m = Map::new();
        m.insert(SLAB_REF_KEY.to_string(), Value::from(p.index()));
        Value::Object(m)
    }

    fn add_typed<T: SlabPrimitive + 'static>(&mut self, values: Vec<T>) -> Value {
        let size = std::mem::size_of::<T>() as u64;
        self.sizes.push((size, size * values.len() as u64));
        Self::placeholder(self.builder.add_slab_from_vec(values))
    }

    /// Replace the array `v` with a typed slab if every value fits `ty`.
    fn typed(&mut self, v: &mut Value, ty: Typed) {
        let Some(a) = v.as_array() else { return };
        let slab = match ty {
            Typed::I32 => a
                .iter()
                .map(|x| x.as_i64().and_then(|n| i32::try_from(n).ok()))
                .collect::<Option<Vec<i32>>>()
                .map(|vals| self.add_typed(vals)),
            Typed::U8 => a
                .iter()
                .map(|x| x.as_u64().and_then(|n| u8::try_from(n).ok()))
                .collect::<Option<Vec<u8>>>()
                .map(|vals| self.add_typed(vals)),
            Typed::F64 | Typed::F64NullZero => {
                let null_zero = matches!(ty, Typed::F64NullZero);
                a.iter()
                    .map(|x| if x.is_null() && null_zero { Some(0.0) } else { x.as_f64() })
                    .collect::<Option<Vec<f64>>>()
                    .map(|vals| self.add_typed(vals))
            }
        };
        if let Some(p) = slab {
            *v = p;
        }
    }

    /// Write each thread's samples table into `doc` (whose threads' `samples`
    /// are `null`, in the order of `samples`), its stacks mapped to the
    /// shared stack table by `stack_maps`. A table of at least
    /// [`LARGE_SAMPLES`] samples gets its columns as slabs straight from
    /// `samples` (what [`split`](Self::split) would make of them, without
    /// the JSON values in between: a sample costs its bytes in the file);
    /// a smaller one is left as JSON arrays for `split`.
    fn samples(
        &mut self,
        doc: &mut Value,
        samples: firefox::Samples,
        stack_maps: &[Vec<usize>],
    ) -> Result<(), CliError> {
        let (cpu, time) = (samples.cpu_delta_us, samples.time);
        let threads =
            doc.get_mut("threads").and_then(Value::as_array_mut).map(Vec::as_mut_slice).unwrap_or(&mut []);
        for ((th, ts), map) in threads.iter_mut().zip(samples.threads).zip(stack_maps) {
            let n = ts.len();
            let stack = |i: usize| map.get(ts.stack[i] as usize).copied().unwrap_or(0);
            let mut table = Map::new();
            table.insert("length".into(), Value::from(n));
            table.insert("weightType".into(), Value::from(if time { "tracing-ms" } else { "samples" }));
            // Counting samples, every weight is 1, which no weight column
            // means (see `upgrade`); in time (`--off-cpu`, `--wall`) the
            // weights are milliseconds, and an off-CPU sample's CPU delta 0.
            table.insert("weight".into(), Value::Null);
            if n < LARGE_SAMPLES {
                table.insert("stack".into(), ts.in_order().map(stack).collect());
                table.insert("timeDeltas".into(), ts.time_deltas_ms().collect());
                table.insert("threadCPUDelta".into(), ts.cpu_deltas_us(cpu).collect());
                if time {
                    table.insert("weight".into(), ts.weights_ms(cpu).collect());
                }
            } else {
                let json = |v: &dyn Fn(&mut TryVec) -> serde_json::Result<()>| -> Result<Vec<u8>, CliError> {
                    let mut out = TryVec(Vec::new());
                    v(&mut out).map_err(|_| firefox::out_of_memory(n))?;
                    Ok(out.0)
                };
                let st = json(&|w| serde_json::to_writer(w, &firefox::Seq(|| ts.in_order().map(stack))))?;
                let cd = json(&|w| serde_json::to_writer(w, &firefox::Seq(|| ts.cpu_deltas_us(cpu))))?;
                if time {
                    let w = json(&|w| serde_json::to_writer(w, &firefox::Seq(|| ts.weights_ms(cpu))))?;
                    table.insert("weight".into(), self.add_json(w));
                }
                let mut deltas: Vec<f64> = Vec::new();
                deltas.try_reserve_exact(n).map_err(|_| firefox::out_of_memory(n))?;
                deltas.extend(ts.time_deltas_ms());
                drop(ts);
                table.insert("stack".into(), self.add_json(st));
                table.insert("timeDeltas".into(), self.add_typed(deltas));
                table.insert("threadCPUDelta".into(), self.add_json(cd));
            }
            if let Some(th) = th.as_object_mut() {
                th.insert("samples".into(), Value::Object(table));
            }
        }
        Ok(())
    }

    /// A JSON slab of `bytes`.
    fn add_json(&mut self, bytes: Vec<u8>) -> Value {
        self.sizes.push((1, bytes.len() as u64));
        Self::placeholder(self.builder.add_json_slab(bytes))
    }

    /// Put the typed columns in slabs, then every other large column of
    /// scalars in a JSON slab.
    fn split(&mut self, doc: &mut Value) {
        if let Some(shared) = doc.get_mut("shared") {
            if let Some(st) = shared.get_mut("stackTable") {
                self.column(st, "frame", Typed::I32);
                self.column(st, "prefixOffset", Typed::I32);
            }
            if let Some(ft) = shared.get_mut("frameTable") {
                self.column(ft, "func", Typed::I32);
                self.column(ft, "address", Typed::I32);
                self.column(ft, "lib", Typed::I32);
                self.column(ft, "inlineDepth", Typed::U8);
            }
        }
        for th in doc.get_mut("threads").and_then(Value::as_array_mut).into_iter().flatten() {
            if let Some(samples) = th.get_mut("samples") {
                self.column(samples, "time", Typed::F64);
                self.column(samples, "timeDeltas", Typed::F64);
            }
            if let Some(markers) = th.get_mut("markers") {
                self.column(markers, "startTime", Typed::F64NullZero);
                self.column(markers, "endTime", Typed::F64NullZero);
            }
            for alloc in ["jsAllocations", "nativeAllocations"] {
                if let Some(t) = th.get_mut(alloc) {
                    self.column(t, "time", Typed::F64);
                }
            }
        }
        for c in doc.get_mut("counters").and_then(Value::as_array_mut).into_iter().flatten() {
            if let Some(samples) = c.get_mut("samples") {
                self.column(samples, "time", Typed::F64);
                self.column(samples, "timeDeltas", Typed::F64);
            }
        }
        self.split_json(doc);
    }

    fn column(&mut self, table: &mut Value, key: &str, ty: Typed) {
        if let Some(v) = table.get_mut(key) {
            self.typed(v, ty);
        }
    }

    /// Move every array of scalars of at least [`SPLIT_BYTES`] of JSON into a
    /// JSON slab (placeholders are objects, so no JSON slab holds one).
    fn split_json(&mut self, v: &mut Value) {
        match v {
            Value::Object(m) => m.values_mut().for_each(|x| self.split_json(x)),
            Value::Array(a) if a.iter().any(|x| x.is_object() || x.is_array()) => {
                a.iter_mut().for_each(|x| self.split_json(x))
            }
            Value::Array(_) => {
                let bytes = serde_json::to_vec(v).unwrap_or_default();
                if bytes.len() >= SPLIT_BYTES {
                    *v = self.add_json(bytes);
                }
            }
            _ => {}
        }
    }

    /// The size of the file with this root JSON, laid out as `json-slabs`
    /// lays it out: a 20-byte header, a 12-byte table entry per slab (root
    /// included), then the root and each slab at its element alignment.
    fn file_size(&self, root: usize) -> u64 {
        let mut pos = 20 + 12 * (self.sizes.len() as u64 + 1) + root as u64;
        for &(align, len) in &self.sizes {
            pos = pos.div_ceil(align) * align + len;
        }
        pos
    }
}

/// A table of the processed format: named columns of `length` rows.
struct Table {
    cols: Map<String, Value>,
    len: usize,
}

impl Table {
    /// Take `key` of `obj` as a table whose columns all have its `length`.
    fn take(obj: &mut Map<String, Value>, key: &str) -> Result<Table, String> {
        let Some(Value::Object(cols)) = obj.remove(key) else { return Err(format!("no {key} table")) };
        let len = cols.get("length").and_then(Value::as_u64).ok_or(format!("{key} has no length"))? as usize;
        for (name, c) in &cols {
            if let Value::Array(a) = c {
                if a.len() != len {
                    return Err(format!("{key}.{name} has {} rows, not {len}", a.len()));
                }
            }
        }
        Ok(Table { cols, len })
    }

    /// Row `i` of column `key` (`null` if the column is absent).
    fn get(&self, key: &str, i: usize) -> &Value {
        self.cols.get(key).and_then(|c| c.get(i)).unwrap_or(&Value::Null)
    }
}

/// An index into another table.
fn index(v: &Value, what: &str, len: usize) -> Result<usize, String> {
    v.as_u64()
        .map(|n| n as usize)
        .filter(|&n| n < len)
        .ok_or_else(|| format!("{what} {v} out of range ({len})"))
}

/// A table being built: columns by name, in a fixed order.
struct NewTable {
    names: &'static [&'static str],
    cols: Vec<Vec<Value>>,
    len: usize,
}

impl NewTable {
    fn new(names: &'static [&'static str]) -> NewTable {
        NewTable { names, cols: vec![Vec::new(); names.len()], len: 0 }
    }

    fn push(&mut self, row: Vec<Value>) -> usize {
        debug_assert_eq!(row.len(), self.names.len());
        for (c, v) in self.cols.iter_mut().zip(row) {
            c.push(v);
        }
        self.len += 1;
        self.len - 1
    }

    fn col(&self, name: &str) -> &[Value] {
        let i = self.names.iter().position(|n| *n == name).unwrap_or(0);
        &self.cols[i]
    }

    fn into_value(self, skip: &[&str]) -> Value {
        let mut m = Map::new();
        for (name, c) in self.names.iter().zip(self.cols) {
            if !skip.contains(name) {
                m.insert(name.to_string(), Value::Array(c));
            }
        }
        m.insert("length".into(), Value::from(self.len));
        Value::Object(m)
    }
}

/// A table being built whose rows are deduplicated by a key.
struct DedupTable {
    table: NewTable,
    index: HashMap<String, usize>,
}

impl DedupTable {
    fn new(names: &'static [&'static str]) -> DedupTable {
        DedupTable { table: NewTable::new(names), index: HashMap::new() }
    }

    /// The index of the row `row`, added if no row has the same `key`.
    fn intern(&mut self, key: String, row: Vec<Value>) -> usize {
        if let Some(&i) = self.index.get(&key) {
            return i;
        }
        let i = self.table.push(row);
        self.index.insert(key, i);
        i
    }
}

/// The key of a row: its values as JSON, separated.
fn key(values: &[&Value]) -> String {
    let mut k = String::new();
    for v in values {
        k.push_str(&v.to_string());
        k.push('\u{0}');
    }
    k
}

const FRAME_COLS: &[&str] = &[
    "address",
    "inlineDepth",
    "category",
    "subcategory",
    "func",
    "nativeSymbol",
    "innerWindowID",
    "line",
    "column",
];
const FUNC_COLS: &[&str] =
    &["name", "isJS", "relevantForJS", "resource", "source", "lineNumber", "columnNumber"];
const RESOURCE_COLS: &[&str] = &["lib", "name", "host", "type"];
const NATIVE_COLS: &[&str] = &["libIndex", "address", "name", "functionSize"];

/// Bring a processed profile of format [`firefox::PROFILE_VERSION`] (the
/// layout `fxprof-processed-profile` writes, as filled in by the JSON export)
/// to format [`VERSION`]. Tables are merged as the profiler's version-60
/// upgrader merges them, functions, resources and native symbols
/// deduplicated, and frames and stacks deduplicated as well (the threads of a
/// process share most of them).
pub fn upgrade(doc: Value) -> Result<Value, String> {
    upgrade_with_stacks(doc).map(|(doc, _)| doc)
}

/// [`upgrade`], and for each thread the index in the shared stack table of
/// each of its own stacks (for samples kept out of the document).
fn upgrade_with_stacks(mut doc: Value) -> Result<(Value, Vec<Vec<usize>>), String> {
    let mut stack_maps = Vec::new();
    let version = doc.pointer("/meta/preprocessedProfileVersion").and_then(Value::as_u64);
    if version != Some(firefox::PROFILE_VERSION) {
        return Err(format!("the profile is format {version:?}, not {}", firefox::PROFILE_VERSION));
    }
    let mut strings: Vec<Value> = Vec::new();
    let mut string_index: HashMap<String, usize> = HashMap::new();
    let mut sources: Vec<Value> = Vec::new();
    let mut source_index: HashMap<usize, usize> = HashMap::new();
    let mut frames = DedupTable::new(FRAME_COLS);
    let mut stack_frame: Vec<Value> = Vec::new();
    let mut stack_prefix_offset: Vec<Value> = Vec::new();
    let mut stack_index: HashMap<(usize, Option<usize>), usize> = HashMap::new();
    let mut funcs = DedupTable::new(FUNC_COLS);
    let mut resources = DedupTable::new(RESOURCE_COLS);
    let mut natives = DedupTable::new(NATIVE_COLS);

    let threads = doc.get_mut("threads").and_then(Value::as_array_mut).ok_or("no threads")?;
    for (ti, th) in threads.iter_mut().enumerate() {
        let th = th.as_object_mut().ok_or(format!("thread {ti} is not an object"))?;
        let in_thread = |e: String| format!("thread {ti}: {e}");
        // Strings: the thread's index -> the shared array's.
        let Some(Value::Array(own)) = th.remove("stringArray") else {
            return Err(in_thread("no stringArray".into()));
        };
        let smap: Vec<usize> = own
            .iter()
            .map(|s| {
                let s = s.as_str().unwrap_or_default();
                *string_index.entry(s.to_string()).or_insert_with(|| {
                    strings.push(Value::from(s));
                    strings.len() - 1
                })
            })
            .collect();
        let string = |v: &Value| -> Result<Value, String> {
            if v.is_null() {
                return Ok(Value::Null);
            }
            Ok(Value::from(smap[index(v, "string", smap.len()).map_err(in_thread)?]))
        };

        let ns = Table::take(th, "nativeSymbols").map_err(in_thread)?;
        let mut ns_map = Vec::with_capacity(ns.len);
        for i in 0..ns.len {
            let (lib, addr) = (ns.get("libIndex", i), ns.get("address", i));
            let row = vec![
                lib.clone(),
                addr.clone(),
                string(ns.get("name", i))?,
                ns.get("functionSize", i).clone(),
            ];
            ns_map.push(natives.intern(key(&[lib, addr]), row));
        }

        let rt = Table::take(th, "resourceTable").map_err(in_thread)?;
        let mut res_map = Vec::with_capacity(rt.len);
        for i in 0..rt.len {
            let row = vec![
                rt.get("lib", i).clone(),
                string(rt.get("name", i))?,
                string(rt.get("host", i))?,
                rt.get("type", i).clone(),
            ];
            res_map.push(resources.intern(key(&[&row[0], &row[1], &row[2], &row[3]]), row));
        }

        let ft_funcs = Table::take(th, "funcTable").map_err(in_thread)?;
        let mut func_map = Vec::with_capacity(ft_funcs.len);
        for i in 0..ft_funcs.len {
            let res = match ft_funcs.get("resource", i).as_i64() {
                Some(-1) => Value::from(-1),
                _ => Value::from(
                    res_map
                        [index(ft_funcs.get("resource", i), "resource", res_map.len()).map_err(in_thread)?],
                ),
            };
            let source = match string(ft_funcs.get("fileName", i))?.as_u64() {
                None => Value::Null,
                Some(file) => {
                    let file = file as usize;
                    Value::from(*source_index.entry(file).or_insert_with(|| {
                        sources.push(Value::from(file));
                        sources.len() - 1
                    }))
                }
            };
            let row = vec![
                string(ft_funcs.get("name", i))?,
                ft_funcs.get("isJS", i).clone(),
                ft_funcs.get("relevantForJS", i).clone(),
                res,
                source,
                ft_funcs.get("lineNumber", i).clone(),
                ft_funcs.get("columnNumber", i).clone(),
            ];
            let k = key(&row.iter().collect::<Vec<_>>());
            func_map.push(funcs.intern(k, row));
        }

        let ft = Table::take(th, "frameTable").map_err(in_thread)?;
        let mut frame_map = Vec::with_capacity(ft.len);
        for i in 0..ft.len {
            let mut row: Vec<Value> = FRAME_COLS.iter().map(|c| ft.get(c, i).clone()).collect();
            row[4] = Value::from(func_map[index(&row[4], "func", func_map.len()).map_err(in_thread)?]);
            if !row[5].is_null() {
                row[5] =
                    Value::from(ns_map[index(&row[5], "nativeSymbol", ns_map.len()).map_err(in_thread)?]);
            }
            if row[0].is_null() {
                row[0] = Value::from(-1);
            }
            let k = key(&row.iter().collect::<Vec<_>>());
            frame_map.push(frames.intern(k, row));
        }

        // A stack is its frame and its parent: equal stacks of different
        // threads become one. A parent comes before its children in the
        // thread's table, so it is in the shared table first and the offset
        // to it is positive.
        let st = Table::take(th, "stackTable").map_err(in_thread)?;
        let mut stack_map: Vec<usize> = Vec::with_capacity(st.len);
        for i in 0..st.len {
            let f = frame_map[index(st.get("frame", i), "frame", frame_map.len()).map_err(in_thread)?];
            let prefix = st.get("prefix", i);
            let parent = if prefix.is_null() {
                None
            } else {
                Some(stack_map[index(prefix, "stack prefix (a stack before it)", i).map_err(in_thread)?])
            };
            let next = stack_frame.len();
            let s = *stack_index.entry((f, parent)).or_insert_with(|| {
                stack_frame.push(Value::from(f));
                stack_prefix_offset.push(Value::from(parent.map_or(0, |p| next - p)));
                next
            });
            stack_map.push(s);
        }

        for t in ["samples", "jsAllocations", "nativeAllocations"] {
            let Some(stacks) = th.get_mut(t).and_then(|s| s.get_mut("stack")).and_then(Value::as_array_mut)
            else {
                continue;
            };
            for s in stacks {
                if !s.is_null() {
                    *s = Value::from(stack_map[index(s, "sample stack", st.len).map_err(in_thread)?]);
                }
            }
        }
        // A weight of 1 for every sample is what no weight column means.
        if let Some(samples) = th.get_mut("samples") {
            let ones = samples["weight"].as_array().is_some_and(|w| w.iter().all(|x| x.as_i64() == Some(1)));
            if ones {
                samples["weight"] = Value::Null;
            }
        }
        stack_maps.push(stack_map);
        // spulse writes no marker payloads; the names are string indexes.
        if let Some(names) =
            th.get_mut("markers").and_then(|m| m.get_mut("name")).and_then(Value::as_array_mut)
        {
            for n in names {
                *n = string(n)?;
            }
        }
    }

    // Each frame's library: its function's resource's (version 70).
    let res_lib = resources.table.col("lib").to_vec();
    let func_res = funcs.table.col("resource").to_vec();
    let lib: Vec<Value> = frames
        .table
        .col("func")
        .iter()
        .map(|f| {
            let r = f.as_u64().and_then(|f| func_res.get(f as usize)).and_then(Value::as_u64);
            r.and_then(|r| res_lib.get(r as usize))
                .filter(|l| !l.is_null())
                .cloned()
                .unwrap_or(Value::from(-1))
        })
        .collect();
    let (n_frames, n_funcs, n_sources) = (frames.table.len, funcs.table.len, sources.len());
    let nulls = |n: usize| Value::Array(vec![Value::Null; n]);
    let mut frame_table = frames.table.into_value(&[]);
    frame_table["lib"] = Value::Array(lib);
    frame_table["originalLocation"] = nulls(n_frames);
    let mut func_table = funcs.table.into_value(&[]);
    func_table["originalLocation"] = nulls(n_funcs);
    let shared = serde_json::json!({
        "stringArray": strings,
        "stackTable": { "frame": stack_frame, "prefixOffset": stack_prefix_offset, "length": stack_frame.len() },
        "frameTable": frame_table,
        "funcTable": func_table,
        "resourceTable": resources.table.into_value(&["lib"]),
        "nativeSymbols": natives.table.into_value(&[]),
        "sources": {
            "id": nulls(n_sources),
            "filename": sources,
            "startLine": vec![1; n_sources],
            "startColumn": vec![1; n_sources],
            "sourceMapURL": nulls(n_sources),
            "content": nulls(n_sources),
            "length": n_sources,
        },
        "sourceLocationTable": { "source": [], "line": [], "column": [], "length": 0 },
    });
    doc["shared"] = shared;
    doc["meta"]["preprocessedProfileVersion"] = Value::from(VERSION);
    Ok((doc, stack_maps))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size planned before writing (checked against the 32-bit offset
    /// limit) is the size `json-slabs` writes, alignment padding included.
    #[test]
    fn planned_size_is_the_written_size() {
        let mut doc = serde_json::json!({
            "shared": {
                "stackTable": { "frame": [0, 1, 2], "prefixOffset": [0, 1, 1], "length": 3 },
                "frameTable": { "func": [0, 1, 2], "address": [-1, 5, 7], "lib": [-1, 0, 0],
                                "inlineDepth": [0, 0, 1], "length": 3 },
            },
            "threads": [
                { "samples": { "timeDeltas": [1.5, 1.0, 1.0], "stack": (0..200).collect::<Vec<u32>>(), "length": 3 } },
                { "samples": { "time": [0.5], "stack": [2], "length": 1 } },
            ],
        });
        let mut slabs = Slabs::default();
        slabs.split(&mut doc);
        // Aligned: 5 Int32 and 2 Float64 columns; byte-aligned: inlineDepth
        // (Uint8) and the long stack column (JSON).
        assert_eq!(slabs.sizes.iter().filter(|s| s.0 > 1).count(), 7);
        assert_eq!(slabs.sizes.iter().filter(|s| s.0 == 1).count(), 2, "{:?}", slabs.sizes);
        let root = serde_json::to_vec(&doc).unwrap();
        let planned = slabs.file_size(root.len());
        let mut out = Vec::new();
        slabs.builder.to_writer(&root, &mut out).unwrap();
        assert_eq!(planned, out.len() as u64);
    }

    /// A value its slab type cannot hold keeps the column JSON.
    #[test]
    fn columns_that_do_not_fit_stay_json() {
        let mut doc = serde_json::json!({
            "shared": { "frameTable": { "address": [1, 2_147_483_648u64], "inlineDepth": [0, 256], "func": [0, 1] } },
        });
        let mut slabs = Slabs::default();
        slabs.split(&mut doc);
        assert_eq!(doc["shared"]["frameTable"]["address"], serde_json::json!([1, 2_147_483_648u64]));
        assert_eq!(doc["shared"]["frameTable"]["inlineDepth"], serde_json::json!([0, 256]));
        assert!(doc["shared"]["frameTable"]["func"].get(SLAB_REF_KEY).is_some());
    }
}
