//! The comparison workload: N threads doing a fixed amount of CPU work split
//! 50/30/20 across three known functions, under one profiler chosen on the
//! command line. Prints one JSON object with timings, CPU, memory and the
//! profiler's sample counts, for `compare/run.py` to tabulate.
//!
//! Usage: workload --profiler none|spulse|pprof --freq HZ --threads N
//!                 [--rounds R] [--depth D] [--out PATH] [--gaps SECONDS]
//!                 [--engine auto|perf-event|perf-stack|perf-stack-tick]
//!                 [--stack-copy BYTES]
//!
//! `--engine` picks spulse's sampling engine (default: its automatic choice;
//! `perf-stack-tick` is the perf-stack engine drained only at the writer's
//! ticks, with rings large enough for a tick's samples; `--stack-copy` sets
//! the perf-stack engine's `user_stack_copy`).
//! With `perf-stack`, whose events are not inherited by threads created
//! later (they get one at the writer's next tick), the worker threads are
//! created first and wait until the recorder has started, so they are
//! sampled from their first instruction, as with the inherited signal events.
//! `workload_user_s` is the workers' user CPU time (`RUSAGE_THREAD`), the time
//! a user-time sampler's capture ratio is measured against.
//!
//! With `--gaps S`, each thread instead runs a gap meter for S seconds (below
//! the same `depth` frames): a tight loop reading the time-stamp counter that
//! adds up every gap between two reads longer than [`GAP_MIN_TICKS`] and
//! shorter than [`GAP_MAX_TICKS`]. Such a gap is time taken from the thread by
//! an interruption: for a profiler, the signal's delivery, its handler and the
//! return. Longer gaps are the thread being descheduled (8 threads share 2
//! cores) and count as neither interruption nor running time. The harness
//! compares the stolen share with and without a profiler: a direct measure of
//! the time a profiler takes from the threads it samples, without the +-5%
//! run-to-run drift of end-to-end timings on a shared virtual machine.
//! `window_cpu_s` is the process CPU spent while the threads ran (the
//! profiler's own threads included, its start and stop excluded).

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Shortest gap counted as an interruption (about 0.5 us at 2.1 GHz; a loop
/// iteration takes a few dozen ticks).
const GAP_MIN_TICKS: u64 = 1_000;
/// Longest gap counted as an interruption (about 100 us); longer ones are
/// descheduling.
const GAP_MAX_TICKS: u64 = 200_000;

#[inline(always)]
fn ticks() -> u64 {
    // SAFETY: rdtsc exists on every x86_64 CPU and has no memory effects.
    unsafe { core::arch::x86_64::_rdtsc() }
}

/// The gap meter's loop: returns (ticks running, ticks stolen by interruptions,
/// interruptions) over `seconds` of wall time.
#[inline(never)]
fn gap_meter(seconds: f64) -> (u64, u64, u64) {
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let (mut running, mut stolen, mut gaps) = (0u64, 0u64, 0u64);
    let mut prev = ticks();
    loop {
        for _ in 0..100_000 {
            let t = ticks();
            let d = t.wrapping_sub(prev);
            prev = t;
            if d < GAP_MIN_TICKS {
                running += d;
            } else if d < GAP_MAX_TICKS {
                running += d;
                stolen += d;
                gaps += 1;
                HIST[((d / HIST_BUCKET_TICKS) as usize).min(HIST.len() - 1)]
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        if Instant::now() >= end {
            return (running, stolen, gaps);
        }
        prev = ticks();
    }
}

/// The gap meter below `depth` frames, like the workload's hot functions.
#[inline(never)]
fn descend_gaps(depth: u32, seconds: f64) -> (u64, u64, u64) {
    if depth > 0 {
        let r = black_box(descend_gaps(depth - 1, seconds));
        return (r.0, r.1, black_box(r.2));
    }
    gap_meter(seconds)
}

/// Iterations in one chunk of work (about 20 us on the reference machine).
const CHUNK: u64 = 8_000;

#[inline(never)]
fn hot_alpha(n: u64, seed: u64) -> u64 {
    let mut x = seed;
    for i in 0..n {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(i ^ 0x9e37);
        x ^= x >> 29;
    }
    black_box(x)
}

#[inline(never)]
fn hot_beta(n: u64, seed: u64) -> u64 {
    let mut x = seed;
    for i in 0..n {
        x = x.wrapping_mul(2862933555777941757).wrapping_add(i ^ 0x7f4a);
        x ^= x >> 31;
    }
    black_box(x)
}

#[inline(never)]
fn hot_gamma(n: u64, seed: u64) -> u64 {
    let mut x = seed;
    for i in 0..n {
        x = x.wrapping_mul(3935559000370003845).wrapping_add(i ^ 0x51ed);
        x ^= x >> 27;
    }
    black_box(x)
}

/// One round: 5 chunks in alpha, 3 in beta, 2 in gamma, below `depth` frames.
#[inline(never)]
fn descend(depth: u32, seed: u64) -> u64 {
    if depth > 0 {
        return black_box(descend(depth - 1, seed.wrapping_add(1))).wrapping_add(1);
    }
    let mut x = seed;
    for _ in 0..5 {
        x = hot_alpha(CHUNK, x);
    }
    for _ in 0..3 {
        x = hot_beta(CHUNK, x);
    }
    for _ in 0..2 {
        x = hot_gamma(CHUNK, x);
    }
    x
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into the valid, exclusive `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn gettid() -> u32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

struct Args {
    profiler: String,
    freq: u32,
    threads: usize,
    rounds: u64,
    depth: u32,
    out: String,
    gaps: Option<f64>,
    engine: String,
    stack_copy: Option<u32>,
}

/// In gap-meter mode, give a profiler that has just started 300 ms before the
/// measured window opens, so its one-off start-up work (spulse's writer
/// faulting its ring in, for one) is not counted as the steady-state cost of
/// sampling; the window measures that cost only. Start-up is measured apart.
fn settle(a: &Args) {
    if a.gaps.is_some() {
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn parse_args() -> Args {
    let mut a = Args {
        profiler: "none".into(),
        freq: 999,
        threads: 1,
        rounds: 4000,
        depth: 20,
        out: "/tmp/spulse-compare.spool".into(),
        gaps: None,
        engine: "auto".into(),
        stack_copy: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--profiler" => a.profiler = v,
            "--freq" => a.freq = v.parse().expect("--freq"),
            "--threads" => a.threads = v.parse().expect("--threads"),
            "--rounds" => a.rounds = v.parse().expect("--rounds"),
            "--depth" => a.depth = v.parse().expect("--depth"),
            "--out" => a.out = v,
            "--gaps" => a.gaps = Some(v.parse().expect("--gaps")),
            "--engine" => a.engine = v,
            "--stack-copy" => a.stack_copy = Some(v.parse().expect("--stack-copy")),
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    a
}

/// Peak resident memory of this program, from `/proc/self/status` (`VmHWM`):
/// unlike `ru_maxrss`, it starts afresh at `exec`, so the harness's own memory
/// (inherited across fork) does not leak into it.
fn peak_rss_kb() -> i64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(-1)
}

fn rusage() -> (f64, i64) {
    // SAFETY: getrusage fills the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let cpu = ru.ru_utime.tv_sec as f64
        + ru.ru_utime.tv_usec as f64 / 1e6
        + ru.ru_stime.tv_sec as f64
        + ru.ru_stime.tv_usec as f64 / 1e6;
    (cpu, ru.ru_maxrss)
}

/// Histogram of interruption lengths, in units of `HIST_BUCKET_TICKS`: its
/// median is the typical cost of one interruption, which host noise and
/// descheduling move far less than the total.
static HIST: [std::sync::atomic::AtomicU64; 2048] = [const { std::sync::atomic::AtomicU64::new(0) }; 2048];
/// Width of a bucket of `HIST`, in time-stamp-counter ticks.
const HIST_BUCKET_TICKS: u64 = 100;
/// Gap-meter totals of every thread: ticks running, ticks stolen, gaps.
static GAPS: [std::sync::atomic::AtomicU64; 3] = [const { std::sync::atomic::AtomicU64::new(0) }; 3];
static GAP_SECONDS: std::sync::Mutex<Option<f64>> = std::sync::Mutex::new(None);

/// Process CPU seconds spent inside `run_workload` (every thread: the
/// workload's and the profiler's), as f64 bits.
static WINDOW_CPU: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Workers' user CPU time in microseconds.
static USER_CPU_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The calling thread's user CPU time in microseconds.
fn thread_user_us() -> u64 {
    // SAFETY: getrusage fills the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD is the calling thread.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    ru.ru_utime.tv_sec as u64 * 1_000_000 + ru.ru_utime.tv_usec as u64
}

fn run_workload(threads: usize, rounds: u64, depth: u32) -> (Vec<(u32, f64)>, u64) {
    run_workload_after(threads, rounds, depth, None)
}

/// The workload; with `prestart`, the threads are created first and start
/// working only once `prestart` has run.
fn run_workload_after(
    threads: usize,
    rounds: u64,
    depth: u32,
    prestart: Option<&mut dyn FnMut()>,
) -> (Vec<(u32, f64)>, u64) {
    let cpu0 = rusage().0;
    let r = run_workload_threads(threads, rounds, depth, prestart);
    WINDOW_CPU.store((rusage().0 - cpu0).to_bits(), std::sync::atomic::Ordering::Relaxed);
    r
}

fn run_workload_threads(
    threads: usize,
    rounds: u64,
    depth: u32,
    prestart: Option<&mut dyn FnMut()>,
) -> (Vec<(u32, f64)>, u64) {
    let gap_seconds = *GAP_SECONDS.lock().unwrap();
    let parties = if prestart.is_some() { threads + 1 } else { 1 };
    let go = std::sync::Arc::new(std::sync::Barrier::new(parties));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let go = go.clone();
            std::thread::Builder::new()
                .name(format!("worker-{t}"))
                .spawn(move || {
                    if parties > 1 {
                        go.wait();
                    }
                    let u0 = thread_user_us();
                    let mut x = t as u64;
                    if let Some(s) = gap_seconds {
                        let r = descend_gaps(depth, s);
                        for (total, v) in GAPS.iter().zip([r.0, r.1, r.2]) {
                            total.fetch_add(v, std::sync::atomic::Ordering::Relaxed);
                        }
                    } else {
                        for r in 0..rounds {
                            x = descend(depth, x ^ r);
                        }
                    }
                    USER_CPU_US.fetch_add(thread_user_us() - u0, std::sync::atomic::Ordering::Relaxed);
                    (gettid(), thread_cpu().as_secs_f64(), x)
                })
                .expect("spawn")
        })
        .collect();
    if let Some(f) = prestart {
        f();
        go.wait();
    }
    let mut per_thread = Vec::new();
    let mut check = 0u64;
    for h in handles {
        let (tid, cpu, x) = h.join().expect("worker");
        per_thread.push((tid, cpu));
        check ^= x;
    }
    (per_thread, check)
}

fn main() {
    let a = parse_args();
    *GAP_SECONDS.lock().unwrap() = a.gaps;
    let _ = std::fs::remove_file(&a.out);
    let tsc0 = ticks();
    let t0 = Instant::now();
    let mut extra = String::new();
    let (per_thread, check);
    // Wall and process CPU when profiling ended: after spulse's `finish` (which
    // drains, writes and syncs), before pprof-rs builds its report. Loading or
    // symbolizing the profile afterwards is timed separately (`load_s`).
    let mut ended: Option<(f64, f64)> = None;
    let mut end_now = || *ended.get_or_insert((t0.elapsed().as_secs_f64(), rusage().0));
    match a.profiler.as_str() {
        "none" => {
            (per_thread, check) = run_workload(a.threads, a.rounds, a.depth);
        }
        "spulse" => {
            let mut builder = spulse::Recorder::builder().frequency_hz(a.freq);
            // WORKLOAD_FLUSH_MS: the writer's flush interval (how often it wakes).
            if let Some(ms) = std::env::var("WORKLOAD_FLUSH_MS").ok().and_then(|v| v.parse().ok()) {
                builder = builder.flush_interval(Duration::from_millis(ms));
            }
            builder = match a.engine.as_str() {
                "auto" => builder,
                "perf-event" => builder.engine(spulse::EngineChoice::PerfEvent),
                "perf-stack" => builder.engine(spulse::EngineChoice::PerfStack),
                // Drained at the writer's ticks only: a ring that holds a
                // 100 ms tick's 16 KiB stack copies (2 MiB).
                "perf-stack-tick" => builder
                    .engine(spulse::EngineChoice::PerfStack)
                    .perf_stack_watermark(false)
                    .perf_stack_ring_pages(512),
                other => panic!("unknown engine {other}"),
            };
            if let Some(bytes) = a.stack_copy {
                builder = builder.user_stack_copy(bytes);
            }
            let prespawn = a.engine.starts_with("perf-stack");
            let mut guard = if prespawn {
                None
            } else {
                let g = builder.start(&a.out).expect("spulse start");
                settle(&a);
                Some(g)
            };
            // WORKLOAD_HANDLER_PHASE=classify|claim|registers|unwind: the handler
            // returns after that phase (the per-phase cost breakdown; those
            // samples are not recorded).
            if let Some(p) = std::env::var_os("WORKLOAD_HANDLER_PHASE") {
                use spulse::testing::handler_timing::Phase;
                let phase = match p.to_str() {
                    Some("classify") => Phase::Classify,
                    Some("claim") => Phase::Claim,
                    Some("registers") => Phase::Registers,
                    Some("unwind") => Phase::Unwind,
                    other => panic!("WORKLOAD_HANDLER_PHASE={other:?}: classify, claim, registers or unwind"),
                };
                spulse::testing::handler_timing::stop_after(Some(phase));
            }
            // WORKLOAD_HANDLER_TIMING=1: also report the handler's own time.
            let timing = std::env::var_os("WORKLOAD_HANDLER_TIMING").is_some();
            let mut handler = String::new();
            if timing {
                spulse::testing::handler_timing::handler_timing(true);
            }
            if prespawn {
                let mut start = || {
                    guard = Some(builder.start(&a.out).expect("spulse start"));
                    settle(&a);
                };
                (per_thread, check) = run_workload_after(a.threads, a.rounds, a.depth, Some(&mut start));
            } else {
                (per_thread, check) = run_workload(a.threads, a.rounds, a.depth);
            }
            let guard = guard.expect("started");
            if timing {
                spulse::testing::handler_timing::handler_timing(false);
                let hist = spulse::testing::handler_timing::take_handler_times();
                let total: u64 = hist.iter().sum();
                let mut acc = 0;
                let mut median = 0;
                for (i, n) in hist.iter().enumerate() {
                    acc += n;
                    if acc * 2 >= total {
                        median = i as u64 * spulse::testing::handler_timing::BUCKET_NS;
                        break;
                    }
                }
                let mean = hist.iter().enumerate().map(|(i, n)| i as u64 * n).sum::<u64>() * spulse::testing::handler_timing::BUCKET_NS
                    / total.max(1);
                handler = format!(r#","handler_median_ns":{median},"handler_mean_ns":{mean}"#);
            }
            let stats = guard.finish().expect("spulse finish");
            end_now();
            let l0 = Instant::now();
            let snap = spulse::Snapshot::open(&a.out).expect("open spool");
            let load_s = l0.elapsed().as_secs_f64();
            let mut counts = std::collections::HashMap::<u32, u64>::new();
            for s in snap.samples() {
                *counts.entry(snap.thread(s.thread).tid).or_default() += 1;
            }
            let per: Vec<String> =
                per_thread.iter().map(|(tid, _)| counts.get(tid).copied().unwrap_or(0).to_string()).collect();
            let bytes = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
            extra = format!(
                r#","samples":{},"per_thread_samples":[{}],"profile_bytes":{},"load_s":{:.6},"engine":"{}","writer_cpu_s":{:.6}"#,
                snap.len(),
                per.join(","),
                bytes,
                load_s,
                stats.engine,
                stats.writer_cpu.as_secs_f64()
            );
            extra.push_str(&handler);
        }
        #[cfg(any(feature = "pprof-default", feature = "pprof-framehop"))]
        "pprof" => {
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(a.freq as i32)
                .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                .build()
                .expect("pprof start");
            settle(&a);
            (per_thread, check) = run_workload(a.threads, a.rounds, a.depth);
            end_now();
            let l0 = Instant::now();
            let report = guard.report().build().expect("pprof report");
            let load_s = l0.elapsed().as_secs_f64();
            drop(guard);
            let mut by_name = std::collections::HashMap::<String, i64>::new();
            let mut leaves = std::collections::HashMap::<String, i64>::new();
            let mut by_fn = [0i64; 3];
            let mut total = 0i64;
            for (frames, count) in &report.data {
                total += *count as i64;
                *by_name.entry(frames.thread_name.clone()).or_default() += *count as i64;
                // The first frame whose symbol is the workload's own code (for an
                // address with inlined calls, its outermost function).
                let leaf = frames
                    .frames
                    .iter()
                    .filter_map(|inlined| inlined.last())
                    .map(|s| s.name())
                    .find(|n| {
                        !n.contains("pprof::")
                            && !n.contains("backtrace")
                            && !n.contains("perf_signal_handler")
                    })
                    .unwrap_or_default();
                if std::env::var_os("WORKLOAD_DEBUG").is_some() {
                    *leaves.entry(leaf.clone()).or_default() += *count as i64;
                }
                for (i, n) in ["hot_alpha", "hot_beta", "hot_gamma"].iter().enumerate() {
                    if leaf.contains(n) {
                        by_fn[i] += *count as i64;
                    }
                }
            }
            if std::env::var_os("WORKLOAD_DEBUG").is_some() {
                eprintln!("{leaves:#?}");
            }
            let per: Vec<String> = (0..per_thread.len())
                .map(|t| by_name.get(&format!("worker-{t}")).copied().unwrap_or(0).to_string())
                .collect();
            extra = format!(
                r#","samples":{},"per_thread_samples":[{}],"functions":{{"hot_alpha":{},"hot_beta":{},"hot_gamma":{}}},"load_s":{:.6}"#,
                total,
                per.join(","),
                by_fn[0],
                by_fn[1],
                by_fn[2],
                load_s
            );
        }
        other => panic!("profiler {other} not built into this binary"),
    }
    let (wall, cpu) = end_now();
    let maxrss = peak_rss_kb();
    let workload_cpu: f64 = per_thread.iter().map(|(_, c)| c).sum();
    if a.gaps.is_some() {
        let g: Vec<u64> = GAPS.iter().map(|v| v.load(std::sync::atomic::Ordering::Relaxed)).collect();
        let window = f64::from_bits(WINDOW_CPU.load(std::sync::atomic::Ordering::Relaxed));
        extra.push_str(&format!(
            r#","gap_running_ticks":{},"gap_stolen_ticks":{},"gaps":{},"window_cpu_s":{:.6},"workload_user_s":{:.6},"tsc_hz":{:.0}"#,
            g[0],
            g[1],
            g[2],
            window,
            USER_CPU_US.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6,
            ticks().wrapping_sub(tsc0) as f64 / t0.elapsed().as_secs_f64()
        ));
        let h: Vec<String> =
            HIST.iter().map(|v| v.load(std::sync::atomic::Ordering::Relaxed).to_string()).collect();
        extra.push_str(&format!(r#","gap_hist":[{}],"gap_hist_bucket_ticks":{}"#, h.join(","), HIST_BUCKET_TICKS));
    }
    println!(
        r#"{{"profiler":"{}","freq":{},"threads":{},"wall_s":{:.6},"cpu_s":{:.6},"workload_cpu_s":{:.6},"maxrss_kb":{},"check":{}{}}}"#,
        a.profiler, a.freq, a.threads, wall, cpu, workload_cpu, maxrss, check, extra
    );
}
