//! Installing, chaining to and restoring signal dispositions (`sigaction`).
//!
//! The previous disposition of each signal we sample with is kept in atomics,
//! so the handler can chain a foreign signal to it without a lock.

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use nix::sys::signal::Signal;

use crate::RecorderError;

/// The type of an `SA_SIGINFO` handler.
pub(crate) type Handler = extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void);

/// A saved previous disposition.
pub(crate) struct Prev {
    pub(crate) handler: AtomicUsize,
    pub(crate) flags: AtomicI32,
}

static PREV_TRAP: Prev = Prev { handler: AtomicUsize::new(libc::SIG_DFL), flags: AtomicI32::new(0) };
static PREV_PROF: Prev = Prev { handler: AtomicUsize::new(libc::SIG_DFL), flags: AtomicI32::new(0) };

pub(crate) fn previous_of(sig: c_int) -> Option<&'static Prev> {
    match sig {
        libc::SIGTRAP => Some(&PREV_TRAP),
        libc::SIGPROF => Some(&PREV_PROF),
        _ => None,
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
    let foreign = |h: usize| h != ours && h != libc::SIG_DFL && h != libc::SIG_IGN;
    let refuse = |handler: usize| RecorderError::SignalInUse { signal: sig.as_str(), handler };
    // SAFETY: querying the disposition (null new action) has no effect.
    let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: `cur` is a valid out-pointer.
    if unsafe { libc::sigaction(sig as c_int, std::ptr::null(), &mut cur) } != 0 {
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
        if unsafe { libc::sigaction(sig as c_int, &action, std::ptr::null_mut()) } != 0 {
            return Err(RecorderError::EngineRefused {
                what: "installing the signal handler (sigaction)",
                source: std::io::Error::last_os_error(),
            });
        }
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
    // SAFETY: a zeroed sigaction is a valid out-parameter.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to an initialized action and an out-parameter; the
    // handler is async-signal-safe as documented in this module.
    if unsafe { libc::sigaction(sig as c_int, &action, &mut old) } != 0 {
        return Err(RecorderError::EngineRefused {
            what: "installing the signal handler (sigaction)",
            source: std::io::Error::last_os_error(),
        });
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
    let Some(prev) = previous_of(sig as c_int) else { return };
    // SAFETY: restoring a disposition we saved (SIG_DFL or SIG_IGN).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = prev.handler.load(Ordering::SeqCst);
        sa.sa_flags = prev.flags.load(Ordering::SeqCst);
        libc::sigaction(sig as c_int, &sa, std::ptr::null_mut());
    }
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

        // A handler installed between the query and the install is neither
        // overwritten nor lost: it is put back as it was and the install refused.
        set(libc::SIGPROF, libc::SIG_DFL, 0);
        let r = install_with(Signal::SIGPROF, ours, || set(libc::SIGPROF, late, libc::SA_SIGINFO));
        let e = r.expect_err("a handler installed concurrently must not be overwritten");
        assert!(
            matches!(e, RecorderError::SignalInUse { signal: "SIGPROF", handler } if handler == late),
            "{e}"
        );
        let now = disposition(libc::SIGPROF);
        assert_eq!(now.sa_sigaction, late);
        assert_ne!(now.sa_flags & libc::SA_SIGINFO, 0);

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
