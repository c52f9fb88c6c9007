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

mod remap;
mod source;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fs::File;
use std::path::{Path, PathBuf};

use spulse::{Frame, FrameId, Header, ModuleId, SpoolWriter, StackId, ThreadId};

use remap::ModuleKey;
pub use source::Source;

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

/// Why a source stopped: its own fault (it is abandoned) or the output's (fatal).
pub enum MergeError {
    /// The source is unreadable or hostile; the message says where.
    Source(String),
    /// Writing the output failed.
    Output(spulse::Error),
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

/// What [`merge_files`] did.
#[derive(Debug)]
pub struct Merged {
    /// Samples copied.
    pub samples: u64,
    /// Samples the output refused (a definition they need broke a rule there).
    pub dropped: u64,
    /// Sources that end inside a record: path and the end of their valid part.
    pub truncated: Vec<(PathBuf, u64)>,
    /// Sources whose headers have the same start time (to the microsecond):
    /// most likely one recording twice, such as a spool and its packed copy.
    pub same_start: Vec<(PathBuf, PathBuf)>,
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
    let same_start: Vec<(PathBuf, PathBuf)> = order
        .windows(2)
        .filter(|w| w[0].0 == w[1].0)
        .map(|w| (paths[w[0].1].clone(), paths[w[1].1].clone()))
        .collect();
    let mut waiting: VecDeque<(u64, usize)> = order.into();
    let header = header.unwrap_or(Header { start_time_us: 0, interval_us: 1 });
    let mut out = SpoolWriter::new(out, header).map_err(MergeError::Output)?;
    let mut sh = Shared::merging();
    let mut merged = Merged { samples: 0, dropped: 0, truncated: Vec::new(), same_start };
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
    use spulse::NewModule;
    use spulse::{Header, Snapshot};
    use std::io::Write;

    const HDR: Header = Header { start_time_us: 1_000_000, interval_us: 1000 };

    fn module<'a>(pid: u32, path: &'a [u8]) -> NewModule<'a> {
        NewModule { pid, start: 0x1000, size: 0x1000, file_offset: 0, generation: 0, path, build_id: b"" }
    }

    /// A source spool of pid 7 at `path` with library a, a thread and a
    /// stack of one frame in a.
    fn with_a(path: &Path) -> (SpoolWriter<File>, spulse::ModuleId, spulse::ThreadId, spulse::StackId) {
        let mut w = SpoolWriter::new(File::create(path).unwrap(), HDR).unwrap();
        let a = w.define_module(&module(7, b"/lib/a.so")).unwrap();
        let th = w.define_thread(7, 7, "main").unwrap();
        let fa = w.define_frame(Frame::Module { module: a, file_relative: 0x10 }).unwrap();
        let sa = w.define_stack(None, fa).unwrap();
        (w, a, th, sa)
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
        let (mut w, a, th, sa) = with_a(&src);
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

    /// A tick as the recorder writes it, between two samples: an off-CPU
    /// interval (its stack taken while library a was loaded), then a's
    /// retirement and library b loaded over a's range, then a heap event
    /// whose stack is resolved against b. The merged interval keeps a's
    /// frame and the heap event b's, rather than addresses.
    #[test]
    fn events_beside_a_retirement_keep_their_modules() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("7.1.spool");
        let (mut w, a, th, sa) = with_a(&src);
        w.sample(1_000_010, th, sa).unwrap();
        w.off_cpu(th, sa, 1_000_020, 30, false).unwrap();
        w.deactivate_module(a).unwrap();
        let b = w.define_module(&module(7, b"/lib/b.so")).unwrap();
        let fb = w.define_frame(Frame::Module { module: b, file_relative: 0x20 }).unwrap();
        let sb = w.define_stack(None, fb).unwrap();
        w.heap_event(th, sb, 1_000_050, 0x5000, 64, 4096, false).unwrap();
        w.sample(1_000_100, th, sb).unwrap();
        w.flush().unwrap();
        drop(w);

        let (out_path, mut out) = output(dir.path());
        let mut s = Source::open(&src, 7).unwrap();
        assert!(s.pump(&mut out).is_ok());
        s.retire_all(&mut out).unwrap();
        out.flush().unwrap();
        drop(out);
        let snap = Snapshot::open(&out_path).unwrap();
        let d = snap.definitions();
        let path = |stack| match d.frame(d.stack(stack).frame) {
            Frame::Module { module, .. } => d.module(module).path.clone(),
            other => panic!("the frame lost its module: {other:?}"),
        };
        assert_eq!(d.off_cpu_intervals().len(), 1);
        assert_eq!(path(d.off_cpu_intervals()[0].stack), b"/lib/a.so");
        assert_eq!(d.heap_events().len(), 1);
        assert_eq!(path(d.heap_events()[0].stack), b"/lib/b.so");
        let samples: Vec<Vec<u8>> = snap.samples().map(|x| path(x.stack)).collect();
        assert_eq!(samples, [b"/lib/a.so".to_vec(), b"/lib/b.so".to_vec()]);
    }

    /// Samples followed by a bad record: one pump copies the samples and
    /// reports the bad record, so a caller that retires the source right after
    /// (its process ended) never takes a corrupt spool for a complete one.
    #[test]
    fn one_pump_reports_a_bad_record_after_samples() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("7.1.spool");
        let (mut w, _, th, sa) = with_a(&src);
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
