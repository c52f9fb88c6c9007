//! A real recording: the library's `quickstart` example (three parts
//! `parse_records` for one part `compress_block`) read by every command and
//! export, with `go tool pprof` as the oracle for pprof (outside CI, when it is
//! missing, only that check is skipped, loudly: `common::oracle`).
//!
//! The example binary is taken from the same target directory
//! (`cargo test --workspace --all-targets` builds it); when it has not been
//! built, the test says so and builds it with cargo.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use common::*;
use serde_json::Value;

fn quickstart() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/recording-HASH -> target/<profile>/examples/quickstart
    let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
    let path = profile_dir.join("examples").join("quickstart");
    if !path.exists() {
        eprintln!("building the quickstart example (not built by this cargo invocation)");
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.args(["build", "-p", "spulse", "--example", "quickstart"]);
        if release {
            cmd.arg("--release");
        }
        cmd.env("CARGO_TARGET_DIR", profile_dir.parent().unwrap());
        // Never hang on a build lock: give up after ten minutes.
        let mut child = cmd.spawn().expect("run cargo");
        let t0 = std::time::Instant::now();
        let st = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if t0.elapsed() > std::time::Duration::from_secs(600) {
                let _ = child.kill();
                panic!("building the quickstart example took over 10 minutes; build it first");
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        };
        assert!(st.success(), "building the quickstart example failed");
    }
    path
}

fn record() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("qs.spool");
    let o = Command::new(quickstart()).arg(&spool).output().expect("run quickstart");
    assert!(o.status.success(), "quickstart failed: {}", String::from_utf8_lossy(&o.stderr));
    (dir, spool)
}

fn share(parse: f64, compress: f64) -> f64 {
    parse / (parse + compress)
}

#[test]
fn real_recording_through_every_command() {
    let (dir, spool) = record();
    let info: Value = serde_json::from_str(&ok(&["info", s(&spool), "--json"])).unwrap();
    let samples = info["samples"].as_u64().unwrap();
    assert!(samples > 200, "{info}");
    assert_eq!(info["threads"], 3, "three workers");
    assert!(info["modules"].as_u64().unwrap() >= 2);
    assert_eq!(info["recovered_from_truncated_tail"], false);

    // top: both hot functions named, in roughly the workload's proportion.
    let rows: Value = serde_json::from_str(&ok(&["top", s(&spool), "--json", "-n", "0"])).unwrap();
    let rows = rows.as_array().unwrap();
    let total_of = |name: &str| {
        rows.iter().find(|r| r["function"] == name).unwrap_or_else(|| panic!("{name} not in top: {rows:?}"))
            ["total"]
            .as_u64()
            .unwrap() as f64
    };
    let (parse, compress) = (total_of("quickstart::parse_records"), total_of("quickstart::compress_block"));
    let sh = share(parse, compress);
    assert!((0.6..0.95).contains(&sh), "parse share {sh}: {parse} vs {compress}");
    assert!(parse + compress >= 0.9 * samples as f64, "the workers' time is in the hot functions");

    // Folded stacks (inlined functions nested under their caller) agree with
    // the self counts of `top --inlines`.
    let folded = dir.path().join("qs.folded");
    ok(&["export", s(&spool), "--format", "collapsed", "-o", s(&folded)]);
    let mut leaf: HashMap<String, u64> = HashMap::new();
    let mut sum = 0;
    for l in std::fs::read_to_string(&folded).unwrap().lines() {
        let (stack, n) = l.rsplit_once(' ').unwrap();
        let n: u64 = n.parse().unwrap();
        sum += n;
        *leaf.entry(stack.rsplit(';').next().unwrap().to_string()).or_default() += n;
    }
    assert_eq!(sum, samples);
    let inl: Value =
        serde_json::from_str(&ok(&["top", s(&spool), "--json", "-n", "0", "--inlines"])).unwrap();
    // Folded stacks name frames only: functions of one name in two modules
    // (`clock_gettime` in libc and in the vDSO) are one frame there and two
    // rows in `top`, summed here.
    let mut self_of: HashMap<String, u64> = HashMap::new();
    for r in inl.as_array().unwrap() {
        *self_of.entry(r["function"].as_str().unwrap().to_string()).or_default() +=
            r["self"].as_u64().unwrap();
    }
    for (name, n) in &self_of {
        assert_eq!(leaf.get(name).copied().unwrap_or(0), *n, "{name}");
    }

    // go tool pprof reads the pprof export and finds the same proportion.
    let pb = dir.path().join("qs.pb.gz");
    ok(&["export", s(&spool), "--format", "pprof", "-o", s(&pb)]);
    if have_go_pprof() {
        check_with_go_pprof(&pb, dir.path(), parse, compress);
    }

    // Firefox and speedscope name the hot functions.
    let ff = dir.path().join("qs.json");
    ok(&["export", s(&spool), "--format", "firefox", "-o", s(&ff)]);
    let text = std::fs::read_to_string(&ff).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["threads"].as_array().unwrap().len(), 3);
    assert!(text.contains("quickstart::parse_records") && text.contains("quickstart::compress_block"));
    let sc = dir.path().join("qs.speedscope.json");
    ok(&["export", s(&spool), "--format", "speedscope", "-o", s(&sc)]);
    assert!(std::fs::read_to_string(&sc).unwrap().contains("quickstart::parse_records"));
    let svg = dir.path().join("qs.svg");
    ok(&["export", s(&spool), "--format", "svg", "-o", s(&svg)]);
    assert!(std::fs::read_to_string(&svg).unwrap().contains("parse_records"));
}

/// `go tool pprof` reads the pprof export and finds the same totals as `top`.
fn check_with_go_pprof(pb: &std::path::Path, dir: &std::path::Path, parse: f64, compress: f64) {
    let o = Command::new("go")
        .args(["tool", "pprof", "-top", "-cum", "-symbolize=none", "-sample_index=samples", "-nodecount=200"])
        .arg(pb)
        .env("PPROF_TMPDIR", dir)
        .env("HOME", dir)
        .output()
        .expect("go tool pprof (Debian's golang-go)");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cum = |name: &str| -> f64 {
        let line = text
            .lines()
            .find(|l| l.split_whitespace().skip(5).collect::<Vec<_>>().join(" ") == name)
            .unwrap_or_else(|| panic!("{name} not in go tool pprof output:\n{text}"));
        line.split_whitespace().nth(3).unwrap().parse().unwrap()
    };
    let (gp, gc) = (cum("quickstart::parse_records"), cum("quickstart::compress_block"));
    assert_eq!((gp, gc), (parse, compress), "go tool pprof agrees with top");
}
