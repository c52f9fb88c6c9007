//! The perf-stack engine (`EngineChoice::PerfStack`), run for real: the kernel
//! copies each sample's user registers and stack into per-thread rings and the
//! writer thread unwinds them. If perf events are refused these tests fail;
//! they never skip. (Attribution of the 3:1 workload is in
//! `recorder_accuracy.rs`, stacks reaching the thread root in
//! `recorder_unwind.rs`.)

mod recorder_support;

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use recorder_support::*;
use spulse::{EngineChoice, Error, RecorderError};

/// Run `threads` busy threads, each burning `cpu_each` seconds of CPU once the
/// recorder (built by `builder`) has started; the threads exist before the
/// start, so each has its event from its first instruction of work. Each
/// thread first runs `prepare`. Returns the stats, the spool's samples per
/// tid and each thread's (tid, CPU seconds of the burn).
///
/// The engine samples user time only (a period that ends in kernel mode is
/// dropped), so the burn reads its CPU clock (a system call) only about once
/// a millisecond: its CPU time is then user time but for the kernel's own
/// work for each sample (the timer interrupt and the stack copy, during which
/// no period can end). That total, from the thread's CPU clock, is exact;
/// the kernel's user/system split (`RUSAGE_THREAD`, printed) is apportioned by
/// scheduler ticks, 250 a second here, too coarse to test 2% against.
fn record_busy(
    builder: spulse::RecorderBuilder,
    threads: usize,
    cpu_each: f64,
    prepare: fn(),
) -> (spulse::Stats, HashMap<u32, u64>, Vec<(u32, f64)>) {
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
                    let c0 = thread_cpu_seconds();
                    std::hint::black_box(burn_cpu(cpu_each, 1_000_000, Duration::from_secs(20)));
                    let cpu = thread_cpu_seconds() - c0;
                    let (u1, s1) = thread_user_system();
                    eprintln!("burn: cpu {cpu:.3} s, user {:.3} s, system {:.3} s", u1 - u0, s1 - s0);
                    (gettid(), cpu)
                })
                .unwrap()
        })
        .collect();
    ready.wait();
    let before = unix_us();
    let guard =
        builder.frequency_hz(999).engine(EngineChoice::PerfStack).start(&path).expect("perf-stack start");
    assert_eq!(guard.engine(), spulse::Engine::PerfStack);
    go.wait();
    let per: Vec<(u32, f64)> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    let stats = guard.finish().expect("finish");
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
    (stats, per_thread(&snap), per)
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
    let (stats, counts, per) = record_busy(spulse::Recorder::builder(), threads, 2.0, || {});
    let cpu: f64 = per.iter().map(|p| p.1).sum();
    let samples: u64 = per.iter().map(|p| counts.get(&p.0).copied().unwrap_or(0)).sum();
    let ratio = samples as f64 / (cpu * 999.0);
    eprintln!("{threads} thread(s): cpu {cpu:.3}s, samples {samples}, capture {ratio:.4}, stats {stats:?}");
    assert!(ratio >= 0.98, "capture ratio {ratio:.4} below 0.98 ({samples} samples, {cpu:.3} s CPU)");
    assert!(ratio <= 1.02, "more samples than CPU time allows: {ratio:.4}");
    // A ring the writer could not drain in time (it had no CPU on a busy
    // machine) loses samples, counted: a few at most.
    assert!(stats.lost() * 100 <= samples, "{stats:?}");
    for (tid, c) in &per {
        let n = counts.get(tid).copied().unwrap_or(0) as f64;
        assert!(n >= 0.95 * c * 999.0, "thread {tid}: {n} samples for {c:.3} s CPU");
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
    let (stats, counts, per) = record_busy(spulse::Recorder::builder(), 1, 0.5, block_every_signal);
    let (tid, cpu) = per[0];
    let n = counts.get(&tid).copied().unwrap_or(0);
    eprintln!("blocked thread: {n} samples for {cpu:.3} s CPU; {stats:?}");
    assert!(n as f64 >= 0.95 * cpu * 999.0, "{n} samples for {cpu:.3} s CPU");
    assert_eq!(stats.threads_blocking_signal, 0, "no signal to block: {stats:?}");
}

/// A ring of one page cannot hold a sample with an 8 KiB stack copy: every
/// sample is lost, and the kernel's count of them reaches `Stats`.
#[test]
fn samples_that_do_not_fit_the_ring_are_counted_lost() {
    let b = spulse::Recorder::builder().perf_stack_ring_pages(1).user_stack_copy(8 << 10);
    let (stats, counts, per) = record_busy(b, 1, 0.5, || {});
    let (tid, cpu) = per[0];
    let expected = cpu * 999.0;
    eprintln!("tiny ring: expected {expected:.0}, {stats:?}");
    assert_eq!(counts.get(&tid).copied().unwrap_or(0), 0);
    let lost = stats.samples_lost.ring_full as f64;
    assert!(lost >= 0.95 * expected && lost <= 1.05 * expected, "lost {lost} of {expected:.0}: {stats:?}");
}

/// A ring that holds one sample at a time: whatever the writer does not drain
/// in time is lost, and every sample is either written or counted lost.
#[test]
fn every_sample_is_written_or_counted_lost_with_a_small_ring() {
    let b = spulse::Recorder::builder().perf_stack_ring_pages(2).user_stack_copy(6 << 10);
    let (stats, counts, per) = record_busy(b, 2, 0.5, || {});
    let cpu: f64 = per.iter().map(|p| p.1).sum();
    let written: u64 = per.iter().map(|p| counts.get(&p.0).copied().unwrap_or(0)).sum();
    let expected = cpu * 999.0;
    let total = (written + stats.samples_lost.ring_full) as f64;
    eprintln!("small ring: expected {expected:.0}, written {written}, {stats:?}");
    assert!(written > 0, "{stats:?}");
    assert!(total >= 0.98 * expected && total <= 1.02 * expected, "written + lost {total} of {expected:.0}");
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
