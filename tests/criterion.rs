//! `spulse::criterion::Profiler` (cargo feature `criterion`): criterion's
//! profile mode (`--profile-time`) gives each benchmark its own recording and
//! flame graph, in which that benchmark's function is the hot one; a second
//! run replaces them; a benchmark whose recording cannot start still runs.
//!
//! One test function: a process has one recorder at a time.

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::Criterion;

#[inline(never)]
fn criterion_hot_alpha(n: u64) -> u64 {
    let mut x = n;
    for i in 0..20_000u64 {
        x = black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
    }
    x
}

#[inline(never)]
fn criterion_hot_beta(n: u64) -> u64 {
    let mut x = n;
    for i in 0..20_000u64 {
        x = black_box(x.rotate_left(7) ^ i.wrapping_mul(0x9e3779b97f4a7c15));
    }
    x
}

/// Files named `name` under `dir`, at any depth.
fn find(dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            found.extend(find(&p, name));
        } else if p.file_name().is_some_and(|n| n == name) {
            found.push(p);
        }
    }
    found.sort();
    found
}

fn run(out: &Path, ran: &mut [u64; 2]) {
    let mut c = Criterion::default()
        .with_profiler(spulse::criterion::Profiler::new())
        .output_directory(out)
        .warm_up_time(Duration::from_millis(200))
        .profile_time(Some(Duration::from_millis(600)));
    c.bench_function("alpha", |b| {
        b.iter(|| {
            ran[0] += 1;
            criterion_hot_alpha(black_box(1))
        })
    });
    c.bench_function("beta", |b| {
        b.iter(|| {
            ran[1] += 1;
            criterion_hot_beta(black_box(1))
        })
    });
}

/// The share of samples whose stack holds a frame named like `name`, by
/// the SVG's text (each frame's title is `name (N samples, P%)`).
fn svg_has(svg: &Path, name: &str) -> bool {
    std::fs::read_to_string(svg).unwrap().contains(name)
}

#[test]
fn each_benchmark_gets_its_recording_and_flame_graph() {
    let dir = tempfile::tempdir().unwrap();
    let mut ran = [0u64; 2];
    run(dir.path(), &mut ran);
    assert!(ran[0] > 0 && ran[1] > 0, "{ran:?}");

    let spools = find(dir.path(), "profile.spool");
    let svgs = find(dir.path(), "flamegraph.svg");
    assert_eq!(spools.len(), 2, "{spools:?}");
    assert_eq!(svgs.len(), 2, "{svgs:?}");
    for (spool, svg) in spools.iter().zip(&svgs) {
        assert_eq!(spool.parent(), svg.parent());
        let bench = spool.components().rev().nth(2).unwrap().as_os_str().to_string_lossy().into_owned();
        let (own, other) = match bench.as_str() {
            "alpha" => ("criterion_hot_alpha", "criterion_hot_beta"),
            "beta" => ("criterion_hot_beta", "criterion_hot_alpha"),
            b => panic!("unexpected benchmark directory {b} ({})", spool.display()),
        };
        let samples =
            spulse::Replay::open(spool).unwrap().samples().try_fold(0usize, |n, s| s.map(|_| n + 1)).unwrap();
        // 600 ms of profile time at 999 Hz: well above this on any machine
        // that gives the thread a tenth of a core.
        assert!(samples >= 30, "{}: {samples} samples", spool.display());
        assert!(svg_has(svg, own), "{} draws {own}", svg.display());
        assert!(!svg_has(svg, other), "{} draws only its own benchmark, not {other}", svg.display());
    }

    // A second run replaces the files (criterion reuses the directories).
    let before: Vec<_> = spools.iter().map(|p| std::fs::metadata(p).unwrap().len()).collect();
    std::fs::write(&svgs[0], b"stale").unwrap();
    run(dir.path(), &mut ran);
    assert_eq!(find(dir.path(), "profile.spool"), spools);
    assert!(svg_has(&svgs[0], "</svg>"), "the stale graph was replaced");
    assert!(before.iter().all(|&n| n > 0));

    // A recorder already running in the process: the profiler cannot start
    // its own; the benchmarks still run and write no profile.
    let other = tempfile::tempdir().unwrap();
    let guard = spulse::start(other.path().join("outer.spool")).unwrap();
    let fresh = tempfile::tempdir().unwrap();
    let mut ran2 = [0u64; 2];
    run(fresh.path(), &mut ran2);
    assert!(ran2[0] > 0 && ran2[1] > 0, "{ran2:?}");
    assert!(find(fresh.path(), "profile.spool").is_empty());
    assert!(find(fresh.path(), "flamegraph.svg").is_empty());
    guard.finish().unwrap();
}
