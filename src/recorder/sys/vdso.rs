//! The vDSO's dynamic symbols, read from the image the kernel maps into every
//! process (`getauxval(AT_SYSINFO_EHDR)`). The recorder needs one: on aarch64
//! a signal handler installed without `SA_RESTORER` (glibc sets none there)
//! returns through the vDSO's `__kernel_rt_sigreturn`, and a kernel-time
//! sample whose stack holds it was taken while the kernel returned from our
//! own handler (`handler::return_trampoline`).
//!
//! The image is read in place: its first page is proven mapped (`mincore`)
//! before its ELF and program headers are read, and the whole extent its
//! `PT_LOAD` segments give before anything else. [`find`] parses a byte slice
//! (64-bit little-endian ELF: `PT_DYNAMIC` gives `DT_SYMTAB`, `DT_STRTAB`
//! and the symbol count from `DT_HASH` or `DT_GNU_HASH`), bounds-checks every
//! read against the slice and answers `None` for an image it cannot read,
//! never panicking. Called at start only, never from the signal handler.

/// A dynamic symbol: where it is and its size (`st_size`; 0 where the image
/// gives none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Symbol {
    /// In [`find`]: the offset from the image's first byte; in [`symbol`]: the address.
    pub addr: u64,
    pub size: u64,
}

/// The largest image [`symbol`] reads (a vDSO is a few pages).
const MAX_IMAGE: u64 = 16 << 20;

/// The in-memory vDSO's defined dynamic symbol `name` (its first, whatever
/// its version), or `None`: no vDSO (qemu-user before 8.1 maps none), an
/// image not mapped as its headers say, or no such symbol.
pub(crate) fn symbol(name: &str) -> Option<Symbol> {
    // SAFETY: getauxval reads the auxiliary vector; it has no preconditions.
    let base = unsafe { libc::getauxval(libc::AT_SYSINFO_EHDR) } as u64;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = u64::try_from(page).ok().filter(|p| p.is_power_of_two())?;
    if base == 0 || !base.is_multiple_of(page) || !mapped(base, page) {
        return None;
    }
    // SAFETY: the page at `base` is mapped (just checked); the vDSO is
    // read-only and never written, and the slice is used only in this call.
    let first = unsafe { std::slice::from_raw_parts(base as *const u8, page as usize) };
    let len = image_len(first)?;
    if !mapped(base, len.next_multiple_of(page)) {
        return None;
    }
    // SAFETY: `len` bytes from `base` are mapped (just checked): the extent
    // the vDSO's own program headers give. As above, read-only and not kept.
    let image = unsafe { std::slice::from_raw_parts(base as *const u8, len as usize) };
    let s = find(image, name.as_bytes())?;
    Some(Symbol { addr: base.checked_add(s.addr)?, size: s.size })
}

/// Whether `[addr, addr + len)` is all mapped (`addr` page-aligned).
fn mapped(addr: u64, len: u64) -> bool {
    // One byte per page of the smallest page size (4 KiB): enough for any.
    let mut vec = vec![0u8; len.div_ceil(4096) as usize];
    // SAFETY: mincore only reports on the range (ENOMEM where part of it is
    // not mapped) into `vec`, which has a byte for every page of it.
    unsafe { libc::mincore(addr as *mut libc::c_void, len as usize, vec.as_mut_ptr()) == 0 }
}

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const DT_NULL: u64 = 0;
const DT_HASH: u64 = 4;
const DT_STRTAB: u64 = 5;
const DT_SYMTAB: u64 = 6;
const DT_STRSZ: u64 = 10;
const DT_SYMENT: u64 = 11;
const DT_GNU_HASH: u64 = 0x6fff_fef5;
const SYM_SIZE: u64 = 24;
const PHDR_SIZE: u64 = 56;
const DYN_SIZE: u64 = 16;

fn bytes(b: &[u8], off: u64, len: u64) -> Option<&[u8]> {
    let start = usize::try_from(off).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    b.get(start..end)
}

fn u16_at(b: &[u8], off: u64) -> Option<u16> {
    Some(u16::from_le_bytes(bytes(b, off, 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], off: u64) -> Option<u32> {
    Some(u32::from_le_bytes(bytes(b, off, 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], off: u64) -> Option<u64> {
    Some(u64::from_le_bytes(bytes(b, off, 8)?.try_into().ok()?))
}

/// A program header's type, file offset, address and size in the file.
struct Segment {
    kind: u32,
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

/// The program headers of a 64-bit little-endian ELF image (`None` if it is not one).
fn segments(b: &[u8]) -> Option<impl Iterator<Item = Option<Segment>> + '_> {
    if bytes(b, 0, 6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let phoff = u64_at(b, 0x20)?;
    let phentsize = u64::from(u16_at(b, 0x36)?);
    let phnum = u64::from(u16_at(b, 0x38)?);
    if phentsize < PHDR_SIZE {
        return None;
    }
    // Every header must be inside the image: reject before iterating.
    bytes(b, phoff, phentsize.checked_mul(phnum)?)?;
    Some((0..phnum).map(move |i| {
        let h = phoff + i * phentsize;
        Some(Segment {
            kind: u32_at(b, h)?,
            offset: u64_at(b, h + 8)?,
            vaddr: u64_at(b, h + 16)?,
            filesz: u64_at(b, h + 32)?,
        })
    }))
}

/// How many bytes of memory from its ELF header an image's loaded segments
/// span (the largest `p_offset + p_filesz` of its `PT_LOAD`s), read from
/// `first` (its first page, where the program headers must be); `None` for
/// none, or more than [`MAX_IMAGE`].
fn image_len(first: &[u8]) -> Option<u64> {
    let mut len = 0u64;
    for s in segments(first)? {
        let s = s?;
        if s.kind == PT_LOAD {
            len = len.max(s.offset.checked_add(s.filesz)?);
        }
    }
    Some(len).filter(|&l| l > 0 && l <= MAX_IMAGE)
}

/// The defined dynamic symbol `name` of the ELF image `b` (laid out in
/// memory as in its file, as the vDSO is), its `addr` an offset into `b`;
/// `None` where the image is not a readable 64-bit little-endian ELF with a
/// dynamic symbol table, or has no such symbol.
pub(crate) fn find(b: &[u8], name: &[u8]) -> Option<Symbol> {
    let mut loads = Vec::new();
    let mut dynamic = None;
    for s in segments(b)? {
        let s = s?;
        match s.kind {
            PT_LOAD if loads.len() < 16 => loads.push(s),
            PT_LOAD => return None,
            PT_DYNAMIC => dynamic = Some(s),
            _ => {}
        }
    }
    // An address's offset into `b`, for `len` bytes inside one loaded segment
    // and inside `b`.
    let at = |vaddr: u64, len: u64| -> Option<u64> {
        let s = loads.iter().find(|s| vaddr >= s.vaddr && vaddr - s.vaddr < s.filesz)?;
        let rel = vaddr - s.vaddr;
        if len > s.filesz - rel {
            return None;
        }
        let off = s.offset.checked_add(rel)?;
        bytes(b, off, len)?;
        Some(off)
    };
    let d = dynamic?;
    let dyn_off = at(d.vaddr, d.filesz)?;
    let (mut hash, mut gnu_hash, mut symtab, mut strtab, mut strsz) = (None, None, None, None, None);
    for i in 0..d.filesz / DYN_SIZE {
        let e = dyn_off + i * DYN_SIZE;
        let (tag, val) = (u64_at(b, e)?, u64_at(b, e + 8)?);
        match tag {
            DT_NULL => break,
            DT_HASH => hash = Some(val),
            DT_GNU_HASH => gnu_hash = Some(val),
            DT_SYMTAB => symtab = Some(val),
            DT_STRTAB => strtab = Some(val),
            DT_STRSZ => strsz = Some(val),
            DT_SYMENT if val != SYM_SIZE => return None,
            _ => {}
        }
    }
    let (symtab, strtab, strsz) = (symtab?, strtab?, strsz?);
    let strtab = at(strtab, strsz)?;
    let count = match (hash, gnu_hash) {
        (Some(h), _) => u64::from(u32_at(b, at(h, 8)? + 4)?),
        (None, Some(g)) => gnu_hash_count(b, at(g, 16)?)?,
        (None, None) => return None,
    };
    let symtab = at(symtab, count.checked_mul(SYM_SIZE)?)?;
    let strings = bytes(b, strtab, strsz)?;
    for i in 1..count {
        let s = symtab + i * SYM_SIZE;
        let shndx = u16_at(b, s + 6)?;
        if shndx == 0 {
            continue;
        }
        let st_name = usize::try_from(u32_at(b, s)?).ok()?;
        let Some(rest) = strings.get(st_name..) else { continue };
        let Some(nul) = rest.iter().position(|&c| c == 0) else { continue };
        if &rest[..nul] != name {
            continue;
        }
        let (value, size) = (u64_at(b, s + 8)?, u64_at(b, s + 16)?);
        return Some(Symbol { addr: at(value, size.max(1))?, size });
    }
    None
}

/// The number of symbols a `DT_GNU_HASH` table at `off` covers: one past the
/// last chain's end (the highest bucket's chain ends at the entry whose low
/// bit is set).
fn gnu_hash_count(b: &[u8], off: u64) -> Option<u64> {
    let nbuckets = u64::from(u32_at(b, off)?);
    let symoffset = u64::from(u32_at(b, off + 4)?);
    let bloom_size = u64::from(u32_at(b, off + 8)?);
    let buckets = off.checked_add(16)?.checked_add(bloom_size.checked_mul(8)?)?;
    bytes(b, buckets, nbuckets.checked_mul(4)?)?;
    let mut last = 0u64;
    for i in 0..nbuckets {
        last = last.max(u64::from(u32_at(b, buckets + i * 4)?));
    }
    if last < symoffset {
        return Some(symoffset);
    }
    let chains = buckets + nbuckets * 4;
    // Each step reads 4 more bytes of `b`: ends within b.len() / 4 steps.
    loop {
        let h = u32_at(b, chains.checked_add((last - symoffset).checked_mul(4)?)?)?;
        last += 1;
        if h & 1 != 0 {
            return Some(last);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `[vdso]` line of /proc/self/maps.
    fn vdso_in_maps() -> Option<(u64, u64)> {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let line = maps.lines().find(|l| l.ends_with("[vdso]"))?;
        let (a, b) = line.split_whitespace().next()?.split_once('-')?;
        Some((u64::from_str_radix(a, 16).unwrap(), u64::from_str_radix(b, 16).unwrap()))
    }

    /// A copy of the live vDSO (the extent `symbol` reads), or `None` without one.
    fn live_image() -> Option<Vec<u8>> {
        // SAFETY: no preconditions.
        let base = unsafe { libc::getauxval(libc::AT_SYSINFO_EHDR) } as u64;
        if base == 0 {
            return None;
        }
        let (lo, hi) =
            vdso_in_maps().expect("a vDSO in the auxiliary vector but no [vdso] in /proc/self/maps");
        assert_eq!(lo, base);
        // SAFETY: the [vdso] mapping is readable and stays mapped.
        Some(unsafe { std::slice::from_raw_parts(base as *const u8, (hi - lo) as usize) }.to_vec())
    }

    /// The name a live vDSO has on this architecture.
    const LIVE_NAME: &str =
        if cfg!(target_arch = "aarch64") { "__kernel_clock_gettime" } else { "__vdso_clock_gettime" };

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn finds_clock_gettime_inside_the_vdso_mapping() {
        let (lo, hi) = vdso_in_maps().expect("no [vdso] in /proc/self/maps");
        let s = symbol("__vdso_clock_gettime").expect("__vdso_clock_gettime not found");
        assert!(s.addr > lo && s.addr < hi, "{:#x} outside the vDSO {lo:#x}-{hi:#x}", s.addr);
        assert!(s.size > 0 && s.addr + s.size <= hi, "size {} at {:#x}", s.size, s.addr);
        // The unversioned alias is the same code.
        let alias = symbol("clock_gettime").expect("clock_gettime not found");
        assert_eq!(alias.addr, s.addr);
        // Calling it as a function gives the time libc gives.
        type ClockGettime = extern "C" fn(libc::clockid_t, *mut libc::timespec) -> libc::c_int;
        // SAFETY: the vDSO's clock_gettime has the C signature of clock_gettime.
        let f: ClockGettime = unsafe { std::mem::transmute(s.addr as usize) };
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        assert_eq!(f(libc::CLOCK_MONOTONIC, &mut ts), 0);
        let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: writes the timespec passed.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
        let (a, b) = (
            ts.tv_sec as i128 * 1_000_000_000 + ts.tv_nsec as i128,
            now.tv_sec as i128 * 1_000_000_000 + now.tv_nsec as i128,
        );
        assert!(a > 0 && b >= a && b - a < 10_000_000_000, "vDSO {a} ns, libc {b} ns");
        assert_eq!(symbol("__spulse_no_such_symbol"), None);
        assert_eq!(symbol(""), None);
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn finds_the_kernel_signal_return_trampoline() {
        // SAFETY: no preconditions.
        if unsafe { libc::getauxval(libc::AT_SYSINFO_EHDR) } == 0 {
            eprintln!(
                "SKIPPED finds_the_kernel_signal_return_trampoline: this process has no vDSO \
                 (AT_SYSINFO_EHDR is 0: qemu-user before 8.1 maps none for aarch64 guests), so \
                 __kernel_rt_sigreturn cannot be looked up; the parser is tested on built images"
            );
            assert_eq!(symbol("__kernel_rt_sigreturn"), None);
            assert_eq!(crate::recorder::handler::return_trampoline(), None);
            return;
        }
        let (lo, hi) = vdso_in_maps().expect("no [vdso] in /proc/self/maps");
        let s = symbol("__kernel_rt_sigreturn").expect("__kernel_rt_sigreturn not found");
        assert!(s.addr >= lo && s.addr + 8 <= hi, "{:#x} outside the vDSO {lo:#x}-{hi:#x}", s.addr);
        // SAFETY: 8 bytes inside the mapped, readable vDSO (just checked).
        let code = unsafe { std::slice::from_raw_parts(s.addr as *const u32, 2) };
        // mov x8, #139 (rt_sigreturn); svc #0
        assert_eq!(code, [0xd280_1168, 0xd400_0001], "at {:#x}", s.addr);
        let (a, b) = crate::recorder::handler::return_trampoline().expect("no trampoline range");
        assert_eq!(a, s.addr);
        assert!(b >= a + 8 && b <= a + 16, "{a:#x}-{b:#x}");
    }

    /// Every prefix of `img`, and copies with bytes overwritten, parse without
    /// panicking; a prefix finds `name` at the same place or not at all.
    fn assert_robust(img: &[u8], name: &str) {
        let full = find(img, name.as_bytes()).expect("the symbol in the whole image");
        let mut found = 0;
        for len in 0..=img.len() {
            match find(&img[..len], name.as_bytes()) {
                Some(s) => {
                    assert_eq!(s, full, "prefix of {len} bytes");
                    found += 1;
                }
                None => assert!(len < img.len()),
            }
        }
        assert!(found >= 1);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rng = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..3000 {
            let mut bad = img.to_vec();
            // Mostly the headers and tables near the start, where the offsets are.
            for _ in 0..1 + rng() % 4 {
                let span = if rng() % 2 == 0 { 1024.min(bad.len()) } else { bad.len() };
                let i = (rng() % span as u64) as usize;
                bad[i] = rng() as u8;
            }
            let _ = find(&bad, name.as_bytes());
        }
    }

    #[test]
    fn truncated_and_corrupted_live_images_do_not_panic() {
        let Some(img) = live_image() else {
            eprintln!("SKIPPED truncated_and_corrupted_live_images_do_not_panic: no vDSO in this process");
            return;
        };
        assert_robust(&img, LIVE_NAME);
    }

    /// aarch64 images linked as the kernel links its vDSO (testdata/README.md).
    const AARCH64_IMAGES: [(&str, &[u8]); 2] = [
        ("sysv", include_bytes!("testdata/vdso_aarch64_sysv.so")),
        ("gnu", include_bytes!("testdata/vdso_aarch64_gnu.so")),
    ];

    #[test]
    fn finds_the_signal_return_trampoline_in_linked_aarch64_images() {
        for (hash, img) in AARCH64_IMAGES {
            let s = find(img, b"__kernel_rt_sigreturn").unwrap_or_else(|| panic!("{hash}: not found"));
            assert_eq!(s.size, 0, "{hash}");
            let at = s.addr as usize;
            let words: Vec<u32> =
                img[at..at + 8].chunks(4).map(|w| u32::from_le_bytes(w.try_into().unwrap())).collect();
            // mov x8, #139 (rt_sigreturn); svc #0
            assert_eq!(words, [0xd280_1168, 0xd400_0001], "{hash}: at {at:#x}");
            let f =
                find(img, b"__kernel_clock_gettime").unwrap_or_else(|| panic!("{hash}: no clock_gettime"));
            assert_eq!(f.size, 8, "{hash}");
            // The function, then a nop, then the trampoline.
            assert_eq!(f.addr + 12, s.addr, "{hash}");
            assert_eq!(find(img, b"__kernel_gettimeofday"), None, "{hash}");
            assert_robust(img, "__kernel_rt_sigreturn");
        }
    }

    /// How a built image gives its symbol count.
    #[derive(Clone, Copy)]
    enum Hash {
        Sysv,
        Gnu,
    }

    fn gnu_hash(name: &[u8]) -> u32 {
        name.iter().fold(5381u32, |h, &c| h.wrapping_mul(33).wrapping_add(u32::from(c)))
    }

    /// A minimal shared object laid out as a vDSO (one `PT_LOAD` from offset 0
    /// at address `vaddr`, a `PT_DYNAMIC`), with `syms` (name, offset from the
    /// image start, size) defined.
    fn build(vaddr: u64, syms: &[(&str, u64, u64)], hash: Hash) -> Vec<u8> {
        let mut strtab = vec![0u8];
        let names: Vec<u32> = syms
            .iter()
            .map(|(n, _, _)| {
                let o = strtab.len() as u32;
                strtab.extend_from_slice(n.as_bytes());
                strtab.push(0);
                o
            })
            .collect();
        let n = syms.len() as u32 + 1;
        let hash_tab: Vec<u32> = match hash {
            Hash::Sysv => {
                let mut t = vec![1, n, 0];
                t.extend(0..n);
                t
            }
            Hash::Gnu => {
                // One bucket, one bloom word (all ones), chains for symbols 1..n.
                let mut t = vec![1, 1, 2, 6, u32::MAX, u32::MAX, u32::MAX, u32::MAX, 1];
                for (i, (name, _, _)) in syms.iter().enumerate() {
                    let last = i + 1 == syms.len();
                    t.push(gnu_hash(name.as_bytes()) & !1 | u32::from(last));
                }
                t
            }
        };
        let (phoff, phnum) = (64u64, 2u64);
        let dyn_off = phoff + phnum * PHDR_SIZE;
        let dyn_len = 5 * DYN_SIZE;
        let hash_off = dyn_off + dyn_len;
        let sym_off = (hash_off + hash_tab.len() as u64 * 4).next_multiple_of(8);
        let str_off = sym_off + u64::from(n) * SYM_SIZE;
        let total = str_off + strtab.len() as u64 + 0x40;
        let mut b = vec![0u8; total as usize];
        let put =
            |b: &mut Vec<u8>, off: u64, v: &[u8]| b[off as usize..off as usize + v.len()].copy_from_slice(v);
        put(&mut b, 0, b"\x7fELF\x02\x01\x01");
        put(&mut b, 0x10, &3u16.to_le_bytes()); // ET_DYN
        put(&mut b, 0x12, &183u16.to_le_bytes()); // EM_AARCH64
        put(&mut b, 0x20, &phoff.to_le_bytes());
        put(&mut b, 0x34, &64u16.to_le_bytes());
        put(&mut b, 0x36, &(PHDR_SIZE as u16).to_le_bytes());
        put(&mut b, 0x38, &(phnum as u16).to_le_bytes());
        let phdr = |b: &mut Vec<u8>, at: u64, kind: u32, off: u64, len: u64| {
            put(b, at, &kind.to_le_bytes());
            put(b, at + 8, &off.to_le_bytes());
            put(b, at + 16, &(vaddr + off).to_le_bytes());
            put(b, at + 24, &(vaddr + off).to_le_bytes());
            put(b, at + 32, &len.to_le_bytes());
            put(b, at + 40, &len.to_le_bytes());
        };
        phdr(&mut b, phoff, PT_LOAD, 0, total);
        phdr(&mut b, phoff + PHDR_SIZE, PT_DYNAMIC, dyn_off, dyn_len);
        let hash_tag = match hash {
            Hash::Sysv => DT_HASH,
            Hash::Gnu => DT_GNU_HASH,
        };
        let dynamic = [
            (hash_tag, vaddr + hash_off),
            (DT_SYMTAB, vaddr + sym_off),
            (DT_STRTAB, vaddr + str_off),
            (DT_STRSZ, strtab.len() as u64),
            (DT_NULL, 0),
        ];
        for (i, (tag, val)) in dynamic.iter().enumerate() {
            put(&mut b, dyn_off + i as u64 * DYN_SIZE, &tag.to_le_bytes());
            put(&mut b, dyn_off + i as u64 * DYN_SIZE + 8, &val.to_le_bytes());
        }
        for (i, w) in hash_tab.iter().enumerate() {
            put(&mut b, hash_off + i as u64 * 4, &w.to_le_bytes());
        }
        for (i, (_, off, size)) in syms.iter().enumerate() {
            let s = sym_off + (i as u64 + 1) * SYM_SIZE;
            put(&mut b, s, &names[i].to_le_bytes());
            b[s as usize + 4] = 0x12; // STB_GLOBAL, STT_FUNC
            put(&mut b, s + 6, &1u16.to_le_bytes());
            put(&mut b, s + 8, &(vaddr + off).to_le_bytes());
            put(&mut b, s + 16, &size.to_le_bytes());
        }
        put(&mut b, str_off, &strtab);
        b
    }

    const SYMS: &[(&str, u64, u64)] = &[
        ("__kernel_clock_gettime", 0x10, 0x20),
        ("__kernel_rt_sigreturn", 0x38, 0),
        ("__kernel_getcpu", 0x48, 8),
    ];

    #[test]
    fn finds_symbols_of_built_images_by_either_hash_table() {
        for hash in [Hash::Sysv, Hash::Gnu] {
            for vaddr in [0, 0xffff_ffff_ff70_0000] {
                let b = build(vaddr, SYMS, hash);
                for &(name, off, size) in SYMS {
                    assert_eq!(find(&b, name.as_bytes()), Some(Symbol { addr: off, size }), "{name}");
                }
                assert_eq!(find(&b, b"__kernel_rt_sigreturnX"), None);
                assert_eq!(find(&b, b"__kernel_rt_"), None);
                assert_eq!(find(&b, b""), None);
            }
        }
    }

    #[test]
    fn malformed_images_give_none() {
        let name = b"__kernel_rt_sigreturn";
        let good = build(0, SYMS, Hash::Sysv);
        assert!(find(&good, name).is_some());
        assert_eq!(find(&[], name), None);
        assert_eq!(find(&[0u8; 4096], name), None);
        assert_eq!(find(&good[..63], name), None);
        for len in 0..good.len() - 0x40 {
            assert_eq!(find(&good[..len], name), None, "prefix of {len} bytes");
        }
        let patched = |off: usize, v: &[u8]| {
            let mut b = good.clone();
            b[off..off + v.len()].copy_from_slice(v);
            b
        };
        // 32-bit or big-endian: not read.
        assert_eq!(find(&patched(4, &[1]), name), None);
        assert_eq!(find(&patched(5, &[2]), name), None);
        // Program headers past the end, or too many of them, or too small.
        assert_eq!(find(&patched(0x20, &u64::MAX.to_le_bytes()), name), None);
        assert_eq!(find(&patched(0x38, &u16::MAX.to_le_bytes()), name), None);
        assert_eq!(find(&patched(0x36, &8u16.to_le_bytes()), name), None);
        // The extent read in memory: the load segment's, at most MAX_IMAGE.
        assert_eq!(image_len(&good), Some(good.len() as u64));
        assert_eq!(image_len(&patched(64 + 32, &u64::MAX.to_le_bytes())), None);
        assert_eq!(image_len(&patched(64 + 32, &(MAX_IMAGE + 1).to_le_bytes())), None);
        assert_eq!(image_len(&patched(64 + 8, &u64::MAX.to_le_bytes())), None);
        assert_eq!(image_len(&patched(64, &0u32.to_le_bytes())), None);
        assert_eq!(image_len(&good[..0x40]), None);
        // The dynamic segment outside the loaded one.
        assert_eq!(find(&patched(64 + 56 + 16, &(1u64 << 40).to_le_bytes()), name), None);
        let dyn_off = 64 + 2 * 56;
        // A symbol count no image holds (DT_HASH's nchain).
        let hash_off = dyn_off + 5 * 16;
        assert_eq!(find(&patched(hash_off + 4, &u32::MAX.to_le_bytes()), name), None);
        // A string table size past the end; a symbol table at an address nothing loads.
        assert_eq!(find(&patched(dyn_off + 3 * 16 + 8, &u64::MAX.to_le_bytes()), name), None);
        assert_eq!(find(&patched(dyn_off + 16 + 8, &u64::MAX.to_le_bytes()), name), None);
        // No symbol table at all.
        assert_eq!(find(&patched(dyn_off + 16, &0x7000_0000u64.to_le_bytes()), name), None);
        // A symbol whose name offset is past the string table is skipped, not read.
        let syms = u64_at(&good, dyn_off as u64 + 16 + 8).unwrap() as usize;
        let b = patched(syms + 2 * 24, &u32::MAX.to_le_bytes());
        assert_eq!(find(&b, name), None);
        assert!(find(&b, b"__kernel_getcpu").is_some());
        // A symbol whose code is past the loaded image.
        assert_eq!(find(&patched(syms + 2 * 24 + 8, &(1u64 << 40).to_le_bytes()), name), None);
        // Undefined: skipped.
        assert_eq!(find(&patched(syms + 2 * 24 + 6, &0u16.to_le_bytes()), name), None);
    }

    #[test]
    fn gnu_hash_chains_without_an_end_give_none() {
        let good = build(0, SYMS, Hash::Gnu);
        let name = b"__kernel_getcpu";
        assert!(find(&good, name).is_some());
        let hash_off = 64 + 2 * 56 + 5 * 16;
        let chains = hash_off + 9 * 4;
        let mut b = good.clone();
        // Clear every chain's end bit: the walk goes on into the symbol table
        // and ends at a word there (any answer but a panic or a hang will do).
        for i in 0..SYMS.len() {
            let o = chains + i * 4;
            let h = u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) & !1;
            b[o..o + 4].copy_from_slice(&h.to_le_bytes());
        }
        let _ = find(&b, name);
        // A table whose chain never ends: the walk stops at the end of the image.
        let mut t = vec![0u8; 4096];
        t[..4].copy_from_slice(&1u32.to_le_bytes()); // one bucket, symoffset 0, no bloom
        t[16..20].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(gnu_hash_count(&t, 0), None);
        t[20..24].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(gnu_hash_count(&t, 0), Some(1));
        // A bucket pointing far past the table; a bloom filter of 2^32 words.
        let mut b = good.clone();
        b[hash_off + 32..hash_off + 36].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(find(&b, name), None);
        let mut b = good.clone();
        b[hash_off + 8..hash_off + 12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(find(&b, name), None);
    }
}
