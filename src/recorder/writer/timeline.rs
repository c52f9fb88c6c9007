//! What the writer knows of the loader state over time ([`Timeline`], see
//! "No sample attributed to the wrong library" in the writer's doc), and the
//! samples held back until a later loader check covers them ([`HeldSample`]).

use crate::recorder::handler::ring::RawSample;
use crate::recorder::modules::ModuleEntry;

/// What the writer knows of the loader state over time (see `objects.rs`).
#[derive(Default)]
pub(super) struct Timeline {
    /// Per generation: latest time (unix us) the loader state was known to equal it.
    pub(super) verified: Vec<u64>,
    /// Per generation: whether the change into it was exact (no unseen object).
    pub(super) exact: Vec<bool>,
    /// Times in which some object may have come and gone unseen, in order.
    pub(super) unseen: Vec<Unseen>,
}

/// `(after, until]`: a time in which some object may have come and gone
/// unseen (the loader's counters moved by more than a rescan explains).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Unseen {
    pub(super) after: u64,
    pub(super) until: u64,
    /// The generations current at its start and after its end.
    pub(super) gens: (u64, u64),
    /// Whether the objects mapped on both sides stayed mapped throughout: at
    /// most one removal more than the rescan found. An object seen before and
    /// after could otherwise have made room for another only by being closed
    /// (a removal) and reopened after that other one was closed (a second
    /// removal); with one, either an unseen object came and went, or one of
    /// them was closed and reopened with nothing in its place. So a library
    /// opened and closed between two ticks (`ld` and its LTO plugin; a
    /// plugin probe at start) leaves the program's other modules certain.
    pub(super) stable: bool,
}

impl Timeline {
    /// Record that the loader changed unseen since generation `gen` was last
    /// verified, and before `now`, which begins generation `next` (`gen`
    /// again if the objects are the same); `stable`: see [`Unseen::stable`].
    pub(super) fn unseen_window(&mut self, gen: usize, next: u64, now: u64, stable: bool) {
        let after = self.verified.get(gen).copied().unwrap_or(0);
        match self.unseen.last_mut() {
            // Consecutive windows (no check found the state unchanged in
            // between) merge, so the list grows only with separate episodes.
            // An object on both sides of the merged window was on both sides
            // of each (the check between them listed it), so it is stable
            // in it if it was in each.
            Some(last) if after <= last.until => {
                last.until = last.until.max(now);
                last.gens.1 = last.gens.1.max(next);
                last.stable &= stable;
            }
            _ => self.unseen.push(Unseen { after, until: now, gens: (gen as u64, next), stable }),
        }
    }

    /// Whether `t` lies in an unseen window.
    pub(super) fn in_unseen_window(&self, t: u64) -> bool {
        self.window_at(t).is_some()
    }

    fn window_at(&self, t: u64) -> Option<&Unseen> {
        // Recent windows first: samples are recent.
        self.unseen.iter().rev().find(|w| w.after < t && t <= w.until)
    }

    /// Whether a sample of generation `gen` taken at `t` ran while the address
    /// space was exactly that generation's.
    pub(super) fn exact_state(&self, gen: u64, t: u64) -> bool {
        self.verified.get(gen as usize).is_some_and(|&v| t <= v) && !self.in_unseen_window(t)
    }

    /// Whether module entry `e`, found for a sample of generation `gen` taken at
    /// `t`, was certainly the object mapped there at `t`.
    pub(super) fn certainly_mapped(&self, e: &ModuleEntry, gen: u64, t: u64) -> bool {
        if let Some(w) = self.window_at(t) {
            // Only an object mapped on both sides of a stable window.
            return w.stable && e.gen_added <= w.gens.0 && e.gen_removed.is_none_or(|r| r > w.gens.1);
        }
        if e.gen_added > gen {
            // Appeared after the handler's snapshot: only if no object came and
            // went unseen in between.
            let exact = (gen + 1..=e.gen_added).all(|g| self.exact.get(g as usize).copied().unwrap_or(false));
            if !exact {
                return false;
            }
        }
        match e.gen_removed {
            None => true,
            Some(r) => r >= 1 && self.verified.get(r as usize - 1).is_some_and(|&v| t <= v),
        }
    }
}

/// A sample held back to the next tick (owned copy of a ring slot).
pub(super) struct HeldSample {
    pub(super) time_us: u64,
    pub(super) tid: u32,
    pub(super) weight: u32,
    pub(super) generation: u64,
    pub(super) truncated: bool,
    pub(super) kernel: bool,
    pub(super) addrs: Vec<u64>,
}

impl HeldSample {
    /// An owned copy of `s`.
    pub(super) fn of(s: &RawSample<'_>) -> HeldSample {
        HeldSample {
            time_us: s.time_us,
            tid: s.tid,
            weight: s.weight,
            generation: s.generation,
            truncated: s.truncated,
            kernel: s.kernel,
            addrs: s.addrs.to_vec(),
        }
    }

    pub(super) fn view(&self) -> RawSample<'_> {
        RawSample {
            time_us: self.time_us,
            tid: self.tid,
            weight: self.weight,
            generation: self.generation,
            truncated: self.truncated,
            kernel: self.kernel,
            addrs: &self.addrs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recorder::modules::{ExecSegment, ObjectKey};

    fn module(gen_added: u64, gen_removed: Option<u64>) -> ModuleEntry {
        ModuleEntry {
            id: crate::ModuleId(0),
            key: ObjectKey { bias: 0x40000, path: b"libbeta.so".to_vec(), first_exec: 0x40000 },
            build_id: Vec::new(),
            seg: ExecSegment { avma: 0x40000, size: 0x1000, file_offset: 0x1000 },
            gen_added,
            gen_removed,
            retired: false,
        }
    }

    /// A library closed, another mapped at its address, closed, and the first
    /// reopened there, all between two checks: the rescan sees the same objects,
    /// but samples taken in between ran in the other library, so nothing
    /// resolved for them may be trusted.
    #[test]
    fn an_unseen_close_and_reopen_makes_its_window_uncertain() {
        let mut tl = Timeline { verified: vec![100], exact: vec![true], unseen: Vec::new() };
        let beta = module(0, None);
        assert!(tl.exact_state(0, 100));
        assert!(tl.certainly_mapped(&beta, 0, 150), "no unseen change known yet");
        // The check at 200 finds the counters moved by two removals and the
        // objects the same.
        tl.unseen_window(0, 0, 200, false);
        for t in [101, 150, 200] {
            assert!(!tl.certainly_mapped(&beta, 0, t), "t = {t}");
            assert!(!tl.exact_state(0, t), "t = {t}");
        }
        // Before the window and after it (once verified again) it is certain.
        assert!(tl.exact_state(0, 100) && tl.certainly_mapped(&beta, 0, 90));
        tl.verified[0] = 300;
        assert!(tl.exact_state(0, 250) && tl.certainly_mapped(&beta, 0, 250));
        assert!(!tl.exact_state(0, 150), "a late sample from the window stays uncertain");
        // A second window right after the first merges with it; a later one does not.
        tl.unseen_window(0, 0, 350, false);
        tl.unseen_window(0, 0, 400, false);
        let spans = |tl: &Timeline| tl.unseen.iter().map(|w| (w.after, w.until)).collect::<Vec<_>>();
        assert_eq!(spans(&tl), [(100, 200), (300, 400)]);
        tl.verified[0] = 420;
        tl.unseen_window(0, 0, 450, false);
        assert_eq!(spans(&tl), [(100, 200), (300, 400), (420, 450)]);
        assert!(tl.exact_state(0, 410) && !tl.exact_state(0, 430));
    }

    /// A library opened and closed between two checks (one removal, the
    /// objects the same): a sample taken meanwhile is not exact, but its
    /// frames in the objects mapped on both sides are certain; a frame in an
    /// object removed or added across the window is not, nor is any frame
    /// of a window with two removals more than the rescan saw.
    #[test]
    fn a_library_opened_and_closed_unseen_leaves_the_others_certain() {
        let mut tl = Timeline { verified: vec![100], exact: vec![true], unseen: Vec::new() };
        tl.unseen_window(0, 0, 200, true);
        let beta = module(0, None);
        assert!(!tl.exact_state(0, 150));
        assert!(tl.certainly_mapped(&beta, 0, 150));
        // The next window changes the objects: generation 1 adds one and
        // removes another, with one removal more than that (stable).
        tl.verified[0] = 300;
        tl.verified.push(0);
        tl.exact.push(false);
        tl.unseen_window(0, 1, 400, true);
        assert!(tl.certainly_mapped(&beta, 0, 350), "on both sides");
        assert!(!tl.certainly_mapped(&module(0, Some(1)), 0, 350), "removed in the window");
        assert!(!tl.certainly_mapped(&module(1, None), 0, 350), "added in the window");
        // Merged with an unstable one: nothing in it is certain.
        tl.unseen_window(1, 1, 500, false);
        assert_eq!(tl.unseen.len(), 2);
        assert!(!tl.certainly_mapped(&beta, 0, 350) && !tl.certainly_mapped(&beta, 1, 450));
        assert!(tl.certainly_mapped(&beta, 0, 150), "the first window stays stable");
    }

    #[test]
    fn removal_and_later_generations() {
        let tl = Timeline { verified: vec![100, 200, 0], exact: vec![true, true, false], unseen: Vec::new() };
        // Removed in generation 1: certain up to generation 0's last check.
        assert!(tl.certainly_mapped(&module(0, Some(1)), 0, 100));
        assert!(!tl.certainly_mapped(&module(0, Some(1)), 0, 101));
        // Added later: only across exact transitions.
        assert!(tl.certainly_mapped(&module(1, None), 0, 150));
        assert!(!tl.certainly_mapped(&module(2, None), 0, 150));
    }
}
