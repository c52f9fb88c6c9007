//! The library's `quickstart` example and `spulse top` tell the same story: the
//! example's own self-time summary (symbol-table names, so inlined helpers are
//! part of the function they were inlined into) and `top`'s default view list
//! the same hottest functions with the same shares.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Build the example with the cargo that runs this test, into the same target
/// directory, and return its path. `--workspace`, so that the features are
/// unified as in the workspace build that built this test and nothing is
/// compiled again (`-p spulse` alone would rebuild spulse and its
/// dependencies with other features).
fn build_quickstart() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // The spulse binary sits in <target>/<profile>/; examples in .../examples/.
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_spulse"));
    let profile_dir = bin.parent().unwrap();
    let target = profile_dir.parent().unwrap();
    let release = profile_dir.file_name().unwrap() == "release";
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(root)
        .args(["build", "--workspace", "--example", "quickstart", "--target-dir"])
        .arg(target);
    if release {
        cmd.arg("--release");
    }
    let o = cmd.output().expect("run cargo");
    assert!(o.status.success(), "cargo build --example quickstart: {}", String::from_utf8_lossy(&o.stderr));
    let exe = profile_dir.join("examples").join("quickstart");
    assert!(exe.is_file(), "{} not built", exe.display());
    exe
}

/// The example's "where the CPU time went" rows: name -> percent.
fn summary(stdout: &str) -> Vec<(String, f64)> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with("where the CPU time went"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .map(|l| {
            let (pct, name) = l.trim().split_once("%  ").expect("`  12.3%  name` row");
            (name.to_string(), pct.trim().parse().unwrap())
        })
        .collect()
}

#[test]
fn quickstart_summary_and_top_agree() {
    let exe = build_quickstart();
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("q.spool");
    let o = Command::new(&exe).arg(&spool).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "quickstart: {}\n{text}", String::from_utf8_lossy(&o.stderr));
    let rows = summary(&text);
    assert!(!rows.is_empty(), "no summary in:\n{text}");

    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["top", spool.to_str().unwrap(), "--json", "-n", "0"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let top: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let top: Vec<(String, f64)> = top
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["function"].as_str().unwrap().to_string(), r["self_percent"].as_f64().unwrap()))
        .collect();
    let by_name: HashMap<&str, f64> = top.iter().map(|(n, p)| (n.as_str(), *p)).collect();

    // The workload's own functions lead both, in the same order.
    assert_eq!(rows[0].0, "quickstart::parse_records", "example summary:\n{text}");
    assert_eq!(top[0].0, rows[0].0, "top: {top:?}\nexample:\n{text}");
    // Every function the example lists with a visible share has the same
    // share in top (the example prints one decimal).
    for (name, pct) in rows.iter().filter(|r| r.1 >= 1.0) {
        let t = by_name.get(name.as_str()).unwrap_or_else(|| panic!("{name} not in top: {top:?}"));
        assert!((t - pct).abs() <= 0.051, "{name}: example {pct}%, top {t}%");
    }
}
