//! Shared by the examples, the recorder tests and the recorder bench: a small
//! offline symbolizer that names the frames of a spool from the symbol tables of
//! the files its modules name (the `spulse` tool does this properly, with debug
//! info; this is the minimum an example needs to print a readable summary), a
//! test plugin library, and per-thread CPU time and busy-loop helpers.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use object::{Object, ObjectSegment, ObjectSymbol};
use spulse::{Definitions, Frame, FrameId};

/// Symbols of one file, by file offset.
#[derive(Default)]
struct FileSymbols {
    /// (start file offset, end file offset, demangled name), sorted.
    syms: Vec<(u64, u64, String)>,
}

/// Names frames of a spool.
#[derive(Default)]
pub struct Symbolizer {
    files: HashMap<Vec<u8>, FileSymbols>,
}

fn load(path: &[u8]) -> FileSymbols {
    use std::os::unix::ffi::OsStrExt;
    let p = std::path::Path::new(std::ffi::OsStr::from_bytes(path));
    let Ok(data) = std::fs::read(p) else { return FileSymbols::default() };
    let Ok(file) = object::File::parse(&*data) else { return FileSymbols::default() };
    let segs: Vec<(u64, u64, u64)> =
        file.segments().map(|s| (s.address(), s.size(), s.file_range().0)).collect();
    let mut syms = Vec::new();
    let add = |syms: &mut Vec<(u64, u64, String)>, sym: object::Symbol<'_, '_>| {
        if sym.kind() != object::SymbolKind::Text || sym.size() == 0 {
            return;
        }
        let a = sym.address();
        let Some(&(va, _, off)) = segs.iter().find(|(va, sz, _)| *va <= a && a < va + sz) else { return };
        let start = a - va + off;
        let name = sym.name().unwrap_or("?");
        let name = format!("{:#}", rustc_demangle::demangle(name));
        syms.push((start, start + sym.size(), name));
    };
    for s in file.symbols() {
        add(&mut syms, s);
    }
    if syms.is_empty() {
        for s in file.dynamic_symbols() {
            add(&mut syms, s);
        }
    }
    syms.sort();
    FileSymbols { syms }
}

impl Symbolizer {
    /// The function containing a frame, or a `module+offset` / address fallback.
    pub fn name(&mut self, defs: &Definitions, frame: FrameId) -> String {
        match defs.frame(frame) {
            Frame::Module { module, file_relative } => {
                let m = defs.module(module);
                let fs = self.files.entry(m.path.clone()).or_insert_with(|| load(&m.path));
                let i = fs.syms.partition_point(|s| s.0 <= file_relative);
                if i > 0 {
                    let (a, b, name) = &fs.syms[i - 1];
                    if *a <= file_relative && file_relative < *b {
                        return name.clone();
                    }
                }
                let base = m.path().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                format!("{base}+{file_relative:#x}")
            }
            // The recorder's mark of time spent in the kernel, as the tool names it.
            Frame::Absolute { address: 0, kernel: true } => "[kernel]".to_string(),
            Frame::Absolute { address, .. } => format!("{address:#x}"),
            Frame::Truncated => "[truncated]".to_string(),
            Frame::Label(l) => format!("[{}]", defs.label(l)),
        }
    }
}

/// Build a small shared library exporting `uint64_t <name>(uint64_t n)` (a busy
/// loop of `n` rounds in a non-inlined helper) into `dir` with the system C
/// compiler (`cc`), and return its path.
pub fn build_plugin(dir: &std::path::Path, name: &str) -> std::io::Result<std::path::PathBuf> {
    let src = dir.join(format!("{name}.c"));
    let lib = dir.join(format!("lib{name}.so"));
    std::fs::write(
        &src,
        format!(
            "#include <stdint.h>\n\
             __attribute__((noinline)) uint64_t {name}_inner(uint64_t n) {{\n\
             \x20   volatile uint64_t h = 1469598103934665603ull;\n\
             \x20   for (uint64_t i = 0; i < n; i++) h = (h ^ i) * 1099511628211ull;\n\
             \x20   return h;\n\
             }}\n\
             uint64_t {name}(uint64_t n) {{ return {name}_inner(n) + 1; }}\n"
        ),
    )?;
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "{cc} failed building {}: {}",
            lib.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(lib)
}

/// A loaded plugin (dlopen handle and its entry point).
pub struct Plugin {
    handle: *mut std::ffi::c_void,
    entry: extern "C" fn(u64) -> u64,
}

impl Plugin {
    /// `dlopen` the library and find `name` in it.
    pub fn open(path: &std::path::Path, name: &str) -> Result<Plugin, String> {
        use std::os::unix::ffi::OsStrExt;
        let cpath = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
        let cname = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
        // SAFETY: dlopen with a valid C string; the library only defines plain functions.
        let handle = unsafe { libc::dlopen(cpath.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("dlopen {} failed", path.display()));
        }
        // SAFETY: dlsym on the handle we just opened.
        let sym = unsafe { libc::dlsym(handle, cname.as_ptr()) };
        if sym.is_null() {
            // SAFETY: closing the handle we opened.
            unsafe { libc::dlclose(handle) };
            return Err(format!("{name} not found in {}", path.display()));
        }
        // SAFETY: the symbol is `uint64_t name(uint64_t)` as built by `build_plugin`.
        let entry: extern "C" fn(u64) -> u64 = unsafe { std::mem::transmute(sym) };
        Ok(Plugin { handle, entry })
    }

    /// Call the entry point.
    pub fn call(&self, n: u64) -> u64 {
        (self.entry)(n)
    }

    /// The address the library is loaded at.
    pub fn base(&self) -> u64 {
        // SAFETY: Dl_info is plain data; dladdr fills it for an address inside a loaded object.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: see above.
        unsafe { libc::dladdr(self.entry as *const std::ffi::c_void, &mut info) };
        info.dli_fbase as u64
    }

    /// `dlclose` it (the entry point must not be called afterwards).
    pub fn close(self) {
        // SAFETY: the handle is ours and closed once.
        unsafe { libc::dlclose(self.handle) };
    }
}

/// CPU time of the calling thread, in seconds.
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the struct we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// The calling thread's kernel id.
pub fn gettid() -> u32 {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

/// Busy user-space hashing on the calling thread until it has used `cpu` seconds
/// of CPU time or `limit` of wall time has passed. The CPU clock (a system call)
/// is read once every `chunk` rounds. Returns the hash, for `black_box`.
#[inline(never)]
pub fn burn_cpu(cpu: f64, chunk: u64, limit: Duration) -> u64 {
    let c0 = thread_cpu_seconds();
    let end = Instant::now() + limit;
    let mut h = 1u64;
    while thread_cpu_seconds() - c0 < cpu && Instant::now() < end {
        for i in 0..chunk {
            h = (h ^ black_box(i)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}
