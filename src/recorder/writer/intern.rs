//! Interning on the writer thread: frames, prefix-linked stacks and threads are
//! defined once in the spool and referred to by id afterwards, so a repeated
//! stack costs one small sample record.
//!
//! A whole-stack cache keyed by the raw sample (module-table generation,
//! truncation flag and addresses) skips the per-frame work for stacks seen before.
//! Every map holds only ids of definitions already written, so the writer's
//! memory is bounded by the spool's definitions. When a module is retired, every
//! cached entry that could lead to a frame of it is dropped, so no new record ever
//! refers to a retired module through a cache.

use std::io::Write;

use rustc_hash::FxHashMap as FxMap;

use crate::recorder::handler::ThreadNames;
use crate::spread::SHORT_BLOCKED_LABEL;
use crate::{Error, Frame, FrameId, ModuleId, SpoolWriter, StackId, ThreadId};

const NO_PARENT: u32 = u32::MAX;

/// Bound of the whole-stack cache: 1 Mi words (8 MiB) of keys. It is only a
/// shortcut; the frame and stack maps behind it hold one entry per definition.
const WHOLE_CACHE_WORDS: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum FrameKey {
    Module(u32, u64),
    Absolute(u64),
    Truncated,
    /// A label frame, by its id (labels are interned in `labels`).
    Label(u32),
}

/// Slots of the recent-thread cache, direct-mapped by tid: threads of
/// consecutive tids (most of a process's) do not evict each other up to this
/// many. With 32, a hundred threads blocking in turn evicted each other at
/// nearly every lookup, and the hash lookup behind was a fifth of the
/// writer's cost of an off-CPU interval.
const RECENT_THREADS: usize = 1024;

/// The recent-thread cache (12 KiB, boxed: the interner is moved).
struct RecentThreads(Box<[Option<(u32, ThreadId)>; RECENT_THREADS]>);

impl Default for RecentThreads {
    fn default() -> RecentThreads {
        RecentThreads(Box::new([None; RECENT_THREADS]))
    }
}

/// Frames, stacks and threads defined so far.
#[derive(Default)]
pub(crate) struct Interner {
    frames: FxMap<FrameKey, FrameId>,
    /// Module of each frame id (NO_PARENT for none).
    frame_module: Vec<u32>,
    stacks: FxMap<(u32, u32), StackId>,
    threads: FxMap<u32, ThreadId>,
    /// The name each thread of `threads` was defined with, and those of the
    /// segment before ([`Interner::next_segment`]): a thread defined again
    /// in a new segment after it exited (an off-CPU wait paired after the
    /// exit) has no `/proc` entry left to read its name from.
    names: FxMap<u32, Box<str>>,
    earlier_names: FxMap<u32, Box<str>>,
    /// The last thread looked up in each slot (by tid): a lookup a sample
    /// and a blocking.
    recent_threads: RecentThreads,
    /// Label frames (off-CPU leaves) by text.
    labels: FxMap<String, FrameId>,
    /// Raw sample words (generation, flag, addresses) -> leaf stack.
    whole: FxMap<Box<[u64]>, StackId>,
    /// Words held by `whole` (it is cleared when this passes `WHOLE_CACHE_WORDS`).
    whole_words: usize,
    key: Vec<u64>,
    /// The off-CPU leaves written at most blockings, once defined: the
    /// `[blocked]` root and the `waiting for CPU` label (looking a label up
    /// by its text, a hash of the string each interval, was a tenth of the
    /// writer's cost of one).
    blocked_root: Option<StackId>,
    /// The `[blocked, under 5 ms]` root (sums of short waits without a stack).
    short_root: Option<StackId>,
    waiting_label: Option<FrameId>,
}

// The label names the recorder's threshold for sums.
const _: () = assert!(crate::recorder::sys::pairing::SUM_BELOW_NS == 5_000_000, "the label says 5 ms");

impl Interner {
    /// The id of `frame`, defining it if new.
    pub(crate) fn frame<W: Write>(&mut self, w: &mut SpoolWriter<W>, frame: Frame) -> Result<FrameId, Error> {
        let key = match frame {
            Frame::Module { module, file_relative } => FrameKey::Module(module.get(), file_relative),
            Frame::Absolute { address, .. } => FrameKey::Absolute(address),
            Frame::Truncated => FrameKey::Truncated,
            Frame::Label(l) => FrameKey::Label(l.get()),
        };
        if let Some(&id) = self.frames.get(&key) {
            return Ok(id);
        }
        let id = w.define_frame(frame)?;
        self.frames.insert(key, id);
        let m = match frame {
            Frame::Module { module, .. } => module.get(),
            _ => NO_PARENT,
        };
        if self.frame_module.len() <= id.index() {
            self.frame_module.resize(id.index() + 1, NO_PARENT);
        }
        self.frame_module[id.index()] = m;
        Ok(id)
    }

    /// The id of the label frame `text` (an off-CPU leaf), defining it if new.
    pub(crate) fn label<W: Write>(&mut self, w: &mut SpoolWriter<W>, text: &str) -> Result<FrameId, Error> {
        if let Some(&id) = self.labels.get(text) {
            return Ok(id);
        }
        let id = w.define_label(text)?;
        self.labels.insert(text.to_owned(), id);
        if self.frame_module.len() <= id.index() {
            self.frame_module.resize(id.index() + 1, NO_PARENT);
        }
        Ok(id)
    }

    /// The stack `[blocked]` alone (a root), defining it if new.
    pub(crate) fn blocked_root<W: Write>(&mut self, w: &mut SpoolWriter<W>) -> Result<StackId, Error> {
        if let Some(s) = self.blocked_root {
            return Ok(s);
        }
        let f = self.label(w, "blocked")?;
        let s = self.node(w, None, f)?;
        self.blocked_root = Some(s);
        Ok(s)
    }

    /// The stack `[blocked, under 5 ms]` alone (a root: a sum of short
    /// waits without a stack, FORMAT.md), defining it if new.
    pub(crate) fn short_blocked_root<W: Write>(&mut self, w: &mut SpoolWriter<W>) -> Result<StackId, Error> {
        if let Some(s) = self.short_root {
            return Ok(s);
        }
        let f = self.label(w, SHORT_BLOCKED_LABEL)?;
        let s = self.node(w, None, f)?;
        self.short_root = Some(s);
        Ok(s)
    }

    /// The label frame `waiting for CPU`, defining it if new.
    pub(crate) fn waiting_label<W: Write>(&mut self, w: &mut SpoolWriter<W>) -> Result<FrameId, Error> {
        if let Some(f) = self.waiting_label {
            return Ok(f);
        }
        let f = self.label(w, "waiting for CPU")?;
        self.waiting_label = Some(f);
        Ok(f)
    }

    /// The id of the stack node `frame` called from `parent`.
    pub(crate) fn node<W: Write>(
        &mut self,
        w: &mut SpoolWriter<W>,
        parent: Option<StackId>,
        frame: FrameId,
    ) -> Result<StackId, Error> {
        let key = (parent.map_or(NO_PARENT, |p| p.get()), frame.get());
        if let Some(&id) = self.stacks.get(&key) {
            return Ok(id);
        }
        let id = w.define_stack(parent, frame)?;
        self.stacks.insert(key, id);
        Ok(id)
    }

    /// The leaf id of a stack given root first.
    pub(crate) fn stack<W: Write>(
        &mut self,
        w: &mut SpoolWriter<W>,
        root_first: &[Frame],
    ) -> Result<StackId, Error> {
        let mut parent = None;
        for &f in root_first {
            let fid = self.frame(w, f)?;
            parent = Some(self.node(w, parent, fid)?);
        }
        parent.ok_or(Error::Recorder(crate::RecorderError::WriterFailed {
            what: "was given an empty stack to write",
            source: None,
        }))
    }

    /// A cached leaf for a raw sample, if seen before.
    pub(crate) fn cached(
        &mut self,
        generation: u64,
        truncated: bool,
        kernel: bool,
        addrs: &[u64],
    ) -> Option<StackId> {
        self.key.clear();
        self.key.push(generation);
        self.key.push(truncated as u64 | (kernel as u64) << 1);
        self.key.extend_from_slice(addrs);
        self.whole.get(self.key.as_slice()).copied()
    }

    /// Remember the leaf for the raw sample last passed to [`Interner::cached`].
    pub(crate) fn remember(&mut self, leaf: StackId) {
        if self.whole_words + self.key.len() > WHOLE_CACHE_WORDS {
            self.whole.clear();
            self.whole_words = 0;
        }
        self.whole_words += self.key.len();
        self.whole.insert(self.key.clone().into_boxed_slice(), leaf);
    }

    /// Drop the whole-stack cache (its keys name a generation; after a module
    /// change old generations stop arriving).
    pub(crate) fn clear_stack_cache(&mut self) {
        self.whole.clear();
        self.whole_words = 0;
    }

    /// The thread id for `tid`, defining it if new, with the name the handler
    /// took on its first sample (else its current name in `/proc`).
    pub(crate) fn thread<W: Write>(
        &mut self,
        w: &mut SpoolWriter<W>,
        pid: u32,
        tid: u32,
        names: &ThreadNames,
    ) -> Result<ThreadId, Error> {
        let slot = tid as usize % RECENT_THREADS;
        if let Some((t, id)) = self.recent_threads.0[slot] {
            if t == tid {
                return Ok(id);
            }
        }
        if let Some(&id) = self.threads.get(&tid) {
            self.recent_threads.0[slot] = Some((tid, id));
            return Ok(id);
        }
        let name = names.get(tid).unwrap_or_else(|| {
            match std::fs::read_to_string(crate::recorder::sys::procfs::task_path(tid, "comm")) {
                Ok(n) => n.trim_end_matches('\n').to_string(),
                // Gone: the name of the segment before, if it had the thread.
                Err(_) => self.earlier_names.get(&tid).map(|n| n.to_string()).unwrap_or_default(),
            }
        });
        let id = w.define_thread(pid, tid, &name)?;
        self.threads.insert(tid, id);
        self.names.insert(tid, name.into());
        self.recent_threads.0[slot] = Some((tid, id));
        Ok(id)
    }

    /// An empty interner for the next segment (rotation), which keeps the
    /// names of this segment's threads for those that exit before the new
    /// segment defines them, and of the earlier ones those for which
    /// `waiting` holds (an off-CPU wait still open, which may be written
    /// segments later, after its thread exited). Bounded by the threads of
    /// one segment and those waiting.
    pub(crate) fn next_segment(self, waiting: impl Fn(u32) -> bool) -> Interner {
        let mut names = self.names;
        for (tid, name) in self.earlier_names {
            if waiting(tid) {
                names.entry(tid).or_insert(name);
            }
        }
        Interner { earlier_names: names, ..Interner::default() }
    }

    /// Forget every cached path to frames of a retired module.
    pub(crate) fn forget_module(&mut self, m: ModuleId) {
        let fm = &self.frame_module;
        let of = |f: FrameId| fm.get(f.index()).copied().unwrap_or(NO_PARENT);
        self.frames.retain(|_, f| of(*f) != m.get());
        self.stacks.retain(|(_, f), _| fm.get(*f as usize).copied().unwrap_or(NO_PARENT) != m.get());
        self.clear_stack_cache();
    }
}
