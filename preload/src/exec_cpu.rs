//! The CPU time an image of a process spent before it `exec`s the next one.
//!
//! A process's CPU counters run on across `exec`, so the next image's
//! constructor, which reports the CPU spent "before the recorder started"
//! (exec, the loader, earlier constructors), counted every earlier image's
//! CPU too, though their recorders had sampled it: a program that burnt
//! 800 ms and exec'd another was said to have spent 800 ms unsampled. Under
//! `spulse record`, the interposed `exec` functions write the CPU used so far
//! into `<pid>.cpu-at-exec` in the collector's directory ([`note`]:
//! async-signal-safe, as `exec` may be called from a signal handler), and
//! the next image's constructor takes it off its own figure and removes the
//! file ([`take_earlier`]). The collector reads no such file.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

/// The note's path (NUL-terminated), set when the recorder of this process
/// starts under `spulse record` ([`set_note_path`]); read by [`note`].
static PATH: [AtomicU8; 512] = [const { AtomicU8::new(0) }; 512];
static PATH_LEN: AtomicUsize = AtomicUsize::new(0);

/// Where [`note`] writes (too long a path: nowhere).
pub(crate) fn set_note_path(path: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    PATH_LEN.store(0, Ordering::SeqCst);
    if bytes.len() >= PATH.len() || bytes.contains(&0) {
        return;
    }
    for (slot, &b) in PATH.iter().zip(bytes) {
        slot.store(b, Ordering::Relaxed);
    }
    PATH[bytes.len()].store(0, Ordering::Relaxed);
    PATH_LEN.store(bytes.len(), Ordering::SeqCst);
}

/// Write the CPU this process used so far (microseconds, user then system)
/// into the note. Async-signal-safe: `getrusage`, `open`, `write`, `close`,
/// stack buffers only.
pub(crate) fn note() {
    let len = PATH_LEN.load(Ordering::SeqCst);
    if len == 0 {
        return;
    }
    let mut path = [0u8; 512];
    for (b, slot) in path.iter_mut().zip(&PATH[..len]) {
        *b = slot.load(Ordering::Relaxed);
    }
    // SAFETY: an all-zero rusage is valid for getrusage to overwrite.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF into the valid `ru`.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return;
    }
    let us = |t: libc::timeval| (t.tv_sec.max(0) as u64) * 1_000_000 + t.tv_usec.max(0) as u64;
    let mut text = [0u8; 48];
    let mut n = put(&mut text, 0, us(ru.ru_utime));
    text[n] = b' ';
    n = put(&mut text, n + 1, us(ru.ru_stime));
    text[n] = b'\n';
    // SAFETY: `path` is NUL-terminated (`len` < 512 bytes copied into zeros); the descriptor is ours until the close below, and `text[..=n]` is initialised.
    unsafe {
        let fd = libc::open(
            path.as_ptr().cast(),
            libc::O_WRONLY
                | libc::O_CREAT
                | libc::O_TRUNC
                | libc::O_NOFOLLOW
                | libc::O_CLOEXEC
                | libc::O_NONBLOCK,
            0o600,
        );
        if fd >= 0 {
            libc::write(fd, text.as_ptr().cast(), n + 1);
            libc::close(fd);
        }
    }
}

/// `v` in decimal into `buf` from `at`; the index after it.
pub(crate) fn put(buf: &mut [u8], at: usize, v: u64) -> usize {
    let mut digits = [0u8; 20];
    let (mut i, mut v) = (0, v);
    loop {
        digits[i] = b'0' + (v % 10) as u8;
        i += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for (k, d) in digits[..i].iter().rev().enumerate() {
        buf[at + k] = *d;
    }
    at + i
}

/// `user` and `sys` (this image's CPU so far, microseconds) less what the
/// image before it noted at its `exec`, if this process exec'd under
/// `spulse record`; the note is removed.
pub(crate) fn take_earlier(user: u64, sys: u64) -> (u64, u64) {
    let Some(dir) = crate::handoff::dir().and_then(|d| crate::handoff::own_dir(d).ok()) else {
        return (user, sys);
    };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let path = dir.join(format!("{pid}.cpu-at-exec"));
    let Ok(meta) = std::fs::symlink_metadata(&path) else { return (user, sys) };
    if !meta.is_file() || meta.len() > 64 {
        return (user, sys);
    }
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    let _ = std::fs::remove_file(&path);
    let mut words = text.split_ascii_whitespace().map(|w| w.parse::<u64>().ok());
    match (words.next().flatten(), words.next().flatten()) {
        (Some(u), Some(s)) => (user.saturating_sub(u), sys.saturating_sub(s)),
        _ => (user, sys),
    }
}
