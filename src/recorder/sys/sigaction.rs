//! Installing, chaining to and restoring signal dispositions (`sigaction`).
//!
//! The previous disposition of each signal we sample with is kept in atomics,
//! so the handler can chain a foreign signal to it without a lock.
//!
//! # Signals the program owns
//! A handler the program installed before ours is kept as the one we chain
//! to: the program's own signals of that number (a debugger's or a
//! breakpoint's SIGTRAP, another profiler's SIGPROF) still reach it, ours
//! (told apart by `si_code` and the magic value) never do. A handler the
//! program installs after ours would take our signals for its own (LLVM's
//! tools treat a SIGTRAP as a crash): where an interposer can see the
//! program's `sigaction` calls (the preload library exports `sigaction`,
//! `signal`, `bsd_signal` and `sysv_signal`), [`virtual_action`] keeps the
//! program's action as the one we chain to, and our handler stays in place;
//! the program reads back what it set. Without an interposer (a library
//! embedded in a program that calls `sigaction` itself) the writer sees the
//! change at its next tick and stops the engine that sends that signal,
//! saying so in `Stats::warnings`.

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};

/// The C library's `sigaction` as the recorder must call it: set by an
/// interposer that exports its own `sigaction` (the preload library), so the
/// recorder's own calls are not taken for the program's; 0 until then.
static REAL_SIGACTION: AtomicUsize = AtomicUsize::new(0);

/// The type of `sigaction(2)`'s C wrapper.
pub type SigactionFn = unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;

/// Route the recorder's own `sigaction` calls to `f` (see [`REAL_SIGACTION`]).
pub(crate) fn set_real_sigaction(f: SigactionFn) {
    REAL_SIGACTION.store(f as usize, Ordering::SeqCst);
}

/// `sigaction` as the C library does it (async-signal-safe: one atomic load,
/// then the system call wrapper).
///
/// # Safety
/// As `sigaction(2)`: `act` null or valid, `old` null or writable.
pub(crate) unsafe fn raw(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int {
    let f = REAL_SIGACTION.load(Ordering::Relaxed);
    if f == 0 {
        // SAFETY: the caller's contract.
        unsafe { libc::sigaction(sig, act, old) }
    } else {
        // SAFETY: only ever set from a `SigactionFn` by `set_real_sigaction`.
        let f: SigactionFn = unsafe { std::mem::transmute(f) };
        // SAFETY: the caller's contract.
        unsafe { f(sig, act, old) }
    }
}

/// `SA_RESTORER`: the C library sets it (and the trampoline) itself.
const SA_RESTORER: c_int = 0x0400_0000;

/// The signals 1..=64 of a `sigset_t` (the kernel's view of it).
fn mask_bits(set: &libc::sigset_t) -> u64 {
    // SAFETY: a glibc sigset_t is at least 8 bytes of plain integers, and
    // its first 64 bits are the kernel's signal mask.
    unsafe { std::ptr::read_unaligned(set as *const libc::sigset_t as *const u64) }
}

fn set_mask_bits(set: &mut libc::sigset_t, bits: u64) {
    // SAFETY: an all-zero sigset_t is a valid empty set.
    *set = unsafe { std::mem::zeroed() };
    // SAFETY: as in `mask_bits`: the first 8 bytes are the kernel's mask.
    unsafe { std::ptr::write_unaligned(set as *mut libc::sigset_t as *mut u64, bits) };
}

/// For an interposed `sigaction`: when our handler holds `sig`, the program's
/// new action (if any) becomes the one we chain to and the one it held
/// before is returned in `old`, as if ours were not there: `Some(0)`.
/// `None`: not a signal we sample with, or not ours now; the caller passes
/// the call on unchanged.
///
/// # Safety
/// As `sigaction(2)`: `act` null or valid, `old` null or writable.
pub(crate) unsafe fn virtual_action(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
    ours: usize,
) -> Option<c_int> {
    let prev = previous_of(sig)?;
    // SAFETY: a zeroed sigaction is a valid out-parameter of a query.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a query (null new action) into a valid out-pointer.
    if unsafe { raw(sig, std::ptr::null(), &mut cur) } != 0 || cur.sa_sigaction != ours {
        return None;
    }
    // SAFETY: the caller's contract: `act` is null or a valid action; it is
    // read before `old` is written, as sigaction(2) allows `act == old`.
    let new = unsafe { act.as_ref() }.map(|a| (a.sa_sigaction, a.sa_flags, mask_bits(&a.sa_mask)));
    // SAFETY: the caller's contract: `old` is null or writable.
    if let Some(o) = unsafe { old.as_mut() } {
        // SAFETY: a zeroed sigaction is a valid value to fill in.
        *o = unsafe { std::mem::zeroed() };
        o.sa_sigaction = prev.handler.load(Ordering::SeqCst);
        o.sa_flags = prev.flags.load(Ordering::SeqCst);
        set_mask_bits(&mut o.sa_mask, prev.mask.load(Ordering::SeqCst));
    }
    if let Some((handler, flags, mask)) = new {
        prev.mask.store(mask, Ordering::SeqCst);
        prev.flags.store(flags, Ordering::SeqCst);
        prev.handler.store(handler, Ordering::SeqCst);
    }
    Some(0)
}

/// Whether `ours` is the disposition of `sig` now.
pub(crate) fn holds(sig: c_int, ours: usize) -> bool {
    // SAFETY: a zeroed sigaction is a valid out-parameter of a query.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a query (null new action) into a valid out-pointer.
    unsafe { raw(sig, std::ptr::null(), &mut cur) == 0 && cur.sa_sigaction == ours }
}

use nix::sys::signal::Signal;

use crate::RecorderError;

/// The type of an `SA_SIGINFO` handler.
pub(crate) type Handler = extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void);

/// A saved previous disposition.
pub(crate) struct Prev {
    pub(crate) handler: AtomicUsize,
    pub(crate) flags: AtomicI32,
    /// Its `sa_mask` (signals 1..=64), blocked while it runs.
    pub(crate) mask: AtomicU64,
}

static PREV_TRAP: Prev =
    Prev { handler: AtomicUsize::new(libc::SIG_DFL), flags: AtomicI32::new(0), mask: AtomicU64::new(0) };
static PREV_PROF: Prev =
    Prev { handler: AtomicUsize::new(libc::SIG_DFL), flags: AtomicI32::new(0), mask: AtomicU64::new(0) };

pub(crate) fn previous_of(sig: c_int) -> Option<&'static Prev> {
    match sig {
        libc::SIGTRAP => Some(&PREV_TRAP),
        libc::SIGPROF => Some(&PREV_PROF),
        _ => None,
    }
}

/// Install our handler for `sig`. Returns whether it was installed by this call
/// (false: it was already ours from an earlier recorder). A handler the
/// program installed before is kept as the one foreign signals are chained to.
///
/// The disposition our handler chains to is the old action returned by the very
/// `sigaction` call that installs ours, so nothing installed between a query and
/// the install is lost.
pub(crate) fn install(sig: Signal, ours: Handler) -> Result<bool, RecorderError> {
    install_with(sig, ours, || {})
}

/// [`install`], running `between` after the query and before the install (tests
/// use it to install a handler in that window).
fn install_with(sig: Signal, ours: Handler, between: impl FnOnce()) -> Result<bool, RecorderError> {
    let Some(prev) = previous_of(sig as c_int) else {
        return Err(RecorderError::EngineRefused {
            what: "installing a handler for a signal spulse does not sample with",
            source: std::io::Error::from_raw_os_error(libc::EINVAL),
        });
    };
    let ours = ours as usize;
    // SAFETY: querying the disposition (null new action) has no effect.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: `cur` is a valid out-pointer.
    if unsafe { raw(sig as c_int, std::ptr::null(), &mut cur) } != 0 {
        return Err(RecorderError::EngineRefused {
            what: "querying the signal disposition (sigaction)",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: a zeroed sigaction is a valid value to fill in.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = ours;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
    // SAFETY: sigemptyset initializes the mask we pass.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    if cur.sa_sigaction == ours {
        if cur.sa_flags & libc::SA_SIGINFO != 0 {
            return Ok(false);
        }
        // Our handler, put back by someone with `signal()` (no SA_SIGINFO): on
        // aarch64 the kernel then passes no siginfo or ucontext pointers at all
        // (x86_64 passes them regardless). Install it again as it must be; the
        // disposition saved for chaining stays the one from before ours.
        // SAFETY: a valid pointer to an initialized action; the handler is
        // async-signal-safe as documented in the handler module.
        if unsafe { raw(sig as c_int, &action, std::ptr::null_mut()) } != 0 {
            return Err(RecorderError::EngineRefused {
                what: "installing the signal handler (sigaction)",
                source: std::io::Error::last_os_error(),
            });
        }
        return Ok(false);
    }
    // Until the install returns the old action, foreign signals that reach our
    // handler are passed to what the query found.
    prev.mask.store(mask_bits(&cur.sa_mask), Ordering::SeqCst);
    prev.flags.store(cur.sa_flags, Ordering::SeqCst);
    prev.handler.store(cur.sa_sigaction, Ordering::SeqCst);
    between();
    // SAFETY: a zeroed sigaction is a valid out-parameter.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to an initialized action and an out-parameter; the
    // handler is async-signal-safe as documented in this module.
    if unsafe { raw(sig as c_int, &action, &mut old) } != 0 {
        return Err(RecorderError::EngineRefused {
            what: "installing the signal handler (sigaction)",
            source: std::io::Error::last_os_error(),
        });
    }
    if old.sa_sigaction != ours {
        prev.mask.store(mask_bits(&old.sa_mask), Ordering::SeqCst);
        prev.flags.store(old.sa_flags, Ordering::SeqCst);
        prev.handler.store(old.sa_sigaction, Ordering::SeqCst);
    }
    Ok(old.sa_sigaction != ours)
}

/// Put back the disposition saved by [`install`] (only after a failed start).
pub(crate) fn restore(sig: Signal) {
    let Some(prev) = previous_of(sig as c_int) else { return };
    // SAFETY: a zeroed sigaction is a valid value to fill in.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = prev.handler.load(Ordering::SeqCst);
    sa.sa_flags = prev.flags.load(Ordering::SeqCst) & !SA_RESTORER;
    set_mask_bits(&mut sa.sa_mask, prev.mask.load(Ordering::SeqCst));
    // SAFETY: restoring a disposition we saved, through the C library (which
    // supplies its own restorer).
    unsafe { raw(sig as c_int, &sa, std::ptr::null_mut()) };
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

    // Two test handlers that never run. They call different functions so the
    // optimizer cannot fold them into one address (empty bodies would be).
    extern "C" fn ours(_: c_int, _: *mut libc::siginfo_t, _: *mut c_void) {
        // SAFETY: getpid has no preconditions.
        unsafe { libc::getpid() };
    }

    extern "C" fn late(_: c_int, _: *mut libc::siginfo_t, _: *mut c_void) {
        // SAFETY: getppid has no preconditions.
        unsafe { libc::getppid() };
    }

    /// SIGPROF only (no other unit test touches it); one test, so the steps
    /// cannot interleave.
    #[test]
    fn install_uses_the_old_action_the_installing_call_returns() {
        let ours_addr = ours as Handler as usize;
        let late = late as extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) as usize;
        let saved = disposition(libc::SIGPROF);

        // A handler installed between the query and the install is not lost:
        // it is what foreign signals are chained to, with its flags.
        set(libc::SIGPROF, libc::SIG_DFL, 0);
        let r = install_with(Signal::SIGPROF, ours, || set(libc::SIGPROF, late, libc::SA_SIGINFO));
        assert!(matches!(r, Ok(true)));
        assert_eq!(disposition(libc::SIGPROF).sa_sigaction, ours_addr);
        assert_eq!(PREV_PROF.handler.load(Ordering::SeqCst), late);
        assert_ne!(PREV_PROF.flags.load(Ordering::SeqCst) & libc::SA_SIGINFO, 0);
        // The program installs its own while ours holds the signal: through an
        // interposer it is kept to chain to, and read back as set.
        // SAFETY: zeroed actions are valid; the pointers are to locals.
        unsafe {
            let mut mine: libc::sigaction = std::mem::zeroed();
            mine.sa_sigaction = libc::SIG_IGN;
            libc::sigemptyset(&mut mine.sa_mask);
            libc::sigaddset(&mut mine.sa_mask, libc::SIGUSR1);
            let mut before: libc::sigaction = std::mem::zeroed();
            assert_eq!(virtual_action(libc::SIGPROF, &mine, &mut before, ours_addr), Some(0));
            assert_eq!(before.sa_sigaction, late);
            let mut back: libc::sigaction = std::mem::zeroed();
            assert_eq!(virtual_action(libc::SIGPROF, std::ptr::null(), &mut back, ours_addr), Some(0));
            assert_eq!(back.sa_sigaction, libc::SIG_IGN);
            assert_eq!(libc::sigismember(&back.sa_mask, libc::SIGUSR1), 1);
            // Not ours (another address): passed on.
            assert_eq!(virtual_action(libc::SIGPROF, std::ptr::null(), &mut back, late), None);
            // A signal we never sample with: passed on.
            assert_eq!(virtual_action(libc::SIGUSR2, std::ptr::null(), &mut back, ours_addr), None);
        }
        assert_eq!(disposition(libc::SIGPROF).sa_sigaction, ours_addr);

        // SIG_IGN set in the same window is what we chain to (the query saw DFL).
        set(libc::SIGPROF, libc::SIG_DFL, 0);
        assert!(matches!(
            install_with(Signal::SIGPROF, ours, || set(libc::SIGPROF, libc::SIG_IGN, 0)),
            Ok(true)
        ));
        assert_eq!(disposition(libc::SIGPROF).sa_sigaction, ours_addr);
        assert_eq!(PREV_PROF.handler.load(Ordering::SeqCst), libc::SIG_IGN);
        // Already ours: nothing changes.
        assert!(matches!(install(Signal::SIGPROF, ours), Ok(false)));
        assert_eq!(PREV_PROF.handler.load(Ordering::SeqCst), libc::SIG_IGN);

        restore(Signal::SIGPROF);
        assert_eq!(disposition(libc::SIGPROF).sa_sigaction, libc::SIG_IGN);
        // SAFETY: restoring the disposition the test started with.
        unsafe { libc::sigaction(libc::SIGPROF, &saved, std::ptr::null_mut()) };
    }
}
