//! The fast path's thread-local count, reached without a call.
//!
//! A `thread_local!` is read through its `LocalKey`'s accessor, a function
//! that the compiler inlines only where its copy sits in the same codegen
//! unit as the caller. The allocation fast path is inlined into every
//! allocating function of the program, most of them in other units (a
//! release build has 16): there each allocation called the accessor, and
//! that call was most of what `Sampled` cost (`compare/heap_ab 61 threads`,
//! pinned: +6.5-7.2% over `System` with the call, +1.7-3.7% when one
//! codegen unit let every site inline it).
//!
//! Where spulse's code is part of the main executable, its thread-locals
//! are in the executable's static TLS block, at one offset from the thread
//! pointer in every thread (what the local-exec TLS model compiles to). The
//! first slow path of any allocator measures that offset once ([`learn`],
//! checking through the auxiliary vector that this code is the
//! executable's); each allocator copies it into itself at its next slow path
//! ([`OffsetCopy`]), and from then on its fast path reads the count at the
//! thread pointer plus that offset. Where
//! the code is in a shared library (its TLS may be allocated per thread on
//! demand), or on another architecture, the offset stays unknown and the
//! fast path goes through the accessor as before.

//!
//! On x86-64 Linux with glibc the count is not a `thread_local!` at all but
//! a TLS symbol of this crate's own ([`slot`]: `.tbss`, reached with the
//! initial-exec model, which the linker turns into a constant in an
//! executable and which a shared library gets from glibc's static TLS), and
//! the fast path is three instructions with no test of a learnt offset:
//! `mov $offset, %rax; sub %size, %fs:(%rax); js cold` ([`charge_or`]).
//! There nothing is learnt and [`OffsetCopy`] stays 0.
//!
//! The initial-exec model has two costs where spulse is in a shared library.
//! A `cdylib` (a Python or Node extension in Rust) says `STATIC_TLS`, and
//! glibc must find its whole TLS segment (136 bytes for `examples/heap_dylib`:
//! std's thread-locals and spulse's) room in the static TLS it keeps spare for
//! libraries loaded later (about 1,664 bytes by default since glibc 2.32,
//! shared by every such library: twelve of these;
//! `GLIBC_TUNABLES=glibc.rtld.optional_static_tls=N` adds to it); a
//! process that used it up fails the `dlopen` ("cannot allocate memory in
//! static TLS block"; the 13th copy of `examples/heap_dylib` in one process
//! failed so). And where spulse is inside a Rust `dylib` (crate type
//! `dylib`, as Bevy's `dynamic_linking` builds) and the fast path is inlined
//! into another crate (its `#[global_allocator]`), the symbol, hidden in the
//! `dylib`, is undefined there: the link error names it, and its name says
//! what to do. Build with `RUSTFLAGS="--cfg spulse_no_tls_slot"` for either:
//! the count is then a `thread_local!` as on other targets.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// Whether the count is [`slot`]'s TLS symbol (x86-64 Linux, glibc).
pub(crate) const SLOT: bool = cfg!(all(
    target_arch = "x86_64",
    target_pointer_width = "64",
    target_os = "linux",
    target_env = "gnu",
    not(spulse_no_tls_slot)
));

thread_local! {
    /// Bytes this thread may still allocate before its pending sample point
    /// (see `sampler`), where it is not [`slot`]'s symbol. `const` and
    /// without a destructor: a plain `#[thread_local]` slot.
    static BYTES_LEFT: Cell<i64> = const { Cell::new(0) };
}

/// The count as a thread-local of its own: a TLS symbol defined here, zero in
/// every new thread, reached with the initial-exec model (`@GOTTPOFF`). Its
/// name holds a hash ([`slot::KEY`]), so that two copies of spulse in one
/// program keep a count each.
#[cfg(all(
    target_arch = "x86_64",
    target_pointer_width = "64",
    target_os = "linux",
    target_env = "gnu",
    not(spulse_no_tls_slot)
))]
pub(crate) mod slot {
    /// What tells this copy of spulse's symbol from any other's in one
    /// program: a hash of the crate's version, of where its source is (a
    /// registry's copy, a git checkout, a path) and of whether it is the
    /// crate's own test build (which links spulse a second time through
    /// its dev-dependencies). `.hidden` keeps it out of a shared library's
    /// exports, not out of a duplicate definition within one link.
    pub(crate) const KEY: u64 = {
        let parts: [&str; 3] =
            [env!("CARGO_PKG_VERSION"), env!("CARGO_MANIFEST_DIR"), if cfg!(test) { "test" } else { "" }];
        // FNV-1a over the parts, each ended by a 0 byte.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut i = 0;
        while i < parts.len() {
            let b = parts[i].as_bytes();
            let mut j = 0;
            while j <= b.len() {
                h ^= if j < b.len() { b[j] as u64 } else { 0 };
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
                j += 1;
            }
            i += 1;
        }
        h
    };

    std::arch::global_asm!(
        ".pushsection .tbss.spulse_heap_bytes_left_{key}_in_a_rust_dylib_build_with_cfg_spulse_no_tls_slot,\"awT\",@nobits",
        ".p2align 3",
        ".globl spulse_heap_bytes_left_{key}_in_a_rust_dylib_build_with_cfg_spulse_no_tls_slot",
        ".hidden spulse_heap_bytes_left_{key}_in_a_rust_dylib_build_with_cfg_spulse_no_tls_slot",
        ".type spulse_heap_bytes_left_{key}_in_a_rust_dylib_build_with_cfg_spulse_no_tls_slot,@object",
        ".size spulse_heap_bytes_left_{key}_in_a_rust_dylib_build_with_cfg_spulse_no_tls_slot,8",
        "spulse_heap_bytes_left_{key}_in_a_rust_dylib_build_with_cfg_spulse_no_tls_slot:",
        ".zero 8",
        ".popsection",
        key = const KEY,
    );

    /// The count's offset from the thread pointer (the same in every
    /// thread: static TLS).
    #[inline(always)]
    pub(crate) fn offset() -> isize {
        let off: isize;
        // (The GOT entry is filled by the loader before any code runs, or made a constant by the linker.)
        // SAFETY: loads the symbol's TLS offset from its GOT entry; no other effect.
        unsafe {
            std::arch::asm!(
                "mov {off}, qword ptr [rip + spulse_heap_bytes_left_{key}_in_a_rust_dylib_build_with_cfg_spulse_no_tls_slot@GOTTPOFF]",
                off = out(reg) off,
                key = const KEY,
                options(pure, readonly, nostack, preserves_flags)
            );
        }
        off
    }

    /// This thread's count.
    #[inline(always)]
    pub(crate) fn cell() -> *mut i64 {
        std::ptr::with_exposed_provenance_mut(super::thread_pointer().wrapping_add_signed(offset()))
    }
}

/// Run `f` on this thread's count.
#[inline]
pub(crate) fn with_left<R>(f: impl FnOnce(&Cell<i64>) -> R) -> R {
    #[cfg(all(
        target_arch = "x86_64",
        target_pointer_width = "64",
        target_os = "linux",
        target_env = "gnu",
        not(spulse_no_tls_slot)
    ))]
    {
        // The count lives as long as the thread and only this thread touches
        // it: through `Cell`s like this one (never borrowed, so a `Cell`
        // allows the fast path's writes through another pointer meanwhile),
        // the fast path's `asm!` and `sub`.
        // SAFETY: `slot::cell` is this thread's count, an `i64` in its static TLS block (see above).
        f(unsafe { &*(slot::cell() as *const Cell<i64>) })
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_pointer_width = "64",
        target_os = "linux",
        target_env = "gnu",
        not(spulse_no_tls_slot)
    )))]
    {
        BYTES_LEFT.with(f)
    }
}

/// Take `size` from this thread's count without its accessor, if that is
/// possible: `None` where the count is a `thread_local!` whose offset
/// `copy` does not hold yet (the caller then charges through
/// [`with_left`]); else the count left.
#[inline(always)]
pub(crate) fn try_sub(copy: &OffsetCopy, size: usize) -> Option<i64> {
    if SLOT {
        #[cfg(all(
            target_arch = "x86_64",
            target_pointer_width = "64",
            target_os = "linux",
            target_env = "gnu",
            not(spulse_no_tls_slot)
        ))]
        // SAFETY: `slot::offset` is the count's offset in every thread.
        return Some(unsafe { sub(slot::offset(), size) });
    }
    let off = copy.get();
    // SAFETY: a nonzero `OffsetCopy` is the count's offset from the thread pointer in every thread (`learn`, `OffsetCopy::refresh`).
    (off != 0).then(|| unsafe { sub(off, size) })
}

/// Take `$size` from this thread's count; if that reaches the pending
/// sample point, or the count cannot be reached without its accessor,
/// return `$cold` from the calling function, with `$charged` bound to
/// whether the bytes were taken. Where the count is [`slot`]'s, three
/// instructions and a jump to the return of `$cold` (an `asm!` label);
/// elsewhere [`try_sub`] and a test.
macro_rules! charge_or {
    ($copy:expr, $size:expr, |$charged:ident| $cold:expr) => {
        #[cfg(all(target_arch = "x86_64", target_pointer_width = "64", target_os = "linux", target_env = "gnu", not(spulse_no_tls_slot)))]
        {
            let off = $crate::heap::tls::slot::offset();
            // SAFETY: `off` is the count's offset from the thread pointer in every thread (`tls::slot`): the `sub` takes from this thread's own count; the label's block is entered when it went below 0.
            unsafe {
                std::arch::asm!(
                    "sub qword ptr fs:[{off}], {size}",
                    "js {cold}",
                    off = in(reg) off,
                    size = in(reg) $size,
                    cold = label {
                        let $charged = true;
                        return $cold;
                    },
                    options(nostack)
                );
            }
            let _ = &$copy;
        }
        #[cfg(not(all(target_arch = "x86_64", target_pointer_width = "64", target_os = "linux", target_env = "gnu", not(spulse_no_tls_slot))))]
        {
            let left = $crate::heap::tls::try_sub(&$copy, $size);
            if !left.is_some_and(|l| l >= 0) {
                let $charged = left.is_some();
                return $cold;
            }
        }
    };
}
pub(crate) use charge_or;

/// The count's offset from the thread pointer, the same in every thread; 0
/// while unknown or where it is not a constant (see the module doc).
static OFFSET: AtomicIsize = AtomicIsize::new(0);
/// [`learn`] ran (once a process).
static LOOKED: AtomicBool = AtomicBool::new(false);

/// The count's offset from the thread pointer, 0 if not known.
pub(crate) fn offset() -> isize {
    OFFSET.load(Ordering::Relaxed)
}

/// A copy of the learnt offset where the fast path reads it with one load:
/// a field of the allocator (usually a static of the program, reached
/// `%rip`-relative; the library's own static is reached through the GOT, a
/// load more). It only ever holds 0 or the learnt offset ([`OffsetCopy::refresh`]
/// is its only setter, and stores only a nonzero [`offset`]).
#[derive(Debug, Default)]
pub(crate) struct OffsetCopy(AtomicIsize);

impl OffsetCopy {
    pub(crate) const fn new() -> OffsetCopy {
        OffsetCopy(AtomicIsize::new(0))
    }

    /// The copy: 0, or the count's offset in every thread.
    #[inline(always)]
    pub(crate) fn get(&self) -> isize {
        self.0.load(Ordering::Relaxed)
    }

    /// Take the learnt offset, if it is known (0 is never stored: a thread
    /// that looked before another learnt it cannot undo that one's copy).
    #[cold]
    pub(crate) fn refresh(&self) {
        let learnt = offset();
        if learnt != 0 && self.get() == 0 {
            self.0.store(learnt, Ordering::Relaxed);
        }
    }
}

/// The targets where the offset is learnt: 64-bit x86-64 (not x32) and
/// aarch64 (elsewhere [`thread_pointer`] is 0 and nothing is learnt).
const SUPPORTED: bool =
    cfg!(all(any(target_arch = "x86_64", target_arch = "aarch64"), target_pointer_width = "64"));

/// This thread's thread pointer.
#[inline(always)]
fn thread_pointer() -> usize {
    let tp: usize;
    #[cfg(all(target_arch = "x86_64", target_pointer_width = "64"))]
    // SAFETY: reads the TCB's self-pointer at `fs:0` (the x86-64 TLS ABI),
    // which every thread has; no other effect.
    unsafe {
        std::arch::asm!("mov {}, qword ptr fs:[0]", out(reg) tp, options(nostack, readonly, preserves_flags, pure));
    }
    #[cfg(all(target_arch = "aarch64", target_pointer_width = "64"))]
    // SAFETY: reads the thread pointer register; no other effect.
    unsafe {
        std::arch::asm!("mrs {}, tpidr_el0", out(reg) tp, options(nostack, nomem, preserves_flags, pure));
    }
    #[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), target_pointer_width = "64")))]
    {
        tp = 0;
    }
    tp
}

/// Take `size` from the count at offset `off` from this thread's thread
/// pointer; the count left.
///
/// # Safety
///
/// `off` is a nonzero [`offset`] (or an [`OffsetCopy`] of it): the count's
/// offset in every thread.
#[inline(always)]
pub(crate) unsafe fn sub(off: isize, size: usize) -> i64 {
    // The cell's address is an integer here (the thread pointer plus a
    // constant, as the local-exec TLS model computes it); `learn` exposed the
    // learning thread's cell, and every thread's cell is reached through the
    // same integer arithmetic by the compiled accessor too.
    let p: *mut i64 = std::ptr::with_exposed_provenance_mut(thread_pointer().wrapping_add_signed(off));
    // SAFETY: the caller's contract: `p` is this thread's count, an `i64`
    // only this thread touches (a `Cell` of its own thread-local, never
    // borrowed mutably: `Cell` allows writes through another pointer).
    unsafe {
        let left = p.read().wrapping_sub(size as i64);
        p.write(left);
        left
    }
}

/// Learn the offset of this thread's count `count` (its thread-local's
/// address), once a process, if it is a constant: this code is part of the
/// main executable, on 64-bit x86-64 or aarch64, and the offset falls in the
/// executable's static TLS block (where a target emulates TLS, the count is
/// a block of its own per thread, elsewhere: then nothing is learnt).
/// Allocation-free and lock-free (the allocator's slow path calls it).
#[cold]
pub(crate) fn learn() {
    if LOOKED.load(Ordering::Relaxed) || LOOKED.swap(true, Ordering::Relaxed) {
        return;
    }
    if !SUPPORTED || SLOT {
        return;
    }
    let Some(tls) = executable_tls(learn as fn() as usize) else { return };
    let count = BYTES_LEFT.with(Cell::as_ptr);
    let off = count.expose_provenance().wrapping_sub(thread_pointer()) as isize;
    if off != 0 && in_static_block(off, tls) {
        OFFSET.store(off, Ordering::Relaxed);
    }
}

/// Whether `off` from the thread pointer lies in the main executable's
/// static TLS block of `memsz` bytes aligned to `align` (`tls`): below the
/// thread pointer on x86-64 (TLS variant II, the block ends at the thread
/// pointer, its start rounded to the alignment), above the 16-byte thread
/// control block on aarch64 (variant I, the block starts at 16 rounded up to
/// the alignment).
fn in_static_block(off: isize, (memsz, align): (u64, u64)) -> bool {
    let align = align.max(1);
    let span = memsz.saturating_add(align).min(isize::MAX as u64) as isize;
    if cfg!(target_arch = "x86_64") {
        (-span..0).contains(&off)
    } else {
        (16..16 + span).contains(&off)
    }
}

/// The size and alignment of the main executable's TLS segment, if `addr`
/// is in one of its loadable segments and it has one (its program headers,
/// from the auxiliary vector: no loader lock, no allocation). `None` also
/// where the headers have no `PT_PHDR` (GNU ld's static executables):
/// the accessor is then used as before.
fn executable_tls(addr: usize) -> Option<(u64, u64)> {
    const PT_LOAD: u32 = 1;
    const PT_PHDR: u32 = 6;
    const PT_TLS: u32 = 7;
    // SAFETY: getauxval only reads the auxiliary vector.
    let (phdr, phnum) = unsafe { (libc::getauxval(libc::AT_PHDR), libc::getauxval(libc::AT_PHNUM)) };
    if phdr == 0 || phnum == 0 || phnum > 4096 {
        return None;
    }
    // SAFETY: the kernel maps the executable's program headers at AT_PHDR,
    // AT_PHNUM of them, for the life of the process.
    let headers = unsafe { std::slice::from_raw_parts(phdr as *const libc::Elf64_Phdr, phnum as usize) };
    let own = headers.iter().find(|h| h.p_type == PT_PHDR)?;
    let bias = (phdr as usize).wrapping_sub(own.p_vaddr as usize);
    let tls = headers.iter().find(|h| h.p_type == PT_TLS)?;
    let holds = headers.iter().filter(|h| h.p_type == PT_LOAD).any(|h| {
        let start = bias.wrapping_add(h.p_vaddr as usize);
        addr >= start && addr - start < h.p_memsz as usize
    });
    holds.then_some((tls.p_memsz, tls.p_align))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests run in an executable that holds this code; libc's code is
    /// not the executable's. (`sampler.rs` tests the offset itself.)
    #[test]
    fn this_code_is_found_in_the_executable_and_libc_is_not() {
        assert!(executable_tls(learn as fn() as usize).is_some());
        assert!(executable_tls(libc::malloc as unsafe extern "C" fn(usize) -> *mut libc::c_void as usize)
            .is_none());
        assert!(executable_tls(0).is_none());
    }

    /// An offset outside the executable's static TLS block (a count
    /// allocated per thread elsewhere, as emulated TLS does) is not taken.
    #[test]
    fn only_an_offset_in_the_static_block_is_taken() {
        let tls = (0x200, 64);
        if cfg!(target_arch = "x86_64") {
            assert!(in_static_block(-0x60, tls));
            assert!(in_static_block(-0x240, tls));
            assert!(!in_static_block(-0x241, tls));
            assert!(!in_static_block(8, tls));
        } else {
            assert!(in_static_block(16, tls));
            assert!(in_static_block(0x200, tls));
            assert!(!in_static_block(8, tls));
            assert!(!in_static_block(0x1000, tls));
        }
        assert!(!in_static_block(0x7f00_0000_0000, tls), "a heap block far from the thread pointer");
        assert!(!in_static_block(-0x7f00_0000_0000, tls));
    }
}
