//! `Definitions`: everything a spool has defined so far, and the rules that tie
//! a record to the records before it.
//!
//! The writer runs every record through [`Definitions::apply`] before encoding it
//! and every reader runs every decoded record through it, so the two can never
//! disagree about what a valid spool is.

use std::collections::HashMap;

use super::limits::*;
use super::record::{RawFrame, Record};
use super::types::*;
use crate::FormatErrorKind;

const NO_PARENT: u32 = u32::MAX;

/// Definitions retained by every reader: modules, frames, stacks, threads,
/// Python-runtime transitions and module retirements, plus the header.
#[derive(Debug, Clone)]
pub struct Definitions {
    header: Header,
    modules: Vec<Module>,
    module_active: Vec<bool>,
    active_by_pid: HashMap<u32, Vec<u32>>,
    frames: Vec<Frame>,
    stack_parent: Vec<u32>,
    stack_frame: Vec<u32>,
    stack_depth: Vec<u16>,
    threads: Vec<Thread>,
    python: Vec<PythonRuntimeEvent>,
    python_in: HashMap<u32, bool>,
    deactivations: Vec<Deactivation>,
    last_time_us: u64,
    sample_count: u64,
}

type Rule<T> = Result<T, FormatErrorKind>;

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
            last_time_us: header.start_time_us,
            sample_count: 0,
        }
    }

    /// Check a sample record against the definitions and return its absolute
    /// timestamp; on success the running timestamp advances.
    #[inline]
    pub(crate) fn apply_sample(&mut self, delta_us: i64, thread: u64, stack: u64) -> Rule<Sample> {
        let time_us =
            self.last_time_us.checked_add_signed(delta_us).ok_or(FormatErrorKind::TimestampOverflow)?;
        let thread = reference("thread", thread, self.threads.len())?;
        let stack = reference("stack", stack, self.stack_frame.len())?;
        self.last_time_us = time_us;
        self.sample_count += 1;
        Ok(Sample { time_us, thread: ThreadId(thread), stack: StackId(stack) })
    }

    /// Check one record against the definitions and, if it is valid, apply it.
    /// A sample is returned with its absolute timestamp.
    pub(crate) fn apply(&mut self, rec: &Record<'_>) -> Rule<Option<Sample>> {
        match *rec {
            Record::Sample { delta_us, thread, stack } => {
                return self.apply_sample(delta_us, thread, stack).map(Some);
            }
            Record::Module { id, pid, start, size, file_offset, generation, path, build_id } => {
                dense("module", id, self.modules.len())?;
                let pid = fits_u32("pid", pid)?;
                if size == 0 {
                    return Err(FormatErrorKind::EmptyModule);
                }
                let end = start.checked_add(size).ok_or(FormatErrorKind::AddressOverflow)?;
                file_offset.checked_add(size).ok_or(FormatErrorKind::AddressOverflow)?;
                if let Some(active) = self.active_by_pid.get(&pid) {
                    for &m in active {
                        let other = &self.modules[m as usize];
                        if start < other.end() && other.start < end {
                            return Err(FormatErrorKind::OverlappingModule { active: m as u64 });
                        }
                    }
                }
                let id32 = id as u32;
                self.modules.push(Module {
                    id: ModuleId(id32),
                    pid,
                    start,
                    size,
                    file_offset,
                    generation,
                    path: path.to_vec(),
                    build_id: build_id.to_vec(),
                });
                self.module_active.push(true);
                self.active_by_pid.entry(pid).or_default().push(id32);
            }
            Record::Frame { id, frame } => {
                dense("frame", id, self.frames.len())?;
                let frame = match frame {
                    RawFrame::Module { module, file_relative } => {
                        let m = reference("module", module, self.modules.len())?;
                        let md = &self.modules[m as usize];
                        let off = file_relative
                            .checked_sub(md.file_offset)
                            .ok_or(FormatErrorKind::OutsideModule { module, address: file_relative })?;
                        if off >= md.size {
                            return Err(FormatErrorKind::OutsideModule { module, address: file_relative });
                        }
                        md.start.checked_add(off).ok_or(FormatErrorKind::AddressOverflow)?;
                        if !self.module_active[m as usize] {
                            return Err(FormatErrorKind::RetiredModule(module));
                        }
                        Frame::Module { module: ModuleId(m), file_relative }
                    }
                    RawFrame::Absolute { address, kernel } => Frame::Absolute { address, kernel },
                    RawFrame::Truncated => Frame::Truncated,
                };
                self.frames.push(frame);
            }
            Record::Stack { id, parent, frame } => {
                dense("stack", id, self.stack_frame.len())?;
                let f = reference("frame", frame, self.frames.len())?;
                let (p, depth) = match parent {
                    None => (NO_PARENT, 1u32),
                    Some(p) => {
                        let p = reference("stack", p, self.stack_frame.len())?;
                        if self.frames[f as usize] == Frame::Truncated {
                            return Err(FormatErrorKind::MisplacedTruncationMarker);
                        }
                        (p, self.stack_depth[p as usize] as u32 + 1)
                    }
                };
                if depth > MAX_STACK_DEPTH {
                    return Err(FormatErrorKind::StackTooDeep);
                }
                self.stack_parent.push(p);
                self.stack_frame.push(f);
                self.stack_depth.push(depth as u16);
            }
            Record::Thread { id, pid, tid, name } => {
                dense("thread", id, self.threads.len())?;
                let pid = fits_u32("pid", pid)?;
                let tid = fits_u32("tid", tid)?;
                let name = std::str::from_utf8(name).map_err(|_| FormatErrorKind::BadUtf8("thread name"))?;
                self.threads.push(Thread { id: ThreadId(id as u32), pid, tid, name: name.to_owned() });
            }
            Record::PythonRuntime { pid, time_us, entering } => {
                let pid = fits_u32("pid", pid)?;
                let inside = self.python_in.get(&pid).copied().unwrap_or(false);
                if inside == entering {
                    return Err(FormatErrorKind::PythonRuntimeState);
                }
                self.python_in.insert(pid, entering);
                self.python.push(PythonRuntimeEvent {
                    pid,
                    time_us,
                    entering,
                    samples_before: self.sample_count,
                });
            }
            Record::ProcessModuleDeactivation { pid } => {
                let pid = fits_u32("pid", pid)?;
                if let Some(active) = self.active_by_pid.remove(&pid) {
                    for m in active {
                        self.module_active[m as usize] = false;
                        self.deactivations
                            .push(Deactivation { module: ModuleId(m), samples_before: self.sample_count });
                    }
                }
            }
            Record::ModuleDeactivation { module } => {
                let m = reference("module", module, self.modules.len())?;
                if !self.module_active[m as usize] {
                    return Err(FormatErrorKind::AlreadyRetired(module));
                }
                self.module_active[m as usize] = false;
                let pid = self.modules[m as usize].pid;
                if let Some(active) = self.active_by_pid.get_mut(&pid) {
                    active.retain(|&x| x != m);
                }
                self.deactivations
                    .push(Deactivation { module: ModuleId(m), samples_before: self.sample_count });
            }
        }
        Ok(None)
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
    /// The sampling engine recorded in the header.
    pub fn engine(&self) -> Engine {
        self.header.engine
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
            Frame::Truncated => None,
        }
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
