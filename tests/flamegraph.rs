//! `Guard::finish_with_flamegraph` (cargo feature `flamegraph`): a recording
//! of this test process ends with its spool and an SVG flame graph that
//! draws every sample of the spool, the hot function among them; a graph that
//! cannot be written is an error naming its path, and the spool is complete.
//!
//! One test function: a process has one recorder at a time.

use std::hint::black_box;
use std::time::{Duration, Instant};

/// CPU work in a function of its own, for at least `cpu` of this thread's CPU time.
#[inline(never)]
fn flamegraph_hot_loop(cpu: Duration) -> u64 {
    let start = thread_cpu();
    let mut x = 1u64;
    while thread_cpu() - start < cpu {
        for i in 0..100_000u64 {
            x = black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
        }
    }
    x
}

/// This thread's CPU time.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the valid `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn samples(spool: &std::path::Path) -> u64 {
    let r = spulse::Replay::open(spool).unwrap();
    r.samples().try_fold(0u64, |n, s| s.map(|_| n + 1)).unwrap()
}

#[test]
fn finish_with_flamegraph_writes_the_recording() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("fg.spool");
    let svg = dir.path().join("fg.svg");
    let guard = spulse::start(&spool).unwrap();
    let t = Instant::now();
    black_box(flamegraph_hot_loop(Duration::from_millis(300)));
    assert!(t.elapsed() < Duration::from_secs(120));
    let stats = guard.finish_with_flamegraph(&svg).unwrap();
    let n = samples(&spool);
    assert!(n >= 50, "{n} samples (stats: {} written)", stats.samples_written);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<?xml") && text.trim_end().ends_with("</svg>"), "an SVG document");
    assert!(text.contains("flamegraph_hot_loop"), "the hot function is drawn");
    // Every sample is drawn: inferno's root frame says how many.
    assert!(text.contains(&format!("all ({n} samples, 100%)")), "the root counts {n} samples");
    // No temporary file left beside it.
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 2, "{names:?}");

    // The same graph from the spool afterwards.
    let again = dir.path().join("again.svg");
    assert_eq!(spulse::flamegraph::write_flamegraph(&spool, &again).unwrap(), n);

    // A graph into a missing directory: an error naming it; the spool is whole.
    let spool2 = dir.path().join("fg2.spool");
    let bad = dir.path().join("missing").join("x.svg");
    let guard = spulse::start(&spool2).unwrap();
    black_box(flamegraph_hot_loop(Duration::from_millis(50)));
    match guard.finish_with_flamegraph(&bad) {
        Err(spulse::Error::Io { path: Some(p), .. }) => assert_eq!(p, bad),
        other => panic!("expected an I/O error naming {}: {other:?}", bad.display()),
    }
    assert!(samples(&spool2) > 0);
}
