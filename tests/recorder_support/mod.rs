//! Shared helpers of the recorder tests: a temp spool path, per-thread CPU time,
//! and naming the leaf function of each sample.
#![allow(dead_code)]

#[path = "../../examples/support/mod.rs"]
mod symbols;

use std::collections::HashMap;
use std::path::PathBuf;

#[allow(unused_imports)]
pub use symbols::{build_plugin, Plugin, Symbolizer};

/// A fresh path for a spool inside a new temp dir (kept alive by the returned dir).
pub fn spool_path(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join(name);
    (dir, p)
}

/// CPU time of the calling thread, in seconds.
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the struct we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// The calling thread's kernel id.
pub fn gettid() -> u32 {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
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

/// Samples per tid.
pub fn per_thread(snap: &spulse::Snapshot) -> HashMap<u32, u64> {
    let mut out = HashMap::new();
    for s in snap.samples() {
        *out.entry(snap.thread(s.thread).tid).or_default() += 1;
    }
    out
}

/// One recorder per process: tests of one file that record take this lock.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
