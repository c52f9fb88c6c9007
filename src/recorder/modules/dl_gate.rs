//! No fork while spulse is inside `dl_iterate_phdr`.
//!
//! `dl_iterate_phdr` holds the loader's lock (`dl_load_write_lock`) for the
//! whole walk, and `fork` neither takes nor resets that lock: a process
//! forked while another of its threads walked the loaded objects has the
//! lock held forever in the child. spulse walks them from its writer
//! thread (the loader's counters at every tick, a scan after a `dlopen`)
//! and at the start of the recording a forked child makes, so a child
//! forked while the writer walked hung in its first call (a helper's
//! Python `multiprocessing` pool under `spulse record` lost both workers
//! in about one run of 20).
//!
//! So every walk of spulse's holds this gate, and `fork` (a `pthread_atfork`
//! prepare handler, registered at the first walk) takes it before the
//! process is copied and gives it back in both processes after. A walk
//! takes microseconds (a scan after a `dlopen`, a few milliseconds); the
//! prepare handler waits at most [`FORK_WAITS_AT_MOST`] and then lets the
//! fork go on (the child may hang as before). A walk from a thread that
//! already holds the gate (a signal handler allocating inside a walk, with
//! the heap profiler on) goes on without it, as the loader's recursive lock
//! lets it. Walks by the program's own threads are the program's: a child
//! forked during one of them can hang at spulse's start as it would at its
//! own first `dl_iterate_phdr` (a panic's backtrace, a C++ exception).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

/// The thread holding the gate (`pthread_self`), 0 when free.
static OWNER: AtomicUsize = AtomicUsize::new(0);

/// Whether the prepare handler took the gate for the fork under way.
static FORK_HOLDS: AtomicBool = AtomicBool::new(false);

/// Longest a `fork` waits for a walk to end.
const FORK_WAITS_AT_MOST: Duration = Duration::from_millis(250);

fn me() -> usize {
    // SAFETY: pthread_self has no preconditions; a thread's id is nonzero.
    unsafe { libc::pthread_self() as usize }
}

/// Take the gate for this thread within `limit` (`None`: wait as long as it
/// takes). `Some(false)`: not taken (this thread holds it already, or the
/// time ran out).
fn take(limit: Option<Duration>) -> bool {
    let me = me();
    if OWNER.load(Ordering::Relaxed) == me {
        return false;
    }
    let start = Instant::now();
    let mut spins = 0u32;
    while OWNER.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed).is_err() {
        if limit.is_some_and(|l| start.elapsed() >= l) {
            return false;
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            // A walk lasts microseconds; a fork, a little longer.
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    true
}

fn give_back() {
    OWNER.store(0, Ordering::Release);
}

/// Run `walk` (which calls `dl_iterate_phdr`) with the gate held.
pub(crate) fn hold<R>(walk: impl FnOnce() -> R) -> R {
    register();
    let took = take(None);
    let r = walk();
    if took {
        give_back();
    }
    r
}

extern "C" fn prepare() {
    FORK_HOLDS.store(take(Some(FORK_WAITS_AT_MOST)), Ordering::SeqCst);
}

extern "C" fn after() {
    if FORK_HOLDS.swap(false, Ordering::SeqCst) {
        give_back();
    }
}

fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // `after` serves parent and child.
        // SAFETY: registers plain functions that touch atomics only (and sleep in the prepare handler).
        unsafe { libc::pthread_atfork(Some(prepare), Some(after), Some(after)) };
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fork while another thread walks waits for the walk's end; the
    /// child walks at once (the loader's lock was free at the copy).
    #[test]
    fn a_fork_waits_for_a_walk_and_the_child_can_walk() {
        static INSIDE: AtomicBool = AtomicBool::new(false);
        static DONE: AtomicBool = AtomicBool::new(false);
        extern "C" fn slow(_: *mut libc::dl_phdr_info, _: usize, _: *mut libc::c_void) -> libc::c_int {
            INSIDE.store(true, Ordering::SeqCst);
            // A long walk, inside the loader's lock: the fork below must wait
            // for it (without the gate, the child hangs in its own walk).
            std::thread::sleep(Duration::from_millis(30));
            DONE.store(true, Ordering::SeqCst);
            1
        }
        let walker = std::thread::spawn(|| {
            // SAFETY: the callback touches no argument; it stops the walk.
            hold(|| unsafe { libc::dl_iterate_phdr(Some(slow), std::ptr::null_mut()) })
        });
        while !INSIDE.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: the child only calls this crate's walk (what is tested) and `_exit`.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let (adds, _) = crate::recorder::modules::dl_counters();
            // SAFETY: ends the child without running the parent's atexit handlers.
            unsafe { libc::_exit(if adds > 0 { 0 } else { 1 }) };
        }
        // (Read at once: the fork returned only after the walk's end.)
        let walk_done = DONE.load(Ordering::SeqCst);
        assert!(pid > 0);
        let mut status = 0;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // SAFETY: waits for our own child without blocking.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            if Instant::now() > deadline {
                // SAFETY: kills our own hung child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("the child hung walking the loaded objects");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status}");
        assert!(walk_done, "the fork did not wait for the walk's end");
        walker.join().unwrap();
        // (Other tests of this process may hold it now: not this thread.)
        assert_ne!(OWNER.load(Ordering::SeqCst), me(), "the fork gave the gate back");
    }
}
