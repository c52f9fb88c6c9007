//! The fallback engines.
//!
//! [`ThreadTimers`]: one POSIX CPU-clock timer per thread (`timer_create` on the
//! thread's own CPU clock, `SIGEV_THREAD_ID` so the signal goes to that thread).
//! glibc's wrapper refuses another thread's clock id, so the raw syscall is used
//! with the kernel's encoding `((~tid) << 3) | 6`. These timers are driven by the
//! scheduler tick (250 Hz on this kernel): at 999 Hz one signal arrives per tick
//! with `si_overrun` = the periods that expired unsignalled, and the handler
//! records 1 + overrun samples (capped) so the sample count still matches CPU
//! time x frequency. The first expiry is randomized within one period so short
//! threads are not systematically missed. Threads created after start get their
//! timer at the writer thread's next tick (a rescan of `/proc/self/task`); timers
//! are not inherited by `fork` and are deleted by `exec`.
//!
//! [`ProcessTimer`]: `setitimer(ITIMER_PROF)`, the last resort. Process-wide, one
//! pending signal at most, tick-limited and without overrun information: it
//! undercounts at high rates and with many busy threads. Its timer survives
//! `exec`: a program exec'd directly by the profiled process (not by a forked
//! child, which has no itimer) inherits it and dies of SIGPROF unless it ignores
//! it, which is why this engine is only chosen when the others are refused.

use std::collections::HashMap;
use std::io;

use super::{list_tids, SIGNAL_MAGIC};

/// Per-thread CPU-clock timers.
pub(crate) struct ThreadTimers {
    timers: HashMap<u32, libc::c_int>,
    period_ns: u64,
    skip: u32,
    seed: u64,
}

fn thread_clock(tid: u32) -> libc::clockid_t {
    ((!(tid as libc::clockid_t)) << 3) | 6
}

impl ThreadTimers {
    /// A timer for every thread but `skip`.
    pub(crate) fn start(period_ns: u64, skip: u32) -> io::Result<ThreadTimers> {
        let seed = super::now_us() | 1;
        let mut t = ThreadTimers { timers: HashMap::new(), period_ns: period_ns.max(1000), skip, seed };
        let tids = list_tids()?;
        for tid in tids {
            if tid == skip {
                continue;
            }
            match t.create(tid) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) || e.raw_os_error() == Some(libc::ESRCH) => {
                }
                Err(e) => {
                    t.stop();
                    return Err(e);
                }
            }
        }
        if t.timers.is_empty() {
            return Err(io::Error::other("no thread timer could be created"));
        }
        Ok(t)
    }

    fn next_rand(&mut self) -> u64 {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        self.seed
    }

    fn create(&mut self, tid: u32) -> io::Result<()> {
        // SAFETY: sigevent is plain data; zero is a valid starting value.
        let mut sev: libc::sigevent = unsafe { std::mem::zeroed() };
        sev.sigev_notify = libc::SIGEV_THREAD_ID;
        sev.sigev_signo = libc::SIGPROF;
        sev.sigev_value = libc::sigval { sival_ptr: SIGNAL_MAGIC as usize as *mut libc::c_void };
        sev.sigev_notify_thread_id = tid as libc::c_int;
        let mut id: libc::c_int = 0;
        // SAFETY: raw timer_create(clock, sigevent*, kernel_timer_t*): the kernel
        // reads `sev` and writes the timer id into `id`.
        let r = unsafe {
            libc::syscall(
                libc::SYS_timer_create,
                thread_clock(tid),
                &sev as *const libc::sigevent,
                &mut id as *mut libc::c_int,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let first = 1 + self.next_rand() % self.period_ns;
        let spec = libc::itimerspec { it_interval: ns_to_ts(self.period_ns), it_value: ns_to_ts(first) };
        // SAFETY: raw timer_settime on the timer we just created.
        let r = unsafe {
            libc::syscall(
                libc::SYS_timer_settime,
                id,
                0,
                &spec as *const libc::itimerspec,
                std::ptr::null_mut::<libc::itimerspec>(),
            )
        };
        if r != 0 {
            let e = io::Error::last_os_error();
            // SAFETY: deleting the timer we own.
            unsafe { libc::syscall(libc::SYS_timer_delete, id) };
            return Err(e);
        }
        self.timers.insert(tid, id);
        Ok(())
    }

    /// Cover threads created since the last call; forget those that exited.
    /// Whether every thread of `tids` has its timer (a refused `timer_create`,
    /// such as `EAGAIN`, is tried again at the next call).
    pub(crate) fn rescan(&mut self, tids: &[u32]) -> bool {
        // A set: with thousands of threads, a scan of the list per timer
        // was millions of comparisons every tick.
        let alive: std::collections::HashSet<u32> = tids.iter().copied().collect();
        let gone: Vec<u32> = self.timers.keys().copied().filter(|t| !alive.contains(t)).collect();
        for t in gone {
            if let Some(id) = self.timers.remove(&t) {
                // SAFETY: deleting a timer we own.
                unsafe { libc::syscall(libc::SYS_timer_delete, id) };
            }
        }
        let mut all = true;
        for &tid in tids {
            if tid != self.skip && !self.timers.contains_key(&tid) {
                all &= self.create(tid).is_ok();
            }
        }
        all
    }

    /// Delete every timer.
    pub(crate) fn stop(&mut self) {
        for (_, id) in self.timers.drain() {
            // SAFETY: deleting a timer we own.
            unsafe { libc::syscall(libc::SYS_timer_delete, id) };
        }
    }
}

impl Drop for ThreadTimers {
    fn drop(&mut self) {
        self.stop();
    }
}

fn ns_to_ts(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

/// The process-wide profiling itimer.
pub(crate) struct ProcessTimer {
    armed: bool,
}

impl ProcessTimer {
    /// Arm `ITIMER_PROF` with the given period.
    pub(crate) fn start(period_ns: u64) -> io::Result<ProcessTimer> {
        let us = (period_ns / 1000).max(1);
        let tv = libc::timeval {
            tv_sec: (us / 1_000_000) as libc::time_t,
            tv_usec: (us % 1_000_000) as libc::suseconds_t,
        };
        let it = libc::itimerval { it_interval: tv, it_value: tv };
        // SAFETY: setitimer reads the struct we pass.
        if unsafe { libc::setitimer(libc::ITIMER_PROF, &it, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(ProcessTimer { armed: true })
    }

    /// Disarm it.
    pub(crate) fn stop(&mut self) {
        if self.armed {
            let zero = libc::timeval { tv_sec: 0, tv_usec: 0 };
            let it = libc::itimerval { it_interval: zero, it_value: zero };
            // SAFETY: setitimer reads the itimerval we pass; a null old value is allowed.
            unsafe { libc::setitimer(libc::ITIMER_PROF, &it, std::ptr::null_mut()) };
            self.armed = false;
        }
    }
}

impl Drop for ProcessTimer {
    fn drop(&mut self) {
        self.stop();
    }
}
