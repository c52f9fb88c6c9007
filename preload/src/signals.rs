//! The program's signal handlers and ours: this library exports `sigaction`,
//! `signal`, `bsd_signal` and `sysv_signal`, so that a program (or a library
//! it loads) that installs a handler for a signal the recorder samples with
//! (SIGTRAP for the perf-event engine, SIGPROF for the timer engines) keeps
//! it without displacing the recorder's: the program's action is kept as the
//! one the recorder chains every signal that is not its own to, and reads
//! back as the program set it (`spulse::__interpose`). LLVM's tools
//! (rust-lld, llvm-symbolizer) install a SIGTRAP handler that takes any
//! SIGTRAP for a crash; without this they died under `spulse record`. Every
//! other signal, and every call made while no recorder handler holds the
//! signal, goes to the C library unchanged.
//!
//! It also exports `pthread_sigmask`, `sigprocmask` and `pthread_create`:
//! while the perf-event engine samples with SIGTRAP, a thread's real mask
//! never blocks it and the program reads back the mask it set
//! (`spulse::__interpose::sigmask`; see `src/recorder/sys/sigmask.rs`).
//!
//! A program that makes the `rt_sigaction` system call itself (Go's runtime,
//! static binaries, which this library is not loaded into anyway) is not
//! seen here; the recorder notices at its next tick that its handler was
//! replaced and stops the engine that signals (see `Stats::warnings`).

use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use spulse::__interpose::{MaskFn, SigactionFn};

/// The C library's `sigaction` (`dlsym(RTLD_NEXT)`), 0 until found.
static REAL: AtomicUsize = AtomicUsize::new(0);

/// Find the C library's `sigaction` and give it to the recorder: called from
/// the constructor, before the recorder starts.
pub(crate) fn init() {
    if let Some(f) = real() {
        spulse::__interpose::set_real_sigaction(f);
    }
}

fn real() -> Option<SigactionFn> {
    let mut p = REAL.load(Ordering::Acquire);
    if p == 0 {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name; it returns
        // the next definition after this library (the C library's) or null.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"sigaction".as_ptr()) } as usize;
        if p == 0 {
            return None;
        }
        REAL.store(p, Ordering::Release);
    }
    // SAFETY: the C library's `sigaction`, which has this signature.
    Some(unsafe { std::mem::transmute::<usize, SigactionFn>(p) })
}

/// `sigaction(2)`, as seen by the program.
///
/// # Safety
/// As `sigaction(2)`.
#[no_mangle]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    // SAFETY: the caller's contract, passed on.
    if let Some(rc) = unsafe { spulse::__interpose::sigaction(sig, act, old) } {
        return rc;
    }
    match real() {
        // SAFETY: the caller's contract, passed on to the C library.
        Some(f) => unsafe { f(sig, act, old) },
        None => {
            // SAFETY: errno is this thread's; ENOSYS says what happened.
            unsafe { *libc::__errno_location() = libc::ENOSYS };
            -1
        }
    }
}

/// `signal`-style installs: `flags` as the C library gives them.
fn install(sig: c_int, handler: libc::sighandler_t, flags: c_int, block_self: bool) -> libc::sighandler_t {
    // SAFETY: zeroed actions are valid values to fill in.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = handler;
    act.sa_flags = flags;
    // SAFETY: sigemptyset/sigaddset initialise the set we own; an invalid
    // `sig` is reported by sigaction below.
    unsafe {
        libc::sigemptyset(&mut act.sa_mask);
        if block_self && sig > 0 && sig < 65 {
            libc::sigaddset(&mut act.sa_mask, sig);
        }
    }
    // SAFETY: valid pointers to our locals.
    if unsafe { sigaction(sig, &act, &mut old) } != 0 {
        return libc::SIG_ERR;
    }
    old.sa_sigaction
}

/// `signal(3)`: BSD semantics, as glibc's (restart, the signal blocked in its handler).
#[no_mangle]
pub extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    install(sig, handler, libc::SA_RESTART, true)
}

/// `bsd_signal(3)`: the same as `signal`.
#[no_mangle]
pub extern "C" fn bsd_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    install(sig, handler, libc::SA_RESTART, true)
}

/// `sysv_signal(3)`: one-shot, not blocked in its handler.
#[no_mangle]
pub extern "C" fn sysv_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    install(sig, handler, libc::SA_RESETHAND | libc::SA_NODEFER, false)
}

/// The C library's `pthread_sigmask` and `sigprocmask` (`dlsym(RTLD_NEXT)`),
/// 0 until found.
static REAL_PTHREAD_SIGMASK: AtomicUsize = AtomicUsize::new(0);
static REAL_SIGPROCMASK: AtomicUsize = AtomicUsize::new(0);

fn real_mask(slot: &AtomicUsize, name: &std::ffi::CStr) -> Option<MaskFn> {
    let mut p = slot.load(Ordering::Acquire);
    if p == 0 {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name; it returns
        // the next definition after this library (the C library's) or null.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
        if p == 0 {
            return None;
        }
        slot.store(p, Ordering::Release);
    }
    // SAFETY: the C library's `pthread_sigmask` or `sigprocmask`, which have
    // this signature.
    Some(unsafe { std::mem::transmute::<usize, MaskFn>(p) })
}

/// Find the C library's mask functions and let the recorder keep SIGTRAP out
/// of the threads' real masks (`recording`: this process is recorded):
/// called from the constructor, before the recorder starts (`dlsym` is not async-signal-safe; a program may call
/// `pthread_sigmask` in a signal handler).
pub(crate) fn init_masks(recording: bool) {
    let a = real_mask(&REAL_PTHREAD_SIGMASK, c"pthread_sigmask");
    let b = real_mask(&REAL_SIGPROCMASK, c"sigprocmask");
    let _ = real_create();
    if recording && a.is_some() && b.is_some() {
        spulse::__interpose::enable_virtual_mask();
    }
}

/// `pthread_sigmask(3)`, as seen by the program: while the perf-event engine
/// samples with SIGTRAP, the thread's real mask never blocks it, and the
/// program reads back the mask it set (`spulse::__interpose::sigmask`).
///
/// # Safety
/// As `pthread_sigmask(3)`.
#[no_mangle]
pub unsafe extern "C" fn pthread_sigmask(
    how: c_int,
    set: *const libc::sigset_t,
    old: *mut libc::sigset_t,
) -> c_int {
    let Some(real) = real_mask(&REAL_PTHREAD_SIGMASK, c"pthread_sigmask") else {
        return libc::ENOSYS;
    };
    // SAFETY: the caller's contract, passed on.
    if let Some(rc) = unsafe { spulse::__interpose::sigmask(real, how, set, old) } {
        return rc;
    }
    // SAFETY: the caller's contract, passed on to the C library.
    unsafe { real(how, set, old) }
}

/// `sigprocmask(2)`: as [`pthread_sigmask`] (it sets the calling thread's
/// mask), returning -1 and setting `errno` on failure.
///
/// # Safety
/// As `sigprocmask(2)`.
#[no_mangle]
pub unsafe extern "C" fn sigprocmask(
    how: c_int,
    set: *const libc::sigset_t,
    old: *mut libc::sigset_t,
) -> c_int {
    let Some(real) = real_mask(&REAL_SIGPROCMASK, c"sigprocmask") else {
        // SAFETY: errno is this thread's; ENOSYS says what happened.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return -1;
    };
    // SAFETY: the caller's contract, passed on.
    if let Some(rc) = unsafe { spulse::__interpose::sigmask(real, how, set, old) } {
        return rc;
    }
    // SAFETY: the caller's contract, passed on to the C library.
    unsafe { real(how, set, old) }
}

/// The type of `pthread_create`.
type CreateFn = unsafe extern "C" fn(
    *mut libc::pthread_t,
    *const libc::pthread_attr_t,
    extern "C" fn(*mut c_void) -> *mut c_void,
    *mut c_void,
) -> c_int;

/// The C library's `pthread_create` (`dlsym(RTLD_NEXT)`), 0 until found.
static REAL_PTHREAD_CREATE: AtomicUsize = AtomicUsize::new(0);

fn real_create() -> Option<CreateFn> {
    let mut p = REAL_PTHREAD_CREATE.load(Ordering::Acquire);
    if p == 0 {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name; it returns
        // the next definition after this library (the C library's default
        // version) or null.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"pthread_create".as_ptr()) } as usize;
        if p == 0 {
            return None;
        }
        REAL_PTHREAD_CREATE.store(p, Ordering::Release);
    }
    // SAFETY: the C library's `pthread_create`, which has this signature.
    Some(unsafe { std::mem::transmute::<usize, CreateFn>(p) })
}

/// What a thread started by [`pthread_create`] runs.
struct Start {
    routine: extern "C" fn(*mut c_void) -> *mut c_void,
    arg: *mut c_void,
}

extern "C" fn start_blocking_trap(p: *mut c_void) -> *mut c_void {
    // SAFETY: `p` is the `Box<Start>` leaked by `pthread_create` for this
    // thread alone.
    let start = unsafe { Box::from_raw(p as *mut Start) };
    spulse::__interpose::inherit_blocks_trap();
    (start.routine)(start.arg)
}

/// `pthread_create(3)`: a thread created by one whose program blocks SIGTRAP
/// (kept out of its real mask: see [`pthread_sigmask`]) starts with the same
/// view, as its mask is its creator's; every other call is passed on as is.
///
/// # Safety
/// As `pthread_create(3)`.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    routine: extern "C" fn(*mut c_void) -> *mut c_void,
    arg: *mut c_void,
) -> c_int {
    let Some(real) = real_create() else { return libc::ENOSYS };
    if !spulse::__interpose::program_blocks_trap() {
        // SAFETY: the caller's contract, passed on to the C library.
        return unsafe { real(thread, attr, routine, arg) };
    }
    let start = Box::into_raw(Box::new(Start { routine, arg })) as *mut c_void;
    // SAFETY: the caller's contract; our routine takes the box it is given.
    let rc = unsafe { real(thread, attr, start_blocking_trap, start) };
    if rc != 0 {
        // SAFETY: no thread was created: the box is still ours.
        drop(unsafe { Box::from_raw(start as *mut Start) });
    }
    rc
}
