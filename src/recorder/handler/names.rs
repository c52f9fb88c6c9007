//! Thread names captured by the handler while the thread is alive.
//!
//! The writer defines a thread (with its name) when it first writes one of its
//! samples, up to a flush interval after the sample was taken; a short-lived
//! thread has exited by then and `/proc/self/task/<tid>/comm` is gone. So the
//! handler takes the name itself on a thread's first sample:
//! `prctl(PR_GET_NAME)` (a system call, async-signal-safe) into a fixed,
//! open-addressed table keyed by tid. A later sample of the thread finds its
//! entry with a few atomic loads and makes no system call. Entries are claimed
//! with one CAS and never freed during a recording; when the table is full, or
//! the probe limit is reached, the writer falls back to `/proc`.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Entries in the table (a power of two).
pub(crate) const NAME_SLOTS: usize = 4096;
/// Entries probed before giving up.
const MAX_PROBES: usize = 32;
/// Set in a key once the name words are written.
const READY: u32 = 1 << 31;

/// tid -> name (15 bytes and a NUL, as the kernel keeps it).
pub(crate) struct ThreadNames {
    keys: Box<[AtomicU32]>,
    words: Box<[[AtomicU64; 2]]>,
    /// Entries claimed so far: it moves when a thread is sampled for the first
    /// time, which tells the writer a new thread exists without listing
    /// `/proc/self/task` on every tick.
    added: AtomicU64,
}

impl Default for ThreadNames {
    fn default() -> Self {
        ThreadNames {
            keys: (0..NAME_SLOTS).map(|_| AtomicU32::new(0)).collect(),
            words: (0..NAME_SLOTS).map(|_| [AtomicU64::new(0), AtomicU64::new(0)]).collect(),
            added: AtomicU64::new(0),
        }
    }
}

#[inline]
fn home(tid: u32) -> usize {
    (tid.wrapping_mul(0x9e37_79b1) >> 20) as usize
}

impl ThreadNames {
    /// How many threads have had their name captured (see `added`).
    pub(crate) fn added(&self) -> u64 {
        self.added.load(Ordering::Relaxed)
    }

    /// In the handler: make sure the calling thread `tid` has an entry, taking
    /// its name if it has none. No allocation, no lock: loads, one CAS, one
    /// `prctl` on the first sample of a thread.
    #[inline]
    pub(crate) fn capture(&self, tid: u32) {
        if tid == 0 || tid & READY != 0 {
            return;
        }
        let mask = NAME_SLOTS - 1;
        let mut i = home(tid) & mask;
        for _ in 0..MAX_PROBES {
            let k = &self.keys[i];
            let cur = k.load(Ordering::Acquire);
            if cur & !READY == tid {
                return;
            }
            if cur == 0 && k.compare_exchange(0, tid, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                let mut buf = [0u8; 16];
                // SAFETY: PR_GET_NAME writes at most 16 bytes (the name and its
                // NUL) into the buffer we pass; it concerns the calling thread,
                // which is `tid`.
                unsafe { libc::prctl(libc::PR_GET_NAME, buf.as_mut_ptr() as libc::c_ulong, 0, 0, 0) };
                let (a, b) = buf.split_at(8);
                let mut w0 = [0u8; 8];
                let mut w1 = [0u8; 8];
                w0.copy_from_slice(a);
                w1.copy_from_slice(b);
                self.words[i][0].store(u64::from_le_bytes(w0), Ordering::Relaxed);
                self.words[i][1].store(u64::from_le_bytes(w1), Ordering::Relaxed);
                k.store(tid | READY, Ordering::Release);
                self.added.fetch_add(1, Ordering::Relaxed);
                return;
            }
            // Another thread won this entry between our load and CAS: look at
            // it again (it may be ours only if `tid` raced itself, which a
            // thread cannot), else move on.
            if k.load(Ordering::Acquire) & !READY == tid {
                return;
            }
            i = (i + 1) & mask;
        }
    }

    /// In the writer: the name taken for `tid`, if the handler took one.
    pub(crate) fn get(&self, tid: u32) -> Option<String> {
        let mask = NAME_SLOTS - 1;
        let mut i = home(tid) & mask;
        for _ in 0..MAX_PROBES {
            let cur = self.keys[i].load(Ordering::Acquire);
            if cur == 0 {
                return None;
            }
            if cur == tid | READY {
                let mut buf = [0u8; 16];
                buf[..8].copy_from_slice(&self.words[i][0].load(Ordering::Relaxed).to_le_bytes());
                buf[8..].copy_from_slice(&self.words[i][1].load(Ordering::Relaxed).to_le_bytes());
                let end = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
                return Some(String::from_utf8_lossy(&buf[..end]).into_owned());
            }
            i = (i + 1) & mask;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_the_calling_threads_name_once() {
        let t = ThreadNames::default();
        let h = std::thread::Builder::new()
            .name("named-probe".into())
            .spawn(move || {
                let tid = crate::recorder::sys::gettid();
                t.capture(tid);
                t.capture(tid);
                (t, tid)
            })
            .unwrap();
        let (t, tid) = h.join().unwrap();
        assert_eq!(t.get(tid).as_deref(), Some("named-probe"));
        assert_eq!(t.get(tid.wrapping_add(1)), None);
        let used = t.keys.iter().filter(|k| k.load(Ordering::Relaxed) != 0).count();
        assert_eq!(used, 1, "a second sample of the thread must not take another entry");
    }

    #[test]
    fn colliding_tids_get_their_own_entries() {
        let t = ThreadNames::default();
        // Two tids whose probes start at the same entry.
        let a = 1000u32;
        let b = (1001u32..).find(|&x| home(x) & (NAME_SLOTS - 1) == home(a) & (NAME_SLOTS - 1)).unwrap();
        t.capture(a);
        t.capture(b);
        // Both are found (each with the calling thread's name: prctl names the
        // caller), in two entries.
        assert!(t.get(a).is_some() && t.get(b).is_some());
        let used = t.keys.iter().filter(|k| k.load(Ordering::Relaxed) != 0).count();
        assert_eq!(used, 2);
    }
}
