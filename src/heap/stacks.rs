//! The table of sampled stacks and what each allocated and freed: fixed
//! capacity, static, lock-free. A stack is written once into a free slot
//! (claimed with a compare-and-swap) and published with a release store;
//! after that only its counters change (atomic adds).
//!
//! Counters are estimates already scaled for the sampling (each sample
//! point stands for `rate` bytes, see [`super::sampler`]): allocations in
//! fixed point ([`FIXED`] per allocation), bytes: allocations and bytes allocated, and the part
//! of both freed since. In use = allocated - freed.
//!
//! Memory: [`CAPACITY`] stacks of at most [`MAX_DEPTH`] addresses,
//! 560 bytes each (2.2 MiB), static. When the table is full a sample is
//! counted under slot 0, the stack-less "[stack table full]" entry; two
//! threads writing the same new stack at once may make two entries (the
//! profile merges them).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Distinct stacks kept.
pub const CAPACITY: usize = 4096;
/// Addresses kept per stack (the deepest frames are cut).
pub const MAX_DEPTH: usize = 64;
/// Fixed-point unit of the counters.
pub const FIXED: u64 = 1 << 12;

const EMPTY: u32 = 0;
const WRITING: u32 = 1;
const READY: u32 = 2;

struct Entry {
    state: AtomicU32,
    depth: AtomicU32,
    hash: AtomicU64,
    /// Leaf first: the first is the pc where the unwind started, the rest
    /// return addresses. Written once, before `state` becomes `READY`.
    addrs: UnsafeCell<[u64; MAX_DEPTH]>,
    alloc_objects: AtomicU64,
    alloc_bytes: AtomicU64,
    free_objects: AtomicU64,
    free_bytes: AtomicU64,
}

// SAFETY: `addrs` is written only by the thread that moved `state` from EMPTY
// to WRITING, and read only after an acquire load saw READY (published by a
// release store after the write); every other field is atomic.
unsafe impl Sync for Entry {}

#[allow(clippy::declare_interior_mutable_const)]
const ENTRY: Entry = Entry {
    state: AtomicU32::new(EMPTY),
    depth: AtomicU32::new(0),
    hash: AtomicU64::new(0),
    addrs: UnsafeCell::new([0; MAX_DEPTH]),
    alloc_objects: AtomicU64::new(0),
    alloc_bytes: AtomicU64::new(0),
    free_objects: AtomicU64::new(0),
    free_bytes: AtomicU64::new(0),
};

static TABLE: [Entry; CAPACITY] = [ENTRY; CAPACITY];

fn hash(addrs: &[u64]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ addrs.len() as u64;
    for &a in addrs {
        h = (h.rotate_left(5) ^ a).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    h | 1
}

/// The slot of `addrs` (leaf first, at most [`MAX_DEPTH`]), added if new; 0
/// when the table is full (or `addrs` is empty).
pub(crate) fn intern(addrs: &[u64]) -> u32 {
    let addrs = &addrs[..addrs.len().min(MAX_DEPTH)];
    if addrs.is_empty() {
        return 0;
    }
    let h = hash(addrs);
    let n = CAPACITY - 1;
    let start = (h % n as u64) as usize;
    // Every stack lies within MAX_PROBE slots of its start (inserts stop
    // there too), so a lookup never scans the whole table: a full one made
    // each new stack's sample walk all 4,095 slots (about 10 us).
    for i in 0..MAX_PROBE.min(n) {
        let idx = 1 + (start + i) % n;
        let e = &TABLE[idx];
        let mut state = e.state.load(Ordering::Acquire);
        if state == EMPTY {
            match e.state.compare_exchange(EMPTY, WRITING, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => {
                    // SAFETY: we moved the slot from EMPTY to WRITING: no one
                    // else writes it, and readers wait for READY.
                    let dst = unsafe { &mut *e.addrs.get() };
                    dst[..addrs.len()].copy_from_slice(addrs);
                    e.depth.store(addrs.len() as u32, Ordering::Relaxed);
                    e.hash.store(h, Ordering::Relaxed);
                    e.state.store(READY, Ordering::Release);
                    return idx as u32;
                }
                Err(s) => state = s,
            }
        }
        if state == READY && e.hash.load(Ordering::Relaxed) == h {
            let d = e.depth.load(Ordering::Relaxed) as usize;
            // SAFETY: READY was seen with acquire: the addresses are written
            // and never change again.
            let have = unsafe { &(&*e.addrs.get())[..d] };
            if have == addrs {
                return idx as u32;
            }
        }
    }
    FULL.fetch_add(1, Ordering::Relaxed);
    0
}

/// Slots a stack may lie from its hash's (see [`intern`]).
const MAX_PROBE: usize = 256;

/// Samples whose stack found no slot (the table full, or its stretch of
/// it): counted under slot 0, shown as "[no stack]".
pub(crate) static FULL: AtomicU64 = AtomicU64::new(0);

/// Count an allocation of `bytes` standing for `objects` (fixed point) at `stack`.
pub(crate) fn add_alloc(stack: u32, objects: u64, bytes: u64) {
    let e = &TABLE[stack as usize % CAPACITY];
    e.alloc_objects.fetch_add(objects, Ordering::Relaxed);
    e.alloc_bytes.fetch_add(bytes, Ordering::Relaxed);
}

/// Count the free of what [`add_alloc`] counted.
pub(crate) fn add_free(stack: u32, objects: u64, bytes: u64) {
    let e = &TABLE[stack as usize % CAPACITY];
    e.free_objects.fetch_add(objects, Ordering::Relaxed);
    e.free_bytes.fetch_add(bytes, Ordering::Relaxed);
}

/// The addresses of stack `slot` (leaf first) into `out`; false (and `out`
/// empty) for slot 0 or a slot not written.
pub(crate) fn addrs(slot: u32, out: &mut Vec<u64>) -> bool {
    out.clear();
    let Some(e) = TABLE.get(slot as usize).filter(|_| slot != 0) else { return false };
    if e.state.load(Ordering::Acquire) != READY {
        return false;
    }
    let d = (e.depth.load(Ordering::Relaxed) as usize).min(MAX_DEPTH);
    // SAFETY: READY seen with acquire (see `intern`): written once before.
    out.extend_from_slice(unsafe { &(&*e.addrs.get())[..d] });
    true
}

/// One stack's estimates, in fixed point.
#[cfg(feature = "pprof")]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub alloc_objects: u64,
    pub alloc_bytes: u64,
    pub free_objects: u64,
    pub free_bytes: u64,
}

/// Every stack with its totals (slot 0, the overflow entry, with no
/// addresses). Allocates: call with the re-entrancy guard set or from outside
/// the allocator.
#[cfg(feature = "pprof")]
pub(crate) fn snapshot() -> Vec<(Vec<u64>, Totals)> {
    let mut out = Vec::new();
    for (i, e) in TABLE.iter().enumerate() {
        let addrs = if i == 0 {
            Vec::new()
        } else if e.state.load(Ordering::Acquire) == READY {
            let d = e.depth.load(Ordering::Relaxed) as usize;
            // SAFETY: READY seen with acquire (see `intern`).
            unsafe { (&*e.addrs.get())[..d].to_vec() }
        } else {
            continue;
        };
        let t = Totals {
            alloc_objects: e.alloc_objects.load(Ordering::Relaxed),
            alloc_bytes: e.alloc_bytes.load(Ordering::Relaxed),
            free_objects: e.free_objects.load(Ordering::Relaxed),
            free_bytes: e.free_bytes.load(Ordering::Relaxed),
        };
        if t.alloc_objects != 0 || i != 0 {
            out.push((addrs, t));
        }
    }
    out
}

#[cfg(all(test, feature = "pprof"))]
mod tests {
    use super::*;

    #[test]
    fn a_stack_is_interned_once_and_counts_add_up() {
        let a = [0xdead_0001u64, 0xdead_0002, 0xdead_0003];
        let i = intern(&a);
        assert_ne!(i, 0);
        assert_eq!(intern(&a), i);
        assert_ne!(intern(&a[..2]), i);
        assert_eq!(intern(&[]), 0);
        add_alloc(i, 3 * FIXED, 300);
        add_free(i, FIXED, 100);
        let snap = snapshot();
        let (_, t) = snap.iter().find(|(s, _)| s[..] == a[..]).unwrap();
        assert_eq!(
            (t.alloc_objects, t.alloc_bytes, t.free_objects, t.free_bytes),
            (3 * FIXED, 300, FIXED, 100)
        );
    }
}
