//! How the views name and shape what they show: a stripped binary's code is
//! one `[unknown]` row per module (`--split-unknown` splits it per address),
//! `top` fits long C++ names to a width (`--wide` shows them in full), the
//! collapsed and svg exports take root frames per thread and process, and
//! `spulse record --svg/--pprof` writes those exports when the command ends.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use serde_json::Value;

/// A C program whose work runs in four functions calling each other (so that
/// a stripped copy's stacks hold several consecutive frames of its code), for
/// a bounded amount of CPU time (a fixed count of iterations, whatever the load).
const STRIPPED_SRC: &str = r#"
#include <stdio.h>
#include <stdlib.h>
volatile double sink;
__attribute__((noinline)) double leaf_one(long n) { double x = 0; for (long i = 0; i < n; i++) x += i * 0.5; return x; }
__attribute__((noinline)) double leaf_two(long n) { double x = 1; for (long i = 0; i < n; i++) x *= 1.0000001; return x; }
__attribute__((noinline)) double middle(long n) { return leaf_one(n) + leaf_two(n); }
__attribute__((noinline)) double outer(long n) { double s = 0; for (int k = 0; k < 4; k++) s += middle(n); return s; }
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 150000000;
    sink = outer(n);
    printf("%f\n", sink);
    return 0;
}
"#;

/// Compile `src` (C, or C++ with `cxx`) into `dir/name`.
fn compile(dir: &Path, name: &str, src: &str, cxx: bool) -> PathBuf {
    let file = dir.join(if cxx { format!("{name}.cc") } else { format!("{name}.c") });
    std::fs::write(&file, src).unwrap();
    let exe = dir.join(name);
    let o = Command::new(if cxx { "g++" } else { "cc" })
        .args(["-O1", "-g", "-o"])
        .arg(&exe)
        .arg(&file)
        .output()
        .expect("run the compiler");
    assert!(o.status.success(), "compile {name}: {}", stderr(&o));
    exe
}

/// `spulse record -o SPOOL [extra...] -- cmd...`, required to succeed.
fn record(spool: &Path, extra: &[&str], cmd: &[&str]) -> String {
    let mut args = vec!["record", "-o", s(spool)];
    args.extend_from_slice(extra);
    args.push("--");
    args.extend_from_slice(cmd);
    let o = spulse(&args);
    assert!(o.status.success(), "spulse {args:?}: {}", stderr(&o));
    stderr(&o)
}

/// `top --json -n 0` rows, with `extra` arguments.
fn top_rows(spool: &Path, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["top", s(spool), "--json", "-n", "0"];
    args.extend_from_slice(extra);
    serde_json::from_str::<Value>(&ok(&args)).unwrap().as_array().unwrap().clone()
}

fn total_samples(spool: &Path) -> u64 {
    let out = ok(&["top", s(spool), "-n", "1"]);
    out.split_whitespace().next().unwrap().parse().unwrap()
}

/// Require a well-formed SVG document (inferno's has a DTD).
fn check_svg(text: &str) {
    let opts = roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() };
    roxmltree::Document::parse_with_options(text, opts).expect("well-formed SVG");
}

/// Folded lines as (stack, count).
fn folded(spool: &Path, extra: &[&str]) -> Vec<(String, u64)> {
    let mut args = vec!["export", s(spool), "--format", "collapsed", "-o", "-"];
    args.extend_from_slice(extra);
    ok(&args)
        .lines()
        .map(|l| {
            let (stack, n) = l.rsplit_once(' ').unwrap();
            (stack.to_string(), n.parse().unwrap())
        })
        .collect()
}

/// A stripped binary (symbols and debug info gone, `.dynsym` and
/// `.eh_frame` kept) recorded under `spulse record`: its code is one
/// `[unknown]` row of its module in `top`, whose self samples are those of
/// every address of it and whose total counts each sample once; the exports
/// name it `[unknown] (module)` and keep consecutive frames of it as one.
/// `--split-unknown` gives one row per address, adding up to the same.
#[test]
fn stripped_binary_is_one_unknown_row_per_module() {
    if !have_binutils("strip") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(dir.path(), "prog", STRIPPED_SRC, false);
    let stripped = dir.path().join("stripprog");
    std::fs::copy(&exe, &stripped).unwrap();
    let o = Command::new("strip").arg(&stripped).output().unwrap();
    assert!(o.status.success(), "strip: {}", stderr(&o));
    let spool = dir.path().join("s.spool");
    record(&spool, &[], &[s(&stripped)]);
    let total = total_samples(&spool);
    assert!(total >= 50, "only {total} samples of the workload");

    let rows = top_rows(&spool, &[]);
    let own: Vec<&Value> = rows.iter().filter(|r| r["module"] == "stripprog").collect();
    assert_eq!(own.len(), 1, "one row for the stripped module: {own:?}");
    let unknown = own[0];
    assert_eq!(unknown["function"], "[unknown]");
    let (own_self, own_total) = (unknown["self"].as_u64().unwrap(), unknown["total"].as_u64().unwrap());
    // The loops are the work: most samples are in the stripped code itself.
    assert!(own_self * 2 >= total, "[unknown] self {own_self} of {total}");
    assert!(own_self <= own_total && own_total <= total, "self {own_self}, total {own_total} of {total}");
    assert!(rows.iter().all(|r| !r["function"].as_str().unwrap().starts_with("stripprog+0x")));
    // Other modules keep their names (libc has symbols).
    assert!(rows
        .iter()
        .any(|r| r["module"] == "libc.so.6" && !r["function"].as_str().unwrap().starts_with('[')));
    let self_sum: u64 = rows.iter().map(|r| r["self"].as_u64().unwrap()).sum();
    assert_eq!(self_sum, total);

    // Split: one row per address, adding up to the one row.
    let split = top_rows(&spool, &["--split-unknown"]);
    let addrs: Vec<&Value> = split.iter().filter(|r| r["module"] == "stripprog").collect();
    assert!(addrs.len() >= 3, "several addresses in the loops: {addrs:?}");
    assert!(addrs.iter().all(|r| r["function"].as_str().unwrap().starts_with("stripprog+0x")));
    assert_eq!(addrs.iter().map(|r| r["self"].as_u64().unwrap()).sum::<u64>(), own_self);
    assert!(addrs.iter().all(|r| r["total"].as_u64().unwrap() <= own_total));

    // Collapsed: the module's name, no address, no two consecutive frames of it.
    let lines = folded(&spool, &[]);
    assert_eq!(lines.iter().map(|l| l.1).sum::<u64>(), total);
    let name = "[unknown] (stripprog)";
    assert!(lines.iter().any(|(st, _)| st.ends_with(name)), "{lines:?}");
    for (st, _) in &lines {
        assert!(!st.contains("stripprog+0x"), "{st}");
        assert!(!st.contains(&format!("{name};{name}")), "{st}");
    }
    let split_lines = folded(&spool, &["--split-unknown"]);
    assert!(split_lines.iter().any(|(st, _)| st.contains("stripprog+0x")));
    assert_eq!(split_lines.iter().map(|l| l.1).sum::<u64>(), total);

    // SVG: the same name.
    let svg = dir.path().join("s.svg");
    ok(&["export", s(&spool), "-o", s(&svg)]);
    let text = std::fs::read_to_string(&svg).unwrap();
    check_svg(&text);
    assert!(text.contains(name) && !text.contains("stripprog+0x"));

    // `--no-symbolize` asks for addresses: they stay split.
    let raw = top_rows(&spool, &["--no-symbolize"]);
    assert!(raw.iter().filter(|r| r["module"] == "stripprog").count() >= 3);
}

/// A C++ program whose hot function has a demangled name of several hundred
/// columns.
const LONG_NAME_SRC: &str = r#"
#include <map>
#include <string>
#include <vector>
#include <cstdio>
#include <cstdlib>
template <typename K, typename V>
struct Accumulator {
    template <typename W>
    __attribute__((noinline)) static double run(const std::map<K, std::vector<std::pair<V, W>>> &m, long n) {
        double x = 0;
        for (long i = 0; i < n; i++) x += (double)(i % 7) * 0.5 + (double)m.size();
        return x;
    }
};
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000000;
    std::map<std::string, std::vector<std::pair<std::wstring, std::multimap<std::string, std::vector<int>>>>> m;
    double r = Accumulator<std::string, std::wstring>::run<std::multimap<std::string, std::vector<int>>>(m, n);
    std::printf("%f\n", r);
    return 0;
}
"#;

/// `top --width COLS` fits every line to COLS columns, cutting a long
/// function name with `…` and keeping its module; `--wide` (and output into a
/// pipe, by default) shows the name in full.
#[test]
fn top_fits_long_names_to_a_width() {
    if !oracle("g++", &["g++", "--version"], "Debian's g++") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(dir.path(), "longcxx", LONG_NAME_SRC, true);
    let spool = dir.path().join("l.spool");
    record(&spool, &[], &[s(&exe)]);
    let rows = top_rows(&spool, &[]);
    let long = rows
        .iter()
        .map(|r| r["function"].as_str().unwrap().to_string())
        .find(|f| f.contains("Accumulator") && f.contains("run"))
        .unwrap_or_else(|| panic!("the hot function is listed: {rows:?}"));
    assert!(long.chars().count() > 200, "the name is long: {long}");

    let width = |l: &str| l.chars().count();
    let fitted = ok(&["top", s(&spool), "-n", "0", "--width", "100"]);
    let mut cut = 0;
    for l in fitted.lines() {
        assert!(width(l) <= 100, "{} columns: {l}", width(l));
        if l.contains("Accumulator") {
            assert!(l.contains('…') && l.ends_with("(longcxx)"), "{l}");
            cut += 1;
        }
    }
    assert_eq!(cut, 1, "{fitted}");

    for extra in [&["--wide"][..], &[][..]] {
        let mut args = vec!["top", s(&spool), "-n", "0"];
        args.extend_from_slice(extra);
        let full = ok(&args);
        assert!(full.lines().any(|l| l.contains(&long) && l.ends_with("(longcxx)")), "{extra:?}: {full}");
    }
    let o = spulse(&["top", s(&spool), "--wide", "--width", "100"]);
    assert!(!o.status.success());
    let o = spulse(&["top", s(&spool), "--width", "5"]);
    assert!(!o.status.success() && stderr(&o).contains("columns"), "{}", stderr(&o));
}

/// `--per-thread` puts a `name (tid N)` root frame above each thread's
/// stacks in the collapsed and svg exports, `--per-process` a
/// `program (pid N)` one above that; the counts per root are the thread's
/// samples. Other formats refuse them.
#[test]
fn exports_take_thread_and_process_roots() {
    let (_p, spool) = fixture();
    // The fixture: thread main (1001) 200 + 100 samples, worker (1002) 100.
    let per_root = |lines: &[(String, u64)], depth: usize| {
        let mut m: HashMap<String, u64> = HashMap::new();
        for (st, n) in lines {
            let root: Vec<&str> = st.split(';').take(depth).collect();
            *m.entry(root.join(";")).or_default() += n;
        }
        m
    };
    let lines = folded(&spool, &["--per-thread"]);
    let m = per_root(&lines, 1);
    assert_eq!(m.len(), 2, "{m:?}");
    assert_eq!(m["main (tid 1001)"], 300);
    assert_eq!(m["worker (tid 1002)"], 100);
    assert!(lines.iter().all(|(st, _)| st.split(';').nth(1) == Some("main")), "{lines:?}");

    let lines = folded(&spool, &["--per-thread", "--per-process"]);
    let m = per_root(&lines, 2);
    let proc_root = format!("hotprog (pid {PID})");
    assert_eq!(m[&format!("{proc_root};main (tid 1001)")], 300, "{m:?}");
    assert_eq!(m[&format!("{proc_root};worker (tid 1002)")], 100, "{m:?}");
    let m = per_root(&folded(&spool, &["--per-process"]), 1);
    assert_eq!(m.len(), 1);
    assert_eq!(m[&proc_root], 400);
    // Without: no root frame.
    assert!(folded(&spool, &[]).iter().all(|(st, _)| st.starts_with("main;")));

    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("t.svg");
    ok(&["export", s(&spool), "-o", s(&svg), "--per-thread"]);
    let text = std::fs::read_to_string(&svg).unwrap();
    check_svg(&text);
    assert!(text.contains("worker (tid 1002)") && text.contains("main (tid 1001)"));

    let pb = dir.path().join("t.pb.gz");
    let o = spulse(&["export", s(&spool), "-o", s(&pb), "--per-thread"]);
    assert!(!o.status.success() && stderr(&o).contains("collapsed and svg"), "{}", stderr(&o));
    assert!(!pb.exists());
}

/// `spulse record --svg OUT --pprof OUT2` writes the spool and, when the
/// command ends, an SVG flame graph and a pprof profile of it, holding every
/// sample of the spool. An export that cannot be written is refused before
/// the command runs.
#[test]
fn record_writes_svg_and_pprof() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(dir.path(), "workprog", STRIPPED_SRC, false);
    let spool = dir.path().join("w.spool");
    let svg = dir.path().join("w.svg");
    let pb = dir.path().join("w.pb.gz");
    let err = record(&spool, &["--svg", s(&svg), "--pprof", s(&pb)], &[s(&exe)]);
    let total = total_samples(&spool);
    assert!(total >= 50, "{total} samples");
    assert!(err.contains(&format!("{total} samples written to {}", svg.display())), "{err}");

    let text = std::fs::read_to_string(&svg).unwrap();
    check_svg(&text);
    assert!(text.contains("leaf_one") && text.contains("leaf_two"), "the hot functions are drawn");
    // Same as exporting the spool afterwards.
    let again = dir.path().join("again.svg");
    ok(&["export", s(&spool), "-o", s(&again)]);
    assert_eq!(std::fs::read_to_string(&again).unwrap(), text);

    let profile = read_pprof(&pb);
    let pprof_total: i64 = profile.sample.iter().map(|smp| smp.value[0]).sum();
    assert_eq!(pprof_total as u64, total);

    // Refused before the command starts: it would have created `marker`.
    let marker = dir.path().join("marker");
    for bad in [&["--svg", "/nonexistent-dir/x.svg"][..], &["--pprof", s(&spool)][..]] {
        let out = dir.path().join("never.spool");
        let mut args = vec!["record", "-o", s(&out)];
        let same_as_spool;
        let bad: Vec<&str> = if bad[1] == s(&spool) {
            same_as_spool = s(&out).to_string();
            vec![bad[0], &same_as_spool]
        } else {
            bad.to_vec()
        };
        args.extend_from_slice(&bad);
        args.extend_from_slice(&["--", "touch", s(&marker)]);
        let o = spulse(&args);
        assert!(!o.status.success(), "{args:?}");
        assert!(stderr(&o).contains(bad[0]), "{}", stderr(&o));
        assert!(!marker.exists() && !out.exists(), "{args:?} ran the command");
    }
    // An export never replaces an older recording.
    let before = std::fs::read(&spool).unwrap();
    let out = dir.path().join("never.spool");
    let o = spulse(&["record", "-o", s(&out), "--svg", s(&spool), "--", "touch", s(&marker)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("refusing to overwrite a recording"), "{}", stderr(&o));
    assert_eq!(std::fs::read(&spool).unwrap(), before);
    assert!(!marker.exists() && !out.exists(), "the command ran");
}
