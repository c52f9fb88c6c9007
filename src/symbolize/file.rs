//! Files the symbolizer reads: opened without blocking and checked to be
//! regular files of bounded size, mapped or copied ([`Bytes`]), parsed as
//! objects once per (device, inode); and this process's own vDSO.

use super::*;

/// The bytes of an opened file, or data decompressed from it.
#[derive(Debug)]
pub(super) enum Backing {
    Map(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    pub(super) fn bytes(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A shared range of a `Backing` (a mapped file or bytes in memory): the data the DWARF reader reads.
#[derive(Debug, Clone)]
pub struct Bytes {
    data: Rc<Backing>,
    start: usize,
    len: usize,
}

impl Bytes {
    pub(super) fn whole(data: Rc<Backing>) -> Bytes {
        let len = data.bytes().len();
        Bytes { data, start: 0, len }
    }

    /// The range of `self` that `part` (a slice borrowed from it) covers.
    pub(super) fn sub(&self, part: &[u8]) -> Option<Bytes> {
        let base = self.data.bytes().as_ptr() as usize;
        let start = (part.as_ptr() as usize).checked_sub(base)?;
        (start + part.len() <= self.data.bytes().len()).then(|| Bytes {
            data: self.data.clone(),
            start,
            len: part.len(),
        })
    }
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.data.bytes()[self.start..self.start + self.len]
    }
}

// SAFETY: `deref` returns a slice of the `Rc`'s target (a mapping or a vector
// that is never changed once built), which stays at the same address however
// the `Bytes` or its clones are moved, for as long as any of them lives.
unsafe impl gimli::StableDeref for Bytes {}
// SAFETY: clones share the same `Rc` target, so they deref to the same address.
unsafe impl gimli::CloneStableDeref for Bytes {}

/// The DWARF reader type.
pub(super) type Reader = gimli::EndianReader<gimli::RunTimeEndian, Bytes>;

/// Open `path` for reading without ever blocking: `O_NONBLOCK` (a FIFO or
/// device opens at once instead of waiting for a writer), `O_CLOEXEC`,
/// `O_NOCTTY`, plus `extra` flags. The opened descriptor must be a regular
/// file of at most `max` bytes. Returns the file and its (device, inode).
pub(super) fn open_regular(path: &Path, max: u64, extra: i32) -> Option<(File, (u64, u64), u64)> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY | extra)
        .open(path)
        .ok()?;
    // fstat of the descriptor just opened: what is checked is what is read.
    let meta = file.metadata().ok()?;
    if !meta.file_type().is_file() || meta.len() > max {
        return None;
    }
    Some((file, (meta.dev(), meta.ino()), meta.len()))
}

/// Files up to this size are read into memory rather than mapped: a mapped
/// file that another process truncates while it is read (`cp` over a
/// library in place) ends the reader with SIGBUS (9 runs of 60 in a
/// helper's trial), a copy cannot. Larger files (the Rust toolchain's
/// `libLLVM`, 150 MB) are still mapped.
const READ_BELOW_BYTES: u64 = 32 << 20;

/// Map a regular file (see [`open_regular`]) read-only, or read it if it is
/// small ([`READ_BELOW_BYTES`]).
pub(super) fn map_regular(path: &Path) -> Option<(Rc<Backing>, (u64, u64))> {
    let (file, key, len) = open_regular(path, MAX_FILE_BYTES, 0)?;
    Some((Rc::new(file_bytes(&file, len)?), key))
}

/// The bytes of `file` (opened with [`open_regular`], `len` long): read if
/// small ([`READ_BELOW_BYTES`]), mapped otherwise.
pub(super) fn file_bytes(file: &File, len: u64) -> Option<Backing> {
    Some(if len == 0 {
        Backing::Owned(Vec::new())
    } else if len <= READ_BELOW_BYTES {
        let mut v = Vec::with_capacity(len as usize);
        file.take(len).read_to_end(&mut v).ok()?;
        Backing::Owned(v)
    } else {
        // (Its bytes are only ever read through `Bytes`, never as Rust
        // references that another process's writes could invalidate the type of.)
        // SAFETY: a private read-only mapping of a regular file we opened and checked.
        Backing::Map(unsafe { memmap2::MmapOptions::new().map(file) }.ok()?)
    })
}

/// An opened, parsed object file, shared by every path that names it.
pub(super) struct Parsed {
    pub(super) data: Bytes,
    pub(super) path: PathBuf,
    pub(super) build_id: Option<Vec<u8>>,
    pub(super) has_dwarf: bool,
    /// PT_LOAD segments: (file offset, file size, virtual address, memory size).
    pub(super) segments: Vec<(u64, u64, u64, u64)>,
    /// Per segment: (executable, alignment).
    pub(super) seg_flags: Vec<(bool, u64)>,
    pub(super) debuglink: Option<Vec<u8>>,
    /// The debug data, built on first use.
    pub(super) debug: OnceCell<Option<Rc<DebugData>>>,
}

pub(super) fn parse(data: Bytes, path: &Path) -> Option<Parsed> {
    let obj = object::File::parse(&*data).ok()?;
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
    drop(obj);
    Some(Parsed {
        data,
        path: path.to_path_buf(),
        build_id,
        has_dwarf,
        segments,
        seg_flags,
        debuglink,
        debug: OnceCell::new(),
    })
}

impl Parsed {
    /// Segments to map the module's file offsets with. A full file's own
    /// headers work as they are; a separate debug file (`objcopy
    /// --only-keep-debug`) keeps the addresses but not the file offsets, so
    /// its executable segment is matched to the module by size and alignment.
    pub(super) fn segments_for(&self, m: &Module) -> Vec<(u64, u64, u64, u64)> {
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

/// Load one DWARF section of `obj` (named `name`) as a reader over `data`,
/// decompressing within `budget`. A missing or unreadable section is empty.
pub(super) fn load_section(
    obj: &object::File<'_>,
    data: &Bytes,
    name: Option<&str>,
    endian: gimli::RunTimeEndian,
    budget: &mut u64,
) -> Reader {
    let empty = || Reader::new(Bytes::whole(Rc::new(Backing::Owned(Vec::new()))), endian);
    let Some(section) = name.and_then(|n| obj.section_by_name(n)) else { return empty() };
    let Ok(compressed) = section.compressed_data() else { return empty() };
    if compressed.format == object::CompressionFormat::None {
        return data.sub(compressed.data).map(|b| Reader::new(b, endian)).unwrap_or_else(empty);
    }
    if compressed.uncompressed_size > *budget {
        return empty();
    }
    *budget -= compressed.uncompressed_size;
    match compressed.decompress() {
        Ok(d) => Reader::new(Bytes::whole(Rc::new(Backing::Owned(d.into_owned()))), endian),
        Err(_) => empty(),
    }
}

pub(super) fn endian_of(obj: &object::File<'_>) -> gimli::RunTimeEndian {
    if obj.is_little_endian() {
        gimli::RunTimeEndian::Little
    } else {
        gimli::RunTimeEndian::Big
    }
}

/// A copy of this process's vDSO: the `[vdso]` mapping of `/proc/self/maps`.
pub(super) fn read_own_vdso() -> Option<Vec<u8>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let line = maps.lines().find(|l| l.trim_end().ends_with("[vdso]"))?;
    let (lo, hi) = line.split_whitespace().next()?.split_once('-')?;
    let (lo, hi) = (u64::from_str_radix(lo, 16).ok()?, u64::from_str_radix(hi, 16).ok()?);
    let len = usize::try_from(hi.checked_sub(lo)?).ok()?;
    // The vDSO is a few pages; anything else is not what we look for.
    if len == 0 || len > MAX_VDSO_BYTES || !line.split_whitespace().nth(1)?.starts_with('r') {
        return None;
    }
    // SAFETY: `[lo, hi)` is this process's own vDSO mapping, readable (checked
    // above), mapped by the kernel for the whole life of the process and never
    // unmapped by this program; it is copied at once.
    Some(unsafe { std::slice::from_raw_parts(lo as usize as *const u8, len) }.to_vec())
}

/// The largest vDSO copied.
pub(super) const MAX_VDSO_BYTES: usize = 1 << 20;
