//! A source's ids remapped into the output's: the output id of each source
//! thread, stack node, frame and module, defined in the output when first
//! needed, or (with [`Shared::merging`]) the output definition another source
//! made of the identical thing.
//!
//! Threads, stack nodes and frames go through one look-up-or-define
//! ([`look_up_or_define`]): the source's own memo ([`IdMap`]), then the
//! shared table, then a new output definition. Modules are counted instead
//! (a shared module is retired once no source uses it: [`release_module`]).

use std::collections::HashMap;
use std::fs::File;
use std::hash::Hash;

use spulse::{Frame, FrameId, ModuleId, NewModule, Sample, SpoolWriter, StackId, ThreadId};

use super::source::Source;
use super::{is_io, MergeError, Shared};

/// A module as its definition describes it (pid, start, size, file offset,
/// generation, path, build id).
pub(super) type ModuleKey = (u32, u64, u64, u64, u64, Vec<u8>, Vec<u8>);

/// The state of one source module in the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ModState {
    /// Not defined yet.
    Pending,
    /// Defined and active.
    Defined(ModuleId),
    /// The source retired it (it may never have been defined in the output).
    Retired,
}

/// One kind of a source's definitions: the output id of each source id
/// (by index) mapped so far.
#[derive(Debug)]
pub(super) struct IdMap<T>(Vec<Option<T>>);

impl<T> Default for IdMap<T> {
    fn default() -> Self {
        IdMap(Vec::new())
    }
}

impl<T: Copy> IdMap<T> {
    /// The output id of source id number `idx`, if mapped.
    fn get(&self, idx: usize) -> Option<T> {
        self.0.get(idx).copied().flatten()
    }

    fn set(&mut self, idx: usize, id: T) {
        if self.0.len() <= idx {
            self.0.resize(idx + 1, None);
        }
        self.0[idx] = Some(id);
    }
}

/// The output id of a definition described by `key`: the one `shared`
/// holds (another source defined the identical thing), else a new one from
/// `define`, which `shared` then keeps if `merging`. An output refusal is
/// [`MergeError::Output`].
fn look_up_or_define<K: Eq + Hash, V: Copy>(
    shared: &mut HashMap<K, V>,
    merging: bool,
    key: K,
    define: impl FnOnce() -> Result<V, spulse::Error>,
) -> Result<V, MergeError> {
    if let Some(&id) = shared.get(&key) {
        return Ok(id);
    }
    let id = define().map_err(MergeError::Output)?;
    if merging {
        shared.insert(key, id);
    }
    Ok(id)
}

impl Source {
    pub(super) fn map_sample(
        &mut self,
        s: &Sample,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<(), MergeError> {
        let thread = self.map_thread(s.thread, out, sh)?;
        let stack = self.map_stack(s.stack, out, sh)?;
        out.sample(s.time_us, thread, stack).map_err(MergeError::Output)
    }

    pub(super) fn map_thread(
        &mut self,
        id: ThreadId,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<ThreadId, MergeError> {
        if let Some(t) = self.threads.get(id.index()) {
            return Ok(t);
        }
        let t = self.tail.definitions().thread(id);
        let pid = if self.strict { self.pid } else { t.pid };
        let new = look_up_or_define(&mut sh.threads, sh.merging, (pid, t.tid, t.name.clone()), || {
            out.define_thread(pid, t.tid, &t.name)
        })?;
        self.threads.set(id.index(), new);
        Ok(new)
    }

    pub(super) fn map_stack(
        &mut self,
        leaf: StackId,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<StackId, MergeError> {
        // Walk towards the root until a node already in the output (or the
        // root), then define the missing nodes root-first.
        let mut missing = Vec::new();
        let mut cur = Some(leaf);
        let mut parent_out = None;
        while let Some(id) = cur {
            if let Some(done) = self.stacks.get(id.index()) {
                parent_out = Some(done);
                break;
            }
            missing.push(id);
            cur = self.tail.definitions().stack(id).parent;
        }
        for id in missing.into_iter().rev() {
            let frame = self.map_frame(self.tail.definitions().stack(id).frame, out, sh)?;
            let new = look_up_or_define(&mut sh.stacks, sh.merging, (parent_out, frame), || {
                out.define_stack(parent_out, frame)
            })?;
            self.stacks.set(id.index(), new);
            parent_out = Some(new);
        }
        Ok(parent_out.expect("a stack has at least its leaf node"))
    }

    pub(super) fn map_frame(
        &mut self,
        id: FrameId,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<FrameId, MergeError> {
        if let Some(f) = self.frames.get(id.index()) {
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
                self.frames.set(id.index(), new);
                return Ok(new);
            }
            other => other,
        };
        let new = look_up_or_define(&mut sh.frames, sh.merging, frame, || out.define_frame(frame))?;
        self.frames.set(id.index(), new);
        Ok(new)
    }

    /// Define pending modules in source order; stop at the first that the
    /// output refuses (its range is still held by a module the source
    /// retires later), so that the order is kept. `next_module` is the
    /// first that may still be pending.
    pub(super) fn define_pending_modules(
        &mut self,
        out: &mut SpoolWriter<File>,
        sh: &mut Shared,
    ) -> Result<(), MergeError> {
        let defs = self.tail.definitions();
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
}

/// A source gives up output module `id`: retire it once no source uses it.
pub(super) fn release_module(
    id: ModuleId,
    out: &mut SpoolWriter<File>,
    sh: &mut Shared,
) -> Result<(), spulse::Error> {
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
