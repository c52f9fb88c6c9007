//! Recorder benchmarks: the signal handler's own cost per sample at stack depths
//! 10, 50 and 200 (median and p99, from the handler's timing histogram), the
//! overhead of recording on a CPU-bound multithreaded workload at 99 Hz and
//! 999 Hz against no profiler (criterion), and the capture ratio (samples /
//! CPU time x frequency) with 1, 2 and 8 busy threads, and the cost of
//! rotation (the writer thread's CPU time and the spool bytes per segment,
//! against the same recording without rotation, interleaved).
//!
//! `cargo bench --bench recorder` prints every figure; under `cargo test` each
//! part runs once, briefly. `SPULSE_BENCH_PARTS=handler,overhead,capture,rotation`
//! (any subset) picks the parts to run.

use std::hint::black_box;
use std::time::Duration;

use criterion::Criterion;

use spulse_testkit::symbols as support;

use support::{burn_cpu, gettid, thread_cpu_seconds as thread_cpu};

/// Busy user-space work until the thread used `cpu` seconds. The CPU clock is
/// read (a system call) only every ~0.5 ms: the perf engine counts user time,
/// and a workload that spends a few percent of its time in system calls would
/// measure that, not the recorder. Always inlined, so that the busy leaf frame
/// (`burn_cpu`) sits directly under `at_depth`.
#[inline(always)]
fn spin_cpu(cpu: f64) -> u64 {
    burn_cpu(cpu, 500_000, Duration::from_secs_f64(cpu * 20.0 + 1.0))
}

#[inline(never)]
fn at_depth(n: usize, cpu: f64) -> u64 {
    if n == 0 {
        return spin_cpu(cpu);
    }
    black_box(at_depth(n - 1, cpu)).wrapping_add(1)
}

fn percentile(hist: &[u64], q: f64) -> f64 {
    let total: u64 = hist.iter().sum();
    let target = (total as f64 * q).ceil() as u64;
    let mut acc = 0;
    for (i, &n) in hist.iter().enumerate() {
        acc += n;
        if acc >= target.max(1) {
            return (i as f64 + 0.5) * spulse::testing::handler_timing::BUCKET_NS as f64;
        }
    }
    f64::NAN
}

fn handler_cost(cpu: f64) {
    println!("\nhandler cost per sample (perf-event engine, 4 kHz, handler entry to exit):");
    println!("  {:>6} {:>11} {:>10} {:>10} {:>8}", "depth", "frames/smpl", "median", "p99", "samples");
    for depth in [10usize, 50, 200] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.spool");
        // Frames below the recursion (thread start, closure, at_depth itself): about 6.
        let recursion = depth.saturating_sub(6);
        let g = spulse::Recorder::builder().frequency_hz(4000).max_stack_depth(256).start(&path).unwrap();
        let _ = spulse::testing::handler_timing::take_handler_times();
        spulse::testing::handler_timing::handler_timing(true);
        let tid = std::thread::spawn(move || {
            black_box(at_depth(recursion, cpu));
            gettid()
        })
        .join()
        .unwrap();
        spulse::testing::handler_timing::handler_timing(false);
        let hist = spulse::testing::handler_timing::take_handler_times();
        g.finish().unwrap();
        let snap = spulse::Snapshot::open(&path).unwrap();
        let (mut frames, mut n) = (0usize, 0usize);
        for s in snap.samples().filter(|s| snap.thread(s.thread).tid == tid) {
            frames += snap.stack_depth(s.stack);
            n += 1;
        }
        println!(
            "  {:>6} {:>11.1} {:>8.2}us {:>8.2}us {:>8}",
            depth,
            frames as f64 / n.max(1) as f64,
            percentile(&hist, 0.5) / 1000.0,
            percentile(&hist, 0.99) / 1000.0,
            hist.iter().sum::<u64>()
        );
    }
}

/// The CPU-bound multithreaded workload of the overhead benchmark: two threads
/// (the machine's cores) hashing a fixed number of rounds each.
fn workload(rounds: u64) -> u64 {
    let hs: Vec<_> = (0..2)
        .map(|t| {
            std::thread::spawn(move || {
                let mut h = t as u64 + 1;
                for i in 0..rounds {
                    h = (h ^ black_box(i)).wrapping_mul(0x100_0000_01b3).rotate_left(5);
                }
                h
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).fold(0, |a, b| a ^ b)
}

/// CPU time of the whole process (every thread, user + system), in seconds.
fn process_cpu() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the struct we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Overhead is measured as process CPU time (user + system, every thread: the
/// workload, the handler, the kernel's signal delivery and the writer thread),
/// not wall time, so other load on a shared machine does not swamp it.
fn overhead(c: &mut Criterion, bench: bool) {
    let rounds = if bench { 20_000_000 } else { 200_000 }; // ~30 ms per thread here
    let cpu_of = |iters: u64| {
        let c0 = process_cpu();
        for _ in 0..iters {
            black_box(workload(rounds));
        }
        Duration::from_secs_f64(process_cpu() - c0)
    };
    let mut group = c.benchmark_group("overhead_cpu_time");
    group.sample_size(20).measurement_time(Duration::from_secs(5)).warm_up_time(Duration::from_secs(1));
    group.bench_function("none", |b| b.iter_custom(cpu_of));
    for hz in [99u32, 999] {
        let dir = tempfile::tempdir().unwrap();
        let g = spulse::Recorder::builder().frequency_hz(hz).start(dir.path().join("o.spool")).unwrap();
        group.bench_function(format!("spulse_{hz}hz"), |b| b.iter_custom(cpu_of));
        g.finish().unwrap();
    }
    group.finish();

    // The same comparison as medians of interleaved runs (none, 99 Hz, 999 Hz in
    // turn), so drift of the machine spreads over all three alike.
    let reps = if bench { 31 } else { 1 };
    let mut runs: [Vec<f64>; 3] = Default::default();
    for _ in 0..reps {
        for (k, hz) in [0u32, 99, 999].into_iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let g = (hz > 0).then(|| {
                spulse::Recorder::builder().frequency_hz(hz).start(dir.path().join("o.spool")).unwrap()
            });
            let c0 = process_cpu();
            for _ in 0..3 {
                black_box(workload(rounds));
            }
            runs[k].push(process_cpu() - c0);
            if let Some(g) = g {
                g.finish().unwrap();
            }
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        (v[v.len() / 2], v[0])
    };
    let (base, base_min) = med(&mut runs[0]);
    println!(
        "\noverhead on the 2-thread CPU-bound workload (process CPU of {reps} interleaved runs, median and minimum):"
    );
    println!("  none      {:8.1} ms            min {:8.1} ms", base * 1e3, base_min * 1e3);
    for (k, hz) in [(1usize, 99), (2, 999)] {
        let (m, lo) = med(&mut runs[k]);
        println!(
            "  {hz:3} Hz    {:8.1} ms {:+6.2}%    min {:8.1} ms {:+6.2}%",
            m * 1e3,
            (m / base - 1.0) * 100.0,
            lo * 1e3,
            (lo / base_min - 1.0) * 100.0
        );
    }
}

fn capture(cpu_each: f64) {
    println!("\ncapture ratio at 999 Hz (samples of the busy threads / their CPU time x 999):");
    for threads in [1usize, 2, 8] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.spool");
        let g = spulse::Recorder::builder().frequency_hz(999).start(&path).unwrap();
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                std::thread::spawn(move || {
                    let c0 = thread_cpu();
                    black_box(spin_cpu(cpu_each));
                    (gettid(), thread_cpu() - c0)
                })
            })
            .collect();
        let res: Vec<(u32, f64)> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let stats = g.finish().unwrap();
        let snap = spulse::Snapshot::open(&path).unwrap();
        let tids: Vec<u32> = res.iter().map(|r| r.0).collect();
        let samples = snap.samples().filter(|s| tids.contains(&snap.thread(s.thread).tid)).count();
        let cpu: f64 = res.iter().map(|r| r.1).sum();
        println!(
            "  {threads} thread(s): {samples} samples / ({cpu:.3} CPU-s x 999) = {:.3}  [engine {}, lost {}]",
            samples as f64 / (cpu * 999.0),
            stats.engine,
            stats.lost()
        );
    }
}

/// CPU time (ns) thread `tid` of this process has run, from its schedstat.
fn thread_run_ns(tid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).unwrap_or_default();
    s.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// The recorder's writer thread (named `spulse-writer`).
fn writer_tid() -> u32 {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|tid| {
            std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
                .is_ok_and(|c| c.trim() == "spulse-writer")
        })
        .expect("the writer thread")
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One run of the rotation part: writer CPU ms, bytes, segments, samples.
type RotationRun = (f64, u64, u64, u64);

/// The cost of rotation: the same busy recording (one thread, 999 Hz, 10 ms
/// flushes) without rotation and rotating every 20 ms, in turn; the writer thread's CPU
/// time while recording and the bytes written, per segment.
fn rotation(bench: bool) {
    let (reps, cpu) = if bench { (9, 2.0) } else { (1, 0.1) };
    let every = Duration::from_millis(20);
    println!(
        "
rotation cost ({cpu} s busy at 999 Hz; rotating every {every:?} vs one file; {reps} runs each, interleaved):"
    );
    let mut runs: [Vec<RotationRun>; 2] = Default::default();
    for _ in 0..reps {
        for (k, rotating) in [false, true].into_iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let b = spulse::Recorder::builder().frequency_hz(999).flush_interval(Duration::from_millis(10));
            let (b, name) = if rotating { (b.rotate(every), "r-{seq}.spool") } else { (b, "one.spool") };
            let g = b.start(dir.path().join(name)).unwrap();
            let writer = writer_tid();
            let w0 = thread_run_ns(writer);
            black_box(spin_cpu(cpu));
            let w1 = thread_run_ns(writer);
            let stats = g.finish().unwrap();
            runs[k].push((
                (w1 - w0) as f64 / 1e6,
                stats.bytes,
                stats.segments_written,
                stats.samples_written,
            ));
        }
    }
    let col =
        |k: usize, f: &dyn Fn(&RotationRun) -> f64| median(&mut runs[k].iter().map(f).collect::<Vec<_>>());
    let (w_one, w_rot) = (col(0, &|r| r.0), col(1, &|r| r.0));
    let (segs, samples) = (col(1, &|r| r.2 as f64), col(1, &|r| r.3 as f64));
    // Bytes per sample, so runs with different sample counts compare.
    let (b_one, b_rot) = (col(0, &|r| r.1 as f64 / r.3 as f64), col(1, &|r| r.1 as f64 / r.3 as f64));
    println!(
        "  {:>10} {:>14} {:>12} {:>10} {:>10}",
        "", "writer CPU ms", "bytes/sample", "segments", "samples"
    );
    println!("  {:>10} {w_one:>14.2} {b_one:>12.2} {:>10} {:>10.0}", "one file", 1, col(0, &|r| r.3 as f64));
    println!("  {:>10} {w_rot:>14.2} {b_rot:>12.2} {segs:>10.0} {samples:>10.0}", "rotating");
    println!(
        "  per segment: {:.1} us of writer CPU, {:.0} bytes (medians' difference / segments)",
        (w_rot - w_one) * 1e3 / segs,
        (b_rot - b_one) * samples / segs
    );
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let mut c = Criterion::default().configure_from_args();
    // `SPULSE_BENCH_PARTS=handler,capture` (say) runs only those parts.
    let parts =
        std::env::var("SPULSE_BENCH_PARTS").unwrap_or_else(|_| "handler,overhead,capture,rotation".into());
    let part = |name: &str| parts.split(',').any(|p| p.trim() == name);
    if part("handler") {
        handler_cost(if bench { 1.0 } else { 0.05 });
    }
    if part("overhead") {
        overhead(&mut c, bench);
    }
    if part("capture") {
        capture(if bench { 1.0 } else { 0.05 });
    }
    if part("rotation") {
        rotation(bench);
    }
    c.final_summary();
}
