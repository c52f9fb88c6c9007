//! The primary engine: one `perf_event_open` task-clock event per thread,
//! counting user-space CPU time only, whose overflow sends `SIGTRAP` to the very
//! thread that ran (`attr.sigtrap = 1`, Linux >= 5.13).
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
//! What the event counts: user-space CPU time only (`exclude_kernel = 1`), so
//! the sample count follows the threads' user CPU time (measured 99.3-99.9% of
//! user CPU time x frequency with 1, 2 and 8 busy threads); time a thread
//! spends in system calls is not sampled, because the kernel drops a period that
//! ends in kernel mode. Kernel time is not counted (even where root or
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

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::{list_tids, SIGNAL_MAGIC};

/// `struct perf_event_attr` up to `sig_data` (PERF_ATTR_SIZE_VER7, 128 bytes).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
    config2: u64,
    branch_sample_type: u64,
    sample_regs_user: u64,
    sample_stack_user: u32,
    clockid: i32,
    sample_regs_intr: u64,
    aux_watermark: u32,
    sample_max_stack: u16,
    reserved_2: u16,
    aux_sample_size: u32,
    reserved_3: u32,
    sig_data: u64,
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_TASK_CLOCK: u64 = 1;
const FLAG_INHERIT: u64 = 1 << 1;
const FLAG_EXCLUDE_KERNEL: u64 = 1 << 5;
const FLAG_EXCLUDE_HV: u64 = 1 << 6;
const FLAG_INHERIT_THREAD: u64 = 1 << 35;
const FLAG_REMOVE_ON_EXEC: u64 = 1 << 36;
const FLAG_SIGTRAP: u64 = 1 << 37;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
const PERF_EVENT_IOC_DISABLE: libc::c_ulong = 0x2401;

/// The running perf engine: the fds of the events opened at start.
pub(crate) struct PerfEngine {
    fds: Vec<OwnedFd>,
}

fn open_for(tid: u32, period_ns: u64) -> io::Result<OwnedFd> {
    let attr = PerfEventAttr {
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
    };
    // SAFETY: perf_event_open reads `attr` (size given in the struct) and returns
    // a new fd or -1; no memory is retained by the kernel.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
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
