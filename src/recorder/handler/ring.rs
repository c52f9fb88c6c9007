//! The lock-free bounded ring between the signal handler (many producers) and the
//! writer thread (one consumer).
//!
//! The two sides are two types: [`Ring`] is the producer side, shared with the
//! handler through `Shared` and offering only [`Ring::claim`]; [`Consumer`] is
//! the one consumer, made together with the ring, owned by the writer thread and
//! not `Clone`, so a second consumer cannot exist and `pop` (which assumes a
//! single consumer) takes it by `&mut`.
//!
//! A bounded MPMC queue in the style of Vyukov's: every slot carries a sequence
//! number; a producer claims the slot at the enqueue position with one
//! compare-and-swap, writes its words in place and publishes them with a release
//! store of the sequence. A full ring (the slot's sequence shows it was not yet
//! consumed) makes the producer give up at once: a sample is dropped and counted,
//! nothing ever waits. The storage is allocated once at start; claiming and
//! publishing touch only atomics and the claimed words, so the ring is usable
//! from a signal handler.
//!
//! Slot layout (u64 words): `[time_us, tid | weight << 32, generation,
//! depth | flags << 32, addr0 (leaf pc), addr1 (return address), ...]`; a
//! kernel-mode sample's addr0 is the user pc the kernel returns to.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Most slots a ring has (the builder's `ring_capacity` limit).
pub(crate) const MAX_SLOTS: usize = 1 << 20;
/// Words before the addresses in a slot.
pub(crate) const HEADER_WORDS: usize = 4;
/// Flag: unwinding stopped before the root (error or depth limit).
pub(crate) const FLAG_TRUNCATED: u64 = 1;
/// Flag: the slot holds no sample (a producer gave up after claiming it).
pub(crate) const FLAG_VOID: u64 = 2;
/// Flag: the sample's period ended in kernel mode (its addresses are the user
/// stack that entered the kernel).
pub(crate) const FLAG_KERNEL: u64 = 4;

/// One decoded sample, borrowed from the ring while the consumer holds it.
#[derive(Debug)]
pub(crate) struct RawSample<'a> {
    pub time_us: u64,
    pub tid: u32,
    pub weight: u32,
    pub generation: u64,
    pub truncated: bool,
    /// The period ended in kernel mode.
    pub kernel: bool,
    /// Leaf first: the interrupted pc, then return addresses.
    pub addrs: &'a [u64],
}

struct SlotSeq {
    seq: AtomicUsize,
}

/// The ring's storage and producer side. Capacity is a power of two; each slot
/// holds `stride` words.
pub(crate) struct Ring {
    seqs: Box<[SlotSeq]>,
    words: ZeroedWords,
    stride: usize,
    mask: usize,
    enqueue: AtomicUsize,
}

/// The ring's single consumer: its dequeue position, and which ring it belongs to.
pub(crate) struct Consumer {
    /// Address of the ring's sequence array, which identifies the ring.
    ring: usize,
    pos: usize,
}

// SAFETY: access to `words` is arbitrated by the per-slot sequence numbers: a
// slot's words are written only by the one producer whose CAS claimed it, and read
// only by the consumer after the producer's release store published them.
unsafe impl Sync for Ring {}
// SAFETY: the ring owns plain data (atomics and u64 cells).
unsafe impl Send for Ring {}

/// A claimed slot. Dropping it without [`Claim::publish`] publishes it as void.
pub(crate) struct Claim<'a> {
    ring: &'a Ring,
    pos: usize,
    published: bool,
}

impl Ring {
    /// A ring of at least `capacity` slots of `max_depth` addresses each, and
    /// its one consumer.
    pub(crate) fn new(capacity: usize, max_depth: usize) -> (Ring, Consumer) {
        let cap = capacity.clamp(2, MAX_SLOTS).next_power_of_two();
        let stride = HEADER_WORDS + max_depth;
        let seqs = (0..cap).map(|i| SlotSeq { seq: AtomicUsize::new(i) }).collect();
        let words = ZeroedWords::new(cap * stride);
        let ring = Ring { seqs, words, stride, mask: cap - 1, enqueue: AtomicUsize::new(0) };
        let consumer = Consumer { ring: ring.seqs.as_ptr() as usize, pos: 0 };
        (ring, consumer)
    }

    /// Slots claimed so far (samples taken and being taken, void ones too).
    pub(crate) fn claimed(&self) -> usize {
        self.enqueue.load(Ordering::SeqCst)
    }

    /// Slots in the ring.
    pub(crate) fn capacity(&self) -> usize {
        self.mask + 1
    }

    /// Claim a free slot, or `None` when the ring is full. Never blocks; the
    /// CAS loop only retries when another producer won the same position.
    #[inline]
    pub(crate) fn claim(&self) -> Option<Claim<'_>> {
        let mut pos = self.enqueue.load(Ordering::Relaxed);
        loop {
            let seq = self.seqs[pos & self.mask].seq.load(Ordering::Acquire);
            let dif = seq as isize - pos as isize;
            if dif == 0 {
                match self.enqueue.compare_exchange_weak(pos, pos + 1, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => return Some(Claim { ring: self, pos, published: false }),
                    Err(now) => pos = now,
                }
            } else if dif < 0 {
                return None;
            } else {
                pos = self.enqueue.load(Ordering::Relaxed);
            }
        }
    }

    /// Whether the slot half a ring before `claim`'s is still unread: the
    /// ring is at least half full (one atomic load). A slot at position `q`
    /// holds sequence `q` (claimed) or `q + 1` (published) until the consumer
    /// reads it, then `q` plus the capacity or more.
    #[inline]
    pub(crate) fn half_full(&self, claim: &Claim<'_>) -> bool {
        // Half the capacity (`mask + 1`, a power of two).
        let Some(q) = claim.pos.checked_sub(self.mask.div_ceil(2)) else { return false };
        self.seqs[q & self.mask].seq.load(Ordering::Relaxed) <= q.wrapping_add(1)
    }

    /// Fault the ring's pages in now, from the writer thread, so the handler
    /// does not: until the ring has gone round once, about every fourth sample
    /// would otherwise take a page fault (the kernel zeroing a fresh page) in
    /// the handler, for the first seconds of a recording. Only the start of
    /// each slot is faulted in: its header and [`PREFAULT_FRAMES`] frames (the
    /// whole ring when slots are that small, as by default); the pages of
    /// deeper frames are touched only by a stack that reaches them, so a large
    /// `max_stack_depth` costs memory only where stacks are deep. Done with
    /// `MADV_POPULATE_WRITE` (Linux 5.14), which leaves the contents as they
    /// are, so producers may be writing slots meanwhile; on an older kernel
    /// the pages are faulted in by their first sample, as before.
    pub(crate) fn prefault(&self) {
        if !self.words.mapped {
            return;
        }
        let stride = self.stride * 8;
        let head = (HEADER_WORDS + PREFAULT_FRAMES) * 8;
        let ranges: Box<dyn Iterator<Item = (usize, usize)>> = if stride <= head {
            Box::new(std::iter::once((0, (self.words.len * 8).max(1))))
        } else {
            Box::new((0..self.capacity()).map(move |i| (i * stride, head)))
        };
        // SAFETY: a sysconf query.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        for (off, len) in ranges {
            // madvise wants a page-aligned start.
            let start = off & !(page - 1);
            let len = len + (off - start);
            let end = (start + len).min(self.words.len * 8);
            // POPULATE_WRITE only makes pages present and writable.
            // SAFETY: `[start, end)` lies in our own mapping (`ZeroedWords`:
            // `len * 8` bytes from a page-aligned `ptr`), and the call changes no byte.
            unsafe {
                libc::madvise(
                    (self.words.ptr as *mut u8).add(start) as *mut libc::c_void,
                    end.saturating_sub(start).max(1),
                    MADV_POPULATE_WRITE,
                )
            };
        }
    }

    fn slot_ptr(&self, pos: usize) -> *mut u64 {
        let base = (pos & self.mask) * self.stride;
        self.words.as_slice()[base].get()
    }
}

/// Frames of each slot faulted in at start ([`Ring::prefault`]).
pub(crate) const PREFAULT_FRAMES: usize = 128;

/// `MADV_POPULATE_WRITE` (Linux 5.14; not in every libc crate version).
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// The ring's slot words: a private anonymous mapping, which the kernel
/// zero-fills page by page on first touch. A default ring is about 2 MB, and
/// zeroing it explicitly at start was a fifth of a recorded process's start-up
/// cost, so the writer thread faults it in after start instead
/// ([`Ring::prefault`]), beside the sampled threads. The mapping is
/// readable and writable for its whole life, so a first touch (from the
/// handler too) is an ordinary page fault, never an access to unmapped memory.
/// Falls back to a zeroed heap allocation if `mmap` fails.
struct ZeroedWords {
    ptr: *mut UnsafeCell<u64>,
    len: usize,
    /// Whether `ptr` is our mapping (else a leaked `Box` of `len` cells).
    mapped: bool,
}

impl ZeroedWords {
    fn new(len: usize) -> ZeroedWords {
        let bytes = len.checked_mul(std::mem::size_of::<u64>()).expect("ring size overflows");
        // SAFETY: a fresh private anonymous mapping at an address of the
        // kernel's choice; it aliases nothing. Checked for failure below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let b: Box<[UnsafeCell<u64>]> = (0..len).map(|_| UnsafeCell::new(0)).collect();
            return ZeroedWords { ptr: Box::into_raw(b) as *mut UnsafeCell<u64>, len, mapped: false };
        }
        ZeroedWords { ptr: p as *mut UnsafeCell<u64>, len, mapped: true }
    }

    fn as_slice(&self) -> &[UnsafeCell<u64>] {
        // `ptr` is either our mapping (zero-filled by the kernel, page-aligned,
        // readable and writable) or a leaked `Box<[UnsafeCell<u64>]>`.
        // SAFETY: either way `len` cells live there until drop, and
        // `UnsafeCell<u64>` has the layout of `u64`, for which zero is valid.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for ZeroedWords {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: our own mapping of this size, made in `new`; the ring is
            // being dropped, so no reference into it remains.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, (self.len * 8).max(1)) };
        } else {
            // SAFETY: `ptr` came from `Box::into_raw` of a boxed slice of `len`
            // cells in `new` and is freed only here.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
        }
    }
}

impl Consumer {
    /// Slots read so far: the ring is empty when this equals
    /// [`Ring::claimed`].
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// Pop one published sample of `ring`, if the next slot is ready; `f` sees it
    /// (`None` for a void slot) while the slot is held. Returns `None` when the
    /// next slot is not (yet) published, or when `ring` is not this consumer's.
    pub(crate) fn pop<R>(&mut self, ring: &Ring, f: impl FnOnce(Option<RawSample<'_>>) -> R) -> Option<R> {
        if ring.seqs.as_ptr() as usize != self.ring {
            debug_assert!(false, "a ring consumer used with another ring");
            return None;
        }
        let pos = self.pos;
        let seq = ring.seqs[pos & ring.mask].seq.load(Ordering::Acquire);
        if seq != pos.wrapping_add(1) {
            return None;
        }
        // This `Consumer` is the ring's only one (made once by `Ring::new`, not
        // `Clone`, borrowed `&mut`), so no other reader holds the slot.
        // SAFETY: the acquire load above saw the producer's release store, so the
        // words are complete; no producer reclaims the slot before our next store.
        let words = unsafe { std::slice::from_raw_parts(ring.slot_ptr(pos) as *const u64, ring.stride) };
        let flags = words[3] >> 32;
        let r = if flags & FLAG_VOID != 0 {
            f(None)
        } else {
            let depth = ((words[3] & 0xffff_ffff) as usize).min(ring.stride - HEADER_WORDS);
            f(Some(RawSample {
                time_us: words[0],
                tid: words[1] as u32,
                weight: (words[1] >> 32) as u32,
                generation: words[2],
                truncated: flags & FLAG_TRUNCATED != 0,
                kernel: flags & FLAG_KERNEL != 0,
                addrs: &words[HEADER_WORDS..HEADER_WORDS + depth],
            }))
        };
        ring.seqs[pos & ring.mask].seq.store(pos.wrapping_add(ring.mask + 1), Ordering::Release);
        self.pos = pos.wrapping_add(1);
        Some(r)
    }
}

impl Claim<'_> {
    /// The slot's words (header then addresses), exclusively ours until published.
    #[inline]
    pub(crate) fn words(&mut self) -> &mut [u64] {
        // SAFETY: our CAS claimed this position; until we publish, no other
        // producer can claim it and the consumer does not read it.
        unsafe { std::slice::from_raw_parts_mut(self.ring.slot_ptr(self.pos), self.ring.stride) }
    }

    /// Fill the header and publish the slot (`flags`: [`FLAG_TRUNCATED`],
    /// [`FLAG_KERNEL`]).
    #[inline]
    pub(crate) fn publish(
        mut self,
        time_us: u64,
        tid: u32,
        weight: u32,
        generation: u64,
        depth: usize,
        flags: u64,
    ) {
        let w = self.words();
        w[0] = time_us;
        w[1] = tid as u64 | (weight as u64) << 32;
        w[2] = generation;
        let flags = flags & (FLAG_TRUNCATED | FLAG_KERNEL);
        w[3] = depth as u64 | flags << 32;
        self.published = true;
        self.ring.seqs[self.pos & self.ring.mask].seq.store(self.pos.wrapping_add(1), Ordering::Release);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.published {
            let w = self.words();
            w[3] = FLAG_VOID << 32;
            self.ring.seqs[self.pos & self.ring.mask].seq.store(self.pos.wrapping_add(1), Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_full_and_void() {
        let (r, mut q) = Ring::new(4, 3);
        assert_eq!(r.capacity(), 4);
        for i in 0..4u64 {
            let mut c = r.claim().expect("free slot");
            c.words()[HEADER_WORDS] = i;
            c.publish(i, 7, 1, 0, 1, 0);
        }
        assert!(r.claim().is_none(), "ring must report full");
        for i in 0..4u64 {
            let got = q.pop(&r, |s| s.map(|s| (s.time_us, s.addrs.to_vec()))).unwrap().unwrap();
            assert_eq!(got, (i, vec![i]));
        }
        assert!(q.pop(&r, |_| ()).is_none());
        drop(r.claim().unwrap());
        assert!(q.pop(&r, |s| s.is_none()).unwrap());
    }

    #[test]
    fn concurrent_producers() {
        let (r, mut q) = Ring::new(1024, 2);
        let r = std::sync::Arc::new(r);
        let hs: Vec<_> = (0..4)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    let mut ok = 0;
                    for i in 0..200u64 {
                        if let Some(mut c) = r.claim() {
                            c.words()[HEADER_WORDS] = t * 1000 + i;
                            c.publish(i, t as u32, 1, 0, 1, 0);
                            ok += 1;
                        }
                    }
                    ok
                })
            })
            .collect();
        let total: usize = hs.into_iter().map(|h| h.join().unwrap()).sum();
        let mut n = 0;
        while q.pop(&r, |s| assert!(s.is_some())).is_some() {
            n += 1;
        }
        assert_eq!(n, total);
        assert_eq!(total, 800);
    }

    #[test]
    fn a_consumer_pops_only_its_own_ring() {
        let (a, _qa) = Ring::new(2, 1);
        let (_b, mut qb) = Ring::new(2, 1);
        a.claim().expect("free slot").publish(1, 1, 1, 0, 0, 0);
        let popped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| qb.pop(&a, |_| ())));
        // Debug builds assert; release builds refuse quietly. Either way the
        // sample stays in `a`.
        assert!(matches!(popped, Ok(None) | Err(_)));
        assert!(a.claim().is_some(), "one free slot left");
        assert!(a.claim().is_none(), "the published sample is still in the ring");
    }
}
