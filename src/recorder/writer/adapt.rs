//! The automatic engine's switch check (see `EngineChoice::Auto`).
//!
//! The perf-event engine's events live in each thread's perf context: every
//! context switch schedules them out and in, and re-arms their high-resolution
//! timers. On a virtual machine reprogramming the timer device traps to the
//! hypervisor, and that costs from under a microsecond to several per switch
//! (measured on the development VM: a futex ping-pong's CPU per round trip
//! 1.7x with the events, 1.16x with per-thread CPU timers). Per-thread CPU
//! timers are checked by the kernel at its scheduler tick and cost nothing per
//! switch. So, while the automatic choice runs the perf-event engine, the
//! writer reads the process's voluntary context switches and CPU time
//! (`getrusage`, its own left out) every tick, and once the program blocks more than
//! [`SWITCH_HEAVY_PER_CPU_SECOND`] times per CPU-second over a window of at
//! least [`MIN_WINDOW_CPU`] of the program's CPU, it moves to the timers. It
//! happens at most once; the warning says when and why.

use std::time::{Duration, Instant};

use super::super::builder::PER_THREAD_ENGINE_FLUSH_INTERVAL;
use super::super::engine::Engine;
use super::super::handler;
use super::super::stats::{KernelTime, SWITCH_HEAVY_PER_CPU_SECOND};
use super::super::sys;
use super::Run;
use nix::sys::signal::Signal;

/// The least CPU time of the program a window must hold before its switch
/// rate decides anything (a burst of thread starts is no pattern).
pub(crate) const MIN_WINDOW_CPU: Duration = Duration::from_millis(50);

/// A window that has not reached [`MIN_WINDOW_CPU`] after this long starts
/// over: a mostly idle program's switches cost little in all.
const MAX_WINDOW: Duration = Duration::from_secs(5);

/// A window's worth of program CPU after which a quiet window starts over
/// (the rate that counts is the recent one).
const MAX_WINDOW_CPU: Duration = Duration::from_secs(2);

/// The process's voluntary context switches (see [`own_switches`]) and CPU
/// time, the calling thread's left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Usage {
    pub switches: u64,
    pub cpu_ns: u64,
}

fn rusage(who: libc::c_int) -> Option<(u64, u64)> {
    // SAFETY: rusage is plain data; zero is a valid value to fill in.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes the struct we pass.
    if unsafe { libc::getrusage(who, &mut ru) } != 0 {
        return None;
    }
    let ns = |t: libc::timeval| (t.tv_sec as u64).saturating_mul(1_000_000_000) + (t.tv_usec as u64) * 1000;
    Some((own_switches(&ru), ns(ru.ru_utime).saturating_add(ns(ru.ru_stime))))
}

/// The switches that say what the program does: the voluntary ones (it
/// blocked: a lock, a channel, I/O, a sleep). Involuntary ones (preempted)
/// are the machine's doing: on a busy host other tasks' wake-ups preempt
/// even a program that never blocks thousands of times per CPU-second
/// (a two-thread spin loop read 5,124 next to two fuzzers), while a program's
/// own oversubscription is paced by the scheduler's time slice, far below
/// [`SWITCH_HEAVY_PER_CPU_SECOND`].
fn own_switches(ru: &libc::rusage) -> u64 {
    ru.ru_nvcsw as u64
}

impl Usage {
    /// Now, for the process but the calling thread (the writer).
    pub(crate) fn now() -> Option<Usage> {
        let (sw, cpu) = rusage(libc::RUSAGE_SELF)?;
        let (own_sw, own_cpu) = rusage(libc::RUSAGE_THREAD)?;
        Some(Usage { switches: sw.saturating_sub(own_sw), cpu_ns: cpu.saturating_sub(own_cpu) })
    }
}

/// What one check of a window found.
#[derive(Debug, PartialEq)]
pub(crate) enum Verdict {
    /// Not enough of the program's CPU yet: keep the window.
    Wait,
    /// A window's worth, below the threshold: start a new window.
    Restart,
    /// Switch-heavy: this many switches per CPU-second.
    Heavy(u64),
}

/// The verdict on a window that began at `from` (`age` ago) and reached `to`.
pub(crate) fn judge(from: Usage, to: Usage, age: Duration) -> Verdict {
    let cpu = to.cpu_ns.saturating_sub(from.cpu_ns);
    let switches = to.switches.saturating_sub(from.switches);
    if cpu < MIN_WINDOW_CPU.as_nanos() as u64 {
        return if age >= MAX_WINDOW { Verdict::Restart } else { Verdict::Wait };
    }
    let rate = (switches as u128 * 1_000_000_000 / cpu as u128) as u64;
    if rate > SWITCH_HEAVY_PER_CPU_SECOND {
        Verdict::Heavy(rate)
    } else if cpu >= MAX_WINDOW_CPU.as_nanos() as u64 || age >= MAX_WINDOW {
        Verdict::Restart
    } else {
        Verdict::Wait
    }
}

/// The automatic engine's state while it runs the perf-event engine.
pub(crate) struct Adapt {
    period_ns: u64,
    writer_tid: u32,
    /// Whether the flush interval was left to the default (it is shortened
    /// for the timers, which cover a new thread at the next tick).
    shorten_flush: bool,
    from: Option<(Usage, Instant)>,
    /// A thread seen blocking SIGPROF at the last verdict: the move waits
    /// for the next tick's, since a thread being created blocks every signal
    /// for a moment (glibc's `pthread_create` until the thread starts).
    suspect: Option<u32>,
    /// No check before this: `getrusage(RUSAGE_SELF)` sums every thread of
    /// the process (0.1 ms and more with 2,000 threads), so checks are at
    /// least [`CHECK_GAP`] and [`CHECK_PACE`] times their cost apart.
    next_check: Instant,
}

/// How long after start the writer ticks at least every [`EARLY_TICK`]
/// while the switch check is pending (the move, if due, comes early).
pub(crate) const EARLY: Duration = Duration::from_secs(2);

/// The longest wait between ticks in the first [`EARLY`] of a recording
/// while the switch check is pending.
pub(crate) const EARLY_TICK: Duration = Duration::from_millis(10);

/// The least time between two checks of the switch rate (a window needs
/// [`MIN_WINDOW_CPU`] of the program's CPU anyway).
const CHECK_GAP: Duration = Duration::from_millis(10);

/// A check waits at least this many times its cost after the last.
const CHECK_PACE: u32 = 100;

impl Adapt {
    pub(crate) fn new(period_ns: u64, writer_tid: u32, shorten_flush: bool) -> Adapt {
        Adapt { period_ns, writer_tid, shorten_flush, from: None, suspect: None, next_check: Instant::now() }
    }

    /// The switch rate, when the window says the program is switch-heavy.
    fn check(&mut self) -> Option<u64> {
        let t0 = Instant::now();
        if t0 < self.next_check {
            return None;
        }
        let now = Usage::now();
        self.next_check = t0 + CHECK_GAP.max(t0.elapsed().saturating_mul(CHECK_PACE));
        let now = now?;
        let Some((from, at)) = self.from else {
            self.from = Some((now, Instant::now()));
            return None;
        };
        match judge(from, now, at.elapsed()) {
            Verdict::Wait => None,
            Verdict::Restart => {
                self.from = Some((now, Instant::now()));
                None
            }
            Verdict::Heavy(rate) => Some(rate),
        }
    }
}

/// What a switch-heavy verdict does about `found`, a thread seen blocking
/// SIGPROF now: `None` to wait for the next tick (a thread seen for the first
/// time may be starting), else the thread that blocks it for sure, if any.
fn settle(suspect: &mut Option<u32>, found: Option<u32>) -> Option<Option<u32>> {
    match found {
        Some(t) if *suspect != Some(t) => {
            *suspect = Some(t);
            None
        }
        found => Some(found),
    }
}

impl Run {
    /// With the automatic engine on perf events: move to per-thread CPU
    /// timers once the program is seen to switch context often. Called by
    /// the tick after its drain.
    pub(super) fn adapt_engine(&mut self) {
        let Some(adapt) = self.st.adapt.as_mut() else { return };
        if self.signal_lost || !matches!(self.st.engine, Engine::Perf(..)) {
            self.st.adapt = None;
            return;
        }
        let Some(rate) = adapt.check() else { return };
        let (period_ns, writer_tid, shorten) = (adapt.period_ns, adapt.writer_tid, adapt.shorten_flush);
        // A thread that blocks SIGPROF would keep the timers' signals pending,
        // for the program to read as its own if it takes its blocked signals
        // (`sigwait`, `signalfd`). One seen once is looked at again at the
        // next tick: a thread being created blocks every signal for a moment.
        let tids = sys::list_tids().unwrap_or_default();
        let found = tids
            .iter()
            .copied()
            .find(|&t| t != writer_tid && super::threads::blocks_signal(t, libc::SIGPROF));
        let Some(blocking) = settle(&mut adapt.suspect, found) else { return };
        // One try: whatever comes of it, the engine stays as it then is.
        self.st.adapt = None;
        let at = self.st.started.elapsed().as_secs_f64();
        if let Some(t) = blocking {
            self.st.warnings.push(format!(
                "the program blocks (switches context voluntarily) {rate} times per CPU-second, which the perf-event engine's \
                 events make costly, but its thread {t} blocks SIGPROF, which the per-thread CPU timers would \
                 send; the perf-event engine stays"
            ));
            return;
        }
        if let Err(e) = handler::install(Signal::SIGPROF) {
            self.st.warnings.push(format!(
                "the program blocks (switches context voluntarily) {rate} times per CPU-second, which the perf-event engine's \
                 events make costly, but the per-thread CPU timers could not take over ({e}); the perf-event \
                 engine stays"
            ));
            return;
        }
        let timers = match sys::timer::ThreadTimers::start(period_ns, writer_tid) {
            Ok(t) => t,
            Err(e) => {
                self.st.warnings.push(format!(
                    "the program blocks (switches context voluntarily) {rate} times per CPU-second, which the perf-event engine's \
                     events make costly, but the per-thread CPU timers were refused ({e}); the perf-event \
                     engine stays"
                ));
                return;
            }
        };
        // The kernel-time rings' last samples, then the events go: the
        // timers count system time too.
        self.drain_stacks(false);
        let mut old = std::mem::replace(&mut self.st.engine, Engine::Threads(timers));
        old.stop();
        drop(old);
        let had_kernel = self.st.kernel_time == KernelTime::Sampled;
        self.st.kernel_time = KernelTime::Unmarked;
        if shorten {
            self.st.interval = self.st.interval.min(PER_THREAD_ENGINE_FLUSH_INTERVAL);
        }
        self.st.warnings.push(format!(
            "the program blocks (switches context voluntarily) {rate} times per CPU-second (more than {SWITCH_HEAVY_PER_CPU_SECOND}), \
             and each switch re-arms the perf-event engine's timers: {at:.1} s into the recording the recorder \
             moved to per-thread CPU timers, which cost nothing per switch; from there on a thread is sampled \
             at most once per kernel tick, each sample weighted by the periods it stands for{} \
             (RecorderBuilder::engine(EngineChoice::PerfEvent) or SPULSE_ENGINE=perf-event keeps the \
             perf-event engine)",
            if had_kernel { ", and system time is charged to the user stack that entered the kernel" } else { "" }
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(switches: u64, cpu_ms: u64) -> Usage {
        Usage { switches, cpu_ns: cpu_ms * 1_000_000 }
    }

    #[test]
    fn a_cpu_bound_program_stays_and_a_switching_one_does_not() {
        let s = Duration::from_secs(1);
        // Too little CPU to judge: wait, then start over after MAX_WINDOW.
        assert_eq!(judge(u(0, 0), u(10_000, 10), s), Verdict::Wait);
        assert_eq!(judge(u(0, 0), u(10_000, 10), MAX_WINDOW), Verdict::Restart);
        // Preemption at the tick: a few hundred per CPU-second.
        assert_eq!(judge(u(0, 0), u(300, 1000), s), Verdict::Wait);
        assert_eq!(judge(u(0, 0), u(600, 2000), s), Verdict::Restart);
        // A ping-pong: 4 switches every 20 us of CPU.
        assert_eq!(judge(u(1000, 100), u(21_000, 200), s), Verdict::Heavy(200_000));
        // Just above and at the threshold.
        let at = SWITCH_HEAVY_PER_CPU_SECOND;
        assert_eq!(judge(u(0, 0), u(at / 10 + 1, 100), s), Verdict::Heavy(at + 10));
        assert_eq!(judge(u(0, 0), u(at / 10, 100), s), Verdict::Wait);
    }

    /// A thread caught blocking SIGPROF once (glibc blocks every signal in
    /// a thread it is creating) does not stop the move; one caught twice does.
    #[test]
    fn a_thread_blocking_sigprof_must_be_seen_twice() {
        let mut suspect = None;
        assert_eq!(settle(&mut suspect, Some(5)), None);
        assert_eq!(settle(&mut suspect, Some(7)), None, "another thread: wait again");
        assert_eq!(settle(&mut suspect, None), Some(None), "gone: move");
        let mut suspect = None;
        assert_eq!(settle(&mut suspect, Some(7)), None);
        assert_eq!(settle(&mut suspect, Some(7)), Some(Some(7)), "seen twice: stay");
        assert_eq!(settle(&mut None, None), Some(None));
    }

    #[test]
    fn usage_counts_other_threads_cpu() {
        // (Other tests run beside this one and only add to it.)
        let before = Usage::now().unwrap();
        std::thread::spawn(|| {
            // 60 ms of this thread's CPU time (not wall time: on a loaded
            // machine it gets less CPU than wall time).
            let cpu = || {
                let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                // SAFETY: clock_gettime writes the timespec we pass.
                unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
                ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
            };
            let t = cpu();
            let mut x = 0u64;
            while cpu() - t < 60_000_000 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        })
        .join()
        .unwrap();
        let after = Usage::now().unwrap();
        assert!(after.cpu_ns - before.cpu_ns >= 40_000_000, "{before:?} {after:?}");
        assert!(after.switches >= before.switches);
    }
}
