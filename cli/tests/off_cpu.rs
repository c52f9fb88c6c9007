//! The off-CPU views over a spool with off-CPU intervals (FORMAT.md, tag 9):
//! `top --off-cpu` and `--wall` charge each interval's duration to where the
//! thread waited (`[blocked: futex]` under its caller), `top --json` rows
//! carry `self_us`/`total_us` in every mode, the pprof export has an
//! `off-cpu` sample type in nanoseconds, collapsed weighs by time, and the
//! Firefox export (JSON and `.jslb`) gives each interval a sample weighing
//! its duration with its leaf in the Off-CPU category. CPU figures are the
//! same with and without the intervals.

mod common;
#[path = "common/jslb.rs"]
mod jslb_read;

use common::*;
use serde_json::Value;
use spulse::{Header, SpoolWriter};

/// A spool at `path` with the standard program's module and hot stacks
/// (main;hot_a, main;hot_b) and its thread `main` (1001) defined.
fn hot_spool(
    p: &Program,
    path: &std::path::Path,
) -> (SpoolWriter<std::fs::File>, spulse::StackId, spulse::StackId, spulse::ThreadId) {
    let file = std::fs::File::create(path).unwrap();
    let mut w = SpoolWriter::new(file, Header { start_time_us: START_US, interval_us: INTERVAL_US }).unwrap();
    let module_path = p.path.as_os_str().as_encoded_bytes().to_vec();
    let m = define_program(&mut w, p, PID, &module_path, &p.build_id);
    let (s_a, s_b) = define_hot_stacks(&mut w, p, m);
    let t1 = w.define_thread(PID, 1001, "main").unwrap();
    (w, s_a, s_b, t1)
}

/// The standard program's stacks: 300 CPU samples of main;hot_a (1 ms each),
/// 100 of main;hot_b, and off-CPU: 600 ms blocked in futex under hot_b and
/// 250 ms waiting for a CPU under hot_a, in intervals of 50 ms.
fn spool(p: &Program, path: &std::path::Path) {
    let (mut w, s_a, s_b, t1) = hot_spool(p, path);
    let futex = w.define_label("blocked: futex").unwrap();
    let cpu = w.define_label("waiting for CPU").unwrap();
    let s_futex = w.define_stack(Some(s_b), futex).unwrap();
    let s_cpu = w.define_stack(Some(s_a), cpu).unwrap();
    let mut t = START_US;
    for i in 0..400u64 {
        t += INTERVAL_US;
        w.sample(t, t1, if i % 4 == 3 { s_b } else { s_a }).unwrap();
        if i % 20 == 0 && i < 240 {
            w.off_cpu(t1, s_futex, t, 50_000, false).unwrap();
        }
        if i % 80 == 0 {
            w.off_cpu(t1, s_cpu, t, 50_000, true).unwrap();
        }
    }
    w.into_inner().unwrap();
}

fn rows(json: &str) -> Vec<Value> {
    serde_json::from_str::<Value>(json).unwrap().as_array().unwrap().clone()
}

fn row<'a>(rows: &'a [Value], name: &str) -> &'a Value {
    rows.iter().find(|r| r["function"] == name).unwrap_or_else(|| panic!("no row {name}: {rows:?}"))
}

#[test]
fn top_off_cpu_wall_and_cpu() {
    let p = program();
    let path = p.dir.path().join("off.spool");
    spool(&p, &path);
    let f = s(&path);
    // CPU (the default): samples only, as without the intervals.
    let cpu = rows(&ok(&["top", f, "--json", "-n", "0"]));
    assert_eq!(row(&cpu, "hot_a")["self"], 300);
    assert_eq!(row(&cpu, "hot_b")["self"], 100);
    assert_eq!(row(&cpu, "hot_a")["self_us"], 300 * INTERVAL_US);
    assert!(cpu.iter().all(|r| !r["function"].as_str().unwrap().starts_with('[')), "{cpu:?}");
    // Off-CPU: the blocked waits, in microseconds, under their callers;
    // waiting for a CPU is left out (and said so), the wall view has it.
    let o = spulse(&["top", f, "--off-cpu", "--json", "-n", "0"]);
    let off = rows(&stdout(&o));
    assert_eq!(row(&off, "[blocked: futex]")["self_us"], 600_000);
    assert!(!off.iter().any(|r| r["function"] == "[waiting for CPU]"), "{off:?}");
    assert_eq!(row(&off, "hot_b")["total_us"], 600_000);
    assert_eq!(row(&off, "hot_b")["self_us"], 0);
    assert_eq!(row(&off, "main")["total_us"], 600_000);
    assert!(stderr(&o).contains("250.0 ms waiting for a CPU (preempted) not counted"), "{}", stderr(&o));
    // Wall: both.
    let wall = rows(&ok(&["top", f, "--wall", "--json", "-n", "0"]));
    assert_eq!(row(&wall, "main")["total_us"], 400 * INTERVAL_US + 850_000);
    assert_eq!(row(&wall, "hot_b")["total_us"], 100 * INTERVAL_US + 600_000);
    assert_eq!(row(&wall, "hot_b")["self_us"], 100 * INTERVAL_US);
    assert_eq!(row(&wall, "[waiting for CPU]")["self_us"], 250_000);
    // The table shows milliseconds.
    let table = ok(&["top", f, "--off-cpu"]);
    assert!(table.starts_with("600.0 ms off-CPU, blocked\n(250.0 ms waiting for a CPU"), "{table}");
    let line = table.lines().find(|l| l.contains("[blocked: futex]")).expect(&table);
    assert!(line.trim_start().starts_with("600.0"), "{line}");
    // info says the mode was on and what the intervals add up to.
    let info: Value = serde_json::from_str(&ok(&["info", f, "--json"])).unwrap();
    assert_eq!(info["off_cpu"], true);
    assert_eq!(info["off_cpu_intervals"], 12 + 5);
    assert_eq!(info["off_cpu_blocked_us"], 600_000);
    assert_eq!(info["off_cpu_blocked_with_stack_us"], 600_000);
    assert_eq!(info["off_cpu_waiting_for_cpu_us"], 250_000);
    assert!(ok(&["info", f]).contains("off-CPU:         on: 17 interval(s)"));
    // A CPU-only spool says it has no intervals.
    let (_plain_dir, plain) = fixture();
    let o = spulse(&["top", s(&plain), "--off-cpu"]);
    assert!(stderr(&o).contains("no off-CPU intervals"), "{}", stderr(&o));
    assert!(ok(&["info", s(&plain)])
        .contains("off-CPU:         none in the spool: recorded without the off-CPU mode"));
    // A recording of a process that only waited: its duration runs to the
    // end of its last wait (it has no sample).
    let waits = p.dir.path().join("waits.spool");
    let mut w = SpoolWriter::new(
        std::fs::File::create(&waits).unwrap(),
        Header { start_time_us: START_US, interval_us: INTERVAL_US },
    )
    .unwrap();
    let t = w.define_thread(PID, 1001, "sh").unwrap();
    let wait4 = w.define_label("blocked: wait4").unwrap();
    let st = w.define_stack(None, wait4).unwrap();
    w.off_cpu(t, st, START_US + 3_000, 1_000_000, false).unwrap();
    w.into_inner().unwrap();
    let info: Value = serde_json::from_str(&ok(&["info", s(&waits), "--json"])).unwrap();
    assert_eq!(info["samples"], 0);
    assert_eq!(info["duration_us"], 1_003_000);
}

#[test]
fn exports_weigh_by_time() {
    let p = program();
    let path = p.dir.path().join("off.spool");
    spool(&p, &path);
    let f = s(&path);
    // pprof: samples, cpu and off-cpu (ns).
    let out = p.dir.path().join("off.pb.gz");
    ok(&["export", f, "-o", s(&out)]);
    let prof = read_pprof(&out);
    let st: Vec<&str> =
        prof.sample_type.iter().map(|v| prof.string_table[v.r#type as usize].as_str()).collect();
    assert_eq!(st, ["samples", "cpu", "off-cpu"]);
    let unit = &prof.string_table[prof.sample_type[2].unit as usize];
    assert_eq!(unit, "nanoseconds");
    let sums: Vec<i64> = (0..3).map(|i| prof.sample.iter().map(|s| s.value[i]).sum()).collect();
    assert_eq!(sums, [400, 400 * INTERVAL_US as i64 * 1000, 850_000_000]);
    // Collapsed with --off-cpu: lines weighted in microseconds.
    let folded = p.dir.path().join("off.folded");
    ok(&["export", f, "--off-cpu", "-o", s(&folded)]);
    let text = std::fs::read_to_string(&folded).unwrap();
    assert!(text.lines().any(|l| l.ends_with("hot_b;[blocked: futex] 600000")), "{text}");
    assert!(!text.contains("[waiting for CPU]"), "{text}");
    let wall = ok(&["export", f, "--wall", "-f", "collapsed", "-o", "-"]);
    assert!(wall.lines().any(|l| l.ends_with("hot_a;[waiting for CPU] 250000")), "{wall}");
    // speedscope: weights in microseconds in every mode (CPU samples count
    // their interval; with --off-cpu/--wall the intervals their duration).
    for (mode, want) in [
        (None, 400 * INTERVAL_US),
        (Some("--off-cpu"), 600_000),
        (Some("--wall"), 400 * INTERVAL_US + 850_000),
    ] {
        let ss = p.dir.path().join("off.speedscope.json");
        let mut args = vec!["export", f, "-o", s(&ss)];
        args.extend(mode);
        ok(&args);
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&ss).unwrap()).unwrap();
        let profiles = v["profiles"].as_array().unwrap();
        assert!(profiles.iter().all(|p| p["unit"] == "microseconds"));
        let sum: u64 = profiles
            .iter()
            .flat_map(|p| p["weights"].as_array().unwrap().iter().map(|w| w.as_u64().unwrap()))
            .sum();
        assert_eq!(sum, want, "speedscope {mode:?}");
        let end: u64 = profiles.iter().map(|p| p["endValue"].as_u64().unwrap()).sum();
        assert_eq!(end, want, "speedscope {mode:?} endValue");
    }
    // svg: widths in microseconds, said so (not "samples"); the summary line too.
    let svg = p.dir.path().join("off.svg");
    let o = spulse(&["export", f, "--off-cpu", "-o", s(&svg)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("export: 600000 us of time written"), "{}", stderr(&o));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("all (600,000 us, 100%)"), "{}", &text[..text.len().min(3000)]);
    let o = spulse(&["export", f, "-o", s(&svg)]);
    assert!(stderr(&o).contains("export: 400 samples written"), "{}", stderr(&o));
    assert!(std::fs::read_to_string(&svg).unwrap().contains("all (400 samples, 100%)"));
    // A CPU-only spool's pprof keeps two sample types.
    let (plain_p, plain) = fixture();
    let out = plain_p.dir.path().join("plain.pb.gz");
    ok(&["export", s(&plain), "-o", s(&out)]);
    assert_eq!(read_pprof(&out).sample_type.len(), 2);
}

/// One sample of a Firefox profile as the tests see it.
#[derive(Debug)]
struct FxSample {
    leaf: String,
    category: String,
    subcategory: String,
    weight_ms: f64,
    cpu_delta_us: u64,
}

/// Every sample of a Firefox profile (format 55 with per-thread tables, or
/// 70 with shared ones), with its weight type (one for the whole profile).
fn fx_samples(v: &Value) -> (String, Vec<FxSample>) {
    let cats = v["meta"]["categories"].as_array().unwrap();
    let mut weight_type = None;
    let mut out = Vec::new();
    for th in v["threads"].as_array().unwrap() {
        let t = if th.get("frameTable").is_some() { th } else { &v["shared"] };
        let strings = t["stringArray"].as_array().unwrap();
        let (st, ft, fu) = (&t["stackTable"], &t["frameTable"], &t["funcTable"]);
        let samples = &th["samples"];
        let wt = samples["weightType"].as_str().unwrap().to_string();
        assert!(weight_type.get_or_insert(wt.clone()) == &wt, "weight types differ: {wt} {weight_type:?}");
        let n = samples["length"].as_u64().unwrap() as usize;
        for i in 0..n {
            let stack = samples["stack"][i].as_u64().unwrap() as usize;
            let f = st["frame"][stack].as_u64().unwrap() as usize;
            let func = ft["func"][f].as_u64().unwrap() as usize;
            let cat = &cats[ft["category"][f].as_u64().unwrap() as usize];
            let sub = ft["subcategory"][f].as_u64().unwrap_or(0) as usize;
            out.push(FxSample {
                leaf: strings[fu["name"][func].as_u64().unwrap() as usize].as_str().unwrap().into(),
                category: cat["name"].as_str().unwrap().into(),
                subcategory: cat["subcategories"][sub].as_str().unwrap().into(),
                weight_ms: samples["weight"].as_array().map_or(1.0, |w| w[i].as_f64().unwrap()),
                cpu_delta_us: samples["threadCPUDelta"][i].as_u64().unwrap(),
            });
        }
    }
    (weight_type.unwrap_or_default(), out)
}

fn weight_where(samples: &[FxSample], f: impl Fn(&FxSample) -> bool) -> f64 {
    samples.iter().filter(|s| f(s)).map(|s| s.weight_ms).sum()
}

#[test]
fn firefox_export_weighs_off_cpu_time_in_its_own_category() {
    let p = program();
    let path = p.dir.path().join("off.spool");
    spool(&p, &path);
    let f = s(&path);
    let json = |args: &[&str], name: &str| -> Value {
        let out = p.dir.path().join(name);
        let mut a = vec!["export", f, "--format", "firefox", "-o", s(&out)];
        a.extend_from_slice(args);
        ok(&a);
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
    let off_cpu = |s: &FxSample| s.category == "Off-CPU";

    // --off-cpu: the 12 blocked intervals only (waiting for a CPU is the
    // wall view's), weighing 600 ms in all, in the Off-CPU category; no CPU
    // delta.
    let v = json(&["--off-cpu"], "off.json");
    let cat = v["meta"]["categories"].as_array().unwrap().iter().find(|c| c["name"] == "Off-CPU");
    let subs = &cat.expect("an Off-CPU category")["subcategories"];
    assert!(subs.as_array().unwrap().iter().any(|s| s == "Blocked"), "{subs}");
    assert!(subs.as_array().unwrap().iter().any(|s| s == "Waiting for CPU"), "{subs}");
    let (wt, samples) = fx_samples(&v);
    assert_eq!(wt, "tracing-ms");
    assert_eq!(samples.len(), 12, "{samples:?}");
    assert!(samples.iter().all(off_cpu), "{samples:?}");
    assert!(samples.iter().all(|s| s.cpu_delta_us == 0), "{samples:?}");
    assert!(close(weight_where(&samples, |_| true), 600.0), "{samples:?}");
    let blocked = weight_where(&samples, |s| s.subcategory == "Blocked" && s.leaf == "[blocked: futex]");
    assert!(close(blocked, 600.0), "{blocked}");

    // --wall: the 400 CPU samples (1 ms each, their own categories and CPU
    // deltas) beside the same intervals.
    let (wt, samples) = fx_samples(&json(&["--wall"], "wall.json"));
    assert_eq!(wt, "tracing-ms");
    assert_eq!(samples.len(), 400 + 17);
    assert!(close(weight_where(&samples, |_| true), 400.0 * INTERVAL_US as f64 / 1000.0 + 850.0));
    assert!(close(weight_where(&samples, off_cpu), 850.0));
    let waiting =
        weight_where(&samples, |s| s.subcategory == "Waiting for CPU" && s.leaf == "[waiting for CPU]");
    assert!(close(waiting, 250.0), "{waiting}");
    let cpu: Vec<&FxSample> = samples.iter().filter(|s| !off_cpu(s)).collect();
    assert!(cpu.iter().all(|s| s.leaf.starts_with("hot_") && s.cpu_delta_us == INTERVAL_US), "{cpu:?}");
    assert_eq!(samples.iter().map(|s| s.cpu_delta_us).sum::<u64>(), 400 * INTERVAL_US);

    // The default: CPU samples counted, no interval.
    let (wt, samples) = fx_samples(&json(&[], "cpu.json"));
    assert_eq!(wt, "samples");
    assert_eq!(samples.len(), 400);
    assert!(!samples.iter().any(off_cpu));

    // The JsonSlabs container says the same.
    let out = p.dir.path().join("off.jslb");
    ok(&["export", f, "--off-cpu", "-o", s(&out)]);
    let (wt, samples) = fx_samples(&jslb_read::read_jslb(&std::fs::read(&out).unwrap()).profile);
    assert_eq!(wt, "tracing-ms");
    assert_eq!(samples.len(), 12);
    assert!(close(weight_where(&samples, off_cpu), 600.0), "{samples:?}");
    let out = p.dir.path().join("wall.jslb");
    ok(&["export", f, "--wall", "-o", s(&out)]);
    let (_, samples) = fx_samples(&jslb_read::read_jslb(&std::fs::read(&out).unwrap()).profile);
    assert!(close(weight_where(&samples, |_| true), 1250.0), "{samples:?}");
    assert_eq!(samples.iter().map(|s| s.cpu_delta_us).sum::<u64>(), 400 * INTERVAL_US);
}

/// A spool for `--spread-blocked`. Thread `main` (1001): waits with a stack,
/// three under hot_a and one under hot_b in its first second (1 ms each),
/// and after 2 s one under hot_b (6 ms) and one under hot_a (40 ms); waits
/// without one, 400 ms of short waits in 8 sums in the first second
/// (`[blocked, under 5 ms]`), and after 2 s a 100 ms and a 6.5 ms wait
/// (`[blocked]`); 30 ms preempted under hot_a. Thread `idle` (1002): one
/// 70 ms wait without a stack and none with one.
fn spread_spool(p: &Program, path: &std::path::Path) {
    let (mut w, s_a, s_b, t1) = hot_spool(p, path);
    let t2 = w.define_thread(PID, 1002, "idle").unwrap();
    let sleep = w.define_label("blocked: clock_nanosleep").unwrap();
    let blocked = w.define_label("blocked").unwrap();
    let short = w.define_label("blocked, under 5 ms").unwrap();
    let cpu = w.define_label("waiting for CPU").unwrap();
    let s_sleep_a = w.define_stack(Some(s_a), sleep).unwrap();
    let s_sleep_b = w.define_stack(Some(s_b), sleep).unwrap();
    let s_blocked = w.define_stack(None, blocked).unwrap();
    let s_sums = w.define_stack(None, short).unwrap();
    let s_cpu = w.define_stack(Some(s_a), cpu).unwrap();
    let ms = 1000;
    w.sample(START_US + ms, t1, s_a).unwrap();
    for (i, st) in [s_sleep_a, s_sleep_b, s_sleep_a, s_sleep_a].into_iter().enumerate() {
        w.off_cpu(t1, st, START_US + 10 * ms + i as u64 * 100 * ms, ms, false).unwrap();
    }
    for i in 0..8u64 {
        w.off_cpu(t1, s_sums, START_US + 50 * ms + i * 110 * ms, 50 * ms, false).unwrap();
    }
    w.off_cpu(t1, s_cpu, START_US + 500 * ms, 30 * ms, true).unwrap();
    w.off_cpu(t2, s_blocked, START_US + 600 * ms, 70 * ms, false).unwrap();
    w.sample(START_US + 2000 * ms, t1, s_b).unwrap();
    w.off_cpu(t1, s_sleep_b, START_US + 2010 * ms, 6 * ms, false).unwrap();
    w.off_cpu(t1, s_sleep_a, START_US + 2030 * ms, 40 * ms, false).unwrap();
    w.off_cpu(t1, s_blocked, START_US + 2100 * ms, 100 * ms, false).unwrap();
    w.off_cpu(t1, s_blocked, START_US + 2300 * ms, 6_500, false).unwrap();
    w.into_inner().unwrap();
}

/// `--spread-blocked` charges each thread's blocked time without a stack to
/// the stacks of that thread's waits with one, in proportion to their number
/// among those of about the same length (the sums of short waits to the
/// short waits, a longer wait to those of its stratum or the nearest one
/// with any) and among those the filter selects, to the microsecond, in
/// `top`, the collapsed, pprof and Firefox exports; it leaves a thread with
/// no wait with a stack, and preempted time, as they are; totals do not
/// change.
#[test]
fn spread_blocked_charges_stackless_time_to_the_captured_stacks() {
    let p = program();
    let path = p.dir.path().join("spread.spool");
    spread_spool(&p, &path);
    let f = s(&path);
    let us = |rows: &[Value], name: &str, what: &str| row(rows, name)[what].as_u64().unwrap();
    // As measured: 400 ms of sums, 176.5 ms of [blocked].
    let plain = rows(&ok(&["top", f, "--off-cpu", "--json", "-n", "0"]));
    assert_eq!(us(&plain, "[blocked, under 5 ms]", "self_us"), 400_000);
    assert_eq!(us(&plain, "[blocked]", "self_us"), 176_500);
    assert_eq!(us(&plain, "hot_a", "total_us"), 3_000 + 40_000);
    // Spread: the sums go 3/4 to hot_a, 1/4 to hot_b (the short waits); the
    // 6.5 ms wait to hot_b (its 6 ms wait), the 100 ms one to hot_a (its
    // 40 ms wait is in the nearest stratum with any); idle's 70 ms stay.
    let o = spulse(&["top", f, "--off-cpu", "--spread-blocked", "--json", "-n", "0"]);
    assert!(stderr(&o).contains("spulse: 506.5 ms blocked, no stack: estimated"), "{}", stderr(&o));
    assert!(stderr(&o).contains("\nspulse: 70.0 ms blocked, no stack: kept"), "{}", stderr(&o));
    let spread = rows(&stdout(&o));
    assert_eq!(us(&spread, "[blocked]", "self_us"), 70_000);
    assert!(!spread.iter().any(|r| r["function"] == "[blocked, under 5 ms]"), "{spread:?}");
    assert_eq!(us(&spread, "hot_a", "total_us"), 3_000 + 40_000 + 300_000 + 100_000);
    assert_eq!(us(&spread, "hot_b", "total_us"), 1_000 + 6_000 + 100_000 + 6_500);
    assert_eq!(us(&spread, "[blocked: clock_nanosleep]", "self_us"), 50_000 + 506_500);
    assert!(!spread.iter().any(|r| r["function"] == "[waiting for CPU]"), "{spread:?}");
    let table = ok(&["top", f, "--off-cpu", "--spread-blocked"]);
    assert!(
        table.starts_with(
            "626.5 ms off-CPU, blocked\n(30.0 ms waiting for a CPU (preempted) not counted: --wall counts it)\n506.5 ms blocked, no stack: estimated from 6 wait(s) with one (--spread-blocked)\n\
             70.0 ms blocked, no stack: kept (no wait of its threads had one)\n"
        ),
        "{table}"
    );
    // The header fits an 80-column terminal.
    assert!(table.lines().take(3).all(|l| l.chars().count() <= 80), "{table}");
    // The window's own waits set the proportions: before 1.5 s, the short
    // ones only.
    let early =
        rows(&ok(&["top", f, "--off-cpu", "--spread-blocked", "--to", "1500000", "--json", "-n", "0"]));
    assert_eq!(us(&early, "hot_a", "total_us"), 3_000 + 300_000);
    assert_eq!(us(&early, "hot_b", "total_us"), 1_000 + 100_000);
    // Per process, the JSON says what the estimate moved.
    let per: Value =
        serde_json::from_str(&ok(&["top", f, "--off-cpu", "--spread-blocked", "--per-process", "--json"]))
            .unwrap();
    assert_eq!(per[0]["spread_blocked"]["moved_us"], 506_500, "{per}");
    assert_eq!(per[0]["spread_blocked"]["kept_us"], 70_000, "{per}");
    assert_eq!(per[0]["spread_blocked"]["waits_with_a_stack"], 6, "{per}");
    // One thread: idle keeps its [blocked].
    let idle =
        rows(&ok(&["top", f, "--off-cpu", "--spread-blocked", "--thread", "idle", "--json", "-n", "0"]));
    assert_eq!(us(&idle, "[blocked]", "self_us"), 70_000);
    let table = ok(&["top", f, "--off-cpu", "--spread-blocked", "--thread", "idle"]);
    assert!(
        table.contains("\n70.0 ms blocked, no stack: kept (no wait of its threads had one)\n"),
        "{table}"
    );
    // A CPU-only spool: nothing to say about it.
    let (_plain_dir, cpu_only) = fixture();
    let table = ok(&["top", s(&cpu_only), "--off-cpu", "--spread-blocked"]);
    assert!(!table.contains("no stack"), "{table}");
    // --wall: the CPU samples beside the same spread.
    let wall = rows(&ok(&["top", f, "--wall", "--spread-blocked", "--json", "-n", "0"]));
    assert_eq!(us(&wall, "hot_b", "total_us"), INTERVAL_US + 113_500);
    // CPU samples have no [blocked]: refused.
    let o = spulse(&["top", f, "--spread-blocked"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--spread-blocked needs --off-cpu or --wall"), "{}", stderr(&o));
    // Without it, top says (on stderr) that most blocked time has no stack:
    // 576.5 of 626.5 ms.
    let o = spulse(&["top", f, "--off-cpu"]);
    assert!(stderr(&o).contains("spulse: 92% of the spool's blocked time has no stack"), "{}", stderr(&o));
    let o = spulse(&["top", f, "--off-cpu", "--spread-blocked"]);
    assert!(!stderr(&o).contains("has no stack"), "{}", stderr(&o));
    // info points at it.
    assert!(ok(&["info", f]).contains("`top --off-cpu --spread-blocked` estimates where"));
    // Collapsed: hot_b's line holds its waits and its shares, to the microsecond.
    let folded = p.dir.path().join("spread.folded");
    ok(&["export", f, "--off-cpu", "--spread-blocked", "-o", s(&folded)]);
    let text = std::fs::read_to_string(&folded).unwrap();
    assert!(text.lines().any(|l| l.ends_with("hot_b;[blocked: clock_nanosleep] 113500")), "{text}");
    assert!(text.lines().any(|l| l == "[blocked] 70000"), "{text}");
    // pprof (in the CPU mode too): the off-cpu values move, their sum stays.
    let pb = p.dir.path().join("spread.pb.gz");
    ok(&["export", f, "--spread-blocked", "-o", s(&pb)]);
    let prof = read_pprof(&pb);
    assert_eq!(prof.sample.iter().map(|s| s.value[2]).sum::<i64>(), 656_500_000);
    let leaf_only: i64 = prof.sample.iter().filter(|s| s.location_id.len() == 1).map(|s| s.value[2]).sum();
    assert_eq!(leaf_only, 70_000_000, "only idle's [blocked] is a stack of one frame");
    // Firefox: an interval without a stack becomes one sample per stack it
    // is charged to (the sums two each, the two single waits one each; the
    // preempted interval is the wall view's).
    let out = p.dir.path().join("spread.json");
    ok(&["export", f, "--format", "firefox", "--off-cpu", "--spread-blocked", "-o", s(&out)]);
    let (_, samples) = fx_samples(&serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap());
    assert_eq!(samples.len(), 6 + 8 * 2 + 2 + 1, "{samples:?}");
    let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
    assert!(close(weight_where(&samples, |_| true), 626.5), "{samples:?}");
    assert!(close(weight_where(&samples, |s| s.leaf == "[blocked]"), 70.0), "{samples:?}");
    // A CPU view of another format is refused.
    let o = spulse(&["export", f, "--spread-blocked", "-o", s(&folded)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));

    // A wait with a stack written in two parts (the recorder splits the waits
    // open at a live reader's window edge) counts once: one wait under
    // hot_b, one under hot_a, so 40 ms of short waits go half to each.
    let split = p.dir.path().join("split.spool");
    let (mut w, s_a, s_b, t1) = hot_spool(&p, &split);
    let sleep = w.define_label("blocked: clock_nanosleep").unwrap();
    let short = w.define_label("blocked, under 5 ms").unwrap();
    let (s_sleep_a, s_sleep_b) =
        (w.define_stack(Some(s_a), sleep).unwrap(), w.define_stack(Some(s_b), sleep).unwrap());
    let s_sums = w.define_stack(None, short).unwrap();
    w.off_cpu(t1, s_sleep_b, START_US + 1_000, 2_000, false).unwrap();
    w.off_cpu(t1, s_sleep_b, START_US + 3_000, 2_000, false).unwrap();
    w.off_cpu(t1, s_sleep_a, START_US + 10_000, 2_000, false).unwrap();
    w.off_cpu(t1, s_sums, START_US + 20_000, 40_000, false).unwrap();
    w.into_inner().unwrap();
    let spread = rows(&ok(&["top", s(&split), "--off-cpu", "--spread-blocked", "--json", "-n", "0"]));
    assert_eq!(us(&spread, "hot_a", "total_us"), 2_000 + 20_000);
    assert_eq!(us(&spread, "hot_b", "total_us"), 4_000 + 20_000);
}

/// A C program that sleeps 10 ms 150 times, always in `nap`.
const NAPPER: &str = r#"
#include <time.h>
__attribute__((noinline)) void nap(void) {
  struct timespec t = {0, 10000000};
  nanosleep(&t, 0);
  __asm__ volatile("");
}
int main(void) {
  for (int i = 0; i < 150; i++) nap();
  return 0;
}
"#;

/// Recorded for real: 10 ms sleeps are measured exactly, but most have no
/// stack (a tick must find them in progress); with `--spread-blocked` the
/// thread's stackless time goes where its waits with a stack were, `nap`.
#[test]
fn spread_blocked_puts_a_recorded_sleepers_waits_under_its_sleep() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("napper.c");
    std::fs::write(&src, NAPPER).unwrap();
    let exe = dir.path().join("napper");
    let o =
        std::process::Command::new("cc").args(["-O1", "-o"]).arg(&exe).arg(&src).output().expect("run cc");
    assert!(o.status.success(), "cc: {}", stderr(&o));
    let out = dir.path().join("nap.spool");
    ok(&["record", "--off-cpu", "-o", s(&out), "--", s(&exe)]);
    let f = s(&out);
    let total_us = |rows: &[Value], name: &str| {
        rows.iter().find(|r| r["function"] == name).map_or(0, |r| r["total_us"].as_u64().unwrap())
    };
    let plain = rows(&ok(&["top", f, "--off-cpu", "--json", "-n", "0"]));
    let blocked = total_us(&plain, "main");
    let stackless = total_us(&plain, "[blocked]") + total_us(&plain, "[blocked, under 5 ms]");
    // 150 sleeps of at least 10 ms each.
    assert!(blocked + stackless >= 1_500_000, "main {blocked} us, [blocked] {stackless} us: {plain:?}");
    let spread = rows(&ok(&["top", f, "--off-cpu", "--spread-blocked", "--json", "-n", "0"]));
    let nap = total_us(&spread, "nap");
    let left = total_us(&spread, "[blocked]") + total_us(&spread, "[blocked, under 5 ms]");
    assert_eq!(total_us(&spread, "main") + left, blocked + stackless, "totals do not change: {spread:?}");
    assert!(nap * 10 >= (blocked + stackless) * 9, "nap {nap} us of {} us: {spread:?}", blocked + stackless);
    assert_eq!(left, 0, "the thread had waits with a stack: {spread:?}");
}

/// The workload of issue 28 (a thread sleeping 1.0 s in all, one blocked
/// 0.6 s on a mutex another holds while burning CPU, one reading a pipe
/// written 0.4 s after the start, two burners), in C with frame pointers, so
/// that the walk from a blocked thread's system call needs a guessed frame
/// pointer (`/proc/<tid>/syscall` gives none). `main` keeps its six thread
/// functions in an array on its stack: read as return addresses, they walk
/// like a chain of frames (each the end of the function before it). Each
/// wait is longer than the writer's tick (100 ms) plus 5 ms, so each gets a
/// stack. Each waiting function prints the time it measured itself.
const TRUTH_C: &str = r#"
#define _GNU_SOURCE
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t mtx = PTHREAD_MUTEX_INITIALIZER;
static sem_t held;
static int pfd[2];
static pthread_barrier_t bar;
static volatile unsigned long sink;

static double now(clockid_t c) { struct timespec t; clock_gettime(c, &t); return t.tv_sec + t.tv_nsec / 1e9; }

__attribute__((noinline)) void spin_work(void) { for (int i = 0; i < 10000; i++) sink += i * 7; }

__attribute__((noinline)) void burn_cpu_seconds(double s) {
    double t0 = now(CLOCK_THREAD_CPUTIME_ID);
    while (now(CLOCK_THREAD_CPUTIME_ID) - t0 < s) spin_work();
}

__attribute__((noinline)) void sleeper_nap(void) {
    struct timespec ts = {0, 200000000};
    nanosleep(&ts, NULL);
}
void *sleeper_thread(void *a) {
    pthread_setname_np(pthread_self(), "sleeper");
    pthread_barrier_wait(&bar);
    double t0 = now(CLOCK_MONOTONIC);
    for (int i = 0; i < 5; i++) sleeper_nap();
    fprintf(stderr, "TRUE sleeper_nap %.1f ms\n", (now(CLOCK_MONOTONIC) - t0) * 1e3);
    return a;
}

__attribute__((noinline)) void holder_burn_while_locked(void) {
    double t0 = now(CLOCK_MONOTONIC);
    while (now(CLOCK_MONOTONIC) - t0 < 0.6) spin_work();
}
void *holder_thread(void *a) {
    pthread_setname_np(pthread_self(), "holder");
    pthread_barrier_wait(&bar);
    pthread_mutex_lock(&mtx);
    sem_post(&held);
    holder_burn_while_locked();
    pthread_mutex_unlock(&mtx);
    return a;
}

__attribute__((noinline)) void waiter_lock_mutex(void) {
    double t0 = now(CLOCK_MONOTONIC);
    pthread_mutex_lock(&mtx);
    double t1 = now(CLOCK_MONOTONIC);
    fprintf(stderr, "TRUE waiter_lock_mutex %.1f ms\n", (t1 - t0) * 1e3);
    pthread_mutex_unlock(&mtx);
}
__attribute__((noinline)) void waiter_wait_for_holder(void) { sem_wait(&held); }
void *waiter_thread(void *a) {
    pthread_setname_np(pthread_self(), "waiter");
    pthread_barrier_wait(&bar);
    waiter_wait_for_holder();
    waiter_lock_mutex();
    return a;
}

__attribute__((noinline)) void reader_read_pipe(void) {
    char buf[16];
    double t0 = now(CLOCK_MONOTONIC);
    ssize_t n = read(pfd[0], buf, sizeof buf);
    double t1 = now(CLOCK_MONOTONIC);
    fprintf(stderr, "TRUE reader_read_pipe %.1f ms (n=%zd)\n", (t1 - t0) * 1e3, n);
}
void *reader_thread(void *a) {
    pthread_setname_np(pthread_self(), "reader");
    pthread_barrier_wait(&bar);
    reader_read_pipe();
    return a;
}

__attribute__((noinline)) void burner_a_work(void) { burn_cpu_seconds(0.2); }
__attribute__((noinline)) void burner_b_work(void) { burn_cpu_seconds(0.2); }
void *burner_a(void *a) { pthread_setname_np(pthread_self(), "burnA"); pthread_barrier_wait(&bar); double t0=now(CLOCK_MONOTONIC); burner_a_work(); fprintf(stderr, "TRUE burner_a wall %.1f ms\n", (now(CLOCK_MONOTONIC)-t0)*1e3); return a; }
void *burner_b(void *a) { pthread_setname_np(pthread_self(), "burnB"); pthread_barrier_wait(&bar); double t0=now(CLOCK_MONOTONIC); burner_b_work(); fprintf(stderr, "TRUE burner_b wall %.1f ms\n", (now(CLOCK_MONOTONIC)-t0)*1e3); return a; }

__attribute__((noinline)) void main_feed_pipe_later(void) {
    struct timespec ts = {0, 400000000};
    nanosleep(&ts, NULL);
    if (write(pfd[1], "x", 1) != 1) abort();
}

int main(void) {
    if (pipe(pfd)) return 1;
    sem_init(&held, 0, 0);
    pthread_barrier_init(&bar, NULL, 7);
    pthread_t t[6];
    void *(*fns[6])(void *) = {sleeper_thread, holder_thread, waiter_thread, reader_thread, burner_a, burner_b};
    for (int i = 0; i < 6; i++) pthread_create(&t[i], NULL, fns[i], NULL);
    pthread_barrier_wait(&bar);
    double t0 = now(CLOCK_MONOTONIC);
    main_feed_pipe_later();
    fprintf(stderr, "TRUE main_feed_pipe_later %.1f ms\n", (now(CLOCK_MONOTONIC) - t0) * 1e3);
    for (int i = 0; i < 6; i++) pthread_join(t[i], NULL);
    fprintf(stderr, "TRUE total wall %.1f ms\n", (now(CLOCK_MONOTONIC) - t0) * 1e3);
    return 0;
}
"#;

/// A blocked thread's stack is its own down to the root: each waiting
/// function's off-CPU time (every stack holding it) is within 5% of the time
/// it measured itself, and no wait is charged through a function pointer or
/// a stale frame record into functions that were not its callers (the
/// deepest walk among the guessed frame records took them: `main`'s wait
/// went under all six thread functions' neighbours, `sleeper_nap` +40%,
/// `reader_read_pipe` +98%).
#[test]
fn a_blocked_threads_stack_is_its_own_to_the_root() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("truth.c");
    std::fs::write(&src, TRUTH_C).unwrap();
    let exe = dir.path().join("truth");
    let cc = std::process::Command::new("cc")
        .args(["-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(cc.status.success(), "cc: {}", stderr(&cc));
    let spool = dir.path().join("truth.spool");
    let o = spulse(&["record", "--off-cpu", "-o", s(&spool), "--", s(&exe)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let truth = |name: &str| -> f64 {
        let err = stderr(&o);
        let line = err.lines().find(|l| l.starts_with(&format!("TRUE {name} "))).expect(&err);
        let ms: f64 = line.split(' ').nth(2).unwrap().parse().unwrap();
        ms * 1000.0
    };
    let collapsed = ok(&["export", s(&spool), "--off-cpu", "-f", "collapsed", "-o", "-"]);
    for (func, leaf) in [
        ("sleeper_nap", "[blocked: clock_nanosleep]"),
        ("waiter_lock_mutex", "[blocked: futex]"),
        ("reader_read_pipe", "[blocked: read]"),
        ("main_feed_pipe_later", "[blocked: clock_nanosleep]"),
    ] {
        let mut total = 0.0;
        for line in collapsed.lines() {
            let (stack, us) = line.rsplit_once(' ').unwrap();
            if !stack.split(';').any(|f| f == func) {
                continue;
            }
            total += us.parse::<f64>().unwrap();
            if stack.ends_with(leaf) {
                assert!(
                    stack.starts_with("_start;")
                        || stack.starts_with("clone3;")
                        || stack.starts_with("clone;"),
                    "a wait in {func} not unwound to the root: {line}"
                );
            }
            assert!(
                !stack.contains("burner_") && !stack.contains("malloc"),
                "a wait in {func} charged through stale frames: {line}"
            );
        }
        let t = truth(func);
        assert!((total - t).abs() <= 0.05 * t, "{func}: {total} us off-CPU against {t} us:\n{collapsed}");
    }
    // main waits under main, its thread functions under the threads; the
    // burners never block (their off-CPU time is waiting for a CPU).
    assert!(collapsed.lines().any(|l| l.contains("main;main_feed_pipe_later;")), "{collapsed}");
    assert!(!collapsed.lines().any(|l| l.contains("burner_") && l.contains("[blocked")), "{collapsed}");
}

/// `--from`/`--to` cut each off-CPU interval to the window: one thread
/// blocked for a second from 100 ms in shows 100 ms in a 100 ms window inside
/// its wait, the part after the window's start in a window that starts
/// inside it, the part before the end in one that ends inside it, and
/// nothing in a window before or after it. (An interval was selected whole
/// by its start: a 100 ms window of a 7-thread program read 5.3 s.)
#[test]
fn a_time_window_cuts_the_waits_at_its_edges() {
    let p = program();
    let path = p.dir.path().join("window.spool");
    let (mut w, _s_a, s_b, t1) = hot_spool(&p, &path);
    let futex = w.define_label("blocked: futex").unwrap();
    let s_futex = w.define_stack(Some(s_b), futex).unwrap();
    w.sample(START_US + 50_000, t1, s_b).unwrap();
    w.off_cpu(t1, s_futex, START_US + 100_000, 1_000_000, false).unwrap();
    w.sample(START_US + 1_200_000, t1, s_b).unwrap();
    w.into_inner().unwrap();
    let f = s(&path);
    let blocked = |from: u64, to: u64| -> u64 {
        let (from, to) = (from.to_string(), to.to_string());
        let json = ok(&["top", f, "--off-cpu", "--json", "-n", "0", "--from", &from, "--to", &to]);
        rows(&json)
            .iter()
            .find(|r| r["function"] == "[blocked: futex]")
            .map_or(0, |r| r["self_us"].as_u64().unwrap())
    };
    assert_eq!(blocked(500_000, 600_000), 100_000);
    assert_eq!(blocked(0, 2_000_000), 1_000_000);
    assert_eq!(blocked(600_000, 2_000_000), 500_000);
    assert_eq!(blocked(0, 300_000), 200_000);
    assert_eq!(blocked(0, 100_000), 0);
    assert_eq!(blocked(1_100_000, 2_000_000), 0);
    // The wall view and the exports cut the same way.
    let wall = rows(&ok(&["top", f, "--wall", "--json", "-n", "0", "--from", "500000", "--to", "600000"]));
    assert_eq!(row(&wall, "[blocked: futex]")["self_us"], 100_000);
    let collapsed =
        ok(&["export", f, "--off-cpu", "-f", "collapsed", "-o", "-", "--from", "500000", "--to", "600000"]);
    let total: u64 = collapsed.lines().map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap()).sum();
    assert_eq!(total, 100_000, "{collapsed}");
}

/// A spool whose blocked waits all lack a stack (as a process that is not
/// dumpable records them): `top` says so and points at `info`, instead of
/// suggesting `--spread-blocked`, which has nothing to estimate from. Per
/// process, `--json` gives `total_us` in every mode and `samples` only
/// where the total counts samples.
#[test]
fn stackless_waits_only_point_at_info_and_per_process_json_says_microseconds() {
    let p = program();
    let path = p.dir.path().join("stackless.spool");
    let (mut w, s_a, _s_b, t1) = hot_spool(&p, &path);
    let blocked = w.define_label("blocked").unwrap();
    let short = w.define_label("blocked, under 5 ms").unwrap();
    let s_blocked = w.define_stack(None, blocked).unwrap();
    let s_short = w.define_stack(None, short).unwrap();
    for i in 0..10u64 {
        w.sample(START_US + i * INTERVAL_US, t1, s_a).unwrap();
    }
    w.off_cpu(t1, s_blocked, START_US + 20_000, 30_000, false).unwrap();
    w.off_cpu(t1, s_short, START_US + 60_000, 4_000, false).unwrap();
    w.into_inner().unwrap();
    let f = s(&path);
    let o = spulse(&["top", f, "--off-cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("no blocked wait in this spool has a stack: `spulse info` says why"), "{err}");
    assert!(!err.contains("--spread-blocked estimates"), "{err}");
    let per = |mode: &[&str]| -> Value {
        let mut a = vec!["top", f, "--per-process", "--json"];
        a.extend_from_slice(mode);
        serde_json::from_str::<Value>(&ok(&a)).unwrap()[0].clone()
    };
    let off = per(&["--off-cpu"]);
    assert_eq!(off["total_us"], 34_000, "{off}");
    assert!(off.get("samples").is_none(), "microseconds are not samples: {off}");
    let wall = per(&["--wall"]);
    assert_eq!(wall["total_us"], 34_000 + 10 * INTERVAL_US, "{wall}");
    let cpu = per(&[]);
    assert_eq!(
        (cpu["samples"].as_u64(), cpu["total_us"].as_u64()),
        (Some(10), Some(10 * INTERVAL_US)),
        "{cpu}"
    );
}
