//! The collector's view of the private directory: each per-process spool
//! found there (`scan`), merged into the output while its process runs and
//! finished when it ends or exec's (`tick`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};

use spulse::SpoolWriter;

use super::handoff::{check_entry, open_spool, parse_name, process_dirs, read_new_lines};
use super::process::{alive, proc_starttime};
use crate::merge::{MergeError, Source};

/// One per-process spool file and how far it got.
pub(super) enum EntryState {
    /// Seen, header not readable yet.
    Waiting,
    /// Being merged.
    Open(Box<Source>),
}

/// A finished spool (merged and retired, or abandoned).
pub(super) struct Done {
    pub(super) pid: u32,
    pub(super) path: PathBuf,
    pub(super) samples: u64,
    pub(super) dropped: u64,
    pub(super) error: Option<String>,
    /// Not merged: writing the output had failed.
    pub(super) discarded: bool,
    /// Its spool was opened (a process whose spool vanished before it could
    /// be read, e.g. removed when its header could not be written, did not
    /// record).
    pub(super) opened: bool,
}

pub(super) struct Entry {
    pub(super) path: PathBuf,
    /// The process's start time (`/proc/<pid>/stat` field 22) when first seen.
    pub(super) starttime: Option<u64>,
    pub(super) state: EntryState,
}

pub(super) struct Collector {
    pub(super) dir: PathBuf,
    /// The `.users` directory this collector made (running as root), if any:
    /// one it did not make is never read.
    pub(super) users: Option<PathBuf>,
    /// By (pid, monotonic ns at the recorder's start): exec images of one pid in order.
    pub(super) entries: BTreeMap<(u32, u64), Entry>,
    pub(super) done: Vec<Done>,
    pub(super) seen: HashSet<PathBuf>,
    pub(super) live: LiveWarnings,
}

/// The warnings the recorded processes hand over while they run (each
/// recorder's `on_warning` appends them to `<pid>.<ns>.warnings`, see the
/// preload library), as far as the collector has printed them.
#[derive(Default)]
pub(super) struct LiveWarnings {
    /// Bytes of each warnings file already read (complete lines only).
    offsets: HashMap<PathBuf, u64>,
    /// (pid, warning) printed while recording: the summary does not print
    /// them again (the `.warnings` file beside the output still holds them).
    pub(super) shown: HashSet<(u32, String)>,
    /// `Collector::done` entries whose warnings file had its last read.
    done_read: usize,
}

impl Collector {
    /// Pick up new spool files.
    pub(super) fn scan(&mut self) {
        for dir in process_dirs(&self.dir, self.users.as_deref()) {
            self.scan_dir(&dir);
        }
    }

    fn scan_dir(&mut self, dir: &Path) {
        let Ok(rd) = std::fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            let path = e.path();
            if self.seen.contains(&path) {
                continue;
            }
            let Some((pid, ns)) = parse_name(&e.file_name(), "spool") else { continue };
            self.seen.insert(path.clone());
            // The directory is private (0700, or a switched user's 0700),
            // but the recorded program is untrusted: only a regular file of
            // the directory's user is read.
            if let Err(why) = check_entry(&path) {
                self.done.push(Done {
                    pid,
                    path,
                    samples: 0,
                    dropped: 0,
                    error: Some(format!("process {pid}: its spool was not read: {why}")),
                    discarded: false,
                    opened: false,
                });
                continue;
            }
            // (A pid outside the recorded tree, such as a spool the program
            // wrote under another process's pid, or a process of the tree
            // in a pid namespace whose pid here is another process's, is
            // merged while that process lives and finished once the tree
            // has exited: never waited for beyond it, never cut short while
            // the tree runs.)
            let starttime = proc_starttime(pid);
            self.entries.insert((pid, ns), Entry { path, starttime, state: EntryState::Waiting });
        }
    }

    /// The warnings the recorded processes found since the last call, as
    /// `process PID: ...`, each (pid, warning) once. Reads the warnings file
    /// of every spool being merged, and a last time of every spool finished
    /// since (its process has exited, so the file is complete).
    pub(super) fn live_warnings(&mut self) -> Vec<String> {
        let mut spools: Vec<(u32, PathBuf)> =
            self.entries.iter().map(|(&(pid, _), e)| (pid, e.path.clone())).collect();
        let live = &mut self.live;
        spools.extend(self.done[live.done_read..].iter().map(|d| (d.pid, d.path.clone())));
        live.done_read = self.done.len();
        let mut out = Vec::new();
        for (pid, spool) in spools {
            let path = spool.with_extension("warnings");
            let offset = live.offsets.get(&path).copied().unwrap_or(0);
            let (lines, next) = read_new_lines(&path, offset);
            if next != offset {
                live.offsets.insert(path, next);
            }
            for w in lines {
                if live.shown.insert((pid, w.clone())) {
                    out.push(format!("process {pid}: {w}"));
                }
            }
        }
        out
    }

    pub(super) fn all_done(&self) -> bool {
        self.entries.is_empty()
    }

    /// Merge what every current spool gained into `out`; finish the spools
    /// whose process ended (all of them once `tree_gone`: the tree has exited,
    /// so no process of it can still write). Without `out` (writing it
    /// failed), drop every spool.
    pub(super) fn tick(
        &mut self,
        out: Option<&mut SpoolWriter<File>>,
        tree_gone: bool,
    ) -> Result<(), spulse::Error> {
        let Some(out) = out else {
            for ((pid, _), entry) in std::mem::take(&mut self.entries) {
                let _ = std::fs::remove_file(&entry.path);
                let path = entry.path;
                self.done.push(Done {
                    pid,
                    path,
                    samples: 0,
                    dropped: 0,
                    error: None,
                    discarded: true,
                    opened: true,
                });
            }
            return Ok(());
        };
        let keys: Vec<(u32, u64)> = self.entries.keys().copied().collect();
        for (i, &(pid, ns)) in keys.iter().enumerate() {
            // Finished spools leave the map, and keys sort by (pid, ns): only
            // the oldest spool of a pid is merged. A later one is a later exec
            // image, and starts after this one is retired.
            if i > 0 && keys[i - 1].0 == pid {
                continue;
            }
            // A later spool of the pid is a later exec image, once this
            // one's recorder let go of its lock (an image's spool is closed
            // by its exec); while it holds it, the later spool is another
            // process with the same pid (another pid namespace's), read
            // once this one is finished.
            let superseded =
                keys.get(i + 1).is_some_and(|k| k.0 == pid) && !still_written(&self.entries[&(pid, ns)].path);
            let entry = self.entries.get_mut(&(pid, ns)).expect("key from the map");
            // Decide "ended" before the last read: once it has ended, nothing
            // more can be appended, so the read below gets everything.
            // A process not found alive by its pid may be one of a pid
            // namespace whose pid here is no process's (or another's): its
            // recorder still holding the spool's lock says it runs.
            let ended =
                superseded || tree_gone || !(alive(pid, entry.starttime) || still_written(&entry.path));
            if let EntryState::Waiting = entry.state {
                let opened = open_spool(&entry.path)
                    .and_then(|f| Source::open_file(f, &entry.path, pid).map_err(|e| e.to_string()));
                match opened {
                    Ok(s) => entry.state = EntryState::Open(Box::new(s)),
                    Err(e) if ended => {
                        let path = entry.path.clone();
                        self.entries.remove(&(pid, ns));
                        self.done.push(Done {
                            pid,
                            path,
                            samples: 0,
                            dropped: 0,
                            error: Some(format!("process {pid} left no readable spool: {e}")),
                            discarded: false,
                            opened: false,
                        });
                        continue;
                    }
                    Err(_) => continue,
                }
            }
            let EntryState::Open(src) = &mut entry.state else { continue };
            let failed = match src.pump(out) {
                Ok(()) => None,
                Err(MergeError::Source(msg)) => Some(msg),
                Err(MergeError::Output(e)) => return Err(e),
            };
            if failed.is_some() || ended {
                src.retire_all(out)?;
                let done = Done {
                    pid,
                    path: entry.path.clone(),
                    samples: src.samples,
                    dropped: src.dropped,
                    error: failed.map(|m| format!("process {pid}: stopped reading its spool: {m}")),
                    discarded: false,
                    opened: true,
                };
                // Its content is in the output now: free the disk space at once
                // (a long build runs through thousands of processes).
                let _ = std::fs::remove_file(&done.path);
                self.entries.remove(&(pid, ns));
                self.done.push(done);
            }
        }
        Ok(())
    }
}

/// Whether the spool at `path` is still being written: its recorder holds
/// the lock it takes at creation and drops when it finishes (or the process
/// ends). Opened without following a link and without blocking.
fn still_written(path: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .ok()
        .and_then(|f| spulse::recording_running(&f).ok())
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spool is "still written" while its recorder holds its lock, and no
    /// longer once it finished: the liveness the collector uses for a
    /// process its pid cannot find (a pid namespace's).
    #[test]
    fn a_spool_is_still_written_until_its_recorder_finishes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.spool");
        let g = spulse::start(&path).unwrap();
        assert!(still_written(&path));
        g.finish().unwrap();
        assert!(!still_written(&path));
        assert!(!still_written(&dir.path().join("missing.spool")));
    }
}
