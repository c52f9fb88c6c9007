//! One module's debug data: DWARF through `addr2line` (split DWARF from a
//! `.dwp` or `.dwo` files), the symbol table as a fallback, and the file
//! offset to address mapping ([`ModuleSymbols`]).

use super::*;

/// Load the split-DWARF sections (`.dwo` names) of an object file.
pub(super) fn load_dwo_sections(data: &Bytes) -> Option<gimli::Dwarf<Reader>> {
    let obj = object::File::parse(&**data).ok()?;
    let endian = endian_of(&obj);
    let mut budget = MAX_DECOMPRESSED_BYTES;
    gimli::Dwarf::load(|id| -> Result<Reader, gimli::Error> {
        Ok(load_section(&obj, data, id.dwo_name(), endian, &mut budget))
    })
    .ok()
}

/// The symbols of one object file: DWARF context, symbol table, split DWARF.
pub(super) struct DebugData {
    pub(super) ctx: addr2line::Context<Reader>,
    /// Text symbols: (address, size, linkage name), sorted by address.
    pub(super) symbols: Vec<(u64, u64, Bytes)>,
    /// Names of symbols that share an address with a preferred one, and
    /// that address (see `plt::text_symbols`).
    pub(super) aliases: HashMap<Vec<u8>, u64>,
    pub(super) dwp: Option<gimli::DwarfPackage<Reader>>,
    /// `.dwo` files already read, by (device, inode).
    pub(super) dwos: RefCell<HashMap<(u64, u64), Option<Bytes>>>,
}

impl DebugData {
    pub(super) fn load(parsed: &Parsed) -> Option<DebugData> {
        let data = &parsed.data;
        let obj = object::File::parse(&**data).ok()?;
        let endian = endian_of(&obj);
        let mut budget = MAX_DECOMPRESSED_BYTES;
        let mut dwarf = gimli::Dwarf::load(|id| -> Result<Reader, gimli::Error> {
            Ok(load_section(&obj, data, Some(id.name()), endian, &mut budget))
        })
        .ok()?;
        dwarf.populate_abbreviations_cache(gimli::AbbreviationsCacheStrategy::Duplicates);
        let ctx = addr2line::Context::from_dwarf(dwarf).ok()?;
        let (symbols, aliases) = super::plt::text_symbols(&obj, data);
        // A DWARF package beside the file: `<file>.dwp`.
        let mut dwp_path = parsed.path.clone().into_os_string();
        dwp_path.push(".dwp");
        let dwp = map_regular(Path::new(&dwp_path)).and_then(|(b, _)| {
            let b = Bytes::whole(b);
            let dobj = object::File::parse(&*b).ok()?;
            let endian = endian_of(&dobj);
            let mut budget = MAX_DECOMPRESSED_BYTES;
            let empty = Reader::new(Bytes::whole(Rc::new(Backing::Owned(Vec::new()))), endian);
            gimli::DwarfPackage::load(
                |id| -> Result<Reader, gimli::Error> {
                    Ok(load_section(&dobj, &b, id.dwo_name(), endian, &mut budget))
                },
                empty,
            )
            .ok()
        });
        Some(DebugData { ctx, symbols, aliases, dwp, dwos: RefCell::new(HashMap::new()) })
    }

    /// The symbol-table entry containing `address` (a symbol without a size
    /// covers up to the next symbol).
    pub(super) fn find_symbol(&self, address: u64) -> Option<&[u8]> {
        let i = self.symbols.partition_point(|s| s.0 <= address);
        let (start, size, name) = self.symbols.get(i.checked_sub(1)?)?;
        (*size == 0 || address - start < *size).then_some(&**name)
    }

    /// The name `perf report` shows for a function DWARF names `raw`: the
    /// preferred symbol at the same address when `raw` is one of its
    /// aliases (`__GI___libc_read` is `read`), else `raw`.
    pub(super) fn preferred_name<'a>(&'a self, raw: &'a str) -> &'a str {
        let Some(&at) = self.aliases.get(raw.as_bytes()) else { return raw };
        let i = self.symbols.partition_point(|s| s.0 < at);
        match self.symbols.get(i) {
            Some((start, _, name)) if *start == at => std::str::from_utf8(name).unwrap_or(raw),
            _ => raw,
        }
    }

    /// Split DWARF for one unit: from the `.dwp`, else from the `.dwo` file
    /// the unit names (opened like every other file, without blocking).
    // addr2line's continuation API takes an `Arc`; the symbolizer is used
    // from one thread, so the reader's `Rc`s are never shared across threads.
    #[allow(clippy::arc_with_non_send_sync)]
    pub(super) fn load_dwo(
        &self,
        load: addr2line::SplitDwarfLoad<Reader>,
    ) -> Option<Arc<gimli::Dwarf<Reader>>> {
        if let Some(dwp) = &self.dwp {
            if let Ok(Some(cu)) = dwp.find_cu(load.dwo_id, &load.parent) {
                return Some(Arc::new(cu));
            }
        }
        let mut path = PathBuf::new();
        if let Some(dir) = &load.comp_dir {
            path.push(std::ffi::OsStr::from_bytes(&dir.to_slice().ok()?));
        }
        let p = load.path.as_ref()?;
        path.push(std::ffi::OsStr::from_bytes(&p.to_slice().ok()?));
        let (file, key, len) = open_regular(&path, MAX_FILE_BYTES, 0)?;
        let data = self
            .dwos
            .borrow_mut()
            .entry(key)
            .or_insert_with(|| Some(Bytes::whole(Rc::new(file_bytes(&file, len)?))))
            .clone()?;
        let mut dwarf = load_dwo_sections(&data)?;
        let header = dwarf.units().next().ok()??;
        let unit = dwarf.unit(header).ok()?;
        if unit.dwo_id != Some(load.dwo_id) {
            return None;
        }
        dwarf.make_dwo(&load.parent);
        Some(Arc::new(dwarf))
    }

    /// The frames at `svma`: (linkage or plain name, file, line), innermost first.
    pub(super) fn find_frames(&self, svma: u64) -> Vec<(String, Option<Rc<str>>, u32)> {
        let mut out = Vec::new();
        let mut lookup = self.ctx.find_frames(svma);
        let frames = loop {
            match lookup {
                addr2line::LookupResult::Output(r) => break r,
                addr2line::LookupResult::Load { load, continuation } => {
                    lookup = continuation.resume(self.load_dwo(load));
                }
            }
        };
        let Ok(mut iter) = frames else { return out };
        while let Ok(Some(f)) = iter.next() {
            let Some(func) = &f.function else { continue };
            let Ok(raw) = func.raw_name() else { continue };
            let (file, line) = match &f.location {
                Some(l) => (l.file.map(Rc::from), l.line.unwrap_or(0)),
                None => (None, 0),
            };
            out.push((raw.into_owned(), file, line));
        }
        out
    }
}

/// A loaded module: the debug data and how its file offsets map to addresses.
pub struct ModuleSymbols {
    pub(super) debug: Rc<DebugData>,
    /// PT_LOAD segments of the file: (file offset, file size, virtual address, memory size).
    pub(super) segments: Vec<(u64, u64, u64, u64)>,
    /// Lowest virtual address of any PT_LOAD segment.
    pub image_base: u64,
    /// The file the symbols were read from.
    pub source: PathBuf,
}

impl ModuleSymbols {
    /// The stated virtual address (as in the file's headers) of a file offset.
    pub fn svma(&self, file_offset: u64) -> Option<u64> {
        svma(&self.segments, file_offset)
    }
}

pub(super) fn svma(segments: &[(u64, u64, u64, u64)], file_offset: u64) -> Option<u64> {
    segments.iter().find_map(|&(off, filesz, vaddr, memsz)| {
        let len = if filesz > 0 { filesz } else { memsz };
        (file_offset >= off && file_offset - off < len).then(|| vaddr.wrapping_add(file_offset - off))
    })
}
