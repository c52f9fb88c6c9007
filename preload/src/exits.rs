//! `_exit`, `_Exit` and the `exec` family, interposed: each first finishes
//! the recording of this process (`spulse::__preload_finish_before_exit`),
//! since none of them runs the `atexit` handler that does it at `exit`.
//! Without this, a process ending with `_exit` (a shell, a forked child,
//! Python's `os._exit`) or replaced by `exec` lost what its writer had not
//! written yet: in the off-CPU mode, every wait still open, such as a
//! shell's whole `wait4` for its last command.
//!
//! The finishing is async-signal-safe and bounded ([`FINISH_WITHIN`]: see
//! `src/recorder/exit_request.rs`), done only in the process this library
//! records (a `vfork` child, which shares its parent's memory until it
//! execs or exits, has another pid and is left alone), and only where the
//! writer can be woken at once (the off-CPU mode, the perf-stack engine):
//! elsewhere the call goes straight on. A failed `exec` returns its error
//! as usual; the recording has then ended (the `atexit` handler still
//! writes its stats at `exit`).
//!
//! `_exit` is the `exit_group` system call itself, as in the C library; the
//! `exec` functions are the C library's, looked up when this library loads
//! ([`resolve`]: `dlsym` is not safe in a signal handler or a `vfork` child).
//! `execl`, `execlp` and `execle` (variadic) are not interposed: the C
//! library's call its `execve` internally, which no interposer sees.

use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The longest an `_exit` or `exec` waits for the writer to finish (a
/// drain, the open waits closed, a flush; about a millisecond here).
const FINISH_WITHIN: Duration = Duration::from_secs(2);

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
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name returns the
        // next definition after this library (the C library's) or null.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        slot.store(p, Ordering::Release);
    }
}

/// Finish the recording if this is the process it records.
fn before_image_ends() {
    // SAFETY: getpid has no preconditions (a system call in this C library).
    let pid = unsafe { libc::getpid() } as u32;
    if pid != 0 && crate::spulse_preload_recorded_pid.load(Ordering::SeqCst) == pid {
        spulse::__preload_finish_before_exit(FINISH_WITHIN);
    }
}

/// The C library's function in `slot`, or `ENOSYS` for the caller.
fn real(slot: &AtomicUsize) -> Option<usize> {
    let p = slot.load(Ordering::Acquire);
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

/// `execve(2)`.
///
/// # Safety
/// As `execve(2)`.
#[no_mangle]
pub unsafe extern "C" fn execve(path: *const c_char, argv: Argv, envp: Argv) -> c_int {
    let Some(p) = real(&REAL_EXECVE) else { return -1 };
    before_image_ends();
    // SAFETY: the C library's `execve`, which has this signature; the
    // caller's contract, passed on.
    unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char, Argv, Argv) -> c_int>(p)(
            path, argv, envp,
        )
    }
}

/// `execv(3)`.
///
/// # Safety
/// As `execv(3)`.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: Argv) -> c_int {
    let Some(p) = real(&REAL_EXECV) else { return -1 };
    before_image_ends();
    // SAFETY: the C library's `execv`, which has this signature; the
    // caller's contract, passed on.
    unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char, Argv) -> c_int>(p)(path, argv) }
}

/// `execvp(3)`.
///
/// # Safety
/// As `execvp(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: Argv) -> c_int {
    let Some(p) = real(&REAL_EXECVP) else { return -1 };
    before_image_ends();
    // SAFETY: the C library's `execvp`, which has this signature; the
    // caller's contract, passed on.
    unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char, Argv) -> c_int>(p)(file, argv) }
}

/// `execvpe(3)`.
///
/// # Safety
/// As `execvpe(3)`.
#[no_mangle]
pub unsafe extern "C" fn execvpe(file: *const c_char, argv: Argv, envp: Argv) -> c_int {
    let Some(p) = real(&REAL_EXECVPE) else { return -1 };
    before_image_ends();
    // SAFETY: the C library's `execvpe`, which has this signature; the
    // caller's contract, passed on.
    unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char, Argv, Argv) -> c_int>(p)(
            file, argv, envp,
        )
    }
}

/// `fexecve(3)`.
///
/// # Safety
/// As `fexecve(3)`.
#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: Argv, envp: Argv) -> c_int {
    let Some(p) = real(&REAL_FEXECVE) else { return -1 };
    before_image_ends();
    // SAFETY: the C library's `fexecve`, which has this signature; the
    // caller's contract, passed on.
    unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(c_int, Argv, Argv) -> c_int>(p)(fd, argv, envp)
    }
}
