//! Finishing the recording before an exit that runs no `atexit` handler.
//!
//! `_exit`, `_Exit` and the `exec` family end a process image without
//! `exit`'s handlers, so a recording finished at `exit` (the preload's
//! `atexit` handler) would lose what its writer had not written yet: up to
//! a flush interval of samples and, in the off-CPU mode, every wait still
//! open, however long (a shell's 1 s `wait4` before its `_exit`).
//! `libspulse_preload.so` interposes those calls and first calls
//! [`finish_before_exit`], which asks the writer thread to stop as
//! `Guard::finish` does (drain, close the waits still open at now, flush)
//! and waits for it, a bounded time.
//!
//! Everything on the caller's side is async-signal-safe (atomics, `fstat`,
//! `write`, `nanosleep`): `_exit` and `execve` may be called from a signal
//! handler, in the child of a multithreaded `fork`, or in a `vfork` child
//! sharing the recorder's memory (the preload calls this only in the process
//! it records: a `vfork` child has another pid). The work is the writer
//! thread's; if it cannot finish in time (it waits for a lock the caller
//! holds, such as the allocator's when a handler interrupted `malloc`), the
//! caller goes on to exit after the bound and the spool keeps what was
//! flushed, as before.
//!
//! The writer is woken at once only where it waits on an eventfd (the
//! off-CPU mode, the perf-stack engine); elsewhere the request returns at
//! once and nothing changes (at most a flush interval of samples is lost):
//! waiting for the next tick would delay every exit of a short process.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::own_fd;

/// An exit asked the writer to finish.
static REQUESTED: AtomicBool = AtomicBool::new(false);
/// The writer thread of the running recorder has finished (or was never
/// started): what it wrote is all there will be.
static DONE: AtomicBool = AtomicBool::new(true);
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

/// A recorder starts (its writer thread about to run); `wake` is its
/// writer's eventfd, if it waits on one.
pub(crate) fn arm(wake: Option<RawFd>) {
    REQUESTED.store(false, Ordering::SeqCst);
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
        WAKE_FD.store(-1, Ordering::SeqCst);
        WRITER_TID.store(0, Ordering::SeqCst);
        DONE.store(true, Ordering::SeqCst);
    }
}

/// Whether an exit asked the writer to finish (the writer checks it each
/// time it wakes).
pub(crate) fn requested() -> bool {
    REQUESTED.load(Ordering::Relaxed)
}

/// Ask the writer of the recorder running in this process to finish now, as
/// `Guard::finish` does, and wait until it has, at most `timeout`; for an
/// exit that runs no `atexit` handler (see the module doc). Returns whether
/// the writer finished. Returns at once where no writer runs, where it
/// cannot be woken at once (no eventfd), or on the writer thread itself (a
/// program's signal handler that ran there). The bound is counted in
/// sleeps of 200 us (no clock is read), so it is about `timeout`.
///
/// Async-signal-safe. The caller must be the process that started the
/// recorder (a `vfork` child shares this memory: it must not call this).
/// The recorder is not usable afterwards: the `Guard`'s `finish` then
/// reports what the writer wrote.
pub fn finish_before_exit(timeout: Duration) -> bool {
    if DONE.load(Ordering::SeqCst) {
        return true;
    }
    let fd = WAKE_FD.load(Ordering::SeqCst);
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() } as u32;
    if fd < 0 || me == WRITER_TID.load(Ordering::SeqCst) {
        return false;
    }
    let id =
        (WAKE_DEV.load(Ordering::SeqCst), WAKE_INO.load(Ordering::SeqCst), WAKE_KIND.load(Ordering::SeqCst));
    if own_fd::identity_words(fd) != Some(id) {
        return false;
    }
    REQUESTED.store(true, Ordering::SeqCst);
    let one = 1u64;
    // SAFETY: writes 8 bytes from our u64 to the writer's eventfd, checked
    // above to be the file the recorder opened.
    unsafe { libc::write(fd, &one as *const u64 as *const libc::c_void, 8) };
    const STEP: Duration = Duration::from_micros(200);
    let mut waited = Duration::ZERO;
    while !DONE.load(Ordering::SeqCst) {
        if waited >= timeout {
            // Withdrawn: a process that goes on (a failed `exec`) keeps its
            // recording, unless the writer already began to finish.
            REQUESTED.store(false, Ordering::SeqCst);
            return false;
        }
        let ts = libc::timespec { tv_sec: 0, tv_nsec: STEP.as_nanos() as libc::c_long };
        // SAFETY: nanosleep reads our timespec; no remainder is asked for.
        unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
        waited += STEP;
    }
    true
}
