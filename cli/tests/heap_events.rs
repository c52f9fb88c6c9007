//! Heap events (FORMAT.md tag 10) in the Firefox export: this test binary
//! runs on `spulse::heap::Sampled`, records itself with
//! `RecorderBuilder::heap_events`, and the real tool's Firefox export must
//! give the process native allocations whose weights add up to what each
//! function allocated and freed, on stacks that end in the code that
//! allocated, not in the allocator.

mod common;
#[path = "common/jslb.rs"]
mod jslb_read;

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

type BySite = HashMap<(&'static str, bool), i64>;

/// Bytes allocated (false) and freed (true, negative) by each site in the
/// native allocations of a Firefox export (format 55), every stack checked.
fn by_site(v: &Value) -> BySite {
    let shared = v["shared"]["stringArray"].as_array();
    let mut by = BySite::new();
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
    assert!(tables <= 1, "one process, at most one allocation table");
    by
}

/// (count, bytes allocated, bytes freed) of every native allocations table.
fn totals(v: &Value) -> (usize, i64, i64) {
    let mut t = (0, 0, 0);
    for th in v["threads"].as_array().unwrap() {
        for w in th["nativeAllocations"]["weight"].as_array().into_iter().flatten() {
            let w = w.as_i64().unwrap();
            t.0 += 1;
            if w > 0 {
                t.1 += w
            } else {
                t.2 += w
            }
        }
    }
    t
}

fn export_json(dir: &std::path::Path, name: &str, inputs: &[&std::path::Path]) -> Value {
    let out = dir.join(name);
    let mut args = vec!["export", "--format", "firefox", "-o", s(&out)];
    args.extend(inputs.iter().map(|p| s(p)));
    ok(&args);
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).expect("JSON")
}

fn mb(by: &BySite, site: &str, freed: bool) -> f64 {
    by.iter().filter(|((s, f), _)| *s == site && *f == freed).map(|(_, &b)| b).sum::<i64>() as f64 / MB as f64
}

/// Run on this thread until it has had `cpu` of CPU time.
fn burn_thread_cpu(cpu: std::time::Duration) {
    let now = || {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: writes the calling thread's CPU clock into `ts`.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    };
    let start = now();
    let mut x = 0u64;
    while now() - start < cpu {
        for i in 0..10_000 {
            x = black_box(x.wrapping_mul(31).wrapping_add(i));
        }
    }
}

#[test]
fn firefox_draws_heap_events_as_native_allocations() {
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (dir.path().join("one.spool"), dir.path().join("two.spool"));
    let guard = spulse::Recorder::builder().frequency_hz(999).heap_events(true).start(&one).unwrap();
    // CPU samples of this thread too, so that the spool has a thread without
    // heap events (the selections below).
    burn_thread_cpu(std::time::Duration::from_millis(60));
    let kept = std::thread::spawn(|| {
        // Room for every block first: a buffer that grows within the kept
        // function frees its old one there (an event of that function's if
        // it was sampled).
        let mut kept = Vec::with_capacity((32 * MB / (64 << 10)) as usize);
        heap_site_kept(&mut kept);
        heap_site_freed();
        kept
    })
    .join()
    .unwrap();
    let stats = guard.finish().unwrap();
    assert!(stats.heap_events.is_some_and(|h| h.written >= 100 && h.lost == 0), "{:?}", stats.heap_events);
    // A second recording: the blocks kept from the first are freed in it,
    // and it holds none of their events (their allocations are not in it).
    let guard = spulse::Recorder::builder().heap_events(true).start(&two).unwrap();
    std::thread::spawn(move || {
        drop(kept);
        heap_site_freed();
    })
    .join()
    .unwrap();
    guard.finish().unwrap();

    let v1 = export_json(dir.path(), "one.json", &[&one]);
    let by1 = by_site(&v1);
    eprintln!("{by1:?}");
    assert!((mb(&by1, "heap_site_kept", false) / 32.0 - 1.0).abs() < 0.05, "{by1:?}");
    assert!((mb(&by1, "heap_site_freed", false) / 32.0 - 1.0).abs() < 0.05, "{by1:?}");
    assert_eq!(mb(&by1, "heap_site_kept", true), 0.0, "kept past the recording: {by1:?}");
    assert_eq!(mb(&by1, "heap_site_freed", true), -mb(&by1, "heap_site_freed", false), "{by1:?}");
    let v2 = export_json(dir.path(), "two.json", &[&two]);
    let by2 = by_site(&v2);
    assert_eq!(mb(&by2, "heap_site_kept", false) + mb(&by2, "heap_site_kept", true), 0.0, "{by2:?}");
    assert!((mb(&by2, "heap_site_freed", false) / 32.0 - 1.0).abs() < 0.05, "{by2:?}");
    assert_eq!(mb(&by2, "heap_site_freed", true), -mb(&by2, "heap_site_freed", false), "{by2:?}");
    // Both recordings merged: both recordings' events.
    let both = totals(&export_json(dir.path(), "both.json", &[&one, &two]));
    let (t1, t2) = (totals(&v1), totals(&v2));
    assert_eq!(both, (t1.0 + t2.0, t1.1 + t2.1, t1.2 + t2.2));
    // `info` sums them up.
    let text = ok(&["info", s(&one)]);
    let line =
        text.lines().find(|l| l.starts_with("heap:")).unwrap_or_else(|| panic!("no heap line:\n{text}"));
    let allocated = format!("standing for {:.1} MiB allocated", t1.1 as f64 / MB as f64);
    assert!(line.contains(&allocated), "{line}");
    let info: Value = serde_json::from_str(&ok(&["info", "--json", s(&one)])).expect("info --json");
    assert_eq!(info["heap_events"].as_u64(), Some(t1.0 as u64), "{line}");
    assert_eq!(info["heap_allocated_bytes"].as_i64(), Some(t1.1), "{line}");
    assert_eq!(info["heap_freed_bytes"].as_i64(), Some(-t1.2), "{line}");
    // A selection keeps the heap events a sample at their time and thread
    // would keep: none in the first microsecond, nor days after the end.
    // Nothing is selected then, and the export lists every thread, empty (it
    // listed only the threads with heap events, which it drew no allocation
    // for).
    let listed = v1["threads"].as_array().unwrap().len();
    assert!(listed >= 2, "this thread's samples and the allocating thread's: {listed} threads");
    for filter in [["--to", "1"], ["--from", "100000000000"]] {
        let out = dir.path().join("filtered.json");
        let mut args = vec!["export", "--format", "firefox", "-o", s(&out)];
        args.extend(filter);
        args.push(s(&one));
        ok(&args);
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).expect("JSON");
        assert_eq!(totals(&v).0, 0, "{filter:?}: native allocations drawn");
        let threads = v["threads"].as_array().unwrap();
        assert!(threads.len() >= listed, "{filter:?}: {} threads listed, not every thread", threads.len());
    }
    // The packed file says the same.
    let packed = dir.path().join("one.spk");
    ok(&["pack", s(&one), "-o", s(&packed)]);
    assert_eq!(by_site(&export_json(dir.path(), "packed.json", &[&packed])), by1);
    // And the JSLB container (format 70, shared stack tables) keeps them.
    let jslb = dir.path().join("one.jslb");
    ok(&["export", "--format", "firefox", "-o", s(&jslb), s(&one)]);
    let loaded = jslb_read::read_jslb(&std::fs::read(&jslb).unwrap());
    assert_eq!(totals(&loaded.profile), t1);
}
