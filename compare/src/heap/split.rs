//! Where the cost of `Sampled<System>` goes, one thread, per malloc/free
//! pair: 4 M pairs of 16-256 bytes (a window of 1,024 live, as the
//! `threads` workload) on System, with only the allocation through
//! `Sampled` (the thread-local count), with only the free through it (the
//! filter), with both, and with a thread-local count of this crate's own in
//! place of the sampler's. Modes rotate between rounds; thread CPU time,
//! nanoseconds per pair, medians.
//!
//!     cargo build --release --bin heap_split && target/release/heap_split 31
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;
use std::sync::atomic::{AtomicU8, Ordering};

use spulse::heap::Sampled;

/// Bit 0: allocate through `Sampled`; bit 1: free through it; bit 2: count
/// in `LEFT` instead.
static MODE: AtomicU8 = AtomicU8::new(0);
static INNER: Sampled<System> = Sampled::new(System);

thread_local! {
    static LEFT: Cell<i64> = const { Cell::new(1 << 40) };
}

#[inline(never)]
#[cold]
fn refill(c: &Cell<i64>) {
    c.set(1 << 19);
    black_box(c);
}

struct Switch;

// SAFETY: every call goes to System, directly or through Sampled (which
// passes it on unchanged): a block allocated one way may be freed the other.
unsafe impl GlobalAlloc for Switch {
    #[inline]
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let m = MODE.load(Ordering::Relaxed);
        if m & 1 != 0 {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { INNER.alloc(l) }
        } else if m & 4 != 0 {
            // SAFETY: our caller's contract, passed on unchanged.
            let p = unsafe { System.alloc(l) };
            LEFT.with(|c| {
                let v = c.get().wrapping_sub(l.size() as i64);
                c.set(v);
                if v < 0 {
                    refill(c)
                }
            });
            p
        } else {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { System.alloc(l) }
        }
    }
    #[inline]
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if MODE.load(Ordering::Relaxed) & 2 != 0 {
            // SAFETY: our caller's contract, passed on unchanged (a block not
            // sampled, or sampled and entered, is looked up and freed).
            unsafe { INNER.dealloc(p, l) }
        } else {
            // SAFETY: our caller's contract, passed on unchanged. A sampled
            // block freed here stays in the table (harmless to System).
            unsafe { System.dealloc(p, l) }
        }
    }
}

#[global_allocator]
static ALLOC: Switch = Switch;

fn cpu() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn work(n: usize, seed: u64) {
    let mut x = seed;
    let mut window: Vec<Vec<u8>> = (0..1024).map(|_| Vec::new()).collect();
    for i in 0..n {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let size = 16 + (x.wrapping_mul(0x2545_f491_4f6c_dd1d) % 241) as usize;
        window[i % 1024] = Vec::with_capacity(size);
        black_box(&window[i % 1024]);
    }
}

fn main() {
    let rounds: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(15);
    let n = 4_000_000;
    let modes = [0u8, 1, 2, 3, 4];
    let names =
        ["System", "count only (alloc)", "filter only (free)", "Sampled (both)", "own thread-local count"];
    let mut t = vec![vec![]; modes.len()];
    work(n, 1);
    for r in 0..rounds {
        for k in 0..modes.len() {
            let m = (k + r) % modes.len();
            MODE.store(modes[m], Ordering::SeqCst);
            let t0 = cpu();
            work(n, 7 + r as u64);
            t[m].push((cpu() - t0) / n as f64 * 1e9);
            MODE.store(0, Ordering::SeqCst);
        }
    }
    for v in t.iter_mut() {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    println!("| side | ns per pair, median (min) | over System, median (min) |");
    println!("| --- | --- | --- |");
    for m in 0..modes.len() {
        println!(
            "| {} | {:.2} ({:.2}) | {:+.2} ({:+.2}) |",
            names[m],
            t[m][rounds / 2],
            t[m][0],
            t[m][rounds / 2] - t[0][rounds / 2],
            t[m][0] - t[0][0]
        );
    }
}
