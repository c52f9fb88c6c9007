//! `unshare` and `setns`, interposed: a process of one thread may enter a new
//! user namespace (and join another's, or another mount namespace), a
//! process of two may not (`EINVAL`). The recorder's writer is a thread of
//! the process it records, so under `spulse record` every `unshare -U`,
//! `unshare -r`, `nsenter -U` or rootless sandbox failed where it worked
//! unrecorded.
//!
//! Such a call is made first as it is. Only if it fails with `EINVAL` in the
//! process this library records does the recording stop (finished, as at
//! exit: its spool and stats written, its writer joined), the call is made
//! again once the kernel lists one thread (at most [`ALONE_WITHIN`]), and a
//! new recording of the process starts whatever the answer (a new spool
//! under `spulse record`: the process reads as two images of one pid, as
//! across an `exec`). A program that has threads of its own gets its
//! `EINVAL` at once, as unrecorded, and the recording goes on (the kernel
//! listing more threads than the program's one and the writer says so).
//! The rest is the C library's call, unchanged.

use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long to wait for the kernel to list the finished writer as gone (a
/// joined thread leaves the thread group a little after `pthread_join`
/// returns).
const ALONE_WITHIN: Duration = Duration::from_millis(200);

/// `unshare` flags that need a process of one thread: a new user namespace
/// (which implies `CLONE_THREAD`), and the sharing flags the kernel refuses
/// in a multithreaded process.
const ONE_THREAD_UNSHARE: c_int =
    libc::CLONE_NEWUSER | libc::CLONE_THREAD | libc::CLONE_SIGHAND | libc::CLONE_VM;

/// `setns` types that need one thread: a user namespace, and a mount
/// namespace (its file system information must not be shared); 0 is any
/// type, and a pidfd's flags may include either.
const ONE_THREAD_SETNS: c_int = libc::CLONE_NEWUSER | libc::CLONE_NEWNS;

static REAL_UNSHARE: AtomicUsize = AtomicUsize::new(0);
static REAL_SETNS: AtomicUsize = AtomicUsize::new(0);

/// Look up the C library's functions (at load, from the constructor).
pub(crate) fn resolve() {
    for (slot, name) in [(&REAL_UNSHARE, c"unshare"), (&REAL_SETNS, c"setns")] {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name returns the next definition after this library (the C library's) or null.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        slot.store(p, Ordering::Release);
    }
}

/// `unshare(2)`.
#[no_mangle]
pub extern "C" fn unshare(flags: c_int) -> c_int {
    let Some(p) = crate::exits::real(&REAL_UNSHARE, c"unshare") else { return -1 };
    // SAFETY: the C library's `unshare`, of this signature.
    let f = unsafe { std::mem::transmute::<usize, extern "C" fn(c_int) -> c_int>(p) };
    let call = || f(flags);
    alone_if_needed(flags & ONE_THREAD_UNSHARE != 0, call)
}

/// `setns(2)`.
#[no_mangle]
pub extern "C" fn setns(fd: c_int, nstype: c_int) -> c_int {
    let Some(p) = crate::exits::real(&REAL_SETNS, c"setns") else { return -1 };
    // SAFETY: the C library's `setns`, of this signature.
    let f = unsafe { std::mem::transmute::<usize, extern "C" fn(c_int, c_int) -> c_int>(p) };
    let call = || f(fd, nstype);
    alone_if_needed(nstype == 0 || nstype & ONE_THREAD_SETNS != 0, call)
}

/// Make `call`; if it may need one thread (`may_need`), failed with
/// `EINVAL`, and this process is recorded here, make it again with the
/// recording stopped, then record anew.
fn alone_if_needed(may_need: bool, call: impl Fn() -> c_int) -> c_int {
    let r = call();
    if r == 0 || !may_need || errno() != libc::EINVAL || !crate::records_this_process() {
        return r;
    }
    // Threads of the program's own besides the writer: the call fails as it
    // would unrecorded, and the recording goes on (no 200 ms wait, no new
    // spool each time).
    if threads() > 2 {
        set_errno(libc::EINVAL);
        return r;
    }
    crate::finish_recording();
    let deadline = Instant::now() + ALONE_WITHIN;
    while threads() > 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let r = call();
    let e = errno();
    crate::record_again();
    set_errno(e);
    r
}

/// The threads the kernel lists for this process (`/proc/self/task`); 0 if
/// that cannot be read.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn set_errno(e: c_int) {
    // SAFETY: sets this thread's errno, an lvalue the C library provides.
    unsafe { *libc::__errno_location() = e };
}
