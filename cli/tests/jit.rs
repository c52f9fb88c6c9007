//! Absolute frames named from `/tmp/perf-<pid>.map`, limited to the recorded
//! Python-runtime intervals; kernel frames and the truncated-stack marker.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value;
use spulse::{Frame, SpoolWriter};

const JIT: u64 = 0x7f00_0000_1010;
const KERNEL: u64 = 0xffff_ffff_8100_0000;

struct MapFile(String);
impl Drop for MapFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Write /tmp/perf-<pid>.map with a stale line first (later lines win).
fn perf_map(pid: u32) -> MapFile {
    let path = format!("/tmp/perf-{pid}.map");
    std::fs::write(
        &path,
        "0x7f0000001000 0x80 stale_name\n7f0000001000 100 py::hot_py:/app/x.py\nbad line\n",
    )
    .unwrap();
    MapFile(path)
}

/// main;jit inside (10) and outside (5) a Python-runtime interval when `python`,
/// a kernel leaf (2), and a truncated stack ending in hot_a (3).
fn write(p: &Program, path: &Path, pid: u32, python: bool) {
    let mut w = SpoolWriter::new(std::fs::File::create(path).unwrap(), header()).unwrap();
    let m = define_program(&mut w, p, pid, p.path.as_os_str().as_encoded_bytes(), &p.build_id);
    let f_main = w.define_frame(Frame::Module { module: m, file_relative: p.main }).unwrap();
    let f_a = w.define_frame(Frame::Module { module: m, file_relative: p.hot_a }).unwrap();
    let f_jit = w.define_frame(Frame::Absolute { address: JIT, kernel: false }).unwrap();
    let f_k = w.define_frame(Frame::Absolute { address: KERNEL, kernel: true }).unwrap();
    let f_tr = w.define_frame(Frame::Truncated).unwrap();
    let s_main = w.define_stack(None, f_main).unwrap();
    let s_jit = w.define_stack(Some(s_main), f_jit).unwrap();
    let s_k = w.define_stack(Some(s_main), f_k).unwrap();
    let s_tr = w.define_stack(None, f_tr).unwrap();
    let s_tr_a = w.define_stack(Some(s_tr), f_a).unwrap();
    let th = w.define_thread(pid, pid, "py").unwrap();
    let mut t = START_US;
    let mut tick = || {
        t += INTERVAL_US;
        t
    };
    if python {
        w.python_runtime(pid, START_US, true).unwrap();
    }
    for _ in 0..10 {
        w.sample(tick(), th, s_jit).unwrap();
    }
    if python {
        w.python_runtime(pid, START_US + 10 * INTERVAL_US, false).unwrap();
    }
    for _ in 0..5 {
        w.sample(tick(), th, s_jit).unwrap();
    }
    for _ in 0..2 {
        w.sample(tick(), th, s_k).unwrap();
    }
    for _ in 0..3 {
        w.sample(tick(), th, s_tr_a).unwrap();
    }
    w.into_inner().unwrap();
}

/// The test program, a perf map for `pid` (removed on drop) and the spool `name`
/// in the program's directory, written by `write`.
fn setup(pid: u32, name: &str, python: bool) -> (Program, MapFile, PathBuf) {
    let p = program();
    let map = perf_map(pid);
    let spool = p.dir.path().join(name);
    write(&p, &spool, pid, python);
    (p, map, spool)
}

fn top(spool: &Path) -> Vec<Value> {
    serde_json::from_str::<Value>(&ok(&["top", s(spool), "--json", "-n", "0"]))
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn self_of(rows: &[Value], name: &str) -> Option<u64> {
    rows.iter().find(|r| r["function"] == name).map(|r| r["self"].as_u64().unwrap())
}

#[test]
fn perf_map_names_only_inside_python_intervals() {
    let pid = 4_190_001;
    let (p, _map, spool) = setup(pid, "py.spool", true);
    let rows = top(&spool);
    assert_eq!(self_of(&rows, "py::hot_py:/app/x.py"), Some(10), "{rows:?}");
    assert_eq!(self_of(&rows, &format!("[unknown] {JIT:#x}")), Some(5), "{rows:?}");
    assert_eq!(self_of(&rows, "stale_name"), None);
    let jit = rows.iter().find(|r| r["function"] == "py::hot_py:/app/x.py").unwrap();
    assert_eq!(jit["module"], format!("perf-{pid}.map"));
    assert_eq!(self_of(&rows, &format!("[kernel] {KERNEL:#x}")), Some(2));
    assert_eq!(self_of(&rows, "hot_a"), Some(3));

    let folded = p.dir.path().join("py.folded");
    ok(&["export", s(&spool), "--format", "collapsed", "-o", s(&folded)]);
    let text = std::fs::read_to_string(&folded).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "[truncated];hot_a 3".to_string(),
            format!("main;[kernel] {KERNEL:#x} 2"),
            format!("main;[unknown] {JIT:#x} 5"),
            "main;py::hot_py:/app/x.py 10".to_string(),
        ]
    );

    // follow selects through the same pipeline: the same names inside and
    // outside the interval (nobody records into the spool: one table).
    let table = ok(&["follow", s(&spool), "--interval", "0.01", "-n", "0"]);
    let self_in = |name: &str| {
        let line = table.lines().find(|l| l.contains(&format!("  {name} (")))?;
        line.split_whitespace().next()?.parse::<u64>().ok()
    };
    assert_eq!(self_in("py::hot_py:/app/x.py"), Some(10), "{table}");
    assert_eq!(self_in(&format!("[unknown] {JIT:#x}")), Some(5), "{table}");
    assert_eq!(self_in("stale_name"), None, "{table}");
}

#[test]
fn perf_map_applies_everywhere_without_python_records() {
    let pid = 4_190_002;
    let (_p, _map, spool) = setup(pid, "jit.spool", false);
    let rows = top(&spool);
    assert_eq!(self_of(&rows, "py::hot_py:/app/x.py"), Some(15), "{rows:?}");
}

#[test]
fn perf_map_of_another_user_is_ignored() {
    use std::os::unix::fs::MetadataExt;
    let pid = 4_190_003;
    let (_p, map, spool) = setup(pid, "other.spool", false);
    let me = std::fs::metadata("/proc/self").unwrap().uid();
    if me != 0 {
        // Only root can give the file away; without it, check the owned case.
        assert_eq!(self_of(&top(&spool), "py::hot_py:/app/x.py"), Some(15));
        return;
    }
    let st = std::process::Command::new("chown").args(["65534", &map.0]).status().unwrap();
    assert!(st.success());
    let rows = top(&spool);
    assert_eq!(self_of(&rows, "py::hot_py:/app/x.py"), None, "{rows:?}");
    assert_eq!(self_of(&rows, &format!("[unknown] {JIT:#x}")), Some(15));
}

#[test]
fn perf_map_names_reach_pprof_and_speedscope() {
    let pid = 4_190_004;
    let (p, _map, spool) = setup(pid, "py2.spool", true);
    let out = p.dir.path().join("py.speedscope.json");
    ok(&["export", s(&spool), "--format", "speedscope", "-o", s(&out)]);
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("py::hot_py:/app/x.py") && text.contains("[truncated]"));
    let out = p.dir.path().join("py.json");
    ok(&["export", s(&spool), "--format", "firefox", "-o", s(&out)]);
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("py::hot_py:/app/x.py") && text.contains("hot_a"));
}
