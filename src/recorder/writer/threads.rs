//! The writer's upkeep of the process's threads: when to list
//! `/proc/self/task` (paced by its own cost), what is known of each thread
//! (sampled, blocking the engine's signal), and whether the program took the
//! engine's signal or descriptors away (step 3 of a tick, `mod.rs`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Run;
use crate::recorder::handler;

/// What is known of one thread of the process.
#[derive(Default, Clone, Copy)]
pub(super) struct ThreadSeen {
    pub(super) sampled: bool,
    /// Sampled in user mode (by the signal; kernel-time samples need none).
    pub(super) user_sampled: bool,
    pub(super) blocking: bool,
}

impl Run {
    /// Note the threads alive now (`tids`); a thread seen for the first time is
    /// checked for blocking the profiling signal (`at_end`: every thread never
    /// sampled is checked again). Returns how many threads were new.
    pub(super) fn scan_threads(&mut self, tids: &[u32], at_end: bool) -> usize {
        let mut news = 0;
        let writer = self.st.shared.writer_tid.load(Ordering::Relaxed);
        // The perf-stack engine sends no signal: no thread can block it.
        let sig = match self.st.engine.kind() {
            crate::Engine::PerfEvent => Some(libc::SIGTRAP),
            crate::Engine::PerfStack => None,
            _ => Some(libc::SIGPROF),
        };
        for &tid in tids {
            if tid == writer {
                continue;
            }
            let new = !self.threads.contains_key(&tid);
            news += new as usize;
            let t = self.threads.entry(tid).or_default();
            if let Some(sig) = sig {
                if (new || (at_end && !t.user_sampled)) && !t.blocking {
                    t.blocking = blocks_signal(tid, sig);
                }
            }
        }
        news
    }

    /// The threads alive now, when this tick should list them: on every tick
    /// for an engine that needs it, else when the handler has named a thread
    /// since the last listing (a thread new to it) or `rescan_every` has
    /// passed (to find threads that block the signal and so are never sampled,
    /// and to let go of the events of threads that exited): [`THREAD_RESCAN`],
    /// doubled after each such listing that found the threads the one before
    /// found (no thread new, none gone) up to [`THREAD_RESCAN_MAX`], and
    /// back to [`THREAD_RESCAN`] when they change. Listing
    /// `/proc/self/task` was two thirds of an idle writer's CPU time, and it
    /// costs in proportion to the threads (about a millisecond for 2,000,
    /// three quarters of the writer's time when 2,000 new threads made every
    /// tick list them; with 1,100 threads that stay, a listing a second was
    /// 8% of the off-CPU mode's writer at 100,000 blockings a second):
    /// listings are paced so that they take at most
    /// 1/[`SCAN_PACE`] of the time (`scan_gap`).
    ///
    /// In the off-CPU mode, such an engine lists only when the switch
    /// records tell of a thread created or ended (or may have: records lost),
    /// besides the clock-driven listings: with 1,100 threads that stay, a
    /// listing at every tick was a fifth of the writer's time at 100,000
    /// blockings a second.
    pub(super) fn threads_to_scan(&mut self) -> Option<Vec<u32>> {
        let named = self.st.shared.names.added();
        let since = self.scanned_at.elapsed();
        let every = self.st.engine.needs_every_scan();
        let told = every && self.st.off_cpu.is_some();
        if told {
            // This tick's records first: a thread created since the last
            // drain is listed now, not a tick later.
            self.collect_switches();
            if let Some(o) = self.st.off_cpu.as_mut() {
                self.threads_changed |= o.tracker_mut().take_threads_changed();
            }
        }
        // (A thread the handler names is new to the writer only where the
        // engine's events are inherited: a per-thread timer or event exists
        // for a thread the writer listed.)
        let asked = if every { !told || self.threads_changed } else { named != self.named_at_scan };
        if !(asked || since >= self.rescan_every) || since < self.scan_gap {
            return None;
        }
        self.named_at_scan = named;
        self.scanned_at = Instant::now();
        let tids = super::sys::list_tids().ok();
        // (A failed listing, such as `EMFILE`, leaves the change to the next tick.)
        self.threads_changed &= tids.is_none();
        // The listing's own cost (what is done once per new thread, such as
        // creating its timer, is not paced).
        self.scan_gap = self.scanned_at.elapsed().saturating_mul(SCAN_PACE).min(THREAD_RESCAN);
        if let Some(tids) = &tids {
            let writer = self.st.shared.writer_tid.load(Ordering::Relaxed);
            let same = tids.len() == self.listed
                && tids.iter().all(|t| *t == writer || self.threads.contains_key(t));
            self.rescan_every = next_rescan(self.rescan_every, same, asked);
            self.listed = tids.len();
        }
        tids
    }

    /// Whether every thread of the program has ended, leaving only the
    /// writer: its main thread ended with `pthread_exit` (it stays listed, a
    /// zombie) and every other thread is gone or a zombie too. The C library
    /// would then have ended the process (`exit(0)` by the last thread to
    /// end), but the writer counts as a thread, so it never does: the writer
    /// must (see [`super::main`]). Checked at each tick: one read of the main
    /// thread's state, a listing only when it is a zombie.
    pub(super) fn program_gone(&self) -> bool {
        let pid = self.st.pid;
        if thread_state(pid) != Some(b'Z') {
            return false;
        }
        let Ok(tids) = super::sys::list_tids() else { return false };
        let writer = self.st.shared.writer_tid.load(Ordering::Relaxed);
        // (The endpoint's threads count as the program's: glibc would keep
        // the process while they run.)
        tids.iter().all(|&t| t == writer || t == pid || thread_state(t) == Some(b'Z'))
    }

    /// Whether the program replaced our handler of the engine's signal (a
    /// program that calls `sigaction` without an interposer: see
    /// `sys/sigaction.rs`). If so the engine stops sending it, so the
    /// program's handler never sees our signals again, and `Stats` says so.
    /// Whether the program closed the perf events is asked at most every
    /// [`CLOSED_CHECK_EVERY`] (and at the end: `at_end`).
    pub(super) fn check_signal(&mut self, at_end: bool) {
        if self.signal_lost {
            return;
        }
        let closed_due = at_end || self.closed_checked.is_none_or(|t| t.elapsed() >= CLOSED_CHECK_EVERY);
        if closed_due {
            self.closed_checked = Some(Instant::now());
        }
        if closed_due && self.st.engine.closed_by_program() {
            self.signal_lost = true;
            self.st.warnings.push(format!(
                "the program closed the recorder's perf-event descriptors {:.1} s into the recording: \
                 sampling stopped there",
                self.st.started.elapsed().as_secs_f64()
            ));
            return;
        }
        let Some(sig) = self.st.engine.signal() else { return };
        if sig == libc::SIGTRAP && handler::trap_deferred() {
            self.signal_lost = true;
            self.st.engine.stop_signals();
            self.st.warnings.push(format!(
                "a thread that blocks SIGTRAP was sent one {:.1} s into the recording; it was left pending \
                 for the program, so the perf-event engine stopped there (user time is not sampled after it)",
                self.st.started.elapsed().as_secs_f64()
            ));
            return;
        }
        if handler::holds(sig) {
            return;
        }
        self.signal_lost = true;
        self.st.engine.stop_signals();
        let name = if sig == libc::SIGTRAP { "SIGTRAP" } else { "SIGPROF" };
        self.st.warnings.push(format!(
            "the program installed its own {name} handler {:.1} s into the recording: the {} engine stopped \
             there (user time is not sampled after it; record under `spulse record` or LD_PRELOAD, which \
             keep the program's handler and go on sampling)",
            self.st.started.elapsed().as_secs_f64(),
            self.st.engine.kind().name(),
        ));
    }
}

/// The time to the next clock-driven listing after one that found the
/// threads of the one before (`same`) or not, and was `asked` for (a thread
/// newly named, an engine that lists at every tick) or driven by the clock:
/// doubled up to [`THREAD_RESCAN_MAX`] by a clock-driven listing that found
/// nothing new, back to [`THREAD_RESCAN`] when the threads changed.
fn next_rescan(every: Duration, same: bool, asked: bool) -> Duration {
    match (same, asked) {
        (true, false) => every.saturating_mul(2).min(THREAD_RESCAN_MAX),
        (true, true) => every,
        (false, _) => THREAD_RESCAN,
    }
}

/// Time between two listings of the process's threads when nothing else
/// asks for one, while they change (see `threads_to_scan`).
pub(super) const THREAD_RESCAN: Duration = Duration::from_secs(1);

/// The longest time between two listings, reached while the threads stay the
/// same: a thread that blocks the engine's signal (never sampled) is found
/// at most this late (and always at the end); a thread of the perf-stack or
/// thread-timer engines is listed at the next tick in any case (every tick,
/// or in the off-CPU mode the next one whose switch records tell of it).
const THREAD_RESCAN_MAX: Duration = Duration::from_secs(8);

/// New threads found by one listing that make an engine needing every scan
/// (the thread-timer engines) raise the writer's priority.
pub(super) const NEW_THREADS_PRESSURE: usize = 64;

/// A listing of the threads waits at least this
/// many times its last cost after it: at most 1% of the writer's time.
const SCAN_PACE: u32 = 100;

/// How often a tick asks whether the program closed the perf events'
/// descriptors (a `readlink` of `/proc/self/fd/N` per event kind, about
/// 3 us each here: up to a tenth of a busy writer's CPU when asked at every
/// tick, and ticks come every millisecond while samples pour in). Nothing
/// is done through those descriptors between the checks (the rings are
/// memory, and `stop` checks each descriptor before closing it), so a later
/// answer only dates the warning up to this much later.
const CLOSED_CHECK_EVERY: Duration = Duration::from_millis(100);

/// Whether thread `tid` of this process blocks signal `sig` (its `SigBlk` mask
/// in `/proc/self/task/<tid>/status`); false when that cannot be read.
pub(super) fn blocks_signal(tid: u32, sig: i32) -> bool {
    let Ok(status) = std::fs::read_to_string(crate::recorder::sys::procfs::task_path(tid, "status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigBlk:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|mask| sig >= 1 && mask & (1u64 << (sig - 1)) != 0)
}

/// User plus system CPU time of thread `tid` of this process, in clock ticks
/// (`/proc/self/task/<tid>/stat`); `None` when it is gone.
pub(super) fn thread_cpu_ticks(tid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(crate::recorder::sys::procfs::task_path(tid, "stat")).ok()?;
    // After the command name's closing parenthesis: state is field 3, utime
    // and stime are fields 14 and 15.
    let mut f = s.rsplit_once(')')?.1.split_ascii_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The warning for threads seen blocking the engine's signal (`sig`).
pub(super) fn blocking_warning(n: usize, sig: i32) -> String {
    let (name, how) = if sig == libc::SIGTRAP {
        (
            "SIGTRAP",
            "under `spulse record` or LD_PRELOAD spulse keeps SIGTRAP out of the real masks set by \
             `pthread_sigmask`/`sigprocmask`, so these blocked it otherwise (a raw system call, spulse embedded \
             as a library, or a SIGTRAP left pending for them)",
        )
    } else {
        ("SIGPROF", "the timer engines cannot sample a thread that blocks it")
    };
    format!(
        "{n} thread{} blocked the profiling signal ({name}) and were not sampled while they did (their CPU \
         time then is missing from the profile); {how}",
        if n == 1 { "" } else { "s" }
    )
}

/// A thread's state letter from `/proc/self/task/<tid>/stat` (`R`, `S`, `Z`,
/// ...); `None` if it cannot be read (gone, or `/proc` refused).
fn thread_state(tid: u32) -> Option<u8> {
    let stat = std::fs::read(super::sys::procfs::task_path(tid, "stat")).ok()?;
    // "tid (comm) S ...": the comm may hold spaces and parentheses.
    let close = stat.iter().rposition(|&b| b == b')')?;
    stat.get(close + 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Clock-driven listings that find the same threads back off to 8 s;
    /// one asked for keeps the pace; a change brings it back to 1 s.
    #[test]
    fn listings_back_off_while_the_threads_stay_and_return_when_they_change() {
        let mut every = THREAD_RESCAN;
        let mut seen = vec![];
        for _ in 0..5 {
            every = next_rescan(every, true, false);
            seen.push(every.as_secs());
        }
        assert_eq!(seen, [2, 4, 8, 8, 8]);
        assert_eq!(next_rescan(every, true, true), THREAD_RESCAN_MAX);
        assert_eq!(next_rescan(every, false, false), THREAD_RESCAN);
        assert_eq!(next_rescan(every, false, true), THREAD_RESCAN);
    }
}
