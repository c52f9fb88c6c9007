//! The C library's user and group changes (`setuid` ... `setgroups`),
//! interposed: in a process of several threads the C library makes each such
//! call in every thread (it signals each one to change its own credentials)
//! and aborts the process if they do not all succeed alike ("failed to
//! change credentials consistently"). Credentials are per thread: a program
//! that gave only its calling thread some capabilities (`setpriv`, which sets
//! `PR_SET_KEEPCAPS` and raises its own effective set around a change of
//! user) then aborts on its next change, because the recorder's writer
//! thread, which kept the credentials it was created with, is refused. Under
//! `spulse record`, `setpriv --reuid=... --regid=... --clear-groups CMD`
//! died with SIGABRT.
//!
//! So before such a call in the process this library records, the
//! writer's capabilities are compared with the calling thread's (`capget`
//! of both: no allocation, no lock, since these calls are async-signal-safe
//! and may come from a signal handler). Where they are alike the call goes
//! straight on: every thread changes, the recording goes on. Where they
//! differ, the recording is finished (its writer joined), the call made, and
//! a new recording started (its writer a copy of the calling thread's
//! credentials from then on; under `spulse record` it writes into the
//! directory of its new user, see `handoff.rs`). A difference among the
//! program's own threads is the program's: it aborts as unrecorded.
//!
//! Before a call that changes the effective user of a root process, the
//! directory that user's recordings go to under a root `spulse record` is
//! made (`handoff::prepare`).

use std::ffi::{c_int, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The C library's functions, looked up at load ([`resolve`]), in the order
/// of [`NAMES`].
static REAL: [AtomicUsize; 9] = [const { AtomicUsize::new(0) }; 9];

const NAMES: [&CStr; 9] = [
    c"setuid",
    c"setgid",
    c"seteuid",
    c"setegid",
    c"setreuid",
    c"setregid",
    c"setresuid",
    c"setresgid",
    c"setgroups",
];

/// Look up the C library's functions (at load, from the constructor: not
/// later, since a `vfork` child may make these calls).
pub(crate) fn resolve() {
    for (slot, name) in REAL.iter().zip(NAMES) {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name returns the next definition after this library (the C library's) or null.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        slot.store(p, Ordering::Release);
    }
}

/// Make `call` (which calls the C library's function number `i`), with the
/// recording out of the way if the writer's capabilities differ from the
/// calling thread's.
fn around(i: usize, euid: Option<Id>, call: impl FnOnce(usize) -> c_int) -> c_int {
    let Some(p) = crate::exits::real(&REAL[i], NAMES[i]) else { return -1 };
    if let Some(uid) = euid {
        // Root about to become another user: a directory for that user's
        // recordings (see `handoff.rs`).
        crate::handoff::prepare(uid);
    }
    if !crate::records_this_process() || writer_alike() {
        return call(p);
    }
    crate::finish_recording();
    let r = call(p);
    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    crate::record_again();
    // SAFETY: sets this thread's errno, an lvalue the C library provides.
    unsafe { *libc::__errno_location() = e };
    r
}

/// Whether the recorder's writer thread has the calling thread's
/// capabilities (effective, permitted, inheritable: what decides whether a
/// change of user or group is allowed, and what it leaves; user and group
/// ids are the same in every thread after each broadcast). True when
/// either cannot be read. Async-signal-safe and allocation-free (`capget`
/// of two threads): these calls may be made from a signal handler.
fn writer_alike() -> bool {
    let writer = spulse::__preload_writer_tid();
    if writer == 0 {
        return true;
    }
    match (caps(0), caps(writer as i32)) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

/// Thread `tid`'s capability sets (0: the calling thread), as
/// `capget(_LINUX_CAPABILITY_VERSION_3)` gives them.
fn caps(tid: i32) -> Option<[u32; 6]> {
    // struct __user_cap_header_struct { u32 version; int pid; }
    let mut header: [u32; 2] = [0x2008_0522, tid as u32];
    let mut data = [0u32; 6];
    // SAFETY: capget reads the header and writes two 12-byte data structs (version 3) into `data`, both ours and live for the call.
    let r = unsafe { libc::syscall(libc::SYS_capget, header.as_mut_ptr(), data.as_mut_ptr()) };
    (r == 0).then_some(data)
}

type Id = libc::uid_t;

macro_rules! interpose {
    ($i:expr, $name:ident($($arg:ident: $ty:ty),*), $euid:expr) => {
        #[doc = concat!("`", stringify!($name), "`, as the C library's (see the module doc).")]
        #[no_mangle]
        pub extern "C" fn $name($($arg: $ty),*) -> c_int {
            around($i, $euid, |p| {
                // SAFETY: the C library's function of this name and signature.
                let f = unsafe { std::mem::transmute::<usize, extern "C" fn($($ty),*) -> c_int>(p) };
                f($($arg),*)
            })
        }
    };
}

/// The effective user a `set*uid` call asks for (`-1`: unchanged).
fn asked(e: Id) -> Option<Id> {
    (e != Id::MAX).then_some(e)
}

interpose!(0, setuid(uid: Id), asked(uid));
interpose!(1, setgid(gid: Id), None);
interpose!(2, seteuid(uid: Id), asked(uid));
interpose!(3, setegid(gid: Id), None);
interpose!(4, setreuid(r: Id, e: Id), asked(e));
interpose!(5, setregid(r: Id, e: Id), None);
interpose!(6, setresuid(r: Id, e: Id, s: Id), asked(e));
interpose!(7, setresgid(r: Id, e: Id, s: Id), None);

/// `setgroups`, as the C library's (see the module doc).
///
/// # Safety
/// As `setgroups(2)`: `list` holds `size` group ids.
#[no_mangle]
pub unsafe extern "C" fn setgroups(size: libc::size_t, list: *const libc::gid_t) -> c_int {
    type SetGroups = unsafe extern "C" fn(libc::size_t, *const libc::gid_t) -> c_int;
    // SAFETY: `p` is the C library's `setgroups`, of this signature, called with the caller's `size` and `list` (its contract, passed on).
    around(8, None, |p| unsafe { std::mem::transmute::<usize, SetGroups>(p)(size, list) })
}
