//! The writer's generation-aware module table: which spool module an address
//! sampled with a given generation belongs to.

use super::*;

/// One spool module as the writer tracks it.
#[derive(Debug, Clone)]
pub(crate) struct ModuleEntry {
    pub id: crate::ModuleId,
    pub key: ObjectKey,
    /// The object's GNU build id (defined again in each new segment).
    pub build_id: Vec<u8>,
    pub seg: ExecSegment,
    pub gen_added: u64,
    /// Generation in which the object disappeared.
    pub gen_removed: Option<u64>,
    /// Whether the spool already holds its deactivation record.
    pub retired: bool,
}

/// The writer's generation-aware module table.
#[derive(Default)]
pub(crate) struct ModuleTable {
    pub entries: Vec<ModuleEntry>,
    /// Every entry (retired ones too), sorted by start, rebuilt per change.
    by_start: Vec<usize>,
}

impl ModuleTable {
    /// Resolve an address sampled under generation `gen`: the module mapped there
    /// at that generation, or `None` if it is retired already (the caller then
    /// writes an absolute frame). If no module of that generation covers the
    /// address, the sample ran in code loaded after the handler's snapshot was
    /// published: the first later generation's module there is the one.
    pub(crate) fn resolve(&self, addr: u64, gen: u64) -> Option<&ModuleEntry> {
        let i = self.by_start.partition_point(|&e| self.entries[e].seg.avma <= addr);
        let mut later: Option<&ModuleEntry> = None;
        for e in self.by_start[..i].iter().rev().map(|&e| &self.entries[e]) {
            if addr >= e.seg.avma + e.seg.size {
                continue;
            }
            if e.gen_added <= gen && e.gen_removed.is_none_or(|r| gen < r) {
                return (!e.retired).then_some(e);
            }
            if e.gen_added > gen && !e.retired && later.is_none_or(|l| e.gen_added < l.gen_added) {
                later = Some(e);
            }
        }
        later
    }

    /// Add an entry (already written to the spool).
    pub(crate) fn push(&mut self, e: ModuleEntry) {
        self.entries.push(e);
        self.reindex();
    }

    fn reindex(&mut self) {
        let mut v: Vec<usize> = (0..self.entries.len()).collect();
        v.sort_by_key(|&i| self.entries[i].seg.avma);
        self.by_start = v;
    }

    /// Mark an entry retired (its deactivation record was written).
    pub(crate) fn retire(&mut self, idx: usize) {
        self.entries[idx].retired = true;
        self.reindex();
    }
}
