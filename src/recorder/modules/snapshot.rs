//! The unwinder snapshots the signal handler reads (see the module doc of
//! `modules/`): each object's checked unwind tables, the main executable's
//! deferred check, and the first, checked and next snapshots.

use super::*;

/// Search-table entries (FDEs) above which the main executable's tables are
/// checked after `start` returns rather than before: the check parses every
/// FDE (0.3-0.6 us each here), so this keeps it to one or two milliseconds of
/// the start, and small programs (a few thousand FDEs) get whole stacks from
/// their first sample.
pub(crate) const DEFER_MIN_FDES: u64 = 4096;

pub(super) static DEFER_THRESHOLD: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(DEFER_MIN_FDES);

/// Milliseconds the writer waits before running a deferred check, servicing
/// the rings meanwhile as during the check (0, the default, outside tests: a
/// test sets it through `testing::unwind_tables::set_check_delay` to give the
/// samples taken during a check a window of known length).
pub(super) static CHECK_DELAY_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How long the writer waits before a deferred check ([`CHECK_DELAY_MS`]).
pub(crate) fn check_delay() -> std::time::Duration {
    std::time::Duration::from_millis(CHECK_DELAY_MS.load(std::sync::atomic::Ordering::Relaxed))
}

/// Whether the check of `t` (an executable's tables) waits until after start:
/// its header's FDE count (a fixed-size field; anything else is checked at
/// once) is above the threshold.
pub(super) fn defer_check(t: &UnwindTables) -> bool {
    cfi_check::fde_count(&t.hdr).unwrap_or(0) > DEFER_THRESHOLD.load(std::sync::atomic::Ordering::Relaxed)
}

/// The main executable's unwind tables, awaiting the check that decides what
/// the handler may be handed. Until the writer thread has run it (between its
/// flushes: [`DeferredTables::check`]), the handler's unwinder has no module
/// for the executable and stops at its frames.
#[derive(Clone)]
pub(crate) struct DeferredTables {
    pub(super) path: Vec<u8>,
    pub(super) build_id: Vec<u8>,
    pub(super) avma: std::ops::Range<u64>,
    pub(super) bias: u64,
    pub(super) hdr: &'static [u8],
    pub(super) hdr_svma: u64,
    pub(super) eh_frame: &'static [u8],
    pub(super) eh_frame_svma: u64,
}

impl DeferredTables {
    /// The code range the handler must stop at until the check is done.
    pub(crate) fn avma(&self) -> std::ops::Range<u64> {
        self.avma.clone()
    }

    /// Run the check, calling `between` every few thousand FDEs (it returns
    /// false to give up: the module then stays without tables). The module
    /// and its table memory.
    pub(crate) fn check(
        self,
        between: &mut dyn FnMut() -> bool,
    ) -> Option<(Vec<framehop::Module<TableBytes>>, TableMemory)> {
        let tables = UnwindTables {
            hdr: Cow::Borrowed(self.hdr),
            hdr_svma: self.hdr_svma,
            eh_frame: Cow::Borrowed(self.eh_frame),
            eh_frame_svma: self.eh_frame_svma,
        };
        let mut aborted = false;
        let mut step = || {
            aborted = aborted || !between();
            !aborted
        };
        let (m, memory, _) =
            unwind_module_with(&self.path, &self.build_id, self.avma, self.bias, Some(tables), &mut step);
        (!aborted).then_some((m, memory))
    }
}

/// An object's `.eh_frame_hdr` and `.eh_frame` bytes with their stated addresses.
pub(crate) struct UnwindTables {
    pub hdr: TableBytes,
    pub hdr_svma: u64,
    pub eh_frame: TableBytes,
    pub eh_frame_svma: u64,
}

/// The unwinder's modules for an object whose code spans `avma` in memory,
/// loaded with `bias`. The handler may only see FDEs it unwinds without any
/// possible integer overflow, so the search table is rebuilt by `cfi_check`; a
/// header that cannot be rebuilt leaves the object to frame pointers. Also
/// returns where the modules' table bytes live, and the memory addresses of the
/// functions whose FDEs were left out.
///
/// A rebuilt search table is a new, owned buffer; when the check dropped no
/// FDE it equals the original, and the original bytes (borrowed or copied, as
/// `tables` holds them) are used instead. For tables read in place (the main
/// executable's) with a few dropped FDEs in an ordered table, the original
/// table is kept too, and the object becomes several modules that leave out
/// the code where a lookup would find a dropped entry (see
/// `cfi_check::Filtered::dropped_ranges`): its memory then does not depend
/// on the executable's size at all.
pub(crate) fn unwind_module(
    path: &[u8],
    build_id: &[u8],
    avma: std::ops::Range<u64>,
    bias: u64,
    tables: Option<UnwindTables>,
) -> (Vec<framehop::Module<TableBytes>>, TableMemory, Vec<u64>) {
    unwind_module_with(path, build_id, avma, bias, tables, &mut || true)
}

/// [`unwind_module`], calling `between` during the check (see
/// [`cfi_check::filter_eh_frame_hdr`]).
fn unwind_module_with(
    path: &[u8],
    build_id: &[u8],
    avma: std::ops::Range<u64>,
    bias: u64,
    tables: Option<UnwindTables>,
    between: &mut dyn FnMut() -> bool,
) -> (Vec<framehop::Module<TableBytes>>, TableMemory, Vec<u64>) {
    let text = avma.start.wrapping_sub(bias)..avma.end.wrapping_sub(bias);
    // base_svma 0: framehop adds it to 32-bit relative addresses unchecked.
    let mut info = ExplicitModuleSectionInfo::<TableBytes> { base_svma: 0, ..Default::default() };
    let mut dropped = Vec::new();
    let mut memory = TableMemory::default();
    // Stated-address ranges left out of the unwinder's modules (see below).
    let mut carved: Vec<std::ops::Range<u64>> = Vec::new();
    if let Some(t) = tables {
        // The filter mirrors framehop's x86_64 rules; elsewhere the tables are
        // handed over as they are (the no-overflow argument is x86_64's).
        let filtered = if cfg!(target_arch = "x86_64") {
            checked_tables(&t, build_id, text.start, between)
        } else {
            None
        };
        let hdr_range = t.hdr_svma..t.hdr_svma.wrapping_add(t.hdr.len() as u64);
        let borrowed = matches!((&t.hdr, &t.eh_frame), (Cow::Borrowed(_), Cow::Borrowed(_)));
        let hdr = match filtered {
            Some(f) => {
                dropped = f.dropped_starts.iter().map(|s| s.wrapping_add(bias)).collect();
                if f.dropped == 0 && f.hdr[..] == t.hdr[..] {
                    Some(t.hdr)
                } else if let Some(ranges) =
                    f.dropped_ranges.filter(|r| borrowed && !r.is_empty() && r.len() <= MAX_CARVED_RANGES)
                {
                    // Tables read in place keep their original search table
                    // rather than a rebuilt copy (8 bytes an FDE): the code
                    // where a lookup would find a dropped entry is left out
                    // of the modules instead, so the handler never looks
                    // one up (framehop unwinds code outside every module by
                    // frame pointer, with checked arithmetic).
                    carved = ranges;
                    Some(t.hdr)
                } else {
                    Some(Cow::Owned(f.hdr))
                }
            }
            None if cfg!(target_arch = "x86_64") => None,
            None => Some(t.hdr),
        };
        if let Some(hdr) = hdr {
            memory = TableMemory::of(&t.eh_frame).add(TableMemory::of(&hdr));
            let eh_end = t.eh_frame_svma.wrapping_add(t.eh_frame.len() as u64);
            info.eh_frame_svma = Some(t.eh_frame_svma..eh_end);
            info.eh_frame = Some(t.eh_frame);
            info.eh_frame_hdr_svma = Some(hdr_range);
            info.eh_frame_hdr = Some(hdr);
        }
    }
    info.text_svma = Some(text.clone());
    let name = String::from_utf8_lossy(path).into_owned();
    // The module's code minus the carved ranges, as memory ranges. Each piece
    // shares the (borrowed) section data; only the range differs.
    let mut pieces = Vec::new();
    let mut from = text.start;
    for r in carved.iter().chain(std::iter::once(&(text.end..text.end))) {
        let to = r.start.clamp(from, text.end);
        if from < to {
            pieces.push(from.wrapping_add(bias)..to.wrapping_add(bias));
        }
        from = from.max(r.end.min(text.end));
    }
    let modules =
        pieces.into_iter().map(|p| framehop::Module::new(name.clone(), p, bias, info.clone())).collect();
    (modules, memory, dropped)
}

/// Most ranges carved out of a module whose search table is read in place;
/// beyond this the table is rebuilt (each range splits the module in two).
const MAX_CARVED_RANGES: usize = 16;

/// [`cfi_check::filter_eh_frame_hdr`] on `t`, with the verdict taken from and
/// kept in the [`CfiCache`] when one is configured and the object has a build id.
fn checked_tables(
    t: &UnwindTables,
    build_id: &[u8],
    text_svma: u64,
    between: &mut dyn FnMut() -> bool,
) -> Option<cfi_check::Filtered> {
    static CACHE: std::sync::OnceLock<Option<CfiCache>> = std::sync::OnceLock::new();
    let mut filter = |known: Option<&[u32]>| {
        cfi_check::filter_eh_frame_hdr(
            &t.hdr,
            t.hdr_svma,
            &t.eh_frame,
            t.eh_frame_svma,
            text_svma,
            known,
            &mut *between,
        )
    };
    let cached = CACHE.get_or_init(CfiCache::from_env).as_ref().and_then(|cache| {
        let key = cfi_cache::Key::new(build_id, &t.hdr, t.hdr_svma, &t.eh_frame, t.eh_frame_svma, text_svma)?;
        Some((cache, key))
    });
    let Some((cache, key)) = cached else { return filter(None) };
    if let Some(known) = cache.load(&key) {
        if let Some(f) = filter(Some(&known)) {
            return Some(f);
        }
    }
    let f = filter(None)?;
    cache.store(&key, &f.dropped_entries);
    Some(f)
}

/// Build the first snapshot from a scan.
pub(crate) fn initial_snapshot(objects: &[LoadedObject], generation: u64) -> UnwindSnapshot {
    let mut unwinder = NativeUnwinder::default();
    for u in objects.iter().flat_map(|o| &o.unwind) {
        unwinder.add_module(u.clone());
    }
    unwinder.pending = objects.iter().find_map(|o| o.deferred.as_ref()).map(DeferredTables::avma);
    UnwindSnapshot { generation, unwinder }
}

/// `prev` with the checked module of the deferred object added, and nothing
/// pending: same modules, same generation.
pub(crate) fn checked_snapshot(
    prev: &UnwindSnapshot,
    modules: Vec<framehop::Module<TableBytes>>,
) -> UnwindSnapshot {
    let mut unwinder = prev.unwinder.clone();
    for m in modules {
        unwinder.add_module(m);
    }
    unwinder.pending = None;
    UnwindSnapshot { generation: prev.generation, unwinder }
}

/// The next snapshot: `prev` minus objects starting at `removed`, plus `added`.
pub(crate) fn next_snapshot(
    prev: &UnwindSnapshot,
    removed: &[u64],
    added: &[&LoadedObject],
    generation: u64,
) -> UnwindSnapshot {
    let mut unwinder = prev.unwinder.clone();
    for &start in removed {
        unwinder.frames.remove_module(start);
    }
    for u in added.iter().flat_map(|o| &o.unwind) {
        unwinder.add_module(u.clone());
    }
    UnwindSnapshot { generation, unwinder }
}
