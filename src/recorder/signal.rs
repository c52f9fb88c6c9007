//! All signal-handler code: installing and chaining the handler, the handler
//! itself, the registers it reads from the `ucontext`, the stack bounds it trusts,
//! and the lock-free publication of the state and module snapshots it reads.
//!
//! # What the handler may do
//! It saves and restores `errno`; it takes no lock (the ring and the cache pool
//! are claimed with one CAS each, and a failed claim drops the sample and counts
//! it); it never allocates (ring slots and caches are allocated at start, framehop
//! runs with `MustNotAllocateDuringUnwind`); it calls only `clock_gettime`
//! (vDSO), `pthread_self` (reads the thread pointer), `__errno_location`,
//! `syscall(SYS_gettid)` (only if the TCB probe below failed; otherwise the
//! thread id is read from glibc's `struct pthread`) and, for foreign signals,
//! `sigaction`/`tgkill`; the executable is linked with full
//! RELRO (`-z now`, rustc's default on Linux) and every one of these functions is
//! called once before the handler is installed, so no PLT slot is resolved by the
//! dynamic loader inside the handler. It uses no Rust thread-local. It never
//! panics by construction, in every build profile of a dependent crate
//! (overflow checks on or off): slice accesses are bounded by checks, our
//! arithmetic is wrapping or checked, and framehop is handed only unwind tables
//! whose every step it performs with checked arithmetic (`cfi_check.rs` gives
//! the argument, line by line through framehop and gimli). An `extern "C"`
//! function aborts rather than unwinding out of a signal frame. The handler runs on the
//! interrupted thread's own stack (no `SA_ONSTACK`: Rust's 8 KiB alternate
//! stacks are too small for the ~17 KiB the unwinder needs).
//!
//! # Which stack memory is read (proven mapped)
//! Only 8-byte-aligned words in `[sp, top)` of the interrupted thread's own stack:
//! * non-main threads: glibc places `struct pthread` at the top of the thread's
//!   stack block and records the block (`stackblock`, `stackblock_size`,
//!   `guardsize`) in it. The offset of those fields is found once at start by
//!   [`probe_tcb_stack_offset`] on two probe threads whose stacks
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
//! `SIGTRAP` with `si_code == TRAP_PERF` and `si_perf_data == MAGIC` (the
//! `sig_data` our perf events carry); `SIGPROF` with `si_code == SI_TIMER` and
//! `si_value == MAGIC` (our per-thread timers); `SIGPROF` with `si_code ==
//! SI_KERNEL` once our process timer was ever armed. Anything else is chained to
//! the old action returned by the `sigaction` call that installed the handler
//! (not one queried earlier, which another thread could have replaced in
//! between). Our signals arriving when
//! no recorder runs (pending strays after stop, or in a forked child) are ignored:
//! the handler stays installed after stop for exactly that reason, since the
//! default action of both signals kills the process.

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

use nix::sys::signal::Signal;

use super::modules::UnwindSnapshot;
use super::ring::HEADER_WORDS;
use super::unwind::{unwind_into, Regs};
use super::Shared;

/// The value our perf events and timers carry in their signal information.
pub(crate) const MAGIC: u64 = 0x5350_554c_5345_0001;

/// The running recorder's state, or null.
static STATE: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
/// Handlers currently between loading `STATE` and their last use of it.
static IN_HANDLER: AtomicUsize = AtomicUsize::new(0);
/// Set once the process timer was armed: `SI_KERNEL` SIGPROFs are ours from then on.
static PROCESS_TIMER_USED: AtomicBool = AtomicBool::new(false);

/// Benchmark instrumentation (the `testing` feature only): when on, each of
/// our signals adds its handler time (entry to exit, read with [`bench_ticks`])
/// to a fixed histogram.
#[cfg(feature = "testing")]
static TIMING: AtomicBool = AtomicBool::new(false);
/// Width of a histogram bucket.
#[cfg(feature = "testing")]
pub(crate) const TIMING_BUCKET_NS: u64 = 20;
/// Buckets (the last one collects everything slower).
#[cfg(feature = "testing")]
pub(crate) const TIMING_BUCKETS: usize = 2048;
#[cfg(feature = "testing")]
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
#[cfg(feature = "testing")]
static TIMING_HIST: [std::sync::atomic::AtomicU64; TIMING_BUCKETS] = [ZERO; TIMING_BUCKETS];

/// Nanoseconds per tick of [`bench_ticks`], as a 32.32 fixed-point number.
#[cfg(feature = "testing")]
static TICK_NS_Q32: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1 << 32);

/// Turn handler timing on or off. Turning it on calibrates the tick counter
/// against `CLOCK_MONOTONIC` (about 20 ms).
#[cfg(feature = "testing")]
pub(crate) fn set_timing(on: bool) {
    if on {
        let (t0, n0) = (bench_ticks(), mono_ns());
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (t1, n1) = (bench_ticks(), mono_ns());
        let ticks = t1.wrapping_sub(t0).max(1) as u128;
        let q32 = ((n1.wrapping_sub(n0) as u128) << 32) / ticks;
        TICK_NS_Q32.store(q32.min(u64::MAX as u128) as u64, Ordering::SeqCst);
    }
    TIMING.store(on, Ordering::SeqCst);
}

/// The clock of the handler-time histogram. On x86_64 the time-stamp counter:
/// reading it costs a few nanoseconds, where `clock_gettime` costs 40-120 ns in
/// the handler (cold vDSO data) and that cost would be counted as the handler's.
#[cfg(feature = "testing")]
#[inline(always)]
fn bench_ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `rdtsc` exists on every x86_64 CPU, reads a counter and has
        // no memory effects.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        mono_ns()
    }
}

/// Take (and reset) the handler-time histogram.
#[cfg(feature = "testing")]
pub(crate) fn take_timing() -> Vec<u64> {
    TIMING_HIST.iter().map(|b| b.swap(0, Ordering::Relaxed)).collect()
}

#[inline]
fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass (vDSO, async-signal-safe).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// A saved previous disposition.
struct Prev {
    handler: AtomicUsize,
    flags: AtomicI32,
}

static PREV_TRAP: Prev = Prev { handler: AtomicUsize::new(libc::SIG_DFL), flags: AtomicI32::new(0) };
static PREV_PROF: Prev = Prev { handler: AtomicUsize::new(libc::SIG_DFL), flags: AtomicI32::new(0) };

fn prev_for(sig: c_int) -> Option<&'static Prev> {
    match sig {
        libc::SIGTRAP => Some(&PREV_TRAP),
        libc::SIGPROF => Some(&PREV_PROF),
        _ => None,
    }
}

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

/// How many sample intervals a signal stands for, or `None` if it is not ours.
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
        libc::SIGTRAP if si.code == libc::TRAP_PERF && si.u1 == MAGIC => Some(1),
        libc::SIGPROF if si.code == libc::SI_TIMER && si.u1 == MAGIC => {
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
    // SAFETY: see above.
    let saved = unsafe { *errno };
    // SAFETY: `info` comes from the kernel (SA_SIGINFO).
    match unsafe { classify(sig, info) } {
        Some(weight) => {
            #[cfg(feature = "testing")]
            let t0 = if TIMING.load(Ordering::Relaxed) { bench_ticks() } else { 0 };
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
            if t0 != 0 {
                let ticks = bench_ticks().wrapping_sub(t0) as u128;
                let ns = (ticks * TICK_NS_Q32.load(Ordering::Relaxed) as u128) >> 32;
                let bucket = (ns / TIMING_BUCKET_NS as u128).min(TIMING_BUCKETS as u128) as usize;
                if let Some(b) = TIMING_HIST.get(bucket.min(TIMING_BUCKETS - 1)) {
                    b.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // SAFETY: the arguments are the kernel's, passed on unchanged.
        None => unsafe { chain(sig, info, ctx) },
    }
    // SAFETY: as above.
    unsafe { *errno = saved };
}

/// Pass a foreign signal to the disposition that was in place before ours.
///
/// # Safety
/// Arguments as received by the handler.
unsafe fn chain(sig: c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    let Some(prev) = prev_for(sig) else { return };
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
            libc::sigaction(sig, &sa, std::ptr::null_mut());
            libc::syscall(libc::SYS_tgkill, libc::getpid(), gettid() as c_int, sig);
        }
        return;
    }
    if flags & libc::SA_SIGINFO != 0 {
        // SAFETY: the saved handler was installed with SA_SIGINFO, so it has this type.
        let f: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) =
            unsafe { std::mem::transmute(handler) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a handler installed without SA_SIGINFO takes the signal number only.
        let f: extern "C" fn(c_int) = unsafe { std::mem::transmute(handler) };
        f(sig);
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
    let Some(mut cache) = st.caches.claim(tid as usize) else {
        c.lost_no_cache.fetch_add(weight as u64, Ordering::Relaxed);
        return;
    };
    let Some(mut claim) = st.ring.claim() else {
        c.lost_ring_full.fetch_add(weight as u64, Ordering::Relaxed);
        return;
    };
    // SAFETY: the kernel's ucontext for this signal.
    let Some(regs) = (unsafe { regs_of(ctx) }) else {
        c.lost_unwind_failed.fetch_add(weight as u64, Ordering::Relaxed);
        return; // the claim is published void on drop
    };
    let time_us = now_us();
    // SAFETY: the snapshot pointer always holds a live snapshot while STATE is
    // published (see `SnapshotCell`); old ones are freed only when no handler runs.
    let snap = unsafe { &*st.snapshot.ptr.load(Ordering::SeqCst) };
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
    if depth == 0 {
        c.lost_unwind_failed.fetch_add(weight as u64, Ordering::Relaxed);
        return;
    }
    if truncated {
        c.truncated.fetch_add(1, Ordering::Relaxed);
    }
    claim.publish(time_us, tid, weight, snap.generation, depth, truncated);
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

/// The calling thread's kernel id.
#[inline]
pub(crate) fn gettid() -> u32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

/// Unix time in microseconds (vDSO clock_gettime: no lock, no allocation).
#[inline]
pub(crate) fn now_us() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000).wrapping_add(ts.tv_nsec as u64 / 1000)
}

/// Call every function the handler uses once, so that nothing is left for the
/// dynamic loader to resolve when the handler first runs.
fn prime() {
    let _ = gettid();
    let _ = now_us();
    let _ = mono_ns();
    // SAFETY: trivial libc calls.
    unsafe {
        let _ = libc::pthread_self();
        let _ = libc::getpid();
        let _ = *libc::__errno_location();
        libc::syscall(libc::SYS_tgkill, -1, -1, 0);
        libc::sigaction(libc::SIGPROF, std::ptr::null(), std::ptr::null_mut());
    }
}

/// Install our handler for `sig`. Returns whether it was installed by this call
/// (false: it was already ours from an earlier recorder). Refuses when another
/// handler owns the signal.
///
/// The disposition our handler chains to is the old action returned by the very
/// `sigaction` call that installs ours, so nothing installed between a query and
/// the install is lost. If that old action turns out to be someone else's
/// handler (installed concurrently by another thread), it is put back exactly
/// as it was and the install is refused, as if it had been there all along.
pub(crate) fn install(sig: Signal) -> Result<bool, String> {
    install_with(sig, || {})
}

/// [`install`], running `between` after the query and before the install (tests
/// use it to install a handler in that window).
fn install_with(sig: Signal, between: impl FnOnce()) -> Result<bool, String> {
    prime();
    let Some(prev) = prev_for(sig as c_int) else {
        return Err(format!("{sig} is not a signal spulse samples with"));
    };
    let ours = on_signal as extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) as usize;
    let foreign = |h: usize| h != ours && h != libc::SIG_DFL && h != libc::SIG_IGN;
    let refuse = |h: usize| {
        format!(
            "{sig} is already handled by another signal handler (at {h:#x}); spulse does not take over \
             a signal someone else owns"
        )
    };
    // SAFETY: querying the disposition (null new action) has no effect.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: `cur` is a valid out-pointer.
    if unsafe { libc::sigaction(sig as c_int, std::ptr::null(), &mut cur) } != 0 {
        return Err(format!("cannot query the disposition of {sig}: {}", std::io::Error::last_os_error()));
    }
    if cur.sa_sigaction == ours {
        return Ok(false);
    }
    if foreign(cur.sa_sigaction) {
        return Err(refuse(cur.sa_sigaction));
    }
    // Until the install returns the old action, foreign signals that reach our
    // handler are passed to what the query found.
    prev.handler.store(cur.sa_sigaction, Ordering::SeqCst);
    prev.flags.store(cur.sa_flags, Ordering::SeqCst);
    between();
    // SAFETY: a zeroed sigaction is a valid value to fill in.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = ours;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
    // SAFETY: sigemptyset initializes the mask we pass.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    // SAFETY: a zeroed sigaction is a valid out-parameter.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to an initialized action and an out-parameter; the
    // handler is async-signal-safe as documented in this module.
    if unsafe { libc::sigaction(sig as c_int, &action, &mut old) } != 0 {
        return Err(format!("cannot install the {sig} handler: {}", std::io::Error::last_os_error()));
    }
    if foreign(old.sa_sigaction) {
        // SAFETY: putting back, unchanged, the action the kernel just returned.
        unsafe { libc::sigaction(sig as c_int, &old, std::ptr::null_mut()) };
        return Err(refuse(old.sa_sigaction));
    }
    if old.sa_sigaction != ours {
        prev.handler.store(old.sa_sigaction, Ordering::SeqCst);
        prev.flags.store(old.sa_flags, Ordering::SeqCst);
    }
    Ok(old.sa_sigaction != ours)
}

/// Put back the disposition saved by [`install`] (only after a failed start).
pub(crate) fn restore(sig: Signal) {
    let Some(prev) = prev_for(sig as c_int) else { return };
    // SAFETY: restoring a disposition we saved (SIG_DFL or SIG_IGN).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = prev.handler.load(Ordering::SeqCst);
        sa.sa_flags = prev.flags.load(Ordering::SeqCst);
        libc::sigaction(sig as c_int, &sa, std::ptr::null_mut());
    }
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
    for i in 0..20_000 {
        if IN_HANDLER.load(Ordering::SeqCst) == 0 {
            // SAFETY: `p` came from Arc::into_raw in `publish`; no handler can
            // load it any more (STATE is null) and none is still using it.
            return Some(unsafe { Arc::from_raw(p) });
        }
        if i < 100 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
    None
}

/// Whether no handler is between loading the state and its last use of it.
fn quiescent() -> bool {
    IN_HANDLER.load(Ordering::SeqCst) == 0
}

extern "C" fn after_fork_in_child() {
    // The child has no writer thread and must never write into the parent's
    // ring or spool: withdraw the state (the Arc is leaked in the child), and let
    // the child start a recorder of its own.
    STATE.store(std::ptr::null_mut(), Ordering::SeqCst);
    super::forget_parent_recorder_after_fork();
}

fn register_atfork() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a plain function that only stores an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
}

/// The handler's current module snapshot.
pub(crate) struct SnapshotCell {
    ptr: AtomicPtr<UnwindSnapshot>,
}

/// A replaced snapshot awaiting reclamation.
pub(crate) struct Retired(*mut UnwindSnapshot);

// SAFETY: the snapshot is immutable and owned solely by this handle.
unsafe impl Send for Retired {}

impl SnapshotCell {
    /// A cell holding `first`.
    pub(crate) fn new(first: Box<UnwindSnapshot>) -> SnapshotCell {
        SnapshotCell { ptr: AtomicPtr::new(Box::into_raw(first)) }
    }

    /// Generation of the current snapshot (writer side).
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
    if retired.is_empty() || !quiescent() {
        return;
    }
    for r in retired.drain(..) {
        // SAFETY: see above; `r.0` came from Box::into_raw and is owned by `r`.
        drop(unsafe { Box::from_raw(r.0) });
    }
}

impl Drop for Retired {
    fn drop(&mut self) {
        // A retired snapshot dropped without `reclaim` (shutdown with a handler
        // possibly still inside) is leaked on purpose.
    }
}

/// Find the offset of glibc's `stackblock`/`stackblock_size`/`guardsize` fields
/// in `struct pthread`, relative to `pthread_self()`, by inspecting two probe
/// threads with different stack sizes. `None` when the layout cannot be found
/// (another libc): then non-main threads record leaf-only samples.
pub(crate) fn probe_tcb_stack_offset() -> Option<usize> {
    let run = |size: usize| {
        std::thread::Builder::new()
            .name("spulse-probe".into())
            .stack_size(size)
            .spawn(probe_current)
            .ok()?
            .join()
            .ok()?
    };
    let a = run(256 << 10)?;
    let b = run(1 << 20)?;
    (a == b).then_some(a)
}

/// Find the offset of glibc's `tid` field in `struct pthread` (relative to
/// `pthread_self()`), so the handler can read its thread id from memory instead
/// of making a `gettid` system call (~200 ns on this VM). Checked on two probe
/// threads and on the calling thread; `None` if they disagree. (A thread made
/// by a raw `clone` without glibc would read its creator's id: its samples would
/// be attributed to that thread; stack bounds are checked against `sp` and stay
/// safe either way.)
pub(crate) fn probe_tcb_tid_offset() -> Option<usize> {
    let find = || -> Vec<usize> {
        let tid = gettid();
        // SAFETY: pthread_self only reads the thread pointer.
        let tcb = unsafe { libc::pthread_self() } as u64;
        let mut v = Vec::new();
        // glibc's struct pthread is well over 1 KiB and holds the tid in its
        // first kilobyte; the whole struct is mapped (it is this thread's TCB).
        for off in (0..1024u64).step_by(4) {
            // SAFETY: within this thread's own struct pthread (see above).
            let w = unsafe { std::ptr::read_volatile((tcb + off) as *const u32) };
            if w == tid {
                v.push(off as usize);
            }
        }
        v
    };
    let run = || std::thread::Builder::new().name("spulse-probe".into()).spawn(find).ok()?.join().ok();
    let (a, b, here) = (run()?, run()?, find());
    a.into_iter().find(|o| b.contains(o) && here.contains(o))
}

fn probe_current() -> Option<usize> {
    // SAFETY: standard pthread attribute queries on the calling thread; the attr
    // is initialized by pthread_getattr_np and destroyed afterwards.
    let (lo, size, tcb) = unsafe {
        let me = libc::pthread_self();
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(me, &mut attr) != 0 {
            return None;
        }
        let mut addr: *mut c_void = std::ptr::null_mut();
        let mut size: usize = 0;
        let r = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        if r != 0 {
            return None;
        }
        (addr as u64, size as u64, me as u64)
    };
    let hi = lo.checked_add(size)?;
    if !(lo < tcb && tcb < hi) {
        return None;
    }
    let mut off = 0u64;
    while tcb + off + 24 <= hi && off < 8192 {
        let p = (tcb + off) as *const u64;
        // SAFETY: [tcb, hi) is the top of this thread's own stack block (the TCB
        // and TLS glibc placed there), mapped and readable; reads are aligned
        // because the TCB is.
        let (block, bsize, guard) = unsafe {
            (std::ptr::read_volatile(p), std::ptr::read_volatile(p.add(1)), std::ptr::read_volatile(p.add(2)))
        };
        if block != 0
            && block.wrapping_add(guard) == lo
            && bsize.wrapping_sub(guard) == size
            && block.wrapping_add(bsize) >= tcb
        {
            return Some(off as usize);
        }
        off += 8;
    }
    None
}

/// The main thread's stack top and the span below it proven to be stack.
pub(crate) fn main_stack_bounds() -> (u64, u64) {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return (0, 0) };
    let mut prev_end = 0u64;
    for line in maps.lines() {
        let range = line.split_whitespace().next().unwrap_or("");
        let (a, b) = range.split_once('-').unwrap_or(("", ""));
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { continue };
        if line.ends_with("[stack]") {
            let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: getrlimit writes the struct we pass.
            unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut rl) };
            let limit = if rl.rlim_cur == libc::RLIM_INFINITY { 1u64 << 30 } else { rl.rlim_cur };
            let span = (end - prev_end.min(start)).min(limit.max(end - start));
            return (end, span);
        }
        prev_end = end;
    }
    (0, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disposition(sig: c_int) -> libc::sigaction {
        // SAFETY: querying (null new action) into a valid out-pointer.
        unsafe {
            let mut cur: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut cur);
            cur
        }
    }

    fn set(sig: c_int, handler: usize, flags: c_int) {
        // SAFETY: installing a plain disposition in this test process.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = handler;
            sa.sa_flags = flags;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }

    extern "C" fn late(_: c_int, _: *mut libc::siginfo_t, _: *mut c_void) {}

    /// SIGPROF only (no other unit test touches it); one test, so the steps
    /// cannot interleave.
    #[test]
    fn install_uses_the_old_action_the_installing_call_returns() {
        let ours = on_signal as extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) as usize;
        let late = late as extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) as usize;
        let saved = disposition(libc::SIGPROF);

        // A handler installed between the query and the install is neither
        // overwritten nor lost: it is put back as it was and the install refused.
        set(libc::SIGPROF, libc::SIG_DFL, 0);
        let r = install_with(Signal::SIGPROF, || set(libc::SIGPROF, late, libc::SA_SIGINFO));
        let msg = r.expect_err("a handler installed concurrently must not be overwritten");
        assert!(msg.contains("another signal handler"), "{msg}");
        let now = disposition(libc::SIGPROF);
        assert_eq!(now.sa_sigaction, late);
        assert_ne!(now.sa_flags & libc::SA_SIGINFO, 0);

        // SIG_IGN set in the same window is what we chain to (the query saw DFL).
        set(libc::SIGPROF, libc::SIG_DFL, 0);
        assert_eq!(install_with(Signal::SIGPROF, || set(libc::SIGPROF, libc::SIG_IGN, 0)), Ok(true));
        assert_eq!(disposition(libc::SIGPROF).sa_sigaction, ours);
        assert_eq!(PREV_PROF.handler.load(Ordering::SeqCst), libc::SIG_IGN);
        // Already ours: nothing changes.
        assert_eq!(install(Signal::SIGPROF), Ok(false));
        assert_eq!(PREV_PROF.handler.load(Ordering::SeqCst), libc::SIG_IGN);

        restore(Signal::SIGPROF);
        assert_eq!(disposition(libc::SIGPROF).sa_sigaction, libc::SIG_IGN);
        // SAFETY: restoring the disposition the test started with.
        unsafe { libc::sigaction(libc::SIGPROF, &saved, std::ptr::null_mut()) };
    }
}
