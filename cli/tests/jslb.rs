//! The Firefox export in the JsonSlabs container (`.jslb`, `.jslb.gz`), read
//! back with the `json-slabs` crate: every placeholder resolves to a slab,
//! the typed columns are slabs of the types the Firefox Profiler takes, the
//! threads' sample counts are the spool's, the resolved profile (processed
//! format 70, shared tables) says what the `.json` export (format 55,
//! per-thread tables) says, sample by sample and frame by frame, and the JSON
//! skeleton is a small share of the file.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

use common::*;
use json_slabs::{ParsedFile, SlabPlaceholder, SlabType};
use serde_json::Value;

/// Export `spool` as Firefox to `out` (the name picks the container).
fn export_to(spool: &Path, out: &Path) {
    ok(&["export", s(spool), "--format", "firefox", "-o", s(out)]);
}

/// The slab a placeholder object (`{"$s": N}` and nothing else) refers to.
fn placeholder(v: &Value) -> Option<usize> {
    let m = v.as_object()?;
    if m.len() != 1 {
        return None;
    }
    Some(m.get(json_slabs::SLAB_REF_KEY)?.as_u64().expect("a placeholder's slab index is a number") as usize)
}

/// A JSLB file read back: the resolved profile, and what was found on the way.
struct Loaded {
    profile: Value,
    /// Slab type of the placeholder at each JSON pointer path.
    types: HashMap<String, SlabType>,
    root_bytes: usize,
    file_bytes: usize,
}

/// Resolve every placeholder of `v` (at `path`), recursively through JSON
/// slabs; panics on a placeholder that does not resolve.
fn resolve(
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
fn read_jslb(bytes: &[u8]) -> Loaded {
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

fn gunzip(path: &Path) -> Vec<u8> {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap()).read_to_end(&mut raw).expect("gzip");
    raw
}

/// A frame as the profile describes it, whatever its layout.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Clone)]
struct FrameDesc {
    func: String,
    file: Option<String>,
    lib: Option<String>,
    address: i64,
    inline_depth: u64,
    line: Option<u64>,
    category: String,
    native_symbol: Option<String>,
}

/// A thread as the profile describes it: metadata, and each sample's time
/// (ms since the profile's start) and stack (root first).
#[derive(Debug, PartialEq)]
struct ThreadDesc {
    meta: BTreeMap<String, Value>,
    samples: Vec<(i64, Vec<FrameDesc>)>,
}

/// The sample times of a samples table, from `time` or `timeDeltas`, in
/// microseconds (rounded: the JSON export prints decimal milliseconds).
fn times(samples: &Value) -> Vec<i64> {
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

fn opt_str(strings: &[Value], v: &Value) -> Option<String> {
    v.as_u64().map(|i| strings[i as usize].as_str().unwrap().to_string())
}

/// Describe every thread of a processed profile. `shared` says which layout:
/// format 70's tables in `profile.shared` (a frame's library on the frame,
/// files in the sources table, stack parents as backward offsets) or format
/// 55's per-thread tables (library through the function's resource, files on
/// the function, parents as indexes).
fn describe(v: &Value, shared: bool) -> Vec<ThreadDesc> {
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
fn tid(t: &Value) -> u64 {
    t["tid"]
        .as_u64()
        .or_else(|| t["tid"].as_str()?.parse().ok())
        .unwrap_or_else(|| panic!("tid {}", t["tid"]))
}

/// Samples per tid in the spool.
fn spool_counts(spool: &Path) -> HashMap<u64, u64> {
    let replay = spulse::Replay::open(spool).unwrap();
    let mut n = HashMap::new();
    for smp in replay.samples() {
        let smp = smp.unwrap();
        *n.entry(u64::from(replay.thread(smp.thread).tid)).or_default() += 1;
    }
    n
}

/// Check a JSLB export of `spool` against its JSON export; returns the read file.
fn check(spool: &Path, jslb: &[u8], json: &Path) -> Loaded {
    let r = read_jslb(jslb);
    let v = &r.profile;
    assert_eq!(v["meta"]["preprocessedProfileVersion"], 70);
    // The columns the profiler takes as typed arrays are binary slabs.
    for (path, ty) in [
        ("/shared/stackTable/frame", SlabType::Int32),
        ("/shared/stackTable/prefixOffset", SlabType::Int32),
        ("/shared/frameTable/func", SlabType::Int32),
        ("/shared/frameTable/address", SlabType::Int32),
        ("/shared/frameTable/lib", SlabType::Int32),
        ("/shared/frameTable/inlineDepth", SlabType::Uint8),
    ] {
        assert_eq!(r.types.get(path), Some(&ty), "{path}: {:?}", r.types);
    }
    let threads = v["threads"].as_array().unwrap();
    for i in 0..threads.len() {
        let t = r.types.get(&format!("/threads/{i}/samples/timeDeltas"));
        let t = t.or(r.types.get(&format!("/threads/{i}/samples/time")));
        assert_eq!(t, Some(&SlabType::Float64), "thread {i}'s sample times: {:?}", r.types);
    }
    // No table is left per thread.
    for th in threads {
        for k in ["stringArray", "stackTable", "frameTable", "funcTable", "resourceTable", "nativeSymbols"] {
            assert!(th.get(k).is_none(), "thread has its own {k}");
        }
    }
    // Sample counts per thread are the spool's.
    let want = spool_counts(spool);
    let got: HashMap<u64, u64> =
        threads.iter().map(|t| (tid(t), t["samples"]["length"].as_u64().unwrap())).collect();
    assert_eq!(got, want);

    // The same profile as the JSON export.
    let j: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    assert_eq!(j["meta"]["preprocessedProfileVersion"], 55);
    for k in ["interval", "startTime", "product", "categories", "symbolicated", "sampleUnits"] {
        assert_eq!(v["meta"][k], j["meta"][k], "meta.{k}");
    }
    let libs = |x: &Value| {
        let mut l: Vec<String> = x["libs"].as_array().unwrap().iter().map(|l| l.to_string()).collect();
        l.sort();
        l
    };
    assert_eq!(libs(v), libs(&j));
    let mut a = describe(v, true);
    let mut b = describe(&j, false);
    let key = |t: &ThreadDesc| t.meta["tid"].to_string();
    a.sort_by_key(key);
    b.sort_by_key(key);
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.meta, y.meta);
        assert_eq!(x.samples.len(), y.samples.len(), "{:?}", x.meta);
        for (i, (sx, sy)) in x.samples.iter().zip(&y.samples).enumerate() {
            assert_eq!(sx, sy, "thread {:?} sample {i}", x.meta["tid"]);
        }
    }
    r
}

/// Leaf function name -> samples, through format 70's shared tables.
fn leaf_counts(v: &Value) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for t in describe(v, true) {
        for (_, frames) in t.samples {
            *out.entry(frames.last().unwrap().func.clone()).or_default() += 1;
        }
    }
    out
}

fn outputs(p: &Program, spool: &Path, stem: &str) -> (PathBuf, PathBuf, PathBuf) {
    let json = p.dir.path().join(format!("{stem}.json"));
    let jslb = p.dir.path().join(format!("{stem}.jslb"));
    let gz = p.dir.path().join(format!("{stem}.jslb.gz"));
    export_to(spool, &json);
    export_to(spool, &jslb);
    export_to(spool, &gz);
    (json, jslb, gz)
}

#[test]
fn jslb_resolves_and_says_what_the_json_export_says() {
    let (p, spool) = fixture();
    let (json, jslb, gz) = outputs(&p, &spool, "a");
    let bytes = std::fs::read(&jslb).unwrap();
    assert!(bytes.starts_with(&json_slabs::MAGIC));
    let r = check(&spool, &bytes, &json);
    let leaf = leaf_counts(&r.profile);
    assert_eq!(leaf.get("hot_a"), Some(&300), "{leaf:?}");
    assert_eq!(leaf.get("hot_b"), Some(&100), "{leaf:?}");
    // Library frames: an address and the program's library.
    let ft = &r.profile["shared"]["frameTable"];
    let libs = r.profile["libs"].as_array().unwrap();
    assert_eq!(libs.len(), 1);
    assert!(ft["lib"].as_array().unwrap().iter().all(|l| l == 0), "{ft}");
    assert!(ft["address"].as_array().unwrap().iter().all(|a| a.as_i64().unwrap() >= 0));

    // .jslb.gz: the same container, gzipped.
    let raw = gunzip(&gz);
    assert!(raw.starts_with(&json_slabs::MAGIC));
    let rg = check(&spool, &raw, &json);
    assert_eq!(leaf_counts(&rg.profile), leaf);
}

#[test]
fn jslb_without_symbols_keeps_label_frames() {
    // The module file does not exist: frames are labels (no address, no library).
    let p = program();
    let spool = p.dir.path().join("nosym.spool");
    write_spool(
        &p,
        &Spec {
            path: &spool,
            module_path: b"/nonexistent/hotprog",
            build_id: &[7; 20],
            a_t1: 20,
            a_t2: 10,
            b_t1: 10,
        },
    );
    let (json, jslb, _) = outputs(&p, &spool, "nosym");
    let r = check(&spool, &std::fs::read(&jslb).unwrap(), &json);
    let ft = &r.profile["shared"]["frameTable"];
    assert!(ft["lib"].as_array().unwrap().iter().all(|l| l == -1), "{ft}");
    assert!(ft["address"].as_array().unwrap().iter().all(|a| a == -1), "{ft}");
}

#[test]
fn jslb_skeleton_is_a_small_share_of_a_large_profile() {
    let p = program();
    let spool = p.dir.path().join("big.spool");
    let module_path = p.path.as_os_str().as_encoded_bytes().to_vec();
    write_spool(
        &p,
        &Spec {
            path: &spool,
            module_path: &module_path,
            build_id: &p.build_id,
            a_t1: 120_000,
            a_t2: 40_000,
            b_t1: 40_000,
        },
    );
    let (json, jslb, gz) = outputs(&p, &spool, "big");
    let r = check(&spool, &std::fs::read(&jslb).unwrap(), &json);
    let share = r.root_bytes as f64 / r.file_bytes as f64;
    let json_len = json.metadata().unwrap().len();
    eprintln!(
        "200,000 samples: .json {json_len} bytes, .jslb {} bytes (skeleton {} bytes, {:.3}%), .jslb.gz {} bytes",
        r.file_bytes,
        r.root_bytes,
        share * 100.0,
        gz.metadata().unwrap().len()
    );
    // Measured: 0.100% (2,991 of 3,003,284 bytes): the skeleton is the
    // metadata and the tables of few rows.
    assert!(share < 0.01, "skeleton {} of {} bytes", r.root_bytes, r.file_bytes);
}

#[test]
fn jslb_is_only_for_the_firefox_format() {
    let (p, spool) = fixture();
    for (format, name) in [("pprof", "x.jslb"), ("collapsed", "x.jslb.gz")] {
        let out = p.dir.path().join(name);
        let o = spulse(&["export", s(&spool), "--format", format, "-o", s(&out)]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(stderr(&o).contains("--format firefox"), "{}", stderr(&o));
        assert!(stderr(&o).contains(name), "{}", stderr(&o));
        assert!(!out.exists());
    }
    // Any spelling of the extension selects the container; other names stay JSON.
    let upper = p.dir.path().join("A.JSLB");
    export_to(&spool, &upper);
    assert!(std::fs::read(&upper).unwrap().starts_with(&json_slabs::MAGIC));
    let plain = p.dir.path().join("a.jslb.json");
    export_to(&spool, &plain);
    let v: Value = serde_json::from_slice(&std::fs::read(&plain).unwrap()).expect("JSON");
    assert_eq!(v["meta"]["preprocessedProfileVersion"], 55);
}

#[test]
fn jslb_of_a_window_and_of_no_samples() {
    let (p, spool) = fixture();
    // Samples 200 to 400 of 400 (one every 1,000 us from 1,000 us on), and a
    // window past the last sample.
    for (from, want) in [("200000", 201), ("100000000", 0)] {
        let json = p.dir.path().join(format!("w{from}.json"));
        let jslb = p.dir.path().join(format!("w{from}.jslb"));
        for out in [&json, &jslb] {
            ok(&["export", s(&spool), "--format", "firefox", "--from", from, "-o", s(out)]);
        }
        let r = read_jslb(&std::fs::read(&jslb).unwrap());
        let j: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        let a = describe(&r.profile, true);
        let b = describe(&j, false);
        assert_eq!(a.iter().map(|t| t.samples.len()).sum::<usize>(), want);
        assert_eq!(a, b);
    }
}
