//! A forked child's recorder starts a moment after the fork, on a thread of
//! its own, not inside `fork`.
//!
//! Most children a shell forks `exec` another program within a
//! millisecond, and that program's constructor starts its own recorder: a
//! recorder started in the fork (its unwind tables, its spool and stats
//! files, its writer thread) was thrown away at once. That was about half of
//! what `spulse record` cost a `bash` loop of short commands (500 `/bin/true`
//! took 2.7-2.9 s recorded against 1.6 s with children not started, 0.3 s
//! plain). So the fork only spawns a thread that waits [`DELAY`] and then
//! starts the recorder; a child that `exec`s or exits before that never
//! starts one (its CPU until then is counted as spent before a recorder:
//! in the next image's "before the recorder", or, at its exit, in the
//! collector's tally: [`TALLY_NAME`], [`count_unstarted`]).
//!
//! The calls that end the image or need the process to have one thread hold
//! the start off ([`hold`]): an `exec` (released if it fails), `_exit` and
//! `exit`, `unshare` and `setns` (the thread is stopped and joined, see
//! [`stop`]), a seccomp mode. A start already under way is waited for
//! (bounded by [`WAIT_START`]), and the call then finds a running recorder
//! as before. A child forked while another thread of its parent was in the
//! middle of such a start goes unrecorded (that thread's locks may be
//! held, and it does not exist in the child).
//!
//! Everything here that a call from a signal handler may reach (`hold`,
//! `release`) is atomic operations and `futex` system calls.

use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long after the fork the child's recorder starts.
pub(crate) const DELAY: Duration = Duration::from_millis(2);

/// The longest a call that ends the image waits for a start under way (a
/// start takes a few milliseconds; it could wait on a lock the waiting
/// thread holds, such as the allocator's, when the call is made from a
/// signal handler).
const WAIT_START: Duration = Duration::from_secs(1);

/// No deferred start in this process (none was asked for, or it ran, or it
/// was given up).
const NONE: u32 = 0;
/// The start thread waits out [`DELAY`] (or for a hold to end).
const PENDING: u32 = 1;
/// The start thread is starting the recorder.
const STARTING: u32 = 2;
/// A call that ends the image holds the start off.
const HELD: u32 = 3;

/// The deferred start's state; also the futex the start thread and the
/// holders wait on.
static STATE: AtomicU32 = AtomicU32::new(NONE);

/// The start thread, for [`stop`] to join.
static THREAD: Mutex<Option<std::thread::JoinHandle<()>>> = Mutex::new(None);

/// Wait on [`STATE`] while it holds `value`, at most `timeout`.
fn wait(value: u32, timeout: Duration) {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: FUTEX_WAIT on our own static word, with a relative timeout on this frame.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            STATE.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            value,
            &ts as *const libc::timespec,
        )
    };
}

/// Wake every waiter on [`STATE`].
fn wake() {
    // SAFETY: FUTEX_WAKE on our own static word.
    unsafe {
        libc::syscall(libc::SYS_futex, STATE.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX)
    };
}

/// In a forked child (from the fork handler): defer the recorder's start.
/// False when the child is to be started at once (no thread could be
/// spawned); true when it is deferred or is to go unrecorded.
pub(crate) fn defer() -> bool {
    // The parent's thread that was starting a recorder is not in this child,
    // and may have held locks the start needs.
    if STATE.load(Ordering::SeqCst) == STARTING {
        STATE.store(NONE, Ordering::SeqCst);
        return true;
    }
    STATE.store(PENDING, Ordering::SeqCst);
    // The parent's handle names a thread of the parent's: forget it.
    match THREAD.try_lock() {
        Ok(mut t) => std::mem::forget(t.take()),
        Err(std::sync::TryLockError::Poisoned(p)) => std::mem::forget(p.into_inner().take()),
        // Held by a thread of the parent at the fork: left as it is.
        Err(std::sync::TryLockError::WouldBlock) => {
            STATE.store(NONE, Ordering::SeqCst);
            return true;
        }
    }
    let b = std::thread::Builder::new().name("spulse-start".into()).stack_size(256 << 10);
    match spulse::__preload_spawn_own(b, run) {
        Ok(h) => {
            if let Ok(mut t) = THREAD.try_lock() {
                *t = Some(h);
            }
            true
        }
        Err(_) => {
            STATE.store(NONE, Ordering::SeqCst);
            false
        }
    }
}

/// The start thread: wait out [`DELAY`], then start unless held off or
/// given up.
fn run() {
    let until = Instant::now() + DELAY;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match STATE.load(Ordering::SeqCst) {
            NONE => return,
            s => wait(s, left),
        }
    }
    loop {
        match STATE.compare_exchange(PENDING, STARTING, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => {
                crate::start_deferred();
                STATE.store(NONE, Ordering::SeqCst);
                wake();
                return;
            }
            Err(NONE) => return,
            // Held (an `exec` under way: if it succeeds this thread is gone).
            Err(s) => wait(s, Duration::from_millis(1)),
        }
    }
}

/// Hold a deferred start off for a call that ends this image (or needs one
/// thread); a start under way is waited for first. True when this call
/// holds it (then nothing records this process yet): [`release`] it if the
/// call returns. Async-signal-safe.
pub(crate) fn hold() -> bool {
    let deadline = Instant::now() + WAIT_START;
    loop {
        match STATE.compare_exchange(PENDING, HELD, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return true,
            Err(STARTING) if Instant::now() < deadline => wait(STARTING, Duration::from_millis(1)),
            Err(_) => return false,
        }
    }
}

/// Let a deferred start held by [`hold`] go on (the call returned).
pub(crate) fn release() {
    if STATE.compare_exchange(HELD, PENDING, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
        wake();
    }
}

/// In a forked child that is not to be recorded: no deferred start (one
/// of the parent's, whose thread is not in this child, is forgotten).
pub(crate) fn reset() {
    STATE.store(NONE, Ordering::SeqCst);
}

/// Give the deferred start up and wait for its thread to end (a call that
/// needs the process to have one thread). True when there was one to stop;
/// a start under way is waited for first (then the recorder runs, and this
/// returns false).
pub(crate) fn stop() -> bool {
    if !hold() {
        return false;
    }
    STATE.store(NONE, Ordering::SeqCst);
    wake();
    let h = match THREAD.lock() {
        Ok(mut t) => t.take(),
        Err(p) => p.into_inner().take(),
    };
    if let Some(h) = h {
        let _ = h.join();
    }
    true
}

/// The file in `spulse record`'s directory where forked children that ended
/// before their recorder started add up their CPU: three native-endian
/// 64-bit words, user and system microseconds and the children counted
/// (the collector creates it, zeroed, at the size [`TALLY_BYTES`]).
pub(crate) const TALLY_NAME: &str = "forks.tally";

/// The tally's size.
const TALLY_BYTES: usize = 4096;

/// The tally, mapped shared (a forked child inherits the mapping); null
/// when not recording under `spulse record` or it could not be mapped.
static TALLY: AtomicPtr<AtomicU64> = AtomicPtr::new(std::ptr::null_mut());

/// Map the collector's tally in `dir`, once an image (no-op once mapped: a
/// forked child has its parent's mapping).
pub(crate) fn map_tally(dir: &std::path::Path) {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    if !TALLY.load(Ordering::SeqCst).is_null() {
        return;
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(dir.join(TALLY_NAME));
    let Ok(f) = f else { return };
    // A regular file the full size: a shorter one would fault on access.
    if !f.metadata().is_ok_and(|m| m.is_file() && m.len() >= TALLY_BYTES as u64) {
        return;
    }
    // SAFETY: a new shared mapping of the file's first TALLY_BYTES bytes, at an address the kernel chooses.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            TALLY_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if p != libc::MAP_FAILED {
        TALLY.store(p.cast(), Ordering::SeqCst);
    }
}

/// Add this process's CPU so far to the tally: a forked child that ends
/// before its recorder started. Async-signal-safe (`getrusage`, atomics).
pub(crate) fn count_unstarted() {
    let t = TALLY.load(Ordering::SeqCst);
    if t.is_null() {
        return;
    }
    // SAFETY: an all-zero rusage is valid for getrusage to overwrite.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF into the valid `ru`.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return;
    }
    let us = |t: libc::timeval| (t.tv_sec.max(0) as u64) * 1_000_000 + t.tv_usec.max(0) as u64;
    // SAFETY: `t` maps TALLY_BYTES (4096) bytes, page-aligned: words 0 to 2 are in it and aligned.
    let words = unsafe { [&*t, &*t.add(1), &*t.add(2)] };
    words[0].fetch_add(us(ru.ru_utime), Ordering::Relaxed);
    words[1].fetch_add(us(ru.ru_stime), Ordering::Relaxed);
    words[2].fetch_add(1, Ordering::Relaxed);
}
