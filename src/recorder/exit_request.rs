//! Writing out the recording before an exit that runs no `atexit` handler.
//!
//! `_exit`, `_Exit` and the `exec` family end a process image without
//! `exit`'s handlers, so a recording finished at `exit` (the preload's
//! `atexit` handler) would lose what its writer had not written yet: up to
//! a flush interval of samples and, in the off-CPU mode, every wait still
//! open, however long. `libspulse_preload.so` interposes those calls and
//! first calls [`flush_before_exit`], which asks the writer thread for a
//! tick now (drain, pair the switch records, write the waits still open up
//! to now, flush) and waits for it, a bounded time. The recording goes on:
//! an `exec` that fails leaves it running as before.
//!
//! Everything on the caller's side is async-signal-safe (atomics,
//! `clock_gettime`, `fstat`, `write`, `nanosleep`): `_exit` and `execve` may
//! be called from a signal handler, in the child of a multithreaded `fork`,
//! or in a `vfork` child sharing the recorder's memory (the preload calls
//! this only in the process it records: a `vfork` child has another pid).
//! The work is the writer thread's. If it cannot answer in time (it waits
//! for a lock the caller holds, such as the allocator's when a handler
//! interrupted `malloc`), the caller goes on after the bound, and later
//! calls do not wait again until the writer has answered: a program whose
//! handler execs at every signal is delayed once, not at every signal.
//!
//! Every writer can be woken at once: where it waits on rings (the
//! perf-stack engine, the off-CPU mode) through the eventfd in its epoll
//! set, elsewhere through a futex word ([`wake_writer`]). (Before, the
//! signal engines' writers waited on their channel only, the call returned
//! at once there, and a forked child that ended with `_exit` lost its last
//! flush interval: one that lived under 100 ms lost every sample.)

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use super::own_fd;

/// Ticks asked for by exits, and those the writer has done (each tick
/// answers every request made before it began).
static ASKED: AtomicU64 = AtomicU64::new(0);
static ANSWERED: AtomicU64 = AtomicU64::new(0);
/// The writer thread of the running recorder has finished (or was never
/// started): what it wrote is all there will be.
static DONE: AtomicBool = AtomicBool::new(true);
/// What a writer without an eventfd (the signal engines' outside the
/// off-CPU mode: no rings to wait on) waits on: a futex word that a control
/// message or an exit's request bumps and wakes ([`wake_writer`]). No
/// descriptor: an eventfd is one anonymous inode, which the program's own
/// eventfds, timerfds and epoll sets share, so a check of its identity
/// could not tell them from ours.
static WAKE_SEQ: AtomicU32 = AtomicU32::new(0);
/// The writer's wake eventfd (-1: none) and what it was opened as (device,
/// inode, file type: checked before the write, never into a descriptor the
/// program reused).
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);
static WAKE_DEV: AtomicU64 = AtomicU64::new(0);
static WAKE_INO: AtomicU64 = AtomicU64::new(0);
static WAKE_KIND: AtomicU32 = AtomicU32::new(0);
/// The writer thread's tid (0: none): an exit it makes itself (the program's
/// signal handler ran on it) cannot wait for it.
static WRITER_TID: AtomicU32 = AtomicU32::new(0);
/// What the writer had done when it last settled ([`settled`]): the ring
/// slots it had read, plus one; 0 while it holds something unwritten (bytes
/// in its buffer, held samples, off-CPU waits to write). An exit finds
/// nothing to wait for when the ring has had no slot claimed since.
static SETTLED: AtomicUsize = AtomicUsize::new(0);

/// A recorder starts (its writer thread about to run); `wake` is its
/// writer's eventfd, if it waits on one.
pub(crate) fn arm(wake: Option<RawFd>) {
    ANSWERED.store(ASKED.load(Ordering::SeqCst), Ordering::SeqCst);
    SETTLED.store(0, Ordering::SeqCst);
    WAKE_FD.store(-1, Ordering::SeqCst);
    if let Some((fd, (dev, ino, kind))) = wake.and_then(|fd| Some((fd, own_fd::identity_words(fd)?))) {
        WAKE_DEV.store(dev, Ordering::SeqCst);
        WAKE_INO.store(ino, Ordering::SeqCst);
        WAKE_KIND.store(kind, Ordering::SeqCst);
        WAKE_FD.store(fd, Ordering::SeqCst);
    }
}

/// Held by the writer thread while it runs: dropped when it ends (after an
/// exit's request, a `Guard`'s stop, a failure, or a panic).
pub(crate) struct WriterThread(());

impl WriterThread {
    /// (Not done until it is running: a writer that could not be spawned
    /// is never waited for.)
    pub(crate) fn started(tid: u32) -> WriterThread {
        WRITER_TID.store(tid, Ordering::SeqCst);
        DONE.store(false, Ordering::SeqCst);
        WriterThread(())
    }
}

impl Drop for WriterThread {
    fn drop(&mut self) {
        SETTLED.store(0, Ordering::SeqCst);
        WAKE_FD.store(-1, Ordering::SeqCst);
        WRITER_TID.store(0, Ordering::SeqCst);
        DONE.store(true, Ordering::SeqCst);
    }
}

/// The futex word's value, read by a writer before it looks for work and
/// then waits with [`wait_for_wake`].
pub(crate) fn wake_seq() -> u32 {
    WAKE_SEQ.load(Ordering::SeqCst)
}

/// Wake a writer waiting on the futex word. Async-signal-safe: an atomic
/// add and one system call.
pub(crate) fn wake_writer() {
    WAKE_SEQ.fetch_add(1, Ordering::SeqCst);
    // SAFETY: FUTEX_WAKE on our own static word.
    unsafe {
        libc::syscall(libc::SYS_futex, WAKE_SEQ.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1)
    };
}

/// Wake the writer of the recorder running in this process if it waits on
/// the futex word (the signal engines' writers), asking for nothing: it
/// looks for work (the heap events' ring, `src/heap/events.rs`) and waits
/// again. A writer waiting on its rings (the perf-stack engine, the off-CPU
/// mode) is not woken: its eventfd cannot be told from a program's eventfd
/// put on the same number, and this is called far more often than an exit;
/// it empties the heap events' ring at its ticks. Async-signal-safe,
/// allocation-free, errno kept (the allocator calls it).
#[cfg(feature = "heap")]
pub(crate) fn nudge_writer() {
    if DONE.load(Ordering::SeqCst) {
        return;
    }
    // Inside the program's `malloc` or `free`: its errno stays as it was.
    // SAFETY: __errno_location returns this thread's errno, always valid.
    let errno = unsafe { *libc::__errno_location() };
    wake_writer();
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Wait until the futex word moves from `seen` (a wake since it was read
/// returns at once), at most `timeout`.
pub(crate) fn wait_for_wake(seen: u32, timeout: Duration) {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: FUTEX_WAIT on our own static word with a relative timeout on this frame.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            WAKE_SEQ.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            seen,
            &ts as *const libc::timespec,
        )
    };
}

/// The writer's state after its latest step: `read` ring slots consumed,
/// and whether everything it had was written to the spool (`quiet`).
pub(crate) fn settled(read: usize, quiet: bool) {
    SETTLED.store(if quiet { read.wrapping_add(1) } else { 0 }, Ordering::SeqCst);
}

/// Whether the writer has nothing to write for an exit now: it had written
/// all it had, and no sample was taken since (no ring slot claimed).
fn nothing_to_write() -> bool {
    let settled = SETTLED.load(Ordering::SeqCst);
    settled != 0 && super::handler::ring_claimed() == Some(settled.wrapping_sub(1))
}

/// The requests made so far, if some is not answered yet: the writer then
/// ticks now, and says so with [`answered`] and this number.
pub(crate) fn pending() -> Option<u64> {
    let asked = ASKED.load(Ordering::SeqCst);
    (asked > ANSWERED.load(Ordering::SeqCst)).then_some(asked)
}

/// The writer's tick for the requests up to `asked` ([`pending`]) is done:
/// what they asked for is in the spool.
pub(crate) fn answered(asked: u64) {
    ANSWERED.fetch_max(asked, Ordering::SeqCst);
}

/// A monotonic clock reading in nanoseconds (async-signal-safe).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

/// The running writer thread's id, 0 if none (for the preload library's
/// interposers; async-signal-safe: one atomic load).
pub fn writer_tid() -> u32 {
    WRITER_TID.load(Ordering::SeqCst)
}

/// Ask the writer of the recorder running in this process for a tick now
/// (drain, write the off-CPU waits still open up to now, flush) and wait
/// until it is done, at most `timeout`; for an exit that runs no `atexit`
/// handler (see the module doc). Returns whether it was done. Returns at
/// once where no writer runs, where its eventfd is gone (the program closed
/// it or put another file there), on the writer thread itself (a program's
/// signal handler that ran there), or while an earlier request is still
/// unanswered.
///
/// Async-signal-safe. The caller must be the process that started the
/// recorder (a `vfork` child shares this memory: it must not call this).
pub fn flush_before_exit(timeout: Duration) -> bool {
    if DONE.load(Ordering::SeqCst) {
        return false;
    }
    let fd = WAKE_FD.load(Ordering::SeqCst);
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() } as u32;
    if me == WRITER_TID.load(Ordering::SeqCst) || pending().is_some() {
        return false;
    }
    // A writer waiting on rings is woken through its eventfd: if the
    // program closed it or put another file there, it cannot be.
    if fd >= 0 {
        let id = (
            WAKE_DEV.load(Ordering::SeqCst),
            WAKE_INO.load(Ordering::SeqCst),
            WAKE_KIND.load(Ordering::SeqCst),
        );
        if own_fd::identity_words(fd) != Some(id) {
            return false;
        }
    }
    // A process that took no sample since the writer wrote out everything
    // (a forked child that execs at once) has nothing to wait for.
    if nothing_to_write() {
        return true;
    }
    // The waits still open are written up to now (lock-free slots).
    super::request_off_cpu_split(super::sys::now_ns());
    let mine = ASKED.fetch_add(1, Ordering::SeqCst) + 1;
    if fd >= 0 {
        let one = 1u64;
        // SAFETY: writes 8 bytes from our u64 to the writer's eventfd, checked above to be the file the recorder opened.
        unsafe { libc::write(fd, &one as *const u64 as *const libc::c_void, 8) };
    }
    // Whichever it waits on: its eventfd beside its rings, or the futex word.
    wake_writer();
    let until = monotonic_ns().saturating_add(timeout.as_nanos() as u64);
    loop {
        if ANSWERED.load(Ordering::SeqCst) >= mine {
            return true;
        }
        if DONE.load(Ordering::SeqCst) || monotonic_ns() >= until {
            return false;
        }
        let ts = libc::timespec { tv_sec: 0, tv_nsec: 100_000 };
        // SAFETY: nanosleep reads our timespec; no remainder is asked for.
        unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
    }
}
