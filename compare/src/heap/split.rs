//! Where the cost of `Sampled<System>` goes, one thread, per malloc/free
//! pair: 4 M pairs of 16-256 bytes (a window of 1,024 live, as the
//! `threads` workload) on System, with only the allocation through
//! `Sampled` (the thread-local count), with only the free through it (the
//! filter), with both, with a thread-local count of this crate's own in
//! place of the sampler's (after the allocation, or before it with a tail
//! call), and with filters of its own (the sampler's bucket function and
//! cheaper ones) in place of the sampler's. Modes rotate within each round; thread CPU time,
//! nanoseconds per pair, medians, and the median of each round's difference
//! to System in the same round.
//!
//!     cargo build --release --bin heap_split && target/release/heap_split 1001 200000
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use spulse::heap::Sampled;

/// Bit 0: allocate through `Sampled`; bit 1: free through it; bit 2: count
/// in `LEFT` instead (with bit 5: before the allocation); bit 3: check an own filter on free (bits 4-5: which
/// bucket function).
static MODE: AtomicU8 = AtomicU8::new(0);
static INNER: Sampled<System> = Sampled::new(System);

/// Filters of this crate's own (2 KiB of bits, none set, as the sampler's
/// while no sampled block is live): to weigh the free's check variants.
static OWN_BITS: [AtomicU64; 256] = [const { AtomicU64::new(0) }; 256];

/// The sampler's filter check, on a static of this crate (no GOT load).
#[inline(always)]
fn own_filter_hash(p: *mut u8) -> bool {
    let b = ((p as u64 >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 50) as usize;
    OWN_BITS[b / 64].load(Ordering::Relaxed) & (1 << (b % 64)) != 0
}

/// The same, the bucket taken from the address bits directly (no multiply).
#[inline(always)]
fn own_filter_bits(p: *mut u8) -> bool {
    let b = ((p as u64 >> 4) & 16383) as usize;
    OWN_BITS[b / 64].load(Ordering::Relaxed) & (1 << (b % 64)) != 0
}

/// The same, the bucket from the address xor its page number (no multiply).
#[inline(always)]
fn own_filter_xor(p: *mut u8) -> bool {
    let a = p as u64;
    let b = (((a >> 4) ^ (a >> 12)) & 16383) as usize;
    OWN_BITS[b / 64].load(Ordering::Relaxed) & (1 << (b % 64)) != 0
}

/// The same, a multiply by a 32-bit constant, middle bits.
#[inline(always)]
fn own_filter_mul32(p: *mut u8) -> bool {
    let b = (((p as u64 >> 4).wrapping_mul(0x9e37_79b1) >> 20) & 16383) as usize;
    OWN_BITS[b / 64].load(Ordering::Relaxed) & (1 << (b % 64)) != 0
}

#[inline(never)]
#[cold]
fn hit(p: *mut u8) {
    black_box(p);
}

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
    #[inline(always)]
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let m = MODE.load(Ordering::Relaxed);
        if m & 1 != 0 {
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { INNER.alloc(l) }
        } else if m & 36 == 36 {
            // The count first, then a tail call (as `Sampled` does now).
            let past = LEFT.with(|c| {
                let v = c.get().wrapping_sub(l.size() as i64);
                c.set(v);
                v < 0
            });
            if past {
                LEFT.with(refill);
            }
            // SAFETY: our caller's contract, passed on unchanged.
            unsafe { System.alloc(l) }
        } else if m & 4 != 0 {
            // The count after the allocation (as `Sampled` did before).
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
    #[inline(always)]
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        let m = MODE.load(Ordering::Relaxed);
        if m & 8 != 0 {
            let h = match m >> 4 {
                0 => own_filter_hash(p),
                1 => own_filter_bits(p),
                2 => own_filter_xor(p),
                _ => own_filter_mul32(p),
            };
            if h {
                hit(p);
            }
            // SAFETY: our caller's contract, passed on unchanged.
            return unsafe { System.dealloc(p, l) };
        }
        if m & 2 != 0 {
            // SAFETY: our caller's contract, passed on unchanged (a block not
            // sampled, or sampled and entered, is looked up and freed).
            unsafe { INNER.dealloc(p, l) }
        } else if p as usize & (spulse::heap::SAMPLED_ALIGN - 1) == 0 {
            // SAFETY: our caller's contract, passed on unchanged. A block
            // that may be sampled (sampled ones are 4096-aligned, inside a
            // larger block of System's) goes back through `Sampled`.
            unsafe { INNER.dealloc(p, l) }
        } else {
            // SAFETY: our caller's contract, passed on unchanged (not sampled).
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
    // A second argument: pairs per round (default 4 M; fewer and more rounds
    // pair the sides closer in time on a loaded machine).
    let n: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(4_000_000);
    let modes = [0u8, 1, 2, 3, 4, 36, 8, 24, 40, 56];
    let names = [
        "System",
        "count only (alloc)",
        "filter only (free)",
        "Sampled (both)",
        "own thread-local count after the allocation",
        "own thread-local count before it, tail call",
        "own filter, multiplicative hash (as before), no GOT load",
        "own filter, address bits 4-17 alone",
        "own filter, address bits 4-17 ^ page number",
        "own filter, 32-bit multiply",
    ];
    let mut t = vec![vec![]; modes.len()];
    // A store the compiler cannot see through: the own filters stay loads.
    OWN_BITS[black_box(255)].store(black_box(0), Ordering::Relaxed);
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
    // Per round, each side against System in the same round (the sides of a
    // round run back to back, so they share the machine's conditions).
    let d: Vec<Vec<f64>> = t.iter().map(|v| v.iter().zip(&t[0]).map(|(a, b)| a - b).collect()).collect();
    let sorted = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v
    };
    println!(
        "| side | ns per pair, median (min) | over System, median of per-round differences (quartiles) |"
    );
    println!("| --- | --- | --- |");
    for m in 0..modes.len() {
        let (tm, dm) = (sorted(&t[m]), sorted(&d[m]));
        println!(
            "| {} | {:.2} ({:.2}) | {:+.2} ({:+.2} to {:+.2}) |",
            names[m],
            tm[rounds / 2],
            tm[0],
            dm[rounds / 2],
            dm[rounds / 4],
            dm[3 * rounds / 4]
        );
    }
}
