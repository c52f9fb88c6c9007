//! Whether `libspulse_preload.so` (the `preload/` crate, loaded by
//! `LD_PRELOAD` or `spulse record`) already records this process.
//!
//! The library carries its own copy of this crate, so the two copies share no
//! Rust statics: it publishes the pid it records in the exported symbol
//! `spulse_preload_recorded_pid` (a `u32`, 0 when it records nothing), and
//! [`RecorderBuilder::start`](crate::RecorderBuilder::start) looks the symbol up
//! with `dlsym` before creating anything. A match with this process's pid
//! means the program is recorded already: the embedded start is refused with
//! an `Err` and the program runs on, recorded once. The pid comparison keeps a
//! forked child (which inherits the parent's value until the library records
//! the child itself) from being refused by its parent's mark.

use std::sync::atomic::{AtomicU32, Ordering};

/// Name of the symbol the preload library exports.
const SYMBOL: &std::ffi::CStr = c"spulse_preload_recorded_pid";

/// The pid of this process if the preload library records it.
pub(crate) fn recorded_by_preload() -> Option<u32> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name has no other
    // precondition; it runs on the caller's thread (never in a signal handler).
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, SYMBOL.as_ptr()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: the preload crate defines the symbol as a `static AtomicU32`,
    // which lives as long as the library stays loaded (it is preloaded, never
    // unloaded), and is only ever accessed atomically.
    let published = unsafe { &*(sym as *const AtomicU32) }.load(Ordering::SeqCst);
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u32;
    (published != 0 && published == pid).then_some(pid)
}
