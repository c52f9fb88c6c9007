//! A map from thread ids to values for the off-CPU pairing
//! (`pairing.rs`), which looks up a thread for each of the hundreds of
//! thousands of switch records a second a switch-heavy program writes.
//!
//! Open addressing with linear probing over two arrays: the keys (4 bytes
//! each, so the few hundred threads that switch fit in a few cache lines
//! and stay cached across a batch) and the values beside them. At most half
//! the slots are used, so a lookup usually reads one key. Removal shifts the following entries back (no
//! tombstones), so a table that churns through short-lived threads stays as
//! fast as a fresh one. Against `std`'s `HashMap` (SwissTable: a control
//! byte group, then a 96-byte entry) the pairing's bench (`bench_pairing`)
//! takes 25 ns a wait instead of 28-29 (BENCHMARKS.md, "Off-CPU mode").

/// A slot no thread holds (thread ids are below `PID_MAX_LIMIT`, 2^22).
const EMPTY: u32 = u32::MAX;

/// The fewest slots a table that holds anything has.
const MIN_SLOTS: usize = 16;

pub(crate) struct TidMap<V> {
    /// Each slot's thread id, or [`EMPTY`]; a power of two of them (or none).
    keys: Vec<u32>,
    /// Each slot's value: `Some` exactly where the key is not [`EMPTY`].
    vals: Vec<Option<V>>,
    len: usize,
    /// Thread ids to remove, for [`TidMap::retain`] (kept for reuse).
    gone: Vec<u32>,
}

impl<V> Default for TidMap<V> {
    fn default() -> Self {
        TidMap { keys: Vec::new(), vals: Vec::new(), len: 0, gone: Vec::new() }
    }
}

impl<V> TidMap<V> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many threads it holds before it grows.
    pub(crate) fn capacity(&self) -> usize {
        self.keys.len() / 2
    }

    /// The slot where a probe for `tid` starts (the table must have slots).
    #[inline(always)]
    fn home(&self, tid: u32) -> usize {
        // Fibonacci hashing: neighbouring thread ids land far apart, so the
        // probes of a pool created in one go do not run into each other.
        let bits = self.keys.len().trailing_zeros();
        ((u64::from(tid).wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> (64 - bits)) as usize
    }

    /// The slot holding `tid`.
    #[inline]
    fn find(&self, tid: u32) -> Option<usize> {
        if self.keys.is_empty() || tid == EMPTY {
            return None;
        }
        let mask = self.keys.len() - 1;
        let mut i = self.home(tid);
        loop {
            match self.keys[i] {
                k if k == tid => return Some(i),
                EMPTY => return None,
                _ => i = (i + 1) & mask,
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn contains_key(&self, tid: u32) -> bool {
        self.find(tid).is_some()
    }

    pub(crate) fn get(&self, tid: u32) -> Option<&V> {
        self.vals[self.find(tid)?].as_ref()
    }

    pub(crate) fn get_mut(&mut self, tid: u32) -> Option<&mut V> {
        let i = self.find(tid)?;
        self.vals[i].as_mut()
    }

    /// `tid`'s value; if it has none, the one `make` gives (then held), or
    /// `None` if `make` gives none (or `tid` is `u32::MAX`, which marks the
    /// empty slots: no thread has it).
    #[inline]
    pub(crate) fn get_or_insert_with(
        &mut self,
        tid: u32,
        make: impl FnOnce() -> Option<V>,
    ) -> Option<&mut V> {
        if tid == EMPTY {
            return None;
        }
        let i = match self.find(tid) {
            Some(i) => i,
            None => self.put_new(tid, make()?),
        };
        self.vals[i].as_mut()
    }

    /// Hold `v` for `tid`; the value it replaces, if any (`tid` `u32::MAX`
    /// is not held: it marks the empty slots).
    pub(crate) fn insert(&mut self, tid: u32, v: V) -> Option<V> {
        if tid == EMPTY {
            return Some(v);
        }
        match self.find(tid) {
            Some(i) => self.vals[i].replace(v),
            None => {
                self.put_new(tid, v);
                None
            }
        }
    }

    /// Put `tid`, which the table does not hold, and `v`; its slot.
    fn put_new(&mut self, tid: u32, v: V) -> usize {
        debug_assert!(tid != EMPTY);
        if (self.len + 1) * 2 > self.keys.len() {
            self.resize((self.keys.len() * 2).max(MIN_SLOTS));
        }
        let mask = self.keys.len() - 1;
        let mut i = self.home(tid);
        while self.keys[i] != EMPTY {
            i = (i + 1) & mask;
        }
        self.keys[i] = tid;
        self.vals[i] = Some(v);
        self.len += 1;
        i
    }

    /// Move every entry to a table of `slots` slots (a power of two that
    /// holds them at most half full).
    fn resize(&mut self, slots: usize) {
        let keys = std::mem::replace(&mut self.keys, vec![EMPTY; slots]);
        let vals = std::mem::replace(&mut self.vals, (0..slots).map(|_| None).collect());
        self.len = 0;
        for (tid, v) in keys.into_iter().zip(vals) {
            if let Some(v) = v {
                self.put_new(tid, v);
            }
        }
    }

    /// Shrink to hold at least `min` threads (and those it holds) without
    /// growing.
    pub(crate) fn shrink_to(&mut self, min: usize) {
        let slots = (min.max(self.len) * 2).next_power_of_two().max(MIN_SLOTS);
        if slots < self.keys.len() {
            self.resize(slots);
        }
    }

    pub(crate) fn remove(&mut self, tid: u32) -> Option<V> {
        let mut hole = self.find(tid)?;
        let v = self.vals[hole].take();
        self.keys[hole] = EMPTY;
        self.len -= 1;
        // Shift back each following entry of the run that its probe would
        // no longer reach past the hole.
        let mask = self.keys.len() - 1;
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let k = self.keys[j];
            if k == EMPTY {
                break;
            }
            // Distances from its home, cyclically: it may fill the hole if
            // the hole is no further from its home than it is.
            let home = self.home(k);
            if (hole.wrapping_sub(home) & mask) < (j.wrapping_sub(home) & mask) {
                self.keys[hole] = k;
                self.vals[hole] = self.vals[j].take();
                self.keys[j] = EMPTY;
                hole = j;
            }
        }
        v
    }

    /// Keep the entries for which `keep` holds.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(u32, &mut V) -> bool) {
        let mut gone = std::mem::take(&mut self.gone);
        gone.clear();
        for (&tid, v) in self.keys.iter().zip(self.vals.iter_mut()) {
            if let Some(v) = v {
                if !keep(tid, v) {
                    gone.push(tid);
                }
            }
        }
        for &tid in &gone {
            self.remove(tid);
        }
        self.gone = gone;
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &V)> {
        self.keys.iter().zip(&self.vals).filter_map(|(&tid, v)| Some((tid, v.as_ref()?)))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (u32, &mut V)> {
        self.keys.iter().zip(&mut self.vals).filter_map(|(&tid, v)| Some((tid, v.as_mut()?)))
    }

    #[cfg(test)]
    pub(crate) fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        self.iter().map(|(tid, _)| tid)
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.vals.iter_mut().filter_map(Option::as_mut)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, removals and retains against `std`'s map, with tids
    /// that collide (a small table, dense and strided ids).
    #[test]
    fn behaves_as_a_hash_map() {
        let mut m = TidMap::default();
        let mut model: HashMap<u32, u64> = HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..200_000u64 {
            let r = next();
            let tid = match r % 3 {
                0 => (r >> 8) as u32 % 64,
                1 => 1000 + ((r >> 8) as u32 % 512) * 1024,
                _ => (r >> 8) as u32 % 4_194_304,
            };
            match (r >> 40) % 10 {
                0..=4 => assert_eq!(m.insert(tid, step), model.insert(tid, step)),
                5..=7 => assert_eq!(m.remove(tid), model.remove(&tid)),
                8 => {
                    let got = m.get_or_insert_with(tid, || (step % 2 == 0).then_some(step)).map(|v| *v);
                    let want = match model.get(&tid) {
                        Some(&v) => Some(v),
                        None if step % 2 == 0 => {
                            model.insert(tid, step);
                            Some(step)
                        }
                        None => None,
                    };
                    assert_eq!(got, want);
                }
                _ if step % 1000 == 9 => {
                    m.retain(|tid, v| !(tid ^ *v as u32).is_multiple_of(3));
                    model.retain(|&tid, v| !(tid ^ *v as u32).is_multiple_of(3));
                    m.shrink_to(0);
                }
                _ => assert_eq!(m.get_mut(tid).map(|v| *v), model.get(&tid).copied()),
            }
            assert_eq!(m.len(), model.len());
            assert!(m.len() <= m.capacity());
        }
        let mut all: Vec<(u32, u64)> = m.iter().map(|(t, v)| (t, *v)).collect();
        all.sort_unstable();
        let mut want: Vec<(u32, u64)> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(all, want);
        for (t, _) in want {
            assert!(m.contains_key(t));
            m.remove(t);
        }
        assert!(m.is_empty() && m.iter().next().is_none());
        // `u32::MAX` marks the empty slots: never held.
        assert_eq!(m.insert(u32::MAX, 7), Some(7));
        assert!(m.get_or_insert_with(u32::MAX, || Some(7)).is_none());
        assert!(m.get_mut(u32::MAX).is_none() && m.is_empty());
    }
}
