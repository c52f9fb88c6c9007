//! `prctl` and `syscall`, interposed for one purpose: a program entering a
//! seccomp mode (`prctl(PR_SET_SECCOMP)`, or the `seccomp` system call
//! through `syscall()`, as libseccomp's `seccomp_load` makes it) restricts
//! the system calls its threads may make from then on, and the recorder's
//! (its signal handler's on every sampled thread, its writer's) are not in a
//! program's allow-list: strict mode killed the recorded process at the next
//! sample (SIGSEGV), a filter that kills killed it (SIGSYS), and one that
//! refuses slowed it and stopped the samples.
//!
//! So the recording of this process is finished just before: what it
//! recorded until then is kept, with a warning saying why it stops, and no
//! recorder runs in the process afterwards (the program's filter would
//! refuse it). Every other call is the C library's, passed on unchanged.

use std::ffi::{c_int, c_long, c_ulong};
use std::sync::atomic::{AtomicUsize, Ordering};

static REAL_PRCTL: AtomicUsize = AtomicUsize::new(0);
static REAL_SYSCALL: AtomicUsize = AtomicUsize::new(0);

/// Whether `seccomp(op, flags, args)` sets a mode: strict (op 0, no flags,
/// no argument) or a filter (op 1, a program). What it is not, such as
/// libseccomp's probes for what the kernel supports (strict with flags, a
/// filter without a program: refused with EINVAL or EFAULT), leaves the
/// recording alone. The kernel reads `op` and `flags` as 32-bit values.
fn sets_a_mode(op: c_long, flags: c_long, args: c_long) -> bool {
    match op as u32 {
        0 => flags as u32 == 0 && args == 0,
        1 => args != 0,
        _ => false,
    }
}

/// Look up the C library's functions (at load, from the constructor).
pub(crate) fn resolve() {
    for (slot, name) in [(&REAL_PRCTL, c"prctl"), (&REAL_SYSCALL, c"syscall")] {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name returns the next definition after this library (the C library's) or null.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        slot.store(p, Ordering::Release);
    }
}

/// Finish the recording before the process restricts its system calls.
fn before_seccomp() {
    crate::UNDER_SECCOMP.store(true, Ordering::SeqCst);
    if crate::records_this_process() {
        crate::finish_recording_because(
            "the program entered a seccomp mode (its filter would refuse the recorder's system calls): \
             recording stopped there",
        );
    }
}

/// `prctl(2)` (its variadic arguments are machine words in registers, as
/// these four are).
#[no_mangle]
pub extern "C" fn prctl(option: c_int, a2: c_ulong, a3: c_ulong, a4: c_ulong, a5: c_ulong) -> c_int {
    let Some(p) = crate::exits::real(&REAL_PRCTL, c"prctl") else { return -1 };
    // prctl's modes: 1 strict, 2 a filter (its program in the third word).
    if option == libc::PR_SET_SECCOMP && (a2 as u32 == 1 || (a2 as u32 == 2 && a3 != 0)) {
        before_seccomp();
    }
    // SAFETY: the C library's `prctl`, called with the caller's words.
    let f = unsafe {
        std::mem::transmute::<usize, extern "C" fn(c_int, c_ulong, c_ulong, c_ulong, c_ulong) -> c_int>(p)
    };
    f(option, a2, a3, a4, a5)
}

/// `syscall(2)` (its variadic arguments are machine words in registers, as
/// these six are).
#[no_mangle]
pub extern "C" fn syscall(
    n: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    let Some(p) = crate::exits::real(&REAL_SYSCALL, c"syscall") else { return -1 };
    if n as u32 as c_long == libc::SYS_seccomp && sets_a_mode(a1, a2, a3) {
        before_seccomp();
    }
    // SAFETY: the C library's `syscall`, called with the caller's words.
    let f = unsafe {
        std::mem::transmute::<
            usize,
            extern "C" fn(c_long, c_long, c_long, c_long, c_long, c_long, c_long) -> c_long,
        >(p)
    };
    f(n, a1, a2, a3, a4, a5, a6)
}
