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
mod dl_gate;

mod scan;
mod snapshot;
mod table;

use cfi_cache::CfiCache;
use framehop::{ExplicitModuleSectionInfo, MustNotAllocateDuringUnwind, Unwinder as _};
pub(crate) use scan::*;
pub(crate) use snapshot::*;
pub(crate) use table::*;

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

    /// Make a recorder's writer wait `ms` milliseconds before it runs a
    /// deferred check (servicing the rings as during the check), so that a
    /// test knows samples are taken while the executable's tables are
    /// pending; returns the previous value (0 by default).
    pub fn set_check_delay(ms: u64) -> u64 {
        super::CHECK_DELAY_MS.swap(ms, std::sync::atomic::Ordering::Relaxed)
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
