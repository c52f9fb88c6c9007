//! A blocked thread's stack, read without a signal: the off-CPU mode's
//! capture (`pairing.rs` says when a thread is blocked).
//!
//! `/proc/self/task/<tid>/syscall` gives a thread that is not running the
//! system call it is in, its arguments, and its user stack pointer and
//! program counter at the kernel entry; the writer copies the stack from that
//! stack pointer upwards with `process_vm_readv` on its own process (which
//! fails with `EFAULT` on an unmapped page instead of faulting, and stops at
//! the end of the mapping: a partial copy is a shorter stack) and unwinds the
//! copy from pc/sp (`stack_sampler.rs`). No signal is sent and the thread is
//! not woken.
//!
//! The thread must not run while its stack is copied, or the copy mixes two
//! stacks. [`capture`] gives the times just before the `syscall` read and
//! just after the copy; the caller keeps the capture only if the thread's
//! switch records (`perf_switch.rs`) show it off the CPU over that whole
//! window: switched out before it began, and not switched in before it
//! ended (the kernel stamps a switch-in before the thread returns to user
//! space, so its stack cannot change before that stamp). That costs nothing
//! here. It needs the switch-in records, so while records are being lost
//! (ring full) the capture also proves it on its own, as it always did
//! before: the number of times the thread was scheduled in (the third field
//! of `/proc/self/task/<tid>/schedstat`) is read before and after, and must
//! not change (two more `/proc` opens, two thirds of a capture's `/proc`
//! cost). The `syscall` file needs the process to be dumpable
//! (as a ptrace read would); a non-dumpable process gets `EACCES` (unless
//! the recorder runs as root), reported by `info`. A thread of a dumpable
//! process that gives `EACCES` is exiting, and is counted as gone ([`missed`]).

use std::io;

/// Where a blocked thread is: its system call and user registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Blocked {
    /// System call number; `None` when blocked outside one (a page fault).
    pub nr: Option<u64>,
    pub sp: u64,
    pub pc: u64,
}

/// The most bytes read of a `/proc` file here (`syscall` is under 200).
const SMALL: usize = 512;

/// Read thread `tid`'s small `/proc/self/task/<tid>/<file>` into `buf` (at
/// most [`SMALL`] bytes): one `open`, one `read`, one `close`, and no
/// allocation once `buf` has grown to [`SMALL`] (the `std::fs` path built a
/// `String`, sized its buffer with an `fstat`, and read twice to see the
/// end: a sixth of the writer's time under 100,000 blockings a second went
/// to these reads). A `/proc` file of one record gives it whole to one read.
fn read_task_file(tid: u32, file: &str, buf: &mut Vec<u8>) -> io::Result<()> {
    use std::io::Write;
    let mut path = [0u8; 64];
    let room = path.len() - 1; // the last byte stays NUL
    let mut w = &mut path[..room];
    write!(w, "/proc/self/task/{}/{file}", super::procfs::task_name(tid))
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    buf.clear();
    buf.reserve(SMALL);
    let fd = loop {
        // SAFETY: `path` is NUL-terminated (its last byte is never written);
        // the descriptor is ours from here until the `close` below.
        let fd = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd >= 0 {
            break fd;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let (n, err) = loop {
        // SAFETY: `buf` has room for `SMALL` bytes (reserved above), which
        // `read` writes at most.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), SMALL) };
        let err = io::Error::last_os_error();
        if n >= 0 || err.kind() != io::ErrorKind::Interrupted {
            break (n, err);
        }
    };
    // SAFETY: `fd` is the descriptor we opened above, closed once.
    unsafe { libc::close(fd) };
    if n < 0 {
        return Err(err);
    }
    // SAFETY: `read` initialised the first `n <= SMALL` bytes.
    unsafe { buf.set_len(n as usize) };
    Ok(())
}

/// Parse `/proc/<tid>/syscall`: `running`, `-1 sp pc`, or `nr a0 .. a5 sp pc`
/// (hexadecimal but for the number). `Ok(None)` while the thread runs.
pub(crate) fn parse_syscall(text: &str) -> Option<Option<Blocked>> {
    let mut it = text.split_ascii_whitespace();
    let first = it.next()?;
    if first == "running" {
        return Some(None);
    }
    let hex = |s: &str| u64::from_str_radix(s.strip_prefix("0x")?, 16).ok();
    let nr: i64 = first.parse().ok()?;
    let rest: Vec<&str> = it.collect();
    let (sp, pc) = match (nr, rest.len()) {
        (-1, 2) => (hex(rest[0])?, hex(rest[1])?),
        (n, 8) if n >= 0 => (hex(rest[6])?, hex(rest[7])?),
        _ => return None,
    };
    Some(Some(Blocked { nr: u64::try_from(nr).ok(), sp, pc }))
}

/// Times `tid` was scheduled in (`schedstat`'s third field).
fn timeslices(tid: u32, buf: &mut Vec<u8>) -> io::Result<u64> {
    read_task_file(tid, "schedstat", buf)?;
    std::str::from_utf8(buf)
        .ok()
        .and_then(|s| s.split_ascii_whitespace().nth(2)?.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unexpected schedstat"))
}

/// Why a capture gave nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Missed {
    /// The thread ran (or exited) meanwhile: not blocked any more.
    Ran,
    /// The `/proc` files could not be read (`EACCES`: the process is not
    /// dumpable), or the stack not copied (`process_vm_readv` refused).
    Refused(i32),
}

/// A capture of a blocked thread: its registers, the bytes of its stack
/// copied, and the window it was taken in (unix ns, the clock of the switch
/// records): `from_ns` before `syscall` was read, `to_ns` after the copy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Taken {
    pub blocked: Blocked,
    pub copied: usize,
    pub from_ns: u64,
    pub to_ns: u64,
}

/// Capture the stack of blocked thread `tid`: its registers, and up to
/// `out.len()` bytes of its stack from `sp`. The copy is of one stack only
/// if the thread did not run between [`Taken::from_ns`] and
/// [`Taken::to_ns`], which the caller checks (see the module doc); with
/// `schedstat`, the capture checks it too (`Missed::Ran` if it ran).
pub(crate) fn capture(tid: u32, out: &mut [u8], buf: &mut Vec<u8>, schedstat: bool) -> Result<Taken, Missed> {
    let refused = |e: io::Error| {
        if e.kind() == io::ErrorKind::NotFound {
            Missed::Ran
        } else {
            missed(e.raw_os_error().unwrap_or(0), process_dumpable)
        }
    };
    let before = if schedstat { Some(timeslices(tid, buf).map_err(refused)?) } else { None };
    let from_ns = super::now_ns();
    read_task_file(tid, "syscall", buf).map_err(refused)?;
    let text = std::str::from_utf8(buf).map_err(|_| Missed::Ran)?;
    let Some(Some(blocked)) = parse_syscall(text) else { return Err(Missed::Ran) };
    let copied = copy_stack(blocked.sp, out).map_err(refused)?;
    let to_ns = super::now_ns();
    if let Some(before) = before {
        if timeslices(tid, buf).map_err(refused)? != before {
            return Err(Missed::Ran);
        }
    }
    Ok(Taken { blocked, copied, from_ns, to_ns })
}

/// Why a read of thread `tid`'s `/proc` files or stack failed with `errno`.
///
/// A thread that is exiting has already given up its memory (`exit_mm`)
/// while it can still be switched out (blocked in the rest of its exit);
/// the kernel then makes its `/proc` files root's, as it does a
/// non-dumpable process's, and a reader that is not root gets `EACCES`. In a
/// process that is dumpable, that is the only way to get `EACCES` (or
/// `EPERM`) on our own threads: the thread is going, not refused to us (an
/// unprivileged recording of 2,000 short threads had one such capture, said
/// to be "not dumpable" before).
fn missed(errno: i32, dumpable: impl Fn() -> bool) -> Missed {
    match errno {
        libc::ESRCH | libc::ENOENT => Missed::Ran,
        libc::EACCES | libc::EPERM if dumpable() => Missed::Ran,
        e => Missed::Refused(e),
    }
}

/// Whether this process is dumpable (`PR_GET_DUMPABLE` is 1, "user").
fn process_dumpable() -> bool {
    // SAFETY: PR_GET_DUMPABLE takes no further argument and only returns a value.
    unsafe { libc::prctl(libc::PR_GET_DUMPABLE) == 1 }
}

/// Copy memory of this process from `addr` into `out` with
/// `process_vm_readv`: unmapped memory is an error or a short count, never
/// a fault. Returns the bytes copied (those before the first unmapped page).
pub(crate) fn copy_stack(addr: u64, out: &mut [u8]) -> io::Result<usize> {
    if out.is_empty() {
        return Ok(0);
    }
    let local = libc::iovec { iov_base: out.as_mut_ptr() as *mut libc::c_void, iov_len: out.len() };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: out.len() };
    // SAFETY: `local` describes `out`, which we own and may write; `remote`
    // is only read by the kernel, which checks it (EFAULT, never a fault here).
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// The name of system call `nr` of this architecture, for the blocking
/// system calls (and a few common others); `None` for the rest.
pub(crate) fn syscall_name(nr: u64) -> Option<&'static str> {
    if let Some((_, s)) = SYSCALLS.iter().find(|(n, _)| *n == nr) {
        return Some(s);
    }
    MORE.iter().chain(MORE_ARCH).find(|(n, _)| *n as u64 == nr).map(|(_, s)| *s)
}

/// System calls a thread is found in less often (process creation, memory
/// and file management that can wait on I/O or locks), by the C library's
/// numbers for this architecture: `make` forking children showed `[blocked:
/// syscall 435]` before they had names.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const MORE: &[(libc::c_long, &str)] = &[
    (libc::SYS_clone, "clone"),
    (libc::SYS_clone3, "clone3"),
    (libc::SYS_execve, "execve"),
    (libc::SYS_execveat, "execveat"),
    (libc::SYS_exit, "exit"),
    (libc::SYS_exit_group, "exit_group"),
    (libc::SYS_fcntl, "fcntl"),
    (libc::SYS_ioctl, "ioctl"),
    (libc::SYS_mmap, "mmap"),
    (libc::SYS_munmap, "munmap"),
    (libc::SYS_mremap, "mremap"),
    (libc::SYS_mprotect, "mprotect"),
    (libc::SYS_msync, "msync"),
    (libc::SYS_madvise, "madvise"),
    (libc::SYS_brk, "brk"),
    (libc::SYS_mlock, "mlock"),
    (libc::SYS_mlockall, "mlockall"),
    (libc::SYS_lseek, "lseek"),
    (libc::SYS_fstat, "fstat"),
    (libc::SYS_newfstatat, "newfstatat"),
    (libc::SYS_statx, "statx"),
    (libc::SYS_getdents64, "getdents64"),
    (libc::SYS_truncate, "truncate"),
    (libc::SYS_ftruncate, "ftruncate"),
    (libc::SYS_fallocate, "fallocate"),
    (libc::SYS_sendfile, "sendfile"),
    (libc::SYS_splice, "splice"),
    (libc::SYS_tee, "tee"),
    (libc::SYS_vmsplice, "vmsplice"),
    (libc::SYS_sync_file_range, "sync_file_range"),
    (libc::SYS_syncfs, "syncfs"),
    (libc::SYS_copy_file_range, "copy_file_range"),
    (libc::SYS_preadv, "preadv"),
    (libc::SYS_pwritev, "pwritev"),
    (libc::SYS_preadv2, "preadv2"),
    (libc::SYS_pwritev2, "pwritev2"),
    (libc::SYS_openat2, "openat2"),
    (libc::SYS_close_range, "close_range"),
    (libc::SYS_mkdirat, "mkdirat"),
    (libc::SYS_unlinkat, "unlinkat"),
    (libc::SYS_renameat2, "renameat2"),
    (libc::SYS_socket, "socket"),
    (libc::SYS_shutdown, "shutdown"),
    (libc::SYS_epoll_ctl, "epoll_ctl"),
    (libc::SYS_kill, "kill"),
    (libc::SYS_tgkill, "tgkill"),
    (libc::SYS_ptrace, "ptrace"),
    (libc::SYS_process_vm_readv, "process_vm_readv"),
    (libc::SYS_process_vm_writev, "process_vm_writev"),
    (libc::SYS_getrandom, "getrandom"),
];
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const MORE: &[(libc::c_long, &str)] = &[];

/// The same, for system calls x86_64 has and aarch64 does not.
#[cfg(target_arch = "x86_64")]
const MORE_ARCH: &[(libc::c_long, &str)] = &[
    (libc::SYS_fork, "fork"),
    (libc::SYS_vfork, "vfork"),
    (libc::SYS_open, "open"),
    (libc::SYS_creat, "creat"),
    (libc::SYS_stat, "stat"),
    (libc::SYS_lstat, "lstat"),
    (libc::SYS_access, "access"),
    (libc::SYS_readlink, "readlink"),
    (libc::SYS_rename, "rename"),
    (libc::SYS_mkdir, "mkdir"),
    (libc::SYS_rmdir, "rmdir"),
    (libc::SYS_unlink, "unlink"),
    (libc::SYS_getdents, "getdents"),
    (libc::SYS_renameat, "renameat"),
];
#[cfg(not(target_arch = "x86_64"))]
const MORE_ARCH: &[(libc::c_long, &str)] = &[];

#[cfg(target_arch = "x86_64")]
const SYSCALLS: &[(u64, &str)] = &[
    (0, "read"),
    (1, "write"),
    (3, "close"),
    (7, "poll"),
    (17, "pread64"),
    (18, "pwrite64"),
    (19, "readv"),
    (20, "writev"),
    (23, "select"),
    (24, "sched_yield"),
    (34, "pause"),
    (35, "nanosleep"),
    (42, "connect"),
    (43, "accept"),
    (44, "sendto"),
    (45, "recvfrom"),
    (46, "sendmsg"),
    (47, "recvmsg"),
    (61, "wait4"),
    (65, "semop"),
    (69, "msgsnd"),
    (70, "msgrcv"),
    (73, "flock"),
    (74, "fsync"),
    (75, "fdatasync"),
    (128, "rt_sigtimedwait"),
    (130, "rt_sigsuspend"),
    (162, "sync"),
    (202, "futex"),
    (208, "io_getevents"),
    (220, "semtimedop"),
    (230, "clock_nanosleep"),
    (232, "epoll_wait"),
    (243, "mq_timedreceive"),
    (247, "waitid"),
    (257, "openat"),
    (270, "pselect6"),
    (271, "ppoll"),
    (281, "epoll_pwait"),
    (288, "accept4"),
    (299, "recvmmsg"),
    (307, "sendmmsg"),
    (426, "io_uring_enter"),
    (441, "epoll_pwait2"),
    (449, "futex_wait"),
    (455, "futex_waitv"),
];

#[cfg(target_arch = "aarch64")]
const SYSCALLS: &[(u64, &str)] = &[
    (17, "getcwd"),
    (32, "flock"),
    (56, "openat"),
    (57, "close"),
    (63, "read"),
    (64, "write"),
    (65, "readv"),
    (66, "writev"),
    (67, "pread64"),
    (68, "pwrite64"),
    (72, "pselect6"),
    (73, "ppoll"),
    (81, "sync"),
    (82, "fsync"),
    (83, "fdatasync"),
    (95, "waitid"),
    (98, "futex"),
    (101, "nanosleep"),
    (115, "clock_nanosleep"),
    (124, "sched_yield"),
    (133, "rt_sigsuspend"),
    (137, "rt_sigtimedwait"),
    (180, "mq_timedreceive"),
    (188, "msgrcv"),
    (189, "msgsnd"),
    (192, "semtimedop"),
    (193, "semop"),
    (202, "accept"),
    (203, "connect"),
    (206, "sendto"),
    (207, "recvfrom"),
    (211, "sendmsg"),
    (212, "recvmsg"),
    (22, "epoll_pwait"),
    (242, "accept4"),
    (243, "recvmmsg"),
    (260, "wait4"),
    (269, "sendmmsg"),
    (426, "io_uring_enter"),
    (441, "epoll_pwait2"),
    (449, "futex_wait"),
    (455, "futex_waitv"),
];

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const SYSCALLS: &[(u64, &str)] = &[];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_creation_and_file_calls_have_names() {
        assert_eq!(syscall_name(libc::SYS_clone3 as u64), Some("clone3"));
        assert_eq!(syscall_name(libc::SYS_clone as u64), Some("clone"));
        assert_eq!(syscall_name(libc::SYS_fcntl as u64), Some("fcntl"));
        assert_eq!(syscall_name(libc::SYS_futex as u64), Some("futex"));
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(syscall_name(58), Some("vfork"));
            assert_eq!(syscall_name(435), Some("clone3"));
        }
        // Every number has one name.
        let all: Vec<(u64, &str)> = SYSCALLS
            .iter()
            .copied()
            .chain(MORE.iter().chain(MORE_ARCH).map(|&(n, s)| (n as u64, s)))
            .collect();
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert!(a.0 != b.0 || a.1 == b.1, "{} is both {} and {}", a.0, a.1, b.1);
            }
        }
    }

    #[test]
    fn syscall_lines_parse() {
        assert_eq!(parse_syscall("running\n"), Some(None));
        let b = parse_syscall("202 0x7f00 0x80 0x1 0x0 0x0 0x0 0x7ffd1000 0x7f2000\n").unwrap().unwrap();
        assert_eq!(b, Blocked { nr: Some(202), sp: 0x7ffd1000, pc: 0x7f2000 });
        let f = parse_syscall("-1 0x7ffd1000 0x7f2000\n").unwrap().unwrap();
        assert_eq!(f.nr, None);
        assert_eq!(parse_syscall("202 0x1"), None);
        assert_eq!(parse_syscall(""), None);
        assert_eq!(parse_syscall("x 0x1 0x2"), None);
    }

    #[test]
    fn an_exiting_thread_is_gone_not_refused() {
        // EACCES in a dumpable process: the thread is exiting (its /proc
        // files are root's once its memory is gone).
        assert_eq!(missed(libc::EACCES, || true), Missed::Ran);
        assert_eq!(missed(libc::EPERM, || true), Missed::Ran);
        // In a non-dumpable one: refused, and said.
        assert_eq!(missed(libc::EACCES, || false), Missed::Refused(libc::EACCES));
        assert_eq!(missed(libc::ESRCH, || false), Missed::Ran);
        // Anything else is a refusal, whatever the process.
        assert_eq!(missed(libc::EFAULT, || true), Missed::Refused(libc::EFAULT));
        // This test process is dumpable (it runs as any other).
        assert!(process_dumpable());
    }

    #[test]
    fn a_sleeping_thread_is_captured_without_waking_it() {
        let (tx, rx) = std::sync::mpsc::channel::<u32>();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::spawn(move || {
            tx.send(super::super::gettid()).unwrap();
            let _ = stop_rx.recv();
        });
        let tid = rx.recv().unwrap();
        let mut out = vec![0u8; 16 << 10];
        let mut buf = Vec::new();
        let mut got = None;
        for _ in 0..200 {
            match capture(tid, &mut out, &mut buf, true) {
                Ok(c) => {
                    got = Some(c);
                    break;
                }
                Err(Missed::Ran) => std::thread::sleep(std::time::Duration::from_millis(5)),
                // An emulator (qemu-user) may not give these files or calls.
                Err(Missed::Refused(errno)) => {
                    eprintln!("SKIPPED: capture refused here (errno {errno})");
                    stop_tx.send(()).unwrap();
                    h.join().unwrap();
                    return;
                }
            }
        }
        let t = got.expect("the blocked thread was never captured");
        let (b, n) = (t.blocked, t.copied);
        assert!(n >= 64, "copied {n} bytes");
        assert!(t.from_ns <= t.to_ns);
        #[cfg(target_arch = "x86_64")]
        assert_eq!(b.nr.and_then(syscall_name), Some("futex"));
        #[cfg(not(target_arch = "x86_64"))]
        let _ = b; // (syscall names are x86-64's here)
        stop_tx.send(()).unwrap();
        h.join().unwrap();
        // Unmapped memory is an error, not a fault.
        assert!(copy_stack(8, &mut out).is_err());
    }
}
