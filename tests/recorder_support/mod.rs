//! Shared helpers of the recorder tests: a temp spool path, per-thread CPU time,
//! a busy loop, and naming the leaf function of each sample.
#![allow(dead_code)]

use spulse_testkit::symbols;

pub use spulse_testkit::emulator::{emulated, self_command};

use std::collections::HashMap;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

#[allow(unused_imports)]
pub use symbols::{build_plugin, burn_cpu, gettid, thread_cpu_seconds, Plugin, Symbolizer};

/// A fresh path for a spool inside a new temp dir (kept alive by the returned dir).
pub fn spool_path(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join(name);
    (dir, p)
}

/// Burn `cpu` seconds of the calling thread's CPU time (reading the clock every
/// 10 000 rounds, giving up after 10 s of wall time).
pub fn burn(cpu: f64) {
    black_box(burn_cpu(cpu, 10_000, Duration::from_secs(10)));
}

/// Block the profiling signals (SIGPROF and SIGTRAP) in the calling thread.
pub fn block_profiling_signals() {
    // SAFETY: a valid signal set, applied to this thread only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPROF);
        libc::sigaddset(&mut set, libc::SIGTRAP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Samples per (tid, leaf function name).
pub fn leaf_counts(snap: &spulse::Snapshot) -> HashMap<(u32, String), u64> {
    let mut sym = Symbolizer::default();
    let mut names: HashMap<spulse::FrameId, String> = HashMap::new();
    let mut out = HashMap::new();
    for s in snap.samples() {
        let leaf = snap.stack(s.stack).frame;
        let name = names.entry(leaf).or_insert_with(|| sym.name(snap, leaf)).clone();
        *out.entry((snap.thread(s.thread).tid, name)).or_default() += 1;
    }
    out
}

/// Samples per tid whose leaf is a kernel-mode frame (system time).
pub fn kernel_leaves(snap: &spulse::Snapshot) -> HashMap<u32, u64> {
    let mut out = HashMap::new();
    for s in snap.samples() {
        if let spulse::Frame::Absolute { kernel: true, .. } = snap.frame(snap.stack(s.stack).frame) {
            *out.entry(snap.thread(s.thread).tid).or_default() += 1;
        }
    }
    out
}

/// Samples per tid.
pub fn per_thread(snap: &spulse::Snapshot) -> HashMap<u32, u64> {
    let mut out = HashMap::new();
    for s in snap.samples() {
        *out.entry(snap.thread(s.thread).tid).or_default() += 1;
    }
    out
}

/// Re-run this test binary for the single test `role` alone (with output
/// shown), with the environment variable `var` set to `path`; its output.
pub fn run_role(role: &str, var: &str, path: &std::path::Path) -> std::process::Output {
    self_command()
        .args(["--exact", role, "--nocapture", "--test-threads", "1"])
        .env(var, path)
        .output()
        .unwrap()
}

/// One recorder per process: tests of one file that record take this lock.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether the kernel this test runs on implements `perf_event_open` at all
/// (qemu-user does not: ENOSYS). A null attribute makes a real kernel answer
/// EFAULT without opening anything.
pub fn perf_event_open_implemented() -> bool {
    // SAFETY: with a null attribute pointer the call only fails; nothing is opened.
    let r = unsafe { libc::syscall(libc::SYS_perf_event_open, std::ptr::null::<u8>(), 0, -1, -1, 0) };
    !(r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS))
}

/// The engine for a test written for perf events: `PerfEvent`, except under an
/// emulator without `perf_event_open` (qemu-user), where the test says so and
/// runs with the thread-CPU-timer engine instead. Natively a refused
/// `perf_event_open` still makes the test fail.
pub fn perf_engine_for(test: &str) -> (spulse::EngineChoice, spulse::Engine) {
    if emulated() && !perf_event_open_implemented() {
        eprintln!(
            "PERF EVENTS UNAVAILABLE: {test} needs perf events, which this emulator does not implement; \
             running it with the thread-CPU-timer engine instead"
        );
        (spulse::EngineChoice::ThreadCpuTimer, spulse::Engine::ThreadCpuTimer)
    } else {
        (spulse::EngineChoice::PerfEvent, spulse::Engine::PerfEvent)
    }
}

/// The engine for a test written for the perf-stack engine: `PerfStack`,
/// except under an emulator without `perf_event_open` (qemu-user), where the
/// test says so and runs with the thread-CPU-timer engine instead. Natively a
/// refused `perf_event_open` still makes the test fail.
pub fn perf_stack_engine_for(test: &str) -> (spulse::EngineChoice, spulse::Engine) {
    match perf_engine_for(test) {
        (_, spulse::Engine::PerfEvent) => (spulse::EngineChoice::PerfStack, spulse::Engine::PerfStack),
        fallback => fallback,
    }
}

/// Sets the number of FDEs above which a recorder checks the executable's
/// unwind tables after `start` returns (until then, stacks stop at the
/// executable's frames), and restores the previous value when dropped. Tests
/// that need every sample unwound from the first one use `u64::MAX`.
pub struct DeferThreshold(u64);

impl DeferThreshold {
    pub fn set(fdes: u64) -> DeferThreshold {
        DeferThreshold(spulse::testing::unwind_tables::set_defer_threshold(fdes))
    }
}

impl Drop for DeferThreshold {
    fn drop(&mut self) {
        spulse::testing::unwind_tables::set_defer_threshold(self.0);
    }
}
