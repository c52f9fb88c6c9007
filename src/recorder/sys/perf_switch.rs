//! The off-CPU mode's view of the scheduler: `PERF_RECORD_SWITCH` records
//! of every thread of the process, turned into exact off-CPU intervals.
//!
//! # Events
//! A software dummy event (it counts nothing and never samples) with
//! `context_switch = 1` makes the kernel write a switch record each time a
//! thread of ours leaves the CPU (`PERF_RECORD_MISC_SWITCH_OUT`, with
//! `PERF_RECORD_MISC_SWITCH_OUT_PREEMPT` when it was preempted while
//! runnable) and each time it comes back; `sample_id_all` stamps each with
//! the thread and a `CLOCK_REALTIME` time, and `task = 1` adds the creation
//! and the exit of each thread (the writer lists `/proc/self/task` for a
//! per-thread engine only when those tell of a change:
//! [`SwitchTracker::take_threads_changed`]). `exclude_kernel` keeps it within what an unprivileged process
//! may open at `perf_event_paranoid` 2 (the switch records are written all
//! the same). The events are laid out as the kernel-time events
//! (`perf_kernel.rs`, whose rings this reuses): inherited, one per CPU for
//! each thread alive at start, redirected into one ring per CPU, so threads
//! created later cost nothing and the perf contexts of all threads stay
//! clones (no re-arming at each switch). No signal is ever sent.
//!
//! The tracker drains the rings into the pairing (`pairing.rs`), which
//! turns the records into intervals and chooses the blocked threads to
//! capture; the module doc there says how.

use std::io;
use std::os::fd::OwnedFd;

use super::pairing::{Capture, Pairing};
use super::perf::{PerfEventAttr, FLAG_EXCLUDE_HV, FLAG_EXCLUDE_KERNEL, FLAG_INHERIT, FLAG_INHERIT_THREAD};
use super::perf::{FLAG_REMOVE_ON_EXEC, PERF_TYPE_SOFTWARE};
use super::perf_kernel::KernelRings;
use super::perf_stack::{
    open_counting_lost, word, FLAG_USE_CLOCKID, FLAG_WATERMARK, SAMPLE_TID, SAMPLE_TIME,
};

const PERF_COUNT_SW_DUMMY: u64 = 9;
const FLAG_TASK: u64 = 1 << 13;
const FLAG_SAMPLE_ID_ALL: u64 = 1 << 18;
const FLAG_CONTEXT_SWITCH: u64 = 1 << 26;
const RECORD_EXIT: u32 = 4;
const RECORD_FORK: u32 = 7;
const RECORD_SWITCH: u32 = 14;
const MISC_SWITCH_OUT: u16 = 1 << 13;
const MISC_SWITCH_OUT_PREEMPT: u16 = 1 << 14;

/// Data pages of each CPU's ring: 1 MiB, about 43,000 switch records (24
/// bytes each, in or out). The writer is woken when a ring is a quarter
/// full, so a ring holds the records of the writer's wake-up latency:
/// records are lost (and counted) only when the writer gets no CPU for the
/// time a CPU takes to write 32,000 switch records (about 120 ms of a futex
/// ping-pong here). Larger batches are cheaper: each wake-up finds the
/// writer's tables cold, and with 256 KiB rings (a wake-up every 64 KiB) the
/// writer used 2.8-3.3% of a core at 100,000 blockings a second against
/// 2.2-2.4% with these (BENCHMARKS.md, "Off-CPU mode"). The kernel counts the
/// rings against `perf_event_mlock_kb` (516 KiB a CPU by default) and then
/// `RLIMIT_MEMLOCK`: where it refuses them, [`SWITCH_RING_PAGES_SMALL`] are
/// used, and also with the perf-stack engine in a process without
/// `CAP_IPC_LOCK` (its ring of 260 KiB for each thread created later is
/// counted against the same limits).
pub(crate) const SWITCH_RING_PAGES: usize = 256;

/// Data pages of each CPU's ring where the kernel refuses
/// [`SWITCH_RING_PAGES`] (an unprivileged process with a small
/// `RLIMIT_MEMLOCK`): 256 KiB, the writer woken every 64 KiB, records lost
/// after about 30 ms of a futex ping-pong without the writer.
pub(crate) const SWITCH_RING_PAGES_SMALL: usize = 64;

/// Counters of the off-CPU mode, for `Stats`.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SwitchCounts {
    /// Switch records read (and thread creation and exit records).
    pub records: u64,
    /// Records the kernel could not write (ring full).
    pub lost: u64,
    /// Blocked threads captured.
    pub captured: u64,
    /// Captures given up because the thread ran meanwhile.
    pub missed_ran: u64,
    /// Captures refused by the kernel (not dumpable, `process_vm_readv`).
    pub refused: u64,
    /// The last refusal's errno.
    pub refused_errno: i32,
}

/// The switch rings and the pairing of their records.
pub(crate) struct SwitchTracker {
    rings: KernelRings,
    /// The writer's wait over the rings and its control descriptor, when the
    /// engine has no epoll set of its own (see [`SwitchTracker::wait_with`]).
    epoll: Option<crate::recorder::own_fd::OwnFd>,
    pub(crate) pairing: Pairing,
    pub(crate) counts: SwitchCounts,
    /// When a drain last found records lost (unix ns; 0: never).
    lost_at_ns: u64,
    /// A drain found records lost or a ring half full (woken at a quarter
    /// full, the writer came late) since [`SwitchTracker::take_pressed`].
    pressed: bool,
    /// Split times asked for and not reached yet by a drain (unix ns; see
    /// [`SwitchTracker::request_split`]).
    splits: Vec<u64>,
    /// The horizon of the last `collect`: the pairing knows every switch up
    /// to it, not later ones (a writer slow to come back from writing the
    /// intervals took threads that had run since for long waits).
    horizon_ns: u64,
    /// `counts.lost` at the last [`SwitchTracker::take_threads_changed`].
    lost_at_take: u64,
}

impl SwitchTracker {
    /// Open the switch events for every thread alive now but `skip` (the
    /// writer thread), within `budget` descriptors.
    ///
    /// A thread already blocked now (an idle pool started before the
    /// recording) wrote its switch-out before the events existed: each
    /// thread the events were opened for that is sleeping now (state `S` or
    /// `D` in `/proc/self/task/<tid>/stat`, read after the events are in
    /// place) is taken as switched out at the time the events were in place,
    /// and captured at the writer's next tick as any blocked thread. Its
    /// wait is charged from then; if it woke meanwhile, its switch records
    /// (written, since the events were in place) close or replace that.
    ///
    /// The rings are [`SWITCH_RING_PAGES`] (`large`) or
    /// [`SWITCH_RING_PAGES_SMALL`] a CPU; the small ones too where the kernel
    /// refuses the large (locked-memory limit).
    pub(crate) fn start(skip: u32, budget: usize, large: bool) -> io::Result<SwitchTracker> {
        let start = |pages: usize| {
            KernelRings::start_with(skip, budget, pages, &|tid, cpu| open_switch_event(tid, cpu, pages))
        };
        let first = if large { SWITCH_RING_PAGES } else { SWITCH_RING_PAGES_SMALL };
        let rings = match start(first) {
            // The locked-memory limit (`mmap` refused): the smaller rings.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::ENOMEM)) => {
                start(SWITCH_RING_PAGES_SMALL)?
            }
            r => r?,
        };
        let since_ns = super::now_ns();
        let blocked = rings
            .opened
            .iter()
            .copied()
            .filter(|&tid| thread_state(tid).is_some_and(|c| c == 'S' || c == 'D'));
        let pairing = Pairing::recording(blocked, since_ns);
        Ok(SwitchTracker {
            rings,
            epoll: None,
            pairing,
            counts: SwitchCounts::default(),
            lost_at_ns: 0,
            pressed: false,
            splits: Vec::new(),
            horizon_ns: 0,
            lost_at_take: 0,
        })
    }

    /// Descriptors held.
    pub(crate) fn descriptors(&self) -> usize {
        self.rings.fds + usize::from(self.epoll.is_some())
    }

    /// The rings' descriptors, for an epoll set that wakes the writer when
    /// one is a quarter full (edge-triggered: a ring's owner event hangs up when
    /// its thread exits, while the other threads still write into it).
    pub(crate) fn ring_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.rings.ring_fds()
    }

    /// Make an epoll set of the rings and the writer's control descriptor
    /// `wake`, for [`SwitchTracker::wait`] (when the engine has none to add
    /// the rings to).
    pub(crate) fn wait_with(&mut self, wake: std::os::fd::RawFd) -> io::Result<()> {
        use super::perf_stack::{epoll_add, epoll_create, SWITCH_KEY, WAKE_KEY};
        use std::os::fd::AsRawFd;
        let ep = epoll_create()?;
        epoll_add(ep.as_raw_fd(), wake, WAKE_KEY, false)?;
        for fd in self.ring_fds() {
            epoll_add(ep.as_raw_fd(), fd, SWITCH_KEY, true)?;
        }
        self.epoll = Some(ep);
        Ok(())
    }

    /// Whether [`SwitchTracker::wait`] can be used (see `wait_with`).
    pub(crate) fn can_wait(&self) -> bool {
        self.epoll.is_some()
    }

    /// Wait up to `timeout` for a ring to be a quarter full or the control
    /// descriptor to be written.
    pub(crate) fn wait(&mut self, timeout: std::time::Duration) -> super::perf_stack::Woken {
        use super::perf_stack::{epoll_wait_for, Woken, SWITCH_KEY};
        let Some(ep) = &self.epoll else {
            std::thread::sleep(timeout);
            return Woken::Other;
        };
        let mut switches = false;
        epoll_wait_for(ep, timeout, &mut |key, _| switches |= key == SWITCH_KEY);
        if switches {
            Woken::Switches
        } else {
            Woken::Other
        }
    }

    /// Threads alive at start left without events (descriptor budget).
    pub(crate) fn missed_threads(&self) -> u64 {
        self.rings.missed
    }

    /// Stop the events (the rings keep their records for the last drain).
    pub(crate) fn stop(&mut self) {
        self.rings.stop();
    }

    /// Drain the rings and pair their records (in time order across CPUs)
    /// into [`Pairing::done`](super::pairing::Pairing::done). Records stamped after the drain began
    /// are kept for the next call (`all`: none is kept, the rings are
    /// stopped).
    pub(crate) fn collect(&mut self, all: bool) {
        let horizon = if all { u64::MAX } else { super::now_ns() };
        let p = &mut self.pairing;
        p.events.clear();
        p.events.append(&mut p.carry);
        let carried = p.events.len();
        let events = &mut p.events;
        let lost = self.rings.drain_records(&mut |kind, rec| {
            if let Some(e) = parse_record(kind, rec) {
                events.push(e);
            }
        });
        self.counts.lost += lost;
        self.counts.records += (p.events.len() - carried) as u64;
        if lost > 0 {
            self.lost_at_ns = horizon;
        }
        if lost > 0 || self.rings.take_half_full() {
            self.pressed = true;
        }
        self.horizon_ns = horizon;
        p.pair_split(horizon, &mut self.splits);
    }

    /// Write the part up to `at_ns` of every wait still open, and the sums
    /// of short waits up to it, as the drain that reaches `at_ns` pairs its
    /// records ([`Pairing::split_open`](super::pairing::Pairing::split_open)): a reader cutting a window there
    /// (the `http` endpoint) finds every wait before it written, none after.
    /// At most 16 are held (a caller asking for times far ahead cannot grow
    /// the list).
    pub(crate) fn request_split(&mut self, at_ns: u64) {
        if self.splits.len() < 16 {
            self.splits.push(at_ns);
        }
    }

    /// Whether the records drained since the last call may tell of a thread
    /// created or ended: a fork or exit record was read, records were lost
    /// (one of those may have been among them), or some thread alive at
    /// start has no event (its new threads write no fork record). While this
    /// says no, every thread of the process is one the writer listed before
    /// (the events are inherited by every thread created later, and each
    /// creation writes a fork record), so an engine that acts for each new
    /// thread need not list `/proc/self/task` (`writer/threads.rs`).
    pub(crate) fn take_threads_changed(&mut self) -> bool {
        let lost = self.counts.lost != self.lost_at_take;
        self.lost_at_take = self.counts.lost;
        std::mem::take(&mut self.pairing.threads_changed) || lost || self.rings.missed > 0
    }

    /// Whether a drain since the last call found records lost or a ring half
    /// full: the writer falls behind the switches (`writer/priority.rs`).
    pub(crate) fn take_pressed(&mut self) -> bool {
        std::mem::take(&mut self.pressed)
    }

    /// Threads that are out, blocked, and not yet captured in this interval,
    /// to capture now (see [`Pairing::due_captures`](super::pairing::Pairing::due_captures)).
    pub(crate) fn due_captures(&mut self, out: &mut Vec<u32>) {
        // Waits are judged as of the last drain: what is known.
        let known = if self.horizon_ns == 0 || self.horizon_ns == u64::MAX {
            super::now_ns()
        } else {
            self.horizon_ns
        };
        self.pairing.due_captures(known, out);
    }

    /// Whether records were lost within the last second: captures must then
    /// check on their own that their thread did not run (see the module doc).
    pub(crate) fn losing_records(&self) -> bool {
        self.lost_at_ns != 0 && super::now_ns().saturating_sub(self.lost_at_ns) < 1_000_000_000
    }

    /// Attach a capture of `tid` (taken after the last [`collect`](Self::collect)).
    pub(crate) fn set_capture(&mut self, tid: u32, c: Result<Capture, super::blocked::Missed>) {
        use super::blocked::Missed;
        match c {
            Ok(c) => {
                self.counts.captured += 1;
                self.pairing.attach(tid, c);
            }
            Err(Missed::Ran) => self.counts.missed_ran += 1,
            Err(Missed::Refused(errno)) => {
                self.counts.refused += 1;
                self.counts.refused_errno = errno;
            }
        }
    }

    /// Close the intervals of threads still out at `end_ns` (the recording
    /// stops), but for threads that no longer exist or are running.
    pub(crate) fn finish(&mut self, end_ns: u64) {
        // Only a thread that is off the CPU now: one whose switch-in
        // record was lost (ring full) and that runs is not closed.
        self.pairing.finish(end_ns, &|tid| thread_state(tid).is_some_and(|c| c != 'R'));
    }
}

/// The scheduler state letter of thread `tid` (`/proc/self/task/<tid>/stat`,
/// after the command name's closing parenthesis); `None` if it is gone.
fn thread_state(tid: u32) -> Option<char> {
    let s = std::fs::read_to_string(super::procfs::task_path(tid, "stat")).ok()?;
    s.rsplit_once(')')?.1.trim_start().chars().next()
}

/// One record as (time, tid, kind), for the records this event writes.
fn parse_record(kind: u32, rec: &[u8]) -> Option<(u64, u32, u8)> {
    let misc = u16::from_ne_bytes(rec.get(4..6)?.try_into().ok()?);
    match kind {
        RECORD_SWITCH => {
            // header, then sample_id: pid/tid (u32 each), time.
            let tid = (word(rec, 8)? >> 32) as u32;
            let time = word(rec, 16)?;
            let k = if misc & MISC_SWITCH_OUT == 0 {
                0
            } else if misc & MISC_SWITCH_OUT_PREEMPT != 0 {
                2
            } else {
                1
            };
            Some((time, tid, k))
        }
        RECORD_EXIT | RECORD_FORK => {
            // header, pid, ppid, tid, ptid (u32 each), time.
            let tid = (word(rec, 16)? & 0xffff_ffff) as u32;
            let time = word(rec, 24)?;
            Some((time, tid, if kind == RECORD_EXIT { 3 } else { 4 }))
        }
        _ => None,
    }
}

/// Open `tid`'s switch event on `cpu`, for a ring of `pages` data pages.
fn open_switch_event(tid: u32, cpu: i32, pages: usize) -> io::Result<(OwnedFd, bool)> {
    let data_bytes = pages * super::perf_stack::page_size();
    let mut attr = PerfEventAttr {
        type_: PERF_TYPE_SOFTWARE,
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        config: PERF_COUNT_SW_DUMMY,
        sample_period: 0,
        sample_type: SAMPLE_TID | SAMPLE_TIME,
        flags: FLAG_INHERIT
            | FLAG_INHERIT_THREAD
            | FLAG_EXCLUDE_KERNEL
            | FLAG_EXCLUDE_HV
            | FLAG_REMOVE_ON_EXEC
            | FLAG_WATERMARK
            | FLAG_USE_CLOCKID
            | FLAG_TASK
            | FLAG_SAMPLE_ID_ALL
            | FLAG_CONTEXT_SWITCH,
        // With `FLAG_WATERMARK`, bytes: the writer is woken when a ring is a
        // quarter full (three quarters left for its wake-up latency on a busy
        // machine).
        wakeup_events: (data_bytes / 4) as u32,
        clockid: libc::CLOCK_REALTIME,
        ..Default::default()
    };
    open_counting_lost(tid, cpu, &mut attr)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(kind: u32, misc: u16, words: &[u64]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&kind.to_ne_bytes());
        v.extend_from_slice(&misc.to_ne_bytes());
        v.extend_from_slice(&((8 + 8 * words.len()) as u16).to_ne_bytes());
        for w in words {
            v.extend_from_slice(&w.to_ne_bytes());
        }
        v
    }

    #[test]
    fn switch_and_exit_records_parse() {
        let tid_word = (42u64 << 32) | 7;
        assert_eq!(parse_record(14, &rec(14, MISC_SWITCH_OUT, &[tid_word, 1000])), Some((1000, 42, 1)));
        let pre = MISC_SWITCH_OUT | MISC_SWITCH_OUT_PREEMPT;
        assert_eq!(parse_record(14, &rec(14, pre, &[tid_word, 1000])), Some((1000, 42, 2)));
        assert_eq!(parse_record(14, &rec(14, 0, &[tid_word, 2000])), Some((2000, 42, 0)));
        assert_eq!(parse_record(4, &rec(4, 0, &[(7 << 32) | 7, (9 << 32) | 42, 3000])), Some((3000, 42, 3)));
        // A fork: pid, ppid, tid, ptid, time (the new thread 43, created by 42).
        assert_eq!(parse_record(7, &rec(7, 0, &[(7 << 32) | 7, (42 << 32) | 43, 4000])), Some((4000, 43, 4)));
        assert_eq!(parse_record(7, &rec(7, 0, &[(7 << 32) | 7, (42 << 32) | 43])), None, "cut short");
        assert_eq!(parse_record(14, &rec(14, 0, &[tid_word])), None, "cut short");
        assert_eq!(parse_record(9, &rec(9, 0, &[1, 2])), None);
    }

    /// The switch events open unprivileged and see a sleep as one interval
    /// of the right length, with no signal sent. The events cover every
    /// thread of the test process, so other tests running beside this one
    /// (and a loaded machine) can cost an attempt its records: one of five
    /// must see the sleep exactly; a broken tracker fails all five.
    #[test]
    fn a_sleep_is_one_exact_interval() {
        let mut seen = Vec::new();
        for _ in 0..5 {
            let mut t = match SwitchTracker::start(0, 1024, true) {
                Ok(t) => t,
                // CI runs as root, where a kernel never refuses them; an
                // emulator without perf_event_open (qemu-user: ENOSYS, the
                // aarch64 run) has none to give.
                Err(e) if std::env::var_os("CI").is_some() && e.raw_os_error() != Some(libc::ENOSYS) => {
                    panic!("switch events refused in CI: {e}")
                }
                Err(e) => {
                    eprintln!("SKIPPED: switch events refused here: {e}");
                    return;
                }
            };
            let h = std::thread::spawn(|| {
                let tid = super::super::gettid();
                std::thread::sleep(std::time::Duration::from_millis(200));
                tid
            });
            let tid = h.join().unwrap();
            t.collect(false);
            t.stop();
            let slept: u64 = t
                .pairing
                .done
                .iter()
                .filter(|i| i.tid == tid && !i.preempted)
                .map(|i| i.end_ns - i.start_ns)
                .sum();
            if (190_000_000..400_000_000).contains(&slept) {
                return;
            }
            seen.push(format!("slept {slept} ns ({} records, {} lost)", t.counts.records, t.counts.lost));
        }
        panic!("no attempt saw the 200 ms sleep: {}", seen.join("; "));
    }
}
