//! Merging spools into one spool: per-process spools for `spulse record`,
//! several spools (or the segments of a rotating recording) for `info`, `top`
//! and `export` ([`merge_files`]), and the segments `follow` reads one after
//! another.
//!
//! Each recorded process (each exec image) writes its own ordinary spool into
//! the collector's private directory. The collector follows each with a
//! [`spulse::Tail`] and re-emits what it reads into the one output spool
//! through a [`SpoolWriter`], with the ids remapped into one dense stream:
//!
//! * Threads, frames and stack nodes are defined in the output when a sample
//!   first needs them (unused definitions are not copied).
//! * Modules are defined in the output in the order the source defined them,
//!   and retired (tag 8) at the same point of the source's sample sequence
//!   where the source retired them; a module whose range is still held in the
//!   output by a module the source has not yet retired waits until it is.
//! * A frame whose module is not active in the output is written as an
//!   absolute address: unattributed, never misattributed.
//! * When the process ends or replaces itself by `exec`, everything left in its
//!   spool is copied and then a tag-7 record retires all of its modules.
//!
//! Merging whole spools ([`merge_files`]) reads them side by side and writes
//! their samples in time order (each spool's next sample, earliest first).
//! Every id of a source is its own (thread 0 of one file is not thread 0 of
//! another); with [`Shared::merging`] the output defines what several
//! sources define identically only once: a thread with the same pid, tid and
//! name, a module with the same pid, range, offset, path and build id while
//! it is active, and then the same frames and stack nodes. That is what
//! makes the segments of one rotating recording (each of which defines again
//! the modules, frames, stacks and threads it uses) one recording again;
//! spools of different processes share nothing, since every module and
//! thread names its pid.
//!
//! A source is untrusted: its own `Tail` validates every record, a record that
//! claims another process's pid is refused, and the output writer checks every
//! record again against the output's state before a byte is written. A source
//! that fails any of these stops being read (its modules are retired; what it
//! contributed before stays); the output spool is never corrupted by it.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use spulse::{
    Definitions, Frame, FrameId, Header, ModuleId, NewModule, OffCpuInterval, OffCpuState, Sample, Snapshot,
    SpoolWriter, StackId, Tail, ThreadId,
};

/// A module as its definition describes it (pid, start, size, file offset,
/// generation, path, build id).
type ModuleKey = (u32, u64, u64, u64, u64, Vec<u8>, Vec<u8>);

/// Output definitions shared between sources (see the module documentation).
#[derive(Debug, Default)]
pub struct Shared {
    merging: bool,
    /// Active output modules by description, with the number of sources using each.
    modules: HashMap<ModuleKey, (ModuleId, u32)>,
    /// The description of each shared output module, by output id.
    module_keys: HashMap<ModuleId, ModuleKey>,
    threads: HashMap<(u32, u32, String), ThreadId>,
    frames: HashMap<Frame, FrameId>,
    stacks: HashMap<(Option<StackId>, FrameId), StackId>,
}

impl Shared {
    /// Nothing shared: every source's definitions are its own (`spulse record`).
    pub fn separate() -> Shared {
        Shared::default()
    }

    /// Identical definitions of several sources become one output definition.
    pub fn merging() -> Shared {
        Shared { merging: true, ..Shared::default() }
    }
}

/// The state of one source module in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModState {
    /// Not defined yet.
    Pending,
    /// Defined and active.
    Defined(ModuleId),
    /// The source retired it (it may never have been defined in the output).
    Retired,
}

/// What a source is read through: a spool, followed with a [`Tail`] as it
/// grows, or (for [`merge_files`] only) a packed file, a complete recording
/// that never grows, checked whole by [`Snapshot`] and handed out in batches
/// as a `Tail` would.
enum Reader {
    Spool(Tail),
    Packed { snap: Box<Snapshot>, next: usize, batch: Vec<Sample>, off_cpu: (usize, usize) },
}

impl Reader {
    /// A spool, or with `packed` also a packed file (told apart by its magic).
    fn open(path: &Path, packed: bool) -> Result<Reader, spulse::Error> {
        if packed && is_packed(path) {
            let snap = Snapshot::open(path)?;
            return Ok(Reader::Packed { snap: Box::new(snap), next: 0, batch: Vec::new(), off_cpu: (0, 0) });
        }
        Ok(Reader::Spool(Tail::open(path)?))
    }

    fn poll(&mut self) -> Result<&[Sample], spulse::Error> {
        match self {
            Reader::Spool(t) => t.poll(),
            Reader::Packed { snap, next, batch, off_cpu } => {
                let end = snap.len().min(*next + Tail::MAX_BATCH);
                batch.clear();
                batch.extend((*next..end).map(|i| snap.sample(i)));
                *next = end;
                // The off-CPU intervals placed before this batch's samples
                // (and, at the end, after the last one).
                let all = snap.definitions().off_cpu_intervals();
                let hi = if end == snap.len() {
                    all.len()
                } else {
                    all.partition_point(|o| o.samples_before < end as u64)
                };
                *off_cpu = (off_cpu.1, hi.max(off_cpu.1));
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

    fn definitions(&self) -> &Definitions {
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

    fn modules(&self) -> &[spulse::format::Module] {
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
    strict: bool,
    tail: Reader,
    modules: Vec<ModState>,
    next_module: usize,
    frames: Vec<Option<FrameId>>,
    stacks: Vec<Option<StackId>>,
    threads: Vec<Option<ThreadId>>,
    threads_checked: usize,
    deactivations_done: usize,
    python_done: usize,
    /// Off-CPU intervals polled but not yet copied (a poll forgets them).
    off_cpu: std::collections::VecDeque<OffCpuInterval>,
    samples_seen: u64,
    batch: Vec<Sample>,
    /// Samples of `batch` already copied (for [`merge_files`]).
    taken: usize,
    /// Samples copied to the output.
    pub samples: u64,
    /// Samples dropped because the output refused a record they needed.
    pub dropped: u64,
    /// Why this source stopped being read, if it failed.
    pub error: Option<String>,
}

/// Why a source stopped: its own fault (it is abandoned) or the output's (fatal).
pub enum MergeError {
    /// The source is unreadable or hostile; the message says where.
    Source(String),
    /// Writing the output failed.
    Output(spulse::Error),
}

impl Source {
    /// Open the spool of process `pid` at `path` (its header must be complete).
    pub fn open(path: &Path, pid: u32) -> Result<Source, spulse::Error> {
        Self::open_with(path, pid, true, false)
    }

    /// Open any spool at `path` (its header must be complete), whatever
    /// processes it holds.
    pub fn open_any(path: &Path) -> Result<Source, spulse::Error> {
        Self::open_with(path, 0, false, false)
    }

    /// Open a complete recording at `path`: any spool, as
    /// [`open_any`](Self::open_any), or a packed file ([`merge_files`]).
    fn open_complete(path: &Path) -> Result<Source, spulse::Error> {
        Self::open_with(path, 0, false, true)
    }

    fn open_with(path: &Path, pid: u32, strict: bool, packed: bool) -> Result<Source, spulse::Error> {
        Ok(Source {
            path: path.to_path_buf(),
            pid,
            strict,
            tail: Reader::open(path, packed)?,
            modules: Vec::new(),
            next_module: 0,
            frames: Vec::new(),
            stacks: Vec::new(),
            threads: Vec::new(),
            threads_checked: 0,
            deactivations_done: 0,
            python_done: 0,
            off_cpu: Default::default(),
            samples_seen: 0,
            batch: Vec::with_capacity(Tail::MAX_BATCH),
            taken: 0,
            samples: 0,
            dropped: 0,
            error: None,
        })
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
        self.threads_checked = self.tail.definitions().threads().len();
        self.modules.resize(self.tail.modules().len(), ModState::Pending);
        Ok(())
    }

    /// Copy one sample (after the events the source placed before it).
    fn copy_sample(
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

    /// Write the retirements and Python-runtime marks the source placed before
    /// its sample number `upto`, then define the modules that can be defined.
    fn apply_events(
        &mut self,
        upto: u64,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<(), MergeError> {
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
        // Define pending modules in source order; stop at the first that the
        // output refuses (its range is still held by a module the source
        // retires later), so that the order is kept. `next_module` is the
        // first that may still be pending.
        while self.next_module < self.modules.len() {
            let idx = self.next_module;
            if self.modules[idx] != ModState::Pending {
                self.next_module += 1;
                continue;
            }
            let m = &defs.modules()[idx];
            let new = NewModule { pid: if self.strict { self.pid } else { m.pid }, ..NewModule::from(m) };
            let key = sh.merging.then(|| {
                (
                    new.pid,
                    new.start,
                    new.size,
                    new.file_offset,
                    new.generation,
                    m.path.clone(),
                    m.build_id.clone(),
                )
            });
            if let Some((id, users)) = key.as_ref().and_then(|k| sh.modules.get_mut(k)) {
                // Another source defined this very module and it is still active.
                *users += 1;
                self.modules[idx] = ModState::Defined(*id);
                self.next_module += 1;
                continue;
            }
            match out.define_module(&new) {
                Ok(id) => {
                    self.modules[idx] = ModState::Defined(id);
                    self.next_module += 1;
                    if let Some(k) = key {
                        sh.modules.insert(k.clone(), (id, 1));
                        sh.module_keys.insert(id, k);
                    }
                }
                Err(e) if !is_io(&e) => break,
                Err(e) => return Err(MergeError::Output(e)),
            }
        }
        Ok(())
    }

    fn map_sample(
        &mut self,
        s: &Sample,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<(), MergeError> {
        let thread = self.map_thread(s.thread, out, sh)?;
        let stack = self.map_stack(s.stack, out, sh)?;
        out.sample(s.time_us, thread, stack).map_err(MergeError::Output)
    }

    fn map_thread(
        &mut self,
        id: ThreadId,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<ThreadId, MergeError> {
        let idx = id.index();
        if self.threads.len() <= idx {
            self.threads.resize(idx + 1, None);
        }
        if let Some(t) = self.threads[idx] {
            return Ok(t);
        }
        let t = self.tail.definitions().thread(id);
        let pid = if self.strict { self.pid } else { t.pid };
        let key = (pid, t.tid, t.name.clone());
        let new = match sh.threads.get(&key) {
            Some(&shared) => shared,
            None => {
                let new = out.define_thread(pid, t.tid, &t.name).map_err(MergeError::Output)?;
                if sh.merging {
                    sh.threads.insert(key, new);
                }
                new
            }
        };
        self.threads[idx] = Some(new);
        Ok(new)
    }

    fn map_stack(
        &mut self,
        leaf: StackId,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<StackId, MergeError> {
        let defs_len = self.tail.definitions().stack_count();
        if self.stacks.len() < defs_len {
            self.stacks.resize(defs_len, None);
        }
        // Walk towards the root until a node already in the output (or the
        // root), then define the missing nodes root-first.
        let mut missing = Vec::new();
        let mut cur = Some(leaf);
        let mut parent_out = None;
        while let Some(id) = cur {
            if let Some(done) = self.stacks[id.index()] {
                parent_out = Some(done);
                break;
            }
            missing.push(id);
            cur = self.tail.definitions().stack(id).parent;
        }
        for id in missing.into_iter().rev() {
            let frame = self.map_frame(self.tail.definitions().stack(id).frame, out, sh)?;
            let new = match sh.stacks.get(&(parent_out, frame)) {
                Some(&shared) => shared,
                None => {
                    let new = out.define_stack(parent_out, frame).map_err(MergeError::Output)?;
                    if sh.merging {
                        sh.stacks.insert((parent_out, frame), new);
                    }
                    new
                }
            };
            self.stacks[id.index()] = Some(new);
            parent_out = Some(new);
        }
        Ok(parent_out.expect("a stack has at least its leaf node"))
    }

    fn map_frame(
        &mut self,
        id: FrameId,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<FrameId, MergeError> {
        let idx = id.index();
        if self.frames.len() <= idx {
            self.frames.resize(idx + 1, None);
        }
        if let Some(f) = self.frames[idx] {
            return Ok(f);
        }
        let defs = self.tail.definitions();
        let frame = match defs.frame(id) {
            Frame::Module { module, file_relative } => match self.modules.get(module.index()) {
                Some(ModState::Defined(m)) if out.definitions().is_module_active(*m) => {
                    Frame::Module { module: *m, file_relative }
                }
                // The source validated the address against the module, so
                // `absolute` succeeds; 0 only guards the arithmetic.
                _ => Frame::Absolute {
                    address: defs.module(module).absolute(file_relative).unwrap_or(0),
                    kernel: false,
                },
            },
            Frame::Label(label) => {
                // Labels are few: defined again per source, not shared.
                let new = out.define_label(defs.label(label)).map_err(MergeError::Output)?;
                self.frames[idx] = Some(new);
                return Ok(new);
            }
            other => other,
        };
        let new = match sh.frames.get(&frame) {
            Some(&shared) => shared,
            None => {
                let new = out.define_frame(frame).map_err(MergeError::Output)?;
                if sh.merging {
                    sh.frames.insert(frame, new);
                }
                new
            }
        };
        self.frames[idx] = Some(new);
        Ok(new)
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
    fn next_time(&mut self) -> Result<Option<u64>, MergeError> {
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
    fn take(&mut self, out: &mut SpoolWriter<File>, sh: &mut Shared) -> Result<(), MergeError> {
        let s = self.batch[self.taken];
        self.taken += 1;
        self.copy_sample(&s, out, sh)
    }
}

/// An error's message, naming the spool unless it does already.
fn named(e: &spulse::Error, path: &Path) -> String {
    let msg = e.to_string();
    let shown = path.display().to_string();
    if msg.contains(&shown) {
        msg
    } else {
        format!("{shown}: {msg}")
    }
}

/// A source gives up output module `id`: retire it once no source uses it.
fn release_module(id: ModuleId, out: &mut SpoolWriter<File>, sh: &mut Shared) -> Result<(), spulse::Error> {
    if let Some(key) = sh.module_keys.get(&id) {
        if let Some(entry) = sh.modules.get_mut(key) {
            entry.1 -= 1;
            if entry.1 > 0 {
                return Ok(());
            }
            sh.modules.remove(key);
        }
        sh.module_keys.remove(&id);
    }
    if out.definitions().is_module_active(id) {
        out.deactivate_module(id)?;
    }
    Ok(())
}

/// What [`merge_files`] did.
#[derive(Debug)]
pub struct Merged {
    /// Samples copied.
    pub samples: u64,
    /// Samples the output refused (a definition they need broke a rule there).
    pub dropped: u64,
    /// Sources that end inside a record: path and the end of their valid part.
    pub truncated: Vec<(PathBuf, u64)>,
}

/// Merge the complete spools `paths` into `out` (a new spool whose header
/// has the earliest start time and the shortest sampling interval of them),
/// samples in time order, ids kept apart, identical definitions shared (see
/// the module documentation). A spool that is unreadable or corrupt is an
/// error naming it; one that ends inside a record is read up to it (listed in
/// [`Merged::truncated`]).
///
/// Spools are opened in the order of their start times, each once the merge
/// has reached its start (and closed when read), so the segments of a long
/// recording are not all open at once.
pub fn merge_files(paths: &[PathBuf], out: File) -> Result<(SpoolWriter<File>, Merged), MergeError> {
    // Each spool's header, read and closed again.
    let mut order = Vec::with_capacity(paths.len());
    let mut header: Option<Header> = None;
    for (i, p) in paths.iter().enumerate() {
        let h = Source::open_complete(p).map_err(|e| MergeError::Source(named(&e, p)))?.header();
        order.push((h.start_time_us, i));
        header = Some(match header {
            None => h,
            Some(m) => Header {
                start_time_us: m.start_time_us.min(h.start_time_us),
                interval_us: m.interval_us.min(h.interval_us),
            },
        });
    }
    order.sort();
    let mut waiting: std::collections::VecDeque<(u64, usize)> = order.into();
    let header = header.unwrap_or(Header { start_time_us: 0, interval_us: 1 });
    let mut out = SpoolWriter::new(out, header).map_err(MergeError::Output)?;
    let mut sh = Shared::merging();
    let mut merged = Merged { samples: 0, dropped: 0, truncated: Vec::new() };
    let mut sources: Vec<Option<Source>> = paths.iter().map(|_| None).collect();
    // Each open source's next sample, earliest first (ties: the source given first).
    let mut next: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    // Sources read to the end whose modules are not given up yet: that waits
    // until the next sample's source has defined its modules, so a module the
    // next segment of a recording defines again keeps its output id.
    let mut ended: Vec<usize> = Vec::new();
    loop {
        // Open the spools that start no later than the earliest pending sample.
        while let Some(&(start, i)) = waiting.front() {
            if next.peek().is_some_and(|Reverse((t, _))| start > *t) {
                break;
            }
            waiting.pop_front();
            let p = &paths[i];
            let mut s = Source::open_complete(p).map_err(|e| MergeError::Source(named(&e, p)))?;
            match s.next_time()? {
                Some(t) => next.push(Reverse((t, i))),
                None => ended.push(i),
            }
            sources[i] = Some(s);
        }
        let Some(Reverse((_, i))) = next.pop() else { break };
        let s = sources[i].as_mut().expect("an open source");
        let seen = s.samples_seen;
        s.apply_events(seen, &mut out, &mut sh)?;
        for j in ended.drain(..) {
            finish_source(&mut sources[j], &mut out, &mut sh, &mut merged)?;
        }
        let s = sources[i].as_mut().expect("an open source");
        // Defines what had to wait for the ended sources' modules to go.
        s.take(&mut out, &mut sh)?;
        match s.next_time()? {
            Some(t) => next.push(Reverse((t, i))),
            None => ended.push(i),
        }
    }
    for j in ended {
        finish_source(&mut sources[j], &mut out, &mut sh, &mut merged)?;
    }
    out.flush().map_err(MergeError::Output)?;
    Ok((out, merged))
}

/// A source of [`merge_files`] was read to the end: give up its modules, add
/// up what it did, and close it.
fn finish_source(
    slot: &mut Option<Source>,
    out: &mut SpoolWriter<File>,
    sh: &mut Shared,
    merged: &mut Merged,
) -> Result<(), MergeError> {
    let Some(mut s) = slot.take() else { return Ok(()) };
    s.finish_shared(out, sh)?;
    merged.samples += s.samples;
    merged.dropped += s.dropped;
    if let Some(valid) = s.incomplete_tail() {
        merged.truncated.push((s.path.clone(), valid));
    }
    Ok(())
}

/// Whether a writer error is an I/O failure (fatal) rather than a refused record.
fn is_io(e: &spulse::Error) -> bool {
    !matches!(e, spulse::Error::InvalidRecord { .. })
}

#[cfg(test)]
mod tests {
    use super::*;
    use spulse::{Header, Snapshot};
    use std::io::Write;

    const HDR: Header = Header { start_time_us: 1_000_000, interval_us: 1000 };

    fn module<'a>(pid: u32, path: &'a [u8]) -> NewModule<'a> {
        NewModule { pid, start: 0x1000, size: 0x1000, file_offset: 0, generation: 0, path, build_id: b"" }
    }

    fn output(dir: &Path) -> (PathBuf, SpoolWriter<File>) {
        let p = dir.join("out.spool");
        (p.clone(), SpoolWriter::new(File::create(&p).unwrap(), HDR).unwrap())
    }

    /// A library unmapped and another mapped at the same range between two
    /// samples: each sample keeps its own module in the merged spool, the
    /// old one is retired before the new one is defined, and the end retires all.
    #[test]
    fn retirement_and_reuse_of_a_range_keep_their_order() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("7.1.spool");
        let mut w = SpoolWriter::new(File::create(&src).unwrap(), HDR).unwrap();
        let a = w.define_module(&module(7, b"/lib/a.so")).unwrap();
        let th = w.define_thread(7, 7, "main").unwrap();
        let fa = w.define_frame(Frame::Module { module: a, file_relative: 0x10 }).unwrap();
        let sa = w.define_stack(None, fa).unwrap();
        w.sample(1_000_100, th, sa).unwrap();
        w.deactivate_module(a).unwrap();
        let b = w.define_module(&module(7, b"/lib/b.so")).unwrap();
        let fb = w.define_frame(Frame::Module { module: b, file_relative: 0x20 }).unwrap();
        let sb = w.define_stack(None, fb).unwrap();
        w.sample(1_000_200, th, sb).unwrap();
        w.flush().unwrap();
        drop(w);

        let (out_path, mut out) = output(dir.path());
        let mut s = Source::open(&src, 7).unwrap();
        assert!(s.pump(&mut out).is_ok());
        s.retire_all(&mut out).unwrap();
        out.flush().unwrap();
        drop(out);
        assert_eq!((s.samples, s.dropped), (2, 0));
        let snap = Snapshot::open(&out_path).unwrap();
        let d = snap.definitions();
        let paths: Vec<Vec<u8>> = snap
            .samples()
            .map(|x| match d.frame(d.stack(x.stack).frame) {
                Frame::Module { module, .. } => d.module(module).path.clone(),
                other => panic!("unattributed frame {other:?}"),
            })
            .collect();
        assert_eq!(paths, vec![b"/lib/a.so".to_vec(), b"/lib/b.so".to_vec()]);
        assert!(d.modules().iter().all(|m| !d.is_module_active(m.id)));
    }

    /// Samples followed by a bad record: one pump copies the samples and
    /// reports the bad record, so a caller that retires the source right after
    /// (its process ended) never takes a corrupt spool for a complete one.
    #[test]
    fn one_pump_reports_a_bad_record_after_samples() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("7.1.spool");
        let mut w = SpoolWriter::new(File::create(&src).unwrap(), HDR).unwrap();
        let a = w.define_module(&module(7, b"/lib/a.so")).unwrap();
        let th = w.define_thread(7, 7, "main").unwrap();
        let fa = w.define_frame(Frame::Module { module: a, file_relative: 0x10 }).unwrap();
        let sa = w.define_stack(None, fa).unwrap();
        w.sample(1_000_100, th, sa).unwrap();
        w.flush().unwrap();
        drop(w);
        std::fs::OpenOptions::new().append(true).open(&src).unwrap().write_all(&[0xee; 16]).unwrap();
        let (_out_path, mut out) = output(dir.path());
        let mut s = Source::open(&src, 7).unwrap();
        assert!(matches!(s.pump(&mut out), Err(MergeError::Source(_))), "the bad record is reported");
        assert_eq!(s.samples, 1, "the sample before it was copied");
    }

    /// A spool of `pid` with one module, thread and stack, and samples at `times`.
    fn spool(path: &Path, pid: u32, times: &[u64]) {
        let mut w = SpoolWriter::new(File::create(path).unwrap(), HDR).unwrap();
        let m = w.define_module(&module(pid, b"/bin/app")).unwrap();
        let th = w.define_thread(pid, pid, "main").unwrap();
        let f = w.define_frame(Frame::Module { module: m, file_relative: 0x10 }).unwrap();
        let st = w.define_stack(None, f).unwrap();
        for &t in times {
            w.sample(t, th, st).unwrap();
        }
        w.flush().unwrap();
    }

    /// Two segments of one process and a spool of another, interleaved in
    /// time: the merge is in time order, the segments' identical definitions
    /// are defined once, the other process's are its own.
    #[test]
    fn merged_files_are_in_time_order_and_share_identical_definitions() {
        let dir = tempfile::tempdir().unwrap();
        let (s0, s1, other) = (
            dir.path().join("s-000000.spool"),
            dir.path().join("s-000001.spool"),
            dir.path().join("o.spool"),
        );
        spool(&s0, 7, &[1_000_100, 1_000_300, 1_000_500]);
        spool(&s1, 7, &[1_000_700, 1_000_900]);
        spool(&other, 8, &[1_000_200, 1_000_800, 1_001_000]);
        let out_path = dir.path().join("merged.spool");
        let paths = [other.clone(), s1.clone(), s0.clone()];
        let Ok((w, merged)) = merge_files(&paths, File::create(&out_path).unwrap()) else {
            panic!("merge failed")
        };
        drop(w);
        assert_eq!((merged.samples, merged.dropped), (8, 0));
        assert!(merged.truncated.is_empty());
        let snap = Snapshot::open(&out_path).unwrap();
        let d = snap.definitions();
        let times: Vec<u64> = snap.samples().map(|x| x.time_us).collect();
        let mut sorted = times.clone();
        sorted.sort();
        assert_eq!(times, sorted, "time order");
        let pids: Vec<u32> = snap.samples().map(|x| d.thread(x.thread).pid).collect();
        assert_eq!(pids, [7, 8, 7, 7, 7, 8, 7, 8]);
        assert_eq!(d.threads().len(), 2, "one thread per process");
        assert_eq!(d.modules().len(), 2, "one module per process: {:?}", d.modules());
        assert_eq!(d.frames().len(), 2);
        assert_eq!(d.stack_count(), 2);
        assert!(d.modules().iter().all(|m| !d.is_module_active(m.id)), "all retired at the end");
        // A corrupt spool is an error naming it.
        std::fs::write(dir.path().join("bad.spool"), b"not a spool at all").unwrap();
        let paths = [s0, dir.path().join("bad.spool")];
        match merge_files(&paths, File::create(&out_path).unwrap()) {
            Err(MergeError::Source(msg)) => assert!(msg.contains("bad.spool"), "{msg}"),
            _ => panic!("a corrupt spool must be an error"),
        }
    }

    /// A per-process spool whose records claim another pid is refused, and
    /// nothing of it reaches the output.
    #[test]
    fn records_of_another_pid_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("7.1.spool");
        let mut w = SpoolWriter::new(File::create(&src).unwrap(), HDR).unwrap();
        w.define_module(&module(8, b"/lib/a.so")).unwrap();
        w.flush().unwrap();
        drop(w);
        let (out_path, mut out) = output(dir.path());
        let mut s = Source::open(&src, 7).unwrap();
        match s.pump(&mut out) {
            Err(MergeError::Source(msg)) => {
                assert!(msg.contains("pid 8") && msg.contains("process 7"), "{msg}")
            }
            _ => panic!("a foreign pid must be refused"),
        }
        out.flush().unwrap();
        drop(out);
        assert!(Snapshot::open(&out_path).unwrap().definitions().modules().is_empty());
    }
}
