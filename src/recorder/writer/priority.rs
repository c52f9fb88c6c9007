//! The writer's scheduling priority under pressure.
//!
//! The writer is one thread among the program's. Where the program keeps
//! hundreds or thousands of threads runnable, the fair scheduler gives the
//! writer one slice a round among them, and a round of 2,000 CPU-bound threads
//! on two CPUs lasts seconds: the writer woke, waited its turn for seconds and
//! three quarters of the samples were lost to a full ring meanwhile.
//!
//! So when the ring fills faster than the writer drains it, the writer's nice
//! value goes to [`BOOST`] below the one it started with (-20 at the lowest),
//! and back up a [`STEP`] after each [`CALM`] without pressure. Two things see
//! the pressure: a sampled thread's signal handler that finds the ring half
//! full or full (it cannot wait for the writer's turn: it asks at once, with
//! one `setpriority` system call, once until the priority is given back; see
//! `WriterBoost`), and the writer's own tick (samples lost, more than half
//! the ring taken in one tick, or context-switch records of the off-CPU mode
//! lost: its rings wake the writer at a quarter full, so a loss means the
//! writer got no CPU for the time three quarters of a ring take to fill). The writer's work is bounded by the sampling
//! rate (it sleeps while the ring is empty), so a higher weight only lets it
//! take the CPU its work needs, when it needs it. Only the writer thread
//! changes; the program's threads never do. Lowering a nice value needs
//! `CAP_SYS_NICE` or a `RLIMIT_NICE` that allows it; where it is refused,
//! nothing more is tried and a warning says so.

use std::time::{Duration, Instant};

use super::super::handler::WriterBoost;

/// Nice values below its start's the writer takes under pressure.
pub(crate) const BOOST: i32 = 20;

/// The lowest nice value there is.
const MIN_NICE: i32 = -20;

/// Nice values per step back.
pub(crate) const STEP: i32 = 5;

/// Time without pressure after which the writer gives one step back.
pub(crate) const CALM: Duration = Duration::from_secs(2);

/// What the writer's priority is and may do.
pub(crate) struct Priority {
    tid: libc::pid_t,
    /// The nice value the writer started with (inherited from the thread
    /// that started the recorder).
    base: i32,
    /// The nice value taken under pressure.
    floor: i32,
    /// The nice value now.
    now: i32,
    /// The lowest nice value taken so far.
    lowest: i32,
    /// The error of a refused change, after which no change is tried.
    refused: Option<std::io::Error>,
    /// When pressure was last seen (or the last step back taken).
    calm_since: Instant,
}

/// The calling thread's id.
fn gettid() -> libc::pid_t {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as libc::pid_t }
}

/// The nice value of thread `tid`.
fn nice_of(tid: libc::pid_t) -> std::io::Result<i32> {
    // getpriority returns -1 both as a value and as an error: errno tells.
    // SAFETY: __errno_location gives this thread's errno.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: getpriority reads scheduling state; PRIO_PROCESS with a thread
    // id addresses that thread on Linux.
    let v = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) };
    if v == -1 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error().unwrap_or(0) != 0 {
            return Err(e);
        }
    }
    Ok(v)
}

fn set_nice(tid: libc::pid_t, nice: i32) -> std::io::Result<()> {
    // SAFETY: setpriority changes only thread `tid`'s nice value (the
    // writer's own: it is called on the writer thread with its id).
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

impl Priority {
    /// For the calling thread (the writer), at its present nice value; arms
    /// the handlers' request.
    pub(crate) fn new(boost: &WriterBoost) -> Priority {
        let tid = gettid();
        let base = nice_of(tid).unwrap_or(0);
        let floor = (base - BOOST).max(MIN_NICE).min(base);
        boost.rearm(floor);
        Priority { tid, base, floor, now: base, lowest: base, refused: None, calm_since: Instant::now() }
    }

    /// One tick: what the handlers did, and `pressed` when the writer found
    /// the ring filling faster than it drains it. True when the nice value
    /// changed.
    pub(crate) fn observe(&mut self, pressed: bool, boost: &WriterBoost) -> bool {
        self.observe_at(pressed, boost, Instant::now())
    }

    fn observe_at(&mut self, pressed: bool, boost: &WriterBoost, now: Instant) -> bool {
        let state = boost.state();
        if state == WriterBoost::TAKEN && self.now == self.base && self.floor != self.base {
            // A handler raised it (to `floor`): handlers ask only while the
            // state is idle, which it is only while the writer is at `base`.
            self.now = self.floor;
            self.lowest = self.lowest.min(self.floor);
            self.calm_since = now;
            return true;
        }
        if state & WriterBoost::REFUSED != 0 && self.refused.is_none() {
            self.refused = Some(std::io::Error::from_raw_os_error((state & 0xffff) as i32));
        }
        if pressed {
            self.calm_since = now;
            if self.refused.is_some() || self.now <= self.floor {
                return false;
            }
            match set_nice(self.tid, self.floor) {
                Ok(()) => {
                    // Handlers need not ask.
                    boost.taken();
                    self.now = self.floor;
                    self.lowest = self.lowest.min(self.floor);
                    true
                }
                Err(e) => {
                    boost.refuse(e.raw_os_error().unwrap_or(0));
                    self.refused = Some(e);
                    false
                }
            }
        } else if self.now < self.base && now.duration_since(self.calm_since) >= CALM {
            self.calm_since = now;
            let want = (self.now + STEP).min(self.base);
            // Raising a nice value is always allowed; if it fails anyway the
            // writer keeps its priority (it only ever helps it drain).
            if set_nice(self.tid, want).is_err() {
                return false;
            }
            self.now = want;
            if want == self.base {
                boost.rearm(self.floor);
            }
            true
        } else {
            false
        }
    }

    /// The lowest nice value the writer took, when it took one below its
    /// start.
    pub(crate) fn raised_to(&self) -> Option<i32> {
        (self.lowest < self.base).then_some(self.lowest)
    }

    /// The nice value the writer started with.
    pub(crate) fn base(&self) -> i32 {
        self.base
    }

    /// Why the priority could not be raised, when it could not.
    pub(crate) fn refused(&self) -> Option<&std::io::Error> {
        self.refused.as_ref()
    }
}

/// Whether a tick in which `arrived` samples came into a ring of `capacity`
/// slots, `lost` of them lost to a full ring, shows the writer falling
/// behind.
pub(crate) fn pressed(arrived: u64, lost: u64, capacity: u64) -> bool {
    lost > 0 || arrived.saturating_mul(2) > capacity
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pressure_is_loss_or_half_a_ring() {
        assert!(!pressed(0, 0, 1024));
        assert!(!pressed(512, 0, 1024));
        assert!(pressed(513, 0, 1024));
        assert!(pressed(1, 1, 1024));
    }

    /// On a thread of its own (nice values are per thread here): pressure
    /// takes the floor at once where allowed (root), and each CALM without
    /// pressure gives a step back; where refused, nothing changes and the
    /// error is kept.
    #[test]
    fn pressure_takes_the_floor_and_calm_steps_back_or_is_refused() {
        std::thread::spawn(|| {
            let boost = WriterBoost::new();
            let mut p = Priority::new(&boost);
            let base = p.base();
            let changed = p.observe(true, &boost);
            match p.refused() {
                None => {
                    assert!(changed);
                    assert_eq!(nice_of(gettid()).unwrap(), (base - BOOST).max(MIN_NICE));
                    assert_eq!(p.raised_to(), Some((base - BOOST).max(MIN_NICE)));
                    assert_eq!(boost.state(), WriterBoost::TAKEN);
                }
                Some(e) => {
                    assert!(!changed, "refused ({e}) yet changed");
                    assert_eq!(nice_of(gettid()).unwrap(), base);
                    assert_eq!(p.raised_to(), None);
                }
            }
            assert!(!p.observe(true, &boost), "a second pressure changes nothing");
            let t0 = Instant::now();
            assert!(!p.observe_at(false, &boost, t0), "no step back before CALM");
            let mut t = t0;
            let mut back = 0;
            for _ in 0..10 {
                t += CALM;
                if p.observe_at(false, &boost, t) {
                    back += 1;
                }
            }
            let expect = if p.refused().is_some() {
                0
            } else {
                (base - (base - BOOST).max(MIN_NICE) + STEP - 1) / STEP
            };
            assert_eq!(back, expect);
            assert_eq!(nice_of(gettid()).unwrap(), base);
            if p.refused().is_none() {
                assert_eq!(boost.state(), WriterBoost::IDLE, "handlers may ask again");
            }
        })
        .join()
        .unwrap();
    }

    /// A handler's request (made here from the thread itself) raises the
    /// priority once, and the writer's next tick adopts it.
    #[test]
    fn a_handler_request_is_adopted_by_the_tick() {
        std::thread::spawn(|| {
            let boost = WriterBoost::new();
            let mut p = Priority::new(&boost);
            let base = p.base();
            boost.request(gettid() as u32);
            let state = boost.state();
            if state == WriterBoost::TAKEN {
                assert_eq!(nice_of(gettid()).unwrap(), (base - BOOST).max(MIN_NICE));
                assert!(p.observe(false, &boost));
                assert_eq!(p.raised_to(), Some((base - BOOST).max(MIN_NICE)));
            } else {
                assert_ne!(state & WriterBoost::REFUSED, 0, "state {state:#x}");
                assert!(!p.observe(true, &boost));
                assert!(p.refused().is_some());
                assert_eq!(nice_of(gettid()).unwrap(), base);
            }
            // A second request does nothing until the writer rearms.
            boost.request(gettid() as u32);
            assert_eq!(boost.state(), state);
        })
        .join()
        .unwrap();
    }
}
