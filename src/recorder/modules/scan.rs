//! Enumeration of the loaded objects through `dl_iterate_phdr` (see the
//! module doc of `modules/`): names, build ids, executable segments and the
//! unwind-table bytes, read in one callback under the loader lock.

use super::*;

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
    // Returning 1 stops the walk after the first object.
    // SAFETY: the callback only writes through the pointer we pass, which outlives the call.
    dl_gate::hold(|| unsafe {
        libc::dl_iterate_phdr(Some(first), &mut counters as *mut (u64, u64) as *mut c_void)
    });
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
    dl_gate::hold(|| unsafe {
        libc::dl_iterate_phdr(Some(each), &mut st as *mut ScanState<'_> as *mut c_void)
    });
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
