//! The default views tell the truth: one Rust demangling display whether a
//! symbol is v0 or legacy mangled, and pprof's `system_name` is the linkage
//! name so that `go tool pprof` neither re-demangles nor merges functions.
//! The Firefox export keeps inlined frames, in JSON and in the JsonSlabs
//! container alike.

mod common;
#[path = "common/jslb.rs"]
mod jslb_read;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use object::{Object, ObjectSegment, ObjectSymbol};
use spulse::{Frame, NewModule, SpoolWriter};
use spulse_cli::symbolize::demangle;

const RUST_SRC: &str = r#"
pub trait Peek { fn peek(&self, n: u64) -> u64; }
pub struct A;
pub struct B;
impl Peek for A {
    #[inline(never)]
    fn peek(&self, n: u64) -> u64 { (0..n).fold(1, |h, i| h ^ i.wrapping_mul(31)) }
}
impl Peek for B {
    #[inline(never)]
    fn peek(&self, n: u64) -> u64 { (0..n).fold(7, |h, i| h.rotate_left(3) ^ i) }
}
impl A {
    #[inline(never)]
    pub fn inherent(&self, n: u64) -> u64 { std::hint::black_box(n).wrapping_mul(7) }
}
#[inline(never)]
pub fn generic<T: Copy + Into<u64>>(x: T) -> u64 { std::hint::black_box(x.into()) * 3 }
fn main() {
    let n = std::hint::black_box(10);
    println!("{}", A.peek(n) + B.peek(n) + generic(3u32) + generic(4u16) + A.inherent(n));
}
"#;

/// Compile the Rust fixture (crate `a`) into `dir/name` with extra rustc flags.
fn rust_program(dir: &Path, name: &str, flags: &[&str]) -> PathBuf {
    compile_rust(dir, RUST_SRC, name, flags)
}

/// Compile `source` (written to `dir/a.rs`) with `rustc` (optimized, with
/// debug info and a build id, then `flags`) into `dir/name`.
fn compile_rust(dir: &Path, source: &str, name: &str, flags: &[&str]) -> PathBuf {
    let src = dir.join("a.rs");
    std::fs::write(&src, source).unwrap();
    let exe = dir.join(name);
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let o = Command::new(&rustc)
        .args(["-g", "-O", "--crate-name", "a", "-C", "link-arg=-Wl,--build-id"])
        .args(flags)
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("run {rustc}: {e}"));
    assert!(o.status.success(), "rustc: {}", String::from_utf8_lossy(&o.stderr));
    exe
}

/// A module over `exe` in a spool being written, with one `main;<function>`
/// stack per (linkage name filter, samples) entry.
struct Binary {
    build_id: Vec<u8>,
    /// Executable segment: (file offset, file size, vaddr, memsz).
    seg: (u64, u64, u64, u64),
    /// (linkage name, vaddr, size) of every text symbol.
    symbols: Vec<(String, u64, u64)>,
}

fn binary(exe: &Path) -> Binary {
    let data = std::fs::read(exe).unwrap();
    let obj = object::File::parse(&*data).unwrap();
    let build_id = obj.build_id().unwrap().expect("build id").to_vec();
    let symbols: Vec<(String, u64, u64)> = obj
        .symbols()
        .filter(|s| s.kind() == object::SymbolKind::Text && s.size() > 0)
        .map(|s| (s.name().unwrap().to_string(), s.address(), s.size()))
        .collect();
    let main = symbols.iter().find(|s| demangle(&s.0) == "a::main").expect("a::main");
    let seg = obj
        .segments()
        .map(|s| (s.file_range().0, s.file_range().1, s.address(), s.size()))
        .find(|&(_, fs, va, _)| main.1 >= va && main.1 < va + fs)
        .unwrap();
    Binary { build_id, seg, symbols }
}

impl Binary {
    /// File offsets inside every function whose linkage name demangles to `name`.
    fn offsets(&self, name: &str) -> Vec<u64> {
        let v: Vec<u64> = self
            .symbols
            .iter()
            .filter(|s| demangle(&s.0) == name)
            .map(|s| s.1 + s.2 / 2 - self.seg.2 + self.seg.0)
            .collect();
        assert!(!v.is_empty(), "no symbol demangles to {name}");
        v
    }

    /// The linkage names of every function that demangles to `name`.
    fn linkage(&self, name: &str) -> Vec<String> {
        self.symbols.iter().filter(|s| demangle(&s.0) == name).map(|s| s.0.clone()).collect()
    }
}

/// Write a spool over `exe`: `main;f` with `n` samples for each (f, n); a
/// function with several instances (generic) spreads its samples over them.
fn spool_over(exe: &Path, b: &Binary, spool: &Path, stacks: &[(&str, u64)]) {
    let file = std::fs::File::create(spool).unwrap();
    let mut w = SpoolWriter::new(file, header()).unwrap();
    let mp = exe.as_os_str().as_encoded_bytes().to_vec();
    let m = w
        .define_module(&NewModule {
            pid: PID,
            start: BASE + b.seg.2,
            size: b.seg.3,
            file_offset: b.seg.0,
            generation: 1,
            path: &mp,
            build_id: &b.build_id,
        })
        .unwrap();
    let th = w.define_thread(PID, PID, "main").unwrap();
    let f_main = w.define_frame(Frame::Module { module: m, file_relative: b.offsets("a::main")[0] }).unwrap();
    let s_main = w.define_stack(None, f_main).unwrap();
    let mut t = START_US;
    for &(name, n) in stacks {
        let offs = b.offsets(name);
        for i in 0..n {
            let off = offs[i as usize % offs.len()];
            let f = w.define_frame(Frame::Module { module: m, file_relative: off }).unwrap();
            let st = w.define_stack(Some(s_main), f).unwrap();
            t += INTERVAL_US;
            w.sample(t, th, st).unwrap();
        }
    }
    w.into_inner().unwrap();
}

fn top_self(spool: &Path) -> HashMap<String, u64> {
    let v: serde_json::Value = serde_json::from_str(&ok(&["top", s(spool), "--json", "-n", "0"])).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| (r["function"].as_str().unwrap().to_string(), r["self"].as_u64().unwrap()))
        .collect()
}

const STACKS: &[(&str, u64)] = &[
    ("<a::A as a::Peek>::peek", 3),
    ("<a::B as a::Peek>::peek", 1),
    ("a::generic", 4),
    ("a::A::inherent", 2),
];

#[test]
fn legacy_and_v0_symbols_display_alike() {
    let dir = tempfile::tempdir().unwrap();
    let legacy = rust_program(dir.path(), "a_legacy", &[]);
    let v0 = rust_program(dir.path(), "a_v0", &["-C", "symbol-mangling-version=v0"]);
    let (bl, bv) = (binary(&legacy), binary(&v0));
    // The fixtures really are mangled both ways, and generic instances differ
    // in their v0 names.
    assert!(bl.linkage("a::generic").iter().all(|n| n.starts_with("_ZN")), "{:?}", bl.linkage("a::generic"));
    let v0_generic = bv.linkage("a::generic");
    assert!(v0_generic.iter().all(|n| n.starts_with("_R")) && v0_generic.len() == 2, "{v0_generic:?}");
    let mut views = Vec::new();
    for (exe, b) in [(&legacy, &bl), (&v0, &bv)] {
        let spool = dir.path().join(format!("{}.spool", exe.file_name().unwrap().to_str().unwrap()));
        spool_over(exe, b, &spool, STACKS);
        views.push(top_self(&spool));
    }
    let want: HashMap<String, u64> =
        STACKS.iter().map(|&(n, c)| (n.to_string(), c)).chain([("a::main".into(), 0)]).collect();
    assert_eq!(views[0], want, "legacy");
    assert_eq!(views[1], want, "v0");
}

#[test]
fn go_tool_pprof_keeps_trait_impls_apart() {
    let dir = tempfile::tempdir().unwrap();
    let exe = rust_program(dir.path(), "a_legacy", &[]);
    let b = binary(&exe);
    let spool = dir.path().join("a.spool");
    spool_over(&exe, &b, &spool, STACKS);
    let pb = dir.path().join("a.pb.gz");
    ok(&["export", s(&spool), "--format", "pprof", "-o", s(&pb)]);

    // Our own decoding: system_name is the linkage name.
    let prof = read_pprof(&pb);
    let st = |i: i64| prof.string_table[i as usize].as_str();
    let a = prof.function.iter().find(|f| st(f.name) == "<a::A as a::Peek>::peek").expect("A::peek");
    assert_eq!(vec![st(a.system_name).to_string()], b.linkage("<a::A as a::Peek>::peek"));
    assert!(prof.function.iter().all(|f| f.system_name != f.name), "system_name is never the display name");

    // go tool pprof with its default symbolization and demangling (outside
    // CI, a missing `go` skips this part loudly; in CI it fails).
    if !have_go_pprof() {
        return;
    }
    let out = Command::new("go")
        .args(["tool", "pprof", "-top", "-noinlines", "-sample_index=samples", "-nodecount=100"])
        .arg(&pb)
        .env("PPROF_TMPDIR", dir.path())
        .env("HOME", dir.path())
        .output()
        .expect("run go tool pprof");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "go tool pprof: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    let flat = |name: &str| {
        text.lines()
            .find(|l| l.trim_end().ends_with(name))
            .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} not in go tool pprof -top:\n{text}"))
    };
    assert_eq!(flat(" <a::A as a::Peek>::peek"), 3.0, "{text}");
    assert_eq!(flat(" <a::B as a::Peek>::peek"), 1.0, "{text}");
    assert_eq!(flat(" a::generic"), 4.0, "{text}");
}

#[test]
fn firefox_profile_names_processes_and_keeps_inlined_frames_with_addresses() {
    let dir = tempfile::tempdir().unwrap();
    let exe = rust_program(dir.path(), "a_legacy", &[]);
    let b = binary(&exe);
    let spool = dir.path().join("a.spool");
    spool_over(&exe, &b, &spool, STACKS);
    let out = dir.path().join("a.json");
    ok(&["export", s(&spool), "--format", "firefox", "-o", s(&out)]);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();

    let cats: Vec<&str> =
        v["meta"]["categories"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    let cat =
        |n: &str| cats.iter().position(|c| *c == n).unwrap_or_else(|| panic!("no category {n}: {cats:?}"));
    let threads = v["threads"].as_array().unwrap();
    assert_eq!(threads.len(), 1);
    let th = &threads[0];
    // The spool's only thread is the process's main thread (tid == pid).
    assert_eq!(th["processName"], "a_legacy");
    assert_eq!(th["name"], "a_legacy");

    let strings = th["stringArray"].as_array().unwrap();
    let st = |i: &serde_json::Value| strings[i.as_u64().unwrap() as usize].as_str().unwrap();
    let (ft, fu) = (&th["frameTable"], &th["funcTable"]);
    let n = ft["length"].as_u64().unwrap() as usize;
    let mut seen_inline = false;
    for i in 0..n {
        let f = ft["func"][i].as_u64().unwrap() as usize;
        let name = st(&fu["name"][f]);
        assert!(!name.starts_with('\u{1}'), "placeholder left in the profile");
        let depth = ft["inlineDepth"][i].as_u64().unwrap();
        let category = ft["category"][i].as_u64().unwrap() as usize;
        if depth > 0 {
            seen_inline = true;
            // An inlined frame has the address and library of the frame it is
            // inlined into.
            let addr = ft["address"][i].as_i64().unwrap();
            assert!(addr >= 0, "inlined {name} has no address");
            let res = fu["resource"][f].as_i64().unwrap();
            assert!(res >= 0, "inlined {name} has no library");
            assert!(
                (0..n).any(|j| ft["inlineDepth"][j] == 0 && ft["address"][j].as_i64() == Some(addr)),
                "no depth-0 frame at {addr:#x} for inlined {name}"
            );
        }
        let want = if name.starts_with("core::") || name.starts_with("std::") || name.starts_with("<core::") {
            "Std/libc"
        } else {
            "User code"
        };
        assert_eq!(category, cat(want), "{name} in {}", cats[category]);
        if name == "<a::A as a::Peek>::peek" {
            // The source view: the function's file and the frame's line.
            assert!(st(&fu["fileName"][f]).ends_with("a.rs"), "{}", fu["fileName"][f]);
            assert!(ft["line"][i].as_u64().is_some_and(|l| l > 0), "no line for {name}");
        }
    }
    assert!(seen_inline, "the optimised fixture has inlined frames");
    // One function per (name, library): the call tree merges its frames.
    let fnames: Vec<(String, i64)> = (0..fu["length"].as_u64().unwrap() as usize)
        .filter(|&f| (0..n).any(|i| ft["func"][i] == f))
        .map(|f| (st(&fu["name"][f]).to_string(), fu["resource"][f].as_i64().unwrap()))
        .collect();
    let mut dedup = fnames.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(dedup.len(), fnames.len(), "{fnames:?}");

    // The JsonSlabs export (format 70, shared tables) has the same frames,
    // inlined ones with their addresses, lines, files and categories.
    let jslb = dir.path().join("a.jslb");
    ok(&["export", s(&spool), "--format", "firefox", "-o", s(&jslb)]);
    let r = jslb_read::read_jslb(&std::fs::read(&jslb).unwrap());
    let (a, b) = (jslb_read::describe(&r.profile, true), jslb_read::describe(&v, false));
    assert_eq!(a, b);
    let inlined =
        a.iter().flat_map(|t| &t.samples).flat_map(|(_, fs)| fs).filter(|f| f.inline_depth > 0).count();
    assert!(inlined > 0, "no inlined frame in the .jslb profile");
}

/// A recorded workload whose stacks hold closures of the application (legacy
/// mangled), of the standard library (v0), and std generics instantiated in
/// the application (legacy again).
const RECORDED_SRC: &str = r#"
use std::hint::black_box;
#[inline(never)]
fn spin(seed: u64, n: u64) -> u64 {
    let mut h = seed;
    for i in 0..n { h = h.rotate_left(5) ^ i.wrapping_mul(0x9e37_79b9); }
    h
}
mod m { pub struct W<T>(pub T, pub u64); }
// An impl outside its type's module: legacy names it `a::imp::<impl .. for ..>::next`.
mod imp {
    impl<T: Copy + Into<u64>> Iterator for crate::m::W<T> {
        type Item = u64;
        #[inline(never)]
        fn next(&mut self) -> Option<u64> {
            self.1 += 1;
            if self.1 > 1000 { None } else { Some(self.0.into() ^ self.1) }
        }
    }
}
fn main() {
    let ms: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(300);
    println!("{}", m::W(black_box(3u32), 0).sum::<u64>());
    let end = std::time::Instant::now() + std::time::Duration::from_millis(ms);
    let t = std::thread::spawn(move || {
        let mut x = 0;
        while std::time::Instant::now() < end { x ^= spin(x, 20_000); }
        x
    });
    let mut n = 0u64;
    while std::time::Instant::now() < end {
        n += black_box(std::fs::metadata("/")).is_ok() as u64;
        let v: Vec<u64> = (0..64).map(|k| spin(k, 200)).collect();
        n ^= v.iter().sum::<u64>();
    }
    println!("{} {}", n, t.join().unwrap());
}
"#;

/// Why `name` is not in the one display style, if it is not: v0 spellings
/// (`{closure#0}`, `{shim:vtable#0}`, a shim as its own segment, `<a::Type>::f`),
/// generic arguments, or a legacy hash.
fn style_violation(name: &str) -> Option<&'static str> {
    if name.contains("{closure#") || name.contains("{shim:") || name.contains("{constant#") {
        return Some("a v0 `{kind#N}` segment");
    }
    if name.contains("::{{vtable.shim}}") {
        return Some("a shim as a separate segment (legacy glues it: `f{{vtable.shim}}`)");
    }
    if name.contains("<impl ") {
        return Some("legacy's `module::<impl Trait for Type>` (v0 and the display: `<Type as Trait>`)");
    }
    if name.contains("::<") {
        return Some("generic arguments");
    }
    let b = name.as_bytes();
    for (i, _) in name.match_indices("::h") {
        let hex = &b[i + 3..];
        if hex.len() >= 16
            && hex[..16].iter().all(u8::is_ascii_hexdigit)
            && hex.get(16).is_none_or(|c| !c.is_ascii_alphanumeric())
        {
            return Some("a legacy hash");
        }
    }
    // v0's inherent-impl brackets around a path type, at a segment start.
    for (i, _) in name.match_indices('<') {
        let at_start = i == 0 || name[..i].ends_with("::") || name[..i].ends_with('<');
        let rest = &name[i + 1..];
        if let Some(end) = rest.find('>') {
            let inner = &rest[..end];
            let path = inner.contains("::")
                && !inner.contains([' ', '<', '&', '*', '[', '('])
                && inner.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_');
            if at_start && path && rest[end + 1..].starts_with("::") {
                return Some("v0's `<a::Type>::f` for an inherent method");
            }
        }
    }
    None
}

fn check_style<'a>(view: &str, names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let names: Vec<&str> = names.into_iter().collect();
    assert!(!names.is_empty(), "{view}: no names");
    let bad: Vec<String> =
        names.iter().filter_map(|n| style_violation(n).map(|why| format!("{n}: {why}"))).collect();
    assert!(bad.is_empty(), "{view} mixes display styles:\n{}", bad.join("\n"));
    names.iter().map(|n| n.to_string()).collect()
}

/// Every view of a real recording (`top`, with and without `--inlines`, the
/// collapsed, pprof, Firefox and speedscope exports) spells every name one
/// way, whether it came from a legacy or a v0 symbol or from DWARF; and so
/// does the demangling of every Rust symbol of the program, built with either
/// mangling.
#[test]
fn one_demangling_style_in_every_view_of_a_recording() {
    let dir = tempfile::tempdir().unwrap();
    for (exe, flags) in [("w_legacy", &[][..]), ("w_v0", &["-C", "symbol-mangling-version=v0"][..])] {
        let exe = compile_rust(dir.path(), RECORDED_SRC, exe, flags);

        // Every Rust symbol of the program, in both manglings.
        let data = std::fs::read(&exe).unwrap();
        let obj = object::File::parse(&*data).unwrap();
        let demangled: Vec<String> = obj
            .symbols()
            .filter_map(|s| s.name().ok())
            .filter(|n| n.starts_with("_R") || n.starts_with("_ZN"))
            .map(|n| demangle(n).into_owned())
            .collect();
        assert!(demangled.len() > 100, "{} Rust symbols", demangled.len());
        check_style("symbol table", demangled.iter().map(String::as_str));
        // The impl outside its type's module reads the same from both manglings.
        let impl_next = "<a::m::W as core::iter::traits::iterator::Iterator>::next";
        assert!(demangled.iter().any(|n| n == impl_next), "{}: no {impl_next}", exe.display());

        let spool = dir.path().join(format!("{}.spool", exe.file_name().unwrap().to_str().unwrap()));
        let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
            .args(["record", "-o", s(&spool), "--"])
            .arg(&exe)
            .arg("400")
            .output()
            .unwrap();
        assert!(o.status.success(), "spulse record: {}", stderr(&o));
        let view = |v: &str| format!("{} {v}", exe.display());

        let mut all = Vec::new();
        for extra in [&[][..], &["--inlines"][..]] {
            let json: serde_json::Value =
                serde_json::from_str(&ok(&[&["top", s(&spool), "--json", "-n", "0"][..], extra].concat()))
                    .unwrap();
            let names: Vec<&str> =
                json.as_array().unwrap().iter().map(|r| r["function"].as_str().unwrap()).collect();
            all.extend(check_style(&view(&format!("top {extra:?}")), names));
        }

        let folded = dir.path().join("w.folded");
        ok(&["export", s(&spool), "--format", "collapsed", "-o", s(&folded)]);
        let text = std::fs::read_to_string(&folded).unwrap();
        let names = text.lines().flat_map(|l| l.rsplit_once(' ').expect("`stack count`").0.split(';'));
        all.extend(check_style(&view("collapsed"), names));

        let pb = dir.path().join("w.pb.gz");
        ok(&["export", s(&spool), "--format", "pprof", "-o", s(&pb)]);
        let prof = read_pprof(&pb);
        let names = prof.function.iter().map(|f| prof.string_table[f.name as usize].as_str());
        all.extend(check_style(&view("pprof"), names));

        let ff = dir.path().join("w.json");
        ok(&["export", s(&spool), "--format", "firefox", "-o", s(&ff)]);
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ff).unwrap()).unwrap();
        for th in v["threads"].as_array().unwrap() {
            let strings = th["stringArray"].as_array().unwrap();
            let names = th["funcTable"]["name"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| strings[i.as_u64().unwrap() as usize].as_str().unwrap());
            all.extend(check_style(&view("firefox"), names));
        }

        let sc = dir.path().join("w.speedscope.json");
        ok(&["export", s(&spool), "--format", "speedscope", "-o", s(&sc)]);
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sc).unwrap()).unwrap();
        let names = v["shared"]["frames"].as_array().unwrap().iter().map(|f| f["name"].as_str().unwrap());
        all.extend(check_style(&view("speedscope"), names));

        // The check looked at closures of both kinds: the application's own
        // and the standard library's.
        assert!(
            all.iter().any(|n| n.starts_with("a::main::{{closure}}")),
            "{}: {all:?}",
            view("app closure")
        );
        assert!(
            all.iter().any(|n| n.starts_with("std::") && n.contains("{{closure}}")),
            "{}: {all:?}",
            view("std closure")
        );
    }
}
