//! The heap-cost workloads in one process, on a base allocator (`System`;
//! jemalloc with `--features jemalloc`, mimalloc with `--features mimalloc`)
//! and on `Sampled<base>` (default rate) in turn, and, with jemalloc started
//! with its profiler built in and off (`_RJEM_MALLOC_CONF=prof:true,
//! prof_active:false,lg_prof_sample:19`), on jemalloc with its own profiler
//! switched on (`prof.active`) at the same mean rate (2^19 bytes = 512 KiB):
//! a global allocator that dispatches on a flag (one load and a predictable
//! branch, paid by every side) switched between rounds, so all sides run
//! under the same machine conditions. Each round frees what it allocated
//! before the switch. Rounds are timed in process CPU time (all threads).
//!
//!     cargo build --release --bin heap_ab && target/release/heap_ab 15 [workload]
//!
//! `HEAP_RATE=bytes` sets `Sampled`'s mean sampling interval
//! (`spulse::heap::set_sample_rate`).
#[path = "workload.rs"]
mod workload;

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU8, Ordering};

use spulse::heap::Sampled;

#[cfg(feature = "jemalloc")]
type Base = tikv_jemallocator::Jemalloc;
#[cfg(feature = "jemalloc")]
const BASE: Base = tikv_jemallocator::Jemalloc;
#[cfg(all(feature = "mimalloc", not(feature = "jemalloc")))]
type Base = mimalloc::MiMalloc;
#[cfg(all(feature = "mimalloc", not(feature = "jemalloc")))]
const BASE: Base = mimalloc::MiMalloc;
#[cfg(not(any(feature = "jemalloc", feature = "mimalloc")))]
type Base = std::alloc::System;
#[cfg(not(any(feature = "jemalloc", feature = "mimalloc")))]
const BASE: Base = std::alloc::System;

fn base_name() -> &'static str {
    std::any::type_name::<Base>().rsplit("::").next().unwrap_or("base")
}

/// The side a round runs on: 0 the base allocator, 1 `Sampled<base>`, 2 the
/// base allocator with jemalloc's profiler on, 3 the base allocator as side
/// 1 of an A/A run. Every side pays the same dispatch (one load, one
/// compare): an A/A run once paid a second flag's load on side 1 only, and
/// read +2.0-2.2% over 101 rounds where two identical sides should read 0.
static SIDE: AtomicU8 = AtomicU8::new(0);
/// `HEAP_AA=1`: side 1 is the base allocator too (an A/A run: the bench's own
/// bias and noise between two identical sides).
static AA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static INNER: Sampled<Base> = Sampled::new(BASE);

struct Switch;

// Every call goes to the base allocator, directly or through Sampled (which
// passes it on unchanged); a block is freed by the side that allocated it
// (the flag changes only between rounds, when no block of the round lives;
// sides 0, 2 and 3 are the same allocator).
// SAFETY: so the base allocator's contract holds for every call, as above.
unsafe impl GlobalAlloc for Switch {
    #[inline]
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if SIDE.load(Ordering::Relaxed) == 1 {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { INNER.alloc(l) }
        } else {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { BASE.alloc(l) }
        }
    }
    #[inline]
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if SIDE.load(Ordering::Relaxed) == 1 {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { INNER.dealloc(p, l) }
        } else {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { BASE.dealloc(p, l) }
        }
    }
    #[inline]
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if SIDE.load(Ordering::Relaxed) == 1 {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { INNER.realloc(p, l, n) }
        } else {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { BASE.realloc(p, l, n) }
        }
    }
}

#[global_allocator]
static ALLOC: Switch = Switch;

/// Whether jemalloc's profiler is built in and enabled (`opt.prof`): then
/// side 2 switches it on and off with `prof.active`.
#[cfg(feature = "jemalloc")]
fn jemalloc_prof(active: Option<bool>) -> bool {
    // SAFETY: the names are NUL-terminated jemalloc controls of these types.
    unsafe {
        if !tikv_jemalloc_ctl::raw::read::<bool>(b"opt.prof\0").unwrap_or(false) {
            return false;
        }
        if let Some(a) = active {
            tikv_jemalloc_ctl::raw::write(b"prof.active\0", a).expect("prof.active");
        }
    }
    true
}
#[cfg(not(feature = "jemalloc"))]
fn jemalloc_prof(_: Option<bool>) -> bool {
    false
}

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
    // A second argument: only the workload of that name.
    let only = std::env::args().nth(2);
    // HEAP_RATE=bytes: another mean sampling interval for `Sampled` (a huge
    // one leaves the fast paths alone; a small one measures the samples).
    if let Some(r) = std::env::var("HEAP_RATE").ok().and_then(|r| r.parse().ok()) {
        spulse::heap::set_sample_rate(Some(r));
    }
    AA.store(std::env::var_os("HEAP_AA").is_some_and(|v| v == "1"), Ordering::Relaxed);
    let base = base_name();
    let mut sides = vec![base.to_string(), format!("Sampled<{base}>")];
    if jemalloc_prof(Some(false)) {
        sides.push(format!("{base} prof (lg_prof_sample 19)"));
    }
    print!("| workload |");
    for s in &sides {
        print!(" {s} CPU median (min) s |");
    }
    for s in &sides[1..] {
        print!(" {s} / {base}, median of per-round ratios |");
    }
    println!(" rounds |");
    println!("{}", "| --- ".repeat(2 * sides.len() + 1) + "|");
    for (name, f) in workload::all() {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let mut times = vec![Vec::new(); sides.len()];
        let mut ratios = vec![Vec::new(); sides.len()];
        f(); // warm up
        for r in 0..rounds {
            let mut t = vec![0.0; sides.len()];
            for i in 0..sides.len() {
                let side = (i + r) % sides.len();
                if side == 2 {
                    jemalloc_prof(Some(true));
                }
                let aa = side == 1 && AA.load(Ordering::Relaxed);
                SIDE.store(if aa { 3 } else { side as u8 }, Ordering::SeqCst);
                let t0 = cpu();
                f();
                t[side] = cpu() - t0;
                SIDE.store(0, Ordering::SeqCst);
                if side == 2 {
                    jemalloc_prof(Some(false));
                }
            }
            for s in 0..sides.len() {
                times[s].push(t[s]);
                ratios[s].push(t[s] / t[0]);
            }
        }
        print!("| {name} |");
        for v in times.iter_mut() {
            let min = v.iter().cloned().fold(f64::MAX, f64::min);
            print!(" {:.3} ({min:.3}) |", median(v));
        }
        for v in ratios[1..].iter_mut() {
            print!(" {:+.1}% |", (median(v) - 1.0) * 100.0);
        }
        println!(" {rounds} |");
    }
    let s = spulse::heap::stats();
    eprintln!("samples {} live {} untracked {}", s.samples, s.live_blocks, s.untracked_blocks);
}
