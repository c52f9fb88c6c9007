//! Rotating recordings and several spools: `info`, `top` and `export` merge
//! the segments of a real rotating recording (made by the recorder in this
//! test process) into a view equal to the sum of the segments; spools of
//! different processes keep their ids apart; `follow` follows a rotating
//! recording across its segments, given the `{seq}` pattern or the first
//! segment.

mod common;

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use spulse::{Frame, SpoolWriter};

/// One recorder per process: the tests that record take this lock.
static RECORDING: Mutex<()> = Mutex::new(());

/// The function the recordings are busy in.
#[inline(never)]
fn rotate_hot_loop(until: Instant) -> u64 {
    let mut x = 1u64;
    while Instant::now() < until {
        for i in 0..20_000u64 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i);
        }
        x = black_box(x);
    }
    x
}

/// The segment files `prefix<6 digits>.spool` in `dir`, by number.
fn segment_files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            name.strip_prefix(prefix)
                .and_then(|r| r.strip_suffix(".spool"))
                .is_some_and(|d| d.len() == 6 && d.bytes().all(|c| c.is_ascii_digit()))
        })
        .collect();
    out.sort();
    out
}

fn json(args: &[&str]) -> Value {
    serde_json::from_str(&ok(args)).unwrap_or_else(|e| panic!("spulse {args:?}: {e}"))
}

/// Self samples of the row of `top --json` whose function name contains `name`.
fn top_self(args: &[&str], name: &str) -> u64 {
    let rows = json(args);
    rows.as_array()
        .unwrap()
        .iter()
        .filter(|r| r["function"].as_str().unwrap().contains(name))
        .map(|r| r["self"].as_u64().unwrap())
        .sum()
}

#[test]
fn the_merged_view_of_all_segments_equals_their_sum() {
    let _one = RECORDING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let g = spulse::Recorder::builder()
        .flush_interval(Duration::from_millis(10))
        .rotate(Duration::from_millis(100))
        .start(dir.path().join("seg-{seq}.spool"))
        .unwrap();
    black_box(rotate_hot_loop(Instant::now() + Duration::from_millis(700)));
    let stats = g.finish().unwrap();
    let segs = segment_files(dir.path(), "seg-");
    assert_eq!(segs.len() as u64, stats.segments_written);
    assert!(segs.len() >= 3, "{} segments", segs.len());
    let names: Vec<&str> = segs.iter().map(|p| s(p)).collect();

    // Each segment alone, then all of them merged.
    let mut sum = 0;
    let mut hot_sum = 0;
    let mut modules_sum = 0;
    for p in &names {
        let info = json(&["info", "--json", p]);
        sum += info["samples"].as_u64().unwrap();
        modules_sum += info["modules"].as_u64().unwrap();
        hot_sum += top_self(&["top", "--json", "-n", "0", p], "rotate_hot_loop");
    }
    assert_eq!(sum, stats.samples_written, "the segments add up to Stats");
    let all = [&["info", "--json"][..], &names].concat();
    let info = json(&all);
    assert_eq!(info["samples"].as_u64().unwrap(), sum, "merged info");
    assert_eq!(info["files"].as_array().unwrap().len(), names.len());
    // The segments define the same modules and threads again; merged, they are one.
    assert!(info["modules"].as_u64().unwrap() < modules_sum, "{info}");
    let tids: Vec<u64> =
        info["thread_list"].as_array().unwrap().iter().map(|t| t["tid"].as_u64().unwrap()).collect();
    let mut unique = tids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(tids.len(), unique.len(), "one thread per tid: {tids:?}");
    let first = json(&["info", "--json", names[0]])["start_time_us"].as_u64().unwrap();
    assert_eq!(info["start_time_us"].as_u64().unwrap(), first, "starts with the first segment");

    let top = [&["top", "--json", "-n", "0"][..], &names].concat();
    let hot = top_self(&top, "rotate_hot_loop");
    assert_eq!(hot, hot_sum, "merged top");
    assert!(hot * 2 > sum, "{hot} of {sum} samples in the hot loop");

    let folded = dir.path().join("all.folded");
    let export = [&["export", "--format", "collapsed", "-o", s(&folded)][..], &names].concat();
    ok(&export);
    let text = std::fs::read_to_string(&folded).unwrap();
    let counted: u64 = text.lines().map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap()).sum();
    assert_eq!(counted, sum, "merged export");

    // A corrupt segment among them is an error naming it, not a partial view.
    let bad = dir.path().join("seg-999999.spool");
    std::fs::write(&bad, b"SPULSE3\0garbage that is no header").unwrap();
    let o = spulse(&[&["info"][..], &names, &[s(&bad)]].concat());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("seg-999999.spool"), "{}", stderr(&o));
}

/// A spool of process `pid` whose thread `tid` has `n` samples in main;hot_a
/// (`hot_a`) or main;hot_b, the stack ids shifted by `shift` dummy stacks so
/// that the same id means different stacks in different files.
fn process_spool(
    p: &Program,
    path: &Path,
    (pid, tid): (u32, u32),
    n: u64,
    hot_a: bool,
    shift: usize,
    t0: u64,
) {
    let file = std::fs::File::create(path).unwrap();
    let mut w = SpoolWriter::new(file, header()).unwrap();
    let m = define_program(&mut w, p, pid, p.path.as_os_str().as_encoded_bytes(), &p.build_id);
    for _ in 0..shift {
        let f = w.define_frame(Frame::Module { module: m, file_relative: p.main }).unwrap();
        w.define_stack(None, f).unwrap();
    }
    let (s_a, s_b) = define_hot_stacks(&mut w, p, m);
    let th = w.define_thread(pid, tid, if hot_a { "alpha" } else { "beta" }).unwrap();
    for i in 0..n {
        w.sample(START_US + t0 + 2 * i * INTERVAL_US, th, if hot_a { s_a } else { s_b }).unwrap();
    }
    w.into_inner().unwrap();
}

#[test]
fn spools_of_different_processes_keep_their_ids_apart() {
    let p = program();
    let a = p.dir.path().join("a.spool");
    let b = p.dir.path().join("b.spool");
    // Thread 0 and the low stack ids exist in both files, meaning other things.
    process_spool(&p, &a, (100, 100), 300, true, 0, 0);
    process_spool(&p, &b, (200, 200), 100, false, 2, INTERVAL_US);
    let info = json(&["info", "--json", s(&a), s(&b)]);
    assert_eq!(info["samples"], 400);
    assert_eq!(info["processes"], 2);
    let threads: Vec<(u64, u64, String, u64)> = info["thread_list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["pid"].as_u64().unwrap(),
                t["tid"].as_u64().unwrap(),
                t["name"].as_str().unwrap().to_string(),
                t["samples"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(threads, vec![(100, 100, "alpha".into(), 300), (200, 200, "beta".into(), 100)]);
    // Each module belongs to its own process.
    assert_eq!(info["modules"], 2);
    let top = json(&["top", "--json", "-n", "0", s(&a), s(&b)]);
    let self_of = |f: &str| -> u64 {
        top.as_array()
            .unwrap()
            .iter()
            .filter(|r| r["function"] == f)
            .map(|r| r["self"].as_u64().unwrap())
            .sum()
    };
    assert_eq!((self_of("hot_a"), self_of("hot_b"), self_of("main")), (300, 100, 0), "{top}");
    let o = ok(&["top", "--pid", "200", s(&a), s(&b)]);
    assert!(o.starts_with("100 samples"), "{o}");
    // The order of the files does not matter: samples are merged by time.
    let folded = p.dir.path().join("ab.folded");
    let folded2 = p.dir.path().join("ba.folded");
    ok(&["export", "--format", "collapsed", "-o", s(&folded), s(&a), s(&b)]);
    ok(&["export", "--format", "collapsed", "-o", s(&folded2), s(&b), s(&a)]);
    let mut l1: Vec<String> = std::fs::read_to_string(&folded).unwrap().lines().map(String::from).collect();
    let mut l2: Vec<String> = std::fs::read_to_string(&folded2).unwrap().lines().map(String::from).collect();
    l1.sort();
    l2.sort();
    assert_eq!(l1, l2);
    // A spool that ends inside a record is read up to it, with the warning
    // naming it, as for one spool.
    let cut = p.dir.path().join("cut.spool");
    let bytes = std::fs::read(&b).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 1]).unwrap();
    let o = spulse(&["info", "--json", s(&a), s(&cut)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("cut.spool: ends inside a record"), "{}", stderr(&o));
    let info: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(info["samples"], 399, "all but the cut sample");
    // The output is never one of the inputs.
    let o = spulse(&["export", "--format", "collapsed", "-o", s(&b), s(&a), s(&b)]);
    assert!(!o.status.success() && stderr(&o).contains("input spool"), "{}", stderr(&o));
}

fn last_table_samples(out: &str) -> u64 {
    let last = out.split("--- ").filter(|t| !t.is_empty()).last().expect("a table");
    let head = last.lines().next().unwrap();
    let n = head.split(": ").nth(1).and_then(|r| r.split(' ').next()).unwrap();
    n.parse().unwrap_or_else(|_| panic!("{head}"))
}

#[test]
fn follow_follows_a_rotating_recording_across_segments() {
    let _one = RECORDING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let pattern = dir.path().join("live-{seq}.spool");
    // One follower waits for the pattern, the other for the first segment.
    let by_pattern =
        spawn_spulse(&["follow", "--wait", "--wait-timeout", "60", s(&pattern), "--interval", "0.1"]);
    let first = dir.path().join("live-000000.spool");
    let by_first = spawn_spulse(&[
        "follow",
        "--segments",
        "--wait",
        "--wait-timeout",
        "60",
        s(&first),
        "--interval",
        "0.1",
    ]);
    std::thread::sleep(Duration::from_millis(200));
    let g = spulse::Recorder::builder()
        .flush_interval(Duration::from_millis(10))
        .rotate(Duration::from_millis(150))
        .start(&pattern)
        .unwrap();
    // Burn until the recording is in at least 4 segments (about 0.6 s; on a
    // loaded machine the writer's ticks, and so its rotations, come later).
    let deadline = Instant::now() + Duration::from_secs(20);
    while segment_files(dir.path(), "live-").len() < 5 && Instant::now() < deadline {
        black_box(rotate_hot_loop(Instant::now() + Duration::from_millis(100)));
    }
    let stats = g.finish().unwrap();
    assert!(stats.segments_written >= 4, "{} segments", stats.segments_written);
    for (what, child) in [("pattern", by_pattern), ("first segment", by_first)] {
        let t0 = Instant::now();
        let o = child.wait_with_output().unwrap();
        assert!(t0.elapsed() < Duration::from_secs(30), "{what}: follow did not end with the recording");
        let (out, err) = (stdout(&o), stderr(&o));
        assert!(o.status.success(), "{what}: {err}");
        assert!(
            err.contains("stopped: recording ended") && err.contains("no later segment"),
            "{what}: {err}"
        );
        assert_eq!(last_table_samples(&out), stats.samples_written, "{what}: every segment's samples");
        assert!(out.contains("rotate_hot_loop"), "{what}: {out}");
    }

    // Started on a later segment, it takes that one and the ones after it.
    let segs = segment_files(dir.path(), "live-");
    let later: u64 =
        segs[2..].iter().map(|p| json(&["info", "--json", s(p)])["samples"].as_u64().unwrap()).sum();
    let o = spulse(&["follow", "--segments", s(&segs[2]), "--interval", "0.1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(last_table_samples(&stdout(&o)), later);
    // Without --segments a segment is a plain spool (its name could be a pid).
    let alone = json(&["info", "--json", s(&segs[2])])["samples"].as_u64().unwrap();
    let o = spulse(&["follow", s(&segs[2]), "--interval", "0.1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(last_table_samples(&stdout(&o)), alone);
    assert!(stderr(&o).contains("--segments follows a rotating recording"), "a hint: {}", stderr(&o));
    let o = spulse(&["follow", "--segments", s(&dir.path().join("plain.spool"))]);
    assert!(!o.status.success() && stderr(&o).contains("no segment number"), "{}", stderr(&o));

    // Bad patterns say what is wrong.
    let o = spulse(&["follow", s(&dir.path().join("{seq}/x.spool"))]);
    assert!(!o.status.success() && stderr(&o).contains("file name"), "{}", stderr(&o));
    let o = spulse(&["follow", s(&dir.path().join("x-{pid}-{seq}.spool"))]);
    assert!(!o.status.success() && stderr(&o).contains("placeholder"), "{}", stderr(&o));
    let o = spulse(&["follow", s(&dir.path().join("none-{seq}.spool"))]);
    assert!(!o.status.success() && stderr(&o).contains("no segment"), "{}", stderr(&o));
}

/// `LD_PRELOAD` recordings rotate with `SPULSE_ROTATE` and `SPULSE_RETAIN`
/// (and `SPULSE_OUTPUT` with `{seq}`); `spulse record`, whose collector reads
/// one spool per process, is not affected by them.
#[test]
fn preload_recordings_rotate_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    // Where `spulse record` finds it too (cargo's layout).
    let lib = Path::new(env!("CARGO_BIN_EXE_spulse")).parent().unwrap().join("deps/libspulse_preload.so");
    assert!(lib.exists(), "{} is built with the tool", lib.display());
    // perl ends through exit(3), so the preload library's exit handler
    // finishes the recording (a shell may end with _exit(2), a crash to the
    // recorder, which can leave one more segment than retained).
    let busy = ["-e", "my $i = 0; $i++ while $i < 2e7"];
    let run = |retain: Option<&str>, prefix: &str| {
        let mut c = std::process::Command::new("perl");
        c.args(busy)
            .env("LD_PRELOAD", &lib)
            .env("SPULSE_OUTPUT", dir.path().join(format!("{prefix}{{seq}}.spool")))
            .env("SPULSE_ROTATE", "0.05");
        if let Some(n) = retain {
            c.env("SPULSE_RETAIN", n);
        }
        let o = c.output().unwrap();
        assert!(o.status.success() && o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
        segment_files(dir.path(), prefix)
    };
    let all = run(None, "all-");
    assert!(all.len() >= 3, "{} segments", all.len());
    let names: Vec<&str> = all.iter().map(|p| s(p)).collect();
    let sum: u64 = names.iter().map(|p| json(&["info", "--json", p])["samples"].as_u64().unwrap()).sum();
    let merged = json(&[&["info", "--json"][..], &names].concat());
    assert_eq!(merged["samples"].as_u64().unwrap(), sum);
    assert!(sum > 20, "{sum} samples");
    let kept = run(Some("2"), "kept-");
    assert_eq!(kept.len(), 2, "{kept:?}");

    let out = dir.path().join("rec.spool");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o", s(&out), "--", "perl", busy[0], busy[1]])
        .env("SPULSE_ROTATE", "0.05")
        .env("SPULSE_RETAIN", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(json(&["info", "--json", s(&out)])["samples"].as_u64().unwrap() > 20);
}

/// A hand-made segment `path` (complete, unlocked) with `n` samples of one
/// thread in one stack.
fn write_segment(path: &Path, n: u64) {
    let mut w =
        SpoolWriter::new(std::io::BufWriter::new(std::fs::File::create(path).unwrap()), header()).unwrap();
    let th = w.define_thread(PID, PID, "main").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let st = w.define_stack(None, f).unwrap();
    for i in 0..n {
        w.sample(START_US + i * INTERVAL_US, th, st).unwrap();
    }
    w.into_inner().unwrap();
}

/// An empty file whose modification time is a minute ago (a segment left
/// without its header when the disk filled, some time back).
fn write_stale_empty(path: &Path) {
    let f = std::fs::File::create(path).unwrap();
    f.set_modified(std::time::SystemTime::now() - Duration::from_secs(60)).unwrap();
}

/// `spulse follow PATTERN` on a finished recording, bounded: its status and
/// output, or a failure if it is still waiting after 30 s.
fn follow_finished(pattern: &Path) -> std::process::Output {
    let mut child = spawn_spulse(&["follow", s(pattern), "--interval", "0.1"]);
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(30) {
            child.kill().unwrap();
            let o = child.wait_with_output().unwrap();
            panic!("follow still waiting after 30 s: {}", stderr(&o));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Files in a segment sequence that are no segment of the recording: a name
/// another user took (the recorder stepped over it) and an empty segment left
/// unlocked when the disk filled are passed over with a warning; an empty
/// last segment ends the follow instead of a wait for ever.
#[test]
fn follow_passes_over_files_that_are_no_segment() {
    let dir = tempfile::tempdir().unwrap();
    let seg = |n: u32| dir.path().join(format!("p-{n:06}.spool"));
    write_segment(&seg(0), 40);
    std::fs::write(seg(1), b"another user's file").unwrap();
    write_stale_empty(&seg(2));
    write_segment(&seg(3), 25);
    let o = follow_finished(&dir.path().join("p-{seq}.spool"));
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{err}");
    assert_eq!(last_table_samples(&out), 65, "{out}\n{err}");
    assert!(err.contains("passed over") && err.contains("p-000001.spool"), "{err}");
    assert!(err.contains("p-000002.spool") && err.contains("header was never written"), "{err}");
    assert!(err.contains("stopped: recording ended"), "{err}");

    // The empty segment last: the recording stopped there.
    let dir = tempfile::tempdir().unwrap();
    write_segment(&dir.path().join("q-000000.spool"), 30);
    write_stale_empty(&dir.path().join("q-000001.spool"));
    let o = follow_finished(&dir.path().join("q-{seq}.spool"));
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{err}");
    assert_eq!(last_table_samples(&out), 30, "{out}\n{err}");
    assert!(err.contains("the recording stopped there"), "{err}");
}
