//! `_exit`, `_Exit` and the `exec` family, interposed: each first has the
//! recording of this process written out
//! (`spulse::__preload_flush_before_exit`: a writer tick now, the off-CPU
//! waits still open written up to now), since none of them runs the
//! `atexit` handler that finishes it at `exit`. Without this, a process
//! ending with `_exit` (a shell, a forked child, Python's `os._exit`) or
//! replaced by `exec` lost what its writer had not written yet: up to a
//! flush interval of samples (all of a forked worker that lived under
//! 100 ms), and in the off-CPU mode every wait still open, such as another
//! thread's.
//!
//! The request is async-signal-safe and bounded ([`FLUSH_WITHIN`]; see
//! `src/recorder/exit_request.rs`: a writer that cannot answer in time is
//! not waited for again until it has), made only in the process this
//! library records (a `vfork` child, which shares its parent's memory until
//! it execs or exits, has another pid and is left alone). Every engine's
//! writer can be woken at once (an eventfd with the off-CPU mode and the
//! perf-stack engine, a futex word with the others); a process that took no
//! sample since its writer last wrote everything out does not wait at all.
//! The recording is not stopped: after an `exec` that fails it simply goes
//! on.
//!
//! `_exit` is the `exit_group` system call itself, as in the C library; the
//! `exec` functions are the C library's, looked up when this library loads
//! ([`resolve`]: `dlsym` is not safe in a signal handler or a `vfork` child).
//! `execl`, `execlp` and `execle` (variadic) are not interposed: the C
//! library's call its `execve` internally, which no interposer sees.

use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The longest an `_exit` or `exec` waits for the writer's tick (a drain,
/// the open waits written, a flush: about a millisecond here).
const FLUSH_WITHIN: Duration = Duration::from_millis(200);

static REAL_EXECVE: AtomicUsize = AtomicUsize::new(0);
static REAL_EXECV: AtomicUsize = AtomicUsize::new(0);
static REAL_EXECVP: AtomicUsize = AtomicUsize::new(0);
static REAL_EXECVPE: AtomicUsize = AtomicUsize::new(0);
static REAL_FEXECVE: AtomicUsize = AtomicUsize::new(0);

type Argv = *const *const c_char;

/// Look up the C library's `exec` functions (at load, from the constructor).
pub(crate) fn resolve() {
    for (slot, name) in [
        (&REAL_EXECVE, c"execve"),
        (&REAL_EXECV, c"execv"),
        (&REAL_EXECVP, c"execvp"),
        (&REAL_EXECVPE, c"execvpe"),
        (&REAL_FEXECVE, c"fexecve"),
    ] {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name returns the next definition after this library (the C library's) or null.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        slot.store(p, Ordering::Release);
    }
}

/// Have the recording written out if this is the process it records.
fn before_image_ends() {
    // (No system call when nothing is recorded: after a seccomp filter, the
    // `getpid` the check needs may be refused.)
    if crate::records_this_process() {
        crate::without_sigxfsz(|| spulse::__preload_flush_before_exit(FLUSH_WITHIN));
    }
}

/// The C library's function `name`, kept in `slot`, or `ENOSYS` for the
/// caller. Looked up here if [`resolve`] has not run yet (a constructor of
/// the program's that runs before this library's and execs).
pub(crate) fn real(slot: &AtomicUsize, name: &CStr) -> Option<usize> {
    let mut p = slot.load(Ordering::Acquire);
    if p == 0 {
        // SAFETY: as in `resolve`.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        slot.store(p, Ordering::Release);
    }
    if p == 0 {
        // SAFETY: sets this thread's errno, an lvalue the C library provides.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return None;
    }
    Some(p)
}

/// `_exit(2)`.
#[no_mangle]
pub extern "C" fn _exit(status: c_int) -> ! {
    before_image_ends();
    loop {
        // SAFETY: exit_group ends the process; it does not return.
        unsafe { libc::syscall(libc::SYS_exit_group, status as libc::c_long) };
    }
}

/// `_Exit(3)`: `_exit`.
#[no_mangle]
pub extern "C" fn _Exit(status: c_int) -> ! {
    _exit(status)
}

/// The C library's `exec` functions' signatures.
type Exec = unsafe extern "C" fn(*const c_char, Argv, Argv) -> c_int;
type ExecNoEnv = unsafe extern "C" fn(*const c_char, Argv) -> c_int;
type ExecFd = unsafe extern "C" fn(c_int, Argv, Argv) -> c_int;

/// Have the recording written out, then call the C library's function in
/// `slot` (`call`).
fn around_exec(slot: &AtomicUsize, name: &CStr, call: impl FnOnce(usize) -> c_int) -> c_int {
    let Some(p) = real(slot, name) else { return -1 };
    before_image_ends();
    if crate::records_this_process() {
        crate::without_sigxfsz(crate::exec_cpu::note);
    }
    call(p)
}

/// `execve(2)`.
///
/// # Safety
/// As `execve(2)`.
#[no_mangle]
pub unsafe extern "C" fn execve(path: *const c_char, argv: Argv, envp: Argv) -> c_int {
    // SAFETY: the C library's `execve`, of this signature; the caller's contract, passed on.
    around_exec(&REAL_EXECVE, c"execve", |p| unsafe {
        std::mem::transmute::<usize, Exec>(p)(path, argv, envp)
    })
}

/// `execv(3)`.
///
/// # Safety
/// As `execv(3)`.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: Argv) -> c_int {
    // SAFETY: the C library's `execv`, of this signature; the caller's contract, passed on.
    around_exec(&REAL_EXECV, c"execv", |p| unsafe { std::mem::transmute::<usize, ExecNoEnv>(p)(path, argv) })
}

/// `execvp(3)`.
///
/// # Safety
/// As `execvp(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: Argv) -> c_int {
    // SAFETY: the C library's `execvp`, of this signature; the caller's contract, passed on.
    around_exec(&REAL_EXECVP, c"execvp", |p| unsafe {
        std::mem::transmute::<usize, ExecNoEnv>(p)(file, argv)
    })
}

/// `execvpe(3)`.
///
/// # Safety
/// As `execvpe(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvpe(file: *const c_char, argv: Argv, envp: Argv) -> c_int {
    // SAFETY: the C library's `execvpe`, of this signature; the caller's contract, passed on.
    around_exec(&REAL_EXECVPE, c"execvpe", |p| unsafe {
        std::mem::transmute::<usize, Exec>(p)(file, argv, envp)
    })
}

/// `fexecve(3)`.
///
/// # Safety
/// As `fexecve(3)`.
#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: Argv, envp: Argv) -> c_int {
    // SAFETY: the C library's `fexecve`, of this signature; the caller's contract, passed on.
    around_exec(&REAL_FEXECVE, c"fexecve", |p| unsafe {
        std::mem::transmute::<usize, ExecFd>(p)(fd, argv, envp)
    })
}
