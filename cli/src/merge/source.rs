//! One source of a merge: a spool followed as it grows (or a packed file,
//! for [`merge_files`](super::merge_files)), read in batches, its pids
//! checked, and its records copied to the output in the source's order
//! (retirements, Python-runtime marks and off-CPU intervals where the source
//! placed them among its samples). The id remapping is in `remap.rs`.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};

use spulse::{
    Definitions, FrameId, Header, HeapEvent, OffCpuInterval, OffCpuState, Sample, Snapshot, SpoolWriter,
    StackId, Tail, ThreadId,
};

use super::remap::{release_module, IdMap, ModState};
use super::{is_io, named, MergeError, Shared};

/// What a source is read through: a spool, followed with a [`Tail`] as it
/// grows, or (for [`merge_files`](super::merge_files) only) a packed file, a complete recording
/// that never grows, checked whole by [`Snapshot`] and handed out in batches
/// as a `Tail` would.
#[allow(clippy::large_enum_variant)] // one per source, held for the whole merge
pub(super) enum Reader {
    Spool(Tail),
    Packed {
        snap: Box<Snapshot>,
        next: usize,
        batch: Vec<Sample>,
        off_cpu: (usize, usize),
        heap: (usize, usize),
    },
}

impl Reader {
    /// A spool, or with `packed` also a packed file (told apart by its magic).
    fn open(path: &Path, packed: bool) -> Result<Reader, spulse::Error> {
        if packed && is_packed(path) {
            let snap = Snapshot::open(path)?;
            return Ok(Reader::Packed {
                snap: Box::new(snap),
                next: 0,
                batch: Vec::new(),
                off_cpu: (0, 0),
                heap: (0, 0),
            });
        }
        Ok(Reader::Spool(Tail::open(path)?))
    }

    fn poll(&mut self) -> Result<&[Sample], spulse::Error> {
        match self {
            Reader::Spool(t) => t.poll(),
            Reader::Packed { snap, next, batch, off_cpu, heap } => {
                let end = snap.len().min(*next + Tail::MAX_BATCH);
                batch.clear();
                batch.extend((*next..end).map(|i| snap.sample(i)));
                *next = end;
                // The off-CPU intervals and heap events placed before this
                // batch's samples (and, at the end, after the last one).
                let last = end == snap.len();
                let defs = snap.definitions();
                let o = defs.off_cpu_intervals();
                let hi = if last { o.len() } else { o.partition_point(|x| x.samples_before < end as u64) };
                *off_cpu = (off_cpu.1, hi.max(off_cpu.1));
                let h = defs.heap_events();
                let hi = if last { h.len() } else { h.partition_point(|x| x.samples_before < end as u64) };
                *heap = (heap.1, hi.max(heap.1));
                Ok(batch)
            }
        }
    }

    /// The off-CPU intervals the last poll brought.
    fn off_cpu(&self) -> &[OffCpuInterval] {
        match self {
            Reader::Spool(t) => t.off_cpu(),
            Reader::Packed { snap, off_cpu: (lo, hi), .. } => {
                &snap.definitions().off_cpu_intervals()[*lo..*hi]
            }
        }
    }

    /// The heap events the last poll brought.
    fn heap(&self) -> &[HeapEvent] {
        match self {
            Reader::Spool(t) => t.heap(),
            Reader::Packed { snap, heap: (lo, hi), .. } => &snap.definitions().heap_events()[*lo..*hi],
        }
    }

    pub(super) fn definitions(&self) -> &Definitions {
        match self {
            Reader::Spool(t) => t.definitions(),
            Reader::Packed { snap, .. } => snap.definitions(),
        }
    }

    fn has_incomplete_record(&self) -> bool {
        matches!(self, Reader::Spool(t) if t.has_incomplete_record())
    }

    fn position(&self) -> u64 {
        match self {
            Reader::Spool(t) => t.position(),
            Reader::Packed { snap, .. } => snap.valid_len(),
        }
    }

    pub(super) fn modules(&self) -> &[spulse::Module] {
        self.definitions().modules()
    }
}

/// Whether `path` is a regular file that starts with the packed magic
/// (anything else, a FIFO included, which opening could block on, is left
/// to `Tail` to refuse or report).
fn is_packed(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 8];
    std::fs::metadata(path).is_ok_and(|m| m.is_file())
        && File::open(path).and_then(|mut f| f.read_exact(&mut head)).is_ok()
        && spulse::is_packed(&head)
}

/// One spool being merged.
pub struct Source {
    /// Its path.
    pub path: PathBuf,
    /// For a per-process spool of `spulse record`: the process it records
    /// (from its file name; every record must agree). 0 for a spool that may
    /// hold any processes.
    pub pid: u32,
    /// Whether every record must name `pid`.
    pub(super) strict: bool,
    pub(super) tail: Reader,
    pub(super) modules: Vec<ModState>,
    pub(super) next_module: usize,
    pub(super) frames: IdMap<FrameId>,
    pub(super) stacks: IdMap<StackId>,
    pub(super) threads: IdMap<ThreadId>,
    threads_checked: usize,
    deactivations_done: usize,
    python_done: usize,
    /// Off-CPU intervals polled but not yet copied (a poll forgets them).
    off_cpu: VecDeque<OffCpuInterval>,
    /// Heap events polled but not yet copied.
    heap: VecDeque<HeapEvent>,
    pub(super) samples_seen: u64,
    batch: Vec<Sample>,
    /// Samples of `batch` already copied (for [`merge_files`](super::merge_files)).
    taken: usize,
    /// Samples copied to the output.
    pub samples: u64,
    /// Samples dropped because the output refused a record they needed.
    pub dropped: u64,
    /// Why this source stopped being read, if it failed.
    pub error: Option<String>,
}

impl Source {
    /// Open the spool of process `pid` at `path` (its header must be complete).
    pub fn open(path: &Path, pid: u32) -> Result<Source, spulse::Error> {
        Self::open_with(path, pid, true, false)
    }

    /// As [`open`](Self::open), for the spool already open as `file` (at
    /// `path`): the caller opened it without following a link and checked it.
    pub fn open_file(file: std::fs::File, path: &Path, pid: u32) -> Result<Source, spulse::Error> {
        Ok(Self::open_with_reader(path, pid, true, Reader::Spool(Tail::open_file(file, path)?)))
    }

    /// Open any spool at `path` (its header must be complete), whatever
    /// processes it holds.
    pub fn open_any(path: &Path) -> Result<Source, spulse::Error> {
        Self::open_with(path, 0, false, false)
    }

    /// Open a complete recording at `path`: any spool, as
    /// [`open_any`](Self::open_any), or a packed file ([`merge_files`](super::merge_files)).
    pub(super) fn open_complete(path: &Path) -> Result<Source, spulse::Error> {
        Self::open_with(path, 0, false, true)
    }

    fn open_with(path: &Path, pid: u32, strict: bool, packed: bool) -> Result<Source, spulse::Error> {
        Ok(Self::open_with_reader(path, pid, strict, Reader::open(path, packed)?))
    }

    fn open_with_reader(path: &Path, pid: u32, strict: bool, tail: Reader) -> Source {
        Source {
            path: path.to_path_buf(),
            pid,
            strict,
            tail,
            modules: Vec::new(),
            next_module: 0,
            frames: IdMap::default(),
            stacks: IdMap::default(),
            threads: IdMap::default(),
            threads_checked: 0,
            deactivations_done: 0,
            python_done: 0,
            off_cpu: Default::default(),
            heap: Default::default(),
            samples_seen: 0,
            batch: Vec::with_capacity(Tail::MAX_BATCH),
            taken: 0,
            samples: 0,
            dropped: 0,
            error: None,
        }
    }

    /// Copy everything the source gained into `out`. A source error is
    /// returned as [`MergeError::Source`]: the caller abandons the source.
    pub fn pump(&mut self, out: &mut SpoolWriter<File>) -> Result<(), MergeError> {
        self.pump_shared(out, &mut Shared::separate())
    }

    /// [`pump`](Self::pump), with definitions shared as `sh` says.
    pub fn pump_shared(&mut self, out: &mut SpoolWriter<File>, sh: &mut Shared) -> Result<(), MergeError> {
        loop {
            let got = match self.tail.poll() {
                Ok(b) => b,
                Err(e) => return Err(MergeError::Source(e.to_string())),
            };
            // Poll until a batch comes back empty: a batch that stops short
            // may stop just before a bad record, which only the next poll
            // reports, and a caller that retires an ended process after this
            // returns must have seen that error.
            self.batch.clear();
            self.batch.extend_from_slice(got);
            let batch = std::mem::take(&mut self.batch);
            let res = self.copy_batch(&batch, out, sh);
            let empty = batch.is_empty();
            self.batch = batch;
            res?;
            if empty {
                return Ok(());
            }
        }
    }

    fn copy_batch(
        &mut self,
        batch: &[Sample],
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<(), MergeError> {
        self.batch_read()?;
        for s in batch {
            self.copy_sample(s, out, sh)?;
        }
        self.apply_events(self.samples_seen, out, sh)
    }

    /// Check the definitions a poll brought (`check_pids`) and make room for them.
    fn batch_read(&mut self) -> Result<(), MergeError> {
        self.check_pids()?;
        let polled = self.tail.off_cpu();
        self.off_cpu.extend(polled.iter().copied());
        let polled = self.tail.heap();
        self.heap.extend(polled.iter().copied());
        self.threads_checked = self.tail.definitions().threads().len();
        self.modules.resize(self.tail.modules().len(), ModState::Pending);
        Ok(())
    }

    /// Copy one sample (after the events the source placed before it).
    pub(super) fn copy_sample(
        &mut self,
        s: &Sample,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<(), MergeError> {
        self.apply_events(self.samples_seen, out, sh)?;
        self.samples_seen += 1;
        match self.map_sample(s, out, sh) {
            Ok(()) => self.samples += 1,
            Err(MergeError::Output(e)) if !is_io(&e) => self.dropped += 1,
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// Refuse definitions that claim another process.
    fn check_pids(&self) -> Result<(), MergeError> {
        if !self.strict {
            return Ok(());
        }
        let defs = self.tail.definitions();
        let bad = |what: &str, pid: u32| {
            MergeError::Source(format!(
                "{}: a {what} record names pid {pid}, but this spool belongs to process {}",
                self.path.display(),
                self.pid
            ))
        };
        if let Some(m) = defs.modules()[self.modules.len()..].iter().find(|m| m.pid != self.pid) {
            return Err(bad("module", m.pid));
        }
        if let Some(t) = defs.threads()[self.threads_checked..].iter().find(|t| t.pid != self.pid) {
            return Err(bad("thread", t.pid));
        }
        if let Some(p) = defs.python_runtime_events()[self.python_done..].iter().find(|p| p.pid != self.pid) {
            return Err(bad("Python-runtime", p.pid));
        }
        Ok(())
    }

    /// Write the off-CPU intervals, retirements, heap events and
    /// Python-runtime marks the source placed before its sample number
    /// `upto`, in the order the recorder writes a tick's records, then define
    /// the modules that can be defined.
    ///
    /// A tick writes its off-CPU intervals (stacks taken while their modules
    /// were loaded) before its module changes, and its heap events (stacks
    /// resolved against the modules as they are after the changes) after
    /// them: so the intervals go before the retirements, and the heap events
    /// after the retirements and the definitions they allow (a library loaded
    /// over a retired one's range). A frame first mapped while its module is
    /// not active in the output loses its module and becomes an address.
    pub(super) fn apply_events(
        &mut self,
        upto: u64,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<(), MergeError> {
        self.define_pending_modules(out, sh)?;
        while let Some(o) = self.off_cpu.front().copied() {
            if o.samples_before > upto {
                break;
            }
            self.off_cpu.pop_front();
            let res = self.map_thread(o.thread, out, sh).and_then(|thread| {
                let stack = self.map_stack(o.stack, out, sh)?;
                let preempted = o.state == OffCpuState::Preempted;
                out.off_cpu(thread, stack, o.start_us, o.duration_us, preempted).map_err(MergeError::Output)
            });
            match res {
                Ok(()) => {}
                Err(MergeError::Output(e)) if !is_io(&e) => {}
                Err(e) => return Err(e),
            }
        }
        let defs = self.tail.definitions();
        while let Some(d) = defs.deactivations().get(self.deactivations_done) {
            if d.samples_before > upto {
                break;
            }
            self.deactivations_done += 1;
            let idx = d.module.index();
            if let ModState::Defined(id) = self.modules[idx] {
                release_module(id, out, sh).map_err(MergeError::Output)?;
            }
            self.modules[idx] = ModState::Retired;
        }
        self.define_pending_modules(out, sh)?;
        while let Some(h) = self.heap.front().copied() {
            if h.samples_before > upto {
                break;
            }
            self.heap.pop_front();
            let res = self.map_thread(h.thread, out, sh).and_then(|thread| {
                let stack = self.map_stack(h.stack, out, sh)?;
                out.heap_event(thread, stack, h.time_us, h.address, h.size, h.bytes, h.freed)
                    .map_err(MergeError::Output)
            });
            match res {
                Ok(()) => {}
                Err(MergeError::Output(e)) if !is_io(&e) => {}
                Err(e) => return Err(e),
            }
        }
        let defs = self.tail.definitions();
        while let Some(p) = defs.python_runtime_events().get(self.python_done) {
            if p.samples_before > upto {
                break;
            }
            self.python_done += 1;
            match out.python_runtime(p.pid, p.time_us, p.entering) {
                Ok(()) => {}
                Err(e) if !is_io(&e) => {}
                Err(e) => return Err(MergeError::Output(e)),
            }
        }
        self.define_pending_modules(out, sh)
    }

    /// The source is finished (its process ended or exec'd): retire every
    /// module of its pid in the output.
    pub fn retire_all(&mut self, out: &mut SpoolWriter<File>) -> Result<(), spulse::Error> {
        for m in &mut self.modules {
            *m = ModState::Retired;
        }
        out.deactivate_process_modules(self.pid)
    }

    /// This source is finished: copy the events it placed after its last
    /// sample, then give up its modules (each retired in the output once no
    /// other source uses it).
    pub fn finish_shared(&mut self, out: &mut SpoolWriter<File>, sh: &mut Shared) -> Result<(), MergeError> {
        self.apply_events(self.samples_seen, out, sh)?;
        for m in &mut self.modules {
            if let ModState::Defined(id) = *m {
                release_module(id, out, sh).map_err(MergeError::Output)?;
            }
            *m = ModState::Retired;
        }
        Ok(())
    }

    /// Whether the spool ends inside a record (so far), and where its valid
    /// part ends.
    pub fn incomplete_tail(&self) -> Option<u64> {
        self.tail.has_incomplete_record().then(|| self.tail.position())
    }

    /// The source's header.
    pub fn header(&self) -> Header {
        *self.tail.definitions().header()
    }

    /// The time of the next sample to copy, reading more if the batch is used
    /// up (`None`: nothing more to read now).
    pub(super) fn next_time(&mut self) -> Result<Option<u64>, MergeError> {
        if self.taken == self.batch.len() {
            let got = self.tail.poll().map_err(|e| MergeError::Source(named(&e, &self.path)))?;
            self.batch.clear();
            self.batch.extend_from_slice(got);
            self.taken = 0;
            self.batch_read()?;
        }
        Ok(self.batch.get(self.taken).map(|s| s.time_us))
    }

    /// Copy the next sample (the one [`next_time`](Self::next_time) gave).
    pub(super) fn take(&mut self, out: &mut SpoolWriter<File>, sh: &mut Shared) -> Result<(), MergeError> {
        let s = self.batch[self.taken];
        self.taken += 1;
        self.copy_sample(&s, out, sh)
    }
}
