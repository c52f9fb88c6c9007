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
//!
//! The library also exports `spulse_preload_live_spool`, which says where its
//! recording of this process is being written (the current segment of a
//! rotating one) and how often it is flushed: the `http` endpoint of a spulse
//! copy in the program cuts its profile windows from that spool instead of
//! starting a recorder of its own ([`preload_live_spool`]).

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

/// Name of the function the preload library exports to say where its
/// recording of this process is written (see [`preload_live_spool`]).
const LIVE_SPOOL_SYMBOL: &std::ffi::CStr = c"spulse_preload_live_spool";

/// The signature of `spulse_preload_live_spool` (`preload/src/lib.rs`):
/// writes the current spool path's bytes into `buf` when they fit in `cap`
/// and the flush interval in microseconds into `*flush_us`; returns the
/// path's length (0: nothing recorded now).
type LiveSpoolFn = unsafe extern "C" fn(buf: *mut u8, cap: usize, flush_us: *mut u64) -> usize;

/// The longest spool path taken from the preload library.
const LIVE_SPOOL_PATH_MAX: usize = 64 * 1024;

/// For `libspulse_preload.so` only: the spool this copy of spulse's recorder
/// writes now (the current segment of a rotating recording) and its flush
/// interval. The library exports it to other spulse copies in the process as
/// `spulse_preload_live_spool`.
pub fn live_spool_of_this_copy() -> Option<(std::path::PathBuf, std::time::Duration)> {
    crate::recorder::live_spool()
}

/// When the preload library records this process: `Ok` with the spool it
/// writes now and its flush interval (the `http` endpoint cuts its windows
/// from it), or `Err` saying why it cannot be read. `None` when the preload
/// library does not record this process.
#[cfg_attr(not(feature = "http"), allow(dead_code))]
pub(crate) fn preload_live_spool() -> Option<Result<(std::path::PathBuf, std::time::Duration), String>> {
    use std::os::unix::ffi::OsStrExt;
    let pid = recorded_by_preload()?;
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name has no other
    // precondition; it runs on the caller's thread (never in a signal handler).
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, LIVE_SPOOL_SYMBOL.as_ptr()) };
    if sym.is_null() {
        return Some(Err(format!(
            "process {pid} is recorded by libspulse_preload.so, which does not say where its spool is \
             (a library built from an older spulse); the profile cannot be cut from that recording"
        )));
    }
    // SAFETY: the preload crate defines `spulse_preload_live_spool` with
    // exactly this signature (`LiveSpoolFn`); the library is preloaded, never
    // unloaded, so the function stays valid.
    let f = unsafe { std::mem::transmute::<*mut libc::c_void, LiveSpoolFn>(sym) };
    let mut buf = vec![0u8; 4096];
    for _ in 0..3 {
        let mut flush_us = 0u64;
        // SAFETY: `buf` is valid for `buf.len()` writable bytes and
        // `flush_us` for one u64; the function writes no more than that.
        let len = unsafe { f(buf.as_mut_ptr(), buf.len(), &mut flush_us) };
        if len == 0 {
            return Some(Err(format!(
                "process {pid} is marked as recorded by libspulse_preload.so, but its recorder writes no spool now"
            )));
        }
        if len <= buf.len() {
            buf.truncate(len);
            let path = std::path::PathBuf::from(std::ffi::OsStr::from_bytes(&buf));
            return Some(Ok((path, std::time::Duration::from_micros(flush_us))));
        }
        if len > LIVE_SPOOL_PATH_MAX {
            return Some(Err(format!(
                "libspulse_preload.so's spool path is {len} bytes long (at most {LIVE_SPOOL_PATH_MAX} are read)"
            )));
        }
        // The path grew (a rotation) or did not fit: again, with room.
        buf.resize(len, 0);
    }
    Some(Err("libspulse_preload.so's spool path kept changing while it was read".into()))
}

/// Name of the function the preload library exports to ask its recorder to
/// write the waits still open (see [`preload_split_off_cpu`]).
const SPLIT_SYMBOL: &std::ffi::CStr = c"spulse_preload_split_off_cpu";

/// When the preload library records this process: ask its recorder to write
/// the part up to `at_ns` (unix ns) of every wait still open (off-CPU mode;
/// `crate::recorder::request_off_cpu_split` in that copy). Nothing if the
/// library is older and does not export it.
#[cfg_attr(not(feature = "http"), allow(dead_code))]
pub(crate) fn preload_split_off_cpu(at_ns: u64) {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name has no other
    // precondition; it runs on the caller's thread (never in a signal handler).
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, SPLIT_SYMBOL.as_ptr()) };
    if sym.is_null() {
        return;
    }
    // SAFETY: the preload crate defines `spulse_preload_split_off_cpu` as an
    // `extern "C" fn(u64)` that only stores the value atomically; the library
    // is preloaded and never unloaded.
    let f: extern "C" fn(u64) = unsafe { std::mem::transmute::<*mut libc::c_void, extern "C" fn(u64)>(sym) };
    f(at_ns);
}
