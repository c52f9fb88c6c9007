//! Reading the Firefox export back, shared by `tests/jslb.rs` and
//! `tests/truth.rs` (included with `#[path]`): a `.jslb` file resolved with
//! the `json-slabs` crate, and a description of a processed profile, sample by
//! sample and frame by frame, that is the same for format 55 (the `.json`
//! export) and format 70 (the `.jslb` export) when they say the same.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};

use json_slabs::{ParsedFile, SlabPlaceholder, SlabType};
use serde_json::Value;

/// The slab a placeholder object (`{"$s": N}` and nothing else) refers to.
pub fn placeholder(v: &Value) -> Option<usize> {
    let m = v.as_object()?;
    if m.len() != 1 {
        return None;
    }
    Some(m.get(json_slabs::SLAB_REF_KEY)?.as_u64().expect("a placeholder's slab index is a number") as usize)
}

/// A JSLB file read back: the resolved profile, and what was found on the way.
pub struct Loaded {
    pub profile: Value,
    /// Slab type of the placeholder at each JSON pointer path.
    pub types: HashMap<String, SlabType>,
    pub root_bytes: usize,
    pub file_bytes: usize,
}

/// Resolve every placeholder of `v` (at `path`), recursively through JSON
/// slabs; panics on a placeholder that does not resolve.
pub fn resolve(
    f: &ParsedFile<'_>,
    v: &mut Value,
    path: &str,
    used: &mut Vec<usize>,
    types: &mut HashMap<String, SlabType>,
) {
    if let Some(i) = placeholder(v) {
        assert!(i < f.slabs().len(), "{path}: placeholder {i} past the {} slabs", f.slabs().len());
        assert_ne!(i, f.root_json_slab_index(), "{path}: placeholder to the root");
        used.push(i);
        let p = SlabPlaceholder(i);
        let ty = f.slab_at(p).unwrap_or_else(|e| panic!("{path}: slab {i}: {e}")).slab_type;
        types.insert(path.to_string(), ty);
        let nums = |vals: Vec<Value>| Value::Array(vals);
        *v = match ty {
            SlabType::Json => {
                let bytes = f.read_subjson_bytes(p).unwrap_or_else(|e| panic!("{path}: slab {i}: {e}"));
                let mut sub: Value =
                    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{path}: slab {i}: {e}"));
                resolve(f, &mut sub, path, used, types);
                sub
            }
            SlabType::Int32 => nums(f.read::<i32>(p).unwrap().into_iter().map(Value::from).collect()),
            SlabType::Uint8 => nums(f.read::<u8>(p).unwrap().into_iter().map(Value::from).collect()),
            SlabType::Float64 => nums(f.read::<f64>(p).unwrap().into_iter().map(Value::from).collect()),
            other => panic!("{path}: slab {i} of type {other}, which the profiler does not take"),
        };
        return;
    }
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                resolve(f, x, &format!("{path}/{k}"), used, types);
            }
        }
        Value::Array(a) => {
            for (k, x) in a.iter_mut().enumerate() {
                resolve(f, x, &format!("{path}/{k}"), used, types);
            }
        }
        _ => {}
    }
}

/// Read a JSLB file with `json-slabs`, checking that every placeholder
/// resolves and every slab but the root is used exactly once.
pub fn read_jslb(bytes: &[u8]) -> Loaded {
    let f = ParsedFile::parse(bytes).expect("a JSLB file");
    assert_eq!(f.root_json_slab_index(), 0, "the root JSON comes first (streaming readers want it)");
    let mut profile: Value = serde_json::from_slice(f.root_json_bytes()).expect("root JSON");
    let mut used = Vec::new();
    let mut types = HashMap::new();
    resolve(&f, &mut profile, "", &mut used, &mut types);
    used.sort_unstable();
    let want: Vec<usize> = (1..f.slabs().len()).collect();
    assert_eq!(used, want, "every slab but the root is referred to exactly once");
    Loaded { profile, types, root_bytes: f.root_json_bytes().len(), file_bytes: bytes.len() }
}

/// A frame as the profile describes it, whatever its layout.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Clone)]
pub struct FrameDesc {
    pub func: String,
    pub file: Option<String>,
    pub lib: Option<String>,
    pub address: i64,
    pub inline_depth: u64,
    pub line: Option<u64>,
    pub category: String,
    pub native_symbol: Option<String>,
}

/// A thread as the profile describes it: metadata, and each sample's time
/// (ms since the profile's start) and stack (root first).
#[derive(Debug, PartialEq)]
pub struct ThreadDesc {
    pub meta: BTreeMap<String, Value>,
    pub samples: Vec<(i64, Vec<FrameDesc>)>,
}

/// The sample times of a samples table, from `time` or `timeDeltas`, in
/// microseconds (rounded: the JSON export prints decimal milliseconds).
pub fn times(samples: &Value) -> Vec<i64> {
    if let Some(t) = samples["time"].as_array() {
        return t.iter().map(|x| (x.as_f64().unwrap() * 1000.0).round() as i64).collect();
    }
    let mut acc = 0.0;
    samples["timeDeltas"]
        .as_array()
        .expect("time or timeDeltas")
        .iter()
        .map(|d| {
            acc += d.as_f64().unwrap();
            (acc * 1000.0).round() as i64
        })
        .collect()
}

pub fn opt_str(strings: &[Value], v: &Value) -> Option<String> {
    v.as_u64().map(|i| strings[i as usize].as_str().unwrap().to_string())
}

/// Describe every thread of a processed profile. `shared` says which layout:
/// format 70's tables in `profile.shared` (a frame's library on the frame,
/// files in the sources table, stack parents as backward offsets) or format
/// 55's per-thread tables (library through the function's resource, files on
/// the function, parents as indexes).
pub fn describe(v: &Value, shared: bool) -> Vec<ThreadDesc> {
    let cats: Vec<String> = v["meta"]["categories"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().into())
        .collect();
    let libs = v["libs"].as_array().unwrap();
    let lib_name = |l: &Value| {
        l.as_i64().filter(|&l| l >= 0).map(|l| {
            let lib = &libs[l as usize];
            format!("{} {} {}", lib["name"], lib["path"], lib["debugId"])
        })
    };
    let mut out = Vec::new();
    for th in v["threads"].as_array().unwrap() {
        let t = if shared { &v["shared"] } else { th };
        let strings = t["stringArray"].as_array().unwrap();
        let (st, ft, fu, ns) = (&t["stackTable"], &t["frameTable"], &t["funcTable"], &t["nativeSymbols"]);
        let frame = |f: usize| -> FrameDesc {
            let func = ft["func"][f].as_u64().unwrap() as usize;
            let (lib, file) = if shared {
                let file = fu["source"][func]
                    .as_u64()
                    .and_then(|s| opt_str(strings, &t["sources"]["filename"][s as usize]));
                (lib_name(&ft["lib"][f]), file)
            } else {
                let res = fu["resource"][func].as_i64().unwrap();
                let lib = if res < 0 { None } else { lib_name(&t["resourceTable"]["lib"][res as usize]) };
                (lib, opt_str(strings, &fu["fileName"][func]))
            };
            FrameDesc {
                func: opt_str(strings, &fu["name"][func]).unwrap(),
                file,
                lib,
                address: ft["address"][f].as_i64().unwrap_or(-1),
                inline_depth: ft["inlineDepth"][f].as_u64().unwrap(),
                line: ft["line"][f].as_u64(),
                category: cats[ft["category"][f].as_u64().unwrap() as usize].clone(),
                native_symbol: ft["nativeSymbol"][f].as_u64().map(|n| {
                    let n = n as usize;
                    format!("{} {}", opt_str(strings, &ns["name"][n]).unwrap(), ns["address"][n])
                }),
            }
        };
        let parent = |s: usize| -> Option<usize> {
            if shared {
                let off = st["prefixOffset"][s].as_u64().unwrap() as usize;
                assert!(off <= s, "stack {s}: prefix offset {off} points before the table");
                (off > 0).then(|| s - off)
            } else {
                st["prefix"][s].as_u64().map(|p| p as usize)
            }
        };
        let samples = &th["samples"];
        let n = samples["length"].as_u64().unwrap() as usize;
        let ts = times(samples);
        assert_eq!(ts.len(), n);
        let mut descs = Vec::with_capacity(n);
        let mut memo: HashMap<usize, Vec<FrameDesc>> = HashMap::new();
        for (i, &t) in ts.iter().enumerate() {
            let stack = samples["stack"][i].as_u64().unwrap() as usize;
            let frames = memo
                .entry(stack)
                .or_insert_with(|| {
                    let mut fs = Vec::new();
                    let mut cur = Some(stack);
                    while let Some(s) = cur {
                        fs.push(frame(st["frame"][s].as_u64().unwrap() as usize));
                        cur = parent(s);
                    }
                    fs.reverse();
                    fs
                })
                .clone();
            let w = samples["weight"].as_array().map(|w| w[i].as_u64().unwrap()).unwrap_or(1);
            for _ in 0..w {
                descs.push((t, frames.clone()));
            }
        }
        let meta = ["name", "pid", "tid", "processName", "isMainThread", "processType", "registerTime"]
            .iter()
            .map(|k| (k.to_string(), th[*k].clone()))
            .collect();
        out.push(ThreadDesc { meta, samples: descs });
    }
    out
}

/// A thread's tid (the profile writes it as a string or a number).
pub fn tid(t: &Value) -> u64 {
    t["tid"]
        .as_u64()
        .or_else(|| t["tid"].as_str()?.parse().ok())
        .unwrap_or_else(|| panic!("tid {}", t["tid"]))
}
