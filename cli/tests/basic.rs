//! `info`, `top` and `export --format collapsed` on fixtures over a real ELF,
//! symbolization edge cases, and bad input for every command.

mod common;

use std::collections::HashMap;

use common::*;
use serde_json::Value;

fn top_json(args: &[&str]) -> Vec<Value> {
    let v: Value = serde_json::from_str(&ok(args)).expect("top --json parses");
    v.as_array().expect("array").clone()
}

fn find<'a>(rows: &'a [Value], name: &str) -> &'a Value {
    rows.iter().find(|r| r["function"] == name).unwrap_or_else(|| panic!("{name} missing from {rows:?}"))
}

#[test]
fn info_json_counts() {
    let (_p, spool) = fixture();
    let v: Value = serde_json::from_str(&ok(&["info", s(&spool), "--json"])).unwrap();
    assert_eq!(v["samples"], 400);
    assert_eq!(v["threads"], 2);
    assert_eq!(v["modules"], 1);
    assert_eq!(v["frames"], 3);
    assert_eq!(v["stacks"], 3);
    assert_eq!(v["start_time_us"], START_US);
    assert_eq!(v["interval_us"], INTERVAL_US);
    assert_eq!(v["duration_us"], 400 * INTERVAL_US);
    assert_eq!(v["recovered_from_truncated_tail"], false);
    // The spool does not record the engine, so neither output claims one.
    assert_eq!(v.get("engine"), None);
    let text = ok(&["info", s(&spool)]);
    assert!(text.contains("samples:         400"), "{text}");
    assert!(text.contains("engine:          not recorded in the spool"), "{text}");
    assert!(text.contains("hotprog"), "{text}");
}

#[test]
fn top_symbolizes_with_three_to_one_split() {
    let (_p, spool) = fixture();
    let rows = top_json(&["top", s(&spool), "--json"]);
    let a = find(&rows, "hot_a");
    let b = find(&rows, "hot_b");
    let m = find(&rows, "main");
    assert_eq!((a["self"].as_u64(), a["total"].as_u64()), (Some(300), Some(300)));
    assert_eq!((b["self"].as_u64(), b["total"].as_u64()), (Some(100), Some(100)));
    assert_eq!((m["self"].as_u64(), m["total"].as_u64()), (Some(0), Some(400)));
    assert_eq!(a["module"], "hotprog");
    assert_eq!(rows[0]["function"], "hot_a", "hottest first");
    assert!((a["self_percent"].as_f64().unwrap() - 75.0).abs() < 1e-9);

    let text = ok(&["top", s(&spool)]);
    assert!(text.lines().any(|l| l.contains("hot_a (hotprog)") && l.contains("75.00%")), "{text}");
    let by_total = top_json(&["top", s(&spool), "--json", "--sort", "total"]);
    assert_eq!(by_total[0]["function"], "main", "main has the most total samples");
    let n1 = ok(&["top", s(&spool), "-n", "1"]);
    assert_eq!(n1.lines().count(), 3, "total line, header and one row: {n1}");
}

#[test]
fn top_filters_by_thread_and_time() {
    let (_p, spool) = fixture();
    let rows = top_json(&["top", s(&spool), "--json", "--thread", "1002"]);
    assert_eq!(find(&rows, "hot_a")["self"], 100);
    assert!(rows.iter().all(|r| r["function"] != "hot_b"));
    // Samples 1..=400 are at 1000 us steps; [100000, 200000) holds 100 of them.
    let rows = top_json(&["top", s(&spool), "--json", "--from", "100000", "--to", "200000"]);
    assert_eq!(find(&rows, "main")["total"], 100);
    assert_eq!(find(&rows, "hot_a")["self"], 75);
    assert_eq!(find(&rows, "hot_b")["self"], 25);
}

#[test]
fn collapsed_agrees_with_top() {
    let (p, spool) = fixture();
    let out = p.dir.path().join("a.folded");
    ok(&["export", s(&spool), "--format", "collapsed", "-o", s(&out)]);
    let text = std::fs::read_to_string(&out).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort();
    assert_eq!(lines, ["main;hot_a 300", "main;hot_b 100"]);
    // Self counts from the folded leaves equal top's.
    let mut leaf: HashMap<String, u64> = HashMap::new();
    for l in text.lines() {
        let (stack, n) = l.rsplit_once(' ').unwrap();
        *leaf.entry(stack.rsplit(';').next().unwrap().to_string()).or_default() += n.parse::<u64>().unwrap();
    }
    for r in top_json(&["top", s(&spool), "--json", "-n", "0"]) {
        let name = r["function"].as_str().unwrap();
        assert_eq!(leaf.get(name).copied().unwrap_or(0), r["self"].as_u64().unwrap(), "{name}");
    }
}

#[test]
fn missing_module_file_shows_offsets() {
    let p = program();
    let spool = p.dir.path().join("gone.spool");
    write_spool(
        &p,
        &Spec {
            path: &spool,
            module_path: b"/nonexistent/dir/libgone.so",
            build_id: &p.build_id,
            a_t1: 3,
            a_t2: 0,
            b_t1: 1,
        },
    );
    // By default the module's unnamed code is one row: main;hot_a and
    // main;hot_b are 4 samples in it, each counted once in its total.
    let rows = top_json(&["top", s(&spool), "--json"]);
    assert_eq!(rows.len(), 1, "{rows:?}");
    let u = find(&rows, "[unknown]");
    assert_eq!((&u["module"], &u["self"], &u["total"]), (&"libgone.so".into(), &4.into(), &4.into()));
    // `--split-unknown`: one row per address.
    let rows = top_json(&["top", s(&spool), "--json", "--split-unknown"]);
    let a = find(&rows, &format!("libgone.so+{:#x}", p.hot_a));
    assert_eq!(a["self"], 3);
    assert_eq!(a["module"], "libgone.so");
    assert!(rows.iter().all(|r| !r["function"].as_str().unwrap().starts_with("hot_")));
}

#[test]
fn wrong_build_id_is_never_named() {
    let p = program();
    let spool = p.dir.path().join("wrong.spool");
    let module_path = p.path.as_os_str().as_encoded_bytes().to_vec();
    let wrong = vec![0xde, 0xad, 0xbe, 0xef, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];
    write_spool(
        &p,
        &Spec { path: &spool, module_path: &module_path, build_id: &wrong, a_t1: 3, a_t2: 0, b_t1: 1 },
    );
    let rows = top_json(&["top", s(&spool), "--json", "--split-unknown"]);
    find(&rows, &format!("hotprog+{:#x}", p.hot_a));
    find(&rows, &format!("hotprog+{:#x}", p.hot_b));
    assert!(rows.iter().all(|r| !r["function"].as_str().unwrap().starts_with("hot_")), "{rows:?}");
}

#[test]
fn symbols_dir_finds_separate_debug_file_by_build_id() {
    // objcopy makes the stripped file and the separate debug file.
    if !have_binutils("objcopy") {
        return;
    }
    let p = program();
    // Ship only a stripped copy under the recorded path, and the debug info in
    // a .build-id tree given with --symbols.
    let stripped = p.dir.path().join("stripped");
    let debug_root = p.dir.path().join("debug");
    let bid: String = p.build_id.iter().map(|b| format!("{b:02x}")).collect();
    let dbg_dir = debug_root.join(".build-id").join(&bid[..2]);
    std::fs::create_dir_all(&dbg_dir).unwrap();
    let dbg = dbg_dir.join(format!("{}.debug", &bid[2..]));
    let run = |args: &[&str]| {
        let st = std::process::Command::new("objcopy").args(args).status().expect("objcopy");
        assert!(st.success());
    };
    run(&["--only-keep-debug", s(&p.path), s(&dbg)]);
    run(&["--strip-all", s(&p.path), s(&stripped)]);
    let spool = p.dir.path().join("stripped.spool");
    let mp = stripped.as_os_str().as_encoded_bytes().to_vec();
    write_spool(
        &p,
        &Spec { path: &spool, module_path: &mp, build_id: &p.build_id, a_t1: 3, a_t2: 0, b_t1: 1 },
    );
    // Without the debug directory: a stripped file has no names.
    let rows = top_json(&["top", s(&spool), "--json"]);
    assert!(rows.iter().all(|r| !r["function"].as_str().unwrap().starts_with("hot_")), "{rows:?}");
    let rows = top_json(&["top", s(&spool), "--json", "--symbols", s(&debug_root)]);
    assert_eq!(find(&rows, "hot_a")["self"], 3);
    assert_eq!(find(&rows, "hot_b")["self"], 1);
    // The module file itself may be gone: the debug file's build id is enough.
    let spool = p.dir.path().join("gone.spool");
    let mp = b"/nonexistent/hotprog".to_vec();
    write_spool(
        &p,
        &Spec { path: &spool, module_path: &mp, build_id: &p.build_id, a_t1: 3, a_t2: 0, b_t1: 1 },
    );
    let rows = top_json(&["top", s(&spool), "--json", "--symbols", s(&debug_root)]);
    assert_eq!(find(&rows, "hot_a")["self"], 3);
    assert_eq!(find(&rows, "main")["total"], 4);
}

#[test]
fn no_symbolize_flag() {
    let (p, spool) = fixture();
    let rows = top_json(&["top", s(&spool), "--json", "--no-symbolize"]);
    assert_eq!(find(&rows, &format!("hotprog+{:#x}", p.hot_a))["self"], 300);
}

/// `--no-symbolize` names a frame by the address `addr2line -e` takes: checked
/// with the real addr2line on a non-PIE build, whose code's virtual addresses
/// differ from its file offsets (0x401000 against 0x1000).
#[test]
fn no_symbolize_addresses_are_what_addr2line_takes() {
    if !have_binutils("addr2line") {
        return;
    }
    let p = program_with(&["-no-pie"]);
    let spool = p.dir.path().join("a.spool");
    standard(&p, &spool);
    assert_ne!(p.text.0, p.text.2, "a non-PIE build's code has vaddr != file offset: {:?}", p.text);
    let rows = top_json(&["top", s(&spool), "--json", "--no-symbolize"]);
    for (offset, want, count) in [(p.hot_a, "hot_a", 300), (p.hot_b, "hot_b", 100)] {
        let row = rows
            .iter()
            .find(|r| r["self"] == count)
            .unwrap_or_else(|| panic!("no row with {count} samples: {rows:?}"));
        let name = row["function"].as_str().unwrap();
        let addr = name.strip_prefix("hotprog+").unwrap_or_else(|| panic!("{name}"));
        assert_ne!(addr, format!("{offset:#x}"), "a file offset, not an address");
        let o = std::process::Command::new("addr2line")
            .args(["-f", "-e"])
            .arg(&p.path)
            .arg(addr)
            .output()
            .unwrap();
        assert!(o.status.success());
        let text = String::from_utf8_lossy(&o.stdout);
        assert_eq!(text.lines().next(), Some(want), "addr2line -f -e hotprog {addr}: {text}");
    }
    // Without the module file the number is the file offset, and says so.
    std::fs::remove_file(&p.path).unwrap();
    let rows = top_json(&["top", s(&spool), "--json", "--no-symbolize"]);
    assert_eq!(find(&rows, &format!("hotprog+{:#x} (file offset)", p.hot_a))["self"], 300);
}

// ---- bad input ----

fn assert_input_error(args: &[&str], needle: &str) {
    let o = spulse(args);
    assert_eq!(o.status.code(), Some(2), "spulse {args:?}: {}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains(needle), "{needle:?} not in {err:?}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "{err}");
}

fn bad_files() -> (tempfile::TempDir, Vec<(String, String)>) {
    let p = program();
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("good.spool");
    standard(&p, &spool);
    let good = std::fs::read(&spool).unwrap();
    let missing = dir.path().join("missing.spool");
    let text = dir.path().join("notes.txt");
    std::fs::write(&text, "hello, this is not a spool\n").unwrap();
    let empty = dir.path().join("empty.spool");
    std::fs::write(&empty, b"").unwrap();
    let corrupt = dir.path().join("corrupt.spool");
    let mut bytes = good.clone();
    let at = bytes.len();
    bytes.extend_from_slice(&[0xee, 1, 2, 3]);
    std::fs::write(&corrupt, &bytes).unwrap();
    let cases = vec![
        (s(&missing).to_string(), format!("{}: No such file", s(&missing))),
        (s(&text).to_string(), format!("{}: at byte offset 0: not a spulse spool", s(&text))),
        (s(&empty).to_string(), format!("{}: at byte offset 0", s(&empty))),
        (s(&corrupt).to_string(), format!("{}: at byte offset {at}: unknown record tag 238", s(&corrupt))),
    ];
    drop(p);
    (dir, cases)
}

#[test]
fn bad_input_info_and_top() {
    let (_dir, cases) = bad_files();
    for (file, needle) in &cases {
        assert_input_error(&["info", file], needle);
        assert_input_error(&["info", file, "--json"], needle);
        assert_input_error(&["top", file], needle);
    }
}

#[test]
fn bad_input_export() {
    let (dir, cases) = bad_files();
    let out = dir.path().join("out");
    for (file, needle) in &cases {
        assert_input_error(&["export", file, "--format", "collapsed", "-o", s(&out)], needle);
    }
}

#[test]
fn bad_arguments() {
    let (_p, spool) = fixture();
    let o = spulse(&["top", s(&spool), "--thread", "99999"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("no thread with tid 99999"), "{}", stderr(&o));
    let o = spulse(&["top", s(&spool), "--from", "10", "--to", "5"]);
    assert_eq!(o.status.code(), Some(2));
    let o = spulse(&["export", s(&spool), "--format", "nonsense", "-o", "x"]);
    assert_eq!(o.status.code(), Some(2));
    let o = spulse(&["frobnicate"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn truncated_spool_is_read_with_one_warning() {
    let (_p, spool) = fixture();
    let mut bytes = std::fs::read(&spool).unwrap();
    // A sample record is 4+ bytes; cut the last one in half: at most one sample is lost.
    bytes.truncate(bytes.len() - 2);
    std::fs::write(&spool, &bytes).unwrap();
    let o = spulse(&["info", s(&spool), "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("warning") && err.contains(s(&spool)) && err.contains("byte offset"), "{err}");
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["recovered_from_truncated_tail"], true);
    assert_eq!(v["samples"], 399);
}

#[test]
fn help_has_examples() {
    for cmd in ["info", "top", "export", "follow"] {
        let out = ok(&[cmd, "--help"]);
        assert!(out.contains("Example"), "{cmd} --help: {out}");
        assert!(out.contains(&format!("spulse {cmd}")), "{cmd} --help: {out}");
    }
}

#[test]
fn empty_spool_through_every_command() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("empty.spool");
    let header = spulse::Header { start_time_us: START_US, interval_us: 500 };
    spulse::SpoolWriter::new(std::fs::File::create(&spool).unwrap(), header).unwrap().into_inner().unwrap();
    let v: Value = serde_json::from_str(&ok(&["info", s(&spool), "--json"])).unwrap();
    assert_eq!((v["samples"].as_u64(), v["duration_us"].as_u64()), (Some(0), Some(0)));
    assert_eq!(top_json(&["top", s(&spool), "--json"]), Vec::<Value>::new());
    assert!(ok(&["top", s(&spool)]).starts_with("0 samples"));
    for f in ["pprof", "firefox", "collapsed", "svg", "speedscope"] {
        let out = dir.path().join(format!("empty.{f}"));
        ok(&["export", s(&spool), "--format", f, "-o", s(&out)]);
        let len = std::fs::metadata(&out).unwrap().len();
        assert!(f == "collapsed" || len > 0, "{f} output is empty");
    }
    let o = spulse(&["follow", s(&spool), "--interval", "0.05", "--idle-exit", "0.2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(": 0 samples"));
}

#[test]
fn export_to_stdout_and_unwritable_output() {
    let (p, spool) = fixture();
    let folded = ok(&["export", s(&spool), "--format", "collapsed", "-o", "-"]);
    assert_eq!(folded, "main;hot_a 300\nmain;hot_b 100\n");
    let bad = p.dir.path().join("no/such/dir/out.pb.gz");
    let o = spulse(&["export", s(&spool), "--format", "pprof", "-o", s(&bad)]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains(s(&bad)) && err.contains("No such file"), "{err}");
}
