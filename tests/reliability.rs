//! Reliability campaign, short CI versions (issue 5): recordings killed with
//! SIGKILL at random moments, and a soak of a churning, allocation-, lock- and
//! syscall-heavy program at 4 kHz.
//!
//! Each scenario runs in a child process: this test binary re-executes itself
//! with `SPULSE_RELIABILITY_CHILD` set, and the `child_entry` test then plays
//! the profiled program. The long runs are the same tests with larger numbers
//! (see BENCHMARKS.md):
//!
//! ```text
//! SPULSE_CRASH_RUNS=200 cargo test --release --test reliability crash -- --nocapture
//! SPULSE_SOAK_SECS=600 cargo test --release --test reliability soak -- --nocapture
//! ```

use spulse_testkit::emulator;
use spulse_testkit::emulator::self_command;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const CHILD_ENV: &str = "SPULSE_RELIABILITY_CHILD";
const FLUSH: Duration = Duration::from_millis(50);

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64
}

fn spawn_child(mode: &str, spool: &std::path::Path, extra: &[(&str, String)]) -> Child {
    let mut cmd = self_command();
    cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, mode)
        .env("SPULSE_TEST_SPOOL", spool)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child")
}

/// Read child stdout until a line equal to `want`; returns the rest of the reader.
fn wait_line(child: &mut Child, want: &str) -> BufReader<std::process::ChildStdout> {
    let mut r = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        let n = r.read_line(&mut line).unwrap();
        assert!(n > 0, "child exited before printing {want:?}");
        if line.trim().ends_with(want) {
            return r;
        }
    }
}

/// A tiny deterministic generator (no dev-dependency needed for the delays).
fn next_rand(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[inline(never)]
fn spin(n: u64) -> u64 {
    let mut x = n;
    for i in 0..n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
    }
    std::hint::black_box(x)
}

#[test]
fn crash_campaign() {
    let runs = env_num("SPULSE_CRASH_RUNS", 8);
    let dir = tempfile::tempdir().unwrap();
    let mut rng = 0x9e3779b97f4a7c15u64 ^ now_us();
    let mut gaps_ms = Vec::new();
    let mut recovered = 0;
    for i in 0..runs {
        let spool = dir.path().join(format!("crash-{i}.spool"));
        let mut child = spawn_child("crash", &spool, &[]);
        let _rest = wait_line(&mut child, "recording");
        let delay = 100 + next_rand(&mut rng) % 1400;
        std::thread::sleep(Duration::from_millis(delay));
        let kill_us = now_us();
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert!(!status.success());
        let snap =
            spulse::Snapshot::open(&spool).unwrap_or_else(|e| panic!("run {i}: spool does not open: {e}"));
        recovered += snap.recovered_from_truncated_tail() as u32;
        assert!(!snap.is_empty(), "run {i}: no samples after {delay} ms of recording");
        // Everything written before the last flush is there: the newest sample
        // is at most one flush interval (plus scheduling slack) older than the kill.
        let newest = snap.samples().map(|s| s.time_us).max().unwrap();
        let gap_ms = kill_us.saturating_sub(newest) as f64 / 1000.0;
        gaps_ms.push(gap_ms);
    }
    gaps_ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = gaps_ms[gaps_ms.len() / 2];
    let max = *gaps_ms.last().unwrap();
    eprintln!(
        "crash campaign: {runs} kills, all spools opened, {recovered} recovered from a torn tail; \
         newest sample before kill: median {median:.1} ms, max {max:.1} ms (flush interval {} ms)",
        FLUSH.as_millis()
    );
    // The writer flushes every 50 ms; allow the same again for a loaded 2-core
    // machine to schedule the writer thread.
    assert!(max <= 2.0 * FLUSH.as_millis() as f64, "newest sample {max:.1} ms before the kill");
}

#[test]
fn soak() {
    let secs = env_num("SPULSE_SOAK_SECS", 6);
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("soak.spool");
    let mut child = spawn_child("soak", &spool, &[("SPULSE_SOAK_SECS", secs.to_string())]);
    let pid = child.id();
    let mut out = wait_line(&mut child, "recording");
    // Sample the child's resident memory while it runs.
    let mut rss_kb = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(secs * 3 + 60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "soak child failed: {status}");
            break;
        }
        assert!(Instant::now() < deadline, "soak child did not finish: deadlock?");
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            if let Some(l) = s.lines().find(|l| l.starts_with("VmRSS:")) {
                let kb: u64 = l.split_whitespace().nth(1).unwrap().parse().unwrap();
                rss_kb.push(kb);
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut report = String::new();
    out.read_to_string(&mut report).unwrap();
    assert!(report.contains("soak ok"), "child report: {report}");
    let snap = spulse::Snapshot::open(&spool).unwrap();
    assert!(!snap.recovered_from_truncated_tail());
    assert!(snap.len() > 100, "only {} samples", snap.len());
    assert!(snap.threads().len() > 16, "threads come and go: {} thread records", snap.threads().len());
    // Resident memory flat after warm-up: the last quarter's peak stays within
    // 16 MiB of the peak of the second quarter.
    if rss_kb.len() >= 8 {
        let q = rss_kb.len() / 4;
        let warm = *rss_kb[q..2 * q].iter().max().unwrap();
        let late = *rss_kb[3 * q..].iter().max().unwrap();
        eprintln!(
            "soak: {secs} s, {} samples, RSS after warm-up {warm} kB, at the end {late} kB; {}",
            snap.len(),
            report.trim()
        );
        if emulator::emulated() {
            // The child's RSS is the emulator's, its translated code included.
            eprintln!(
                "RSS CHECK NOT APPLICABLE: the child runs under an emulator (RSS {warm} kB -> {late} kB)"
            );
        } else {
            assert!(late <= warm + 16 * 1024, "RSS grew from {warm} kB to {late} kB");
        }
    }
}

/// The profiled programs (runs only in a child process).
#[test]
fn child_entry() {
    let Ok(mode) = std::env::var(CHILD_ENV) else { return };
    let spool = std::env::var("SPULSE_TEST_SPOOL").unwrap();
    match mode.as_str() {
        "crash" => {
            let _guard = spulse::Recorder::builder().flush_interval(FLUSH).start(&spool).unwrap();
            for t in 0..2 {
                std::thread::spawn(move || loop {
                    spin(100_000 + t);
                });
            }
            println!("recording");
            std::io::stdout().flush().unwrap();
            loop {
                spin(100_000);
            }
        }
        "soak" => soak_child(&spool),
        other => panic!("unknown child mode {other}"),
    }
}

fn soak_child(spool: &str) {
    let secs = env_num("SPULSE_SOAK_SECS", 6);
    let guard = spulse::Recorder::builder().frequency_hz(4000).start(spool).unwrap();
    println!("recording");
    std::io::stdout().flush().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let eintr = Arc::new(AtomicU64::new(0));
    let done_ops = Arc::new(AtomicU64::new(0));
    let shared = Arc::new((Mutex::new(Vec::<u64>::new()), Condvar::new()));
    let end = Instant::now() + Duration::from_secs(secs);
    let mut generation = 0u64;
    // 16 worker slots; each worker lives a short while, then a new one takes its place.
    let mut workers: Vec<std::thread::JoinHandle<u64>> = Vec::new();
    while Instant::now() < end {
        while workers.len() < 16 {
            generation += 1;
            let (stop, eintr, done_ops, shared) =
                (stop.clone(), eintr.clone(), done_ops.clone(), shared.clone());
            let g = generation;
            workers.push(std::thread::spawn(move || churn_worker(g, &stop, &eintr, &done_ops, &shared)));
        }
        // Reap finished workers and check their answers.
        let mut i = 0;
        while i < workers.len() {
            if workers[i].is_finished() {
                let sum = workers.swap_remove(i).join().expect("worker panicked");
                assert_eq!(sum, expected_worker_sum(), "wrong answer from a worker");
            } else {
                i += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.store(true, Ordering::Relaxed);
    shared.1.notify_all();
    for w in workers {
        assert_eq!(w.join().expect("worker panicked"), expected_worker_sum());
    }
    let stats = guard.finish().unwrap();
    let e = eintr.load(Ordering::Relaxed);
    assert_eq!(e, 0, "EINTR surfaced to blocking calls {e} times");
    println!(
        "soak ok: {} threads, {} ops, {} samples written, {} lost, engine {}",
        generation,
        done_ops.load(Ordering::Relaxed),
        stats.samples_written,
        stats.lost(),
        stats.engine
    );
}

const WORKER_ROUNDS: u64 = 40;

fn expected_worker_sum() -> u64 {
    (0..WORKER_ROUNDS).map(|r| (0..64u64).map(|k| k * r).sum::<u64>()).sum()
}

/// Allocates, locks, waits on a condvar, does pipe and file syscalls; returns
/// a checksum that must equal `expected_worker_sum()`.
fn churn_worker(
    g: u64,
    _stop: &AtomicBool,
    eintr: &AtomicU64,
    done_ops: &AtomicU64,
    shared: &(Mutex<Vec<u64>>, Condvar),
) -> u64 {
    let (rfd, wfd) = {
        let mut fds = [0i32; 2];
        // SAFETY: pipe writes two fds into the array we own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        use std::os::fd::FromRawFd;
        // SAFETY: both fds were just created by pipe and are owned by nothing else.
        unsafe { (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1])) }
    };
    let (mut rfd, mut wfd) = (rfd, wfd);
    let mut sum = 0u64;
    for r in 0..WORKER_ROUNDS {
        // Allocation-heavy: build and drop vectors and strings.
        let v: Vec<u64> = (0..64u64).map(|k| k * r).collect();
        let s: String = v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",");
        std::hint::black_box(&s);
        // Lock-heavy: push into a shared vector and wake a waiter.
        {
            let mut q = shared.0.lock().unwrap();
            q.push(g);
            if q.len() > 1024 {
                q.clear();
            }
        }
        shared.1.notify_one();
        {
            let q = shared.0.lock().unwrap();
            let _ = shared.1.wait_timeout(q, Duration::from_micros(200)).unwrap();
        }
        // Syscall-heavy: a blocking pipe round trip with plain read/write.
        wfd.write_all(&r.to_le_bytes()).unwrap();
        let mut b = [0u8; 8];
        let mut got = 0;
        while got < 8 {
            match rfd.read(&mut b[got..]) {
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {
                    eintr.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => panic!("pipe read: {e}"),
            }
        }
        assert_eq!(u64::from_le_bytes(b), r);
        std::thread::sleep(Duration::from_micros(100));
        spin(20_000);
        sum += v.iter().sum::<u64>();
        done_ops.fetch_add(1, Ordering::Relaxed);
    }
    sum
}
