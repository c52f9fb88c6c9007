//! Spools are untrusted: module paths that name FIFOs (the module file, its
//! `.dwp`, a split-DWARF `.dwo`, a debug file, a perf map) never block the
//! symbolizer, and one file under many spellings of its path is loaded once.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use spulse::{Frame, SpoolWriter};
use spulse_cli::select::Context;
use spulse_cli::symbolize::{Options, Symbolizer};

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
}

/// Run the real binary, failing (and killing it) if it has not finished within
/// a minute: a symbolizer that opens a FIFO for reading waits forever.
fn run_bounded(args: &[&str]) -> std::process::Output {
    let mut child = spawn_spulse(args);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            let _ = child.wait();
            panic!("spulse {args:?} still running after 60 s (blocked on a FIFO?)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn top_functions(spool: &Path, extra: &[&str]) -> Vec<(String, u64)> {
    let mut args = vec!["top", s(spool), "--json"];
    args.extend_from_slice(extra);
    let o = run_bounded(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| (r["function"].as_str().unwrap().to_string(), r["self"].as_u64().unwrap()))
        .collect()
}

#[test]
fn fifo_module_file_is_left_unsymbolized() {
    let p = program();
    let fifo = p.dir.path().join("fifo-module");
    mkfifo(&fifo);
    let spool = p.dir.path().join("fifo.spool");
    let mp = fifo.as_os_str().as_encoded_bytes().to_vec();
    // With and without a build id (without one only the named file is tried).
    for bid in [&p.build_id[..], &[][..]] {
        write_spool(&p, &Spec { path: &spool, module_path: &mp, build_id: bid, a_t1: 3, a_t2: 0, b_t1: 1 });
        let rows = top_functions(&spool, &["--split-unknown"]);
        assert!(!rows.is_empty());
        assert!(rows.iter().all(|(f, _)| f.starts_with("fifo-module+0x")), "{rows:?}");
    }
}

#[test]
fn fifo_debug_file_candidate_is_skipped() {
    let p = program();
    // A FIFO where the debug file would be looked up by name in --symbols.
    let dir = p.dir.path().join("syms");
    std::fs::create_dir(&dir).unwrap();
    mkfifo(&dir.join("hotprog.debug"));
    mkfifo(&dir.join("hotprog"));
    let stripped = p.dir.path().join("hotprog-stripped");
    let st = Command::new("objcopy").args(["--strip-debug", s(&p.path), s(&stripped)]).status().unwrap();
    assert!(st.success());
    let spool = p.dir.path().join("stripped.spool");
    let mp = stripped.as_os_str().as_encoded_bytes().to_vec();
    write_spool(
        &p,
        &Spec { path: &spool, module_path: &mp, build_id: &p.build_id, a_t1: 3, a_t2: 0, b_t1: 1 },
    );
    // The symbol table of the stripped file still names the functions.
    let rows = top_functions(&spool, &["--symbols", s(&dir)]);
    assert_eq!(rows.iter().find(|r| r.0 == "hot_a").map(|r| r.1), Some(3), "{rows:?}");
}

#[test]
fn fifo_dwp_beside_the_module_is_skipped() {
    let p = program();
    let mut dwp = p.path.clone().into_os_string();
    dwp.push(".dwp");
    mkfifo(Path::new(&dwp));
    let spool = p.dir.path().join("dwp.spool");
    standard(&p, &spool);
    let rows = top_functions(&spool, &[]);
    assert_eq!(rows.iter().find(|r| r.0 == "hot_a").map(|r| r.1), Some(300), "{rows:?}");
}

/// Build the test program with split DWARF (`-gsplit-dwarf`): the executable
/// names its `.dwo` files, which are read when a frame is looked up.
fn split_dwarf_program(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let src = dir.join("split.c");
    std::fs::write(
        &src,
        "static inline __attribute__((always_inline)) int sq(int x) { return x * x; }\n\
         __attribute__((noinline)) int hot_s(int n) { int t = 0; for (int i = 0; i < n; i++) t += sq(i); return t; }\n\
         int main(int c, char **v) { return hot_s(c * 1000); }\n",
    )
    .unwrap();
    let exe = dir.join("splitprog");
    let o = Command::new("cc")
        .current_dir(dir)
        .args(["-g", "-O2", "-gsplit-dwarf", "-Wl,--build-id", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert!(o.status.success(), "cc -gsplit-dwarf: {}", String::from_utf8_lossy(&o.stderr));
    // gcc names the .dwo after the output and source (`splitprog-split.dwo`).
    let dwo = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "dwo"))?;
    Some((exe, dwo))
}

#[test]
fn fifo_dwo_is_skipped_and_a_real_dwo_is_read() {
    use object::{Object, ObjectSegment, ObjectSymbol};
    let dir = tempfile::tempdir().unwrap();
    let (exe, dwo) =
        split_dwarf_program(dir.path()).expect("cc -gsplit-dwarf wrote no .dwo file next to the program");
    let data = std::fs::read(&exe).unwrap();
    let obj = object::File::parse(&*data).unwrap();
    let build_id = obj.build_id().unwrap().unwrap().to_vec();
    let sym = obj.symbols().find(|s| s.name() == Ok("hot_s")).unwrap();
    let seg = obj
        .segments()
        .map(|s| (s.file_range().0, s.file_range().1, s.address(), s.size()))
        .find(|&(_, fs, va, _)| sym.address() >= va && sym.address() < va + fs)
        .unwrap();
    // Every address of hot_s: the split DWARF names the inlined `sq` at some.
    let spool = dir.path().join("split.spool");
    let file = std::fs::File::create(&spool).unwrap();
    let mut w = SpoolWriter::new(file, header()).unwrap();
    let mp = exe.as_os_str().as_encoded_bytes().to_vec();
    let m = w
        .define_module(&spulse::NewModule {
            pid: PID,
            start: BASE + seg.2,
            size: seg.3,
            file_offset: seg.0,
            generation: 1,
            path: &mp,
            build_id: &build_id,
        })
        .unwrap();
    let th = w.define_thread(PID, PID, "main").unwrap();
    for a in sym.address()..sym.address() + sym.size() {
        let f = w.define_frame(Frame::Module { module: m, file_relative: a - seg.2 + seg.0 }).unwrap();
        let st = w.define_stack(None, f).unwrap();
        w.sample(START_US + (a - sym.address() + 1) * INTERVAL_US, th, st).unwrap();
    }
    w.into_inner().unwrap();

    // With the real .dwo the inlined helper is found.
    let rows = top_functions(&spool, &["--inlines", "-n", "0"]);
    assert!(rows.iter().any(|r| r.0 == "sq"), "split DWARF not read: {rows:?}");
    // Replaced by a FIFO: no blocking, and the symbol table still names hot_s.
    std::fs::remove_file(&dwo).unwrap();
    mkfifo(&dwo);
    let rows = top_functions(&spool, &["--inlines", "-n", "0"]);
    assert!(rows.iter().all(|r| r.0 != "sq"), "{rows:?}");
    assert_eq!(rows.iter().map(|r| r.1).sum::<u64>(), sym.size());
    assert!(rows.iter().any(|r| r.0 == "hot_s"), "{rows:?}");
}

/// 100 spellings of one path: `./`, doubled slashes, `..` and symlinks.
fn spellings(p: &Program) -> Vec<Vec<u8>> {
    let dir = p.dir.path();
    let base = dir.file_name().unwrap().to_str().unwrap().to_string();
    let d = dir.to_str().unwrap();
    let mut out = Vec::new();
    for i in 0..100 {
        let path = match i % 4 {
            0 => format!("{d}/{}hotprog", "./".repeat(i / 4 + 1)),
            1 => format!("{d}{}hotprog", "/".repeat(i / 4 + 2)),
            2 => format!("{d}/{}hotprog", format!("../{base}/").repeat(i / 4 + 1)),
            _ => {
                let link = dir.join(format!("link{i}"));
                std::os::unix::fs::symlink(&p.path, &link).unwrap();
                link.to_str().unwrap().to_string()
            }
        };
        out.push(path.into_bytes());
    }
    out.sort();
    out.dedup();
    assert_eq!(out.len(), 100);
    out
}

#[test]
fn many_spellings_of_one_file_load_it_once() {
    let p = program();
    let paths = spellings(&p);
    for with_build_id in [true, false] {
        let spool = p.dir.path().join(format!("spell-{with_build_id}.spool"));
        let file = std::fs::File::create(&spool).unwrap();
        let mut w = SpoolWriter::new(file, header()).unwrap();
        let th = w.define_thread(PID, PID, "main").unwrap();
        let mut frames = Vec::new();
        for (i, path) in paths.iter().enumerate() {
            let bid: &[u8] = if with_build_id { &p.build_id } else { &[] };
            let m = define_program(&mut w, &p, PID + i as u32, path, bid);
            let f = w.define_frame(Frame::Module { module: m, file_relative: p.hot_a }).unwrap();
            let st = w.define_stack(None, f).unwrap();
            w.sample(START_US + (i as u64 + 1) * INTERVAL_US, th, st).unwrap();
            frames.push(f);
        }
        w.into_inner().unwrap();

        let replay = spulse_cli::input::open_replay(&spool).unwrap();
        let mut sym = Symbolizer::new(Options::default());
        let ctx = Context { thread: None, pid: PID, perf_map_allowed: false };
        for &f in &frames {
            let r = sym.resolve(&replay, f, &ctx);
            assert_eq!(sym.function(r.outer().func).name, "hot_a", "{with_build_id} {:?}", replay.frame(f));
        }
        assert_eq!(sym.files_loaded(), 1, "build id recorded: {with_build_id}");
        assert_eq!(sym.files_parsed(), 1, "one (device, inode) whatever the spelling");

        // And through the binary (a symlink's module is named after the link,
        // so the symlinked spellings are rows of their own).
        let rows = top_functions(&spool, &["-n", "0"]);
        assert!(rows.iter().all(|r| r.0 == "hot_a"), "{rows:?}");
        assert_eq!(rows.iter().map(|r| r.1).sum::<u64>(), 100);
        // Folded stacks show names only: one line for them all.
        let o = run_bounded(&["export", s(&spool), "--format", "collapsed", "-o", "-"]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(stdout(&o), "hot_a 100\n");
    }
}

#[test]
fn fifo_perf_map_is_skipped() {
    // A pid no test uses, so that /tmp/perf-<pid>.map is ours to create.
    let pid = 4_190_777;
    let map = PathBuf::from(format!("/tmp/perf-{pid}.map"));
    let _ = std::fs::remove_file(&map);
    mkfifo(&map);
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _cleanup = Remove(map);
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("jit.spool");
    let file = std::fs::File::create(&spool).unwrap();
    let mut w = SpoolWriter::new(file, header()).unwrap();
    let th = w.define_thread(pid, pid, "main").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x7f00_0000_1000, kernel: false }).unwrap();
    let st = w.define_stack(None, f).unwrap();
    w.sample(START_US + INTERVAL_US, th, st).unwrap();
    w.into_inner().unwrap();
    let rows = top_functions(&spool, &[]);
    assert_eq!(rows, [("[unknown] 0x7f0000001000".to_string(), 1)]);
}
