//! The off-CPU views over a spool with off-CPU intervals (FORMAT.md, tag 9):
//! `top --off-cpu` and `--wall` charge each interval's duration to where the
//! thread waited (`[blocked: futex]` under its caller), `top --json` rows
//! carry `self_us`/`total_us` in every mode, the pprof export has an
//! `off-cpu` sample type in nanoseconds, and collapsed weighs by time.
//! CPU figures are the same with and without the intervals.

mod common;

use common::*;
use serde_json::Value;
use spulse::{Header, SpoolWriter};

/// The standard program's stacks: 300 CPU samples of main;hot_a (1 ms each),
/// 100 of main;hot_b, and off-CPU: 600 ms blocked in futex under hot_b and
/// 250 ms waiting for a CPU under hot_a, in intervals of 50 ms.
fn spool(p: &Program, path: &std::path::Path) {
    let file = std::fs::File::create(path).unwrap();
    let mut w = SpoolWriter::new(file, Header { start_time_us: START_US, interval_us: INTERVAL_US }).unwrap();
    let module_path = p.path.as_os_str().as_encoded_bytes().to_vec();
    let m = define_program(&mut w, p, PID, &module_path, &p.build_id);
    let (s_a, s_b) = define_hot_stacks(&mut w, p, m);
    let t1 = w.define_thread(PID, 1001, "main").unwrap();
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
    // Off-CPU: the waits, in microseconds, under their callers.
    let off = rows(&ok(&["top", f, "--off-cpu", "--json", "-n", "0"]));
    assert_eq!(row(&off, "[blocked: futex]")["self_us"], 600_000);
    assert_eq!(row(&off, "[waiting for CPU]")["self_us"], 250_000);
    assert_eq!(row(&off, "hot_b")["total_us"], 600_000);
    assert_eq!(row(&off, "hot_b")["self_us"], 0);
    assert_eq!(row(&off, "main")["total_us"], 850_000);
    // Wall: both.
    let wall = rows(&ok(&["top", f, "--wall", "--json", "-n", "0"]));
    assert_eq!(row(&wall, "main")["total_us"], 400 * INTERVAL_US + 850_000);
    assert_eq!(row(&wall, "hot_b")["total_us"], 100 * INTERVAL_US + 600_000);
    assert_eq!(row(&wall, "hot_b")["self_us"], 100 * INTERVAL_US);
    // The table shows milliseconds.
    let table = ok(&["top", f, "--off-cpu"]);
    assert!(table.starts_with("850.0 ms off-CPU"), "{table}");
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
    assert!(ok(&["info", s(&plain)]).contains("off-CPU:         not recorded"));
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
    assert!(text.lines().any(|l| l.ends_with("hot_a;[waiting for CPU] 250000")), "{text}");
    // A CPU-only spool's pprof keeps two sample types.
    let (plain_p, plain) = fixture();
    let out = plain_p.dir.path().join("plain.pb.gz");
    ok(&["export", s(&plain), "-o", s(&out)]);
    assert_eq!(read_pprof(&out).sample_type.len(), 2);
}
