//! The handler's module snapshot: an `AtomicPtr` the writer thread swaps when
//! the loaded objects change, and the deferred reclamation of replaced
//! snapshots. The handler only loads the pointer; freeing waits until no handler
//! can hold an old one.

use std::sync::atomic::{AtomicPtr, Ordering};

use crate::recorder::modules::UnwindSnapshot;

/// The handler's current module snapshot.
pub(crate) struct SnapshotCell {
    ptr: AtomicPtr<UnwindSnapshot>,
}

/// A replaced snapshot awaiting reclamation. Dropped without [`reclaim`]
/// (shutdown with a handler possibly still inside) it is leaked, never freed
/// under a reader.
pub(crate) struct Retired(*mut UnwindSnapshot);

// SAFETY: the snapshot is immutable and owned solely by this handle.
unsafe impl Send for Retired {}

impl SnapshotCell {
    /// A cell holding `first`.
    pub(crate) fn new(first: Box<UnwindSnapshot>) -> SnapshotCell {
        SnapshotCell { ptr: AtomicPtr::new(Box::into_raw(first)) }
    }

    /// The current snapshot, for the handler.
    ///
    /// # Safety
    /// Only while the `Shared` holding this cell is published to the handler and
    /// the caller counts in `IN_HANDLER`: a replaced snapshot is freed only when
    /// no handler runs (see [`reclaim`]).
    #[inline]
    pub(super) unsafe fn current(&self) -> &UnwindSnapshot {
        // SAFETY: the pointer always holds a live snapshot (set by `new`, swapped
        // by `replace`); the caller's contract keeps it from being reclaimed.
        unsafe { &*self.ptr.load(Ordering::SeqCst) }
    }

    /// Run `f` on the current snapshot (writer thread only).
    pub(crate) fn with_current<R>(&self, f: impl FnOnce(&UnwindSnapshot) -> R) -> R {
        // SAFETY: only the writer thread swaps the pointer and it is the caller,
        // so the current snapshot stays alive during `f`.
        f(unsafe { &*self.ptr.load(Ordering::SeqCst) })
    }

    /// Publish `next`; the previous snapshot is returned for deferred reclamation.
    pub(crate) fn replace(&self, next: Box<UnwindSnapshot>) -> Retired {
        Retired(self.ptr.swap(Box::into_raw(next), Ordering::SeqCst))
    }
}

impl Drop for SnapshotCell {
    fn drop(&mut self) {
        // SAFETY: the cell is dropped with its `Shared`, after `unpublish`
        // observed that no handler runs, so nobody holds the pointer.
        drop(unsafe { Box::from_raw(*self.ptr.get_mut()) });
    }
}

/// Free retired snapshots if no handler can hold them: any handler that loaded
/// one incremented IN_HANDLER before loading it, so observing zero after the
/// swap proves every such handler has finished.
pub(crate) fn reclaim(retired: &mut Vec<Retired>) {
    if retired.is_empty() || !super::quiescent() {
        return;
    }
    for r in retired.drain(..) {
        // SAFETY: `quiescent()` saw no handler running after the snapshot was
        // swapped out, so no handler holds `r.0` or can load it again; it came
        // from Box::into_raw and is owned by `r` alone, freed only here.
        drop(unsafe { Box::from_raw(r.0) });
    }
}
