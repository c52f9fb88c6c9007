//! The state the handler records into and the writer thread drains, published
//! to the handler as one `Arc` (see `publish` in `mod.rs`).

use std::sync::atomic::{AtomicU32, AtomicU64};

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
}
