//! The primary engine: one `perf_event_open` task-clock event per thread,
//! sampling user-space CPU time, whose overflow sends `SIGTRAP` to the very
//! thread that ran (`attr.sigtrap = 1`, Linux >= 5.13); and, where the kernel
//! allows it, a second event per thread for system time ([`KernelEvents`],
//! below).
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
//! Events that cannot be inherited (the kernel-time events below, and the
//! perf-stack engine's, `perf_stack.rs`) are kept per thread by
//! [`PerThreadEvents`]: opened at start and at every writer tick for threads
//! created since, closed when their thread is gone.
//!
//! # Kernel time: [`KernelEvents`]
//! System CPU time is sampled by a second task-clock event per thread that
//! counts the periods ending in kernel mode only (`exclude_user = 1`; refused
//! unless `perf_event_paranoid` <= 1 or the process has `CAP_PERFMON` /
//! `CAP_SYS_ADMIN`), so every overflow of it is a kernel-mode sample by
//! construction: no guessing from the interrupted user pc. Its signal is not
//! SIGTRAP through `sigtrap`, for the exec reason above (measured here: a
//! kernel-mode sigtrap event at 1 kHz killed 26% of the programs a process
//! exec'd directly), but SIGURG through `fasync` (`O_ASYNC`, `F_SETSIG`,
//! `F_SETOWN_EX` with `F_OWNER_TID`): SIGURG's default action is to ignore,
//! so one still pending when the thread execs is discarded by the new program
//! (measured: 0 of 300 exec'd programs disturbed). The signal is sent to the
//! thread right after the overflow and handled on its return to user space,
//! where the handler unwinds the user stack that made the system call (or
//! took the page fault) and adds a kernel-mode leaf frame.
//!
//! The price of fasync: such an event is not inherited usefully (the signal of
//! an inherited copy goes to the owner of the original), so one event with its
//! own descriptor is opened per thread, at start and, for a thread created
//! later, at the writer tick after its first (user-mode) sample, which is
//! how the writer learns of it without listing `/proc/self/task` every tick:
//! until then (about a flush interval, 100 ms by default, of its running time)
//! a new thread is sampled in user mode only. At most [`MAX_KERNEL_EVENTS`] threads get one,
//! and only descriptors below [`crate::recorder::handler::MAX_KERNEL_FD`] are
//! kept (the handler looks the descriptor of a SIGURG up in a fixed table to
//! tell ours from a socket's). A pending SIGURG also makes an interruptible
//! sleep that follows the overflow in the same system call return early, like
//! any signal: restarted (`SA_RESTART`) or `EINTR` for calls that are never
//! restarted (`epoll_wait`, `select`, ...).
//!
//! The kernel event's period is 8.618 sampling periods
//! ([`KERNEL_PERIOD_MILLI`]) and each of its samples weighs as many intervals
//! on average: a task-clock timer fires every period the thread runs, in user
//! mode too (where an `exclude_user` event drops the overflow), so at one
//! period the kernel event doubled the cost of sampling a thread that never
//! enters the kernel; the fraction keeps the two events' timers out of step
//! without touching them from the handler. What remains: a
//! period that expires while the kernel switches the thread in or out, or
//! delivers one of our signals, is kernel time as perf sees it (`perf record`
//! shows the same), while `getrusage` counts system time by the scheduler tick;
//! on a busy machine the two differ by a few percent of the thread's CPU time.

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
const FLAG_INHERIT: u64 = 1 << 1;
const FLAG_EXCLUDE_USER: u64 = 1 << 4;
pub(super) const FLAG_EXCLUDE_KERNEL: u64 = 1 << 5;
pub(super) const FLAG_EXCLUDE_HV: u64 = 1 << 6;
const FLAG_INHERIT_THREAD: u64 = 1 << 35;
const FLAG_REMOVE_ON_EXEC: u64 = 1 << 36;
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
    // SAFETY: perf_event_open reads `attr` (size given in the struct) and returns
    // a new fd or -1; no memory is retained by the kernel.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            attr as *const PerfEventAttr,
            tid as libc::pid_t,
            -1,
            -1,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
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
    /// user CPU time.
    pub(crate) fn start(period_ns: u64, skip: u32) -> io::Result<PerfEngine> {
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

    /// Disable every event (and its inherited clones) and close them.
    pub(crate) fn stop(&mut self) {
        for fd in &self.fds {
            // SAFETY: an ioctl on an fd we own; DISABLE takes no argument.
            unsafe { libc::ioctl(fd.as_raw_fd(), PERF_EVENT_IOC_DISABLE as _, 0) };
        }
        self.fds.clear();
    }
}

impl Drop for PerfEngine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Most threads given a kernel-time event (each costs a descriptor).
pub(crate) const MAX_KERNEL_EVENTS: usize = 512;

/// Events that need one descriptor per thread (no inheritance): one opened for
/// every thread found in `/proc/self/task` at start and at each [`rescan`]
/// (every writer tick) for threads created since, and closed once their thread
/// is gone. Used by the kernel-time events and by the perf-stack engine
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

/// Per-thread kernel-mode task-clock events signalled by SIGURG (see the module
/// documentation).
pub(crate) struct KernelEvents {
    threads: PerThreadEvents<OwnedFd>,
    period_ns: u64,
    /// How many threads were ever left without one.
    pub(crate) missed: u64,
}

/// `struct f_owner_ex` of `<fcntl.h>` (not in the `libc` crate).
#[repr(C)]
struct FOwnerEx {
    type_: libc::c_int,
    pid: libc::pid_t,
}
const F_SETSIG: libc::c_int = 10;
const F_SETOWN_EX: libc::c_int = 15;
const F_OWNER_TID: libc::c_int = 0;

/// Open a kernel-mode-only task-clock event for `tid` that sends SIGURG to it.
fn open_kernel_for(tid: u32, period_ns: u64) -> io::Result<OwnedFd> {
    let fd = open_attr(
        tid,
        &PerfEventAttr {
            type_: PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: PERF_COUNT_SW_TASK_CLOCK,
            sample_period: period_ns,
            flags: FLAG_EXCLUDE_USER | FLAG_EXCLUDE_HV,
            wakeup_events: 1,
            ..Default::default()
        },
    )?;
    let raw = fd.as_raw_fd();
    let owner = FOwnerEx { type_: F_OWNER_TID, pid: tid as libc::pid_t };
    // SAFETY: fcntl on a descriptor we own; F_SETOWN_EX reads the struct we pass,
    // F_SETSIG and F_SETFL take integers.
    let ok = unsafe {
        libc::fcntl(raw, F_SETOWN_EX, &owner as *const FOwnerEx) == 0
            && libc::fcntl(raw, F_SETSIG, libc::SIGURG) == 0
            && libc::fcntl(raw, libc::F_SETFL, libc::O_ASYNC) == 0
    };
    if !ok {
        return Err(io::Error::last_os_error());
    }
    // Into the handler's table, or no event: a SIGURG from an unmarked
    // descriptor would not be recognised as ours.
    if !crate::recorder::handler::mark_kernel_fd(raw) {
        return Err(io::Error::from_raw_os_error(libc::EMFILE));
    }
    Ok(fd)
}

/// Close the kernel-time event of a thread that exited (or at drop): no handler
/// can be using it, since its signal goes to that thread only.
fn close_kernel(_tid: u32, fd: OwnedFd) {
    // Out of the handler's table before the number can be reused.
    crate::recorder::handler::unmark_kernel_fd(fd.as_raw_fd());
    drop(fd);
}

impl KernelEvents {
    /// Kernel-time events for every thread but `skip`. Fails (with the
    /// kernel's answer) when the first one is refused: kernel counting is not allowed.
    pub(crate) fn start(period_ns: u64, skip: u32) -> io::Result<KernelEvents> {
        let threads =
            PerThreadEvents::start(skip, MAX_KERNEL_EVENTS, &mut |tid| open_kernel_for(tid, period_ns))?;
        let missed = threads.missed;
        Ok(KernelEvents { threads, period_ns, missed })
    }

    /// Events for threads created since the last call; close those of threads
    /// that exited.
    pub(crate) fn rescan(&mut self, tids: &[u32]) {
        let period_ns = self.period_ns;
        self.threads.rescan(tids, &mut |tid| open_kernel_for(tid, period_ns), &mut close_kernel);
        self.missed = self.threads.missed;
    }

    /// Stop every event and take it out of the handler's table, but keep the
    /// descriptors open: a SIGURG of one may still be pending, and its
    /// descriptor number must not be reused by another file the handler would
    /// then take for ours. They are closed on drop, which the writer thread
    /// does only after withdrawing the state from the handler and waiting
    /// until no handler runs.
    pub(crate) fn stop(&mut self) {
        for fd in self.threads.events.values() {
            crate::recorder::handler::unmark_kernel_fd(fd.as_raw_fd());
            // SAFETY: an ioctl on an fd we own; DISABLE takes no argument.
            unsafe { libc::ioctl(fd.as_raw_fd(), PERF_EVENT_IOC_DISABLE as _, 0) };
        }
    }
}

impl Drop for KernelEvents {
    fn drop(&mut self) {
        self.threads.close_all(&mut close_kernel);
    }
}
