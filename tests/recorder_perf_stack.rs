//! The perf-stack engine (`EngineChoice::PerfStack`), run for real: the kernel
//! copies each sample's user registers and stack into per-thread rings and the
//! writer thread unwinds them. If perf events are refused these tests fail;
//! they never skip. (Attribution of the 3:1 workload is in
//! `recorder_accuracy.rs`, stacks reaching the thread root in
//! `recorder_unwind.rs`.)

mod recorder_support;

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use recorder_support::*;
use spulse::{EngineChoice, Error, RecorderError};

/// Run `threads` busy threads, each burning `cpu_each` seconds of CPU once the
/// recorder (built by `builder`) has started; the threads exist before the
/// start, so each has its event from its first instruction of work. Each
/// thread first runs `prepare`. Returns the stats, the spool's samples per
/// tid and each thread's [`Burn`].
///
/// The engine samples user time only (a period that ends in kernel mode is
/// dropped), so the burn reads its CPU clock (a system call) only about once
/// a millisecond: its CPU time is then user time but for the kernel's own
/// work for each sample (the timer interrupt and the stack copy, during which
/// no period can end). That total, from the thread's CPU clock, is exact;
/// the kernel's user/system split (`RUSAGE_THREAD`, printed) is apportioned by
/// scheduler ticks, 250 a second here, too coarse to test 2% against.
///
/// The upper bounds use [`Burn::on_cpu`], not the CPU clock. The task-clock
/// timer runs in wall time while the thread is on its CPU; the CPU clock
/// leaves out the time the host took the vCPU away (steal time). On a loaded
/// VM that gap is several per cent: 2,068 samples for 2.000 s of CPU clock
/// (1.035) in one CI run, with nothing counted twice.
/// What [`record_busy`] returns: the recorder's statistics, the samples per
/// thread id, each busy thread's [`Burn`], and an upper bound on the time the
/// kernel's sampling timer ran for the whole process while recording (its CPU
/// time, with each busy thread's CPU time replaced by its on-CPU time).
type Recorded = (spulse::Stats, HashMap<u32, u64>, Vec<Burn>, f64);

/// One busy thread's burn.
#[derive(Clone, Copy, Debug)]
struct Burn {
    tid: u32,
    /// CPU seconds of the burn (the thread's CPU clock).
    cpu: f64,
    /// Wall seconds of the burn less the time the thread waited on a run
    /// queue (`/proc/thread-self/schedstat`): the time it held a vCPU, steal
    /// time included.
    on_cpu: f64,
}

/// The calling thread's run-queue wait so far, in seconds: the second field
/// of `/proc/thread-self/schedstat`.
fn run_delay_seconds() -> f64 {
    let text =
        std::fs::read_to_string("/proc/thread-self/schedstat").expect("read /proc/thread-self/schedstat");
    let field =
        text.split_whitespace().nth(1).unwrap_or_else(|| panic!("schedstat without run delay: {text:?}"));
    field.parse::<u64>().unwrap_or_else(|e| panic!("schedstat run delay {field:?}: {e}")) as f64 * 1e-9
}

fn record_busy(builder: spulse::RecorderBuilder, threads: usize, cpu_each: f64, prepare: fn()) -> Recorded {
    let _serial = serial();
    let (_dir, path) = spool_path("stack.spool");
    let ready = Arc::new(Barrier::new(threads + 1));
    let go = Arc::new(Barrier::new(threads + 1));
    let hs: Vec<_> = (0..threads)
        .map(|i| {
            let (ready, go) = (ready.clone(), go.clone());
            std::thread::Builder::new()
                .name(format!("busy-{i}"))
                .spawn(move || {
                    prepare();
                    ready.wait();
                    go.wait();
                    let (u0, s0) = thread_user_system();
                    let (w0, d0) = (Instant::now(), run_delay_seconds());
                    let c0 = thread_cpu_seconds();
                    std::hint::black_box(burn_cpu(cpu_each, 1_000_000, Duration::from_secs(20)));
                    let cpu = thread_cpu_seconds() - c0;
                    let on_cpu = w0.elapsed().as_secs_f64() - (run_delay_seconds() - d0);
                    let (u1, s1) = thread_user_system();
                    eprintln!(
                        "burn: cpu {cpu:.3} s, on cpu {on_cpu:.3} s, user {:.3} s, system {:.3} s",
                        u1 - u0,
                        s1 - s0
                    );
                    Burn { tid: gettid(), cpu, on_cpu }
                })
                .unwrap()
        })
        .collect();
    ready.wait();
    let before = unix_us();
    let process_cpu0 = process_cpu_seconds();
    let guard =
        builder.frequency_hz(999).engine(EngineChoice::PerfStack).start(&path).expect("perf-stack start");
    assert_eq!(guard.engine(), spulse::Engine::PerfStack);
    go.wait();
    let per: Vec<Burn> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let stats = guard.finish().expect("finish");
    let process_cpu = process_cpu_seconds() - process_cpu0;
    let after = unix_us();
    assert_eq!(stats.engine, spulse::Engine::PerfStack);
    let snap = spulse::Snapshot::open(&path).expect("spool opens");
    assert_eq!(stats.samples_written, snap.len() as u64);
    // The kernel stamps samples with CLOCK_REALTIME, the clock of the spool's
    // times and of the writer's module checks.
    for smp in snap.samples() {
        assert!(
            before <= smp.time_us && smp.time_us <= after,
            "sample at {} outside [{before}, {after}]",
            smp.time_us
        );
    }
    let sampled = process_cpu + per.iter().map(|b| (b.on_cpu - b.cpu).max(0.0)).sum::<f64>();
    (stats, per_thread(&snap), per, sampled)
}

/// CPU seconds of the whole process so far (every thread, the test harness's
/// other test threads included: the perf-stack engine samples them all).
fn process_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn unix_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64
}

/// The calling thread's user and system CPU seconds (`RUSAGE_THREAD`).
fn thread_user_system() -> (f64, f64) {
    // SAFETY: getrusage fills the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD is the calling thread.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (s(ru.ru_utime), s(ru.ru_stime))
}

fn capture(threads: usize) {
    let (stats, counts, per, _) = record_busy(spulse::Recorder::builder(), threads, 2.0, || {});
    let cpu: f64 = per.iter().map(|b| b.cpu).sum();
    let on_cpu: f64 = per.iter().map(|b| b.on_cpu.max(b.cpu)).sum();
    let samples: u64 = per.iter().map(|b| counts.get(&b.tid).copied().unwrap_or(0)).sum();
    let ratio = samples as f64 / (cpu * 999.0);
    let timer_ratio = samples as f64 / (on_cpu * 999.0);
    eprintln!(
        "{threads} thread(s): cpu {cpu:.3}s, on cpu {on_cpu:.3}s, samples {samples}, capture {ratio:.4} \
         (of on-CPU time {timer_ratio:.4}), stats {stats:?}"
    );
    assert!(ratio >= 0.98, "capture ratio {ratio:.4} below 0.98 ({samples} samples, {cpu:.3} s CPU)");
    assert!(
        timer_ratio <= 1.02,
        "more samples than on-CPU time allows: {samples} for {on_cpu:.3} s ({timer_ratio:.4}; CPU clock {cpu:.3} s)"
    );
    // A ring the writer could not drain in time (it had no CPU on a busy
    // machine) loses samples, counted: a few at most.
    assert!(stats.lost() * 100 <= samples, "{stats:?}");
    for b in &per {
        let n = counts.get(&b.tid).copied().unwrap_or(0) as f64;
        assert!(n >= 0.95 * b.cpu * 999.0, "thread {}: {n} samples for {:.3} s CPU", b.tid, b.cpu);
    }
}

#[test]
fn captures_user_cpu_times_frequency_with_one_thread() {
    capture(1);
}

#[test]
fn captures_user_cpu_times_frequency_with_two_threads() {
    capture(2);
}

fn block_every_signal() {
    // SAFETY: a full signal set, applied to the calling thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// No signal is involved: a thread that blocks every signal (which the signal
/// engines cannot sample, see `recorder_edges.rs`) is sampled like any other.
#[test]
fn a_thread_blocking_every_signal_is_sampled() {
    let (stats, counts, per, _) = record_busy(spulse::Recorder::builder(), 1, 0.5, block_every_signal);
    let Burn { tid, cpu, .. } = per[0];
    let n = counts.get(&tid).copied().unwrap_or(0);
    eprintln!("blocked thread: {n} samples for {cpu:.3} s CPU; {stats:?}");
    assert!(n as f64 >= 0.95 * cpu * 999.0, "{n} samples for {cpu:.3} s CPU");
    assert_eq!(stats.threads_blocking_signal, 0, "no signal to block: {stats:?}");
}

// The bounds below: a sample is due every 1/999 s of a thread's CPU time,
// but when the kernel's task-clock timer interrupt comes more than a period
// late (a vCPU the host did not run), the timer is moved past the missed
// periods without a sample for them (`hrtimer_forward_now`, overruns
// dropped): on a loaded VM a few per cent fewer samples than CPU x 999 (0.978
// seen in CI). The kernel samples every thread of the process, the test
// harness's other threads too, so the upper bound is the whole process's
// time under the sampling timer while recording (see `Recorded`).

/// A ring of one page cannot hold a sample with an 8 KiB stack copy: every
/// sample is lost, and the kernel's count of them reaches `Stats`.
#[test]
fn samples_that_do_not_fit_the_ring_are_counted_lost() {
    let b = spulse::Recorder::builder().perf_stack_ring_pages(1).user_stack_copy(8 << 10);
    let (stats, counts, per, sampled) = record_busy(b, 1, 0.5, || {});
    let Burn { tid, cpu, .. } = per[0];
    let (expected, most) = (cpu * 999.0, sampled * 999.0);
    eprintln!("tiny ring: expected {expected:.0} (process at most {most:.0}), {stats:?}");
    assert_eq!(counts.get(&tid).copied().unwrap_or(0), 0);
    assert_eq!(stats.samples_written, 0, "{stats:?}");
    let lost = stats.samples_lost.ring_full as f64;
    assert!(lost >= 0.94 * expected && lost <= 1.02 * most + 2.0, "lost {lost} of {expected:.0}: {stats:?}");
}

/// A ring that holds one sample at a time: whatever the writer does not drain
/// in time is lost, and every sample is either written or counted lost.
#[test]
fn every_sample_is_written_or_counted_lost_with_a_small_ring() {
    let b = spulse::Recorder::builder().perf_stack_ring_pages(2).user_stack_copy(6 << 10);
    let (stats, counts, per, sampled) = record_busy(b, 2, 0.5, || {});
    let cpu: f64 = per.iter().map(|b| b.cpu).sum();
    let written: u64 = per.iter().map(|b| counts.get(&b.tid).copied().unwrap_or(0)).sum();
    let (expected, most) = (cpu * 999.0, sampled * 999.0);
    let total = (stats.samples_written + stats.samples_lost.ring_full) as f64;
    eprintln!("small ring: expected {expected:.0} (process at most {most:.0}), written {written}, {stats:?}");
    assert!(written > 0, "{stats:?}");
    // 0.90: CI's loaded debug run read 0.931 (748 written, 185 lost of 1,002):
    // with two threads and the writer starved at a one-sample ring, more
    // timer periods pass late and are dropped as overruns (see above).
    assert!(
        total >= 0.90 * expected && total <= 1.02 * most + 2.0,
        "written + lost {total} of {expected:.0} (process at most {most:.0})"
    );
}

#[test]
fn stack_copy_and_ring_size_are_checked() {
    // One recorder per process: a recording test running now would make
    // `start` answer AlreadyRunning before it checks the settings.
    let _serial = serial();
    let (_dir, path) = spool_path("bad.spool");
    let setting = |b: spulse::RecorderBuilder| match b.engine(EngineChoice::PerfStack).start(&path) {
        Err(Error::Recorder(RecorderError::InvalidConfig { setting, message })) => {
            assert!(message.contains(setting), "{message}");
            setting
        }
        other => panic!("accepted: {other:?}"),
    };
    let b = spulse::Recorder::builder;
    for bytes in [0, 12, 64 << 10, 1 << 20] {
        assert_eq!(setting(b().user_stack_copy(bytes)), "user_stack_copy", "{bytes}");
    }
    for pages in [0, 3, 2048] {
        assert_eq!(setting(b().perf_stack_ring_pages(pages)), "perf_stack_ring_pages", "{pages}");
    }
    assert!(!path.exists(), "nothing is created for a bad setting");
}
