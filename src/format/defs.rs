//! `Definitions`: everything a spool has defined so far, and the rules that tie
//! a record to the records before it.
//!
//! Records are decoded by the record codec ([`super::record`]) and only then
//! checked here: [`Definitions::read_record`] checks what
//! [`record::decode_fields`] returns (for a record cut short, its complete
//! fields) and applies it; runs of sample records go through
//! [`Definitions::apply_samples`], which checks what the codec's sample decoder
//! ([`sample::decode_at`]) returns. The writer runs every record it encodes
//! through `read_record` (samples through [`Definitions::apply_sample`], the
//! same rule) before handing it on, and every reader runs every record through
//! the same code, so the two can never disagree about what a valid spool is.

use std::collections::{BTreeMap, HashMap};

use super::limits::*;
use super::record::{self, sample, DecodeError, Partial, RawFrame, Record, SampleFields};
use super::tag;
use super::types::*;
use crate::FormatErrorKind;

/// `stack_parent` of a root node. Stack ids are below `MAX_IDS` (u32::MAX), so
/// no stack has this id.
const NO_PARENT: u32 = u32::MAX;

/// Definitions retained by every reader: modules, frames, stacks, threads,
/// Python-runtime transitions and module retirements, plus the header.
#[derive(Debug, Clone)]
pub struct Definitions {
    header: Header,
    modules: Vec<Module>,
    module_active: Vec<bool>,
    /// Active modules of each process, by start address.
    active_by_pid: HashMap<u32, BTreeMap<u64, u32>>,
    frames: Vec<Frame>,
    stack_parent: Vec<u32>,
    stack_frame: Vec<u32>,
    stack_depth: Vec<u16>,
    threads: Vec<Thread>,
    python: Vec<PythonRuntimeEvent>,
    python_in: HashMap<u32, bool>,
    deactivations: Vec<Deactivation>,
    labels: Vec<String>,
    off_cpu: Vec<OffCpuInterval>,
    off_cpu_total: u64,
    heap: Vec<HeapEvent>,
    heap_total: u64,
    last_time_us: u64,
    sample_count: u64,
}

type Rule<T> = Result<T, FormatErrorKind>;

/// A rule violation, reported at the record's tag byte.
#[inline]
fn rule(kind: FormatErrorKind) -> DecodeError {
    DecodeError::Bad { at: 0, kind }
}

fn dense(what: &'static str, found: u64, len: usize) -> Rule<()> {
    let expected = len as u64;
    if expected >= MAX_IDS {
        return Err(FormatErrorKind::TooManyDefinitions(what));
    }
    if found != expected {
        return Err(FormatErrorKind::NonDenseId { what, found, expected });
    }
    Ok(())
}

fn reference(what: &'static str, id: u64, len: usize) -> Rule<u32> {
    if id < len as u64 {
        Ok(id as u32)
    } else {
        Err(FormatErrorKind::UndefinedReference { what, id })
    }
}

fn fits_u32(what: &'static str, v: u64) -> Rule<u32> {
    u32::try_from(v).map_err(|_| FormatErrorKind::BadValue(what, v))
}

impl Definitions {
    pub(crate) fn new(header: Header) -> Definitions {
        Definitions {
            header,
            modules: Vec::new(),
            module_active: Vec::new(),
            active_by_pid: HashMap::new(),
            frames: Vec::new(),
            stack_parent: Vec::new(),
            stack_frame: Vec::new(),
            stack_depth: Vec::new(),
            threads: Vec::new(),
            python: Vec::new(),
            python_in: HashMap::new(),
            deactivations: Vec::new(),
            labels: Vec::new(),
            off_cpu: Vec::new(),
            off_cpu_total: 0,
            heap: Vec::new(),
            heap_total: 0,
            last_time_us: header.start_time_us,
            sample_count: 0,
        }
    }

    /// Check a sample record against the definitions and return its absolute
    /// timestamp; on success the running timestamp advances.
    #[inline]
    pub(crate) fn apply_sample(&mut self, delta_us: i64, thread: u64, stack: u64) -> Rule<Sample> {
        let time_us = self.sample_time(delta_us)?;
        let thread = reference("thread", thread, self.threads.len())?;
        let stack = reference("stack", stack, self.stack_frame.len())?;
        self.last_time_us = time_us;
        self.sample_count += 1;
        Ok(Sample { time_us, thread: ThreadId(thread), stack: StackId(stack) })
    }

    /// Apply the run of sample records starting at `buf[*pos]`, calling
    /// `on_sample(sample, offset_in_buf)` for each; it returns `false` to stop
    /// after that sample. Stops without error at the first record that is not a
    /// sample or whose varints are not all complete and canonical (the general
    /// decoder handles it). Returns whether `on_sample` stopped the run; on a
    /// rule violation, the offset of the offending record in `buf` and the kind.
    /// `*pos` always ends on a record boundary after the last applied sample.
    #[inline(always)]
    pub(crate) fn apply_samples(
        &mut self,
        buf: &[u8],
        pos: &mut usize,
        mut on_sample: impl FnMut(Sample, usize) -> bool,
    ) -> Result<bool, (usize, FormatErrorKind)> {
        let threads = self.threads.len() as u64;
        let stacks = self.stack_frame.len() as u64;
        let mut time = self.last_time_us;
        let mut count = 0u64;
        let mut p = *pos;
        let mut result = Ok(false);
        while let Some(&t) = buf.get(p) {
            if t != tag::SAMPLE {
                break;
            }
            let Some((SampleFields { delta_us: delta, thread, stack }, end)) = sample::decode_at(buf, p)
            else {
                break;
            };
            let Some(next) = time.checked_add_signed(delta) else {
                result = Err((p, FormatErrorKind::TimestampOverflow));
                break;
            };
            if thread >= threads {
                result = Err((p, FormatErrorKind::UndefinedReference { what: "thread", id: thread }));
                break;
            }
            if stack >= stacks {
                result = Err((p, FormatErrorKind::UndefinedReference { what: "stack", id: stack }));
                break;
            }
            time = next;
            count += 1;
            let at = p;
            p = end;
            if !on_sample(
                Sample { time_us: time, thread: ThreadId(thread as u32), stack: StackId(stack as u32) },
                at,
            ) {
                result = Ok(true);
                break;
            }
        }
        self.last_time_us = time;
        self.sample_count += count;
        *pos = p;
        result
    }

    /// Decode the record at the start of `buf` ([`record::decode_fields`]),
    /// check what it returns against every rule and, if the record is valid
    /// and complete, apply it. Returns the sample (for a sample record) and the
    /// record's length.
    ///
    /// The rules of a record that did not decode completely still run on its
    /// complete fields, in stream order, before the decoding error is
    /// reported, so the outcome depends only on the bytes up to the first
    /// offending field: `Incomplete` means the bytes present are a prefix of
    /// some valid record (more bytes could complete it), never a prefix that
    /// is already wrong. Syntax errors carry the offset of the field within the
    /// record; rule violations carry offset 0 (the record's tag byte).
    pub(crate) fn read_record(&mut self, buf: &[u8]) -> Result<(Option<Sample>, usize), DecodeError> {
        // Stack definitions, the most frequent records after samples, skip
        // building a `Record` when they decode completely; the same rule and
        // the same update apply.
        if buf.first() == Some(&tag::STACK) {
            if let Some(((id, parent, frame), len)) = record::decode_stack(buf) {
                self.check_stack(id, parent, frame, usize::MAX).map_err(rule)?;
                self.push_stack(parent, frame);
                return Ok((None, len));
            }
        }
        match record::decode_fields(buf) {
            Ok((rec, len)) => {
                self.check(&rec, usize::MAX).map_err(rule)?;
                Ok((self.apply(&rec), len))
            }
            Err(Partial { record, fields, error }) => {
                if let Some(rec) = record {
                    self.check(&rec, fields).map_err(rule)?;
                }
                Err(error)
            }
        }
    }

    /// Check the first `fields` fields of `rec` (all of them for a complete
    /// record) against the rules, in stream order: each rule runs once the
    /// fields it needs are present, so the first violation reported is the
    /// one a field-by-field reader would meet first.
    fn check(&self, rec: &Record<'_>, fields: usize) -> Rule<()> {
        let has = |n: usize| fields >= n;
        match *rec {
            Record::Sample(SampleFields { delta_us, thread, stack }) => {
                if has(1) {
                    self.sample_time(delta_us)?;
                }
                if has(2) {
                    reference("thread", thread, self.threads.len())?;
                }
                if has(3) {
                    reference("stack", stack, self.stack_frame.len())?;
                }
            }
            Record::Module { id, pid, start, size, file_offset, .. } => {
                if has(1) {
                    dense("module", id, self.modules.len())?;
                }
                if has(2) {
                    fits_u32("pid", pid)?;
                }
                if has(4) {
                    if size == 0 {
                        return Err(FormatErrorKind::EmptyModule);
                    }
                    let end = start.checked_add(size).ok_or(FormatErrorKind::AddressOverflow)?;
                    if let Some(active) = self.active_by_pid.get(&(pid as u32)) {
                        // Active modules of one process are disjoint, so only the one
                        // starting last below `end` can overlap [start, end).
                        if let Some((_, &m)) = active.range(..end).next_back() {
                            if self.modules[m as usize].end() > start {
                                return Err(FormatErrorKind::OverlappingModule { active: m as u64 });
                            }
                        }
                    }
                }
                if has(5) {
                    file_offset.checked_add(size).ok_or(FormatErrorKind::AddressOverflow)?;
                }
            }
            Record::Frame { id, frame } => {
                if has(1) {
                    dense("frame", id, self.frames.len())?;
                }
                if let RawFrame::Module { module, file_relative } = frame {
                    if has(3) {
                        let m = reference("module", module, self.modules.len())?;
                        if !self.module_active[m as usize] {
                            return Err(FormatErrorKind::RetiredModule(module));
                        }
                    }
                    if has(4) {
                        let md = &self.modules[module as usize];
                        let outside = FormatErrorKind::OutsideModule { module, address: file_relative };
                        let off = file_relative.checked_sub(md.file_offset).ok_or(outside.clone())?;
                        if off >= md.size {
                            return Err(outside);
                        }
                        // Cannot fail: `start + size` was checked when the module was defined.
                        md.start.checked_add(off).ok_or(FormatErrorKind::AddressOverflow)?;
                    }
                }
            }
            Record::Stack { id, parent, frame } => self.check_stack(id, parent, frame, fields)?,
            Record::Thread { id, pid, tid, .. } => {
                if has(1) {
                    dense("thread", id, self.threads.len())?;
                }
                if has(2) {
                    fits_u32("pid", pid)?;
                }
                if has(3) {
                    fits_u32("tid", tid)?;
                }
            }
            Record::PythonRuntime { pid, entering, .. } => {
                if has(1) {
                    fits_u32("pid", pid)?;
                }
                if has(3) {
                    let inside = self.python_in.get(&(pid as u32)).copied().unwrap_or(false);
                    if inside == entering {
                        return Err(FormatErrorKind::PythonRuntimeState);
                    }
                }
            }
            Record::ProcessModuleDeactivation { pid } => {
                if has(1) {
                    fits_u32("pid", pid)?;
                }
            }
            Record::ModuleDeactivation { module } => {
                if has(1) {
                    let m = reference("module", module, self.modules.len())?;
                    if !self.module_active[m as usize] {
                        return Err(FormatErrorKind::AlreadyRetired(module));
                    }
                }
            }
            Record::OffCpu { thread, stack, start_us, duration_us, .. } => {
                self.check_off_cpu(thread, stack, start_us, duration_us, fields)?;
            }
            Record::Heap { thread, stack, .. } => self.check_heap(thread, stack, fields)?,
        }
        Ok(())
    }

    /// Apply a complete record that passed [`Definitions::check`]; returns the
    /// sample for a sample record. Ids, pids and tids fit in 32 bits and
    /// references are defined: the check made sure of both.
    fn apply(&mut self, rec: &Record<'_>) -> Option<Sample> {
        match *rec {
            Record::Sample(SampleFields { delta_us, thread, stack }) => {
                let time_us = self.last_time_us.wrapping_add_signed(delta_us);
                self.last_time_us = time_us;
                self.sample_count += 1;
                return Some(Sample {
                    time_us,
                    thread: ThreadId(thread as u32),
                    stack: StackId(stack as u32),
                });
            }
            Record::Module { id, pid, start, size, file_offset, generation, path, build_id } => {
                let (id, pid) = (id as u32, pid as u32);
                self.modules.push(Module {
                    id: ModuleId(id),
                    pid,
                    start,
                    size,
                    file_offset,
                    generation,
                    path: path.to_vec(),
                    build_id: build_id.to_vec(),
                });
                self.module_active.push(true);
                self.active_by_pid.entry(pid).or_default().insert(start, id);
            }
            Record::Frame { frame, .. } => {
                self.frames.push(match frame {
                    RawFrame::Module { module, file_relative } => {
                        Frame::Module { module: ModuleId(module as u32), file_relative }
                    }
                    RawFrame::Absolute { address, kernel } => Frame::Absolute { address, kernel },
                    RawFrame::Truncated => Frame::Truncated,
                    RawFrame::Label(label) => {
                        // Valid UTF-8: the decoder checked it.
                        self.labels.push(String::from_utf8_lossy(label).into_owned());
                        Frame::Label(LabelId(self.labels.len() as u32 - 1))
                    }
                });
            }
            Record::Stack { parent, frame, .. } => self.push_stack(parent, frame),
            Record::Thread { id, pid, tid, name } => {
                // Valid UTF-8: the decoder checked it.
                let name = String::from_utf8_lossy(name).into_owned();
                self.threads.push(Thread { id: ThreadId(id as u32), pid: pid as u32, tid: tid as u32, name });
            }
            Record::PythonRuntime { pid, time_us, entering } => {
                let pid = pid as u32;
                self.python_in.insert(pid, entering);
                self.python.push(PythonRuntimeEvent {
                    pid,
                    time_us,
                    entering,
                    samples_before: self.sample_count,
                });
            }
            Record::ProcessModuleDeactivation { pid } => {
                if let Some(active) = self.active_by_pid.remove(&(pid as u32)) {
                    let mut ids: Vec<u32> = active.into_values().collect();
                    ids.sort_unstable();
                    for m in ids {
                        self.module_active[m as usize] = false;
                        self.deactivations
                            .push(Deactivation { module: ModuleId(m), samples_before: self.sample_count });
                    }
                }
            }
            Record::ModuleDeactivation { module } => {
                let m = module as u32;
                self.module_active[m as usize] = false;
                let md = &self.modules[m as usize];
                if let Some(active) = self.active_by_pid.get_mut(&md.pid) {
                    active.remove(&md.start);
                    if active.is_empty() {
                        self.active_by_pid.remove(&md.pid);
                    }
                }
                self.deactivations
                    .push(Deactivation { module: ModuleId(m), samples_before: self.sample_count });
            }
            Record::OffCpu { thread, stack, start_us, duration_us, preempted } => {
                self.off_cpu_total += 1;
                self.off_cpu.push(OffCpuInterval {
                    thread: ThreadId(thread as u32),
                    stack: StackId(stack as u32),
                    start_us,
                    duration_us,
                    state: if preempted { OffCpuState::Preempted } else { OffCpuState::Blocked },
                    samples_before: self.sample_count,
                });
            }
            Record::Heap { thread, stack, time_us, address, size, bytes, freed } => {
                self.heap_total += 1;
                self.heap.push(HeapEvent {
                    thread: ThreadId(thread as u32),
                    stack: StackId(stack as u32),
                    time_us,
                    address,
                    size,
                    bytes,
                    freed,
                    samples_before: self.sample_count,
                });
            }
        }
        None
    }

    /// The rules of a stack record, on its first `fields` fields.
    #[inline]
    fn check_stack(&self, id: u64, parent: Option<u64>, frame: u64, fields: usize) -> Rule<()> {
        if fields >= 1 {
            dense("stack", id, self.stack_frame.len())?;
        }
        if fields >= 2 {
            if let Some(p) = parent {
                reference("stack", p, self.stack_frame.len())?;
            }
        }
        if fields >= 3 {
            let f = reference("frame", frame, self.frames.len())?;
            let depth = match parent {
                None => 1,
                Some(p) => {
                    if self.frames[f as usize] == Frame::Truncated {
                        return Err(FormatErrorKind::MisplacedTruncationMarker);
                    }
                    self.stack_depth[p as usize] as u32 + 1
                }
            };
            if depth > MAX_STACK_DEPTH {
                return Err(FormatErrorKind::StackTooDeep);
            }
        }
        Ok(())
    }

    /// Apply a stack record that passed [`Definitions::check_stack`].
    #[inline]
    fn push_stack(&mut self, parent: Option<u64>, frame: u64) {
        let (p, depth) = match parent {
            None => (NO_PARENT, 1),
            Some(p) => (p as u32, self.stack_depth[p as usize] + 1),
        };
        self.stack_parent.push(p);
        self.stack_frame.push(frame as u32);
        self.stack_depth.push(depth);
    }

    #[inline]
    fn sample_time(&self, delta_us: i64) -> Rule<u64> {
        self.last_time_us.checked_add_signed(delta_us).ok_or(FormatErrorKind::TimestampOverflow)
    }

    /// Account for `count` samples that were checked in bulk (see
    /// `read/parallel.rs`), the last of them at `last_time_us`.
    pub(crate) fn commit_samples(&mut self, count: u64, last_time_us: u64) {
        self.sample_count += count;
        self.last_time_us = last_time_us;
    }

    pub(crate) fn last_time_us(&self) -> u64 {
        self.last_time_us
    }

    /// The stream header.
    pub fn header(&self) -> &Header {
        &self.header
    }
    /// Profile start, unix microseconds.
    pub fn start_time_us(&self) -> u64 {
        self.header.start_time_us
    }
    /// Requested sample interval, microseconds.
    pub fn interval_us(&self) -> u64 {
        self.header.interval_us
    }
    /// Samples seen so far (by a `Snapshot` or `Replay`: all of them).
    pub fn sample_count(&self) -> u64 {
        self.sample_count
    }

    /// Every module, in id order.
    pub fn modules(&self) -> &[Module] {
        &self.modules
    }
    /// One module.
    pub fn module(&self, id: ModuleId) -> &Module {
        &self.modules[id.index()]
    }
    /// Whether a module is still active (not retired) at the end of what was read.
    pub fn is_module_active(&self, id: ModuleId) -> bool {
        self.module_active[id.index()]
    }
    /// The executable process `pid` ran last, if the spool lists its
    /// modules. The recorder lists a process's modules in
    /// `dl_iterate_phdr` order, the main executable first, then the vDSO,
    /// then the libraries; a process that `exec`s records a new image,
    /// listed again in that order after the old one's modules. So the module
    /// just before the pid's last vDSO is its latest executable (the first
    /// module of the pid when no vDSO was listed).
    pub fn executable_of(&self, pid: u32) -> Option<&Module> {
        let is_vdso = |m: &Module| {
            matches!(&m.path[..], b"linux-vdso.so.1" | b"linux-vdso64.so.1" | b"linux-gate.so.1" | b"[vdso]")
        };
        let mut first = None;
        let mut prev: Option<&Module> = None;
        let mut exe = None;
        for m in self.modules.iter().filter(|m| m.pid == pid) {
            first.get_or_insert(m);
            if is_vdso(m) {
                if let Some(p) = prev.filter(|p| !is_vdso(p)) {
                    exe = Some(p);
                }
            }
            prev = Some(m);
        }
        exe.or(first)
    }

    /// Every module retirement, in stream order.
    pub fn deactivations(&self) -> &[Deactivation] {
        &self.deactivations
    }

    /// Every frame, in id order.
    pub fn frames(&self) -> &[Frame] {
        &self.frames
    }
    /// One frame.
    pub fn frame(&self, id: FrameId) -> Frame {
        self.frames[id.index()]
    }
    /// The absolute address of a frame, if it has one (not for the truncation marker).
    pub fn frame_address(&self, id: FrameId) -> Option<u64> {
        match self.frame(id) {
            Frame::Module { module, file_relative } => self.module(module).absolute(file_relative),
            Frame::Absolute { address, .. } => Some(address),
            Frame::Truncated | Frame::Label(_) => None,
        }
    }

    /// The text of a label frame (FORMAT.md, frame kind 3), without brackets:
    /// `blocked: futex`, `waiting for CPU`.
    pub fn label(&self, id: LabelId) -> &str {
        &self.labels[id.index()]
    }

    /// The id of the frame with dense index `index`, if that many are defined.
    pub fn frame_id(&self, index: usize) -> Option<FrameId> {
        (index < self.frames.len()).then_some(FrameId(index as u32))
    }

    /// The id of the stack node with dense index `index`, if that many are defined.
    pub fn stack_id(&self, index: usize) -> Option<StackId> {
        (index < self.stack_frame.len()).then_some(StackId(index as u32))
    }

    /// Number of stack nodes.
    pub fn stack_count(&self) -> usize {
        self.stack_frame.len()
    }
    /// One stack node.
    pub fn stack(&self, id: StackId) -> StackNode {
        let p = self.stack_parent[id.index()];
        StackNode {
            parent: if p == NO_PARENT { None } else { Some(StackId(p)) },
            frame: FrameId(self.stack_frame[id.index()]),
        }
    }
    /// Depth of a stack (1 for a root node).
    pub fn stack_depth(&self, id: StackId) -> usize {
        self.stack_depth[id.index()] as usize
    }
    /// The frames of a stack from leaf to root.
    pub fn stack_frames(&self, id: StackId) -> StackFrames<'_> {
        StackFrames { defs: self, next: Some(id) }
    }

    /// Every thread, in id order.
    pub fn threads(&self) -> &[Thread] {
        &self.threads
    }
    /// One thread.
    pub fn thread(&self, id: ThreadId) -> &Thread {
        &self.threads[id.index()]
    }

    /// Every Python-runtime transition, in stream order.
    pub fn python_runtime_events(&self) -> &[PythonRuntimeEvent] {
        &self.python
    }

    /// The off-CPU intervals (tag 9) read so far, in stream order; empty for
    /// a recording made without off-CPU mode. A [`Tail`](crate::Tail) hands
    /// them out per poll ([`Tail::off_cpu`](crate::Tail::off_cpu)) and keeps
    /// only the current poll's.
    pub fn off_cpu_intervals(&self) -> &[OffCpuInterval] {
        &self.off_cpu
    }

    /// How many off-CPU intervals the stream held so far (a `Tail` included,
    /// which does not keep them all).
    pub fn off_cpu_count(&self) -> u64 {
        self.off_cpu_total
    }

    /// Forget the off-CPU intervals kept so far (`Tail`, at each poll).
    pub(crate) fn clear_off_cpu(&mut self) {
        self.off_cpu.clear();
    }

    /// The rules of an off-CPU record's first `fields` fields (see
    /// [`Definitions::check`]; its state is a flag, checked by the decoder).
    fn check_off_cpu(
        &self,
        thread: u64,
        stack: u64,
        start_us: u64,
        duration_us: u64,
        fields: usize,
    ) -> Rule<()> {
        if fields >= 1 {
            reference("thread", thread, self.threads.len())?;
        }
        if fields >= 2 {
            reference("stack", stack, self.stack_frame.len())?;
        }
        if fields >= 4 {
            start_us.checked_add(duration_us).ok_or(FormatErrorKind::IntervalEndOverflow)?;
        }
        Ok(())
    }

    /// A writer's off-CPU record (its fields): the same rules as a reader's,
    /// counted but not kept (a recorder writes one per blocking, for as long
    /// as it runs).
    pub(crate) fn count_off_cpu(
        &mut self,
        thread: u64,
        stack: u64,
        start_us: u64,
        duration_us: u64,
    ) -> Result<(), FormatErrorKind> {
        self.check_off_cpu(thread, stack, start_us, duration_us, usize::MAX)?;
        self.off_cpu_total += 1;
        Ok(())
    }

    /// The heap events (tag 10) read so far, in stream order; empty for a
    /// recording made without heap events. A [`Tail`](crate::Tail) hands
    /// them out per poll ([`Tail::heap`](crate::Tail::heap)) and keeps only
    /// the current poll's.
    pub fn heap_events(&self) -> &[HeapEvent] {
        &self.heap
    }

    /// How many heap events the stream held so far (a `Tail` included,
    /// which does not keep them all).
    pub fn heap_count(&self) -> u64 {
        self.heap_total
    }

    /// Forget the heap events kept so far (`Tail`, at each poll).
    pub(crate) fn clear_heap(&mut self) {
        self.heap.clear();
    }

    /// The rules of a heap record's first `fields` fields (its state is a
    /// flag, checked by the decoder; the other fields are free).
    fn check_heap(&self, thread: u64, stack: u64, fields: usize) -> Rule<()> {
        if fields >= 1 {
            reference("thread", thread, self.threads.len())?;
        }
        if fields >= 2 {
            reference("stack", stack, self.stack_frame.len())?;
        }
        Ok(())
    }

    /// A writer's heap record (its fields): the same rules as a reader's,
    /// counted but not kept.
    pub(crate) fn count_heap(&mut self, thread: u64, stack: u64) -> Result<(), FormatErrorKind> {
        self.check_heap(thread, stack, usize::MAX)?;
        self.heap_total += 1;
        Ok(())
    }
}

/// Iterator over a stack's frames from leaf to root.
#[derive(Debug, Clone)]
pub struct StackFrames<'a> {
    defs: &'a Definitions,
    next: Option<StackId>,
}

impl Iterator for StackFrames<'_> {
    type Item = FrameId;
    fn next(&mut self) -> Option<FrameId> {
        let id = self.next?;
        let node = self.defs.stack(id);
        self.next = node.parent;
        Some(node.frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The id-space limit cannot be reached by a test file (it takes 2^32 - 1
    /// definitions), so the rule is checked directly.
    #[test]
    fn too_many_definitions() {
        let last = MAX_IDS as usize - 1;
        assert_eq!(dense("frame", last as u64, last), Ok(()));
        assert_eq!(
            dense("frame", MAX_IDS, MAX_IDS as usize),
            Err(FormatErrorKind::TooManyDefinitions("frame"))
        );
        assert_eq!(
            dense("stack", 3, 2),
            Err(FormatErrorKind::NonDenseId { what: "stack", found: 3, expected: 2 })
        );
    }
}
