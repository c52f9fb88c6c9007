//! The symbol-table fallback's names: text symbols, each ending where its
//! section ends when it has no size, and names for the PLT stubs
//! (`name@plt`), which no symbol table holds.
//!
//! Without the second, a stripped library's stubs took the name of the
//! symbol before them: libpython's `.plt` and `.plt.sec` follow `_init`,
//! a sizeless symbol in `.init`, and 13% of a Python loop's samples read
//! `_init` where `perf report` says `_Py_NewReference@plt` and
//! `PyIter_Next@plt`. A stub is named from the GOT slot it jumps through
//! (decoded from its instructions: `jmp *slot(%rip)` on x86_64, with or
//! without `endbr64` and `bnd`; `adrp x16` + `ldr x17, [x16, #off]` on
//! aarch64) and the dynamic relocation that fills that slot, so it does not
//! depend on the order of `.rela.plt` nor on which PLT layout the linker
//! chose; a stub that cannot be decoded is `[plt]`.

use std::collections::HashMap;
use std::rc::Rc;

use object::{Object, ObjectSection, ObjectSymbol, ObjectSymbolTable};

use super::file::{Backing, Bytes};

/// Text symbols of `obj` (a view of `data`): (address, size, name), sorted
/// by address, one per address, PLT stubs included, and the names of the
/// aliases left out, by address. Of the aliases at one address the public
/// name is kept ([`preference`]), as `perf report` shows it from a library's
/// `.dynsym`: `malloc`, not `__libc_malloc`; `write`, not
/// `__GI___libc_write` (which a debug file's `.symtab` also holds).
pub(super) fn text_symbols(obj: &object::File<'_>, data: &Bytes) -> (Vec<TextSymbol>, HashMap<Vec<u8>, u64>) {
    let section_end = |s: &object::Symbol<'_, '_>| {
        let index = s.section_index()?;
        let section = obj.section_by_index(index).ok()?;
        section.address().checked_add(section.size())
    };
    let mut symbols: Vec<(u64, u64, Bytes, Preference)> = obj
        .symbols()
        .chain(obj.dynamic_symbols())
        .filter(|s| s.kind() == object::SymbolKind::Text && s.is_definition())
        .filter_map(|s| {
            // A debug file's `.symtab` spells versioned names in full
            // (`pthread_mutex_lock@@GLIBC_2.2.5`): the name is before the `@`.
            let raw = s.name_bytes().ok()?;
            let raw = match raw.iter().position(|&b| b == b'@') {
                Some(at) if at > 0 => &raw[..at],
                _ => raw,
            };
            let name = data.sub(raw)?;
            // A symbol without a size (`_init`, hand-written assembly) covers
            // up to the next symbol, but never past its own section.
            let size = match (s.size(), section_end(&s)) {
                (0, Some(end)) => end.saturating_sub(s.address()),
                (size, _) => size,
            };
            let rank = preference(&s, &name);
            Some((s.address(), size, name, rank))
        })
        .collect();
    symbols.extend(plt_symbols(obj).into_iter().map(|(a, size, n)| (a, size, n, Preference::default())));
    symbols.sort_by(|a, b| (a.0, &a.3).cmp(&(b.0, &b.3)));
    // The names left out, by address: DWARF may name a function by one of
    // them (glibc's `__GI___libc_read`), which is then shown as the kept one.
    let mut aliases = HashMap::new();
    for w in symbols.windows(2) {
        if w[0].0 == w[1].0 && w[0].2[..] != w[1].2[..] {
            aliases.entry(w[1].2.to_vec()).or_insert(w[1].0);
        }
    }
    symbols.dedup_by_key(|s| s.0);
    (symbols.into_iter().map(|(a, size, n, _)| (a, size, n)).collect(), aliases)
}

/// The choice among symbols at one address, smallest first: one with a
/// size, fewer leading underscores (the public name), global before weak
/// before local, the shorter name (`__libc_write` before
/// `__GI___libc_write`).
type Preference = (bool, usize, u8, usize);

fn preference(s: &object::Symbol<'_, '_>, name: &[u8]) -> Preference {
    let underscores = name.iter().take_while(|&&b| b == b'_').count();
    // (`object` counts a weak symbol as global too.)
    let binding = if s.is_weak() {
        1
    } else if s.is_global() {
        0
    } else {
        2
    };
    (s.size() == 0, underscores, binding, name.len())
}

/// A text symbol: address, size, name.
pub(super) type TextSymbol = (u64, u64, Bytes);

/// An owned name, for the names no file holds.
fn owned(name: Vec<u8>) -> Bytes {
    Bytes::whole(Rc::new(Backing::Owned(name)))
}

/// Names for the stubs of the PLT sections: `name@plt` from the GOT slot
/// each jumps through; `[plt]` for the PLT's header and any stub not decoded.
fn plt_symbols(obj: &object::File<'_>) -> Vec<(u64, u64, Bytes)> {
    let mut out = Vec::new();
    let sections: Vec<_> = [".plt", ".plt.sec", ".plt.got", ".iplt"]
        .iter()
        .filter_map(|name| obj.section_by_name(name))
        .collect();
    if sections.is_empty() {
        return out;
    }
    let slots = got_slot_names(obj);
    for section in sections {
        let (Ok(code), addr) = (section.data(), section.address()) else { continue };
        let stubs = match obj.architecture() {
            object::Architecture::X86_64 => x86_64_stubs(code, addr),
            object::Architecture::Aarch64 => aarch64_stubs(code, addr),
            _ => Vec::new(),
        };
        // What comes before the first stub (x86_64's PLT0, aarch64's
        // header; a section of lazy-binding entries whose named stubs are in
        // `.plt.sec`) is `[plt]`.
        let end = addr.saturating_add(code.len() as u64);
        let first = stubs.first().map_or(end, |s| s.0);
        if first > addr {
            out.push((addr, first - addr, owned(b"[plt]".to_vec())));
        }
        for (i, &(start, slot)) in stubs.iter().enumerate() {
            let next = stubs.get(i + 1).map_or(end, |s| s.0);
            let name = match slots.get(&slot) {
                Some(n) => [&n[..], b"@plt"].concat(),
                None => b"[plt]".to_vec(),
            };
            out.push((start, next.saturating_sub(start).max(1), owned(name)));
        }
    }
    out
}

/// The symbol each dynamic relocation fills a slot with, by slot address.
fn got_slot_names(obj: &object::File<'_>) -> HashMap<u64, Vec<u8>> {
    let mut names = HashMap::new();
    let (Some(relocations), Some(table)) = (obj.dynamic_relocations(), obj.dynamic_symbol_table()) else {
        return names;
    };
    for (slot, r) in relocations {
        let object::RelocationTarget::Symbol(index) = r.target() else { continue };
        let Ok(sym) = table.symbol_by_index(index) else { continue };
        match sym.name_bytes() {
            Ok(n) if !n.is_empty() => {
                names.entry(slot).or_insert_with(|| n.to_vec());
            }
            _ => {}
        }
    }
    names
}

/// x86_64 stubs: (start, GOT slot) of each `jmp *disp32(%rip)` (`ff 25`)
/// that begins an entry, alone, after `endbr64`, or with a `bnd` prefix.
/// Entries start 8-byte aligned (`.plt.got`'s are 8 bytes, the others 16).
fn x86_64_stubs(code: &[u8], addr: u64) -> Vec<(u64, u64)> {
    const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
    let mut out = Vec::new();
    let mut at = 0;
    while at + 8 <= code.len() {
        let e = &code[at..];
        let mut jmp = if e.starts_with(&ENDBR64) { 4 } else { 0 };
        if e.get(jmp) == Some(&0xf2) {
            jmp += 1; // bnd
        }
        if let (Some(&[0xff, 0x25]), Some(d)) = (e.get(jmp..jmp + 2), e.get(jmp + 2..jmp + 6)) {
            let disp = i32::from_le_bytes([d[0], d[1], d[2], d[3]]) as i64;
            let next = addr + (at + jmp + 6) as u64;
            out.push((addr + at as u64, next.wrapping_add(disp as u64)));
        }
        at += 8;
    }
    // A 16-byte entry's second half never decodes as a jump (checked above
    // at its own start): nothing to drop.
    out
}

/// aarch64 stubs: (start, GOT slot) of each `adrp x16, page` followed by
/// `ldr x17, [x16, #off]` (the stub starts at a `bti c` just before).
fn aarch64_stubs(code: &[u8], addr: u64) -> Vec<(u64, u64)> {
    const BTI_C: u32 = 0xd503_245f;
    let word = |i: usize| code.get(i..i + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let mut out = Vec::new();
    let mut at = 0;
    while let (Some(adrp), Some(ldr)) = (word(at), word(at + 4)) {
        let is_adrp_x16 = adrp & 0x9f00_001f == 0x9000_0010;
        let is_ldr_x17 = ldr & 0xffc0_03ff == 0xf940_0211;
        if is_adrp_x16 && is_ldr_x17 {
            let immlo = u64::from((adrp >> 29) & 3);
            let immhi = u64::from((adrp >> 5) & 0x7_ffff);
            // 21 bits of pages, sign-extended.
            let pages = (((immhi << 2 | immlo) << 43) as i64 >> 43) as u64;
            let pc = addr + at as u64;
            let page = (pc & !0xfff).wrapping_add(pages << 12);
            let slot = page.wrapping_add(u64::from((ldr >> 10) & 0xfff) * 8);
            let start = if at >= 4 && word(at - 4) == Some(BTI_C) { pc - 4 } else { pc };
            out.push((start, slot));
            at += 8;
        } else {
            at += 4;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x86_64_stubs_of_every_layout_name_their_slot() {
        // .plt: PLT0 (push; jmp *; nop), then `jmp *0x2fe2(%rip); push $0; jmp PLT0`.
        let mut plt = vec![0xff, 0x35, 0, 0, 0, 0, 0xf2, 0xff, 0x25, 0, 0, 0, 0, 0x0f, 0x1f, 0];
        plt.extend([0xff, 0x25, 0xe2, 0x2f, 0, 0, 0x68, 0, 0, 0, 0, 0xe9, 0xe0, 0xff, 0xff, 0xff]);
        let stubs = x86_64_stubs(&plt, 0x1000);
        assert_eq!(stubs, vec![(0x1010, 0x1016 + 0x2fe2)], "PLT0's push is no stub");
        // .plt.sec: `endbr64; bnd jmp *0x10(%rip); nopl`.
        let sec = [0xf3, 0x0f, 0x1e, 0xfa, 0xf2, 0xff, 0x25, 0x10, 0, 0, 0, 0x0f, 0x1f, 0x44, 0, 0];
        assert_eq!(x86_64_stubs(&sec, 0x2000), vec![(0x2000, 0x200b + 0x10)]);
        // .plt.got, 8-byte entries: `jmp *-0x10(%rip); xchg %ax,%ax` twice.
        let got =
            [0xff, 0x25, 0xf0, 0xff, 0xff, 0xff, 0x66, 0x90, 0xff, 0x25, 0xf0, 0xff, 0xff, 0xff, 0x66, 0x90];
        assert_eq!(x86_64_stubs(&got, 0x3000), vec![(0x3000, 0x2ff6), (0x3008, 0x2ffe)]);
        assert!(x86_64_stubs(&[0x90; 7], 0).is_empty(), "shorter than an entry");
    }

    #[test]
    fn aarch64_stubs_name_their_slot() {
        // At 0x10010: `adrp x16, 0x20000` (16 pages on), `ldr x17, [x16, #0x18]`,
        // `add x16, x16, #0x18`, `br x17`, after a `bti c`.
        let pages: u32 = 16;
        let adrp: u32 = 0x9000_0010 | ((pages & 3) << 29) | ((pages >> 2) << 5);
        let ldr: u32 = 0xf940_0211 | ((0x18 / 8) << 10);
        let words = [0xd503_245f, adrp, ldr, 0x9100_6210, 0xd61f_0220];
        let code: Vec<u8> = words.iter().flat_map(|w: &u32| w.to_le_bytes()).collect();
        assert_eq!(aarch64_stubs(&code, 0x1000c), vec![(0x1000c, 0x20018)]);
        // A negative page offset: `adrp x16, -1 page`.
        let back: u32 = 0x9000_0010 | (3 << 29) | (0x7_ffff << 5);
        let code: Vec<u8> = [back, ldr].iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(aarch64_stubs(&code, 0x5004), vec![(0x5004, 0x4018)]);
    }

    /// Of glibc's aliases the public name is kept: `malloc` (not
    /// `__libc_malloc`), `write` (not `__write`).
    #[test]
    fn the_public_alias_is_kept() {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let Some(path) =
            maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.contains("libc.so.6"))
        else {
            eprintln!("SKIPPED: no glibc in this process");
            return;
        };
        let bytes = std::fs::read(path).unwrap();
        let data = owned(bytes);
        let obj = object::File::parse(&*data).unwrap();
        let (symbols, aliases) = text_symbols(&obj, &data);
        let kept = |alias: &str| {
            let at = *aliases.get(alias.as_bytes())?;
            let s = symbols.iter().find(|s| s.0 == at)?;
            Some(String::from_utf8_lossy(&s.2).into_owned())
        };
        if !cfg!(target_arch = "x86_64") && kept("__libc_malloc").is_none() {
            // (The aarch64 run reads the cross sysroot's libc under qemu-user.)
            eprintln!("SKIPPED: {path} without the aliases looked for");
            return;
        }
        assert_eq!(kept("__libc_malloc").as_deref(), Some("malloc"), "{path}");
        assert_eq!(kept("__write").as_deref(), Some("write"), "{path}");
        // No kept name carries a symbol version.
        assert!(symbols.iter().all(|s| !s.2.contains(&b'@') || s.2.ends_with(b"@plt")), "{path}");
    }

    /// This test binary's own PLT (a PIE linked against libc): every stub
    /// decoded names a dynamic symbol, and `malloc` has one.
    #[test]
    fn this_binarys_plt_is_named() {
        let Ok(bytes) = std::fs::read("/proc/self/exe") else { return };
        let obj = object::File::parse(&*bytes).expect("own executable parses");
        let plt = plt_symbols(&obj);
        let names: Vec<String> = plt.iter().map(|s| String::from_utf8_lossy(&s.2).into_owned()).collect();
        if obj.section_by_name(".plt").is_none() && obj.section_by_name(".plt.sec").is_none() {
            eprintln!("SKIPPED: no PLT in this binary ({names:?})");
            return;
        }
        assert!(
            names.iter().any(|n| n.ends_with("@plt")),
            "no stub named in {} PLT entries: {names:?}",
            plt.len()
        );
        for (start, size, _) in &plt {
            assert!(*size > 0 && *size <= 0x10000, "stub at {start:#x} of {size} bytes");
        }
    }
}
