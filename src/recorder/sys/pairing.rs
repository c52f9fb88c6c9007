//! The pairing of the switch records that `perf_switch.rs` drains into
//! off-CPU intervals, and the choice of the blocked threads to capture.
//!
//! # Intervals
//! The writer drains the rings at each tick, and between ticks whenever a
//! ring is a quarter full (the events' wake-up watermark; the writer waits on the
//! rings in `epoll_wait`, so a switch-heavy program is drained as fast as it
//! fills them, not every 100 ms). It orders the records of all CPUs by time
//! and pairs each switch-out of a thread with its next switch-in: that
//! interval is exact (the kernel's own timestamps). Records stamped after
//! the drain began wait for the next drain: another CPU's ring, read
//! earlier, may still get records before them, and pairing out of order
//! would lose the interval. A thread still out
//! when the recording stops is closed at the stop; one that exited is
//! forgotten. A thread already blocked when the recording starts (it
//! switched out before the events existed) is found at start, in
//! `/proc/self/task/<tid>/stat`, and taken as switched out then.
//!
//! # Captures
//! At each writer tick, a thread found blocked (switched out, not
//! preempted, and not yet back) is captured at most once an interval
//! (`blocked.rs`: its system call and stack, with no signal and without
//! waking it): a thread that stays blocked costs nothing more, however long
//! it stays. Every thread out for at least [`LONG_WAIT_NS`] is captured; of
//! those out for less (most wake before their capture is written; a program
//! blocking 100,000 times a second has about a hundred of them at each tick)
//! about [`SHORT_CAPTURES_PER_SECOND`], chosen at random among them: a
//! sample of where the short waits are, at a bounded cost (a capture is a
//! few tens of microseconds). Each thread out is as likely to be chosen, at
//! every pass, whatever the number out with it ([`Pairing::choose_short`]),
//! so the captures fall where blocked time is; the longest out first chose,
//! among threads sleeping 1 ms at a time, those about to wake (92% of the
//! captures were of a thread that had run again). The capture belongs to
//! the interval only if the thread was out over the whole capture (from
//! before its `syscall` read to after its stack copy): one taken after a
//! wake-up the writer had not yet seen is moved to the next interval that
//! contains it, or dropped; one during which the thread was switched in is
//! dropped (its copy may mix two stacks). This check needs every switch-in
//! record: for a second after records were lost (ring full), each capture
//! also checks on its own that its thread was not scheduled in meanwhile
//! (`blocked.rs`, `schedstat`). A capture taken before a loss was known is
//! not checked again: a switch-in of its thread lost during the copy is
//! harmless unless the thread's next switch-out is lost too (its switch-out
//! then replaces the interval and its capture), and then that interval is
//! wrong in any case (it spans the time the thread ran).

use rustc_hash::FxHashMap as HashMap;

use super::tid_map::TidMap;

/// A thread found out (blocked) for at least this long by a capture pass is
/// always captured: such a wait is worth its capture (a few microseconds of
/// the writer's CPU for at least this much blocked time), and every wait
/// longer than this plus the writer's tick interval gets its stack.
pub(crate) const LONG_WAIT_NS: u64 = 5_000_000;

/// Captures a second of threads out for less than [`LONG_WAIT_NS`] (most of
/// them wake before their capture is of use; a switch-heavy program has
/// thousands of them blocked at each tick): a sample of where short waits
/// are, chosen at random, at a bounded cost. Up to a second's worth is
/// held for a burst. A capture costs the writer 20-50 us on the VM of
/// BENCHMARKS.md ("Off-CPU mode"), more when it succeeds (the stack copy
/// and its unwinding): at 100 a second they were a seventh of its time
/// under 100,000 blockings a second. Chosen at random, 10 a second find
/// their thread still blocked more often than 25 chosen longest out first
/// did (which mostly found it running again), and cost less.
pub(crate) const SHORT_CAPTURES_PER_SECOND: u64 = 10;

/// Waits shorter than this that got no stack (uncaptured blocked waits, and
/// preempted ones) are summed per thread and state until the writer's next
/// tick, and written as one interval each (FORMAT.md, tag 9: `start_us` the
/// first one's start, `duration_us` their sum): a thread blocking 1,000
/// times a second writes about ten records a second instead of 1,000, and
/// the spool and the writer pay per tick, not per switch, for the waits that
/// are `[blocked, under 5 ms]` or `[waiting for CPU]`. Totals stay exact; such a
/// record sits at its first wait's start (its waits lie between that and
/// the tick). Longer waits, and every wait with a stack, are written one by
/// one.
pub(crate) const SUM_BELOW_NS: u64 = LONG_WAIT_NS;

/// A thread out this long without a record, and captured (or preempted),
/// is parked ([`Pairing::parked`]) at the next capture pass.
pub(crate) const PARK_NS: u64 = 100_000_000;

/// What the capture of a blocked thread found (filled by the writer, which
/// unwinds the copied stack).
#[derive(Debug, Clone)]
pub(crate) struct Capture {
    /// When the capture started (unix nanoseconds, before the `syscall`
    /// read).
    pub at_ns: u64,
    /// When it ended (after the stack copy). It is kept only for an
    /// interval that holds all of `at_ns..=end_ns`: the thread was not
    /// switched in meanwhile.
    pub end_ns: u64,
    /// The system call it was blocked in (`None`: outside one).
    pub syscall: Option<u64>,
    /// Module-table generation the addresses belong to.
    pub generation: u64,
    /// Whether the walk stopped before the root.
    pub truncated: bool,
    /// Leaf first; the leaf is the pc the system call returns to. Kept
    /// after the stack is defined: a new segment defines it again.
    pub addrs: Vec<u64>,
    /// The stack as the writer defined it in the current segment (label
    /// leaf included); `None` until then, and again once a new segment
    /// begins (`Pairing::forget_stacks`).
    pub stack: Option<crate::StackId>,
}

/// One off-CPU interval of one thread.
#[derive(Debug, Clone)]
pub(crate) struct Interval {
    pub tid: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Runnable but preempted (waiting for a CPU), rather than blocked.
    pub preempted: bool,
    /// Where it blocked, if a capture was taken while it was out (boxed:
    /// most intervals have none, and an interval is moved a few times).
    pub capture: Option<Box<Capture>>,
    /// A sum of short waits without a stack ([`SUM_BELOW_NS`]), not one wait.
    pub summed: bool,
}

/// A thread switched out and not seen back yet.
#[derive(Debug)]
struct Out {
    time_ns: u64,
    preempted: bool,
    /// A capture was attempted (taken or not) during this interval.
    tried: bool,
    capture: Option<Box<Capture>>,
    /// `time_ns` is where [`Pairing::split_open`] cut the wait, not its
    /// start: the rest is written on its own, never summed as a short wait.
    split: bool,
}

/// A thread the switch records named: out (and since when) or not. An
/// entry stays while its thread switches (one lookup a record, no insertion
/// and removal a blocking); it goes when its thread exits, or at a
/// [`SwitchTracker::due_captures`](super::perf_switch::SwitchTracker::due_captures) when its thread is not out and had no
/// record since the one before (so the map holds the threads out or active
/// lately, not every thread that ever ran).
#[derive(Debug, Default)]
struct Seen {
    out: Option<Out>,
    /// A record named the thread since the last `due_captures`.
    recent: bool,
    /// The latest time of a record that named the thread (records paired
    /// late, from another CPU's ring, may be older than the state).
    last_ns: u64,
    /// Its short waits without a stack since the last
    /// [`Pairing::flush_sums`] ([`SUM_BELOW_NS`]): blocked, preempted.
    sums: [Option<Sum>; 2],
    /// In [`Pairing::summed`] (listed once until its sums are flushed).
    listed: bool,
}

/// Short waits of one thread in one state, summed ([`SUM_BELOW_NS`]).
#[derive(Debug, Clone, Copy)]
struct Sum {
    /// The first one's start (unix ns).
    start_ns: u64,
    /// Their durations, each truncated to microseconds at both ends as a
    /// single interval's is (so the sum is what their records would add up to).
    us: u64,
}

impl Sum {
    /// As an interval: at the first wait's start, as long as their sum.
    fn interval(self, tid: u32, preempted: bool) -> Interval {
        let end_ns = (self.start_ns / 1000).saturating_add(self.us).saturating_mul(1000);
        Interval {
            tid,
            start_ns: self.start_ns,
            end_ns: end_ns.max(self.start_ns),
            preempted,
            capture: None,
            summed: true,
        }
    }
}

/// Push `seen`'s sums, if any, as intervals of `tid`, the one that began
/// first first (the two may overlap in time: each sits at its first wait).
fn flush_seen(tid: u32, seen: &mut Seen, done: &mut Vec<Interval>) {
    let [blocked, preempted] = [seen.sums[0].take(), seen.sums[1].take()];
    let (first, second) = match (blocked, preempted) {
        (Some(b), Some(p)) if p.start_ns < b.start_ns => ((p, true), Some((b, false))),
        (Some(b), p) => ((b, false), p.map(|p| (p, true))),
        (None, Some(p)) => ((p, true), None),
        (None, None) => return,
    };
    done.push(first.0.interval(tid, first.1));
    if let Some((sum, preempted)) = second {
        done.push(sum.interval(tid, preempted));
    }
}

/// The pairing of switch records into intervals (no descriptor: the
/// tracker drains the rings into [`Pairing::events`]).
#[derive(Default)]
pub(crate) struct Pairing {
    /// (time, tid, kind) of the last drain: 0 in, 1 out, 2 out preempted, 3
    /// exit, 4 a thread (or a child process) created.
    pub(super) events: Vec<(u64, u32, u8)>,
    /// Records stamped after the last drain began, for the next one.
    pub(super) carry: Vec<(u64, u32, u8)>,
    /// The events merged in time order (swapped with `events`; kept for its
    /// capacity).
    merged: Vec<(u64, u32, u8)>,
    /// Threads by tid (those out are the pending intervals), but the
    /// parked ones.
    threads: TidMap<Seen>,
    /// Threads out for [`PARK_NS`] or more without a record, captured or
    /// preempted and without sums, by tid: kept apart so that the map each
    /// switch record looks up holds the threads that switch, not a pool of
    /// idle ones (1,000 idle threads in it made each wait's pairing 60%
    /// dearer: the switching threads' entries spread over a table ten times
    /// larger). A record of a parked thread brings it back.
    parked: HashMap<u32, Seen>,
    /// Captures taken after a wake-up not yet seen, by thread.
    orphans: HashMap<u32, Box<Capture>>,
    /// Finished intervals, for the writer to take.
    pub(crate) done: Vec<Interval>,
    /// Captures dropped because their thread was switched in during the
    /// capture.
    pub(crate) dropped: u64,
    /// The short waits' sampling ([`Pairing::choose_short`]): the time of
    /// the last pass (unix ns; 0: none yet), the mean number of threads out
    /// for a short wait at a pass (smoothed over about a second), and the
    /// credit carried from pass to pass (systematic sampling).
    short_at: u64,
    short_mean: f64,
    short_credit: f64,
    /// The state of the random choice of short waits to capture
    /// (xorshift64; never zero once drawn from).
    short_rng: u64,
    /// Threads out for less than [`LONG_WAIT_NS`] at this pass.
    short: Vec<u32>,
    /// Threads to park at this pass.
    to_park: Vec<u32>,
    /// Waits without a stack shorter than this are summed
    /// ([`SUM_BELOW_NS`] when recording; 0, none, in the pairing's own tests).
    sum_below_ns: u64,
    /// Threads with sums to flush.
    summed: Vec<u32>,
    /// Waits measured (switch-out paired with its switch-in, or closed at
    /// the end), summed or not.
    pub(crate) waits: u64,
    /// Threads created or ended (fork and exit records) since
    /// [`SwitchTracker::take_threads_changed`](super::perf_switch::SwitchTracker::take_threads_changed).
    pub(super) threads_changed: bool,
}

impl Pairing {
    /// The pairing of a recording: `blocked` (threads found sleeping once
    /// the events were in place, which switched out before they existed) are
    /// taken as switched out at `since_ns`.
    pub(super) fn recording(blocked: impl IntoIterator<Item = u32>, since_ns: u64) -> Pairing {
        let mut threads = TidMap::default();
        for tid in blocked {
            let out = Out { time_ns: since_ns, preempted: false, tried: false, capture: None, split: false };
            threads.insert(
                tid,
                Seen { out: Some(out), recent: true, last_ns: since_ns, sums: [None; 2], listed: false },
            );
        }
        Pairing { threads, sum_below_ns: SUM_BELOW_NS, ..Pairing::default() }
    }

    /// Pair the records of [`Pairing::events`] (each CPU's in time order)
    /// stamped up to `horizon`, in time order across CPUs; keep the later
    /// ones for the next call.
    #[cfg(test)]
    fn pair(&mut self, horizon: u64) {
        self.pair_split(horizon, &mut Vec::new());
    }

    /// [`Pairing::pair`], splitting at each time of `splits` up to `horizon`
    /// when the records reach it ([`Pairing::split_open`]: the sums of
    /// short waits and the open waits are written up to there); the later
    /// split times stay in `splits`.
    pub(super) fn pair_split(&mut self, horizon: u64, splits: &mut Vec<u64>) {
        // Records of one CPU are in order; across CPUs they are not. The
        // stable sort finds the runs (the carried ones, one per CPU) and
        // merges them: linear. By time alone (a 5% cheaper pairing than by
        // time and kind): records of one time keep their ring's order, and
        // two of one thread are never of one time on two CPUs. The usual
        // batch (two CPUs' runs, nothing carried) is merged into a buffer
        // kept for the next: no allocation and no copy back (the sort
        // allocated its scratch, as large as the batch, at every drain).
        match two_runs(&self.events) {
            Some(mid) => {
                merge_runs(&self.events[..mid], &self.events[mid..], &mut self.merged);
                std::mem::swap(&mut self.events, &mut self.merged);
            }
            None => self.events.sort_by_key(|&(t, _, _)| t),
        }
        let cut = self.events.partition_point(|&(t, _, _)| t <= horizon);
        self.carry.extend_from_slice(&self.events[cut..]);
        let mut from = 0;
        if !splits.is_empty() {
            splits.sort_unstable();
            let reached = splits.partition_point(|&at| at <= horizon);
            for at in splits.drain(..reached) {
                let upto = self.events[..cut].partition_point(|&(t, _, _)| t <= at).max(from);
                self.apply_range(from, upto);
                from = upto;
                self.split_open(at);
            }
        }
        self.apply_range(from, cut);
    }

    fn apply_range(&mut self, from: usize, to: usize) {
        for i in from..to {
            let (time_ns, tid, kind) = self.events[i];
            self.apply(time_ns, tid, kind);
        }
    }

    fn apply(&mut self, time_ns: u64, tid: u32, kind: u8) {
        match kind {
            0 => {
                let parked = &mut self.parked;
                let Some(seen) = self.threads.get_or_insert_with(tid, || parked.remove(&tid)) else {
                    return;
                };
                seen.recent = true;
                seen.last_ns = seen.last_ns.max(time_ns);
                if let Some(o) = seen.out.take() {
                    self.waits += 1;
                    let mut capture = o.capture;
                    if let Some(c) = capture.take_if(|c| c.end_ns >= time_ns) {
                        if c.at_ns >= time_ns {
                            // Taken after this wake-up: it belongs to a later interval.
                            self.orphans.insert(tid, c);
                        } else {
                            // Switched in during the capture: the copy may mix two stacks.
                            self.dropped += 1;
                        }
                    }
                    let end_ns = time_ns.max(o.time_ns);
                    if capture.is_none() && !o.split && end_ns - o.time_ns < self.sum_below_ns {
                        let us = end_ns / 1000 - o.time_ns / 1000;
                        if !seen.listed {
                            seen.listed = true;
                            self.summed.push(tid);
                        }
                        match &mut seen.sums[o.preempted as usize] {
                            Some(sum) => sum.us += us,
                            empty => *empty = Some(Sum { start_ns: o.time_ns, us }),
                        }
                    } else {
                        // Its sums first: a thread's records stay in time order.
                        flush_seen(tid, seen, &mut self.done);
                        self.done.push(Interval {
                            tid,
                            start_ns: o.time_ns,
                            end_ns,
                            preempted: o.preempted,
                            capture,
                            summed: false,
                        });
                    }
                }
            }
            1 | 2 => {
                // (Orphans are rare: most switches find none to look up.)
                let orphan = if self.orphans.is_empty() { None } else { self.orphans.remove(&tid) };
                let capture = orphan.filter(|c| c.at_ns > time_ns);
                let tried = capture.is_some();
                // New, forgotten or parked (a parked one's wait is replaced:
                // its switch-in was lost).
                let parked = &mut self.parked;
                let Some(seen) =
                    self.threads.get_or_insert_with(tid, || Some(parked.remove(&tid).unwrap_or_default()))
                else {
                    // Not a thread id (`u32::MAX`): no record of ours says so.
                    return;
                };
                seen.recent = true;
                seen.last_ns = seen.last_ns.max(time_ns);
                seen.out = Some(Out { time_ns, preempted: kind == 2, tried, capture, split: false });
            }
            4 => self.threads_changed = true,
            _ => {
                self.threads_changed = true;
                if let Some(mut seen) = self.threads.remove(tid) {
                    flush_seen(tid, &mut seen, &mut self.done);
                }
                if !self.parked.is_empty() {
                    self.parked.remove(&tid);
                }
                if !self.orphans.is_empty() {
                    self.orphans.remove(&tid);
                }
            }
        }
    }

    /// Threads to capture at `now_ns`, in tid order: those out and blocked
    /// (not preempted) and not yet tried in this interval, of which those out
    /// for at least [`LONG_WAIT_NS`] and named by no record in that time
    /// all (records from two CPUs' rings can pair out of order, leaving an
    /// older switch-out as the state of a thread that has run since: a slow
    /// writer saw hundreds of such false long waits a second), and of the others as many as the
    /// short-wait allowance ([`SHORT_CAPTURES_PER_SECOND`]) lets, chosen at
    /// random (see the module doc). Each listed is marked as tried (one attempt per
    /// interval); one left out may be listed at a later pass of the same
    /// interval (as a long wait, once it is one). Forgets the threads neither
    /// out nor named by a record since the last call, and parks those out
    /// and named by no record for [`PARK_NS`] once tried or if preempted
    /// ([`Pairing::parked`]: a parked thread is never due again in the same
    /// interval, so the passes skip them).
    pub(crate) fn due_captures(&mut self, now_ns: u64, out: &mut Vec<u32>) {
        out.clear();
        let short = &mut self.short;
        short.clear();
        let to_park = &mut self.to_park;
        to_park.clear();
        self.threads.retain(|tid, seen| {
            let recent = std::mem::replace(&mut seen.recent, false);
            let quiet = !seen.listed && now_ns.saturating_sub(seen.last_ns) >= PARK_NS;
            match seen.out.as_mut() {
                Some(o) => {
                    if quiet && (o.tried || o.preempted) && seen.sums.iter().all(Option::is_none) {
                        to_park.push(tid);
                    } else if !o.preempted && !o.tried {
                        if now_ns.saturating_sub(o.time_ns) >= LONG_WAIT_NS {
                            if now_ns.saturating_sub(seen.last_ns) >= LONG_WAIT_NS {
                                o.tried = true;
                                out.push(tid);
                            }
                        } else {
                            short.push(tid);
                        }
                    }
                    true
                }
                // (Sums are flushed before each tick's pass, but those of
                // the records drained just before it are not: kept.)
                None => recent || seen.sums.iter().any(Option::is_some),
            }
        });
        if !self.to_park.is_empty() {
            for &tid in &self.to_park {
                if let Some(seen) = self.threads.remove(tid) {
                    self.parked.insert(tid, seen);
                }
            }
            // A table that held the idle threads is dense again.
            if self.threads.capacity() > 4 * self.threads.len() + 64 {
                self.threads.shrink_to(2 * self.threads.len());
            }
        }
        let n = self.choose_short(now_ns);
        for &tid in &self.short[..n] {
            if let Some(o) = self.threads.get_mut(tid).and_then(|s| s.out.as_mut()) {
                o.tried = true;
            }
            out.push(tid);
        }
        out.sort_unstable();
    }

    /// Move the short waits to capture at this pass to the front of
    /// `self.short` and say how many. Each thread out for a short wait is
    /// chosen with the same probability, whatever the others do: the
    /// allowance of the time since the last pass ([`SHORT_CAPTURES_PER_SECOND`])
    /// over the mean number of such threads at a pass, not over this pass's
    /// number. (Dividing by this pass's number made a wait's chance depend
    /// on how many threads waited with it: the waits of a lock, which come
    /// in crowds, and those of a sleep, which do not, were captured at
    /// different rates, and `--spread-blocked` charged them unevenly.) In a
    /// random order, by systematic sampling with the credit carried over, so
    /// that the number taken stays within one of the allowance; at most
    /// [`SHORT_CAPTURES_PER_SECOND`] at one pass.
    fn choose_short(&mut self, now_ns: u64) -> usize {
        let n = self.short.len();
        let dt_s = if self.short_at == 0 { 0.0 } else { now_ns.saturating_sub(self.short_at) as f64 / 1e9 };
        self.short_at = now_ns;
        // The mean over about a second of passes (the first pass: its own).
        let a = if self.short_mean == 0.0 { 1.0 } else { dt_s.min(1.0) };
        self.short_mean += a * (n as f64 - self.short_mean);
        if n == 0 || self.short_mean <= 0.0 {
            return 0;
        }
        let allowance = SHORT_CAPTURES_PER_SECOND as f64 * dt_s.min(1.0);
        let p = (allowance / self.short_mean).min(1.0);
        // A random order (Fisher-Yates), then every candidate adds `p` to
        // the credit and is taken each time it reaches 1.
        for k in 0..n.saturating_sub(1) {
            let j = k + (self.random() % (n - k) as u64) as usize;
            self.short.swap(k, j);
        }
        let mut taken = 0;
        for k in 0..n {
            self.short_credit += p;
            if self.short_credit >= 1.0 && taken < SHORT_CAPTURES_PER_SECOND as usize {
                self.short_credit -= 1.0;
                self.short.swap(taken, k);
                taken += 1;
            }
        }
        // (The cap never binds: the mean includes this pass's number with
        // the weight of its time, so `p * n` is at most the allowance.)
        taken
    }

    /// The next number of the tracker's random sequence (xorshift64: the
    /// choice of short waits to capture, the writer's tick jitter).
    pub(crate) fn random(&mut self) -> u64 {
        let x = match self.short_rng {
            0 => 0x9e37_79b9_7f4a_7c15,
            x => x,
        };
        let x = x ^ (x << 13);
        let x = x ^ (x >> 7);
        let x = x ^ (x << 17);
        self.short_rng = x;
        x
    }

    /// Push every thread's sums of short waits ([`SUM_BELOW_NS`]) as
    /// intervals, in tid order (the writer's tick, before it writes them).
    pub(crate) fn flush_sums(&mut self) {
        self.summed.sort_unstable();
        for &tid in &self.summed {
            if let Some(seen) = self.threads.get_mut(tid) {
                flush_seen(tid, seen, &mut self.done);
                seen.listed = false;
            }
        }
        self.summed.clear();
    }

    /// Write the part up to `at_ns` of every wait still open that began
    /// before it, and start the rest of each at `at_ns` (a reader cutting a
    /// window there sees the time of threads still waiting, which would
    /// otherwise be written only when they wake). `at_ns` must not be later
    /// than the last drain's horizon (every switch up to it is known). The
    /// part written keeps the wait's capture if that capture ended by
    /// `at_ns` (a later one is checked when the thread wakes); the rest keeps
    /// it in any case. In tid order, after every thread's sums of short
    /// waits ([`Pairing::flush_sums`]).
    pub(crate) fn split_open(&mut self, at_ns: u64) {
        self.flush_sums();
        let first = self.done.len();
        let parked = self.parked.iter_mut().map(|(&tid, seen)| (tid, seen));
        for (tid, seen) in self.threads.iter_mut().chain(parked) {
            let Some(o) = seen.out.as_mut().filter(|o| o.time_ns < at_ns) else { continue };
            let capture = o.capture.as_ref().filter(|c| c.end_ns <= at_ns).cloned();
            self.done.push(Interval {
                tid,
                start_ns: o.time_ns,
                end_ns: at_ns,
                preempted: o.preempted,
                capture,
                summed: false,
            });
            o.time_ns = at_ns;
            o.split = true;
        }
        self.done[first..].sort_unstable_by_key(|i| i.tid);
    }

    /// Forget the spool stacks of every capture held (a new segment
    /// begins: its stacks are defined afresh); each is defined again from
    /// its addresses when its interval is written.
    pub(crate) fn forget_stacks(&mut self) {
        let outs = (self.threads.values_mut().chain(self.parked.values_mut()))
            .filter_map(|s| s.out.as_mut())
            .filter_map(|o| o.capture.as_mut());
        let rest = self.orphans.values_mut().chain(self.done.iter_mut().filter_map(|i| i.capture.as_mut()));
        for c in outs.chain(rest) {
            c.stack = None;
        }
    }

    /// The threads with a wait paired and not yet written: in
    /// [`Pairing::done`], or summed ([`Pairing::summed`]).
    pub(crate) fn unwritten(&self) -> impl Iterator<Item = u32> + '_ {
        self.done.iter().map(|i| i.tid).chain(self.summed.iter().copied())
    }

    /// Whether `tid` is out now (its wait not yet written), parked or not.
    pub(crate) fn is_out(&self, tid: u32) -> bool {
        match self.threads.get(tid) {
            Some(seen) => seen.out.is_some(),
            None => self.parked.get(&tid).is_some_and(|seen| seen.out.is_some()),
        }
    }

    /// Attach capture `c` to `tid`'s interval, if it is out (parked or not:
    /// a pass lists only threads not tried yet, which it does not park, so a
    /// capture's thread is normally in the switching table).
    pub(super) fn attach(&mut self, tid: u32, c: Capture) {
        let seen = match self.threads.get_mut(tid) {
            Some(seen) => Some(seen),
            None => self.parked.get_mut(&tid),
        };
        if let Some(o) = seen.and_then(|s| s.out.as_mut()) {
            o.capture = Some(Box::new(c));
        }
    }

    /// Close the intervals of threads still out at `end_ns` for which
    /// `off_now` holds, in tid order (after the sums of short waits);
    /// forget the others.
    pub(super) fn finish(&mut self, end_ns: u64, off_now: &dyn Fn(u32) -> bool) {
        self.flush_sums();
        for (tid, seen) in self.parked.drain() {
            self.threads.insert(tid, seen);
        }
        let mut tids: Vec<u32> =
            self.threads.iter().filter(|(_, s)| s.out.is_some()).map(|(tid, _)| tid).collect();
        tids.sort_unstable();
        for tid in tids {
            let o = self.threads.get_mut(tid).and_then(|s| s.out.take()).expect("listed");
            if off_now(tid) && end_ns > o.time_ns {
                self.waits += 1;
                self.done.push(Interval {
                    tid,
                    start_ns: o.time_ns,
                    end_ns,
                    preempted: o.preempted,
                    capture: o.capture,
                    summed: false,
                });
            }
        }
    }
}

/// Where the second of exactly two runs in time order of `events` begins
/// (`None`: fewer or more runs).
fn two_runs(events: &[(u64, u32, u8)]) -> Option<usize> {
    let mut mid = None;
    for i in 1..events.len() {
        if events[i].0 < events[i - 1].0 {
            if mid.is_some() {
                return None;
            }
            mid = Some(i);
        }
    }
    mid
}

/// `a` and `b` (each in time order) merged into `out` in time order, `a`'s
/// record first of two of one time (as a stable sort of `a` then `b`).
fn merge_runs(a: &[(u64, u32, u8)], b: &[(u64, u32, u8)], out: &mut Vec<(u64, u32, u8)>) {
    out.clear();
    out.reserve(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        // Branch-free: which run comes next is as good as random.
        let from_b = y.0 < x.0;
        out.push(if from_b { y } else { x });
        j += usize::from(from_b);
        i += usize::from(!from_b);
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two runs are merged as the stable sort by time would order them
    /// (ties: the first run's record first); other batches are told apart.
    #[test]
    fn two_runs_merge_as_a_stable_sort_would() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let mut out = Vec::new();
        for _ in 0..500 {
            let (na, nb) = (next(40), next(40));
            let mut run = |n: u64, tid: u32| {
                let mut t = 0;
                (0..n)
                    .map(|i| {
                        t += next(3);
                        (t, tid, i as u8)
                    })
                    .collect::<Vec<_>>()
            };
            let a = run(na, 1);
            let b = run(nb, 2);
            let mut all = a.clone();
            all.extend_from_slice(&b);
            let mut want = all.clone();
            want.sort_by_key(|&(t, _, _)| t);
            match two_runs(&all) {
                Some(mid) => {
                    assert!(mid > 0 && mid < all.len());
                    merge_runs(&all[..mid], &all[mid..], &mut out);
                    assert_eq!(out, want);
                }
                // One run (b's first not before a's last, or one empty).
                None => assert_eq!(all, want),
            }
        }
        assert_eq!(two_runs(&[(3, 1, 0), (2, 1, 0), (1, 1, 0)]), None, "three runs");
    }

    /// A capture pass long after the records of these tests: every wait
    /// still out is a long one.
    const LATER: u64 = 1 << 40;
    const MS: u64 = 1_000_000;

    /// A record carried to the next call pairs there, before the next
    /// drain's records of its time, as if all had been sorted at once.
    #[test]
    fn carried_records_pair_with_the_next_drain() {
        let mut p = Pairing::default();
        // The carried records, then CPU 0's and CPU 1's.
        p.events.extend([(10, 1, 1), (20, 2, 1)]);
        p.events.extend([(30, 1, 0), (60, 1, 1)]);
        p.events.extend([(25, 2, 0), (55, 3, 2), (70, 2, 1)]);
        p.pair(50);
        assert_eq!(done(&mut p), [(2, 20, 25, false, None), (1, 10, 30, false, None)]);
        let mut kept = p.carry.clone();
        kept.sort_unstable();
        assert_eq!(kept, [(55, 3, 2), (60, 1, 1), (70, 2, 1)]);
        p.events.clear();
        p.events.append(&mut p.carry);
        p.events.extend([(58, 3, 0), (65, 1, 0)]);
        p.events.extend([(60, 3, 1), (80, 2, 0), (90, 3, 0)]);
        p.pair(100);
        assert_eq!(
            done(&mut p),
            [
                (3, 55, 58, true, None),
                (1, 60, 65, false, None),
                (2, 70, 80, false, None),
                (3, 60, 90, false, None)
            ]
        );
        assert!(p.carry.is_empty());
    }

    /// A pass lists every thread out for a long wait, and of those out for a
    /// short one a sample: each with the same chance whatever the number out
    /// with it, about [`SHORT_CAPTURES_PER_SECOND`] a second in all; one left
    /// out is listed at a later pass of the same interval once it is long.
    #[test]
    fn short_waits_are_sampled_evenly_within_their_allowance_long_ones_always() {
        const S: u64 = 1_000_000_000;
        let mut p = Pairing::default();
        let mut tids = Vec::new();
        let now = 100 * S;
        // 10 threads out for 10 ms; 1,000 out for 1 ms or less.
        for tid in 0..10u32 {
            p.events.push((now - 10_000_000, tid, 1));
        }
        for i in 0..1000u64 {
            p.events.push((now - 1_000_000 + i, 1000 + i as u32, 1));
        }
        p.pair(u64::MAX);
        p.due_captures(now, &mut tids);
        assert!(tids.iter().copied().eq(0..10), "every long wait, no short one at the first pass: {tids:?}");
        // 50 ms later the short ones are long: all listed, once.
        p.due_captures(now + 50_000_000, &mut tids);
        assert_eq!(tids.len(), 1000);
        p.due_captures(now + 10 * S, &mut tids);
        assert!(tids.is_empty(), "each thread is tried once an interval");
        // Passes 50 ms apart for 100 s, alternately with 1 and 9 threads
        // newly out (each back in before the next pass): the lone ones are
        // taken as often as those of a crowd, 10 a second in all.
        let mut p = Pairing::default();
        let (mut lone, mut crowd) = (0u64, 0u64);
        let mut tid = 1u32;
        for pass in 0..2000u64 {
            let t = now + pass * 50_000_000;
            let n = if pass % 2 == 0 { 1 } else { 9 };
            let first = tid;
            for _ in 0..n {
                p.events.push((t - 1_000, tid, 1));
                tid += 1;
            }
            p.pair(u64::MAX);
            p.due_captures(t, &mut tids);
            let taken = tids.iter().filter(|&&x| x >= first).count() as u64;
            if n == 1 {
                lone += taken;
            } else {
                crowd += taken;
            }
            for x in first..tid {
                p.events.push((t + 1_000, x, 0));
            }
            p.pair(u64::MAX);
        }
        let (lone_rate, crowd_rate) = (lone as f64 / 1000.0, crowd as f64 / 9000.0);
        assert!((950..=1010).contains(&(lone + crowd)), "{} taken in 100 s", lone + crowd);
        assert!(
            (lone_rate / crowd_rate - 1.0).abs() < 0.25,
            "a lone thread taken at {lone_rate:.3}, one of a crowd at {crowd_rate:.3}"
        );
    }

    fn cap(at_ns: u64) -> Capture {
        cap_to(at_ns, at_ns + 10)
    }

    fn cap_to(at_ns: u64, end_ns: u64) -> Capture {
        Capture {
            at_ns,
            end_ns,
            syscall: Some(202),
            generation: 0,
            truncated: false,
            addrs: vec![],
            stack: None,
        }
    }

    /// (tid, start, end, preempted, capture time) of the finished intervals.
    fn done(p: &mut Pairing) -> Vec<(u32, u64, u64, bool, Option<u64>)> {
        p.done
            .drain(..)
            .map(|i| (i.tid, i.start_ns, i.end_ns, i.preempted, i.capture.map(|c| c.at_ns)))
            .collect()
    }

    /// Short waits without a stack are summed per thread and state until the
    /// flush, exactly as their records would add up (each truncated to
    /// microseconds at both ends), at the first one's start; a long or
    /// captured wait is written alone, after its thread's sums, and an exit
    /// flushes its thread's sums. Every wait is counted.
    #[test]
    fn short_waits_without_a_stack_are_summed_per_thread_and_state() {
        let mut p = Pairing { sum_below_ns: SUM_BELOW_NS, ..Pairing::default() };
        let t0 = 1_000_000_000u64;
        let long = t0 + 5_000 + SUM_BELOW_NS;
        p.events = vec![
            (t0 + 999, 1, 1),
            (t0 + 2_001, 1, 0), // 2 us as its own record
            (t0 + 1_000, 3, 1),
            (t0 + 2_000, 3, 0),
            (t0 + 3_000, 3, 1), // captured below
            (t0 + 1_000, 4, 1),
            (t0 + 3_000, 4, 0),
        ];
        p.pair(t0 + 3_000);
        p.attach(3, cap_to(t0 + 3_100, t0 + 3_200));
        p.events = vec![
            (t0 + 4_000, 3, 0),
            (t0 + 5_000, 4, 3), // exits
            (t0 + 5_000, 2, 1),
            (long, 2, 0), // not short
            (t0 + 10_000, 1, 1),
            (t0 + 13_000, 1, 0), // 3 us
            (t0 + 20_000, 1, 2),
            (t0 + 21_000, 1, 0), // 1 us preempted
        ];
        p.pair(u64::MAX);
        assert_eq!(
            done(&mut p),
            vec![
                (3, t0 + 1_000, t0 + 2_000, false, None),
                (3, t0 + 3_000, t0 + 4_000, false, Some(t0 + 3_100)),
                (4, t0 + 1_000, t0 + 3_000, false, None),
                (2, t0 + 5_000, long, false, None),
            ]
        );
        p.flush_sums();
        assert_eq!(
            done(&mut p),
            vec![(1, t0 + 999, t0 + 5_000, false, None), (1, t0 + 20_000, t0 + 21_000, true, None)]
        );
        assert_eq!(p.waits, 7);
        // Nothing is left to flush.
        p.flush_sums();
        assert!(p.done.is_empty());
    }

    /// A split asked for is made when the drain's records reach its time:
    /// the sums of the short waits before it are written as they stand
    /// then (all before the split time), the wait open across it is cut
    /// there, and the waits after it sum anew; a split beyond the drain's
    /// horizon waits for a later drain.
    #[test]
    fn a_split_cuts_the_sums_where_the_records_reach_it() {
        let mut p = Pairing { sum_below_ns: SUM_BELOW_NS, ..Pairing::default() };
        let t0 = 1_000_000_000u64;
        let at = t0 + 10_000;
        p.events = vec![
            (t0, 1, 1),
            (t0 + 2_000, 1, 0), // 2 us before the split
            (t0 + 4_000, 1, 1),
            (t0 + 5_000, 1, 0), // 1 us before
            (t0 + 8_000, 1, 1),
            (t0 + 13_000, 1, 0), // across the split: 2 us before, 3 after
            (t0 + 20_000, 1, 1),
            (t0 + 21_000, 1, 0), // 1 us after
        ];
        let mut splits = vec![t0 + 1_000_000, at];
        p.pair_split(t0 + 500_000, &mut splits);
        assert_eq!(splits, vec![t0 + 1_000_000], "the later split waits");
        assert_eq!(
            done(&mut p),
            vec![
                (1, t0, t0 + 3_000, false, None),
                (1, t0 + 8_000, at, false, None),
                (1, at, at + 3_000, false, None)
            ],
            "the sum before the split (3 us at the first wait's start), then the open wait's part, and its \
             rest on its own (never summed: a wait cut by a split is not a short one)"
        );
        p.flush_sums();
        assert_eq!(done(&mut p), vec![(1, t0 + 20_000, t0 + 21_000, false, None)], "after the split: 1 us");
        assert_eq!(p.waits, 4);
    }

    /// A split writes the part up to its time of each wait open before it
    /// (with its capture if that ended by then), and the rest follows as
    /// its own interval when the thread wakes, with the capture: the parts
    /// add up to the wait. A thread that switched out after the split time,
    /// or is not out, is left alone.
    #[test]
    fn a_split_writes_the_open_waits_up_to_its_time() {
        let mut p = Pairing::default();
        p.events.extend([(10, 1, 1), (20, 2, 2), (30, 3, 1), (40, 3, 0), (150, 4, 1)]);
        p.pair(u64::MAX);
        p.attach(1, cap(50));
        assert_eq!(done(&mut p), [(3, 30, 40, false, None)]);
        p.split_open(100);
        assert_eq!(done(&mut p), [(1, 10, 100, false, Some(50)), (2, 20, 100, true, None)]);
        // A capture that ends after the split time goes with the rest only.
        p.attach(2, cap_to(90, 120));
        p.events.clear();
        p.events.extend([(200, 1, 0), (210, 2, 0), (220, 4, 0)]);
        p.pair(u64::MAX);
        assert_eq!(
            done(&mut p),
            [(1, 100, 200, false, Some(50)), (2, 100, 210, true, Some(90)), (4, 150, 220, false, None)]
        );
        // Nothing open: nothing written.
        p.split_open(300);
        assert!(p.done.is_empty());
    }

    /// Two CPUs' records, each in order, interleave in time: each switch-out
    /// pairs with the same thread's next switch-in, and intervals come out
    /// in the order they ended; records after the horizon wait for the next
    /// call.
    #[test]
    fn records_of_two_cpus_pair_in_time_order() {
        let mut p = Pairing::default();
        // CPU 0's ring, then CPU 1's.
        p.events.extend([(100, 1, 1), (300, 2, 0), (400, 3, 2)]);
        p.events.extend([(50, 2, 1), (200, 1, 0), (450, 3, 0), (600, 1, 1), (900, 1, 0)]);
        p.pair(500);
        assert_eq!(
            done(&mut p),
            [(1, 100, 200, false, None), (2, 50, 300, false, None), (3, 400, 450, true, None)]
        );
        assert_eq!(p.carry, [(600, 1, 1), (900, 1, 0)], "stamped after the horizon: kept");
        p.events.clear();
        p.events.append(&mut p.carry);
        p.pair(u64::MAX);
        assert_eq!(done(&mut p), [(1, 600, 900, false, None)]);
        // A switch-in without its switch-out (lost, or before the start) makes nothing.
        p.events.clear();
        p.events.push((1000, 7, 0));
        p.pair(u64::MAX);
        assert!(p.done.is_empty());
    }

    /// A thread has one entry while it switches; it goes when the thread
    /// exits, or at a capture pass when it is in and had no record since the
    /// pass before. A thread that stays blocked stays (and is listed for a
    /// capture once an interval).
    #[test]
    fn thread_entries_stay_while_switching_and_go_when_idle_or_exited() {
        let mut p = Pairing::default();
        let mut tids = Vec::new();
        for i in 0..1000u64 {
            p.events.extend([(10 * i, 1, 1), (10 * i + 5, 1, 0)]);
        }
        p.events.extend([(20_000, 2, 1), (20_001, 3, 1), (20_002, 4, 2), (20_003, 3, 3)]);
        p.pair(u64::MAX);
        assert_eq!(p.done.len(), 1000);
        assert_eq!(tracked(&p), [1, 2, 4], "3 exited");
        p.due_captures(LATER, &mut tids);
        assert_eq!(tids, [2], "out and blocked (4 is preempted, 1 is in)");
        assert_eq!(tracked(&p), [1, 2, 4], "1 had records since the last pass");
        p.due_captures(LATER, &mut tids);
        assert!(tids.is_empty(), "2 was tried in this interval already");
        assert_eq!(tracked(&p), [2, 4], "1 is in and idle since the last pass: forgotten");
        // It comes back with its next switch-out.
        p.events.clear();
        p.events.extend([(30_000, 1, 1), (30_010, 1, 0)]);
        p.pair(u64::MAX);
        assert_eq!(p.done.last().map(|i| (i.tid, i.start_ns, i.end_ns)), Some((1, 30_000, 30_010)));
    }

    /// The tids of the threads the pairing holds, parked or not.
    fn tracked(p: &Pairing) -> Vec<u32> {
        let mut v: Vec<u32> = p.threads.keys().chain(p.parked.keys().copied()).collect();
        v.sort_unstable();
        v
    }

    /// A thread out for long without a record, once tried, is parked apart
    /// from the switching ones (whose table shrinks back): its wake-up still
    /// closes its wait exactly, a split and the end still write it, and a
    /// capture listed at the pass that parked it is still attached.
    #[test]
    fn idle_threads_are_parked_and_their_waits_stay_exact() {
        let mut p = Pairing::default();
        let mut tids = Vec::new();
        // 1,000 idle threads out at 1 ms; thread 1 switching.
        p.events.extend((0..1000u32).map(|i| (MS, 100 + i, 1)));
        p.events.extend([(2 * MS, 1, 1), (2 * MS + 10, 1, 0)]);
        p.pair(u64::MAX);
        let big = p.threads.capacity();
        p.due_captures(LONG_WAIT_NS + 2 * MS, &mut tids);
        assert_eq!(tids.len(), 1000, "every idle thread listed once");
        assert!(p.parked.is_empty(), "not quiet for {PARK_NS} ns yet");
        let at = PARK_NS + 2 * MS;
        p.events.clear();
        p.events.extend([(at - 20, 1, 1), (at - 10, 1, 0)]);
        p.pair(at);
        p.due_captures(at, &mut tids);
        assert!(tids.is_empty());
        assert_eq!(p.parked.len(), 1000, "tried and quiet: parked");
        assert_eq!(p.threads.keys().collect::<Vec<_>>(), [1], "the switching one stays");
        assert!(p.threads.capacity() * 8 <= big, "{} of {big}", p.threads.capacity());
        // A capture listed at that pass still finds its thread.
        p.attach(100, cap_to(at + 1, at + 2));
        // A split writes parked waits too.
        p.done.clear();
        p.split_open(at + 10);
        assert_eq!(p.done.len(), 1000);
        assert!(p.done.iter().all(|i| i.start_ns == MS && i.end_ns == at + 10));
        p.done.clear();
        // Thread 100 wakes: its wait is exact (from the split) and carries
        // the capture; it switches again from the hot table.
        p.events.clear();
        p.events.extend([(at + 50, 100, 0), (at + 60, 100, 1)]);
        p.pair(u64::MAX);
        assert_eq!(p.done.len(), 1);
        assert_eq!((p.done[0].tid, p.done[0].start_ns, p.done[0].end_ns), (100, at + 10, at + 50));
        assert_eq!(p.done[0].capture.as_ref().map(|c| c.at_ns), Some(at + 1));
        assert!(p.threads.contains_key(100) && !p.parked.contains_key(&100));
        // An exit forgets a parked thread.
        p.events.clear();
        p.events.push((at + 70, 101, 3));
        p.pair(u64::MAX);
        assert!(!p.parked.contains_key(&101));
        // The end closes every wait still open, parked or not.
        p.done.clear();
        p.finish(at + 100, &|_| true);
        assert_eq!(p.done.len(), 999, "100's second wait and 998 still parked");
        assert!(p.parked.is_empty());
    }

    /// Fork and exit records tell that the threads changed (the writer then
    /// lists them for a per-thread engine); switches alone do not. A fork
    /// adds no thread entry (its first switch does).
    #[test]
    fn fork_and_exit_records_tell_of_changed_threads() {
        let mut p = Pairing::default();
        p.events.extend([(10, 1, 1), (15, 1, 0)]);
        p.pair(u64::MAX);
        assert!(!std::mem::take(&mut p.threads_changed), "switches alone");
        p.events.clear();
        p.events.extend([(20, 9, 4)]);
        p.pair(u64::MAX);
        assert!(std::mem::take(&mut p.threads_changed), "a fork");
        assert!(!p.threads.contains_key(9));
        p.events.clear();
        p.events.extend([(30, 1, 1), (35, 1, 0), (40, 1, 3)]);
        p.pair(u64::MAX);
        assert!(std::mem::take(&mut p.threads_changed), "an exit");
        assert_eq!(p.done.len(), 2);
    }

    /// A capture belongs to the interval it was taken in; one taken after a
    /// wake-up the pairing had not seen moves to the next interval if that
    /// one contains it, else it is dropped.
    #[test]
    fn captures_go_to_the_interval_they_were_taken_in() {
        let mut p = Pairing::default();
        let mut tids = Vec::new();
        p.events.extend([(100, 1, 1), (100, 2, 1)]);
        p.pair(u64::MAX);
        p.due_captures(LATER, &mut tids);
        assert_eq!(tids, [1, 2]);
        p.attach(1, cap(150));
        p.attach(2, cap(250));
        p.attach(9, cap(150)); // not out: ignored
        p.events.clear();
        // 1 woke after its capture; 2 woke at 200, before its capture, and
        // blocked again at 240 (the capture at 250 is of that blocking).
        p.events.extend([(200, 1, 0), (200, 2, 0), (240, 2, 1), (300, 2, 0)]);
        p.pair(u64::MAX);
        assert_eq!(
            done(&mut p),
            [(1, 100, 200, false, Some(150)), (2, 100, 200, false, None), (2, 240, 300, false, Some(250))]
        );
        // A capture taken after a wake-up and before the next switch-out: dropped.
        p.events.clear();
        p.events.push((400, 3, 1));
        p.pair(u64::MAX);
        p.attach(3, cap(450));
        p.events.clear();
        p.events.extend([(420, 3, 0), (500, 3, 1)]);
        p.pair(u64::MAX);
        p.finish(600, &|_| true);
        assert_eq!(done(&mut p), [(3, 400, 420, false, None), (3, 500, 600, false, None)]);
        assert!(p.orphans.is_empty() && p.threads.iter().all(|(_, s)| s.out.is_none()));
    }

    /// A switch-out paired after newer records of its thread (from another
    /// CPU's ring, late) leaves an old time as the thread's state: that is
    /// no long wait while the thread had records within [`LONG_WAIT_NS`].
    #[test]
    fn a_late_old_switch_out_is_no_long_wait() {
        let mut p = Pairing::default();
        let mut tids = Vec::new();
        let ms = 1_000_000;
        // Thread 1 woke at 2 ms and blocked again at 3 ms (one CPU's ring);
        // its switch-out at 1 ms comes late (the other CPU's).
        p.events.extend([(2 * ms, 1, 0), (3 * ms, 1, 1)]);
        p.pair(u64::MAX);
        p.events.clear();
        p.events.push((ms, 1, 1));
        p.pair(u64::MAX);
        p.due_captures(6 * ms + ms / 2, &mut tids);
        assert!(tids.is_empty(), "out since 1 ms by the state, but named at 3 ms: {tids:?}");
        p.due_captures(8 * ms + 1, &mut tids);
        assert_eq!(tids, [1], "no record for 5 ms: a long wait");
    }

    /// A capture during which its thread was switched in is dropped (its
    /// copy may mix two stacks), whichever interval it would go to.
    #[test]
    fn a_capture_the_thread_ran_during_is_dropped() {
        let mut p = Pairing::default();
        let mut tids = Vec::new();
        p.events.extend([(100, 1, 1), (100, 2, 1), (100, 3, 1)]);
        p.pair(u64::MAX);
        p.due_captures(LATER, &mut tids);
        assert_eq!(tids, [1, 2, 3]);
        // 1: copied from 150 to 250, switched in at 200. 2: the same,
        // switched in at 260, after the copy. 3: taken from 150 to 250 after
        // a wake-up at 120 and a new switch-out at 140, switched in at 200.
        p.attach(1, cap_to(150, 250));
        p.attach(2, cap_to(150, 250));
        p.attach(3, cap_to(150, 250));
        p.events.clear();
        p.events.extend([(200, 1, 0), (260, 2, 0), (120, 3, 0), (140, 3, 1), (200, 3, 0)]);
        p.pair(u64::MAX);
        assert_eq!(
            done(&mut p),
            [
                (3, 100, 120, false, None),
                (1, 100, 200, false, None),
                (3, 140, 200, false, None),
                (2, 100, 260, false, Some(150))
            ]
        );
        assert_eq!(p.dropped, 2);
    }
}

#[cfg(test)]
mod bench_pairing {
    use super::*;

    /// Bench (ignored; BENCHMARKS.md "Off-CPU mode"): pairing 100 threads' switches on 2 CPUs, drains of 5,000 records,
    /// with 1,000 idle threads out since before.
    #[test]
    #[ignore]
    fn bench_pairing() {
        let ms = 1_000_000u64;
        let base = 1_764_000_000_000_000_000u64;
        let drains: Vec<Vec<(u64, u32, u8)>> = (0..400u64)
            .map(|d| {
                let mut v = Vec::with_capacity(5000);
                for c in 0..2u64 {
                    for k in 0..1250u64 {
                        let tid = 1000 + (c + 2 * (k % 50)) as u32;
                        let t = base + d * 25 * ms + k * 20_000 + c * 7_000;
                        v.push((t, tid, 1));
                        v.push((t + 10_000, tid, 0));
                    }
                }
                v
            })
            .collect();
        for (round, sum_below_ns) in
            [0, SUM_BELOW_NS, 0, SUM_BELOW_NS, 0, SUM_BELOW_NS].into_iter().enumerate()
        {
            let mut p = Pairing { sum_below_ns, ..Pairing::default() };
            // The goal's pool of 1,000 idle threads, out since before.
            p.events.extend((0..1000u32).map(|t| (base - ms, 5000 + t * 7, 1)));
            p.pair(base - ms / 2);
            let mut tids = Vec::new();
            let start = std::time::Instant::now();
            for (d, drain) in drains.iter().enumerate() {
                p.events.clear();
                p.events.append(&mut p.carry);
                p.events.extend_from_slice(drain);
                p.pair(base + (d as u64 + 1) * 25 * ms - ms / 10);
                if d % 4 == 3 {
                    // A writer tick: the sums become intervals, captures are listed.
                    p.flush_sums();
                    p.due_captures(base + (d as u64 + 1) * 25 * ms, &mut tids);
                }
                p.done.clear();
            }
            let n = p.waits;
            let el = start.elapsed();
            let what = if round % 2 == 0 { "one by one" } else { "summed" };
            eprintln!("BENCH pairing ({what}): {n} waits, {:.1} ns each", el.as_nanos() as f64 / n as f64);
        }
    }
}
