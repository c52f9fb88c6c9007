//! The unwinding step of a sample: a pool of framehop caches claimed with one
//! compare-and-swap, and the loop that walks frames into a ring slot.
//!
//! Everything here runs inside the signal handler and is allocation- and
//! lock-free: the caches are allocated at start, claiming is a CAS on an
//! `AtomicBool`, and framehop with `MustNotAllocateDuringUnwind` keeps its DWARF
//! evaluation state in the cache and on the stack. The only memory read outside
//! the unwinder's own owned data goes through the `read_stack` callback that
//! `signal.rs` builds from proven stack bounds.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};

use framehop::{FrameAddress, Unwinder as _};

use super::modules::{NativeCache, NativeUnwinder};

struct CacheSlot {
    busy: AtomicBool,
    cache: UnsafeCell<NativeCache>,
}

/// Preallocated unwinder caches (framehop needs exclusive use of one per unwind).
pub(crate) struct CachePool {
    slots: Box<[CacheSlot]>,
}

// SAFETY: a cache is only touched by the holder of its `busy` flag, acquired
// with a CAS (acquire) and released with a release store.
unsafe impl Sync for CachePool {}
// SAFETY: plain owned data.
unsafe impl Send for CachePool {}

/// Exclusive use of one cache until dropped.
pub(crate) struct CacheGuard<'a> {
    slot: &'a CacheSlot,
}

impl CachePool {
    /// `n` caches (at least one).
    pub(crate) fn new(n: usize) -> CachePool {
        let slots = (0..n.max(1))
            .map(|_| CacheSlot {
                busy: AtomicBool::new(false),
                cache: UnsafeCell::new(NativeCache::new_in()),
            })
            .collect();
        CachePool { slots }
    }

    /// Claim a free cache, starting the search at `hint`; `None` if all are busy.
    #[inline]
    pub(crate) fn claim(&self, hint: usize) -> Option<CacheGuard<'_>> {
        let n = self.slots.len();
        for i in 0..n {
            let slot = &self.slots[(hint + i) % n];
            if slot.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return Some(CacheGuard { slot });
            }
        }
        None
    }
}

impl CacheGuard<'_> {
    /// The claimed cache.
    #[inline]
    pub(crate) fn cache(&mut self) -> &mut NativeCache {
        // SAFETY: we hold the slot's busy flag, so nobody else has a reference.
        unsafe { &mut *self.slot.cache.get() }
    }
}

impl Drop for CacheGuard<'_> {
    fn drop(&mut self) {
        self.slot.busy.store(false, Ordering::Release);
    }
}

/// Registers at the interrupted instruction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Regs {
    pub pc: u64,
    pub sp: u64,
    pub fp: u64,
    /// The link register (aarch64 only; zero elsewhere).
    #[allow(dead_code)]
    pub lr: u64,
}

#[cfg(target_arch = "x86_64")]
fn native_regs(r: &Regs) -> framehop::UnwindRegsNative {
    framehop::UnwindRegsNative::new(r.pc, r.sp, r.fp)
}

/// framehop takes the link register separately from the pc: it becomes the
/// leaf's return address only where the unwind rule of the leaf says the return
/// address is still in lr (a function that has not saved it yet); otherwise the
/// return address is read from the frame. Code built with pointer
/// authentication (`-mbranch-protection`, common in distributions' system
/// libraries) signs the saved return addresses in the bits above the virtual
/// address; Linux maps code below 2^48, so those bits are cleared.
#[cfg(target_arch = "aarch64")]
fn native_regs(r: &Regs) -> framehop::UnwindRegsNative {
    let code_mask = framehop::aarch64::PtrAuthMask(u64::MAX >> 16);
    framehop::UnwindRegsNative::new_with_ptr_auth_mask(code_mask, r.lr, r.sp, r.fp)
}

/// Walk the stack from `regs` into `out` (leaf pc first, then raw return
/// addresses). Returns the number of addresses written and whether the walk
/// stopped before the root (unwinding error, or `out` full).
#[inline]
pub(crate) fn unwind_into<F>(
    unwinder: &NativeUnwinder,
    cache: &mut NativeCache,
    regs: &Regs,
    read_stack: &mut F,
    out: &mut [u64],
) -> (usize, bool)
where
    F: FnMut(u64) -> Result<u64, ()>,
{
    if out.is_empty() {
        return (0, true);
    }
    let mut iter = unwinder.iter_frames(regs.pc, native_regs(regs), cache, read_stack);
    let mut n = 0;
    loop {
        match iter.next() {
            Ok(Some(frame)) => {
                if n == out.len() {
                    return (n, true);
                }
                out[n] = match frame {
                    FrameAddress::InstructionPointer(pc) => pc,
                    FrameAddress::ReturnAddress(ra) => ra.get(),
                };
                n += 1;
            }
            Ok(None) => return (n, false),
            Err(_) => return (n, true),
        }
    }
}
