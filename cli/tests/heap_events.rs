//! Heap events (FORMAT.md tag 10) in the Firefox export: this test binary
//! runs on `spulse::heap::Sampled`, records itself with
//! `RecorderBuilder::heap_events`, and the real tool's Firefox export must
//! give the process native allocations whose weights add up to what each
//! function allocated and freed, on stacks that end in the code that
//! allocated, not in the allocator.

mod common;

use std::alloc::System;
use std::collections::HashMap;
use std::hint::black_box;

use common::*;
use serde_json::Value;
use spulse::heap::Sampled;

#[global_allocator]
static ALLOC: Sampled<System> = Sampled::new(System);

const MB: i64 = 1 << 20;

#[inline(never)]
fn heap_site_kept(kept: &mut Vec<Vec<u8>>) {
    black_box(1u32);
    for _ in 0..(32 * MB / (64 << 10)) {
        kept.push(black_box(Vec::with_capacity(64 << 10)));
    }
}

#[inline(never)]
fn heap_site_freed() {
    black_box(2u32);
    for _ in 0..(32 * MB / 1024) {
        black_box(Vec::<u8>::with_capacity(1024));
    }
}

/// Function names of a processed-profile thread's stack `st`, leaf first.
fn names(th: &Value, strings: &[Value], mut st: Option<usize>) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(i) = st {
        let fr = th["stackTable"]["frame"][i].as_u64().unwrap() as usize;
        let fu = th["frameTable"]["func"][fr].as_u64().unwrap() as usize;
        let name = th["funcTable"]["name"][fu].as_u64().unwrap() as usize;
        out.push(strings[name].as_str().unwrap().to_string());
        st = th["stackTable"]["prefix"][i].as_u64().map(|p| p as usize);
    }
    out
}

#[test]
fn firefox_draws_heap_events_as_native_allocations() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("heap.spool");
    let guard = spulse::Recorder::builder().heap_events(true).start(&spool).unwrap();
    let kept = std::thread::spawn(|| {
        let mut kept = Vec::new();
        heap_site_kept(&mut kept);
        heap_site_freed();
        kept
    })
    .join()
    .unwrap();
    let stats = guard.finish().unwrap();
    drop(kept);
    assert!(stats.heap_events.is_some_and(|h| h.written >= 100 && h.lost == 0), "{:?}", stats.heap_events);
    let out = dir.path().join("heap.json");
    ok(&["export", s(&spool), "--format", "firefox", "-o", s(&out)]);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).expect("JSON");
    let shared = v["shared"]["stringArray"].as_array();
    // (site, freed) -> bytes; every stack checked.
    let mut by: HashMap<(&str, bool), i64> = HashMap::new();
    let mut tables = 0;
    for th in v["threads"].as_array().unwrap() {
        let na = &th["nativeAllocations"];
        if na.is_null() {
            continue;
        }
        tables += 1;
        let strings = th["stringArray"].as_array().or(shared).expect("string table").as_slice();
        let n = na["length"].as_u64().unwrap() as usize;
        assert!(n > 0);
        let times: Vec<f64> = na["time"].as_array().unwrap().iter().map(|t| t.as_f64().unwrap()).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]), "native allocations in time order");
        for i in 0..n {
            let w = na["weight"][i].as_i64().unwrap();
            let stack = names(th, strings, na["stack"][i].as_u64().map(|s| s as usize));
            // Cut to the code that allocated: no allocator frame at the leaf.
            let leaf = stack.first().map(String::as_str).unwrap_or("");
            assert!(
                !leaf.starts_with("spulse::heap")
                    && !leaf.contains("__rust_alloc")
                    && !leaf.starts_with("alloc::alloc::"),
                "allocation leaf {leaf}: {stack:?}"
            );
            for site in ["heap_site_kept", "heap_site_freed"] {
                if stack.iter().any(|f| f.ends_with(site)) {
                    if !by.contains_key(&(site, w < 0)) {
                        eprintln!("{site} {}: {:?}", w < 0, &stack[..stack.len().min(6)]);
                    }
                    *by.entry((site, w < 0)).or_default() += w;
                }
            }
        }
    }
    assert_eq!(tables, 1, "one process, one allocation table");
    eprintln!("{by:?}");
    let mb = |site, freed| by.get(&(site, freed)).copied().unwrap_or(0) as f64 / MB as f64;
    assert!((mb("heap_site_kept", false) / 32.0 - 1.0).abs() < 0.05, "{by:?}");
    assert!((mb("heap_site_freed", false) / 32.0 - 1.0).abs() < 0.05, "{by:?}");
    assert_eq!(mb("heap_site_kept", true), 0.0, "kept past the recording: {by:?}");
    assert_eq!(mb("heap_site_freed", true), -mb("heap_site_freed", false), "{by:?}");
}
