//! SIGKILL mid-recording: the spool opens, and holds every sample taken before
//! the writer's last flush preceding the kill.

mod recorder_support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use recorder_support::*;

/// Child role: record, burn, let two flush intervals pass, report the time and
/// CPU so far, burn a little more and die by SIGKILL.
#[test]
fn crash_role() {
    let Ok(path) = std::env::var("SPULSE_TEST_CRASH_SPOOL") else { return };
    let _guard = spulse::Recorder::builder()
        .frequency_hz(999)
        .flush_interval(Duration::from_millis(20))
        .start(&path)
        .unwrap();
    let c0 = thread_cpu_seconds();
    burn(0.5);
    let cpu = thread_cpu_seconds() - c0;
    let tid = gettid();
    let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros();
    std::thread::sleep(Duration::from_millis(100)); // several writer ticks
    println!("MARK {t} {cpu} {tid}");
    burn(0.05);
    // SAFETY: killing ourselves.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
}

#[test]
fn sigkill_mid_recording_leaves_a_readable_spool() {
    for round in 0..3 {
        let (_dir, path) = spool_path("crash.spool");
        let out = run_role("crash_role", "SPULSE_TEST_CRASH_SPOOL", &path);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(libc::SIGKILL), "child should die by SIGKILL: {out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mark = stdout
            .lines()
            .find_map(|l| l.split_once("MARK ").map(|x| x.1))
            .unwrap_or_else(|| panic!("no mark from the child: {out:?}"));
        let mut it = mark.split_whitespace();
        let t: u64 = it.next().unwrap().parse().unwrap();
        let cpu: f64 = it.next().unwrap().parse().unwrap();
        let tid: u32 = it.next().unwrap().parse().unwrap();

        let snap = spulse::Snapshot::open(&path).expect("spool opens after SIGKILL");
        let before =
            snap.samples().filter(|s| s.time_us <= t && snap.thread(s.thread).tid == tid).count() as f64;
        let expected = cpu * 999.0;
        eprintln!("round {round}: {before} samples before the mark, expected ~{expected:.0}");
        assert!(before >= 0.9 * expected, "only {before} of ~{expected:.0} samples flushed before the kill");
        assert!(!snap.modules().is_empty());
    }
}
