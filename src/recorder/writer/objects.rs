//! The writer's tracking of the loaded objects: each tick's check of the
//! loader's counters, the rescan when they moved, the module records of a new
//! generation and the retirement of the old ones, and the unwinder snapshot
//! published after them (steps 2 and 4 of a tick, `mod.rs`).
//!
//! # No sample attributed to the wrong library
//! The handler unwinds with the snapshot it finds and stamps the sample with that
//! snapshot's generation, but the loader may have changed the address space since
//! (a library closed and another mapped at the same address) before this thread
//! noticed. So every tick records *when* the loader state was last known to equal
//! the current generation: `verified[g]` is the time taken just before reading the
//! loader's counters and finding them unchanged (the counters move before a new
//! object's code can run). A sample `(g, t)`:
//! * with `t <= verified[g]` ran while generation `g` was exactly the address
//!   space: resolved against that generation (and cached);
//! * with `t` after the current tick's check: held back to the next tick, when the
//!   check will have covered it (at stop, the final check covers everything);
//! * otherwise it is in doubt, and each frame is checked on its own: a module of
//!   generation `g` counts only if it was still mapped at `t` (never removed, or
//!   `t <= verified[removed - 1]`); a module that appeared later counts only if
//!   every transition since `g` was exact (the loader's add/remove counters moved
//!   by exactly the objects the rescan found, so no object came and went unseen)
//!   and it was still mapped at `t`. A frame that fails is written as an absolute
//!   address: unattributed, never misattributed.
//!
//! "Never removed" only holds if every removal was seen. When the counters moved
//! by more than the rescan explains (an object came and went between two ticks,
//! or was closed and reopened at the same address, which looks like no change),
//! the time between the last check that found the counters unchanged and this
//! check is an *unseen window*. For a sample taken inside it, whatever its
//! generation, only a module mapped on both sides of the window is certain, and
//! only if the loader removed at most one object more than the rescan found
//! (`timeline::Unseen::stable`: a library opened and closed between two ticks
//! leaves the program's other modules certain); other frames are written as
//! absolute addresses.

use std::collections::{HashMap, HashSet};

use super::{Out, Run};
use crate::recorder::modules::{self, LoadedObject, ModuleEntry, ModuleTable};
use crate::recorder::sys;
use crate::{Error, NewModule};

/// A module change found by a rescan, applied around the drain.
pub(super) struct Change {
    gen: u64,
    removed: Vec<usize>,
    removed_starts: Vec<u64>,
    added: Vec<LoadedObject>,
    /// Indexes into `added` of objects that reuse a still-active span.
    deferred: Vec<usize>,
}

fn overlaps(a: &modules::ExecSegment, b: &modules::ExecSegment) -> bool {
    a.avma < b.avma + b.size && b.avma < a.avma + a.size
}

/// Define module records for a scan's objects (generation `gen`) and add them
/// to the table.
pub(crate) fn define_objects(
    out: &mut Out,
    table: &mut ModuleTable,
    pid: u32,
    objects: &[&LoadedObject],
    gen: u64,
) -> Result<(), Error> {
    for o in objects {
        for seg in &o.segments {
            let id = out.define_module(&NewModule {
                pid,
                start: seg.avma,
                size: seg.size,
                file_offset: seg.file_offset,
                generation: gen,
                path: &o.key.path,
                build_id: &o.build_id,
            })?;
            table.push(ModuleEntry {
                id,
                key: o.key.clone(),
                build_id: o.build_id.clone(),
                seg: seg.clone(),
                gen_added: gen,
                gen_removed: None,
                retired: false,
            });
        }
    }
    Ok(())
}

impl Run {
    pub(super) fn retire(&mut self, idx: usize) {
        if self.st.table.entries[idx].retired {
            return;
        }
        let id = self.st.table.entries[idx].id;
        if self.error.is_none() {
            let r = self.st.out.deactivate_module(id);
            self.note(r);
        }
        self.st.table.retire(idx);
        self.interner.forget_module(id);
    }

    /// Define an object's modules, first retiring any still-active module whose
    /// span it reuses (those belong to objects already gone).
    pub(super) fn define_object(&mut self, o: &LoadedObject, gen: u64) {
        let stale: Vec<usize> = (0..self.st.table.entries.len())
            .filter(|&i| {
                let e = &self.st.table.entries[i];
                !e.retired && o.segments.iter().any(|s| overlaps(s, &e.seg))
            })
            .collect();
        for i in stale {
            self.retire(i);
        }
        if self.error.is_none() {
            let pid = self.st.pid;
            let r = define_objects(&mut self.st.out, &mut self.st.table, pid, &[o], gen);
            self.note(r);
        }
    }

    /// Phase 1 of a module change (before the drain): if the loader's counters
    /// moved, rescan; mark vanished objects removed as of the next generation and
    /// write the module records of new objects that reuse no active span at once,
    /// so samples already in the ring that ran in them can be resolved.
    pub(super) fn scan_modules(&mut self) -> Option<Change> {
        // Taken before the counters are read: if they did not move, the address
        // space at this time was exactly the current generation's.
        let checked_at = sys::now_us();
        self.horizon = checked_at;
        let dl = modules::dl_counters();
        let g = self.st.generation as usize;
        if dl == self.st.dl {
            self.timeline.verified[g] = self.timeline.verified[g].max(checked_at);
            return None;
        }
        let prev_dl = self.st.dl;
        self.st.dl = dl;
        let known: HashSet<modules::ObjectKey> =
            self.st.table.entries.iter().filter(|e| e.gen_removed.is_none()).map(|e| e.key.clone()).collect();
        // Objects already in the table are listed without copying their data again.
        let objects = modules::scan(&self.st.exe_path, &|k| known.contains(k), false);
        let gen = self.st.generation + 1;
        let present: HashSet<&modules::ObjectKey> = objects.iter().map(|o| &o.key).collect();
        let removed: Vec<usize> = (0..self.st.table.entries.len())
            .filter(|&i| {
                let e = &self.st.table.entries[i];
                e.gen_removed.is_none() && !present.contains(&e.key)
            })
            .collect();
        let added: Vec<LoadedObject> = objects.into_iter().filter(|o| !known.contains(&o.key)).collect();
        self.st.table_memory = added.iter().fold(self.st.table_memory, |m, o| m.add(o.table_memory));
        if removed.is_empty() && added.is_empty() {
            // The counters moved but the objects are the same (say, a library
            // opened and closed between two ticks): the state now is the current
            // generation again, but not continuously since the last check.
            self.unseen_objects = true;
            let stable = dl.1.wrapping_sub(prev_dl.1) <= 1;
            self.timeline.unseen_window(g, g as u64, checked_at, stable);
            return None;
        }
        let removed_objects: HashSet<&modules::ObjectKey> =
            removed.iter().map(|&i| &self.st.table.entries[i].key).collect();
        let explained = dl.0.wrapping_sub(prev_dl.0) == added.len() as u64
            && dl.1.wrapping_sub(prev_dl.1) == removed_objects.len() as u64;
        let exact = !std::mem::take(&mut self.unseen_objects) && explained;
        // (Objects on both sides of the window stayed mapped if at most one
        // removal more than those seen happened: `Unseen::stable`.)
        let stable = dl.1.wrapping_sub(prev_dl.1) <= removed_objects.len() as u64 + 1;
        drop(removed_objects);
        if !explained {
            self.timeline.unseen_window(g, gen, checked_at, stable);
        }
        // The new generation is verified only from the next check on.
        self.timeline.verified.push(0);
        self.timeline.exact.push(exact);
        // The unwinder keys modules by the start of their whole range: the lowest
        // executable segment of the object.
        let mut starts: HashMap<modules::ObjectKey, u64> = HashMap::new();
        for &i in &removed {
            let e = &mut self.st.table.entries[i];
            e.gen_removed = Some(gen);
            let s = starts.entry(e.key.clone()).or_insert(u64::MAX);
            *s = (*s).min(e.seg.avma);
        }
        let mut deferred = Vec::new();
        for (k, o) in added.iter().enumerate() {
            let reuses = self
                .st
                .table
                .entries
                .iter()
                .any(|e| !e.retired && o.segments.iter().any(|s| overlaps(s, &e.seg)));
            if reuses {
                deferred.push(k);
            } else {
                self.define_object(o, gen);
            }
        }
        Some(Change { gen, removed, removed_starts: starts.into_values().collect(), added, deferred })
    }

    /// Phase 2 (after the drain): write the deactivations queued by the previous
    /// tick, retire the modules whose span a new object reuses and define that
    /// object, queue the other removals for the next tick, and publish the new
    /// unwinder snapshot.
    pub(super) fn apply_module_change(&mut self, change: Option<Change>) {
        let pending = std::mem::take(&mut self.pending_retire);
        for idx in pending {
            self.retire(idx);
        }
        let Some(ch) = change else { return };
        // Samples kept for the executable's pending tables, with the
        // snapshot they were taken under, before it is replaced.
        self.release_waiting();
        for &k in &ch.deferred {
            self.define_object(&ch.added[k], ch.gen);
        }
        for &i in &ch.removed {
            if !self.st.table.entries[i].retired {
                self.pending_retire.push(i);
            }
        }
        let added: Vec<&LoadedObject> = ch.added.iter().collect();
        let next = self
            .st
            .shared
            .snapshot
            .with_current(|cur| modules::next_snapshot(cur, &ch.removed_starts, &added, ch.gen));
        self.retired.push(self.st.shared.snapshot.replace(Box::new(next)));
        self.st.generation = ch.gen;
        self.interner.clear_stack_cache();
    }
}
