//! Accuracy and capture: two threads whose CPU time splits 3:1 between two
//! `#[inline(never)]` functions, recorded at 999 Hz with the default (perf-event)
//! engine (and each other engine, forced). At least 95% of their user-mode samples must land in those functions,
//! in a 3:1 ratio within 3 points, and the user-mode sample count must reach 90%
//! of the threads' CPU time x frequency (under an emulator, with the intervals
//! over the per-signal weight cap, which are counted as lost). (Samples with a kernel-mode leaf are
//! their system time, the CPU-clock reads of the loop and signal delivery:
//! counted apart, in `recorder_kernel.rs`.)

mod recorder_support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use recorder_support::*;

#[inline(always)]
fn spin(n: u64) -> u64 {
    let mut h = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..n {
        h = (h ^ black_box(i)).wrapping_mul(0x100_0000_01b3).rotate_left(17);
    }
    h
}

#[inline(never)]
fn work_three(n: u64) -> u64 {
    spin(3 * n)
}

#[inline(never)]
fn work_one(n: u64) -> u64 {
    spin(n)
}

/// How long the workload runs.
#[derive(Clone, Copy)]
enum Until {
    /// Each thread has used this many seconds of CPU.
    Cpu(f64),
    /// The spool holds this many samples (read while it grows, with `Tail`).
    Samples(usize),
}

/// Runs the workload on two threads until `until` holds (or `wall` passed: the
/// machine may be busy); returns (tids, total CPU s). `path` is the spool being
/// recorded.
fn workload(until: Until, wall: Duration, path: &std::path::Path) -> (Vec<u32>, f64) {
    let deadline = Instant::now() + wall;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cpu_each = match until {
        Until::Cpu(c) => c,
        Until::Samples(_) => f64::INFINITY,
    };
    let hs: Vec<_> = (0..2)
        .map(|i| {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("acc-{i}"))
                .spawn(move || {
                    let tid = gettid();
                    let c0 = thread_cpu_seconds();
                    let mut acc = 0;
                    // Each round's length is drawn at random (10,000-30,000
                    // steps, the same for both functions: 3:1 in every
                    // round): rounds of one fixed length (about 120 us, 8 to
                    // a sampling period) could fall in step with the 1 ms
                    // period and have the samples see one phase of the loop
                    // more than the other.
                    let mut rng =
                        0x2545_f491_4f6c_dd1du64 ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    while thread_cpu_seconds() - c0 < cpu_each
                        && Instant::now() < deadline
                        && !stop.load(std::sync::atomic::Ordering::Relaxed)
                    {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let n = 10_000 + rng % 20_000;
                        acc ^= work_three(n);
                        acc ^= work_one(n);
                    }
                    black_box(acc);
                    (tid, thread_cpu_seconds() - c0)
                })
                .unwrap()
        })
        .collect();
    if let Until::Samples(enough) = until {
        let mut tail = spulse::Tail::open(path).expect("tail the spool being recorded");
        let mut seen = 0;
        while seen < enough && Instant::now() < deadline {
            seen += tail.poll().expect("poll the spool being recorded").len();
            std::thread::sleep(Duration::from_millis(20));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let mut tids = Vec::new();
    let mut cpu = 0.0;
    for h in hs {
        let (t, c) = h.join().unwrap();
        tids.push(t);
        cpu += c;
    }
    (tids, cpu)
}

fn check(
    engine: spulse::EngineChoice,
    expect: spulse::Engine,
    until: Until,
    min_capture: f64,
    ratio_tol: f64,
) {
    let _serial = serial();
    let (_dir, path) = spool_path("acc.spool");
    let guard = spulse::Recorder::builder().frequency_hz(999).engine(engine).start(&path).expect("start");
    assert_eq!(guard.engine(), expect);
    let wall = match until {
        Until::Cpu(cpu_each) => Duration::from_secs(8 + 4 * cpu_each as u64),
        Until::Samples(_) => Duration::from_secs(60),
    };
    let (tids, cpu) = workload(until, wall, &path);
    let stats = guard.finish().expect("finish");
    let snap = spulse::Snapshot::open(&path).expect("spool opens");
    assert_eq!(stats.engine, expect);
    assert_eq!(stats.samples_written, snap.len() as u64);

    let counts = leaf_counts(&snap);
    let kernel = kernel_leaves(&snap);
    let kernel_total: u64 = tids.iter().map(|t| kernel.get(t).copied().unwrap_or(0)).sum();
    let mut three = 0u64;
    let mut one = 0u64;
    let mut total = 0u64;
    for ((tid, name), n) in &counts {
        if !tids.contains(tid) {
            continue;
        }
        total += n;
        if name.ends_with("work_three") {
            three += n;
        } else if name.ends_with("work_one") {
            one += n;
        }
    }
    // User-mode samples only.
    let total = total - kernel_total;
    let expected = cpu * 999.0;
    // Under an emulator a timer signal can reach the guest thread late and
    // then carry more overrun intervals than one sample may weigh (64): the
    // handler counts the excess as lost (`overrun_capped`) instead of writing
    // it. qemu-user beside two CPU hogs: 895 such intervals of 5,994 (written
    // capture 0.828). There the capture counts them; natively a written
    // sample must stand for every interval.
    let capped = if emulated() { stats.samples_lost.overrun_capped } else { 0 };
    let capture = (total + capped) as f64 / expected;
    let in_fns = (three + one) as f64 / total.max(1) as f64;
    let ratio = three as f64 / (three + one).max(1) as f64;
    eprintln!(
        "{expect}: cpu {cpu:.3}s, user-mode samples {total} (expected {expected:.0}, capture {capture:.3}, \
         counting {capped} intervals over the per-signal cap), \
         kernel-mode samples {kernel_total}, \
         in functions {in_fns:.3}, work_three share {ratio:.3}, stats {stats:?}"
    );
    assert!(total > 200, "too few samples: {total}");
    assert!(in_fns >= 0.95, "only {in_fns:.3} of samples in the workload functions: {counts:?}");
    assert!((ratio - 0.75).abs() <= ratio_tol, "work_three share {ratio:.3}, expected 0.75 +- {ratio_tol}");
    assert!(capture >= min_capture, "capture ratio {capture:.3} below {min_capture}");
    assert!(capture <= 1.10, "more samples than CPU time allows: {capture:.3}");
}

#[test]
fn perf_event_engine_three_to_one_at_999hz() {
    match perf_engine_for("perf_event_engine_three_to_one_at_999hz") {
        (choice, spulse::Engine::PerfEvent) => {
            check(choice, spulse::Engine::PerfEvent, Until::Cpu(1.5), 0.90, 0.03)
        }
        // The timer fallback under an emulator: its parameters are those of the
        // thread-CPU-timer test below.
        (choice, engine) => check(choice, engine, Until::Cpu(3.0), 0.90, 0.05),
    }
}

/// The perf-stack engine (opt-in): no signal; the kernel copies each sample's
/// registers and stack and the writer thread unwinds them. Same workload, same
/// tolerances as the perf-event engine. Its threads are created after start,
/// so each is sampled from the writer's next tick on (the first up to 50 ms
/// of their CPU time are missing); its capture against user CPU time is
/// checked in `recorder_perf_stack.rs`.
#[test]
fn perf_stack_engine_three_to_one_at_999hz() {
    match perf_stack_engine_for("perf_stack_engine_three_to_one_at_999hz") {
        (choice, spulse::Engine::PerfStack) => {
            check(choice, spulse::Engine::PerfStack, Until::Cpu(1.5), 0.90, 0.03)
        }
        (choice, engine) => check(choice, engine, Until::Cpu(3.0), 0.90, 0.05),
    }
}

/// The first fallback, forced: per-thread CPU timers deliver at most one signal
/// per scheduler tick, so the count only reaches the CPU time x frequency because
/// each signal is recorded as 1 + overrun samples. Weighted samples are fewer
/// independent observations (about 250 a CPU-second), hence twice the CPU time
/// and the wider ratio tolerance (a 1.5 s run failed once at 0.806 on a loaded
/// machine). The signals come at scheduler ticks, so the share also wanders
/// with how the loop's calls fall against the 4 ms ticks: CI's run of
/// 776f9b7's successor read 0.697, five quiet runs 0.697-0.777 (2026-12-04),
/// wider than the ~0.011 standard deviation of ~1,500 independent signals;
/// hence 0.08.
#[test]
fn thread_cpu_timer_engine_weights_overruns() {
    check(spulse::EngineChoice::ThreadCpuTimer, spulse::Engine::ThreadCpuTimer, Until::Cpu(3.0), 0.90, 0.08);
}

/// The last resort, forced: `setitimer(ITIMER_PROF)` has no overrun count, so at
/// 999 Hz on a 250 Hz-tick kernel it captures a fraction of the intervals (one
/// pending signal per process at most): an eighth to a quarter on a quiet
/// machine, 0.05 with two CPU hogs beside the test, so a fixed CPU time gave
/// as few as 148 samples. It runs until the spool holds 600 samples instead
/// (the 3:1 share's tolerance, 0.08, is then 4.5 standard deviations); it must
/// run for real, attribute correctly and say which engine ran. Its capture is
/// only checked to be more than one sample in 50 intervals.
#[test]
fn process_timer_engine_runs_and_is_recorded() {
    check(spulse::EngineChoice::ProcessTimer, spulse::Engine::ProcessTimer, Until::Samples(600), 0.02, 0.08);
}
