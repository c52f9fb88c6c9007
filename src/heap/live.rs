//! The table of live sampled blocks: fixed capacity, in static memory (no
//! allocation, ever), lock-free (compare-and-swap per slot), so that any
//! thread, a forked child, or a thread in its TLS destructors can use it
//! without waiting for anyone.
//!
//! Every `dealloc` has to find out whether its block was sampled. A filter
//! answers nearly all of them with one load from 2 KiB: [`FILTER_BUCKETS`]
//! buckets indexed by the address (see [`bucket`]), one bit each in [`BITS`] (set
//! while the bucket holds a block of the table), read by every free, and a
//! one-byte count each in a separate array, touched only when a sampled
//! block comes or goes. A clear bit means "not sampled". Only blocks whose
//! bit is set (the sampled ones, and the others that share a bucket with
//! one: about live sampled blocks / 16,384 of the frees) search the table.
//! The bits keep the part every free reads to 2 KiB (32 cache lines), so
//! that it stays in the first-level cache of a program that frees a lot
//! however much of that cache its own data takes (the counts were read
//! directly before, 16 KiB; and before that 128 KiB of four-byte counters,
//! which cost +10-15 % on 8 threads doing nothing but malloc/free). The
//! bucket is the address's bits 4-17 xor its bits 18-31, not a multiplicative
//! hash: blocks near each other in memory (allocated together, freed
//! together) share a bit word, so a run of frees touches few of the 32
//! lines; with the hash each free read a line at random, and the
//! program's own data evicted them. On a benchmark of 8 threads doing
//! nothing but malloc/free the filter costs about 0.4-0.55 ns a free, the
//! hash 0.6-0.8 (BENCHMARKS.md, `heap_split`).
//!
//! A bucket counts at most 254 blocks; one more is not tracked. The last
//! block to leave a bucket clears its bit while holding the count at a
//! marker value, so that no block can be entered (and its bit set) in the
//! meantime: a block entered then waits for the clearing (a few spins),
//! and is not tracked if it takes longer than that (the clearing thread
//! preempted in its three instructions, or a child forked during them).
//!
//! The table is open-addressed with linear probing bounded to [`MAX_PROBE`]
//! slots from the home slot, so a search reads at most that many slots. A slot
//! holds the block's address, the estimated bytes and allocations it stands
//! for (fixed point) and its stack's index. A block that finds no free slot in
//! its window is not tracked: its allocation is still counted, and
//! [`dropped`] counts it (the sampler then counts it freed at once: the
//! in-use figures of its stack leave it out).
//!
//! Memory: [`CAPACITY`] slots of 32 bytes (2 MiB) plus the filter (2 KiB
//! of bits, 16 KiB of counts),
//! static, touched page by page. At the default rate the table holds about
//! one block per 512 KiB of sampled live heap (plus each live block larger
//! than that), so 65,536 slots cover a live heap of some 32 GiB.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

/// Slots in the table.
pub const CAPACITY: usize = 1 << 16;
/// Counters in the filter.
pub const FILTER_BUCKETS: usize = 1 << 14;
/// The farthest a block is placed from its home slot.
pub const MAX_PROBE: usize = 128;

const EMPTY: u64 = 0;
const TOMBSTONE: u64 = 1;
/// A slot being written (or, in a child forked meanwhile, lost).
const BUSY: u64 = 2;

/// A live sampled block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    /// Estimated bytes this sample stands for.
    pub bytes: u64,
    /// Estimated allocations this sample stands for, in 1/[`super::stacks::FIXED`].
    pub objects: u64,
    pub stack: u32,
    /// Where the block came from: a page of the sampler's pool
    /// ([`super::pool::TAG`] and the page's index), or a block of the inner
    /// allocator this many bytes before the sampled block's (aligned)
    /// address.
    pub offset: u32,
}

struct Slot {
    addr: AtomicU64,
    size: AtomicU64,
    objects: AtomicU64,
    stack: AtomicU32,
    offset: AtomicU32,
}

#[allow(clippy::declare_interior_mutable_const)]
const SLOT: Slot = Slot {
    addr: AtomicU64::new(EMPTY),
    size: AtomicU64::new(0),
    objects: AtomicU64::new(0),
    stack: AtomicU32::new(0),
    offset: AtomicU32::new(0),
};
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU8 = AtomicU8::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const ZERO64: AtomicU64 = AtomicU64::new(0);

static SLOTS: [Slot; CAPACITY] = [SLOT; CAPACITY];
/// The filter's counts.
static COUNTS: [AtomicU8; FILTER_BUCKETS] = [ZERO; FILTER_BUCKETS];
/// The filter's bits: bucket `i`'s is bit `i % 64` of word `i / 64`.
static BITS: [AtomicU64; FILTER_BUCKETS / 64] = [ZERO64; FILTER_BUCKETS / 64];
/// A count held by the remover of a bucket's last block while it clears
/// the bucket's bit.
const CLEARING: u8 = u8::MAX;
static DROPPED: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
thread_local! {
    /// Tests: [`insert`] refuses every block on this thread (as a full table
    /// would).
    pub(crate) static REFUSE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
static LIVE: AtomicU64 = AtomicU64::new(0);

#[inline(always)]
fn hash(addr: u64) -> u64 {
    // Allocators return 8- or 16-byte aligned blocks: drop those bits, then a
    // Fibonacci multiply spreads the rest into the high bits.
    (addr >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The filter bucket of `addr`: its bits 4-17 (blocks are 16-byte aligned,
/// or 8: two neighbours share a bucket) xor its bits 18-31. Blocks in one
/// 256 KiB stretch fall in distinct buckets, neighbours in neighbouring ones
/// (one bit word holds 1 KiB of blocks); the high bits spread blocks aligned
/// to pages or more (large blocks, whose low bits are all alike) over the
/// buckets.
#[inline(always)]
fn bucket(addr: u64) -> usize {
    (((addr >> 4) ^ (addr >> 18)) & (FILTER_BUCKETS as u64 - 1)) as usize
}

/// The bit word of bucket `b` and the bucket's bit in it.
#[inline(always)]
fn bit(b: usize) -> (&'static AtomicU64, u64) {
    (&BITS[b / 64], 1 << (b % 64))
}

#[inline(always)]
fn home(addr: u64) -> usize {
    (hash(addr) >> (64 - CAPACITY.trailing_zeros())) as usize
}

/// Whether the block at `addr` may be in the table (false: it is not).
#[inline(always)]
pub(crate) fn maybe_sampled(addr: *mut u8) -> bool {
    let (word, mask) = bit(bucket(addr as u64));
    word.load(Ordering::Relaxed) & mask != 0
}

/// Spins [`enter`] waits at most for a bucket's bit to be cleared.
const CLEARING_SPINS: u32 = 512;

/// Count a block into its bucket and set the bucket's bit; false (the block
/// is not to be tracked) if the bucket is full, or its bit still being
/// cleared after [`CLEARING_SPINS`] spins (a few microseconds: the clearing
/// takes three instructions, unless its thread was preempted in them or a
/// fork left it so in a child).
fn enter(b: usize) -> bool {
    let count = &COUNTS[b];
    let mut spins = 0;
    let mut c = count.load(Ordering::Relaxed);
    loop {
        if c == CLEARING {
            spins += 1;
            if spins > CLEARING_SPINS {
                return false;
            }
            std::hint::spin_loop();
            c = count.load(Ordering::Relaxed);
            continue;
        }
        if c >= CLEARING - 1 {
            return false;
        }
        match count.compare_exchange_weak(c, c + 1, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => break,
            Err(now) => c = now,
        }
    }
    let (word, mask) = bit(b);
    word.fetch_or(mask, Ordering::Relaxed);
    true
}

/// Count a block out of its bucket; the last one out clears the bit, holding
/// the count at [`CLEARING`] meanwhile so that no block is entered (and its
/// bit set) between the clearing and the count's return to zero.
fn leave(b: usize) {
    let count = &COUNTS[b];
    let mut c = count.load(Ordering::Relaxed);
    loop {
        if c == 0 || c == CLEARING {
            // Not ours to change (only left over from a fork).
            return;
        }
        if c == 1 {
            match count.compare_exchange(1, CLEARING, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => {
                    let (word, mask) = bit(b);
                    word.fetch_and(!mask, Ordering::Relaxed);
                    count.store(0, Ordering::Release);
                    return;
                }
                Err(now) => c = now,
            }
        } else {
            match count.compare_exchange(c, c - 1, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(now) => c = now,
            }
        }
    }
}

/// Record a sampled block (its address just returned by the allocator).
/// False if no slot was free within [`MAX_PROBE`] of its home.
pub(crate) fn insert(addr: *mut u8, b: Block) -> bool {
    let addr = addr as u64;
    #[cfg(test)]
    if REFUSE.with(std::cell::Cell::get) {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    if addr <= BUSY {
        return false;
    }
    let h = home(addr);
    for i in 0..MAX_PROBE {
        let slot = &SLOTS[(h + i) % CAPACITY];
        let cur = slot.addr.load(Ordering::Relaxed);
        if cur != EMPTY && cur != TOMBSTONE {
            continue;
        }
        if slot.addr.compare_exchange(cur, BUSY, Ordering::Acquire, Ordering::Relaxed).is_err() {
            continue;
        }
        // The filter first: a search that sees the address sees the bit.
        if !enter(bucket(addr)) {
            // A tombstone, not back to empty: a search must not stop here,
            // short of a block entered further on while this slot was busy
            // (it would miss it, and that block's free would be given the
            // caller's layout instead of the sampled one).
            slot.addr.store(TOMBSTONE, Ordering::Release);
            break;
        }
        slot.size.store(b.bytes, Ordering::Relaxed);
        slot.objects.store(b.objects, Ordering::Relaxed);
        slot.stack.store(b.stack, Ordering::Relaxed);
        slot.offset.store(b.offset, Ordering::Relaxed);
        LIVE.fetch_add(1, Ordering::Relaxed);
        slot.addr.store(addr, Ordering::Release);
        return true;
    }
    DROPPED.fetch_add(1, Ordering::Relaxed);
    false
}

/// The [`Block::offset`] of the block at `addr` if it is in the table (only its owner,
/// the caller, may take it out, so the answer holds until the caller frees
/// it).
pub(crate) fn offset_of(addr: *mut u8) -> Option<u32> {
    let addr = addr as u64;
    if addr <= BUSY {
        return None;
    }
    let h = home(addr);
    for i in 0..MAX_PROBE {
        let slot = &SLOTS[(h + i) % CAPACITY];
        let cur = slot.addr.load(Ordering::Acquire);
        if cur == EMPTY {
            return None;
        }
        if cur == addr {
            return Some(slot.offset.load(Ordering::Relaxed));
        }
    }
    None
}

/// Take the block at `addr` out of the table, if it is there. Called before
/// the block goes back to the allocator (after that the address may be
/// handed out and inserted again).
pub(crate) fn remove(addr: *mut u8) -> Option<Block> {
    let addr = addr as u64;
    if addr <= BUSY {
        return None;
    }
    let h = home(addr);
    for i in 0..MAX_PROBE {
        let slot = &SLOTS[(h + i) % CAPACITY];
        let cur = slot.addr.load(Ordering::Acquire);
        if cur == EMPTY {
            return None;
        }
        if cur != addr {
            continue;
        }
        // Only the block's owner frees it, so no one else takes this slot
        // from under us; the CAS keeps a forked child's leftovers harmless.
        if slot.addr.compare_exchange(addr, BUSY, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return None;
        }
        let b = Block {
            bytes: slot.size.load(Ordering::Relaxed),
            objects: slot.objects.load(Ordering::Relaxed),
            stack: slot.stack.load(Ordering::Relaxed),
            offset: slot.offset.load(Ordering::Relaxed),
        };
        slot.addr.store(TOMBSTONE, Ordering::Release);
        leave(bucket(addr));
        LIVE.fetch_sub(1, Ordering::Relaxed);
        return Some(b);
    }
    None
}

/// Sampled blocks that found no slot (see the module documentation).
pub(crate) fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Sampled blocks in the table now.
pub(crate) fn live() -> u64 {
    LIVE.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_find_remove_and_a_full_window() {
        // Addresses no allocator returns (above the canonical user range) so
        // as not to meet the test process's own sampled blocks, none in
        // filter bucket 0: the next test's, run at the same time (it sets
        // that bucket's count directly).
        let base = 0xffff_9000_0000_1230u64;
        assert_ne!(bucket(base), bucket(0xffff_a000_0000_0000));
        let b = Block { bytes: 24, objects: 7, stack: 3, offset: 16 };
        assert!(!maybe_sampled(base as *mut u8));
        assert!(insert(base as *mut u8, b));
        assert!(maybe_sampled(base as *mut u8));
        assert_eq!(remove(base as *mut u8), Some(b));
        assert_eq!(remove(base as *mut u8), None);
        // Addresses that all share one home slot: MAX_PROBE fit, the next not.
        let same_home: Vec<u64> = (0u64..)
            .map(|i| base + (i << 4))
            .filter(|&a| home(a) == home(base) && bucket(a) != bucket(0xffff_a000_0000_0000))
            .take(MAX_PROBE + 1)
            .collect();
        let before = dropped();
        for (i, &a) in same_home.iter().enumerate() {
            assert_eq!(insert(a as *mut u8, Block { stack: i as u32, ..b }), i < MAX_PROBE, "{i}");
        }
        assert_eq!(dropped() - before, 1);
        for (i, &a) in same_home.iter().enumerate().rev() {
            assert_eq!(remove(a as *mut u8).map(|b| b.stack), (i < MAX_PROBE).then_some(i as u32));
        }
    }

    #[test]
    fn page_aligned_blocks_spread_over_the_filter() {
        // 4,096 consecutive pages (glibc's large blocks start 16 bytes into
        // a page; jemalloc's and mimalloc's on it): nearly as many buckets,
        // where the address's low bits alone give 64.
        for offset in [0u64, 16] {
            let mut seen: Vec<usize> =
                (0..4096u64).map(|p| bucket(0x7f00_0000_0000 + (p << 12) + offset)).collect();
            seen.sort_unstable();
            seen.dedup();
            assert!(seen.len() >= 4000, "offset {offset}: {} buckets", seen.len());
        }
        // Blocks in one 256 KiB stretch: all distinct.
        let mut seen: Vec<usize> = (0..16384u64).map(|i| bucket(0x5555_5555_0000 + (i << 4))).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), FILTER_BUCKETS);
    }

    #[test]
    fn a_bucket_bit_stays_set_until_its_last_block_leaves() {
        let base = 0xffff_a000_0000_0000u64;
        let b = Block { bytes: 1, objects: 1, stack: 0, offset: 0 };
        let same: Vec<u64> =
            (1u64..).map(|i| base + (i << 4)).filter(|&a| bucket(a) == bucket(base)).take(2).collect();
        let (x, y) = (same[0] as *mut u8, same[1] as *mut u8);
        assert!(insert(x, b) && insert(y, b));
        assert!(remove(x).is_some());
        assert!(maybe_sampled(y), "the bucket's other block still sampled");
        assert!(remove(y).is_some());
        assert!(!maybe_sampled(y) && !maybe_sampled(x));
        // While a bucket's bit is being cleared, a block is not entered.
        COUNTS[bucket(base)].store(CLEARING, Ordering::Relaxed);
        let before = dropped();
        assert!(!insert(x, b));
        assert_eq!(dropped() - before, 1);
        assert!(!maybe_sampled(x));
        COUNTS[bucket(base)].store(0, Ordering::Relaxed);
        assert!(insert(x, b) && maybe_sampled(x) && remove(x).is_some());
    }
}
