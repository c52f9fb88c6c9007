//! The primary engine: one `perf_event_open` task-clock event per thread,
//! sampling user-space CPU time, whose overflow sends `SIGTRAP` to the very
//! thread that ran (`attr.sigtrap = 1`, Linux >= 5.13); and, where the kernel
//! allows it, per-CPU inherited events for system time (`perf_kernel.rs`).
//!
//! Why SIGTRAP through `sigtrap` rather than SIGPROF through `F_SETOWN_EX` +
//! `F_SETSIG`: with `sigtrap` the kernel delivers the signal synchronously to the
//! task whose event overflowed, and an event opened with `inherit = 1,
//! inherit_thread = 1` is cloned into every thread its thread creates later, with
//! no file descriptor and no rescan: threads created after start are covered from
//! their first instruction. `inherit_thread` keeps forked children out and
//! `remove_on_exec` (required by `sigtrap`) drops the events at `exec`, so neither
//! a child nor an exec'd program ever receives one. The events carry
//! `sig_data = SIGNAL_MAGIC`, which the handler checks (with `si_code == TRAP_PERF`) to
//! tell our SIGTRAPs from a debugger's or a breakpoint's. The fasync route would
//! need one fd per thread, a rescan of `/proc/self/task` to find new threads
//! (missing short ones), and a SIGPROF shared with other profilers.
//!
//! What the inherited SIGTRAP event counts: user-space CPU time only (`exclude_kernel = 1`), so
//! the sample count follows the threads' user CPU time (measured 99.3-99.9% of
//! user CPU time x frequency with 1, 2 and 8 busy threads); time a thread
//! spends in system calls is not sampled, because the kernel drops a period that
//! ends in kernel mode. This event never counts kernel time (even where root or
//! `perf_event_paranoid` <= 1 would allow it) because a period that ends inside
//! `execve` would queue a SIGTRAP that survives the exec (pending signals do;
//! `remove_on_exec` only removes the event) and kill the new program with the
//! default disposition; `tests/recorder_process.rs` checks that this cannot
//! happen. With user-only counting the signal is always delivered on the return to user
//! space, before the thread can enter another system call.
//!
//! One event is opened for every thread found in `/proc/self/task` (except the
//! writer thread); the listing is repeated until it is stable, so a thread
//! created by a thread whose event was not open yet is found on the next pass.
//!
//! Events that cannot be inherited (the perf-stack engine's, `perf_stack.rs`)
//! are kept per thread by [`PerThreadEvents`]: opened at start and at every
//! writer tick for threads created since, closed when their thread is gone.
//!
//! # Kernel time
//! System CPU time is sampled by the inherited per-CPU ring events of
//! `perf_kernel.rs` (no signal), at a period of [`KERNEL_PERIOD_MILLI`]
//! sampling periods.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::{list_tids, SIGNAL_MAGIC};

/// `struct perf_event_attr` up to `sig_data` (PERF_ATTR_SIZE_VER7, 128 bytes).
#[repr(C)]
#[derive(Default)]
pub(super) struct PerfEventAttr {
    pub(super) type_: u32,
    pub(super) size: u32,
    pub(super) config: u64,
    pub(super) sample_period: u64,
    pub(super) sample_type: u64,
    pub(super) read_format: u64,
    pub(super) flags: u64,
    pub(super) wakeup_events: u32,
    pub(super) bp_type: u32,
    pub(super) config1: u64,
    pub(super) config2: u64,
    pub(super) branch_sample_type: u64,
    pub(super) sample_regs_user: u64,
    pub(super) sample_stack_user: u32,
    pub(super) clockid: i32,
    pub(super) sample_regs_intr: u64,
    pub(super) aux_watermark: u32,
    pub(super) sample_max_stack: u16,
    pub(super) reserved_2: u16,
    pub(super) aux_sample_size: u32,
    pub(super) reserved_3: u32,
    pub(super) sig_data: u64,
}

/// The kernel-time events' period, in thousandths of a sampling period
/// (8.618 periods); each of their samples stands for as many intervals on
/// average (8 or 9, dithered so that n samples weigh n x 8.618 in all). A
/// task-clock event's timer fires every period the thread runs, in user mode
/// too, where an `exclude_user` event drops the overflow: at one period it
/// doubled the cost of sampling a thread that stays in user space (measured
/// with `compare/gaps.py`: 17.5 against 33.2 us per sample at 999 Hz). At
/// 8.618 periods that timer costs less than an eighth, and system time is
/// still sampled without bias. The fraction keeps the two events of a thread
/// out of step: their expiries shift by 0.618 of a period against each other
/// every kernel period, so the kernel event never keeps expiring just after
/// the user event, while the kernel delivers the user event's signal (which
/// would count that delivery as the thread's system time, period after
/// period). Setting a new random period from the handler after a kernel
/// sample did that before, but each `PERF_EVENT_IOC_PERIOD` restarts the
/// count, and at 8 periods that lost 5-15% of system time.
pub(crate) const KERNEL_PERIOD_MILLI: u64 = 8_618;

pub(super) const PERF_TYPE_SOFTWARE: u32 = 1;
pub(super) const PERF_COUNT_SW_TASK_CLOCK: u64 = 1;
pub(super) const FLAG_INHERIT: u64 = 1 << 1;
pub(super) const FLAG_EXCLUDE_USER: u64 = 1 << 4;
pub(super) const FLAG_EXCLUDE_KERNEL: u64 = 1 << 5;
pub(super) const FLAG_EXCLUDE_HV: u64 = 1 << 6;
pub(super) const FLAG_INHERIT_THREAD: u64 = 1 << 35;
pub(super) const FLAG_REMOVE_ON_EXEC: u64 = 1 << 36;
const FLAG_SIGTRAP: u64 = 1 << 37;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
pub(super) const PERF_EVENT_IOC_DISABLE: libc::c_ulong = 0x2401;

/// The running perf engine: the fds of the events opened at start.
pub(crate) struct PerfEngine {
    fds: Vec<OwnedFd>,
}

fn open_for(tid: u32, period_ns: u64) -> io::Result<OwnedFd> {
    open_attr(
        tid,
        &PerfEventAttr {
            type_: PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: PERF_COUNT_SW_TASK_CLOCK,
            sample_period: period_ns,
            flags: FLAG_INHERIT
                | FLAG_EXCLUDE_KERNEL
                | FLAG_EXCLUDE_HV
                | FLAG_INHERIT_THREAD
                | FLAG_REMOVE_ON_EXEC
                | FLAG_SIGTRAP,
            sig_data: SIGNAL_MAGIC,
            ..Default::default()
        },
    )
}

pub(super) fn open_attr(tid: u32, attr: &PerfEventAttr) -> io::Result<OwnedFd> {
    open_attr_on(tid, -1, attr)
}

/// Open an event for `tid` counting only while it runs on `cpu` (-1: any CPU).
pub(super) fn open_attr_on(tid: u32, cpu: i32, attr: &PerfEventAttr) -> io::Result<OwnedFd> {
    // SAFETY: perf_event_open reads `attr` (size given in the struct) and returns
    // a new fd or -1; no memory is retained by the kernel.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            attr as *const PerfEventAttr,
            tid as libc::pid_t,
            cpu,
            -1,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // Out of the way of a program that closes its low descriptors and opens
    // files that would get these numbers (see `own_fd.rs`).
    Ok(crate::recorder::own_fd::move_high(fd))
}

/// Whether `fd` is still a perf event (`anon_inode:[perf_event]`): a program
/// that closes every descriptor closes ours too, and may have opened a file
/// of its own at the number since.
pub(crate) fn is_perf_event(fd: std::os::fd::RawFd) -> bool {
    perf_event_status(fd) == Some(true)
}

/// Whether `fd` is a perf event, as its link in `/proc` says: the calling
/// thread's view (`/proc/thread-self`: `/proc/self` is the main thread's,
/// unreadable once it ended with `pthread_exit`), else the process's. `None`
/// when neither can be read (`/proc` out of reach after a `chroot`, or not
/// mounted): then nobody can tell.
pub(crate) fn perf_event_status(fd: std::os::fd::RawFd) -> Option<bool> {
    let link = std::fs::read_link(format!("/proc/thread-self/fd/{fd}"))
        .or_else(|_| std::fs::read_link(format!("/proc/self/fd/{fd}")));
    match link {
        Ok(l) => Some(l.as_os_str().as_encoded_bytes() == b"anon_inode:[perf_event]"),
        // The number names no file: closed.
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) && proc_readable() => Some(false),
        Err(_) => None,
    }
}

/// Whether this thread's descriptors can be listed in `/proc`.
fn proc_readable() -> bool {
    std::fs::metadata("/proc/thread-self/fd").or_else(|_| std::fs::metadata("/proc/self/fd")).is_ok()
}

/// Close `fd` if it is still our perf event; a number the program has taken
/// over is left alone (never closed: it is not ours any more).
pub(crate) fn close_if_ours(fd: OwnedFd) {
    if is_perf_event(fd.as_raw_fd()) {
        drop(fd);
    } else {
        std::mem::forget(fd);
    }
}

/// Most listings of `/proc/self/task` before the start gives up waiting for a
/// stable one. Each pass opens events for the threads new since the last, and
/// every thread created after its creator's event is open inherits one, so a
/// pass finds new threads only while threads are being created by threads
/// without an event yet: a few passes settle it; the bound keeps a process that
/// spawns threads without end from holding the start forever (such threads are
/// then covered by inheritance from the threads already opened).
const MAX_LISTING_PASSES: usize = 16;

impl PerfEngine {
    /// Open an event for every thread but `skip`, sampling every `period_ns` of
    /// user CPU time, with at most `budget` descriptors: more threads than
    /// that alive at start is an error (the caller falls back to an engine
    /// that needs no descriptor per thread), never a silent gap.
    pub(crate) fn start(period_ns: u64, skip: u32, budget: usize) -> io::Result<PerfEngine> {
        let mut eng = PerfEngine { fds: Vec::new() };

        let mut done: HashSet<u32> = HashSet::new();
        done.insert(skip);
        for _pass in 0..MAX_LISTING_PASSES {
            let tids = list_tids()?;
            let new: Vec<u32> = tids.into_iter().filter(|t| !done.contains(t)).collect();
            if new.is_empty() {
                return Ok(eng);
            }
            for tid in new {
                done.insert(tid);
                if eng.fds.len() >= budget {
                    let n = list_tids().map_or(0, |t| t.len().saturating_sub(1));
                    eng.stop();
                    return Err(io::Error::new(
                        io::ErrorKind::OutOfMemory,
                        format!(
                            "{n} threads alive at start need more descriptors than the budget of {budget} \
                             (an eighth of the soft RLIMIT_NOFILE)"
                        ),
                    ));
                }
                match open_for(tid, period_ns) {
                    Ok(fd) => eng.fds.push(fd),
                    // The thread exited between listing and opening.
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                    Err(e) => {
                        eng.stop();
                        return Err(e);
                    }
                }
            }
        }
        Ok(eng)
    }

    /// Descriptors held (one per thread alive at start).
    pub(crate) fn descriptors(&self) -> usize {
        self.fds.len()
    }

    /// Whether the program closed our events (the first one is checked:
    /// programs that close descriptors close them all).
    pub(crate) fn closed_by_program(&self) -> bool {
        // (Not when `/proc` cannot say: after a `chroot`, say.)
        self.fds.first().is_some_and(|fd| perf_event_status(fd.as_raw_fd()) == Some(false))
    }

    /// Disable every event (and its inherited clones) and close them; a
    /// descriptor the program closed (and may have reused) is left alone.
    pub(crate) fn stop(&mut self) {
        for fd in self.fds.drain(..) {
            if is_perf_event(fd.as_raw_fd()) {
                // SAFETY: an ioctl on an fd we own; DISABLE takes no argument.
                unsafe { libc::ioctl(fd.as_raw_fd(), PERF_EVENT_IOC_DISABLE as _, 0) };
            }
            close_if_ours(fd);
        }
    }
}

impl Drop for PerfEngine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Events that need one descriptor per thread (no inheritance): one opened for
/// every thread found in `/proc/self/task` at start and at each [`rescan`]
/// (the writer's listings: every tick, or in the off-CPU mode each tick whose
/// switch records tell of a thread created or ended) for threads created since, and closed once their thread
/// is gone. Used by the perf-stack engine
/// (`perf_stack.rs`); `T` is what each thread holds.
///
/// [`rescan`]: PerThreadEvents::rescan
pub(crate) struct PerThreadEvents<T> {
    /// tid -> its event.
    pub(crate) events: HashMap<u32, T>,
    /// The writer thread, never given one.
    skip: u32,
    /// Most threads with an event at once.
    limit: usize,
    /// Threads left without an event (limit, descriptors, memory).
    given_up: HashSet<u32>,
    /// How many threads were ever left without one.
    pub(crate) missed: u64,
}

impl<T> PerThreadEvents<T> {
    /// An event for every thread but `skip`, made by `open`. Fails (with the
    /// kernel's answer) when the first one is refused: such events are not
    /// allowed here at all. Later refusals leave that thread without one.
    pub(crate) fn start(
        skip: u32,
        limit: usize,
        open: &mut dyn FnMut(u32) -> io::Result<T>,
    ) -> io::Result<PerThreadEvents<T>> {
        let mut set =
            PerThreadEvents { events: HashMap::new(), skip, limit, given_up: HashSet::new(), missed: 0 };
        for tid in list_tids()? {
            if tid == skip {
                continue;
            }
            match set.add(tid, open) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) if set.events.is_empty() => return Err(e),
                Err(_) => set.give_up(tid),
            }
        }
        Ok(set)
    }

    fn give_up(&mut self, tid: u32) {
        if self.given_up.insert(tid) {
            self.missed += 1;
        }
    }

    fn add(&mut self, tid: u32, open: &mut dyn FnMut(u32) -> io::Result<T>) -> io::Result<()> {
        if self.events.len() >= self.limit {
            return Err(io::Error::from_raw_os_error(libc::EMFILE));
        }
        let ev = open(tid)?;
        self.events.insert(tid, ev);
        Ok(())
    }

    /// Events for the threads of `tids` (the threads alive now) that have
    /// none yet (made by `open`); the events of threads that exited are handed
    /// to `close`.
    pub(crate) fn rescan(
        &mut self,
        tids: &[u32],
        open: &mut dyn FnMut(u32) -> io::Result<T>,
        close: &mut dyn FnMut(u32, T),
    ) {
        let alive: HashSet<u32> = tids.iter().copied().collect();
        let gone: Vec<u32> = self.events.keys().copied().filter(|t| !alive.contains(t)).collect();
        for t in gone {
            if let Some(ev) = self.events.remove(&t) {
                close(t, ev);
            }
        }
        self.given_up.retain(|t| alive.contains(t));
        for &tid in tids {
            if tid != self.skip && !self.events.contains_key(&tid) && !self.given_up.contains(&tid) {
                match self.add(tid, open) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                    Err(_) => self.give_up(tid),
                }
            }
        }
    }

    /// Hand every event to `close`.
    pub(crate) fn close_all(&mut self, close: &mut dyn FnMut(u32, T)) {
        for (t, ev) in self.events.drain() {
            close(t, ev);
        }
    }
}
