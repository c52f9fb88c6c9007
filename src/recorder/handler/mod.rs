//! Everything that runs in the signal handler, and only that: this folder is
//! the audited part of the recorder. `mod.rs` holds the handler itself (which
//! signals are ours, chaining foreign ones, the registers it reads from the
//! `ucontext`, the stack bounds it trusts) and the publication of the state it
//! reads; `ring.rs` the slot claim (handler -> writer queue); `unwind.rs` the
//! unwinder cache pool and the walk; `snapshot.rs` the module-snapshot cell and
//! its deferred reclamation; `shared.rs` the state and counters; `timing.rs` the
//! benchmark histogram of handler times; `names.rs` the thread names taken on
//! a thread's first sample. The raw system calls (installing the
//! handler with `sigaction`, the engines, probing the thread control block,
//! reading `/proc/self/maps`) live in `../sys/`; of those the handler calls only
//! `sys::gettid`, `sys::now_us`, `sys::sigaction::previous_of` (one system
//! call, one vDSO clock read, two atomic loads) and, for a foreign SIGTRAP,
//! `sys::sigmask::program_blocks_trap` (a thread-specific value).
//!
//! # What the handler may do
//! It saves and restores `errno`; it takes no lock (the ring and the cache pool
//! are claimed with one CAS each, and a failed claim drops the sample and counts
//! it); it never allocates (ring slots and caches are allocated at start, framehop
//! runs with `MustNotAllocateDuringUnwind`); it calls only `clock_gettime`
//! (vDSO), `pthread_self` (reads the thread pointer), `__errno_location`,
//! `prctl(PR_GET_NAME)` (once per thread, on its first sample),
//! `syscall(SYS_gettid)` (only if the TCB probe below failed; otherwise the
//! thread id is read from glibc's `struct pthread`) and, for foreign signals,
//! `sigaction`/`tgkill`, and for a foreign SIGTRAP `pthread_getspecific` (a
//! key below 32: a read of the thread control block), `getpid`,
//! `rt_tgsigqueueinfo` and `sigaddset` (see `defer_blocked_trap`), and, once the
//! ring is half full, `syscall(SYS_setpriority)` on the writer thread (once
//! until the writer gives the priority back: `WriterBoost`); the executable is linked with full
//! RELRO (`-z now`, rustc's default on Linux) and every one of these functions is
//! called once before the handler is installed, so no PLT slot is resolved by the
//! dynamic loader inside the handler. It uses no Rust thread-local. It never
//! panics by construction, in every build profile of a dependent crate
//! (overflow checks on or off): slice accesses are bounded by checks, our
//! arithmetic is wrapping or checked, and framehop only ever evaluates unwind
//! entries whose every step it performs with checked arithmetic: the others
//! are left out of the table it searches, or, where the executable's original
//! table is kept, the code they cover is left out of its module, so no lookup
//! reaches them (`cfi_check.rs` gives the argument, line by line through
//! framehop and gimli). An `extern "C"`
//! function aborts rather than unwinding out of a signal frame. The handler runs on the
//! interrupted thread's own stack (no `SA_ONSTACK`: Rust's 8 KiB alternate
//! stacks are too small for the ~17 KiB the unwinder needs).
//!
//! # Which stack memory is read (proven mapped)
//! Only 8-byte-aligned words in `[sp, top)` of the interrupted thread's own stack:
//! * non-main threads: glibc places `struct pthread` at the top of the thread's
//!   stack block and records the block (`stackblock`, `stackblock_size`,
//!   `guardsize`) in it. The offset of those fields is found once at start by
//!   `sys::tcb::stack_block_offset` on two probe threads whose stacks
//!   `pthread_getattr_np` reports. In the handler `pthread_self()` gives the
//!   TCB, the fields give the block, and the unwind may read `[sp, tcb)` only if
//!   `stackblock + guardsize <= sp < tcb`: that span is the thread's usable stack,
//!   mapped for the thread's whole life.
//! * the main thread (tid == pid): `top` is the end of `[stack]` in
//!   `/proc/self/maps` at start, and `sp` must lie within `span` below it, where
//!   `span` is the gap between `top` and the end of the next lower mapping at start,
//!   capped by `RLIMIT_STACK`; the kernel keeps that gap free (mmap_base lies at
//!   least RLIMIT_STACK below the stack), so `[sp, top)` is inside the stack VMA.
//! * any other `sp` (an alternate signal stack, a coroutine, a failed probe),
//!   or a thread with less than 32 KiB of stack left below `sp` (the unwinder
//!   itself needs ~17 KiB): nothing is read; the sample keeps its leaf pc and is
//!   marked truncated.
//!
//! # Which signals are ours
//! `SIGTRAP` with `si_code == TRAP_PERF` and `si_perf_data == SIGNAL_MAGIC` (the
//! `sig_data` our perf events carry); `SIGPROF` with `si_code == SI_TIMER` and
//! `si_value == SIGNAL_MAGIC` (our per-thread timers); `SIGPROF` with `si_code ==
//! SI_KERNEL` once our process timer was ever armed. Anything else is chained to
//! the old action returned by the `sigaction` call that installed the handler
//! (not one queried earlier, which another thread could have replaced in
//! between). Our signals arriving when
//! no recorder runs (pending strays after stop, or in a forked child) are ignored:
//! the handler stays installed after stop for exactly that reason, since the
//! default action of both signals kills the process.

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

use nix::sys::signal::Signal;

mod names;
pub(crate) mod ring;
mod shared;
mod snapshot;
#[cfg(feature = "testing")]
pub(crate) mod timing;
pub(crate) mod unwind;

pub(crate) use names::ThreadNames;
pub(crate) use shared::{Counters, Shared, StackBounds, WriterBoost};
pub(crate) use snapshot::{reclaim, Retired, SnapshotCell};

use crate::recorder::sys::{gettid, now_us, SIGNAL_MAGIC};
use crate::recorder::sys::{sigaction, sigmask};
use crate::RecorderError;
use ring::HEADER_WORDS;
use unwind::{unwind_into, Regs};

/// The running recorder's state, or null.
static STATE: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
/// Handlers currently between loading `STATE` and their last use of it.
static IN_HANDLER: AtomicUsize = AtomicUsize::new(0);
/// Set once the process timer was armed: `SI_KERNEL` SIGPROFs are ours from then on.
static PROCESS_TIMER_USED: AtomicBool = AtomicBool::new(false);

/// The first words of a `siginfo_t` on 64-bit Linux: three ints, padding, then the
/// union at offset 16 (`_timer`: tid, overrun, sigval; `_sigfault`: addr, then
/// `_perf`: data, type, flags).
#[repr(C)]
struct SigInfoHead {
    signo: c_int,
    errno: c_int,
    code: c_int,
    _pad: c_int,
    u0: u64,
    u1: u64,
}

/// How many sample intervals a signal stands for; `None` if the signal is not ours.
///
/// # Safety
/// `info` must be the siginfo pointer the kernel passed to an `SA_SIGINFO` handler.
#[inline]
unsafe fn classify(sig: c_int, info: *const libc::siginfo_t) -> Option<u32> {
    if info.is_null() {
        return None;
    }
    // SAFETY: the kernel's siginfo is 128 bytes, larger than SigInfoHead, and
    // suitably aligned; all fields are plain integers.
    let si = unsafe { &*(info as *const SigInfoHead) };
    match sig {
        libc::SIGTRAP if si.code == libc::TRAP_PERF && si.u1 == SIGNAL_MAGIC => Some(1),
        libc::SIGPROF if si.code == libc::SI_TIMER && si.u1 == SIGNAL_MAGIC => {
            let overrun = (si.u0 >> 32) as u32 as i32;
            Some(1u32.saturating_add(overrun.max(0) as u32))
        }
        libc::SIGPROF if si.code == libc::SI_KERNEL && PROCESS_TIMER_USED.load(Ordering::Relaxed) => Some(1),
        _ => None,
    }
}

extern "C" fn on_signal(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: __errno_location returns this thread's errno slot (initial-exec TLS,
    // always allocated); reading and writing it is what every C handler does.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: `errno` is this thread's errno slot, valid and aligned for the
    // thread's life; reading an int from it has no other effect.
    let saved = unsafe { *errno };
    // SAFETY: `info` comes from the kernel (SA_SIGINFO).
    match unsafe { classify(sig, info) } {
        Some(weight) => {
            #[cfg(feature = "testing")]
            let t0 = timing::begin();
            #[cfg(feature = "testing")]
            if timing::stop_after(timing::Phase::Classify) {
                timing::end(t0);
                // SAFETY: `errno` is this thread's errno slot (from __errno_location, valid
                // for the thread's life); restoring it undoes any change made since.
                unsafe { *errno = saved };
                return;
            }
            IN_HANDLER.fetch_add(1, Ordering::SeqCst);
            let st = STATE.load(Ordering::SeqCst);
            if !st.is_null() {
                // SAFETY: a non-null STATE is an `Arc<Shared>` leaked by `publish`;
                // `unpublish` frees it only after observing IN_HANDLER == 0 after
                // nulling STATE, and we incremented IN_HANDLER before loading it.
                let st = unsafe { &*st };
                // SAFETY: `ctx` is the kernel's ucontext for this signal.
                unsafe { record(st, weight, ctx) };
            }
            IN_HANDLER.fetch_sub(1, Ordering::SeqCst);
            #[cfg(feature = "testing")]
            timing::end(t0);
        }
        // SAFETY: the arguments are the kernel's.
        None if sig == libc::SIGTRAP && unsafe { defer_blocked_trap(info, ctx) } => {}
        // SAFETY: the arguments are the kernel's, passed on unchanged.
        None => unsafe { chain(sig, info, ctx) },
    }
    // SAFETY: `errno` is this thread's errno location, valid for the thread's
    // life; restoring it undoes any change made while the handler ran.
    unsafe { *errno = saved };
}

/// Set by [`defer_blocked_trap`]: a thread now really blocks SIGTRAP, so the
/// perf-event engine must stop (the writer does at its next tick).
static TRAP_DEFERRED: AtomicBool = AtomicBool::new(false);

/// Whether a SIGTRAP was left pending for a thread that blocks it (the
/// writer then stops the perf-event engine; see [`defer_blocked_trap`]).
pub(crate) fn trap_deferred() -> bool {
    TRAP_DEFERRED.load(Ordering::Relaxed)
}

/// A SIGTRAP that is not ours, sent by someone (`kill`, `tgkill`,
/// `sigqueue`: `si_code <= 0`) to a thread whose program blocks SIGTRAP
/// while its real mask does not (`sys/sigmask.rs`): without spulse it would
/// stay pending for the program's `sigwait` or `signalfd`, so make it so.
/// It is queued again to this thread with its own `siginfo` (it is blocked
/// while the handler runs), and SIGTRAP is added to the mask the thread
/// returns to, so it stays pending and blocked. From then on this thread
/// really blocks SIGTRAP and the engine's would stay pending for it too:
/// [`TRAP_DEFERRED`] tells the writer to stop the engine. Returns whether it
/// did all this (false: chain the signal as any other).
///
/// # Safety
/// Arguments as received by the handler.
unsafe fn defer_blocked_trap(info: *mut libc::siginfo_t, ctx: *mut c_void) -> bool {
    if info.is_null() || ctx.is_null() || !sigmask::program_blocks_trap() {
        return false;
    }
    // SAFETY: the kernel's siginfo (128 bytes; plain integers).
    let code = unsafe { (*info).si_code };
    // A fault or breakpoint (si_code > 0) is synchronous: blocked, the
    // kernel would have killed the process; chained, the program's
    // disposition decides, as it would.
    if code > 0 {
        return false;
    }
    // SAFETY: getpid and gettid are system calls; rt_tgsigqueueinfo to this
    // very thread with the kernel's siginfo (allowed for any si_code to the
    // caller's own process). All async-signal-safe.
    let rc = unsafe {
        libc::syscall(libc::SYS_rt_tgsigqueueinfo, libc::getpid(), gettid() as c_int, libc::SIGTRAP, info)
    };
    if rc != 0 {
        return false;
    }
    // SAFETY: the kernel's ucontext for this signal, writable: the mask the
    // thread gets back on return from the handler.
    unsafe { libc::sigaddset(&mut (*(ctx as *mut libc::ucontext_t)).uc_sigmask, libc::SIGTRAP) };
    TRAP_DEFERRED.store(true, Ordering::Relaxed);
    true
}

/// Pass a foreign signal to the disposition that was in place before ours.
///
/// # Safety
/// Arguments as received by the handler.
unsafe fn chain(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    let Some(prev) = sigaction::previous_of(sig) else { return };
    let handler = prev.handler.load(Ordering::Relaxed);
    let flags = prev.flags.load(Ordering::Relaxed);
    if handler == libc::SIG_IGN {
        return;
    }
    if handler == libc::SIG_DFL {
        // The default action of SIGTRAP and SIGPROF terminates the process:
        // restore it and re-raise; the signal is blocked while we run, so it is
        // delivered with the default action as soon as we return.
        // SAFETY: sigaction, getpid, gettid and tgkill are async-signal-safe syscalls.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = libc::SIG_DFL;
            sigaction::raw(sig, &sa, std::ptr::null_mut());
            libc::syscall(libc::SYS_tgkill, libc::getpid(), gettid() as c_int, sig);
        }
        return;
    }
    if flags & libc::SA_RESETHAND != 0 {
        // One-shot: the program's disposition is the default from now on.
        prev.handler.store(libc::SIG_DFL, Ordering::Relaxed);
        prev.flags.store(0, Ordering::Relaxed);
    }
    // The program's sa_mask, blocked while its handler runs, as the kernel
    // would have (the signal itself is blocked already, by our action).
    let mask = prev.mask.load(Ordering::Relaxed);
    let mut saved: u64 = 0;
    if mask != 0 {
        // SAFETY: rt_sigprocmask with 8-byte sets we own; async-signal-safe.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigprocmask,
                libc::SIG_BLOCK,
                &mask as *const u64,
                &mut saved as *mut u64,
                8,
            )
        };
    }
    if flags & libc::SA_SIGINFO != 0 {
        type SigInfoHandler = extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void);
        // SAFETY: the saved handler was installed with SA_SIGINFO, so it has this type.
        let f: SigInfoHandler = unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a handler installed without SA_SIGINFO takes the signal number only.
        let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
    }
    if mask != 0 {
        // SAFETY: as above: restores the mask saved before the call.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigprocmask,
                libc::SIG_SETMASK,
                &saved as *const u64,
                std::ptr::null_mut::<u64>(),
                8,
            )
        };
    }
}

/// Record one sample of the interrupted thread.
///
/// # Safety
/// `ctx` must be the ucontext the kernel passed with the signal.
#[inline]
unsafe fn record(st: &Shared, weight: u32, ctx: *mut c_void) {
    let c = &st.counters;
    c.signals.fetch_add(1, Ordering::Relaxed);
    let weight = if weight > st.weight_cap {
        c.overrun_capped.fetch_add((weight - st.weight_cap) as u64, Ordering::Relaxed);
        st.weight_cap
    } else {
        weight
    };
    let tid = match st.bounds.tcb_tid_offset {
        // SAFETY: the offset of the `tid` field of glibc's struct pthread, found
        // at start by `probe_tcb_tid_offset`; this thread's TCB is mapped.
        Some(off) => unsafe {
            std::ptr::read_volatile((libc::pthread_self() as u64).wrapping_add(off as u64) as *const u32)
        },
        None => gettid(),
    };
    if tid == st.writer_tid.load(Ordering::Relaxed) {
        return;
    }
    st.names.capture(tid);
    let Some(mut cache) = st.caches.claim(tid as usize) else {
        c.lost_no_cache.fetch_add(weight as u64, Ordering::Relaxed);
        return;
    };
    #[cfg(feature = "testing")]
    if timing::stop_after(timing::Phase::Claim) {
        return;
    }
    let Some(mut claim) = st.ring.claim() else {
        c.lost_ring_full.fetch_add(weight as u64, Ordering::Relaxed);
        st.writer_boost.request(st.writer_tid.load(Ordering::Relaxed));
        return;
    };
    if st.ring.half_full(&claim) {
        st.writer_boost.request(st.writer_tid.load(Ordering::Relaxed));
    }
    // SAFETY: the kernel's ucontext for this signal.
    let Some(regs) = (unsafe { regs_of(ctx) }) else {
        c.lost_unwind_failed.fetch_add(weight as u64, Ordering::Relaxed);
        return; // the claim is published void on drop
    };
    let time_us = now_us();
    #[cfg(feature = "testing")]
    if timing::stop_after(timing::Phase::Registers) {
        return;
    }
    // SAFETY: `st` is the published state and the caller counts in IN_HANDLER,
    // as `SnapshotCell::current` requires.
    let snap = unsafe { st.snapshot.current() };
    let (depth, truncated) = {
        let words = claim.words();
        let out = match words.get_mut(HEADER_WORDS..) {
            Some(o) => o,
            None => return,
        };
        match stack_range(st, tid, regs.sp) {
            Some((lo, hi)) => {
                let mut read = |addr: u64| read_stack_word(lo, hi, addr);
                unwind_into(&snap.unwinder, cache.cache(), &regs, &mut read, out)
            }
            None => {
                c.foreign_stack.fetch_add(1, Ordering::Relaxed);
                match out.first_mut() {
                    Some(w) => {
                        *w = regs.pc;
                        (1, true)
                    }
                    None => (0, true),
                }
            }
        }
    };
    #[cfg(feature = "testing")]
    if timing::stop_after(timing::Phase::Unwind) {
        return;
    }
    if depth == 0 {
        c.lost_unwind_failed.fetch_add(weight as u64, Ordering::Relaxed);
        return;
    }
    if truncated {
        c.truncated.fetch_add(1, Ordering::Relaxed);
    }
    let flags = if truncated { ring::FLAG_TRUNCATED } else { 0 };
    claim.publish(time_us, tid, weight, snap.generation, depth, flags);
}

/// The weight of the next kernel-time sample: 8 or 9, so that the first n
/// kernel samples of the recording weigh `n x kernel_weight_milli / 1000` in all.
/// (Called by the writer thread, which drains the kernel-time rings.)
pub(crate) fn kernel_weight(st: &Shared) -> u32 {
    let n = st.counters.kernel_signals.fetch_add(1, Ordering::Relaxed);
    let m = st.kernel_weight_milli;
    let w = (n.wrapping_add(1).wrapping_mul(m) / 1000).wrapping_sub(n.wrapping_mul(m) / 1000);
    w.min(u32::MAX as u64) as u32
}

/// Read one stack word, only inside `[lo, hi)` and 8-byte aligned.
#[inline]
fn read_stack_word(lo: u64, hi: u64, addr: u64) -> Result<u64, ()> {
    if addr & 7 != 0 || addr < lo || hi < 8 || addr > hi - 8 {
        return Err(());
    }
    // SAFETY: [lo, hi) is the interrupted thread's own mapped stack span, proven by
    // `stack_range` (see the module documentation); the word is inside it.
    Ok(unsafe { std::ptr::read_volatile(addr as *const u64) })
}

/// The readable stack span `[sp, top)` of the interrupted thread, if proven.
#[inline]
fn stack_range(st: &Shared, tid: u32, sp: u64) -> Option<(u64, u64)> {
    let b = &st.bounds;
    if tid == st.pid {
        let top = b.main_top;
        return (top != 0 && sp < top && top - sp <= b.main_span).then_some((sp, top));
    }
    let off = b.tcb_block_offset? as u64;
    // SAFETY: pthread_self only reads the thread pointer register.
    let tcb = unsafe { libc::pthread_self() } as u64;
    let field = tcb.checked_add(off)?;
    // SAFETY: `field .. field + 24` lies inside this thread's own `struct pthread`
    // (the probe found the fields at this offset below the top of the stack block,
    // and the TCB of a running thread is always mapped).
    let (block, _size, guard) = unsafe {
        let p = field as *const u64;
        (std::ptr::read_volatile(p), std::ptr::read_volatile(p.add(1)), std::ptr::read_volatile(p.add(2)))
    };
    let usable_lo = block.checked_add(guard)?;
    // The unwinder needs ~17 KiB of stack below the signal frame (gimli's
    // evaluation storage lives on the stack): on a thread with less left, take
    // the leaf only rather than overflow into the guard page.
    let room = sp.checked_sub(usable_lo)?;
    (block != 0 && room >= UNWIND_STACK_RESERVE && sp < tcb).then_some((sp, tcb))
}

/// Stack the handler wants left below the interrupted `sp` before it unwinds.
const UNWIND_STACK_RESERVE: u64 = 32 << 10;

/// Registers from the ucontext.
///
/// # Safety
/// `ctx` must be the kernel's ucontext pointer for the current signal (or null).
#[inline]
unsafe fn regs_of(ctx: *mut c_void) -> Option<Regs> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: the kernel passes a valid ucontext_t to SA_SIGINFO handlers.
    let uc = unsafe { &*(ctx as *const libc::ucontext_t) };
    #[cfg(target_arch = "x86_64")]
    {
        let g = &uc.uc_mcontext.gregs;
        Some(Regs {
            pc: g[libc::REG_RIP as usize] as u64,
            sp: g[libc::REG_RSP as usize] as u64,
            fp: g[libc::REG_RBP as usize] as u64,
            lr: 0,
        })
    }
    #[cfg(target_arch = "aarch64")]
    {
        // The pc comes from the context, not the link register; framehop gets
        // lr separately for leaf functions that have not saved it yet.
        let m = &uc.uc_mcontext;
        Some(Regs { pc: m.pc, sp: m.sp, fp: m.regs[29], lr: m.regs[30] })
    }
}

/// Call every function the handler uses once, so that nothing is left for the
/// dynamic loader to resolve when the handler first runs.
fn prime() {
    let _ = gettid();
    let _ = now_us();
    #[cfg(feature = "testing")]
    let _ = timing::mono_ns();
    // SAFETY: trivial libc calls.
    unsafe {
        let _ = libc::pthread_self();
        let _ = libc::getpid();
        let _ = *libc::__errno_location();
        libc::syscall(libc::SYS_tgkill, -1, -1, 0);
        let _ = sigmask::program_blocks_trap();
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigaddset(&mut set, libc::SIGTRAP);
        sigaction::raw(libc::SIGPROF, std::ptr::null(), std::ptr::null_mut());
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_BLOCK,
            std::ptr::null::<u64>(),
            std::ptr::null_mut::<u64>(),
            8,
        );
        let mut name = [0u8; 16];
        libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr() as libc::c_ulong, 0, 0, 0);
    }
}

/// Install the handler for `sig`; see [`sigaction::install`]. Every function the
/// handler calls is called once first ([`prime`]).
pub(crate) fn install(sig: Signal) -> Result<bool, RecorderError> {
    prime();
    let r = sigaction::install(sig, on_signal);
    if r.is_ok() && sig == Signal::SIGTRAP {
        // Threads must not block it from now on (under an interposer).
        TRAP_DEFERRED.store(false, Ordering::Relaxed);
        sigmask::set_active(true);
    }
    r
}

/// Put back the disposition saved by [`install`] (only after a failed start).
pub(crate) fn restore(sig: Signal) {
    if sig == Signal::SIGTRAP {
        sigmask::set_active(false);
    }
    sigaction::restore(sig)
}

/// Whether our handler is the disposition of `sig` now (a program may have
/// replaced it: see `sys/sigaction.rs`).
pub(crate) fn holds(sig: c_int) -> bool {
    sigaction::holds(sig, on_signal as sigaction::Handler as usize)
}

/// For an interposed `sigaction` (see `sys::sigaction::virtual_action`).
///
/// # Safety
/// As `sigaction(2)`: `act` null or valid, `old` null or writable.
pub(crate) unsafe fn virtual_action(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> Option<c_int> {
    // SAFETY: the caller's contract.
    unsafe { sigaction::virtual_action(sig, act, old, on_signal as sigaction::Handler as usize) }
}

/// The code a handler of ours returns through (the signal return trampoline),
/// as an address range: a kernel-time sample whose stack holds it was taken
/// while the kernel returned from our own handler. On x86_64 it is the
/// action's `sa_restorer` (glibc's `__restore_rt`); on aarch64, where glibc
/// sets no restorer, the vDSO's `__kernel_rt_sigreturn` (`sys::vdso`). `None`
/// where it cannot be found (no vDSO: qemu-user before 8.1 maps none).
pub(crate) fn return_trampoline() -> Option<(u64, u64)> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: querying (null new action) into a valid out-pointer.
        let cur = unsafe {
            let mut cur: libc::sigaction = std::mem::zeroed();
            sigaction::raw(libc::SIGTRAP, std::ptr::null(), &mut cur);
            cur
        };
        let r = cur.sa_restorer.map(|f| f as usize as u64)?;
        // __restore_rt is `mov $15, %rax; syscall` (9 bytes): 16 covers it.
        Some((r, r.wrapping_add(16)))
    }
    #[cfg(target_arch = "aarch64")]
    {
        let s = crate::recorder::sys::vdso::symbol("__kernel_rt_sigreturn")?;
        // It is `mov x8, #139; svc #0` (8 bytes): 16 covers it where the
        // image gives no size.
        let len = if s.size == 0 { 16 } else { s.size };
        Some((s.addr, s.addr.wrapping_add(len)))
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    None
}

/// From now on, `SI_KERNEL` SIGPROFs are ours.
pub(crate) fn mark_process_timer_used() {
    PROCESS_TIMER_USED.store(true, Ordering::SeqCst);
}

/// Make `shared` the state the handler records into.
pub(crate) fn publish(shared: Arc<Shared>) {
    register_atfork();
    let old = STATE.swap(Arc::into_raw(shared) as *mut Shared, Ordering::SeqCst);
    debug_assert!(old.is_null());
}

/// Withdraw the state from the handler and wait (briefly, yielding) until no
/// handler still uses it. Returns it, or `None` if none was published or a
/// handler never left (then it is leaked rather than freed under a reader).
pub(crate) fn unpublish() -> Option<Arc<Shared>> {
    let p = STATE.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if p.is_null() {
        return None;
    }
    for i in 0..UNPUBLISH_POLLS {
        if IN_HANDLER.load(Ordering::SeqCst) == 0 {
            // SAFETY: `p` came from Arc::into_raw in `publish`; no handler can
            // load it any more (STATE is null) and none is still using it.
            return Some(unsafe { Arc::from_raw(p) });
        }
        if i < UNPUBLISH_YIELDS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(UNPUBLISH_SLEEP);
        }
    }
    None
}

/// How often [`unpublish`] checks for handlers still inside. A handler runs for
/// microseconds; one that has not left after the ~2 s these polls span is stuck
/// (stopped by a debugger, or its thread frozen), and its state is leaked.
const UNPUBLISH_POLLS: u32 = 20_000;
/// The first polls only yield: a handler on another CPU leaves within them.
const UNPUBLISH_YIELDS: u32 = 100;
/// Later polls sleep, so a slow exit does not spin a CPU.
const UNPUBLISH_SLEEP: std::time::Duration = std::time::Duration::from_micros(100);

/// Slots the running recorder's ring has had claimed so far (`None`: no
/// recorder runs). Async-signal-safe: it enters as a handler does.
pub(crate) fn ring_claimed() -> Option<usize> {
    IN_HANDLER.fetch_add(1, Ordering::SeqCst);
    let st = STATE.load(Ordering::SeqCst);
    let claimed = if st.is_null() {
        None
    } else {
        // SAFETY: a non-null STATE is `publish`'s leaked Arc, freed by `unpublish` only after IN_HANDLER is seen at 0, and we counted ourselves in before loading it.
        let shared = unsafe { &*st };
        Some(shared.ring.claimed())
    };
    IN_HANDLER.fetch_sub(1, Ordering::SeqCst);
    claimed
}

/// Whether no handler is between loading the state and its last use of it.
pub(super) fn quiescent() -> bool {
    IN_HANDLER.load(Ordering::SeqCst) == 0
}

extern "C" fn after_fork_in_child() {
    // The child has no writer thread and must never write into the parent's
    // ring or spool: withdraw the state (the Arc is leaked in the child), and let
    // the child start a recorder of its own.
    STATE.store(std::ptr::null_mut(), Ordering::SeqCst);
    // The parent's count of handlers inside counted its other threads, which
    // the child does not have: a thread of the parent sampled at the fork
    // left it above 0 for good, and the child's own recorder then waited out
    // `unpublish`'s 2 s (twice: 3-5 s in `exit`). Only this thread runs here,
    // and it is not inside the handler (the handler never forks).
    IN_HANDLER.store(0, Ordering::SeqCst);
    #[cfg(feature = "heap")]
    crate::heap::events::after_fork();
    crate::recorder::forget_parent_recorder_after_fork();
    crate::recorder::sys::procfs::forget_after_fork();
    crate::recorder::sys::sigmask::own::reset();
}

fn register_atfork() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a plain function that only stores an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}
