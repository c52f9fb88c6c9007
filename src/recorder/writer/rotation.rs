//! Segment rotation (see "Rotation" in the recorder's doc): the state of a
//! rotating recording, the step that starts the next segment, and retention.

use std::collections::VecDeque;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{Run, Sink};
use crate::recorder::builder::RotationPlan;
use crate::recorder::output::{create_spool, segment_path};
use crate::recorder::own_fd::SpoolFile;
use crate::recorder::{set_live_segment, sys};
use crate::{Error, Header, NewModule, SpoolWriter};

/// A segment this recorder created: where, what file it was created as, and
/// (once finished) its size and modification time, which retention checks
/// too before deleting it: file systems reuse inode numbers (ext4 soon after
/// a file is deleted), so (device, inode) alone may name another file.
struct KeptSegment {
    path: PathBuf,
    dev: u64,
    ino: u64,
    /// Size and modification time (s, ns) when it was finished; `None` if
    /// they could not be read (it is then never deleted).
    finished: Option<(u64, i64, i64)>,
}

impl KeptSegment {
    /// Whether `m` (of the file at the path now) is still this segment.
    fn is(&self, m: &std::fs::Metadata) -> bool {
        m.file_type().is_file()
            && m.dev() == self.dev
            && m.ino() == self.ino
            && self.finished == Some((m.size(), m.mtime(), m.mtime_nsec()))
    }
}

/// The state of a rotating recording.
pub(crate) struct Rotation {
    pieces: Vec<Vec<u8>>,
    every: Duration,
    retain: Option<usize>,
    mode: u32,
    overwrite: bool,
    interval_us: u64,
    /// Number of the current segment.
    pub(super) seq: u64,
    /// When the next segment is due.
    pub(super) due: Instant,
    /// Segments this recorder created and has not deleted, oldest first, with
    /// the device and inode each was created as.
    kept: VecDeque<KeptSegment>,
    pub(super) deleted: u64,
    /// Bytes of the segments already finished.
    pub(super) bytes_done: u64,
}

impl Rotation {
    /// The segment being written (the last one created).
    pub(super) fn current(&self) -> Option<&Path> {
        self.kept.back().map(|k| k.path.as_path())
    }

    /// Rotation state for a recording whose first segment, `first`, was just
    /// created (`meta` is its metadata).
    pub(crate) fn new(
        plan: RotationPlan,
        first: &Path,
        meta: &std::fs::Metadata,
        mode: u32,
        overwrite: bool,
        interval_us: u64,
    ) -> Rotation {
        Rotation {
            pieces: plan.pieces,
            every: plan.every,
            retain: plan.retain,
            mode,
            overwrite,
            interval_us,
            seq: 0,
            due: Instant::now() + plan.every,
            kept: VecDeque::from([KeptSegment {
                path: first.to_path_buf(),
                dev: meta.dev(),
                ino: meta.ino(),
                finished: None,
            }]),
            deleted: 0,
            bytes_done: 0,
        }
    }
}

/// How many taken segment names in a row a rotation steps over before it
/// stops the recording with the error.
const MAX_TAKEN: usize = 16;

/// Whether creating a segment failed only because its name is taken.
fn is_taken(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::AlreadyExists)
}

/// Create, lock and start the segment `path`. A segment whose header cannot be
/// written (a full disk) is removed again, so that no empty, unlocked
/// segment is left for followers to wait on.
fn create_segment(
    path: &Path,
    mode: u32,
    overwrite: bool,
    header: Header,
) -> Result<(SpoolWriter<Box<dyn Sink>>, std::fs::Metadata), Error> {
    let file = create_spool(path, mode, overwrite)?;
    let meta = file.metadata().map_err(|e| Error::io(Some(path), e))?;
    let sink: Box<dyn Sink> = Box::new(SpoolFile::new(file));
    match SpoolWriter::new(sink, header).and_then(|mut out| out.flush().map(|()| out)) {
        Ok(out) => Ok((out, meta)),
        Err(e) => {
            // Still the file created above (same device and inode): ours to remove.
            if std::fs::symlink_metadata(path).is_ok_and(|m| m.dev() == meta.dev() && m.ino() == meta.ino()) {
                let _ = std::fs::remove_file(path);
            }
            Err(e.with_path(path))
        }
    }
}

impl Run {
    /// Start the next segment (called after a tick's flush, so every sample
    /// drained so far is in the segment left behind).
    ///
    /// The next segment is created, locked, and given its header, the
    /// definitions of every module not yet retired (under new ids, which the
    /// module table takes over) and, in Python-runtime mode, an entry mark;
    /// frames, stacks and threads are defined again when its samples need
    /// them (the interner starts empty). The old segment is synced (and its
    /// size and time noted for retention) before the next one is created, and
    /// unlocked only after, so a follower that finds it unlocked finds the next one
    /// already there. Retention then deletes the oldest segments.
    pub(super) fn rotate(&mut self) {
        let Some(rot) = self.st.rotation.as_mut() else { return };
        let now = Instant::now();
        rot.due += rot.every;
        if rot.due <= now {
            rot.due = now + rot.every;
        }
        if self.error.is_some() {
            return;
        }
        let mut seq = rot.seq + 1;
        let mut path = segment_path(&rot.pieces, seq);
        // The segment being left is complete (the tick's flush wrote it):
        // make it durable and note its size and modification time now,
        // before the next segment exists, so that what retention later
        // matches is the segment as this recorder finished it, not a file
        // someone wrote there after seeing the next segment appear.
        let old_done = self.st.out.flush().and_then(|()| self.st.out.get_ref().sync().map_err(Error::from));
        let finished = self.st.out.get_ref().metadata().map(|m| (m.size(), m.mtime(), m.mtime_nsec()));
        let header = Header { start_time_us: sys::now_us(), interval_us: rot.interval_us };
        // A segment's name already taken by a file this recorder did not
        // create (another user's, in a shared directory; without overwrite):
        // the recording goes on under the next free number, which followers
        // find (the lowest number after the last segment), and says so.
        let mut taken = Vec::new();
        let created = loop {
            match create_segment(&path, rot.mode, rot.overwrite, header) {
                Err(e) if is_taken(&e) && taken.len() < MAX_TAKEN => {
                    taken.push(path);
                    seq += 1;
                    path = segment_path(&rot.pieces, seq);
                }
                r => break r,
            }
        };
        if !taken.is_empty() {
            let names: Vec<String> = taken.iter().map(|p| p.display().to_string()).collect();
            let w = format!(
                "segment path {} already taken by another file: the recording went on at {}",
                names.join(", "),
                path.display()
            );
            self.st.warnings.push(w);
        }
        let Some(rot) = self.st.rotation.as_mut() else { return };
        let (out, meta) = match created {
            Ok(c) => c,
            Err(e) => {
                self.note(Err::<(), _>(e));
                return;
            }
        };
        rot.seq = seq;
        rot.kept.push_back(KeptSegment {
            path: path.clone(),
            dev: meta.dev(),
            ino: meta.ino(),
            finished: None,
        });
        set_live_segment(&path);
        let old = std::mem::replace(&mut self.st.out, out);
        let old_path = rot.kept.iter().rev().nth(1).map(|k| k.path.clone());
        // The new segment's definitions: the modules still active, in table
        // order (the order they were defined in, so spans never overlap).
        let r = self.define_active_modules(&path);
        self.note(r);
        // Threads whose waits are still to be written, maybe after they
        // exit: out now, or paired by the drain before the captures.
        let off_cpu = self.st.off_cpu.as_ref();
        let unwritten: rustc_hash::FxHashSet<u32> =
            off_cpu.map(|o| o.unwritten().collect()).unwrap_or_default();
        let waiting = |tid| unwritten.contains(&tid) || off_cpu.is_some_and(|o| o.is_waiting(tid));
        self.interner = std::mem::take(&mut self.interner).next_segment(waiting);
        self.off_cpu_new_segment();
        if self.python_inside && self.error.is_none() {
            let r = self.st.out.python_runtime(self.st.pid, header.start_time_us, true);
            self.note(r.map_err(|e| e.with_path(&path)));
        }
        if self.error.is_none() {
            let r = self.st.out.flush().map_err(|e| e.with_path(&path));
            self.note(r);
        }
        // The segment left behind was made durable above: tell followers
        // (the next segment already exists).
        let r = old_done;
        old.get_ref().release();
        let Some(rot) = self.st.rotation.as_mut() else { return };
        if let Some(k) = rot.kept.iter_mut().rev().nth(1) {
            k.finished = finished;
        }
        rot.bytes_done += old.len();
        drop(old);
        if let Err(e) = r {
            let e = match old_path {
                Some(p) => e.with_path(&p),
                None => e,
            };
            self.note(Err::<(), _>(e));
        }
        self.apply_retention();
    }

    /// Define every module not yet retired in the (new) current segment and
    /// give the table their new ids.
    fn define_active_modules(&mut self, path: &Path) -> Result<(), Error> {
        for e in self.st.table.entries.iter_mut().filter(|e| !e.retired) {
            e.id = self
                .st
                .out
                .define_module(&NewModule {
                    pid: self.st.pid,
                    start: e.seg.avma,
                    size: e.seg.size,
                    file_offset: e.seg.file_offset,
                    generation: e.gen_added,
                    path: &e.key.path,
                    build_id: &e.build_id,
                })
                .map_err(|err| err.with_path(path))?;
        }
        Ok(())
    }

    /// Delete the oldest segments beyond the number to retain, each only if
    /// its path still names the file this recorder created and finished
    /// (device, inode, size and modification time: see [`KeptSegment`]).
    fn apply_retention(&mut self) {
        let Some(rot) = self.st.rotation.as_mut() else { return };
        let Some(retain) = rot.retain else { return };
        let mut failure = None;
        while rot.kept.len() > retain {
            let Some(k) = rot.kept.pop_front() else { break };
            let path = &k.path;
            match std::fs::symlink_metadata(path) {
                Ok(m) if k.is(&m) => match std::fs::remove_file(path) {
                    Ok(()) => rot.deleted += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => failure = failure.or(Some(Error::io(Some(path), e))),
                },
                // Gone already, or another file took its place: not ours to delete.
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => failure = failure.or(Some(Error::io(Some(path), e))),
            }
        }
        if let Some(e) = failure {
            self.note(Err::<(), _>(e));
        }
    }
}
