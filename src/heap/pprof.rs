//! The heap profile in pprof format: the sampled stacks' estimates as Go's
//! heap profile has them (`alloc_objects`, `alloc_space`, `inuse_objects`,
//! `inuse_space`; period type `space/bytes`, period the sampling rate),
//! symbolized in process as the CPU endpoint is (through [`crate::pprof`]:
//! mappings with build ids, locations with addresses, functions with file and
//! line).
//!
//! The stacks are defined, as a spool would define them, in a
//! [`crate::SpoolWriter`] that writes nowhere, over the loaded objects the
//! sampler's unwinder knows (an object unloaded since its stacks were sampled
//! leaves their frames as bare addresses). The frames of the allocation path
//! itself (this sampler, `__rust_alloc` and `alloc::alloc`) are cut from each
//! stack's leaf end, and left out of the inlined functions of the first frame
//! kept, so the leaf is the code that asked for the memory (a `Vec`'s or
//! `Box`'s allocating function, say).

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use super::stacks::{self, Totals};
use super::{sampler, unwind};
use crate::pprof::{Counts, Head, Window};
use crate::symbolize::{is_allocator_frame, Context, Options, Symbolizer};
use crate::{Error, Frame, FrameId, Header, NewModule, SpoolWriter, StackId};

/// The endpoint's path for this profile (`spulse::http`).
pub const HEAP_PATH: &str = "/debug/pprof/heap";

struct Rows {
    contexts: Vec<Context>,
    /// (stack, totals) in a stable order.
    rows: Vec<(StackId, Totals)>,
}

impl Counts for Rows {
    fn contexts(&self) -> &[Context] {
        &self.contexts
    }
    fn iter(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        // The "count" is the row's index (plus one: counts are non-zero).
        self.rows.iter().enumerate().map(|(i, (s, _))| (0, *s, i as u64 + 1))
    }
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

fn fixed_to_count(v: u64) -> i64 {
    ((v + stacks::FIXED / 2) / stacks::FIXED) as i64
}

/// The gzipped pprof heap profile of everything [`super::Sampled`] sampled
/// so far in this process: `alloc_objects`/`alloc_space` since the start,
/// `inuse_objects`/`inuse_space` now, per stack, scaled for the sampling.
/// Symbolizes on the calling thread (whose symbolizer keeps its symbol tables
/// for the next call). Allocations of this function are not sampled.
///
/// Empty (no samples) when no [`super::Sampled`] allocator is installed.
///
/// ```no_run
/// let pprof_gz: Vec<u8> = spulse::heap::profile()?;
/// std::fs::write("heap.pb.gz", pprof_gz)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn profile() -> Result<Vec<u8>, Error> {
    thread_local! {
        static SYMBOLIZER: RefCell<Option<Symbolizer>> = const { RefCell::new(None) };
    }
    // The guard keeps this function's own allocations out of the tables.
    // A call from inside the sampler (impossible from safe code) is refused.
    sampler::guarded(|| {
        let kept = SYMBOLIZER.try_with(|s| {
            let mut s = s.borrow_mut();
            let sym = s.get_or_insert_with(|| Symbolizer::new(Options::default()));
            build(sym)
        });
        // Called while this thread's thread-locals are torn down (from an
        // `atexit` handler, or the destructor of another thread-local, such
        // as a kept recorder's guard): a symbolizer for this call alone.
        kept.unwrap_or_else(|_| build(&mut Symbolizer::new(Options::default())))
    })
    .unwrap_or_else(|| {
        Err(Error::io(None, std::io::Error::other("heap::profile called from inside the sampler")))
    })
}

/// [`profile`] with the caller's symbolizer (the endpoint's heap thread
/// keeps one for every request).
#[cfg(feature = "http")]
pub(crate) fn profile_with(sym: &mut Symbolizer) -> Result<Vec<u8>, Error> {
    sampler::guarded(|| build(sym)).unwrap_or_else(|| {
        Err(Error::io(None, std::io::Error::other("heap::profile called from inside the sampler")))
    })
}

/// Write [`profile`] to `path` (created or truncated).
pub fn write_profile(path: impl AsRef<Path>) -> Result<(), Error> {
    let path = path.as_ref();
    let bytes = profile()?;
    // Mode 0600, as the spool's: the profile names the program's functions
    // and files.
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io(Some(path), e))?;
    f.write_all(&bytes).map_err(|e| Error::io(Some(path), e))
}

fn build(sym: &mut Symbolizer) -> Result<Vec<u8>, Error> {
    let io = |e: Error| e;
    // Frame ids are this profile's: forget the previous one's.
    sym.next_spool();
    let pid = std::process::id();
    let snapshot = stacks::snapshot();
    let start = now_us();
    let mut w = SpoolWriter::new(std::io::sink(), Header { start_time_us: start, interval_us: 1 })?;
    // Modules: every executable segment the unwinder's scan saw.
    let mut segs: Vec<(u64, u64, u64, crate::ModuleId)> = Vec::new();
    unwind::with_state(|state| {
        for o in state.map_or(&[][..], |s| &s.objects[..]) {
            for seg in &o.segments {
                let m = NewModule {
                    pid,
                    start: seg.avma,
                    size: seg.size,
                    file_offset: seg.file_offset,
                    generation: 0,
                    path: &o.path,
                    build_id: &o.build_id,
                };
                // A module the spool rules refuse (overlapping, say) leaves
                // its frames as addresses.
                if let Ok(id) = w.define_module(&m) {
                    segs.push((seg.avma, seg.size, seg.file_offset, id));
                }
            }
        }
    });
    segs.sort_unstable_by_key(|s| s.0);
    let ctx = Context { thread: None, pid, perf_map_allowed: true };

    let mut frame_ids: HashMap<Frame, FrameId> = HashMap::new();
    let mut stack_ids: HashMap<(Option<StackId>, FrameId), StackId> = HashMap::new();
    let mut internal: HashMap<FrameId, bool> = HashMap::new();
    let mut merged: HashMap<StackId, Totals> = HashMap::new();
    let mut order: Vec<StackId> = Vec::new();
    let mut no_stack: Option<StackId> = None;
    for (addrs, t) in snapshot {
        // Leaf first; return addresses step back into their call.
        let mut frames = Vec::with_capacity(addrs.len());
        for (i, &a) in addrs.iter().enumerate() {
            let addr = if i == 0 { a } else { a.wrapping_sub(1) };
            let at = segs.partition_point(|s| s.0 <= addr);
            let frame = match at.checked_sub(1).map(|j| segs[j]) {
                Some((start, size, off, module)) if addr - start < size => {
                    Frame::Module { module, file_relative: addr - start + off }
                }
                _ => Frame::Absolute { address: addr, kernel: false },
            };
            let id = match frame_ids.get(&frame) {
                Some(&id) => id,
                None => {
                    let id = w.define_frame(frame).map_err(io)?;
                    frame_ids.insert(frame, id);
                    id
                }
            };
            frames.push(id);
        }
        // Cut the allocation path off the leaf end.
        let defs = w.definitions();
        let keep = frames
            .iter()
            .position(|&f| {
                !*internal.entry(f).or_insert_with(|| {
                    let r = sym.resolve(defs, f, &ctx);
                    is_allocator_frame(&sym.function(r.outer().func).name)
                })
            })
            .unwrap_or(frames.len());
        let frames = if keep < frames.len() { &frames[keep..] } else { &frames[..] };
        let leaf = if frames.is_empty() {
            // "[no stack]": a label alone (the unwinder was not ready, every
            // unwinder cache was in use, or the allocation was made off the
            // thread's own stack; counted in `stats().without_stack`).
            match no_stack {
                Some(s) => s,
                None => {
                    let f = w.define_label("no stack").map_err(io)?;
                    let s = w.define_stack(None, f).map_err(io)?;
                    no_stack = Some(s);
                    s
                }
            }
        } else {
            let mut parent = None;
            for &f in frames.iter().rev() {
                let s = match stack_ids.get(&(parent, f)) {
                    Some(&s) => s,
                    None => {
                        let s = w.define_stack(parent, f).map_err(io)?;
                        stack_ids.insert((parent, f), s);
                        s
                    }
                };
                parent = Some(s);
            }
            parent.expect("frames is not empty")
        };
        let e = merged.entry(leaf).or_insert_with(|| {
            order.push(leaf);
            Totals::default()
        });
        e.alloc_objects += t.alloc_objects;
        e.alloc_bytes += t.alloc_bytes;
        e.free_objects += t.free_objects;
        e.free_bytes += t.free_bytes;
    }
    let rows = Rows {
        contexts: vec![ctx],
        rows: order.into_iter().map(|s| (s, merged.remove(&s).unwrap_or_default())).collect(),
    };
    let rate = super::LAST_RATE.load(std::sync::atomic::Ordering::Relaxed) as i64;
    let head = Head {
        sample_types: &[
            ("alloc_objects", "count"),
            ("alloc_space", "bytes"),
            ("inuse_objects", "count"),
            ("inuse_space", "bytes"),
        ],
        period_type: ("space", "bytes"),
        period: rate,
        trim_inlined: Some(is_allocator_frame),
    };
    let values = |i: u64| {
        let t = &rows.rows[i as usize - 1].1;
        vec![
            fixed_to_count(t.alloc_objects),
            t.alloc_bytes as i64,
            fixed_to_count(t.alloc_objects.saturating_sub(t.free_objects)),
            t.alloc_bytes.saturating_sub(t.free_bytes) as i64,
        ]
    };
    let st = super::stats();
    let comment = format!(
        "spulse heap profile: {} samples, {} live sampled blocks, {} untracked, {} without stack, {} past the stack table",
        st.samples, st.live_blocks, st.untracked_blocks, st.without_stack, st.stack_table_full
    );
    let mut out = Vec::new();
    crate::pprof::write_with(
        w.definitions(),
        &rows,
        &head,
        &values,
        Window { start_us: start, duration_us: 0 },
        sym,
        &comment,
        &mut out,
    )
    .map_err(|e| Error::io(None, e))?;
    Ok(out)
}
