//! The heap-cost workloads in one process, on `System` and on
//! `Sampled<System>` (default rate) in turn: a global allocator that
//! dispatches on a flag (one load and a predictable branch, paid by both
//! sides) switched between rounds, so both sides run under the same machine
//! conditions. Each round frees what it allocated before the switch. Rounds
//! are timed in process CPU time (all threads).
//!
//!     cargo build --release --bin heap_ab && target/release/heap_ab 15
#[path = "workload.rs"]
mod workload;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, Ordering};

use spulse::heap::Sampled;

static SAMPLED: AtomicBool = AtomicBool::new(false);
static INNER: Sampled<System> = Sampled::new(System);

struct Switch;

// SAFETY: every call goes to System, directly or through Sampled (which
// passes it on unchanged); a block is freed by the side that allocated it
// (the flag changes only between rounds, when no block of the round lives).
unsafe impl GlobalAlloc for Switch {
    #[inline]
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if SAMPLED.load(Ordering::Relaxed) {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { INNER.alloc(l) }
        } else {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { System.alloc(l) }
        }
    }
    #[inline]
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if SAMPLED.load(Ordering::Relaxed) {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { INNER.dealloc(p, l) }
        } else {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { System.dealloc(p, l) }
        }
    }
    #[inline]
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if SAMPLED.load(Ordering::Relaxed) {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { INNER.realloc(p, l, n) }
        } else {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { System.realloc(p, l, n) }
        }
    }
}

#[global_allocator]
static ALLOC: Switch = Switch;

/// The process's CPU time (all threads), seconds: less disturbed than wall
/// time by the other programs of a shared machine.
fn cpu() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(15);
    println!("| workload | System CPU median (min) s | Sampled<System> CPU median (min) s | Sampled / System, median of per-round ratios | rounds |");
    println!("| --- | --- | --- | --- | --- |");
    for (name, f) in workload::all() {
        let (mut sys, mut smp, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
        f(); // warm up
        for r in 0..rounds {
            let mut pair = [0.0; 2];
            for i in 0..2 {
                let sampled = (i + r) % 2 == 1;
                SAMPLED.store(sampled, Ordering::SeqCst);
                let t = cpu();
                f();
                pair[sampled as usize] = cpu() - t;
                SAMPLED.store(false, Ordering::SeqCst);
            }
            sys.push(pair[0]);
            smp.push(pair[1]);
            ratio.push(pair[1] / pair[0]);
        }
        let (smin, pmin) =
            (sys.iter().cloned().fold(f64::MAX, f64::min), smp.iter().cloned().fold(f64::MAX, f64::min));
        println!(
            "| {name} | {:.3} ({smin:.3}) | {:.3} ({pmin:.3}) | {:+.1}% | {rounds} |",
            median(&mut sys),
            median(&mut smp),
            (median(&mut ratio) - 1.0) * 100.0
        );
    }
    let s = spulse::heap::stats();
    eprintln!("samples {} live {} untracked {}", s.samples, s.live_blocks, s.untracked_blocks);
}
