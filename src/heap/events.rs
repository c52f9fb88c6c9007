//! Heap events for the spool: each sampled allocation and the free of each
//! sampled block, handed from the allocating (or freeing) thread to one
//! recorder's writer, which writes them as tag-10 records (FORMAT.md, "Heap
//! events"; `RecorderBuilder::heap_events`).
//!
//! A fixed ring of [`CAPACITY`] events, static and lock-free (a bounded
//! multi-producer queue: a producer claims a position with a
//! compare-and-swap, writes its cell, then publishes it with a release
//! compare-and-swap of the cell's sequence number); the one consumer is the writer of
//! the recorder that began the current *session*. Nothing here allocates or
//! blocks: a producer that finds the ring full drops its event and counts it
//! in [`LOST`]; a consumer that finds the next cell claimed but not yet
//! published (its producer was interrupted) stops there until its next tick.
//! The writer empties the ring at each tick, and the producer of every
//! quarter ring's event wakes it (a futex wake, where the writer waits on
//! the futex word: the signal engines'), so that a program allocating fast
//! fills it only if the writer cannot run.
//!
//! A session is a number from 1 to [`MAX_SESSION`] (0: no session). A
//! sampled block remembers the session it was allocated in (in its stack
//! slot's high bits, see [`tag_stack`]); its free is an event only in that
//! same session, so a recording never holds the free of a block whose
//! allocation it does not hold.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Events the ring holds.
pub const CAPACITY: usize = 16384;
/// Every this many events, the producer wakes the writer (it empties the
/// ring at each tick, and at each such wake).
const NUDGE: u64 = CAPACITY as u64 / 4;
/// The largest session number (they wrap back to 1).
const MAX_SESSION: u32 = 0xffff;
/// Bits of a live block's stack word that hold the stack slot (the rest: the
/// session of its allocation).
const STACK_BITS: u32 = 16;

// The stack table's slots fit below the session bits.
const _: () = assert!(super::stacks::CAPACITY <= 1 << STACK_BITS);

/// One event.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Event {
    /// Unix microseconds (`CLOCK_REALTIME`, the recorder's clock).
    pub time_us: u64,
    /// The kernel thread id of the thread that allocated or freed.
    pub tid: u32,
    /// The allocation's stack slot in [`super::stacks`].
    pub stack: u32,
    pub address: u64,
    /// The block's size as asked.
    pub size: u64,
    /// The bytes of allocation the sample stands for.
    pub bytes: u64,
    pub freed: bool,
    /// The session it was made in (the consumer drops others': made by a
    /// thread that began before the session changed).
    pub session: u32,
}

struct Cell {
    /// The position this cell is next free for (to be written), or that
    /// plus one once written (to be read), less the cell's index: 0 in the
    /// static initializer means "free for position `index`".
    seq: AtomicU64,
    event: UnsafeCell<Event>,
}

// SAFETY: a cell's event is written only by the producer whose
// compare-and-swap claimed its position (while `seq` says free), and read
// only by the one consumer after an acquire load of `seq` saw it published.
unsafe impl Sync for Cell {}

#[allow(clippy::declare_interior_mutable_const)]
const CELL: Cell = Cell {
    seq: AtomicU64::new(0),
    event: UnsafeCell::new(Event {
        time_us: 0,
        tid: 0,
        stack: 0,
        address: 0,
        size: 0,
        bytes: 0,
        freed: false,
        session: 0,
    }),
};

static CELLS: [Cell; CAPACITY] = [CELL; CAPACITY];
/// The next position to claim.
static HEAD: AtomicU64 = AtomicU64::new(0);
/// The next position to read (the consumer's).
static TAIL: AtomicU64 = AtomicU64::new(0);
/// The current session (0: none).
static SESSION: AtomicU32 = AtomicU32::new(0);
/// The last session begun.
static LAST_SESSION: AtomicU32 = AtomicU32::new(0);
/// Events dropped because the ring was full (or, in a forked child, because
/// the fork came between their claim and their publication).
pub(crate) static LOST: AtomicU64 = AtomicU64::new(0);

/// The current session, 0 if none: whether events are wanted.
#[inline]
pub(crate) fn session() -> u32 {
    SESSION.load(Ordering::Relaxed)
}

/// A live block's stack word: the stack slot and the session it was
/// allocated in.
pub(crate) fn tag_stack(slot: u32, session: u32) -> u32 {
    slot | session << STACK_BITS
}

/// The stack slot and the session of a live block's stack word.
pub(crate) fn untag_stack(word: u32) -> (u32, u32) {
    (word & ((1 << STACK_BITS) - 1), word >> STACK_BITS)
}

/// Begin a session: the caller becomes the consumer. `None` if one is
/// running (another recorder takes the events). Events left in the ring by
/// an earlier session are dropped (not counted lost).
pub(crate) fn begin() -> Option<u32> {
    // Claimed first with a placeholder, so that two recorders starting at
    // once cannot both drain.
    if SESSION.compare_exchange(0, u32::MAX, Ordering::AcqRel, Ordering::Relaxed).is_err() {
        return None;
    }
    while pop().is_some() {}
    let last = LAST_SESSION.load(Ordering::Relaxed);
    let next = if last >= MAX_SESSION { 1 } else { last + 1 };
    LAST_SESSION.store(next, Ordering::Relaxed);
    SESSION.store(next, Ordering::Release);
    Some(next)
}

/// End session `s` (the consumer's): no more events are made.
pub(crate) fn end(s: u32) {
    let _ = SESSION.compare_exchange(s, 0, Ordering::AcqRel, Ordering::Relaxed);
}

/// In a forked child (the `fork` handler, on its only thread): the parent's
/// session is not the child's (it has no writer), and cells that the
/// parent's other threads had claimed will never be published. The ring is
/// made empty again, and the session ended, so that a recorder started in
/// the child takes the events afresh. Allocation-free.
pub(crate) fn after_fork() {
    SESSION.store(0, Ordering::SeqCst);
    let (head, tail) = (HEAD.load(Ordering::Relaxed), TAIL.load(Ordering::Relaxed));
    if head == tail {
        // Every cell is free for its next position already.
        return;
    }
    for (i, cell) in CELLS.iter().enumerate() {
        // Free for the lap of position `head` (the next to claim).
        let lap = head - head % CAPACITY as u64;
        let pos = if (i as u64) < head % CAPACITY as u64 {
            lap + CAPACITY as u64 + i as u64
        } else {
            lap + i as u64
        };
        cell.seq.store(pos.wrapping_sub(i as u64), Ordering::Relaxed);
    }
    TAIL.store(head, Ordering::Relaxed);
}

/// Hand `e` to the consumer; false (and counted in [`LOST`]) if the ring is
/// full, or if a fork came between the claim and the publication (in the
/// child). Lock-free and allocation-free.
pub(crate) fn push(e: Event) -> bool {
    let Some((pos, cell)) = claim() else {
        LOST.fetch_add(1, Ordering::Relaxed);
        return false;
    };
    publish(pos, cell, e)
}

/// Claim the next position: it and its cell, `None` if the ring is full.
fn claim() -> Option<(u64, &'static Cell)> {
    let mut pos = HEAD.load(Ordering::Relaxed);
    loop {
        let i = (pos % CAPACITY as u64) as usize;
        let cell = &CELLS[i];
        let seq = cell.seq.load(Ordering::Acquire).wrapping_add(i as u64);
        let dif = seq.wrapping_sub(pos) as i64;
        if dif == 0 {
            match HEAD.compare_exchange_weak(pos, pos + 1, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some((pos, cell)),
                Err(now) => pos = now,
            }
        } else if dif < 0 {
            // The cell still holds an event of the lap before: full.
            return None;
        } else {
            pos = HEAD.load(Ordering::Relaxed);
        }
    }
}

/// Write `e` into `cell`, claimed for `pos`, and publish it. The publication
/// is a compare-and-swap from "free for `pos`": a fork between the claim and
/// here (a signal handler that interrupted this thread and forked) made the
/// child's [`after_fork`] free every cell for a later position, and the
/// event is then dropped (counted in [`LOST`]) rather than published where
/// the child's consumer would never look, which left the ring stuck there.
/// (The event's bytes are still written into the cell first: this assumes
/// that nothing in the child claims that cell's next position before the
/// handler returns, which would need the handler to begin a recording and
/// push a lap of events.)
fn publish(pos: u64, cell: &Cell, e: Event) -> bool {
    let i = (pos % CAPACITY as u64) as usize;
    // (No one reads the cell until the compare-and-swap below publishes it.)
    // SAFETY: position `pos` is ours (the claim's compare-and-swap) and the cell was free for it.
    unsafe { *cell.event.get() = e };
    let free = pos.wrapping_sub(i as u64);
    let published = (pos + 1).wrapping_sub(i as u64);
    if cell.seq.compare_exchange(free, published, Ordering::Release, Ordering::Relaxed).is_err() {
        LOST.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    if (pos + 1).is_multiple_of(NUDGE) {
        crate::recorder::exit_request::nudge_writer();
    }
    true
}

/// The next published event, if any (the consumer only: the recorder whose
/// [`begin`] returned the current session).
pub(crate) fn pop() -> Option<Event> {
    let pos = TAIL.load(Ordering::Relaxed);
    let i = (pos % CAPACITY as u64) as usize;
    let cell = &CELLS[i];
    let seq = cell.seq.load(Ordering::Acquire).wrapping_add(i as u64);
    if seq != pos + 1 {
        return None;
    }
    // SAFETY: published for `pos` (the acquire load saw the producer's release store); only this consumer reads it.
    let e = unsafe { *cell.event.get() };
    // Free for the position one lap on.
    cell.seq.store((pos + CAPACITY as u64).wrapping_sub(i as u64), Ordering::Release);
    TAIL.store(pos + 1, Ordering::Relaxed);
    Some(e)
}

/// This thread's kernel thread id (read from glibc's thread control block
/// where the recorder's start found the field, else a system call).
pub(crate) fn tid() -> u32 {
    crate::recorder::current_tid()
}

/// Unix microseconds, `CLOCK_REALTIME` (the recorder's clock).
pub(crate) fn now_us() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1000
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Serializes the tests that begin sessions (the ring is the process's).
    pub(crate) static SESSIONS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn ev(n: u64) -> Event {
        Event {
            time_us: n,
            tid: 1,
            stack: 2,
            address: n * 16,
            size: 8,
            bytes: 512,
            freed: n % 2 == 1,
            session: 3,
        }
    }

    #[test]
    fn one_session_at_a_time_and_events_come_out_in_order() {
        let _g = SESSIONS.lock().unwrap_or_else(|p| p.into_inner());
        let s = begin().expect("no session runs");
        assert_ne!(s, 0);
        assert_eq!(session(), s);
        assert_eq!(begin(), None, "a second consumer");
        let lost = LOST.load(Ordering::Relaxed);
        // Three laps of the ring, half full each time.
        for lap in 0..3u64 {
            for n in 0..CAPACITY as u64 / 2 {
                assert!(push(ev(lap * 10_000 + n)));
            }
            for n in 0..CAPACITY as u64 / 2 {
                assert_eq!(pop(), Some(ev(lap * 10_000 + n)));
            }
            assert_eq!(pop(), None);
        }
        // Full: the rest are dropped and counted.
        for n in 0..CAPACITY as u64 + 5 {
            push(ev(n));
        }
        assert_eq!(LOST.load(Ordering::Relaxed) - lost, 5);
        end(s);
        assert_eq!(session(), 0);
        // The next session starts empty, with another number.
        let t = begin().expect("ended");
        assert_ne!(t, s);
        assert_eq!(pop(), None);
        end(t);
    }

    #[test]
    fn producers_on_several_threads_lose_nothing_that_fits() {
        let _g = SESSIONS.lock().unwrap_or_else(|p| p.into_inner());
        let s = begin().expect("no session runs");
        let lost = LOST.load(Ordering::Relaxed);
        let threads: Vec<_> = (0..4u64)
            .map(|t| std::thread::spawn(move || (0..CAPACITY as u64 / 8).all(|n| push(ev(t << 32 | n)))))
            .collect();
        // Read while they write.
        let mut got = Vec::new();
        let mut done = false;
        while !done {
            done = threads.iter().all(|t| t.is_finished());
            while let Some(e) = pop() {
                got.push(e.time_us);
            }
        }
        for t in threads {
            assert!(t.join().unwrap());
        }
        while let Some(e) = pop() {
            got.push(e.time_us);
        }
        assert_eq!(LOST.load(Ordering::Relaxed), lost);
        assert_eq!(got.len(), CAPACITY / 2);
        // Each producer's events in its order.
        for t in 0..4u64 {
            let mine: Vec<u64> = got.iter().filter(|&&v| v >> 32 == t).map(|&v| v & 0xffff_ffff).collect();
            assert_eq!(mine, (0..CAPACITY as u64 / 8).collect::<Vec<_>>());
        }
        end(s);
    }

    #[test]
    fn a_fork_leaves_an_empty_ring_and_no_session() {
        let _g = SESSIONS.lock().unwrap_or_else(|p| p.into_inner());
        let s = begin().expect("no session runs");
        for n in 0..100 {
            assert!(push(ev(n)));
        }
        // A cell claimed and never published (its thread not in the child).
        HEAD.fetch_add(1, Ordering::SeqCst);
        after_fork();
        assert_eq!(session(), 0);
        assert_eq!(pop(), None);
        // The ring works on from there, over more than a lap.
        let t = begin().expect("the child may begin");
        assert_ne!(t, s);
        for n in 0..CAPACITY as u64 + 10 {
            assert!(push(ev(n)));
            assert_eq!(pop(), Some(ev(n)));
        }
        end(t);
    }

    /// A fork between a push's claim and its publication (a signal handler
    /// that interrupted the push and forked; the push goes on in the child
    /// once the handler returns): the event is dropped, and the child's ring
    /// does not stall at that cell.
    #[test]
    fn a_push_interrupted_by_a_fork_is_dropped_in_the_child() {
        let _g = SESSIONS.lock().unwrap_or_else(|p| p.into_inner());
        let s = begin().expect("no session runs");
        for n in 0..10 {
            assert!(push(ev(n)));
        }
        for wrap in [false, true] {
            let (pos, cell) = claim().expect("room");
            after_fork();
            let lost = LOST.load(Ordering::Relaxed);
            assert!(!publish(pos, cell, ev(99)), "published after the fork");
            assert_eq!(LOST.load(Ordering::Relaxed) - lost, 1);
            // Over more than a lap, every cell is claimed and read again.
            let t = begin().expect("the child may begin");
            assert_eq!(pop(), None);
            let laps = if wrap { 2 } else { 1 };
            for n in 0..laps * CAPACITY as u64 + 10 {
                assert!(push(ev(n)), "push {n}");
                assert_eq!(pop(), Some(ev(n)));
            }
            end(t);
        }
        end(s);
    }

    #[test]
    fn a_stack_word_keeps_the_slot_and_the_session() {
        assert_eq!(untag_stack(tag_stack(4095, MAX_SESSION)), (4095, MAX_SESSION));
        assert_eq!(untag_stack(tag_stack(7, 0)), (7, 0));
    }
}
