//! The Firefox export in the JsonSlabs container (`.jslb`, `.jslb.gz`), read
//! back with the `json-slabs` crate: every placeholder resolves to a slab,
//! the typed columns are slabs of the types the Firefox Profiler takes, the
//! threads' sample counts are the spool's, the resolved profile (processed
//! format 70, shared tables) says what the `.json` export (format 55,
//! per-thread tables) says, sample by sample and frame by frame, and the JSON
//! skeleton is a small share of the file.

mod common;
#[path = "common/jslb.rs"]
mod jslb_read;

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use common::*;
use jslb_read::*;
use json_slabs::SlabType;
use serde_json::Value;

/// Export `spool` as Firefox to `out` (the name picks the container).
fn export_to(spool: &Path, out: &Path) {
    ok(&["export", s(spool), "--format", "firefox", "-o", s(out)]);
}

fn gunzip(path: &Path) -> Vec<u8> {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap()).read_to_end(&mut raw).expect("gzip");
    raw
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
