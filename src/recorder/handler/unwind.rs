//! The unwinding step of a sample: a pool of framehop caches claimed with one
//! compare-and-swap, and the loop that walks frames into a ring slot.
//!
//! Everything here runs inside the signal handler and is allocation- and
//! lock-free: the caches are allocated at start, claiming is a CAS on an
//! `AtomicBool`, and framehop with `MustNotAllocateDuringUnwind` keeps its DWARF
//! evaluation state in the cache and on the stack. The only memory read outside
//! the unwinder's own owned data goes through the `read_stack` callback that
//! the handler (`mod.rs`) builds from proven stack bounds.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};

use framehop::{FrameAddress, Unwinder as _};

use crate::recorder::modules::{NativeCache, NativeUnwinder};

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
/// stopped before the root (unwinding error, `out` full, or a frame in the
/// code whose unwind tables are still being checked: its caller is not known
/// yet).
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
    let mut iter = unwinder.frames.iter_frames(regs.pc, native_regs(regs), cache, read_stack);
    let mut n = 0;
    loop {
        match iter.next() {
            Ok(Some(frame)) => {
                if n == out.len() {
                    return (n, true);
                }
                let (addr, lookup) = match frame {
                    FrameAddress::InstructionPointer(pc) => (pc, pc),
                    FrameAddress::ReturnAddress(ra) => (ra.get(), ra.get() - 1),
                };
                out[n] = addr;
                n += 1;
                // Stop before framehop unwinds this frame without its tables.
                if unwinder.pending.as_ref().is_some_and(|r| r.contains(&lookup)) {
                    return (n, true);
                }
            }
            Ok(None) => return (n, false),
            Err(_) => return (n, true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recorder::modules;
    use proptest::prelude::*;

    /// Code addresses of this process to start unwinds at: functions in the test
    /// executable, libc and the dynamic loader, and the starts of the functions
    /// whose unwind entries `cfi_check` left out (PLT stubs, trampolines: the
    /// ones framehop would evaluate on its unchecked path).
    fn code_addresses(objects: &[modules::LoadedObject]) -> Vec<u64> {
        let mut v = vec![
            code_addresses as fn(&[modules::LoadedObject]) -> Vec<u64> as usize as u64,
            libc::getpid as unsafe extern "C" fn() -> libc::pid_t as usize as u64,
            libc::malloc as unsafe extern "C" fn(usize) -> *mut libc::c_void as usize as u64,
            libc::dlsym as unsafe extern "C" fn(*mut libc::c_void, *const libc::c_char) -> *mut libc::c_void
                as usize as u64,
        ];
        v.extend(objects.iter().flat_map(|o| o.unwind_dropped.iter().copied()));
        v
    }

    /// A module whose unwind tables framehop would evaluate on its unchecked
    /// path: a CFA expression that yields 4 makes its `cfa - 8` underflow (a panic
    /// in a debug build) once the return address cannot be read at CFA - 8. The
    /// table the handler gets leaves that FDE out, so the unwind ends in an error.
    // The FDE filter (cfi_check) exists for framehop's x86_64 rules; on other
    // targets the unwind tables are handed over unfiltered (see cfi_check.rs).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn an_fde_on_the_unchecked_path_is_never_handed_to_the_unwinder() {
        use crate::recorder::modules::cfi_check::synth::{cie, fde, hdr};
        let (hdr_svma, eh_svma, text, avma) = (0x1000u64, 0x2000u64, 0x10000u64, 0x5000_0000u64);
        let mut eh = Vec::new();
        let c = cie(&mut eh, &[0x0c, 7, 8, 0x90, 1]);
        let good = fde(&mut eh, eh_svma, c, text, 0x40, &[0x41, 0x0e, 16, 0x86, 2, 0x43, 0x0d, 6]);
        // DW_CFA_def_cfa_expression { DW_OP_lit4 }
        let lit4 = fde(&mut eh, eh_svma, c, text + 0x40, 0x40, &[0x0f, 1, 0x34]);
        eh.extend_from_slice(&[0, 0, 0, 0]);
        let tables = modules::UnwindTables {
            hdr: hdr(hdr_svma, eh_svma, &[(text, good), (text + 0x40, lit4)]).into(),
            hdr_svma,
            eh_frame: eh.into(),
            eh_frame_svma: eh_svma,
        };
        let bias = avma - text;
        let eh_len = tables.eh_frame.len() as u64;
        let (module, memory, dropped) =
            modules::unwind_module(b"synthetic", b"", avma..avma + 0x1000, bias, Some(tables));
        assert_eq!(module.len(), 1, "owned tables: one module, the search table rebuilt");
        assert_eq!(dropped, [avma + 0x40]);
        // Owned tables, and a rebuilt search table (one entry of 8 bytes fewer).
        assert_eq!(memory.borrowed, 0);
        assert_eq!(memory.copied, eh_len + 12 + 8);
        let mut unwinder = NativeUnwinder::default();
        unwinder.add_module(module.into_iter().next().unwrap());
        let pool = CachePool::new(1);
        let mut guard = pool.claim(0).unwrap();
        let mut out = [0u64; 8];
        let regs = Regs { pc: avma + 0x48, sp: 0x7000_0000, fp: 0x7000_0100, lr: 0 };
        let (n, truncated) = unwind_into(&unwinder, guard.cache(), &regs, &mut |_| Err(()), &mut out);
        assert_eq!((n, truncated), (1, true));
        assert_eq!(out[0], avma + 0x48);
    }

    /// Tables read in place keep their original search table: the code whose
    /// lookup would find the dropped FDE is left out of the modules instead,
    /// and nothing is copied.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn borrowed_tables_leave_out_the_code_of_dropped_fdes() {
        use crate::recorder::modules::cfi_check::synth::{cie, fde, hdr};
        let (hdr_svma, eh_svma, text, avma) = (0x1000u64, 0x2000u64, 0x10000u64, 0x5000_0000u64);
        let mut eh = Vec::new();
        let c = cie(&mut eh, &[0x0c, 7, 8, 0x90, 1]);
        let plain = [0x41, 0x0e, 16, 0x86, 2, 0x43, 0x0d, 6];
        let good = fde(&mut eh, eh_svma, c, text, 0x40, &plain);
        // DW_CFA_def_cfa_expression { DW_OP_lit4 }: dropped by the check.
        let lit4 = fde(&mut eh, eh_svma, c, text + 0x40, 0x40, &[0x0f, 1, 0x34]);
        let after = fde(&mut eh, eh_svma, c, text + 0x80, 0x40, &plain);
        eh.extend_from_slice(&[0, 0, 0, 0]);
        let h = hdr(hdr_svma, eh_svma, &[(text, good), (text + 0x40, lit4), (text + 0x80, after)]);
        let (h, eh): (&'static [u8], &'static [u8]) = (Box::leak(h.into()), Box::leak(eh.into()));
        let tables =
            modules::UnwindTables { hdr: h.into(), hdr_svma, eh_frame: eh.into(), eh_frame_svma: eh_svma };
        let bias = avma - text;
        let (pieces, memory, dropped) =
            modules::unwind_module(b"synthetic", b"", avma..avma + 0x1000, bias, Some(tables));
        assert_eq!(dropped, [avma + 0x40]);
        assert_eq!((memory.copied, memory.borrowed), (0, (h.len() + eh.len()) as u64));
        let ranges: Vec<_> = pieces.iter().map(|m| m.avma_range()).collect();
        assert_eq!(ranges, [avma..avma + 0x40, avma + 0x80..avma + 0x1000]);

        let mut unwinder = NativeUnwinder::default();
        for m in pieces {
            unwinder.add_module(m);
        }
        let pool = CachePool::new(1);
        let mut guard = pool.claim(0).unwrap();
        let mut out = [0u64; 8];
        // In the dropped function: no module, so framehop follows the frame
        // pointer (here: unreadable) and never evaluates the FDE.
        let regs = Regs { pc: avma + 0x48, sp: 0x7000_0000, fp: 0x7000_0100, lr: 0 };
        let r = unwind_into(&unwinder, guard.cache(), &regs, &mut |_| Err(()), &mut out);
        assert_eq!((r, out[0]), ((1, true), avma + 0x48));
        // In the functions on either side, their own FDEs: at their first
        // instruction the return address is at sp.
        for pc in [avma, avma + 0x80] {
            let stack = [0x1234u64];
            let sp = stack.as_ptr() as u64;
            let mut read = |a: u64| if a == sp { Ok(stack[0]) } else { Err(()) };
            let regs = Regs { pc, sp, fp: 0, lr: 0 };
            let r = unwind_into(&unwinder, guard.cache(), &regs, &mut read, &mut out);
            assert_eq!((r.0, &out[..2]), (2, &[pc, 0x1234][..]), "{pc:#x}");
        }
    }

    /// While an object's tables are being checked, a walk stops at its first
    /// frame, which it keeps: a leaf in that code, or a caller there.
    #[test]
    fn a_walk_stops_at_code_whose_tables_are_pending() {
        let objects = modules::scan(b"", &|_| false, false);
        let full = modules::initial_snapshot(&objects, 0);
        let here = a_walk_stops_at_code_whose_tables_are_pending as fn() as usize as u64;
        let exe =
            objects.iter().find(|o| o.segments.iter().any(|s| s.avma <= here && here - s.avma < s.size));
        let exe = exe.expect("the test executable");
        assert!(!exe.unwind.is_empty(), "checked at scan");
        let mut pending = full.unwinder.clone();
        for m in &exe.unwind {
            pending.frames.remove_module(m.avma_range().start);
        }
        let range = exe.unwind[0].avma_range().start..exe.unwind.last().unwrap().avma_range().end;
        pending.pending = Some(range);

        let pool = CachePool::new(1);
        let mut guard = pool.claim(0).unwrap();
        let mut out = [0u64; 8];
        // A stack that a frame-pointer guess would follow: [fp] = 0 (the
        // root), [fp + 8] = a return address into libc.
        let getpid = libc::getpid as unsafe extern "C" fn() -> libc::pid_t as usize as u64;
        let stack = [here + 1, 0, getpid + 0x10, 0];
        let base = stack.as_ptr() as u64;
        let mut read = |a: u64| -> Result<u64, ()> {
            let i = a.wrapping_sub(base) / 8;
            if a.is_multiple_of(8) && a >= base && i < 4 {
                Ok(stack[i as usize])
            } else {
                Err(())
            }
        };
        // A leaf in the pending code: that frame only, marked truncated.
        let leaf = Regs { pc: here, sp: base, fp: base + 8, lr: 0 };
        let r = unwind_into(&pending, guard.cache(), &leaf, &mut read, &mut out);
        assert_eq!((r, out[0]), ((1, true), here));
        // The rest is x86_64's calling convention (the return address on the
        // stack at a function's entry; aarch64 keeps it in the link register).
        if cfg!(not(target_arch = "x86_64")) {
            return;
        }
        // Without the stop, framehop would have guessed a caller by frame
        // pointer (there are no tables for that code in this unwinder).
        let mut guessing = pending.clone();
        guessing.pending = None;
        let r = unwind_into(&guessing, guard.cache(), &leaf, &mut read, &mut out);
        assert!(r.0 >= 2 && out[1] == getpid + 0x10, "{r:?} {:x?}", &out[..r.0]);
        // A libc leaf whose caller is in the pending code: the walk reads the
        // return address (at sp on entry to a function), keeps it, and stops.
        let regs = Regs { pc: getpid, sp: base, fp: 0, lr: 0 };
        let r = unwind_into(&pending, guard.cache(), &regs, &mut read, &mut out);
        assert_eq!((r, &out[..2]), ((2, true), &[getpid, here + 1][..]));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]
        /// Whatever the registers and stack hold, unwinding with the handler's
        /// unwinder over this process's real modules returns rather than panics
        /// (run it in a debug build: framehop and gimli then have overflow
        /// checks on). The stack is a buffer at a stated address anywhere from
        /// 8 up to the top of the address space; its words are arbitrary,
        /// pointers into it, or code addresses.
        #[test]
        fn hostile_registers_and_stack_never_panic(
            base_words in prop_oneof![1u64..512, (1u64 << 40)..(1u64 << 44), (u64::MAX / 8 - 80)..=(u64::MAX / 8 - 64)],
            words in proptest::collection::vec((0u8..5, any::<u64>()), 1..64),
            sp_index in 0usize..64,
            pc_choice in any::<proptest::sample::Index>(),
            pc_known in any::<bool>(),
            pc_offset in 0u64..4096,
            fp in prop_oneof![any::<u64>(), Just(u64::MAX), Just(0u64), 1u64..64],
            pc_raw in any::<u64>(),
        ) {
            thread_local! {
                static SNAP: (modules::UnwindSnapshot, Vec<u64>) = {
                    let objects = modules::scan(b"", &|_| false, false);
                    (modules::initial_snapshot(&objects, 0), code_addresses(&objects))
                };
            }
            let base = base_words * 8;
            let code = SNAP.with(|s| s.1.clone());
            let stack: Vec<u64> = words
                .iter()
                .map(|&(kind, v)| match kind {
                    0 => v,
                    1 => base.wrapping_add((v % 80) * 8),
                    2 => code[(v % code.len() as u64) as usize].wrapping_add(v % 512),
                    3 => u64::MAX - (v % 32),
                    _ => v % 64,
                })
                .collect();
            let hi = base + stack.len() as u64 * 8;
            let sp = base + (sp_index.min(stack.len() - 1) as u64) * 8;
            let pc = if pc_known { pc_choice.get(&code).wrapping_add(pc_offset % 32) } else { pc_raw };
            let mut read = |addr: u64| -> Result<u64, ()> {
                if addr & 7 != 0 || addr < base || addr >= hi {
                    return Err(());
                }
                Ok(stack[((addr - base) / 8) as usize])
            };
            let pool = CachePool::new(1);
            let mut guard = pool.claim(0).unwrap();
            let mut out = [0u64; 128];
            let (n, _) = SNAP.with(|s| {
                unwind_into(&s.0.unwinder, guard.cache(), &Regs { pc, sp, fp, lr: 0 }, &mut read, &mut out)
            });
            prop_assert!(n >= 1 && out[0] == pc);
        }
    }
}
