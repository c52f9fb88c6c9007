//! Symbolization of spool frames (cargo feature `pprof`): offline in the
//! `spulse` tool, in process behind `spulse::http`.
//!
//! Module frames are resolved from the module files named in the spool (or a
//! separate debug file found by build id or debug link), with `addr2line` over
//! DWARF (inlined frames expanded, split DWARF read from a `.dwp` beside the
//! file or from the `.dwo` files its units name) and the ELF symbol table as a
//! fallback, names demangled (see [`demangle`]). A candidate file is used only
//! when its GNU build id equals the one recorded in the spool; a module with no
//! usable file is shown as `name+0xoffset`, never with a guessed name.
//!
//! Paths, build ids and sizes in a spool are untrusted. Every file the
//! symbolizer reads (module files, debug files, `.dwp`, `.dwo`, perf maps) is
//! opened with `O_NONBLOCK | O_CLOEXEC | O_NOCTTY`, checked with `fstat` on the
//! opened descriptor to be a regular file, and mapped only when at most
//! [`MAX_FILE_BYTES`] long; a FIFO or device is never waited on, and there is
//! no window between the check and the open. Decompressed debug sections of
//! one file are capped at [`MAX_DECOMPRESSED_BYTES`] together. A file is
//! parsed once per (device, inode) whatever path spells it, and a module's
//! symbols are loaded once per build id; each frame is resolved once.
//!
//! Absolute frames (anonymous executable memory) are named from
//! `/tmp/perf-<pid>.map` when that file exists, is a regular file (not a
//! symlink) and belongs to the user running the tool; when the spool records
//! Python-runtime intervals for the process, only samples inside them use the
//! map (see [`Context`]).

use std::borrow::Cow;
use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::ops::Deref;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;

use addr2line::gimli;
use addr2line::LookupContinuation;
use gimli::Reader as _;
use object::{Object, ObjectSection, ObjectSegment};

use crate::{Definitions, Frame, FrameId, Module, ThreadId};

mod demangle;
mod dwarf;
mod file;
mod perf_map;
mod plt;

pub use demangle::demangle;
pub use dwarf::ModuleSymbols;
use dwarf::*;
pub use file::Bytes;
use file::*;
use perf_map::*;

/// What a stack's symbolization depends on besides the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Context {
    /// The thread, for per-thread outputs; `None` otherwise.
    pub thread: Option<ThreadId>,
    /// The sampled process.
    pub pid: u32,
    /// Whether absolute frames may be named from the process's perf map
    /// (`/tmp/perf-<pid>.map`). Where a spool records Python-runtime
    /// intervals, perf-map names are only trusted inside them, since CPython's
    /// trampolines are unmapped and their addresses reused outside them.
    pub perf_map_allowed: bool,
}

/// The largest file the symbolizer maps (module, debug, `.dwp` or `.dwo`
/// file); a larger one is treated as missing.
pub const MAX_FILE_BYTES: u64 = 4 << 30;

/// The most decompressed debug-section data the symbolizer allocates for one
/// file; a file whose compressed sections declare more is read without them.
pub const MAX_DECOMPRESSED_BYTES: u64 = 2 << 30;

/// The largest perf map read (`/tmp/perf-<pid>.map`); the rest is ignored.
pub const MAX_PERF_MAP_BYTES: u64 = 256 << 20;

/// The most lines of one perf map kept (the rest are ignored): its index
/// then takes about 130 MB at most (about 32 bytes a line), its names at most
/// what was read.
pub const MAX_PERF_MAP_LINES: usize = 4 << 20;

/// One function as shown to the user.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Function {
    /// Demangled name, or `module+0xoffset` / an address when unresolved.
    pub name: String,
    /// Module (file name without directories), `[kernel]`, `[unknown]`, or the
    /// perf map the name came from.
    pub module: String,
}

/// One (possibly inlined) function at a frame's address.
#[derive(Debug, Clone)]
pub struct SymFrame {
    /// Index into [`Symbolizer::functions`].
    pub func: u32,
    /// The linkage (mangled) name the function was found under, when the
    /// debug info or symbol table gives one.
    pub linkage: Option<Rc<str>>,
    /// Source file, when the debug info gives one.
    pub file: Option<Rc<str>>,
    /// Source line (0 when unknown).
    pub line: u32,
}

/// What a frame resolved to.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The functions at the address, innermost (inlined callee) first and the
    /// function that contains the code last. Never empty.
    pub frames: Vec<SymFrame>,
    /// Whether a name came from symbols (false for `module+0xoffset` and raw
    /// addresses).
    pub named: bool,
}

impl Resolved {
    /// The function that contains the code (the last, outermost frame).
    pub fn outer(&self) -> &SymFrame {
        self.frames.last().expect("resolved frames are never empty")
    }
}

/// Where to look for symbols.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Extra places: directories holding debug files, by base name or in a
    /// `.build-id/xx/rest.debug` tree.
    pub dirs: Vec<PathBuf>,
    /// Do not read any file: every module frame becomes `name+0xoffset`.
    pub disabled: bool,
}

/// A module file's identity in the spool: (path, build id).
type FileKey = (Vec<u8>, Vec<u8>);

/// Resolves frames to functions, caching every file and frame.
pub struct Symbolizer {
    options: Options,
    functions: Vec<Function>,
    function_ids: HashMap<Function, u32>,
    /// Results by the spool's (path, build id).
    files: HashMap<FileKey, Option<Rc<ModuleSymbols>>>,
    /// Successful loads by (build id, file offset, size): one build id names
    /// one file content, whatever path the spool spells it with.
    by_build_id: HashMap<(Vec<u8>, u64, u64), Rc<ModuleSymbols>>,
    /// Parsed files by (device, inode); `None` for a file that is not an object file.
    parsed: HashMap<(u64, u64), Option<Rc<Parsed>>>,
    /// Per module id.
    modules: Vec<Option<Option<Rc<ModuleSymbols>>>>,
    module_frames: Vec<Option<Rc<Resolved>>>,
    other_frames: HashMap<(FrameId, u32, bool), Rc<Resolved>>,
    perf_maps: HashMap<u32, Option<PerfMap>>,
    /// A copy of this process's own vDSO, parsed (read on first need).
    vdso: OnceCell<Option<Rc<Parsed>>>,
    files_loaded: usize,
    lookups: u64,
}

/// Whether a function (by its demangled name) belongs to the allocation
/// path rather than to the code that allocated: `spulse::heap`'s own, the
/// global allocator's shims, `alloc::alloc` and `GlobalAlloc`. Heap
/// profiles and the heap events' stacks in exports cut such frames off the
/// leaf end of an allocation's stack.
pub fn is_allocator_frame(name: &str) -> bool {
    let name = name.trim_start_matches('<');
    let name = name.strip_prefix("__rustc::").unwrap_or(name);
    name.starts_with("spulse::heap::")
        || name.starts_with("__rust_alloc")
        || name.starts_with("__rust_realloc")
        || name.starts_with("__rust_alloc_zeroed")
        || name.starts_with("__rg_")
        || name.starts_with("__rdl_")
        || name.starts_with("alloc::alloc::")
        || name.starts_with("std::alloc::")
        || name.starts_with("core::alloc::global::")
}

/// The file name of a module path (or the whole path if it has no `/`).
pub fn module_name(m: &Module) -> String {
    let name = m.path.rsplit(|&b| b == b'/').next().unwrap_or(&m.path);
    if name.is_empty() {
        format!("module{}", m.id)
    } else {
        String::from_utf8_lossy(name).into_owned()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Symbolizer {
    /// A symbolizer with the given search options.
    pub fn new(options: Options) -> Symbolizer {
        Symbolizer {
            options,
            functions: Vec::new(),
            function_ids: HashMap::new(),
            files: HashMap::new(),
            by_build_id: HashMap::new(),
            parsed: HashMap::new(),
            modules: Vec::new(),
            module_frames: Vec::new(),
            other_frames: HashMap::new(),
            perf_maps: HashMap::new(),
            vdso: OnceCell::new(),
            files_loaded: 0,
            lookups: 0,
        }
    }

    /// Every function seen so far, by id.
    pub fn functions(&self) -> &[Function] {
        &self.functions
    }

    /// One function.
    pub fn function(&self, id: u32) -> &Function {
        &self.functions[id as usize]
    }

    /// Forget every resolved frame but keep the loaded module files (so the
    /// next resolutions measure lookups against warm, parsed modules).
    pub fn clear_frame_cache(&mut self) {
        self.module_frames.clear();
        self.other_frames.clear();
    }

    /// Get ready for frames of another spool (module and frame ids are per
    /// spool): forget everything indexed by them and the perf maps (which
    /// grow while the process runs), keep every parsed file and loaded symbol
    /// table (found again by path and build id). A long-lived in-process
    /// symbolizer calls this between profiles.
    pub fn next_spool(&mut self) {
        self.modules.clear();
        self.module_frames.clear();
        self.other_frames.clear();
        self.perf_maps.clear();
    }

    /// Re-read perf maps on next use (a JIT appends to its map while it runs):
    /// forgets the maps and every absolute frame resolved from them.
    pub fn refresh_perf_maps(&mut self) {
        self.perf_maps.clear();
        self.other_frames.clear();
    }

    /// How many files had their debug data (DWARF and symbol table) loaded.
    pub fn files_loaded(&self) -> usize {
        self.files_loaded
    }

    /// How many times [`Symbolizer::resolve`] was called (cached or not): the
    /// work measure of the reports, which look each distinct stack node up once.
    pub fn lookups(&self) -> u64 {
        self.lookups
    }

    /// How many distinct files (by device and inode) were opened and parsed.
    pub fn files_parsed(&self) -> usize {
        self.parsed.len()
    }

    /// The id of the function with this name and module, added if new: for
    /// frames a view makes up itself (a thread's root frame, the one row of a
    /// module's unsymbolized code), shown and counted like any other function.
    pub fn function_id(&mut self, name: String, module: String) -> u32 {
        self.intern(Function { name, module })
    }

    fn intern(&mut self, f: Function) -> u32 {
        if let Some(&id) = self.function_ids.get(&f) {
            return id;
        }
        let id = self.functions.len() as u32;
        self.functions.push(f.clone());
        self.function_ids.insert(f, id);
        id
    }

    fn single(&mut self, name: String, module: String, named: bool) -> Rc<Resolved> {
        let func = self.intern(Function { name, module });
        Rc::new(Resolved { frames: vec![SymFrame { func, linkage: None, file: None, line: 0 }], named })
    }

    /// The loaded symbols of a module, if a file with its build id is found.
    pub fn module_symbols(&mut self, m: &Module) -> Option<Rc<ModuleSymbols>> {
        let i = m.id.index();
        if self.modules.len() <= i {
            self.modules.resize(i + 1, None);
        }
        if let Some(s) = &self.modules[i] {
            return s.clone();
        }
        let key = (m.path.clone(), m.build_id.clone());
        let loaded = match self.files.get(&key) {
            Some(s) => s.clone(),
            None => {
                let s = if self.options.disabled { None } else { self.load(m) };
                self.files.insert(key, s.clone());
                s
            }
        };
        self.modules[i] = Some(loaded.clone());
        loaded
    }

    fn candidate_paths(&self, m: &Module, primary: Option<&Parsed>) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let name = module_name(m);
        let bid = hex(&m.build_id);
        let mut roots: Vec<PathBuf> = self.options.dirs.clone();
        roots.push(PathBuf::from("/usr/lib/debug"));
        for root in &roots {
            if bid.len() > 2 {
                out.push(root.join(".build-id").join(&bid[..2]).join(format!("{}.debug", &bid[2..])));
                out.push(root.join(&bid[..2]).join(format!("{}.debug", &bid[2..])));
            }
        }
        let link =
            primary.and_then(|p| p.debuglink.as_ref()).map(|l| String::from_utf8_lossy(l).into_owned());
        for dir in &self.options.dirs {
            out.push(dir.join(format!("{name}.debug")));
            out.push(dir.join(&name));
            if let Some(l) = &link {
                out.push(dir.join(l));
            }
        }
        if let Some(l) = &link {
            if let Some(parent) = m.path().parent() {
                out.push(parent.join(l));
                out.push(parent.join(".debug").join(l));
                let rel = parent.strip_prefix("/").unwrap_or(parent);
                out.push(Path::new("/usr/lib/debug").join(rel).join(l));
            }
        }
        out
    }

    /// Open and parse `path` once per (device, inode).
    fn inspect(&mut self, path: &Path) -> Option<Rc<Parsed>> {
        let (file, key, _) = open_regular(path, MAX_FILE_BYTES, 0)?;
        if let Some(p) = self.parsed.get(&key) {
            return p.clone();
        }
        let backing = file_bytes(&file, file.metadata().ok()?.len())?;
        let p = parse(Bytes::whole(Rc::new(backing)), path).map(Rc::new);
        self.parsed.insert(key, p.clone());
        p
    }

    fn debug_data(&mut self, p: &Parsed) -> Option<Rc<DebugData>> {
        let mut loaded = false;
        let d = p
            .debug
            .get_or_init(|| {
                loaded = true;
                DebugData::load(p).map(Rc::new)
            })
            .clone();
        if loaded && d.is_some() {
            self.files_loaded += 1;
        }
        d
    }

    fn load(&mut self, m: &Module) -> Option<Rc<ModuleSymbols>> {
        let want: Option<&[u8]> = (!m.build_id.is_empty()).then_some(&m.build_id[..]);
        let bid_key = want.map(|b| (b.to_vec(), m.file_offset, m.size));
        if let Some(s) = bid_key.as_ref().and_then(|k| self.by_build_id.get(k)) {
            return Some(s.clone());
        }
        let matches = |c: &Parsed| match want {
            Some(b) => c.build_id.as_deref() == Some(b),
            // No build id recorded: only the named file itself can be trusted.
            None => false,
        };
        // The vDSO is no file: the kernel maps one image into every process,
        // so a module without a file whose build id is that of this
        // process's own vDSO is named from this process's copy (same kernel).
        let primary =
            self.inspect(m.path()).or_else(|| self.own_vdso().filter(|v| want.is_some() && matches(v)));
        let primary_ok = primary.as_ref().is_some_and(|p| want.is_none() || matches(p));
        let mut chosen: Option<Rc<Parsed>> = None;
        if (!primary_ok || !primary.as_ref().is_some_and(|p| p.has_dwarf)) && want.is_some() {
            // Look for a separate debug file with DWARF and the same build id.
            let paths = self.candidate_paths(m, primary.as_deref().filter(|_| primary_ok));
            for path in paths {
                if let Some(c) = self.inspect(&path) {
                    if matches(&c) && (c.has_dwarf || !primary_ok) {
                        chosen = Some(c);
                        break;
                    }
                }
            }
        }
        let (from, segments) = match (chosen, primary_ok) {
            (Some(c), true) => {
                // Addresses map through the original file's headers.
                let segs = primary.map(|p| p.segments.clone()).unwrap_or_default();
                let segs = if segs.is_empty() { c.segments.clone() } else { segs };
                (c, segs)
            }
            (Some(c), false) => {
                let segs = c.segments_for(m);
                (c, segs)
            }
            (None, true) => {
                let p = primary?;
                let segs = p.segments.clone();
                (p, segs)
            }
            (None, false) => return None,
        };
        let debug = self.debug_data(&from)?;
        let image_base = segments.iter().map(|s| s.2).min().unwrap_or(0);
        let s = Rc::new(ModuleSymbols { debug, segments, image_base, source: from.path.clone() });
        if let Some(k) = bid_key {
            self.by_build_id.insert(k, s.clone());
        }
        Some(s)
    }

    /// Resolve a frame in a context (the context matters only for absolute frames).
    pub fn resolve(&mut self, defs: &Definitions, frame: FrameId, ctx: &Context) -> Rc<Resolved> {
        self.lookups += 1;
        match defs.frame(frame) {
            Frame::Module { module, file_relative } => {
                let i = frame.index();
                if let Some(Some(r)) = self.module_frames.get(i) {
                    return r.clone();
                }
                let m = defs.module(module);
                let r = self.resolve_module(m, file_relative);
                if self.module_frames.len() <= i {
                    self.module_frames.resize(defs.frames().len().max(i + 1), None);
                }
                self.module_frames[i] = Some(r.clone());
                r
            }
            Frame::Absolute { address, kernel } => {
                let key = (frame, ctx.pid, ctx.perf_map_allowed);
                if let Some(r) = self.other_frames.get(&key) {
                    return r.clone();
                }
                let r = if kernel {
                    // Address 0: the recorder's mark of time spent in the
                    // kernel (a system call, a page fault) on top of the user
                    // stack that entered it; which kernel function ran is not
                    // known in process.
                    let name =
                        if address == 0 { "[kernel]".to_string() } else { format!("[kernel] {address:#x}") };
                    self.single(name, "[kernel]".into(), false)
                } else {
                    let named =
                        if ctx.perf_map_allowed { self.perf_map_name(ctx.pid, address) } else { None };
                    match named {
                        Some((name, map)) => self.single(name, map, true),
                        None => self.single(format!("[unknown] {address:#x}"), "[unknown]".into(), false),
                    }
                };
                self.other_frames.insert(key, r.clone());
                r
            }
            Frame::Truncated => {
                let key = (frame, 0, false);
                if let Some(r) = self.other_frames.get(&key) {
                    return r.clone();
                }
                let r = self.single("[truncated]".into(), "[truncated]".into(), false);
                self.other_frames.insert(key, r.clone());
                r
            }
            Frame::Label(label) => {
                let key = (frame, 0, false);
                if let Some(r) = self.other_frames.get(&key) {
                    return r.clone();
                }
                // An off-CPU leaf (`[blocked: futex]`, `[waiting for CPU]`).
                // Control characters of an untrusted label are not printed.
                let text: String =
                    defs.label(label).chars().map(|c| if c.is_control() { '?' } else { c }).collect();
                let r = self.single(format!("[{text}]"), "[off-cpu]".into(), false);
                self.other_frames.insert(key, r.clone());
                r
            }
        }
    }

    fn resolve_module(&mut self, m: &Module, file_relative: u64) -> Rc<Resolved> {
        let module = module_name(m);
        if self.options.disabled {
            let name = match self.header_address(m, file_relative) {
                Some(a) => format!("{module}+{a:#x}"),
                None => format!("{module}+{file_relative:#x} (file offset)"),
            };
            return self.single(name, module, false);
        }
        let unresolved =
            |s: &mut Self| s.single(format!("{module}+{file_relative:#x}"), module.clone(), false);
        let Some(syms) = self.module_symbols(m) else { return unresolved(self) };
        let Some(svma) = syms.svma(file_relative) else { return unresolved(self) };
        let mut found = syms.debug.find_frames(svma);
        if found.is_empty() {
            if let Some(sym) = syms.debug.find_symbol(svma) {
                found.push((String::from_utf8_lossy(sym).into_owned(), None, 0));
            }
        }
        if found.is_empty() {
            return unresolved(self);
        }
        let frames = found
            .into_iter()
            .map(|(raw, file, line)| {
                let name = demangle(syms.debug.preferred_name(&raw)).into_owned();
                SymFrame {
                    func: self.intern(Function { name, module: module.clone() }),
                    linkage: Some(Rc::from(raw)),
                    file,
                    line,
                }
            })
            .collect();
        Rc::new(Resolved { frames, named: true })
    }

    /// This process's own vDSO image, parsed.
    fn own_vdso(&self) -> Option<Rc<Parsed>> {
        self.vdso
            .get_or_init(|| {
                let bytes = read_own_vdso()?;
                parse(Bytes::whole(Rc::new(Backing::Owned(bytes))), Path::new("[vdso]")).map(Rc::new)
            })
            .clone()
    }

    /// Without symbolization: the address of a file offset in the module's
    /// own ELF address space (what `addr2line -e`, `objdump` and `nm` take),
    /// from the program headers of the module's file, only if that file is the
    /// recorded build (its build id matches; a module recorded without one
    /// takes the file at its path). No symbol or debug section is read.
    fn header_address(&mut self, m: &Module, file_relative: u64) -> Option<u64> {
        let p = match self.inspect(m.path()) {
            Some(p) => p,
            None => self
                .own_vdso()
                .filter(|v| !m.build_id.is_empty() && v.build_id.as_deref() == Some(&m.build_id[..]))?,
        };
        if !m.build_id.is_empty() && p.build_id.as_deref() != Some(&m.build_id[..]) {
            return None;
        }
        svma(&p.segments, file_relative)
    }

    fn perf_map_name(&mut self, pid: u32, address: u64) -> Option<(String, String)> {
        let map = self.perf_maps.entry(pid).or_insert_with(|| load_perf_map(pid));
        let map = map.as_ref()?;
        Some((map.lookup(address)?.to_string(), map.path.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::demangle::*;
    use super::*;

    #[test]
    fn demangles_rust_without_hash_and_cpp() {
        assert_eq!(
            demangle("_ZN10quickstart13parse_records17h0123456789abcdefE"),
            "quickstart::parse_records"
        );
        assert_eq!(demangle("_RNvCs1234_10quickstart13parse_records"), "quickstart::parse_records");
        assert_eq!(demangle("_ZN3foo3barEv"), "foo::bar()");
        assert_eq!(demangle("hot_a"), "hot_a");
        assert_eq!(demangle("_Zgarbage"), "_Zgarbage");
        // PLT stubs keep their suffix.
        assert_eq!(demangle("_ZN3foo3barEv@plt"), "foo::bar()@plt");
        assert_eq!(demangle("PyIter_Next@plt"), "PyIter_Next@plt");
    }

    #[test]
    fn v0_and_legacy_rust_names_display_alike() {
        // The same closure of a generic function, as the standard library (v0)
        // and an application crate (legacy) mangle it.
        let v0 = "_RNCINvNtCsjrHSEGnQ3l9_3std2rt10lang_startuE0Cs6xxl1lAjzDf_1a";
        let legacy = "_ZN3std2rt10lang_start28_$u7b$$u7b$closure$u7d$$u7d$17he39bdf0230cb3880E";
        assert_eq!(demangle(v0), "std::rt::lang_start::{{closure}}");
        assert_eq!(demangle(legacy), "std::rt::lang_start::{{closure}}");
        // Generic arguments go, qualified paths stay.
        assert_eq!(
            normalize_rust("core::ptr::drop_in_place::<alloc::string::String>"),
            "core::ptr::drop_in_place"
        );
        assert_eq!(
            normalize_rust("core::ptr::drop_in_place<alloc::string::String>"),
            "core::ptr::drop_in_place"
        );
        assert_eq!(
            normalize_rust("<alloc::vec::Vec<u8> as core::ops::drop::Drop>::drop"),
            "<alloc::vec::Vec as core::ops::drop::Drop>::drop"
        );
        assert_eq!(
            normalize_rust("<alloc::vec::Vec<T,A> as core::ops::drop::Drop>::drop"),
            "<alloc::vec::Vec as core::ops::drop::Drop>::drop"
        );
        assert_eq!(
            normalize_rust("<u64 as core::cmp::PartialOrd>::lt"),
            "<u64 as core::cmp::PartialOrd>::lt"
        );
        assert_eq!(
            normalize_rust("a::call::<fn(u8) -> u8>::{closure#2}::{shim:vtable#0}"),
            "a::call::{{closure}}{{vtable.shim}}"
        );
        // As legacy spells the same shim (`..::FnOnce::call_once{{vtable.shim}}`),
        // and an inherent method's closure inside a qualified path unwrapped.
        assert_eq!(
            normalize_rust(
                "<<std::sync::once::Once>::call_once::{closure#0} as core::ops::function::FnOnce<(&std::sync::once::OnceState,)>>::call_once::{shim:vtable#0}"
            ),
            "<std::sync::once::Once::call_once::{{closure}} as core::ops::function::FnOnce>::call_once{{vtable.shim}}"
        );
        assert_eq!(normalize_rust("<[u8] as a::B<&str>>::f"), "<[u8] as a::B>::f");
        // Legacy names an impl by its module; v0 by its type and trait.
        let legacy = "_ZN4core4iter5range101_$LT$impl$u20$core..iter..traits..iterator..Iterator$u20$for$u20$core..ops..range..Range$LT$A$GT$$GT$4next17h7c48a1ecddd74bd4E";
        assert_eq!(
            demangle(legacy),
            "<core::ops::range::Range as core::iter::traits::iterator::Iterator>::next"
        );
        assert_eq!(
            normalize_rust("<core::ops::range::Range<A> as core::iter::traits::iterator::Iterator>::next"),
            demangle(legacy)
        );
        assert_eq!(normalize_rust("a::b::<impl a::T<u8> for a::S<fn() -> u8>>::f"), "<a::S as a::T>::f");
        assert_eq!(normalize_rust("a::b::<impl a::S<T>>::f::{{closure}}"), "a::S::f::{{closure}}");
        assert_eq!(normalize_rust("x::<impl a::T for &[u8]>::g"), "<&[u8] as a::T>::g");
        // Inherent methods: v0 brackets the type, legacy does not.
        assert_eq!(normalize_rust("<std::time::Instant>::now"), "std::time::Instant::now");
        assert_eq!(normalize_rust("<alloc::vec::Vec<u8>>::push"), "alloc::vec::Vec::push");
        assert_eq!(normalize_rust("a::b::<x::Y>::f"), "a::b::f");
        assert_eq!(normalize_rust("<u64>::wrapping_mul"), "<u64>::wrapping_mul");
        assert_eq!(normalize_rust("<&str>::len"), "<&str>::len");
    }

    #[test]
    fn perf_map_lines_and_lookup() {
        assert_eq!(parse_hex("0x1f"), Some(31));
        assert_eq!(parse_hex("1F"), Some(31));
        assert_eq!(parse_hex("zz"), None);
        let m = PerfMap::new([(0x1000, 0x1100, "old"), (0x1000, 0x1080, "new")], "perf-1.map".into());
        assert_eq!(m.lookup(0x1010), Some("new"), "later lines win");
        assert_eq!(m.lookup(0x1090), Some("old"));
        assert_eq!(m.lookup(0x1100), None, "end is exclusive");
    }

    #[test]
    fn svma_uses_the_segment_holding_the_offset() {
        let segs = vec![(0, 0x1000, 0, 0x1000), (0x1000, 0x2000, 0x401000, 0x2000)];
        assert_eq!(svma(&segs, 0x1234), Some(0x401234));
        assert_eq!(svma(&segs, 0x10), Some(0x10));
        assert_eq!(svma(&segs, 0x3000), None);
    }

    #[test]
    fn fifo_is_not_opened_for_reading() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(open_regular(&fifo, MAX_FILE_BYTES, 0).is_none());
        assert!(open_regular(Path::new("/dev/zero"), MAX_FILE_BYTES, 0).is_none());
        let f = dir.path().join("f");
        std::fs::write(&f, [0u8; 10]).unwrap();
        assert!(open_regular(&f, 10, 0).is_some());
        assert!(open_regular(&f, 9, 0).is_none(), "over the size cap");
    }
}
