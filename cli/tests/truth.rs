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
    let src = dir.join("a.rs");
    std::fs::write(&src, RUST_SRC).unwrap();
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
    let mut raw = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::GzDecoder::new(std::fs::File::open(&pb).unwrap()),
        &mut raw,
    )
    .unwrap();
    let prof = <spulse_cli::export::pprof::Profile as prost::Message>::decode(&*raw).unwrap();
    let st = |i: i64| prof.string_table[i as usize].as_str();
    let a = prof.function.iter().find(|f| st(f.name) == "<a::A as a::Peek>::peek").expect("A::peek");
    assert_eq!(vec![st(a.system_name).to_string()], b.linkage("<a::A as a::Peek>::peek"));
    assert!(prof.function.iter().all(|f| f.system_name != f.name), "system_name is never the display name");

    // go tool pprof with its default symbolization and demangling.
    let out = Command::new("go")
        .args(["tool", "pprof", "-top", "-noinlines", "-sample_index=samples", "-nodecount=100"])
        .arg(&pb)
        .env("PPROF_TMPDIR", dir.path())
        .env("HOME", dir.path())
        .output()
        .expect("go tool pprof (install Debian's golang-go)");
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
