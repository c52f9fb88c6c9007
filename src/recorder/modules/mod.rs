//! The process's loaded objects: enumeration through `dl_iterate_phdr`, the
//! writer's generation-aware module table, and the immutable unwinder snapshots
//! the signal handler reads.
//!
//! Enumeration walks the loader's list itself (rather than through `findshlibs`)
//! because a spool module needs the executable segment's `p_offset`, which
//! `findshlibs` 0.10 does not expose, and because one walk must see one
//! consistent list: names, build ids (`NT_GNU_BUILD_ID` notes), executable
//! `PT_LOAD` segments and the `.eh_frame_hdr`/`.eh_frame` bytes are all read in the
//! same callback, while the loader lock keeps every object mapped. A library's
//! unwind data is copied into owned vectors, so a later `dlclose` cannot pull it
//! away from the handler. The main executable's is not copied: the handler's
//! unwinder reads its `.eh_frame` (and its `.eh_frame_hdr`, unless the search
//! table had to be rebuilt) where the program is mapped, since that mapping
//! lasts, read-only, for the life of the process (see [`TableBytes`]). For a
//! large program that is most of the unwind data: the recorder's memory does
//! not grow with the size of the executable's tables. None of this code runs
//! in the signal handler.
//!
//! Replacing the handler's view of modules without a lock: the writer builds a new
//! [`UnwindSnapshot`] (clone of the previous unwinder, modules removed and added,
//! generation + 1) and swaps it into an `AtomicPtr` (`handler::SnapshotCell::replace`).
//! A handler loads the pointer once per sample, after incrementing the global
//! in-handler counter, and stamps the sample with the snapshot's generation. The
//! old snapshot is freed only once the writer has observed the in-handler counter
//! at zero after the swap (every handler that could have loaded it has returned);
//! until then it waits on a retired list. Nobody ever waits on anybody.

use std::borrow::Cow;
use std::ffi::CStr;
use std::os::raw::{c_int, c_void};

mod cfi_cache;
pub(super) mod cfi_check;

use cfi_cache::CfiCache;
use framehop::{ExplicitModuleSectionInfo, MustNotAllocateDuringUnwind, Unwinder as _};

/// Bytes of an unwind table as the handler's unwinder holds them: a copy
/// (`Owned`), or the object's own mapped bytes (`Borrowed`), only for an object
/// that stays mapped and unchanged for the life of the process: the main
/// executable, in a segment without write permission.
///
/// Libraries are always copied. glibc never unloads the libraries loaded before
/// `main` (only objects that `dlopen` loaded can be unloaded), but no public
/// interface tells such a library from one a plugin loader opened (which may be
/// closed at any time); pinning every library (`RTLD_NODELETE`) would change
/// what `dlclose` does for the program, so libraries keep their copies.
pub(crate) type TableBytes = Cow<'static, [u8]>;

/// The unwinder the handler uses: framehop's, and the code range of an object
/// whose tables are still being checked (the main executable's, when they are
/// large: see [`DeferredTables`]). The handler stops a walk at a frame in that
/// range (the stack is then marked truncated) rather than let framehop guess
/// that frame's caller by frame pointer.
#[derive(Clone, Default)]
pub(crate) struct NativeUnwinder {
    pub frames: framehop::UnwinderNative<TableBytes, MustNotAllocateDuringUnwind>,
    pub pending: Option<std::ops::Range<u64>>,
}

impl NativeUnwinder {
    pub(crate) fn add_module(&mut self, m: framehop::Module<TableBytes>) {
        self.frames.add_module(m);
    }
}
/// The unwinder cache type (one per concurrent unwind).
pub(crate) type NativeCache = framehop::CacheNative<MustNotAllocateDuringUnwind>;

/// An immutable view of the modules, as published to the handler.
pub(crate) struct UnwindSnapshot {
    /// The module-table generation this snapshot describes.
    pub generation: u64,
    /// The unwinder with every module of that generation.
    pub unwinder: NativeUnwinder,
}

/// One executable `PT_LOAD` segment of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExecSegment {
    pub avma: u64,
    pub size: u64,
    pub file_offset: u64,
}

/// Identity of a loaded object across scans.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ObjectKey {
    pub bias: u64,
    pub path: Vec<u8>,
    pub first_exec: u64,
}

/// A loaded object found by a scan.
#[derive(Clone)]
pub(crate) struct LoadedObject {
    pub key: ObjectKey,
    pub build_id: Vec<u8>,
    pub segments: Vec<ExecSegment>,
    /// The unwinder's modules: usually one; several when parts of the code are
    /// left out (see [`unwind_module`]); none for objects the caller already
    /// knows (their data is not read again) and for deferred ones.
    pub unwind: Vec<framehop::Module<TableBytes>>,
    /// Where the handler's unwinder reads this object's tables from (zero for
    /// objects the caller already knew, and for deferred ones until checked).
    pub table_memory: TableMemory,
    /// The tables left to check after start (then `unwind` is empty).
    pub deferred: Option<DeferredTables>,
    /// Start addresses (in memory) of the functions whose unwind entries were
    /// left out of the handler's search table (see `cfi_check`).
    #[cfg_attr(not(test), allow(dead_code))]
    pub unwind_dropped: Vec<u64>,
}

/// An object's unwind-table bytes, by where the handler's unwinder reads them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct TableMemory {
    /// Bytes copied into the recorder's memory (libraries' tables, and a
    /// rebuilt search table).
    pub copied: u64,
    /// Bytes read where the object is mapped (the main executable's).
    pub borrowed: u64,
}

impl TableMemory {
    fn of(bytes: &TableBytes) -> TableMemory {
        let n = bytes.len() as u64;
        match bytes {
            Cow::Owned(_) => TableMemory { copied: n, borrowed: 0 },
            Cow::Borrowed(_) => TableMemory { copied: 0, borrowed: n },
        }
    }

    pub(crate) fn add(self, o: TableMemory) -> TableMemory {
        TableMemory { copied: self.copied + o.copied, borrowed: self.borrowed + o.borrowed }
    }
}

const PT_LOAD: u32 = 1;
const PF_W: u32 = 2;
const PT_NOTE: u32 = 4;
const PT_GNU_EH_FRAME: u32 = 0x6474_e550;
const PF_X: u32 = 1;
const NT_GNU_BUILD_ID: u32 = 3;

struct ScanState<'a> {
    exe_path: &'a [u8],
    /// The program headers of the object `exec` mapped (`AT_PHDR`).
    main_phdr: u64,
    defer: bool,
    known: &'a dyn Fn(&ObjectKey) -> bool,
    out: Vec<LoadedObject>,
}

/// Loader counters (`dlpi_adds`, `dlpi_subs`): they change whenever an object is
/// loaded or unloaded, so the writer rescans only then.
pub(crate) fn dl_counters() -> (u64, u64) {
    unsafe extern "C" fn first(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
        // SAFETY: `data` is the `&mut (u64, u64)` passed below and `info` is valid
        // for the duration of the callback (dl_iterate_phdr's contract).
        unsafe {
            let out = &mut *(data as *mut (u64, u64));
            *out = ((*info).dlpi_adds, (*info).dlpi_subs);
        }
        1
    }
    let mut counters = (0u64, 0u64);
    // SAFETY: the callback only writes through the pointer we pass, which outlives
    // the call; returning 1 stops the walk after the first object.
    unsafe { libc::dl_iterate_phdr(Some(first), &mut counters as *mut (u64, u64) as *mut c_void) };
    counters
}

/// Every loaded object with at least one executable segment. Objects for which
/// `known` returns true are listed by key and segments only. With `defer`, the
/// check of a large main executable's tables is left to the caller (its object
/// carries them in `deferred`; see [`DeferredTables`]).
pub(crate) fn scan(exe_path: &[u8], known: &dyn Fn(&ObjectKey) -> bool, defer: bool) -> Vec<LoadedObject> {
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
        // `data` is the `&mut ScanState` passed by `scan`; `info` and the program
        // headers it points to are valid during the callback, and the loader lock
        // held by dl_iterate_phdr keeps the object mapped while we copy from it.
        // A panic must not unwind into C: catch it and skip the object.
        // SAFETY: the pointers are valid for the callback's duration (see above).
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
            let st = &mut *(data as *mut ScanState<'_>);
            let info = &*info;
            let phdrs: &[libc::Elf64_Phdr] = if info.dlpi_phdr.is_null() || info.dlpi_phnum == 0 {
                &[]
            } else {
                std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize)
            };
            let name =
                if info.dlpi_name.is_null() { &[][..] } else { CStr::from_ptr(info.dlpi_name).to_bytes() };
            let main = st.main_phdr != 0 && info.dlpi_phdr as usize as u64 == st.main_phdr;
            if let Some(obj) = read_object(info.dlpi_addr, name, phdrs, main, st.defer, st.exe_path, st.known)
            {
                st.out.push(obj);
            }
        }));
        let _ = res;
        0
    }
    // SAFETY: getauxval only reads the auxiliary vector; 0 when absent.
    let main_phdr = unsafe { libc::getauxval(libc::AT_PHDR) };
    let mut st = ScanState { exe_path, main_phdr, defer, known, out: Vec::new() };
    // SAFETY: the callback only uses the state we pass, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), &mut st as *mut ScanState<'_> as *mut c_void) };
    st.out
}

/// Whether `[vaddr, vaddr + len)` (stated addresses) lies inside one `PT_LOAD`.
fn in_load(phdrs: &[libc::Elf64_Phdr], vaddr: u64, len: u64) -> Option<&libc::Elf64_Phdr> {
    let end = vaddr.checked_add(len)?;
    phdrs
        .iter()
        .find(|p| p.p_type == PT_LOAD && p.p_vaddr <= vaddr && end <= p.p_vaddr.saturating_add(p.p_memsz))
}

/// Copy `len` bytes of the object at stated address `vaddr`.
///
/// # Safety
/// Must be called inside a dl_iterate_phdr callback for the object with load bias
/// `bias`, and `[vaddr, vaddr+len)` must lie inside one of its `PT_LOAD` segments
/// (checked by the callers with [`in_load`]): then the bytes are mapped and
/// readable (every loadable segment is at least readable on Linux/glibc except
/// execute-only text, which holds no notes or unwind tables).
unsafe fn copy_mapped(bias: u64, vaddr: u64, len: u64) -> Vec<u8> {
    let p = bias.wrapping_add(vaddr) as *const u8;
    // SAFETY: guaranteed by the caller (see above).
    unsafe { std::slice::from_raw_parts(p, len as usize) }.to_vec()
}

/// `len` bytes of the object at stated address `vaddr`, borrowed where they
/// are mapped if the object is `permanent` and `load` (the `PT_LOAD` that holds
/// them) is not writable, copied otherwise.
///
/// # Safety
/// As for [`copy_mapped`], with `load` the segment that holds the bytes; and
/// `permanent` only for the object that `exec` mapped (the main program).
unsafe fn table_bytes(
    bias: u64,
    vaddr: u64,
    len: u64,
    load: &libc::Elf64_Phdr,
    permanent: bool,
) -> TableBytes {
    if !permanent || load.p_flags & PF_W != 0 {
        // SAFETY: guaranteed by the caller.
        return Cow::Owned(unsafe { copy_mapped(bias, vaddr, len) });
    }
    let p = bias.wrapping_add(vaddr) as *const u8;
    // The program `exec` mapped is never unloaded (the loader unloads only what
    // `dlopen` loaded), and its segment has no write permission: nothing writes there.
    // SAFETY: so the bytes, mapped and readable now (the caller's contract, as for
    // `copy_mapped`), stay so unchanged for the process's life: a `'static` borrow holds.
    Cow::Borrowed(unsafe { std::slice::from_raw_parts(p, len as usize) })
}

/// Read one object.
///
/// # Safety
/// As for [`copy_mapped`]: only inside the dl_iterate_phdr callback for this object.
unsafe fn read_object(
    bias: u64,
    name: &[u8],
    phdrs: &[libc::Elf64_Phdr],
    main: bool,
    defer: bool,
    exe: &[u8],
    known: &dyn Fn(&ObjectKey) -> bool,
) -> Option<LoadedObject> {
    let segments: Vec<ExecSegment> = phdrs
        .iter()
        .filter(|p| p.p_type == PT_LOAD && p.p_flags & PF_X != 0 && p.p_memsz > 0)
        .map(|p| ExecSegment { avma: bias.wrapping_add(p.p_vaddr), size: p.p_memsz, file_offset: p.p_offset })
        .collect();
    let first = segments.first()?.avma;
    let path = if name.is_empty() { exe.to_vec() } else { name.to_vec() };
    let key = ObjectKey { bias, path, first_exec: first };
    if known(&key) {
        return Some(LoadedObject {
            key,
            build_id: Vec::new(),
            segments,
            unwind: Vec::new(),
            table_memory: TableMemory::default(),
            deferred: None,
            unwind_dropped: Vec::new(),
        });
    }

    // Build id from the PT_NOTE segments.
    let mut build_id = Vec::new();
    for p in phdrs.iter().filter(|p| p.p_type == PT_NOTE) {
        if in_load(phdrs, p.p_vaddr, p.p_memsz).is_none() || p.p_memsz > 1 << 20 {
            continue;
        }
        // SAFETY: the note segment lies inside a PT_LOAD (checked above).
        let notes = unsafe { copy_mapped(bias, p.p_vaddr, p.p_memsz) };
        if let Some(id) = find_build_id(&notes) {
            build_id = id;
            break;
        }
    }

    // Unwind tables: .eh_frame_hdr from PT_GNU_EH_FRAME, .eh_frame from its pointer.
    let lo = segments.iter().map(|s| s.avma).min()?;
    let hi = segments.iter().map(|s| s.avma + s.size).max()?;
    let mut tables = None;
    if let Some(h) = phdrs.iter().find(|p| p.p_type == PT_GNU_EH_FRAME) {
        if let Some(hdr_load) = in_load(phdrs, h.p_vaddr, h.p_memsz).filter(|_| h.p_memsz >= 8) {
            // SAFETY: inside a PT_LOAD (checked above); `main` only for the
            // object exec mapped.
            let hdr = unsafe { table_bytes(bias, h.p_vaddr, h.p_memsz, hdr_load, main) };
            if let Some(eh_svma) = eh_frame_address(&hdr, h.p_vaddr) {
                if let Some(load) = in_load(phdrs, eh_svma, 1) {
                    let end = load.p_vaddr + load.p_memsz;
                    let len = end - eh_svma;
                    // SAFETY: [eh_svma, end) is the tail of one PT_LOAD.
                    let eh = unsafe { table_bytes(bias, eh_svma, len, load, main) };
                    tables =
                        Some(UnwindTables { hdr, hdr_svma: h.p_vaddr, eh_frame: eh, eh_frame_svma: eh_svma });
                }
            }
        }
    }
    if let Some(t) = tables.as_ref().filter(|t| main && defer && defer_check(t)) {
        if let (Cow::Borrowed(hdr), Cow::Borrowed(eh_frame)) = (&t.hdr, &t.eh_frame) {
            let deferred = DeferredTables {
                path: key.path.clone(),
                build_id: build_id.clone(),
                avma: lo..hi,
                bias,
                hdr,
                hdr_svma: t.hdr_svma,
                eh_frame,
                eh_frame_svma: t.eh_frame_svma,
            };
            return Some(LoadedObject {
                key,
                build_id,
                segments,
                unwind: Vec::new(),
                table_memory: TableMemory::default(),
                deferred: Some(deferred),
                unwind_dropped: Vec::new(),
            });
        }
    }
    let (unwind, table_memory, unwind_dropped) = unwind_module(&key.path, &build_id, lo..hi, bias, tables);
    Some(LoadedObject { key, build_id, segments, unwind, table_memory, deferred: None, unwind_dropped })
}

/// Search-table entries (FDEs) above which the main executable's tables are
/// checked after `start` returns rather than before: the check parses every
/// FDE (0.3-0.6 us each here), so this keeps it to one or two milliseconds of
/// the start, and small programs (a few thousand FDEs) get whole stacks from
/// their first sample.
pub(crate) const DEFER_MIN_FDES: u64 = 4096;

static DEFER_THRESHOLD: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(DEFER_MIN_FDES);

/// Whether the check of `t` (an executable's tables) waits until after start:
/// its header's FDE count (a fixed-size field; anything else is checked at
/// once) is above the threshold.
fn defer_check(t: &UnwindTables) -> bool {
    cfi_check::fde_count(&t.hdr).unwrap_or(0) > DEFER_THRESHOLD.load(std::sync::atomic::Ordering::Relaxed)
}

/// The main executable's unwind tables, awaiting the check that decides what
/// the handler may be handed. Until the writer thread has run it (between its
/// flushes: [`DeferredTables::check`]), the handler's unwinder has no module
/// for the executable and stops at its frames.
#[derive(Clone)]
pub(crate) struct DeferredTables {
    path: Vec<u8>,
    build_id: Vec<u8>,
    avma: std::ops::Range<u64>,
    bias: u64,
    hdr: &'static [u8],
    hdr_svma: u64,
    eh_frame: &'static [u8],
    eh_frame_svma: u64,
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

/// The GNU build id in a block of ELF notes.
fn find_build_id(mut d: &[u8]) -> Option<Vec<u8>> {
    let rd =
        |b: &[u8], i: usize| -> Option<u32> { Some(u32::from_ne_bytes(b.get(i..i + 4)?.try_into().ok()?)) };
    let align4 = |n: usize| (n + 3) & !3;
    while d.len() >= 12 {
        let namesz = rd(d, 0)? as usize;
        let descsz = rd(d, 4)? as usize;
        let typ = rd(d, 8)?;
        let name_end = 12usize.checked_add(align4(namesz))?;
        let desc_end = name_end.checked_add(align4(descsz))?;
        if d.len() < name_end + descsz {
            return None;
        }
        if typ == NT_GNU_BUILD_ID && &d[12..12 + namesz] == b"GNU\0" {
            return Some(d[name_end..name_end + descsz].to_vec());
        }
        d = d.get(desc_end..)?;
    }
    None
}

/// The stated address of `.eh_frame`, decoded from an `.eh_frame_hdr` found at
/// stated address `hdr_svma`.
fn eh_frame_address(hdr: &[u8], hdr_svma: u64) -> Option<u64> {
    if hdr.first() != Some(&1) {
        return None;
    }
    let enc = *hdr.get(1)?;
    let field = hdr_svma + 4;
    let raw: i64 = match enc & 0x0f {
        0x00 | 0x04 | 0x0c => i64::from_ne_bytes(hdr.get(4..12)?.try_into().ok()?),
        0x03 => u32::from_ne_bytes(hdr.get(4..8)?.try_into().ok()?) as i64,
        0x0b => i32::from_ne_bytes(hdr.get(4..8)?.try_into().ok()?) as i64,
        _ => return None,
    };
    match enc & 0x70 {
        0x00 => Some(raw as u64),
        0x10 => Some(field.wrapping_add(raw as u64)),
        0x30 => Some(hdr_svma.wrapping_add(raw as u64)),
        _ => None,
    }
}

/// One spool module as the writer tracks it.
#[derive(Debug, Clone)]
pub(crate) struct ModuleEntry {
    pub id: crate::ModuleId,
    pub key: ObjectKey,
    /// The object's GNU build id (defined again in each new segment).
    pub build_id: Vec<u8>,
    pub seg: ExecSegment,
    pub gen_added: u64,
    /// Generation in which the object disappeared.
    pub gen_removed: Option<u64>,
    /// Whether the spool already holds its deactivation record.
    pub retired: bool,
}

/// The writer's generation-aware module table.
#[derive(Default)]
pub(crate) struct ModuleTable {
    pub entries: Vec<ModuleEntry>,
    /// Every entry (retired ones too), sorted by start, rebuilt per change.
    by_start: Vec<usize>,
}

impl ModuleTable {
    /// Resolve an address sampled under generation `gen`: the module mapped there
    /// at that generation, or `None` if it is retired already (the caller then
    /// writes an absolute frame). If no module of that generation covers the
    /// address, the sample ran in code loaded after the handler's snapshot was
    /// published: the first later generation's module there is the one.
    pub(crate) fn resolve(&self, addr: u64, gen: u64) -> Option<&ModuleEntry> {
        let i = self.by_start.partition_point(|&e| self.entries[e].seg.avma <= addr);
        let mut later: Option<&ModuleEntry> = None;
        for e in self.by_start[..i].iter().rev().map(|&e| &self.entries[e]) {
            if addr >= e.seg.avma + e.seg.size {
                continue;
            }
            if e.gen_added <= gen && e.gen_removed.map_or(true, |r| gen < r) {
                return (!e.retired).then_some(e);
            }
            if e.gen_added > gen && !e.retired && later.map_or(true, |l| e.gen_added < l.gen_added) {
                later = Some(e);
            }
        }
        later
    }

    /// Add an entry (already written to the spool).
    pub(crate) fn push(&mut self, e: ModuleEntry) {
        self.entries.push(e);
        self.reindex();
    }

    fn reindex(&mut self) {
        let mut v: Vec<usize> = (0..self.entries.len()).collect();
        v.sort_by_key(|&i| self.entries[i].seg.avma);
        self.by_start = v;
    }

    /// Mark an entry retired (its deactivation record was written).
    pub(crate) fn retire(&mut self, idx: usize) {
        self.entries[idx].retired = true;
        self.reindex();
    }
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

/// With the `testing` feature (not a stable API): where the handler's unwinder
/// would read each loaded object's unwind tables if a recorder started now.
#[cfg(feature = "testing")]
pub mod table_report {
    /// One loaded object's unwind tables.
    #[derive(Debug, Clone)]
    pub struct ObjectTables {
        /// The object's path (the executable's as `/proc/self/exe` names it).
        pub path: Vec<u8>,
        /// Its executable segments in memory: `(start, size)`.
        pub exec_segments: Vec<(u64, u64)>,
        /// Table bytes copied into the recorder's memory.
        pub copied: u64,
        /// Table bytes read where they are mapped.
        pub mapped: u64,
    }

    /// Set the number of FDEs above which a recorder checks the executable's
    /// unwind tables after `start` returns (default [`DEFAULT_DEFER_MIN_FDES`]);
    /// returns the previous value.
    pub fn set_defer_threshold(fdes: u64) -> u64 {
        super::DEFER_THRESHOLD.swap(fdes, std::sync::atomic::Ordering::Relaxed)
    }

    /// The default of [`set_defer_threshold`].
    pub const DEFAULT_DEFER_MIN_FDES: u64 = super::DEFER_MIN_FDES;

    /// Scan this process's objects as `start` does.
    pub fn scan() -> Vec<ObjectTables> {
        use std::os::unix::ffi::OsStringExt;
        let exe =
            std::fs::read_link("/proc/self/exe").map(|p| p.into_os_string().into_vec()).unwrap_or_default();
        super::scan(&exe, &|_| false, true)
            .into_iter()
            .map(|o| ObjectTables {
                path: o.key.path,
                exec_segments: o.segments.iter().map(|s| (s.avma, s.size)).collect(),
                copied: o.table_memory.copied,
                mapped: o.table_memory.borrowed,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u32, start: u64, added: u64, removed: Option<u64>, retired: bool) -> ModuleEntry {
        ModuleEntry {
            id: crate::ModuleId(id),
            key: ObjectKey { bias: start, path: format!("lib{id}").into_bytes(), first_exec: start },
            build_id: Vec::new(),
            seg: ExecSegment { avma: start, size: 0x1000, file_offset: 0x1000 },
            gen_added: added,
            gen_removed: removed,
            retired,
        }
    }

    #[test]
    fn resolve_by_generation() {
        let mut t = ModuleTable::default();
        t.push(entry(0, 0x10000, 0, None, false)); // the executable
        t.push(entry(1, 0x40000, 1, Some(3), false)); // alpha, gone in generation 3
        t.push(entry(2, 0x40000, 3, None, false)); // beta at the same address
        let id = |e: Option<&ModuleEntry>| e.map(|e| e.id.get());
        assert_eq!(id(t.resolve(0x10010, 0)), Some(0));
        assert_eq!(id(t.resolve(0x40010, 1)), Some(1));
        assert_eq!(id(t.resolve(0x40010, 2)), Some(1));
        assert_eq!(id(t.resolve(0x40010, 3)), Some(2));
        // Sampled with generation 0, before alpha was known: the first later
        // generation's module there.
        assert_eq!(id(t.resolve(0x40010, 0)), Some(1));
        assert_eq!(id(t.resolve(0x41000, 3)), None, "one past the end");
        assert_eq!(id(t.resolve(0x5000, 3)), None);
        // Once alpha is retired, its generation's samples get absolute frames,
        // never beta's module.
        t.retire(1);
        assert_eq!(id(t.resolve(0x40010, 2)), None);
        assert_eq!(id(t.resolve(0x40010, 3)), Some(2));
    }

    #[test]
    fn scan_finds_executable_and_libc() {
        let objs = scan(b"/proc/self/exe", &|_| false, false);
        assert!(objs.iter().any(|o| o.key.path == b"/proc/self/exe"), "executable missing");
        assert!(objs.iter().any(|o| String::from_utf8_lossy(&o.key.path).contains("libc")), "libc missing");
        let exe = objs.iter().find(|o| o.key.path == b"/proc/self/exe").unwrap();
        assert!(!exe.build_id.is_empty(), "rustc links a GNU build id");
        let pc = scan_finds_executable_and_libc as *const () as usize as u64;
        assert!(exe.segments.iter().any(|s| s.avma <= pc && pc < s.avma + s.size));
        let (a, _) = dl_counters();
        assert!(a >= objs.len() as u64);
    }

    /// The executable's `.eh_frame` is read where it is mapped, never copied;
    /// libraries' tables are copied.
    #[test]
    fn executable_tables_are_borrowed_and_libraries_copied() {
        let objs = scan(b"/proc/self/exe", &|_| false, false);
        let exe = objs.iter().find(|o| o.key.path == b"/proc/self/exe").unwrap();
        assert!(!exe.unwind.is_empty(), "the test executable has unwind tables");
        assert!(exe.table_memory.borrowed > 0, "{:?}", exe.table_memory);
        let libc = objs.iter().find(|o| String::from_utf8_lossy(&o.key.path).contains("libc.so")).unwrap();
        assert_eq!(libc.table_memory.borrowed, 0);
        assert!(libc.table_memory.copied > 0);
        // The unwinder finds the executable's functions through the borrowed tables.
        let pc = executable_tables_are_borrowed_and_libraries_copied as *const () as usize as u64;
        assert!(exe.unwind.iter().any(|m| m.avma_range().contains(&pc)));
    }
}
