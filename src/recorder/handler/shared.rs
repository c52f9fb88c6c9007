//! The state the handler records into and the writer thread drains, published
//! to the handler as one `Arc` (see `publish` in `mod.rs`).

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

use super::names::ThreadNames;
use super::ring::Ring;
use super::snapshot::SnapshotCell;
use super::unwind::CachePool;

/// Counters the handler updates.
#[derive(Default)]
pub(crate) struct Counters {
    pub signals: AtomicU64,
    pub lost_ring_full: AtomicU64,
    pub lost_no_cache: AtomicU64,
    pub lost_unwind_failed: AtomicU64,
    pub overrun_capped: AtomicU64,
    pub truncated: AtomicU64,
    pub foreign_stack: AtomicU64,
    /// Samples whose period ended in kernel mode (by weight).
    pub kernel: AtomicU64,
    /// Kernel-time samples taken while the kernel returned from our own
    /// signal handler (by weight): the profiler's time, dropped.
    pub own_dropped: AtomicU64,
    /// Kernel-time signals handled: the dithering of their weights.
    pub kernel_signals: AtomicU64,
}

/// A request, from a sampled thread's handler, that the writer take a higher
/// priority: the ring is half full or full, so the writer is falling behind
/// (see `writer/priority.rs`). The first handler to see it sets the writer
/// thread's nice value to `target` with one `setpriority` system call; no
/// other handler tries until the writer has given the priority back (or,
/// once refused, ever).
pub(crate) struct WriterBoost {
    /// [`WriterBoost::IDLE`], [`WriterBoost::TRYING`], [`WriterBoost::TAKEN`],
    /// or [`WriterBoost::REFUSED`] plus the errno.
    state: AtomicU32,
    /// The nice value asked for (the writer sets it at start).
    pub target: AtomicI32,
}

impl WriterBoost {
    pub const IDLE: u32 = 0;
    pub const TRYING: u32 = 1;
    pub const TAKEN: u32 = 2;
    pub const REFUSED: u32 = 1 << 16;

    pub(crate) fn new() -> WriterBoost {
        // Until the writer sets its target, a handler asks for nothing.
        WriterBoost { state: AtomicU32::new(Self::TRYING), target: AtomicI32::new(0) }
    }

    /// The state (see the field).
    pub(crate) fn state(&self) -> u32 {
        self.state.load(Ordering::Acquire)
    }

    /// Let handlers ask again (the writer is back at its start's priority).
    pub(crate) fn rearm(&self, target: i32) {
        self.target.store(target, Ordering::Relaxed);
        self.state.store(Self::IDLE, Ordering::Release);
    }

    /// The writer raised its priority itself: handlers need not.
    pub(crate) fn taken(&self) {
        self.state.store(Self::TAKEN, Ordering::Release);
    }

    /// Raising the writer's priority was refused (`errno`): handlers never ask.
    pub(crate) fn refuse(&self, errno: i32) {
        self.state.store(Self::REFUSED | (errno as u32 & 0xffff), Ordering::Release);
    }

    /// Raise the writer's priority unless done or being done. Async-signal-safe:
    /// two atomic operations and, once, one raw system call.
    #[inline]
    pub(crate) fn request(&self, writer_tid: u32) {
        if self.state.load(Ordering::Relaxed) != Self::IDLE
            || self
                .state
                .compare_exchange(Self::IDLE, Self::TRYING, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        let target = self.target.load(Ordering::Relaxed);
        // SAFETY: setpriority(PRIO_PROCESS, tid, nice) changes only the nice
        // value of thread `writer_tid`, the recorder's own writer; `syscall`
        // is resolved before the handler is installed (it reads the thread
        // id the same way) and the handler restores errno.
        let r = unsafe {
            libc::syscall(
                libc::SYS_setpriority,
                libc::PRIO_PROCESS as libc::c_long,
                writer_tid as libc::c_long,
                target as libc::c_long,
            )
        };
        let state = if r == 0 {
            Self::TAKEN
        } else {
            // SAFETY: __errno_location gives this thread's errno slot.
            Self::REFUSED | (unsafe { *libc::__errno_location() } as u32 & 0xffff)
        };
        self.state.store(state, Ordering::Release);
    }
}

/// Stack bounds the handler trusts (see the handler's module documentation).
pub(crate) struct StackBounds {
    pub main_top: u64,
    pub main_span: u64,
    pub tcb_block_offset: Option<usize>,
    pub tcb_tid_offset: Option<usize>,
}

/// State shared by the handler and the writer thread.
pub(crate) struct Shared {
    pub pid: u32,
    pub writer_tid: AtomicU32,
    /// The ring's producer side; the writer thread owns its `Consumer`.
    pub ring: Ring,
    pub caches: CachePool,
    pub snapshot: SnapshotCell,
    pub bounds: StackBounds,
    pub counters: Counters,
    pub weight_cap: u32,
    /// Sample intervals a kernel-time sample stands for on average, in
    /// thousandths: the kernel-time events' period in sampling periods (see
    /// `sys::perf::KERNEL_PERIOD_MILLI`).
    pub kernel_weight_milli: u64,
    /// Names of the threads sampled, taken on their first sample.
    pub names: ThreadNames,
    /// The handlers' request for a higher writer priority.
    pub writer_boost: WriterBoost,
}
