//! SIGTRAP in the program's signal mask, while the perf-event engine samples
//! with it (under an interposer: the preload library exports
//! `pthread_sigmask` and `sigprocmask`).
//!
//! The perf-event engine's SIGTRAP goes to the thread it samples. A thread
//! that blocks SIGTRAP is not sampled, and the signal stays pending for it: a
//! program that blocks every signal and reads them (`sigwait`,
//! `sigtimedwait`, `signalfd` on a full set: the daemon pattern) would read
//! ours as its own. The events cannot be disabled for one thread (threads
//! created after start run inherited copies of one event), so instead the
//! thread's real mask never blocks SIGTRAP while our handler holds it:
//! [`virtual_mask`] removes SIGTRAP from what the program blocks, keeps a
//! per-thread "the program blocks SIGTRAP" flag, and reports SIGTRAP in the
//! old set while the flag is set, so the program reads back the mask it set.
//!
//! The flag lives in a POSIX thread-specific key created at load, used only
//! if it is one of glibc's first 32 keys: those are a plain array in the
//! thread control block, so `pthread_getspecific`/`pthread_setspecific` read
//! and write it without allocating or locking (a Rust thread-local in a
//! shared library goes through `__tls_get_addr`, which may allocate after a
//! `dlopen`), and the wrapper stays async-signal-safe as `pthread_sigmask` is.
//!
//! A thread created by `pthread_create` (interposed too) starts with its
//! creator's flag, as its mask is its creator's. A SIGTRAP sent by someone
//! else (`kill`, `tgkill`, `sigqueue`) to a thread whose flag is set reaches
//! our handler, which leaves it pending and blocked for the program
//! (`handler::defer_blocked_trap`; the perf-event engine then stops).
//!
//! Limits: masks set by raw system calls, by `sigsuspend`, `pselect`,
//! `ppoll`, `epoll_pwait` or a handler's `sa_mask`, or inherited across
//! `exec`, are not seen (the real mask is what the program set); threads
//! created by `clone` directly start with the flag clear.

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// No usable key.
const NO_KEY: u32 = u32::MAX;

/// The thread-specific key of the flag, or [`NO_KEY`].
static KEY: AtomicU32 = AtomicU32::new(NO_KEY);

/// Our handler holds SIGTRAP (the perf-event engine was installed).
static ACTIVE: AtomicBool = AtomicBool::new(false);

/// glibc keeps keys below this in the thread control block itself.
const INLINE_KEYS: u32 = 32;

/// Create the key (once; an interposer calls it at load). Whether the mask
/// can be virtualised.
pub(crate) fn enable() -> bool {
    if KEY.load(Ordering::SeqCst) != NO_KEY {
        return true;
    }
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: a valid out-pointer; no destructor.
    if unsafe { libc::pthread_key_create(&mut key, None) } != 0 {
        return false;
    }
    if key >= INLINE_KEYS {
        // SAFETY: the key we just created, used by nobody.
        unsafe { libc::pthread_key_delete(key) };
        return false;
    }
    KEY.store(key, Ordering::SeqCst);
    true
}

/// Our SIGTRAP handler was installed (`true`) or taken away again.
pub(crate) fn set_active(on: bool) {
    ACTIVE.store(on, Ordering::SeqCst);
}

fn key() -> Option<libc::pthread_key_t> {
    let k = KEY.load(Ordering::Relaxed);
    (k != NO_KEY).then_some(k)
}

/// Whether the program blocks SIGTRAP on this thread while its real mask
/// does not (async-signal-safe: a read of the thread control block).
pub(crate) fn program_blocks_trap() -> bool {
    // SAFETY: a key we created; below 32 it is a plain read of this thread's control block.
    key().is_some_and(|k| !unsafe { libc::pthread_getspecific(k) }.is_null())
}

/// Set this thread's flag: a thread starts with the flag of the thread that
/// created it (an interposed `pthread_create` calls this first thing in the
/// new thread), as its mask is the creator's.
pub(crate) fn inherit_blocks_trap() {
    if let Some(k) = key() {
        set_flag(k, true);
    }
}

fn set_flag(k: libc::pthread_key_t, on: bool) {
    let v = if on { std::ptr::dangling::<c_void>() } else { std::ptr::null() };
    // SAFETY: a key we created; below 32 it is a plain write of this thread's control block (cannot fail for a valid key).
    unsafe { libc::pthread_setspecific(k, v) };
}

/// The type of `pthread_sigmask` (and of `sigprocmask`, which returns -1
/// and sets `errno` instead of returning the error).
pub type MaskFn = unsafe extern "C" fn(c_int, *const libc::sigset_t, *mut libc::sigset_t) -> c_int;

/// For an interposed `pthread_sigmask`/`sigprocmask`: while our handler holds
/// SIGTRAP, call `real` with SIGTRAP taken out of what the program blocks
/// and its flag kept instead, and add SIGTRAP to `old` if the program blocked
/// it. `None`: not active, or an invalid `how` (which `real` refuses as it
/// should); the caller passes the call on unchanged. Otherwise `real`'s
/// return value.
///
/// # Safety
/// As `pthread_sigmask(3)`: `set` null or valid, `old` null or writable;
/// `real` is the C library's function.
pub(crate) unsafe fn virtual_mask(
    real: MaskFn,
    how: c_int,
    set: *const libc::sigset_t,
    old: *mut libc::sigset_t,
) -> Option<c_int> {
    if !ACTIVE.load(Ordering::Relaxed) {
        return None;
    }
    let k = key()?;
    let was = program_blocks_trap();
    let mut copy: libc::sigset_t;
    let mut p = set;
    // SAFETY: the caller's contract: `set` is null or valid; it is copied before `old` is written (they may be the same set).
    if let Some(s) = unsafe { set.as_ref() } {
        copy = *s;
        // SAFETY: a valid set we own or the caller's, SIGTRAP a valid signal.
        let traps = unsafe { libc::sigismember(s, libc::SIGTRAP) } == 1;
        let now = match how {
            libc::SIG_BLOCK => was || traps,
            libc::SIG_UNBLOCK => was && !traps,
            libc::SIG_SETMASK => traps,
            _ => return None,
        };
        // SAFETY: our copy.
        unsafe { libc::sigdelset(&mut copy, libc::SIGTRAP) };
        p = &copy;
        // Set before the real call: a SIGTRAP pending while the real mask
        // blocked it, delivered as the mask changes, must see the flag the
        // program asked for.
        set_flag(k, now);
    }
    // SAFETY: the caller's contract, with our copy of the set.
    let rc = unsafe { real(how, p, old) };
    if rc != 0 {
        set_flag(k, was);
        return Some(rc);
    }
    if was {
        // SAFETY: the caller's contract: `old`, when not null, was filled in.
        if let Some(o) = unsafe { old.as_mut() } {
            // SAFETY: a valid set.
            unsafe { libc::sigaddset(o, libc::SIGTRAP) };
        }
    }
    Some(0)
}

/// Spawn one of spulse's own threads (the writer, the probes, the `http`
/// endpoint's) with every signal blocked but the C library's two internal
/// ones (glibc's cancellation and `setxid` signals, 32 and 33: a thread
/// blocking `setxid`'s would hang the program's next `setuid`). A signal
/// sent to the process goes to one of its threads that does not block it:
/// before, a signal the program blocked in all its own threads to read with
/// `sigwait`, `sigtimedwait` or `signalfd` could go to the writer instead and
/// kill the process (SIGUSR1's default), and a handler of the program could
/// run on the writer. The mask is set in the calling thread around the
/// spawn (a new thread starts with its creator's mask, so no signal can
/// reach it before it could block them itself) and restored at once, by
/// raw system calls (no interposer in between).
pub(crate) fn spawn_quiet<F, T>(b: std::thread::Builder, f: F) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    // Bits are signal numbers less one; 32 and 33 stay open.
    let all: u64 = !((1u64 << 31) | (1u64 << 32));
    let mut old: u64 = 0;
    // SAFETY: rt_sigprocmask reads the 8-byte kernel set `all` and writes the old one into `old`; both live for the call. SIGKILL and SIGSTOP are never blocked (the kernel drops them from the set).
    let set = unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &all as *const u64,
            &mut old as *mut u64,
            8,
        )
    };
    let r = b.spawn(move || {
        let slot = own::enter(super::gettid());
        let out = f();
        own::leave(slot);
        out
    });
    if set == 0 {
        // SAFETY: as above; restores the caller's own mask.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigprocmask,
                libc::SIG_SETMASK,
                &old as *const u64,
                std::ptr::null_mut::<u64>(),
                8,
            )
        };
    }
    r
}

/// spulse's own threads (those [`spawn_quiet`] started), by thread id: the
/// off-CPU mode leaves their waits out (spulse never appears in its own
/// profiles; the `http` endpoint's threads, which wait for requests, did).
/// A fixed table of atomics: entered and left by the threads themselves,
/// read by the writer without a lock.
pub(crate) mod own {
    use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

    /// Slots: more than spulse ever runs at once (the writer, the probes,
    /// the endpoint's acceptor, window thread and connections). A thread
    /// that finds none free is simply not listed.
    const SLOTS: usize = 128;
    static TIDS: [AtomicU32; SLOTS] = [const { AtomicU32::new(0) }; SLOTS];
    /// One past the highest slot ever taken: the lookups read no further.
    static HIGH: AtomicUsize = AtomicUsize::new(0);

    /// List `tid`; the slot to [`leave`] (`None`: the table was full).
    pub(crate) fn enter(tid: u32) -> Option<usize> {
        let i = TIDS
            .iter()
            .position(|t| t.compare_exchange(0, tid, Ordering::AcqRel, Ordering::Relaxed).is_ok())?;
        HIGH.fetch_max(i + 1, Ordering::AcqRel);
        Some(i)
    }

    /// Unlist the thread of `slot`.
    pub(crate) fn leave(slot: Option<usize>) {
        if let Some(i) = slot {
            TIDS[i].store(0, Ordering::Release);
        }
    }

    /// Whether `tid` is one of spulse's own threads (running now).
    pub(crate) fn is_own(tid: u32) -> bool {
        let high = HIGH.load(Ordering::Acquire).min(SLOTS);
        tid != 0 && TIDS[..high].iter().any(|t| t.load(Ordering::Acquire) == tid)
    }

    /// Forget every thread listed (in a forked child, where none of them runs).
    pub(crate) fn reset() {
        for t in &TIDS {
            t.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn real_blocks_trap() -> bool {
        // SAFETY: a query into a valid out-set.
        unsafe {
            let mut cur: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut cur);
            libc::sigismember(&cur, libc::SIGTRAP) == 1
        }
    }

    /// On a thread of its own (the flag and mask are per thread).
    #[test]
    fn the_program_reads_back_sigtrap_while_the_real_mask_never_blocks_it() {
        std::thread::spawn(|| {
            assert!(enable());
            set_active(true);
            let real: MaskFn = libc::pthread_sigmask;
            // SAFETY: valid sets on this thread's stack; the C library's function.
            unsafe {
                let mut trap: libc::sigset_t = std::mem::zeroed();
                libc::sigaddset(&mut trap, libc::SIGTRAP);
                let mut old: libc::sigset_t = std::mem::zeroed();
                assert_eq!(virtual_mask(real, libc::SIG_BLOCK, &trap, &mut old), Some(0));
                assert_eq!(libc::sigismember(&old, libc::SIGTRAP), 0);
                assert!(program_blocks_trap() && !real_blocks_trap());
                assert_eq!(virtual_mask(real, libc::SIG_BLOCK, std::ptr::null(), &mut old), Some(0));
                assert_eq!(libc::sigismember(&old, libc::SIGTRAP), 1);
                // An invalid `how` is passed on for the C library to refuse.
                assert_eq!(virtual_mask(real, 12345, &trap, &mut old), None);
                assert!(program_blocks_trap());
                // SIG_SETMASK without SIGTRAP clears the flag, and reports it set before.
                let empty: libc::sigset_t = std::mem::zeroed();
                assert_eq!(virtual_mask(real, libc::SIG_SETMASK, &empty, &mut old), Some(0));
                assert_eq!(libc::sigismember(&old, libc::SIGTRAP), 1);
                assert!(!program_blocks_trap() && !real_blocks_trap());
                // Not active: passed on.
                set_active(false);
                assert_eq!(virtual_mask(real, libc::SIG_BLOCK, &trap, &mut old), None);
            }
        })
        .join()
        .unwrap();
    }

    /// A thread spawned quiet blocks every signal but glibc's 32 and 33.
    #[test]
    fn a_quiet_thread_blocks_every_signal_but_the_c_librarys_own() {
        let read_mask = || {
            let mut cur: u64 = 0;
            // SAFETY: a query of this thread's mask into `cur`.
            unsafe {
                libc::syscall(
                    libc::SYS_rt_sigprocmask,
                    libc::SIG_BLOCK,
                    std::ptr::null::<u64>(),
                    &mut cur as *mut u64,
                    8,
                )
            };
            cur
        };
        let before = read_mask();
        let inner = spawn_quiet(std::thread::Builder::new(), read_mask).unwrap().join().unwrap();
        assert_eq!(read_mask(), before, "the caller's mask is restored");
        for sig in [libc::SIGUSR1, libc::SIGCHLD, libc::SIGPROF, libc::SIGTERM, libc::SIGTRAP] {
            assert_ne!(inner & (1 << (sig - 1)), 0, "signal {sig} blocked");
        }
        assert_eq!(inner & (1 << 31), 0, "32 open");
        assert_eq!(inner & (1 << 32), 0, "33 open");
    }
}
