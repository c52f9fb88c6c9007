//! One sample selection for every command: the same filters select the same
//! samples in `top`, every `export` format and `follow`, and `export` rejects
//! the filters `top` rejects.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::*;
use serde_json::Value;

const PID2: u32 = 4_100_002;
/// (pid, tid) of the fixture's threads, sampled in turn.
const THREADS: [(u32, u32); 3] = [(PID, 1001), (PID, 1002), (PID2, 2001)];
const SAMPLES: u64 = 600;

/// Sample `i` of the fixture: its thread index, whether it is in `hot_b`
/// (else `hot_a`), and its time in microseconds since the profile start.
fn plan(i: u64) -> (usize, bool, u64) {
    ((i % 3) as usize, i.is_multiple_of(4) || (i % 3 == 2 && i.is_multiple_of(5)), (i + 1) * INTERVAL_US)
}

/// Two processes running the test program, three threads, and a
/// Python-runtime interval in the second process (the selection tracks it).
fn write_fixture(p: &Program, path: &Path) {
    let file = std::fs::File::create(path).unwrap();
    let mut w = spulse::SpoolWriter::new(std::io::BufWriter::new(file), header()).unwrap();
    let module_path = p.path.as_os_str().as_encoded_bytes().to_vec();
    let m1 = define_program(&mut w, p, PID, &module_path, &p.build_id);
    let m2 = define_program(&mut w, p, PID2, &module_path, &p.build_id);
    let stacks = [define_hot_stacks(&mut w, p, m1), define_hot_stacks(&mut w, p, m2)];
    let threads: Vec<_> = THREADS.iter().map(|&(pid, tid)| w.define_thread(pid, tid, "t").unwrap()).collect();
    for i in 0..SAMPLES {
        let (t, in_b, time) = plan(i);
        if i == 150 || i == 450 {
            w.python_runtime(PID2, START_US + time, i == 150).unwrap();
        }
        let (a, b) = stacks[(THREADS[t].0 == PID2) as usize];
        w.sample(START_US + time, threads[t], if in_b { b } else { a }).unwrap();
    }
    w.into_inner().unwrap();
}

/// The self samples of hot_a and hot_b the filter `args` should select,
/// counted from the plan.
fn expected(args: &[&str]) -> (u64, u64) {
    let val = |flag: &str| args.iter().position(|a| *a == flag).map(|i| args[i + 1].parse::<u64>().unwrap());
    let (tid, pid, from, to) = (val("--thread"), val("--pid"), val("--from"), val("--to"));
    let (mut a, mut b) = (0, 0);
    for i in 0..SAMPLES {
        let (t, in_b, time) = plan(i);
        let (tpid, ttid) = THREADS[t];
        let keep = tid.is_none_or(|x| x == ttid as u64)
            && pid.is_none_or(|x| x == tpid as u64)
            && from.is_none_or(|f| time >= f)
            && to.is_none_or(|e| time < e);
        if keep {
            if in_b {
                b += 1
            } else {
                a += 1
            }
        }
    }
    (a, b)
}

/// Self samples per function of a `top`/`follow` table (the last one printed).
fn table_self(text: &str) -> HashMap<String, u64> {
    let last = text.rsplit("   SELF").next().unwrap_or("");
    let mut out = HashMap::new();
    for line in last.lines().skip(1) {
        let mut words = line.split_whitespace();
        let (Some(n), Some(name)) = (words.next(), words.nth(3)) else { continue };
        if let Ok(n) = n.parse::<u64>() {
            *out.entry(name.to_string()).or_insert(0) += n;
        }
    }
    out
}

/// The "N samples" an export reports on stderr.
fn exported(stderr: &str) -> u64 {
    let rest = stderr.split("spulse: export: ").nth(1).unwrap_or_else(|| panic!("no report: {stderr}"));
    rest.split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn same_filters_select_the_same_samples_in_top_export_and_follow() {
    let p = program();
    let spool = p.dir.path().join("two.spool");
    write_fixture(&p, &spool);
    let filters: [&[&str]; 7] = [
        &[],
        &["--thread", "1002"],
        &["--pid", "4100002"],
        &["--pid", "4100001"],
        &["--from", "100000", "--to", "400000"],
        &["--pid", "4100002", "--from", "200000", "--to", "500000"],
        &["--thread", "1001", "--pid", "4100001", "--to", "300000"],
    ];
    for filter in filters {
        let (a, b) = expected(filter);
        assert!(a > 0 && b > 0, "the fixture gives every filter both functions: {filter:?}");
        let with = |args: &[&str]| -> Vec<String> {
            args.iter().chain(filter).map(|s| s.to_string()).collect::<Vec<_>>()
        };
        let run = |args: Vec<String>| {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let o = spulse(&args);
            assert!(o.status.success(), "spulse {args:?}: {}", stderr(&o));
            o
        };

        let top: Value = serde_json::from_slice(&run(with(&["top", s(&spool), "--json"])).stdout).unwrap();
        let top_self = |name: &str| {
            top.as_array()
                .unwrap()
                .iter()
                .find(|r| r["function"] == name)
                .map(|r| r["self"].as_u64().unwrap())
        };
        assert_eq!((top_self("hot_a"), top_self("hot_b")), (Some(a), Some(b)), "top {filter:?}");

        for format in ["collapsed", "pprof", "firefox", "svg", "speedscope"] {
            let out = p.dir.path().join(format!("out.{format}"));
            let o = run(with(&["export", s(&spool), "--format", format, "-o", s(&out)]));
            assert_eq!(exported(&stderr(&o)), a + b, "export {format} {filter:?}");
            if format == "collapsed" {
                let mut leaves: HashMap<String, u64> = HashMap::new();
                for line in std::fs::read_to_string(&out).unwrap().lines() {
                    let (stack, n) = line.rsplit_once(' ').unwrap();
                    let leaf = stack.rsplit(';').next().unwrap().to_string();
                    *leaves.entry(leaf).or_insert(0) += n.parse::<u64>().unwrap();
                }
                assert_eq!(leaves.get("hot_a").copied(), Some(a), "collapsed {filter:?}: {leaves:?}");
                assert_eq!(leaves.get("hot_b").copied(), Some(b), "collapsed {filter:?}: {leaves:?}");
            }
        }

        // Nobody records into the spool: follow prints one table and stops.
        let o = run(with(&["follow", s(&spool), "--interval", "0.01", "-n", "0"]));
        let rows = table_self(&stdout(&o));
        assert_eq!(
            (rows.get("hot_a").copied(), rows.get("hot_b").copied()),
            (Some(a), Some(b)),
            "follow {filter:?}"
        );
        assert!(stderr(&o).contains(&format!("; {} samples", a + b)), "follow {filter:?}: {}", stderr(&o));
    }
}

#[test]
fn export_rejects_the_filters_top_rejects() {
    let p = program();
    let spool = p.dir.path().join("two.spool");
    write_fixture(&p, &spool);
    let out = p.dir.path().join("out");
    let bad: [(&[&str], &str); 5] = [
        (&["--thread", "99999"], "no thread with tid 99999"),
        (&["--pid", "99999"], "no thread of pid 99999"),
        (&["--thread", "2001", "--pid", "4100001"], "no thread with tid 2001 in pid 4100001"),
        (&["--from", "10", "--to", "5"], "--from 10 must be below --to 5"),
        (&["--from", "7", "--to", "7"], "--from 7 must be below --to 7"),
    ];
    for (filter, message) in bad {
        let mut top = vec!["top", s(&spool)];
        top.extend_from_slice(filter);
        for format in ["collapsed", "pprof", "firefox", "svg", "speedscope"] {
            let mut export = vec!["export", s(&spool), "--format", format, "-o", s(&out)];
            export.extend_from_slice(filter);
            for args in [&top, &export] {
                let o = spulse(args);
                assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
                assert!(stderr(&o).contains(message), "{args:?}: {}", stderr(&o));
            }
            assert!(!out.exists(), "a rejected export wrote {}", out.display());
        }
    }
    // The same ids are accepted when the spool has them.
    ok(&[
        "export",
        s(&spool),
        "--format",
        "collapsed",
        "-o",
        s(&out),
        "--thread",
        "2001",
        "--pid",
        "4100002",
    ]);
    assert!(std::fs::read_to_string(&out).unwrap().contains("hot_a"));
}
