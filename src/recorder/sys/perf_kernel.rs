//! Kernel time without a signal: per-CPU, inherited task-clock events that
//! count kernel mode only (`exclude_user`) and write each sample, with the
//! user registers at the kernel entry (`REGS_USER`) and a copy of the top of
//! the user stack (`STACK_USER`), into one mapped ring per CPU. The writer
//! thread drains the rings at each tick and unwinds the copies
//! (`stack_sampler.rs`), as it does for the perf-stack engine: a sample's
//! leaf is a kernel-mode frame on top of the user stack that entered the
//! kernel.
//!
//! # Why this shape (measured: `BENCHMARKS.md`, "Context switches")
//! The kernel-time events used to be one per thread, not inherited, each
//! sending SIGURG through `fasync`. A thread's perf context that holds a
//! non-inherited event is no longer a clone of its siblings', so at every
//! context switch between two threads of the process the kernel scheduled
//! every event out and in, cancelling and re-arming each task-clock hrtimer
//! (reprogramming the VM's timer device when it is the earliest timer): a
//! futex ping-pong took 23 us a round trip against 2.1 bare. Inherited events
//! keep the contexts of all threads created after start clones of one
//! another, and the kernel then swaps the contexts at a switch without
//! touching the events (`perf_event_context_sched_out`), as `perf record`'s
//! inherited per-CPU events do.
//!
//! An inherited event cannot signal through `fasync` (the signal would go to
//! the owner of the original event), and `sigtrap` is not safe for a
//! kernel-mode period (one ending inside `execve` queues a SIGTRAP that
//! survives the exec and kills the new program). An inherited event with a
//! ring is allowed per CPU (`cpu >= 0`; the kernel refuses to map an inherited
//! event with `cpu = -1`), and every inherited copy writes into its parent's
//! ring. So: for every thread alive at start and every CPU, one event; the
//! first opened on a CPU owns that CPU's ring and the others are redirected
//! into it (`PERF_EVENT_IOC_SET_OUTPUT`, which needs the same CPU). Threads
//! created later inherit the events of their creator and cost nothing.
//!
//! No signal is sent, so no program's signal disposition matters, no
//! interruptible sleep is cut short, and the profiler's own signal delivery
//! cannot show up as a sample with the handler's frames on it (see
//! `stack_sampler.rs` for the samples taken while our handler returns).
//!
//! # Costs
//! Descriptors: (threads alive at start) x (CPUs online), counted against the
//! recorder's descriptor budget (`recorder::fd_budget`). Memory: one ring of
//! `1 + data_pages` pages per CPU, locked kernel memory. Per kernel sample the
//! kernel copies `user_stack_copy` bytes of the user stack (16 KiB by
//! default); a stack deeper than the copy is truncated. The event's period is
//! [`super::perf::KERNEL_PERIOD_MILLI`] sampling periods, for the reason given
//! there (its timer fires in user mode too, where it is pure cost).

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::OwnedFd;

use super::list_tids;
use super::perf::{
    PerfEventAttr, FLAG_EXCLUDE_HV, FLAG_EXCLUDE_USER, FLAG_INHERIT, FLAG_INHERIT_THREAD,
    FLAG_REMOVE_ON_EXEC, PERF_COUNT_SW_TASK_CLOCK, PERF_TYPE_SOFTWARE,
};
use super::perf_stack::{
    open_counting_lost, page_size, StackRing, StackSample, FLAG_USE_CLOCKID, FLAG_WATERMARK, FORMAT_LOST,
    MAX_RING_PAGES, REGS_MASK, SAMPLE_IP, SAMPLE_REGS_USER, SAMPLE_STACK_USER, SAMPLE_TID, SAMPLE_TIME,
};

/// `PERF_EVENT_IOC_SET_OUTPUT`.
const PERF_EVENT_IOC_SET_OUTPUT: libc::c_ulong = 0x2405;

/// Most listings of `/proc/self/task` at start (as `perf::PerfEngine`).
const MAX_LISTING_PASSES: usize = 16;

/// What the kernel-time rings are asked for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KernelConfig {
    /// The events' period (already the kernel period, not the sampling period).
    pub period_ns: u64,
    /// Bytes of user stack copied per sample (a multiple of 8, below 64 KiB).
    pub stack_copy: u32,
    /// How long the writer may leave a ring undrained (its flush interval).
    pub drain_interval_ns: u64,
}

impl KernelConfig {
    /// Data pages of a ring that holds the samples one CPU can take in a
    /// drain interval if it spends all of it in the kernel (a power of two,
    /// 8 to [`MAX_RING_PAGES`]): 64 pages (256 KiB) with the defaults. Rings
    /// are locked kernel memory, one per CPU per recorded process; a CPU that
    /// overflows its ring loses samples, counted (`LostSamples::ring_full`).
    pub(crate) fn data_pages(&self) -> usize {
        let per_interval = self.drain_interval_ns / self.period_ns.max(1) + 1;
        let bytes = per_interval.saturating_mul(self.stack_copy as u64 + 256);
        let pages = (bytes / page_size() as u64 + 1).min(MAX_RING_PAGES as u64) as usize;
        pages.next_power_of_two().clamp(8, MAX_RING_PAGES)
    }
}

/// The CPUs the kernel has online (`/sys/devices/system/cpu/online`, e.g.
/// `0-3,6`), or `0..sysconf(_SC_NPROCESSORS_ONLN)` if it cannot be read.
pub(crate) fn online_cpus() -> Vec<i32> {
    if let Ok(s) = std::fs::read_to_string("/sys/devices/system/cpu/online") {
        if let Some(v) = parse_cpu_list(s.trim()) {
            if !v.is_empty() {
                return v;
            }
        }
    }
    // SAFETY: sysconf reads a constant.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1);
    (0..n.min(4096) as i32).collect()
}

/// Parse a kernel CPU list (`0-3,6`); `None` if malformed or absurdly large.
fn parse_cpu_list(s: &str) -> Option<Vec<i32>> {
    let mut v = Vec::new();
    for part in s.split(',') {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<i32>().ok()?, b.parse::<i32>().ok()?),
            None => {
                let a = part.parse::<i32>().ok()?;
                (a, a)
            }
        };
        if a < 0 || b < a || b >= 65536 || v.len() + (b - a) as usize > 65536 {
            return None;
        }
        v.extend(a..=b);
    }
    Some(v)
}

/// The running kernel-time events and their per-CPU rings.
pub(crate) struct KernelRings {
    /// cpu -> the ring of that CPU (owned by the first event opened on it).
    rings: HashMap<i32, StackRing>,
    /// The other events, whose samples go to their CPU's ring.
    redirected: Vec<OwnedFd>,
    /// Lost samples not yet handed to the recorder.
    lost: u64,
    scratch: Vec<u8>,
    /// Threads alive at start left without kernel-time events (descriptor budget).
    pub(crate) missed: u64,
    /// Descriptors held.
    pub(crate) fds: usize,
    /// The threads alive at start whose events were opened.
    pub(crate) opened: Vec<u32>,
}

impl KernelRings {
    /// Events for every thread alive now but `skip`, on every online CPU,
    /// using at most `budget` descriptors. Fails (with the kernel's answer)
    /// when the first event is refused (kernel counting not allowed) or the
    /// budget cannot cover even one thread: nothing is then left open.
    pub(crate) fn start(cfg: KernelConfig, skip: u32, budget: usize) -> io::Result<KernelRings> {
        let data_pages = cfg.data_pages();
        Self::start_with(skip, budget, data_pages, &|tid, cpu| open_kernel_event(tid, cpu, &cfg, data_pages))
    }

    /// [`KernelRings::start`] with events that `open(tid, cpu)` opens (and
    /// says whether they report their own lost count), into rings of
    /// `data_pages` pages: also the off-CPU mode's switch records
    /// (`perf_switch.rs`).
    pub(crate) fn start_with(
        skip: u32,
        budget: usize,
        data_pages: usize,
        open: &dyn Fn(u32, i32) -> io::Result<(OwnedFd, bool)>,
    ) -> io::Result<KernelRings> {
        let cpus = online_cpus();
        let mut k = KernelRings {
            rings: HashMap::new(),
            redirected: Vec::new(),
            lost: 0,
            scratch: Vec::new(),
            missed: 0,
            fds: 0,
            opened: Vec::new(),
        };
        if cpus.len() > budget {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!("{} CPUs need more descriptors than the budget of {budget}", cpus.len()),
            ));
        }
        let mut done: HashSet<u32> = HashSet::new();
        done.insert(skip);
        let mut opened_any = false;
        for _pass in 0..MAX_LISTING_PASSES {
            let new: Vec<u32> = list_tids()?.into_iter().filter(|t| !done.contains(t)).collect();
            if new.is_empty() {
                break;
            }
            for tid in new {
                done.insert(tid);
                if k.fds + cpus.len() > budget {
                    k.missed += 1;
                    continue;
                }
                match k.open_thread(tid, &cpus, open, data_pages) {
                    Ok(()) => {
                        opened_any = true;
                        k.opened.push(tid);
                    }
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                    Err(e) if !opened_any => return Err(e),
                    Err(_) => k.missed += 1,
                }
            }
        }
        Ok(k)
    }

    /// One event per CPU for `tid`; on failure the ones opened for it are closed.
    fn open_thread(
        &mut self,
        tid: u32,
        cpus: &[i32],
        open: &dyn Fn(u32, i32) -> io::Result<(OwnedFd, bool)>,
        data_pages: usize,
    ) -> io::Result<()> {
        let mut fresh_rings = Vec::new();
        let mut fresh_fds = Vec::new();
        let r = (|| {
            for &cpu in cpus {
                let (fd, lost_readable) = open(tid, cpu)?;
                match self.rings.get(&cpu) {
                    Some(ring) => {
                        redirect(&fd, ring.raw_fd())?;
                        fresh_fds.push(fd);
                    }
                    None => {
                        let ring = StackRing::map(fd, data_pages, lost_readable)?;
                        self.rings.insert(cpu, ring);
                        fresh_rings.push(cpu);
                    }
                }
            }
            Ok(())
        })();
        match r {
            Ok(()) => {
                self.fds += fresh_rings.len() + fresh_fds.len();
                self.redirected.append(&mut fresh_fds);
                Ok(())
            }
            Err(e) => {
                // Redirected fds close on drop; rings made for this thread go too
                // (no other event writes into them yet).
                for cpu in fresh_rings {
                    self.rings.remove(&cpu);
                }
                Err(e)
            }
        }
    }

    /// Stop every event (the rings keep their samples for the last drain).
    pub(crate) fn stop(&mut self) {
        for fd in &self.redirected {
            disable(fd);
        }
        for ring in self.rings.values() {
            ring.disable();
        }
    }

    /// Hand every sample the rings hold to `on_sample`; returns the samples
    /// the kernel could not write since the last call.
    pub(crate) fn drain(&mut self, on_sample: &mut dyn FnMut(&StackSample<'_>)) -> u64 {
        let mut lost = std::mem::take(&mut self.lost);
        for ring in self.rings.values_mut() {
            ring.drain(&mut self.scratch, &mut lost, on_sample);
        }
        lost
    }

    /// Hand every record but samples and lost records to `on_record` (its
    /// type and bytes); returns the records the kernel could not write.
    pub(crate) fn drain_records(&mut self, on_record: &mut impl FnMut(u32, &[u8])) -> u64 {
        let mut lost = std::mem::take(&mut self.lost);
        for ring in self.rings.values_mut() {
            ring.drain_records(&mut self.scratch, &mut lost, on_record);
        }
        lost
    }

    /// Whether a drain found some CPU's ring half full or more since the
    /// last call (the reader came late).
    pub(crate) fn take_half_full(&mut self) -> bool {
        self.rings.values_mut().fold(false, |any, r| r.take_half_full() | any)
    }

    /// The descriptor of each CPU's ring (to wait on their watermark).
    pub(crate) fn ring_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.rings.values().map(|r| r.raw_fd()).collect()
    }

    /// Whether the program closed our events (checked on one ring's).
    pub(crate) fn closed_by_program(&self) -> bool {
        self.rings.values().next().is_some_and(|r| super::perf::perf_event_status(r.raw_fd()) == Some(false))
    }

    /// Samples lost and never reported in a lost record (read at the end).
    pub(crate) fn lost_unreported(&self) -> u64 {
        self.rings.values().map(|r| r.lost_unreported()).sum()
    }
}

impl Drop for KernelRings {
    fn drop(&mut self) {
        // Only descriptors still ours are closed (the rings see to their own).
        for fd in self.redirected.drain(..) {
            super::perf::close_if_ours(fd);
        }
    }
}

fn disable(fd: &OwnedFd) {
    use std::os::fd::AsRawFd;
    // SAFETY: an ioctl on an fd we own; DISABLE takes no argument.
    unsafe { libc::ioctl(fd.as_raw_fd(), super::perf::PERF_EVENT_IOC_DISABLE as _, 0) };
}

/// Send the samples of `fd` into the ring of the event `to` (same CPU).
fn redirect(fd: &OwnedFd, to: std::os::fd::RawFd) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: an ioctl on an fd we own; SET_OUTPUT takes the target descriptor,
    // an open perf event of ours.
    if unsafe { libc::ioctl(fd.as_raw_fd(), PERF_EVENT_IOC_SET_OUTPUT as _, to) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Open `tid`'s kernel-mode event on `cpu`; whether it reports its own lost count.
fn open_kernel_event(
    tid: u32,
    cpu: i32,
    cfg: &KernelConfig,
    data_pages: usize,
) -> io::Result<(OwnedFd, bool)> {
    let data_bytes = data_pages * page_size();
    let mut attr = PerfEventAttr {
        type_: PERF_TYPE_SOFTWARE,
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        config: PERF_COUNT_SW_TASK_CLOCK,
        sample_period: cfg.period_ns,
        sample_type: SAMPLE_IP | SAMPLE_TID | SAMPLE_TIME | SAMPLE_REGS_USER | SAMPLE_STACK_USER,
        read_format: FORMAT_LOST,
        flags: FLAG_INHERIT
            | FLAG_INHERIT_THREAD
            | FLAG_EXCLUDE_USER
            | FLAG_EXCLUDE_HV
            | FLAG_REMOVE_ON_EXEC
            | FLAG_WATERMARK
            | FLAG_USE_CLOCKID,
        // Nobody waits on these rings: wake only when one is all but full.
        wakeup_events: (data_bytes - data_bytes / 8) as u32,
        sample_regs_user: REGS_MASK,
        sample_stack_user: cfg.stack_copy,
        clockid: libc::CLOCK_REALTIME,
        ..Default::default()
    };
    open_counting_lost(tid, cpu, &mut attr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_reject_nonsense() {
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list("0-3,6"), Some(vec![0, 1, 2, 3, 6]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(parse_cpu_list("0-99999999"), None);
        assert!(!online_cpus().is_empty());
    }

    #[test]
    fn rings_hold_a_drain_interval_within_the_page_cap() {
        let c = KernelConfig { period_ns: 8_618_000, stack_copy: 16 << 10, drain_interval_ns: 100_000_000 };
        let p = c.data_pages();
        assert!(p.is_power_of_two() && (8..=MAX_RING_PAGES).contains(&p));
        // 12 samples an interval of 16.25 KiB each.
        assert!(p * page_size() >= 12 * (16 << 10), "{p} pages");
        let long = KernelConfig { drain_interval_ns: 60_000_000_000, ..c };
        assert_eq!(long.data_pages(), MAX_RING_PAGES);
    }
}
