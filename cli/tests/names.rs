//! What a user reads first in a recording of a process tree: program names in
//! `info`, `top --per-process` and the Firefox export, and the counts above
//! `info`'s process table.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::Value;

/// Record `sh -c script` in `dir` with the real tool.
fn record(dir: &Path, script: &str) -> std::path::PathBuf {
    let out = dir.join("tree.spool");
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o", s(&out), "--", "sh", "-c", script])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "record failed: {}", stderr(&o));
    out
}

#[test]
fn programs_are_the_executables_they_ran_last() {
    let dir = tempfile::tempdir().unwrap();
    // `li`: a program whose name is a prefix of libc's and libgcc_s's file
    // names (as `ld` is of ld-linux's). The subshell first burns CPU as bash,
    // then execs it: its main thread was first named after bash.
    let gzip = Path::new("/usr/bin/gzip");
    let bash = Path::new("/bin/bash");
    if !gzip.is_file() || !bash.is_file() {
        eprintln!("SKIPPED programs_are_the_executables_they_ran_last: needs /usr/bin/gzip and /bin/bash");
        return;
    }
    std::fs::copy(gzip, dir.path().join("li")).unwrap();
    let big = dir.path().join("big");
    std::fs::write(
        &big,
        (0..4_000_000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect::<Vec<_>>(),
    )
    .unwrap();
    let li = std::fs::canonicalize(dir.path().join("li")).unwrap();
    let script = format!(
        "bash -c '(i=0; while [ $i -lt 40000 ]; do i=$((i+1)); done; exec {li} -c {big} > /dev/null)'; \
         {li} -9 -c {big} > /dev/null",
        li = li.display(),
        big = big.display()
    );
    let spool = record(dir.path(), &script);

    let info: Value = serde_json::from_str(&ok(&["info", s(&spool), "--json"])).unwrap();
    let procs = info["process_list"].as_array().unwrap();
    let with_samples: Vec<&Value> = procs.iter().filter(|p| p["samples"].as_u64().unwrap() > 0).collect();
    let li_path = li.display().to_string();
    // Both li processes (the exec'd subshell and the direct one) are named li,
    // and every process with samples is named after a program it ran, never a library.
    let li_rows = procs.iter().filter(|p| p["program"] == li_path.as_str()).count();
    assert!(li_rows >= 2, "li processes named li: {li_rows}; {procs:#?}");
    for p in &with_samples {
        let prog = p["program"].as_str().unwrap();
        assert!(!prog.contains(".so"), "a library as a program: {p}");
    }
    // The counts above the table agree with it.
    assert_eq!(info["processes"].as_u64().unwrap() as usize, procs.len());
    assert_eq!(info["processes_with_samples"].as_u64().unwrap() as usize, with_samples.len());
    let text = ok(&["info", s(&spool)]);
    let line = text.lines().find(|l| l.starts_with("processes:")).unwrap();
    assert!(line.contains(&format!("{} ({} with samples)", procs.len(), with_samples.len())), "{line}");

    // top --per-process names them the same way.
    let top = ok(&["top", s(&spool), "--per-process", "-n", "3"]);
    let headers: Vec<&str> = top.lines().filter(|l| l.starts_with("process ")).collect();
    assert!(headers.iter().filter(|h| h.contains(&li_path)).count() >= 2, "{top}");
    assert!(!headers.iter().any(|h| h.contains(".so")), "{top}");

    // And the Firefox export.
    let fx = dir.path().join("p.json");
    ok(&["export", s(&spool), "--format", "firefox", "--no-symbolize", "-o", s(&fx)]);
    let v: Value = serde_json::from_slice(&std::fs::read(&fx).unwrap()).unwrap();
    let names: Vec<String> = v["threads"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["processName"].as_str().map(str::to_owned))
        .collect();
    assert!(names.iter().filter(|n| n.as_str() == "li").count() >= 2, "{names:?}");
}

/// `--thread` takes a name as well as a tid; an unknown name is an error that
/// lists the names there are.
#[test]
fn thread_by_name() {
    let (_p, spool) = fixture();
    let by_tid: Value = serde_json::from_str(&ok(&["top", s(&spool), "--thread", "1002", "--json"])).unwrap();
    let by_name: Value =
        serde_json::from_str(&ok(&["top", s(&spool), "--thread", "worker", "--json"])).unwrap();
    assert_eq!(by_tid, by_name);
    let all: Value = serde_json::from_str(&ok(&["top", s(&spool), "--json"])).unwrap();
    assert_ne!(all, by_name);
    let o = spulse(&["top", s(&spool), "--thread", "hasher"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("no thread named hasher") && e.contains("main, worker"), "{e}");
    assert!(!e.contains("invalid digit"), "{e}");
}

/// `-o NAME` picks the format from NAME's extension; a name that says nothing
/// needs `--format`, and `--format` still wins.
#[test]
fn export_format_from_the_output_name() {
    let (p, spool) = fixture();
    let d = p.dir.path();
    let svg = d.join("flame.svg");
    ok(&["export", s(&spool), "-o", s(&svg)]);
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    let pb = d.join("p.pb.gz");
    ok(&["export", s(&spool), "-o", s(&pb)]);
    assert_eq!(&std::fs::read(&pb).unwrap()[..2], &[0x1f, 0x8b], "gzip");
    let ss = d.join("p.speedscope.json");
    ok(&["export", s(&spool), "-o", s(&ss)]);
    assert!(std::fs::read_to_string(&ss).unwrap().contains("speedscope.app"));
    let fx = d.join("p.json");
    ok(&["export", s(&spool), "-o", s(&fx)]);
    let v: Value = serde_json::from_slice(&std::fs::read(&fx).unwrap()).unwrap();
    assert!(v["meta"].is_object() && v["threads"].is_array(), "firefox");
    let folded = d.join("p.folded");
    ok(&["export", s(&spool), "-o", s(&folded)]);
    assert!(std::fs::read_to_string(&folded).unwrap().lines().all(|l| l.rsplit_once(' ').is_some()));
    let forced = d.join("forced.svg");
    ok(&["export", s(&spool), "--format", "collapsed", "-o", s(&forced)]);
    assert!(!std::fs::read_to_string(&forced).unwrap().contains("<svg"));
    let o = spulse(&["export", s(&spool), "-o", s(&d.join("p.out"))]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("give --format"), "{}", stderr(&o));
}
