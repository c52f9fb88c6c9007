//! The recorded process tree, supervised by the collector (a child
//! subreaper): whether a process still runs, reaping CMD and the orphans it
//! adopted, waking when CMD exits, and the signals passed on to the tree.

use super::TICK;

/// Field 22 of `/proc/<pid>/stat` (start time in clock ticks), `None` if the
/// process is gone or a zombie.
pub(super) fn proc_starttime(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields are
    // counted after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// The parent of process `pid` (field 4 of `/proc/<pid>/stat`), `None` if
/// it is gone.
fn proc_ppid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].split_whitespace().nth(1)?.parse().ok()
}

/// Whether `pid` is the collector's descendant (the recorded tree: as a
/// subreaper it adopts every orphan of the tree). A process outside it,
/// whose spool the recorded program put in the handoff directory under that
/// pid, must not be waited for: it may run forever (pid 1).
pub(super) fn in_tree(pid: u32) -> bool {
    let me = std::process::id();
    let mut p = pid;
    // (Bounded: a chain longer than any real tree ends the walk.)
    for _ in 0..4096 {
        match proc_ppid(p) {
            Some(parent) if parent == me => return true,
            Some(parent) if parent > 1 => p = parent,
            _ => return false,
        }
    }
    false
}

/// Whether the process first seen with `starttime` still runs (not a zombie,
/// and its pid not taken by another process).
pub(super) fn alive(pid: u32, starttime: Option<u64>) -> bool {
    match (starttime, proc_starttime(pid)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// Reap every exited child (CMD and adopted orphans) without blocking; note
/// CMD's status: its exit code, or minus the signal that killed it.
pub(super) fn reap(cmd_pid: u32, cmd_status: &mut Option<i32>) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes the status into the valid `status`.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
        if pid as u32 == cmd_pid {
            *cmd_status = Some(if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else if libc::WIFSIGNALED(status) {
                // Negative: killed by this signal (see `Exit`).
                -libc::WTERMSIG(status)
            } else {
                1
            });
        }
    }
}

/// Whether any child (CMD or an adopted descendant) is still alive or unreaped.
pub(super) fn have_children() -> bool {
    // SAFETY: an all-zero siginfo_t is a valid value for waitid to overwrite.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid with WNOHANG | WNOWAIT only inspects (reaps nothing) and writes into the valid `info`.
    let r = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) };
    // waitid fails with ECHILD when there are no children at all.
    !(r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD))
}

/// The collector's children still running that started a session of their
/// own (`setsid`: daemons, such as `ssh-agent` or `setsid CMD &`), if every
/// child still running did; `None` if any is of the collector's session
/// (still to be waited for). Once CMD has exited, a tree of only such
/// processes is not waited for: a shell does not wait for them either.
pub(super) fn only_daemons_left() -> Option<usize> {
    // SAFETY: getsid(0) asks for this process's session.
    let own = unsafe { libc::getsid(0) };
    let mut daemons = 0;
    for pid in children_of(&std::process::id().to_string()) {
        // SAFETY: getsid of a pid only reads; -1 if it is gone.
        match unsafe { libc::getsid(pid as i32) } {
            -1 => {}
            sid if sid == own => return None,
            _ => daemons += 1,
        }
    }
    // None listed while children exist (a kernel without the `children`
    // files): nothing tells them apart, so they are waited for.
    (daemons > 0).then_some(daemons)
}

/// A pidfd for CMD, so that the collector wakes as soon as it exits.
pub(super) fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Some(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) })
}

/// Sleep one tick, waking early when CMD exits.
pub(super) fn wait_tick(pidfd: Option<&std::os::fd::OwnedFd>, cmd_running: bool) {
    match pidfd {
        Some(fd) if cmd_running => {
            use std::os::fd::AsRawFd;
            let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, TICK.as_millis() as i32) };
        }
        _ => std::thread::sleep(TICK),
    }
}

/// The last of SIGINT, SIGTERM, SIGHUP received (0: none), for the main
/// loop, and how many arrived since it last looked (two within one of its
/// ticks are two).
static SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
static SIGNALS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
    SIGNALS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// Catch SIGINT, SIGTERM and SIGHUP (the recorded command gets the default
/// dispositions back at exec).
pub(super) fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: all-zero bytes are a valid sigaction to fill in.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = libc::SA_RESTART;
        // SAFETY: installs an async-signal-safe handler (one atomic store); the old action is not needed.
        unsafe { libc::sigaction(sig, &sa, std::ptr::null_mut()) };
    }
}

/// The last signal received since the last call, if any. Two received
/// between calls are handed out one per call.
pub(super) fn take_signal() -> Option<i32> {
    use std::sync::atomic::Ordering::SeqCst;
    let pending = SIGNALS.load(SeqCst);
    if pending == 0 {
        return None;
    }
    SIGNALS.fetch_sub(1, SeqCst);
    let sig = SIGNAL.load(SeqCst);
    (sig != 0).then_some(sig)
}

/// The children of process `pid` (`/proc/<pid>/task/*/children`).
fn children_of(pid: &str) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    let mut out = Vec::new();
    for t in tasks.flatten() {
        let Ok(list) = std::fs::read_to_string(t.path().join("children")) else { continue };
        out.extend(list.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
    }
    out
}

/// Pass `sig` on to every process of the tree (CMD, its descendants, and
/// the orphans the collector adopted): signalling `spulse record` stops the
/// command it records, however deep (before, only its children got it, and
/// a grandchild, once adopted, kept the collector waiting for it). The
/// collector keeps merging until they have exited. A SIGINT that the
/// terminal sent to the whole foreground process group (the collector's
/// group is the terminal's) already reached them and is not sent again.
///
/// A descendant is signalled through a pidfd, and only if it is still of
/// the tree once the pidfd holds it: a pid that ended and was taken by an
/// unrelated process meanwhile is not signalled ([`signal_descendant`]).
/// Returns whether the signal was forwarded (a SIGINT the terminal sent to
/// the whole group was not: it reached the tree already).
pub(super) fn forward_signal(sig: i32) -> bool {
    if sig == libc::SIGINT {
        // SAFETY: tcgetpgrp and getpgrp only read process state.
        let foreground = unsafe { libc::tcgetpgrp(libc::STDIN_FILENO) == libc::getpgrp() };
        if foreground {
            return false;
        }
    }
    let me = std::process::id();
    let mut signalled: std::collections::HashSet<u32> = std::collections::HashSet::new();
    // A process whose parent ended during a walk (signalled just before) is
    // adopted by the collector: the next round finds it among its children.
    // (Bounded: a tree forking faster than the walks cannot keep them going.)
    for _round in 0..3 {
        let before = signalled.len();
        let mut queue: Vec<(u32, u32)> = children_of("self").into_iter().map(|c| (me, c)).collect();
        while let Some((parent, pid)) = queue.pop() {
            if signalled.len() >= 100_000 {
                return true;
            }
            queue.extend(children_of(&pid.to_string()).into_iter().map(|c| (pid, c)));
            if !signalled.insert(pid) {
                continue;
            }
            if parent == me {
                // SAFETY: kill on a child of ours (unreaped, so its pid is not reused).
                unsafe { libc::kill(pid as i32, sig) };
                continue;
            }
            signal_descendant(pid, sig);
        }
        if signalled.len() == before {
            break;
        }
    }
    true
}

/// Send `sig` to `pid`, a descendant found in the walk, if it is still of the
/// tree: through a pidfd (so that a pid taken by an unrelated process after
/// the check is not signalled), or where the kernel has none (before 5.3;
/// ENOSYS) with `kill` right after the check.
fn signal_descendant(pid: u32, sig: i32) {
    let fd = pidfd_open(pid);
    let no_pidfd = fd.is_none() && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS);
    // (Its parent may have ended since, signalled just before: it is then
    // the collector's, adopted, and still of the tree.)
    if !in_tree(pid) {
        return;
    }
    use std::os::fd::AsRawFd;
    if let Some(fd) = fd {
        // SAFETY: pidfd_send_signal on a pidfd we own, with no siginfo.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
    } else if no_pidfd {
        // SAFETY: kill on a process checked just above to be of the tree.
        unsafe { libc::kill(pid as i32, sig) };
    }
}

/// End this process as CMD ended: killed by `sig` (its default action, the
/// collector's own handler removed and the signal unblocked; no core file
/// of the collector: CMD's own was written, if any), so that a shell or a
/// parent reads the same status as unrecorded (a `subprocess` sees -11, not
/// 139; a shell loop stops on a SIGINT). Returns if the signal did not end
/// it (then the caller exits with 128 + `sig`).
pub fn die_like(sig: i32) {
    let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: setrlimit reads the valid `no_core`; signal, sigprocmask on valid sets and raise act on this process only.
    unsafe {
        libc::setrlimit(libc::RLIMIT_CORE, &no_core);
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(sig);
    }
}
