//! Offline symbolization of spool frames.
//!
//! Module frames are resolved from the module files named in the spool (or a
//! separate debug file found by build id or debug link), with `addr2line` over
//! DWARF (inlined frames expanded) and the ELF symbol table as a fallback, names
//! demangled (Rust without the hash, then C++). A candidate file is used only
//! when its GNU build id equals the one recorded in the spool; a module with no
//! usable file is shown as `name+0xoffset`, never with a guessed name. Each
//! module file is loaded once; each frame is resolved once.
//!
//! Absolute frames (anonymous executable memory) are named from
//! `/tmp/perf-<pid>.map` when that file exists, is a regular file and belongs to
//! the user running the tool; when the spool records Python-runtime intervals
//! for the process, only samples inside them use the map (see
//! [`crate::aggregate::Context`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use object::{Object, ObjectSegment};
use spulse::{Definitions, Frame, FrameId, Module};

use crate::aggregate::Context;

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

/// Where to look for symbols.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Extra places: directories holding debug files, by base name or in a
    /// `.build-id/xx/rest.debug` tree.
    pub dirs: Vec<PathBuf>,
    /// Do not read any file: every module frame becomes `name+0xoffset`.
    pub disabled: bool,
}

/// A loaded module file.
pub struct ModuleSymbols {
    loader: addr2line::Loader,
    /// PT_LOAD segments of the file: (file offset, file size, virtual address, memory size).
    segments: Vec<(u64, u64, u64, u64)>,
    /// Lowest virtual address of any PT_LOAD segment.
    pub image_base: u64,
    /// The file the symbols were read from.
    pub source: PathBuf,
}

impl ModuleSymbols {
    /// The stated virtual address (as in the file's headers) of a file offset.
    pub fn svma(&self, file_offset: u64) -> Option<u64> {
        self.segments.iter().find_map(|&(off, filesz, vaddr, memsz)| {
            let len = if filesz > 0 { filesz } else { memsz };
            (file_offset >= off && file_offset - off < len).then(|| vaddr + (file_offset - off))
        })
    }
}

struct PerfMap {
    /// (start, end, name) in file order; later lines win.
    entries: Vec<(u64, u64, String)>,
    path: String,
}

impl PerfMap {
    fn lookup(&self, address: u64) -> Option<&str> {
        self.entries.iter().rev().find(|(s, e, _)| address >= *s && address < *e).map(|(_, _, n)| n.as_str())
    }
}

/// A module file's identity: (path, build id).
type FileKey = (Vec<u8>, Vec<u8>);

/// Resolves frames to functions, caching every file and frame.
pub struct Symbolizer {
    options: Options,
    functions: Vec<Function>,
    function_ids: HashMap<Function, u32>,
    /// Loaded files by (path, build id).
    files: HashMap<FileKey, Option<Rc<ModuleSymbols>>>,
    /// Per module id.
    modules: Vec<Option<Option<Rc<ModuleSymbols>>>>,
    module_frames: Vec<Option<Rc<Resolved>>>,
    other_frames: HashMap<(FrameId, u32, bool), Rc<Resolved>>,
    perf_maps: HashMap<u32, Option<PerfMap>>,
    files_loaded: usize,
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

/// Demangle a linkage name: Rust (v0 or legacy, without the hash), then C++.
pub fn demangle(name: &str) -> Cow<'_, str> {
    if let Ok(d) = rustc_demangle::try_demangle(name) {
        return Cow::Owned(format!("{d:#}"));
    }
    if name.starts_with("_Z") {
        if let Ok(sym) = cpp_demangle::Symbol::new(name) {
            if let Ok(s) = sym.demangle() {
                return Cow::Owned(s);
            }
        }
    }
    Cow::Borrowed(name)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

struct Candidate {
    path: PathBuf,
    build_id: Option<Vec<u8>>,
    has_dwarf: bool,
    segments: Vec<(u64, u64, u64, u64)>,
    /// Per segment: (executable, alignment).
    seg_flags: Vec<(bool, u64)>,
    debuglink: Option<Vec<u8>>,
}

impl Candidate {
    /// Segments to map the module's file offsets with. A full file's own
    /// headers work as they are; a separate debug file (`objcopy
    /// --only-keep-debug`) keeps the addresses but not the file offsets, so
    /// its executable segment is matched to the module by size and alignment.
    fn segments_for(&self, m: &Module) -> Vec<(u64, u64, u64, u64)> {
        if self.segments.iter().any(|&(off, filesz, _, _)| off == m.file_offset && filesz > 0) {
            return self.segments.clone();
        }
        let matches: Vec<_> = self
            .segments
            .iter()
            .zip(&self.seg_flags)
            .filter(|(&(_, _, vaddr, memsz), &(exec, align))| {
                exec && memsz == m.size && (align <= 1 || vaddr % align == m.file_offset % align)
            })
            .collect();
        match matches.as_slice() {
            [(&(_, _, vaddr, memsz), _)] => vec![(m.file_offset, m.size, vaddr, memsz)],
            _ => Vec::new(),
        }
    }
}

fn inspect(path: &Path) -> Option<Candidate> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() {
        return None;
    }
    let file = File::open(path).ok()?;
    let cache = object::ReadCache::new(file);
    let obj = object::File::parse(&cache).ok()?;
    let build_id = obj.build_id().ok().flatten().map(|b| b.to_vec());
    let has_dwarf = obj.section_by_name(".debug_info").is_some();
    let segments = obj
        .segments()
        .map(|s| {
            let (off, filesz) = s.file_range();
            (off, filesz, s.address(), s.size())
        })
        .collect();
    let seg_flags = obj
        .segments()
        .map(|s| {
            let exec = match s.flags() {
                object::SegmentFlags::Elf { p_flags } => p_flags & object::elf::PF_X != 0,
                _ => false,
            };
            (exec, s.align())
        })
        .collect();
    let debuglink = obj.gnu_debuglink().ok().flatten().map(|(n, _)| n.to_vec());
    Some(Candidate { path: path.to_path_buf(), build_id, has_dwarf, segments, seg_flags, debuglink })
}

impl Symbolizer {
    /// A symbolizer with the given search options.
    pub fn new(options: Options) -> Symbolizer {
        Symbolizer {
            options,
            functions: Vec::new(),
            function_ids: HashMap::new(),
            files: HashMap::new(),
            modules: Vec::new(),
            module_frames: Vec::new(),
            other_frames: HashMap::new(),
            perf_maps: HashMap::new(),
            files_loaded: 0,
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

    /// Re-read perf maps on next use (a JIT appends to its map while it runs):
    /// forgets the maps and every absolute frame resolved from them.
    pub fn refresh_perf_maps(&mut self) {
        self.perf_maps.clear();
        self.other_frames.clear();
    }

    /// How many module files were loaded.
    pub fn files_loaded(&self) -> usize {
        self.files_loaded
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
        Rc::new(Resolved { frames: vec![SymFrame { func, file: None, line: 0 }], named })
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

    fn candidate_paths(&self, m: &Module, primary: Option<&Candidate>) -> Vec<PathBuf> {
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

    fn load(&mut self, m: &Module) -> Option<Rc<ModuleSymbols>> {
        let want: Option<&[u8]> = (!m.build_id.is_empty()).then_some(&m.build_id[..]);
        let matches = |c: &Candidate| match want {
            Some(b) => c.build_id.as_deref() == Some(b),
            // No build id recorded: only the named file itself can be trusted.
            None => false,
        };
        let primary = inspect(m.path());
        let primary_ok = primary.as_ref().is_some_and(|p| want.is_none() || matches(p));
        let mut chosen: Option<Candidate> = None;
        if !primary_ok || !primary.as_ref().is_some_and(|p| p.has_dwarf) {
            // Look for a separate debug file with DWARF and the same build id.
            if want.is_some() {
                for path in self.candidate_paths(m, primary.as_ref().filter(|_| primary_ok)) {
                    if let Some(c) = inspect(&path) {
                        if matches(&c) && (c.has_dwarf || !primary_ok) {
                            chosen = Some(c);
                            break;
                        }
                    }
                }
            }
        }
        let (symbols_from, segments) = match (chosen, primary_ok) {
            (Some(c), true) => {
                // Addresses map through the original file's headers.
                let segs = primary.map(|p| p.segments).unwrap_or_default();
                (c.path, if segs.is_empty() { c.segments } else { segs })
            }
            (Some(c), false) => {
                let segs = c.segments_for(m);
                (c.path, segs)
            }
            (None, true) => {
                let p = primary?;
                (p.path, p.segments)
            }
            (None, false) => return None,
        };
        let loader = addr2line::Loader::new(&symbols_from).ok()?;
        let image_base = segments.iter().map(|s| s.2).min().unwrap_or(0);
        self.files_loaded += 1;
        Some(Rc::new(ModuleSymbols { loader, segments, image_base, source: symbols_from }))
    }

    /// Resolve a frame in a context (the context matters only for absolute frames).
    pub fn resolve(&mut self, defs: &Definitions, frame: FrameId, ctx: &Context) -> Rc<Resolved> {
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
                    self.single(format!("[kernel] {address:#x}"), "[kernel]".into(), false)
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
        }
    }

    fn resolve_module(&mut self, m: &Module, file_relative: u64) -> Rc<Resolved> {
        let module = module_name(m);
        let unresolved =
            |s: &mut Self| s.single(format!("{module}+{file_relative:#x}"), module.clone(), false);
        let Some(syms) = self.module_symbols(m) else { return unresolved(self) };
        let Some(svma) = syms.svma(file_relative) else { return unresolved(self) };
        let mut found: Vec<(String, Option<Rc<str>>, u32)> = Vec::new();
        if let Ok(mut iter) = syms.loader.find_frames(svma) {
            while let Ok(Some(f)) = iter.next() {
                let Some(func) = &f.function else { continue };
                let Ok(raw) = func.raw_name() else { continue };
                let name = demangle(&raw).into_owned();
                let (file, line) = match &f.location {
                    Some(l) => (l.file.map(Rc::from), l.line.unwrap_or(0)),
                    None => (None, 0),
                };
                found.push((name, file, line));
            }
        }
        if found.is_empty() {
            if let Some(sym) = syms.loader.find_symbol(svma) {
                found.push((demangle(sym).into_owned(), None, 0));
            }
        }
        if found.is_empty() {
            return unresolved(self);
        }
        let frames = found
            .into_iter()
            .map(|(name, file, line)| SymFrame {
                func: self.intern(Function { name, module: module.clone() }),
                file,
                line,
            })
            .collect();
        Rc::new(Resolved { frames, named: true })
    }

    fn perf_map_name(&mut self, pid: u32, address: u64) -> Option<(String, String)> {
        let map = self.perf_maps.entry(pid).or_insert_with(|| load_perf_map(pid));
        let map = map.as_ref()?;
        Some((map.lookup(address)?.to_string(), map.path.clone()))
    }
}

fn my_uid() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    // /proc/self is owned by the effective uid of the process that looks at it.
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

fn parse_hex(s: &str) -> Option<u64> {
    let s = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).unwrap_or(s);
    u64::from_str_radix(s, 16).ok()
}

/// Load `/tmp/perf-<pid>.map` if it exists, is a regular file and is owned by
/// the current user. Malformed lines are skipped.
fn load_perf_map(pid: u32) -> Option<PerfMap> {
    use std::os::unix::fs::MetadataExt;
    let path = format!("/tmp/perf-{pid}.map");
    let meta = std::fs::symlink_metadata(&path).ok()?;
    if !meta.is_file() || Some(meta.uid()) != my_uid() {
        return None;
    }
    let text = std::fs::read(&path).ok()?;
    let text = String::from_utf8_lossy(&text);
    let mut entries = Vec::new();
    for line in text.lines() {
        let mut parts = line.trim_end().splitn(3, ' ');
        let (Some(start), Some(size), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (Some(start), Some(size)) = (parse_hex(start), parse_hex(size)) else { continue };
        let Some(end) = start.checked_add(size) else { continue };
        if size == 0 || name.is_empty() {
            continue;
        }
        entries.push((start, end, name.to_string()));
    }
    let name = format!("perf-{pid}.map");
    Some(PerfMap { entries, path: name })
}

#[cfg(test)]
mod tests {
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
    }

    #[test]
    fn perf_map_lines_and_lookup() {
        assert_eq!(parse_hex("0x1f"), Some(31));
        assert_eq!(parse_hex("1F"), Some(31));
        assert_eq!(parse_hex("zz"), None);
        let m = PerfMap {
            entries: vec![(0x1000, 0x1100, "old".into()), (0x1000, 0x1080, "new".into())],
            path: "perf-1.map".into(),
        };
        assert_eq!(m.lookup(0x1010), Some("new"), "later lines win");
        assert_eq!(m.lookup(0x1090), Some("old"));
        assert_eq!(m.lookup(0x1100), None, "end is exclusive");
    }

    #[test]
    fn svma_uses_the_segment_holding_the_offset() {
        let s = |segments| ModuleSymbols {
            loader: addr2line::Loader::new("/proc/self/exe").unwrap(),
            segments,
            image_base: 0,
            source: PathBuf::new(),
        };
        let m = s(vec![(0, 0x1000, 0, 0x1000), (0x1000, 0x2000, 0x401000, 0x2000)]);
        assert_eq!(m.svma(0x1234), Some(0x401234));
        assert_eq!(m.svma(0x10), Some(0x10));
        assert_eq!(m.svma(0x3000), None);
    }
}
