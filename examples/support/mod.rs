//! A small offline symbolizer for the examples and the recorder tests: names the
//! frames of a spool from the symbol tables of the files its modules name.
//! (The `spulse` tool does this properly, with debug info; this is the minimum an
//! example needs to print a readable summary.)
#![allow(dead_code)]

use std::collections::HashMap;

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
            Frame::Absolute { address, .. } => format!("{address:#x}"),
            Frame::Truncated => "[truncated]".to_string(),
        }
    }
}
