//! `Definitions`: everything a spool has defined so far, and the rules that tie
//! a record to the records before it.
//!
//! The writer runs every record through [`Definitions::apply`] before encoding it
//! and every reader runs every decoded record through it, so the two can never
//! disagree about what a valid spool is.

use std::collections::{BTreeMap, HashMap};

use super::limits::*;
use super::record::{Cursor, DecodeError};
use super::types::*;
use super::{frame_kind, tag, varint};
use crate::FormatErrorKind;

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
            let Some((delta, thread, stack, end)) = varint::decode_sample_at(buf, p) else { break };
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

    /// Decode the record at the start of `buf`, check it against every rule and,
    /// if it is valid and complete, apply it. Returns the sample (for a sample
    /// record) and the record's length.
    ///
    /// Fields are read in stream order and each rule runs as soon as the fields
    /// it needs are complete, so the outcome depends only on the bytes up to the
    /// first offending field: `Incomplete` means the bytes present are a prefix
    /// of some valid record (more bytes could complete it), never a prefix that
    /// is already wrong. Syntax errors carry the offset of the field within the
    /// record; rule violations carry offset 0 (the record's tag byte).
    pub(crate) fn read_record(&mut self, buf: &[u8]) -> Result<(Option<Sample>, usize), DecodeError> {
        let Some(&t) = buf.first() else {
            return Err(DecodeError::Incomplete);
        };
        let mut c = Cursor::new(buf, 1);
        match t {
            tag::SAMPLE => {
                let delta_us = c.i64()?;
                let time_us = self.sample_time(delta_us).map_err(rule)?;
                let thread = reference("thread", c.u64()?, self.threads.len()).map_err(rule)?;
                let stack = reference("stack", c.u64()?, self.stack_frame.len()).map_err(rule)?;
                self.last_time_us = time_us;
                self.sample_count += 1;
                return Ok((
                    Some(Sample { time_us, thread: ThreadId(thread), stack: StackId(stack) }),
                    c.pos,
                ));
            }
            tag::MODULE => {
                let id = c.u64()?;
                dense("module", id, self.modules.len()).map_err(rule)?;
                let pid = fits_u32("pid", c.u64()?).map_err(rule)?;
                let start = c.u64()?;
                let size = c.u64()?;
                if size == 0 {
                    return Err(rule(FormatErrorKind::EmptyModule));
                }
                let end = start.checked_add(size).ok_or(rule(FormatErrorKind::AddressOverflow))?;
                if let Some(active) = self.active_by_pid.get(&pid) {
                    // Active modules of one process are disjoint, so only the one
                    // starting last below `end` can overlap [start, end).
                    if let Some((_, &m)) = active.range(..end).next_back() {
                        if self.modules[m as usize].end() > start {
                            return Err(rule(FormatErrorKind::OverlappingModule { active: m as u64 }));
                        }
                    }
                }
                let file_offset = c.u64()?;
                file_offset.checked_add(size).ok_or(rule(FormatErrorKind::AddressOverflow))?;
                let generation = c.u64()?;
                let path = c.bytes("module path", MAX_PATH_LEN)?;
                let build_id = c.bytes("build id", MAX_BUILD_ID_LEN)?;
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
                self.active_by_pid.entry(pid).or_default().insert(start, id32);
            }
            tag::FRAME => {
                let id = c.u64()?;
                dense("frame", id, self.frames.len()).map_err(rule)?;
                let kind_at = c.pos;
                let frame = match c.u64()? {
                    frame_kind::MODULE => {
                        let module = c.u64()?;
                        let m = reference("module", module, self.modules.len()).map_err(rule)?;
                        if !self.module_active[m as usize] {
                            return Err(rule(FormatErrorKind::RetiredModule(module)));
                        }
                        let file_relative = c.u64()?;
                        let md = &self.modules[m as usize];
                        let outside = FormatErrorKind::OutsideModule { module, address: file_relative };
                        let off = file_relative.checked_sub(md.file_offset).ok_or(rule(outside.clone()))?;
                        if off >= md.size {
                            return Err(rule(outside));
                        }
                        // Cannot fail: `start + size` was checked when the module was defined.
                        md.start.checked_add(off).ok_or(rule(FormatErrorKind::AddressOverflow))?;
                        Frame::Module { module: ModuleId(m), file_relative }
                    }
                    frame_kind::ABSOLUTE => {
                        let (address, kernel) = c.absolute_frame()?;
                        Frame::Absolute { address, kernel }
                    }
                    frame_kind::TRUNCATED => {
                        c.truncation_payload()?;
                        Frame::Truncated
                    }
                    other => return Err(c.bad(kind_at, FormatErrorKind::UnknownFrameKind(other))),
                };
                self.frames.push(frame);
            }
            tag::STACK => {
                let id = c.u64()?;
                dense("stack", id, self.stack_frame.len()).map_err(rule)?;
                let parent = match c.u64()?.checked_sub(1) {
                    None => None,
                    Some(p) => Some(reference("stack", p, self.stack_frame.len()).map_err(rule)?),
                };
                let f = reference("frame", c.u64()?, self.frames.len()).map_err(rule)?;
                let (p, depth) = match parent {
                    None => (NO_PARENT, 1u32),
                    Some(p) => {
                        if self.frames[f as usize] == Frame::Truncated {
                            return Err(rule(FormatErrorKind::MisplacedTruncationMarker));
                        }
                        (p, self.stack_depth[p as usize] as u32 + 1)
                    }
                };
                if depth > MAX_STACK_DEPTH {
                    return Err(rule(FormatErrorKind::StackTooDeep));
                }
                self.stack_parent.push(p);
                self.stack_frame.push(f);
                self.stack_depth.push(depth as u16);
            }
            tag::THREAD => {
                let id = c.u64()?;
                dense("thread", id, self.threads.len()).map_err(rule)?;
                let pid = fits_u32("pid", c.u64()?).map_err(rule)?;
                let tid = fits_u32("tid", c.u64()?).map_err(rule)?;
                let name_at = c.pos;
                let bad_utf8 =
                    DecodeError::Bad { at: name_at, kind: FormatErrorKind::BadUtf8("thread name") };
                let name = match c.bytes_or_partial("thread name", MAX_THREAD_NAME_LEN)? {
                    Ok(name) => std::str::from_utf8(name).map_err(|_| bad_utf8)?,
                    Err(prefix) => {
                        // A prefix is still valid if it only ends inside a character.
                        if let Err(e) = std::str::from_utf8(prefix) {
                            if e.error_len().is_some() {
                                return Err(bad_utf8);
                            }
                        }
                        return Err(DecodeError::Incomplete);
                    }
                };
                self.threads.push(Thread { id: ThreadId(id as u32), pid, tid, name: name.to_owned() });
            }
            tag::PYTHON_RUNTIME => {
                let pid = fits_u32("pid", c.u64()?).map_err(rule)?;
                let time_us = c.u64()?;
                let state_at = c.pos;
                let state = c.u64()?;
                if state > 1 {
                    return Err(c.bad(state_at, FormatErrorKind::BadValue("Python-runtime state", state)));
                }
                let entering = state == 1;
                let inside = self.python_in.get(&pid).copied().unwrap_or(false);
                if inside == entering {
                    return Err(rule(FormatErrorKind::PythonRuntimeState));
                }
                self.python_in.insert(pid, entering);
                self.python.push(PythonRuntimeEvent {
                    pid,
                    time_us,
                    entering,
                    samples_before: self.sample_count,
                });
            }
            tag::PROCESS_MODULE_DEACTIVATION => {
                let pid = fits_u32("pid", c.u64()?).map_err(rule)?;
                if let Some(active) = self.active_by_pid.remove(&pid) {
                    let mut ids: Vec<u32> = active.into_values().collect();
                    ids.sort_unstable();
                    for m in ids {
                        self.module_active[m as usize] = false;
                        self.deactivations
                            .push(Deactivation { module: ModuleId(m), samples_before: self.sample_count });
                    }
                }
            }
            tag::MODULE_DEACTIVATION => {
                let module = c.u64()?;
                let m = reference("module", module, self.modules.len()).map_err(rule)?;
                if !self.module_active[m as usize] {
                    return Err(rule(FormatErrorKind::AlreadyRetired(module)));
                }
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
            other => return Err(DecodeError::Bad { at: 0, kind: FormatErrorKind::UnknownTag(other) }),
        }
        Ok((None, c.pos))
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
