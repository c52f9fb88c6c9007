//! Test fixtures: a small C program compiled with debug info, and spools written
//! with `SpoolWriter` whose frames point at its real functions, so that
//! symbolization is exercised against a real ELF file.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use object::{Object, ObjectSegment, ObjectSymbol};
use spulse::{Frame, Header, ModuleId, NewModule, SpoolWriter, StackId};

pub const START_US: u64 = 1_700_000_000_000_000;
pub const INTERVAL_US: u64 = 1000;
pub const PID: u32 = 4_100_001;

const PROGRAM: &str = r#"
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) double hot_a(int n) {
    double x = 0; for (int i = 0; i < n; i++) x += i * 0.5; return x;
}
__attribute__((noinline)) double hot_b(int n) {
    double x = 1; for (int i = 0; i < n; i++) x *= 1.0000001; return x;
}
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1000;
    printf("%f %f\n", hot_a(n), hot_b(n));
    return 0;
}
"#;

/// The compiled program and what the fixtures need to know about it.
pub struct Program {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub build_id: Vec<u8>,
    /// Executable PT_LOAD segment: (p_offset, p_filesz, p_vaddr).
    pub text: (u64, u64, u64),
    /// File offsets inside each function (a few bytes past its start).
    pub hot_a: u64,
    pub hot_b: u64,
    pub main: u64,
}

/// Compile the test program (`cc -g -O1`).
pub fn program() -> Program {
    program_with(&[])
}

/// Compile the test program (`cc -g -O1`) with `extra` flags.
pub fn program_with(extra: &[&str]) -> Program {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("hot.c");
    std::fs::write(&src, PROGRAM).unwrap();
    let path = dir.path().join("hotprog");
    let out = Command::new("cc")
        .args(extra)
        .args(["-g", "-O1", "-fno-omit-frame-pointer", "-Wl,--build-id", "-o"])
        .arg(&path)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(out.status.success(), "cc failed: {}", String::from_utf8_lossy(&out.stderr));
    let data = std::fs::read(&path).unwrap();
    let obj = object::File::parse(&*data).unwrap();
    let build_id = obj.build_id().unwrap().expect("build id").to_vec();
    let sym_addr = |name: &str| {
        let s = obj.symbols().find(|s| s.name() == Ok(name)).unwrap_or_else(|| panic!("no symbol {name}"));
        (s.address(), s.size())
    };
    let (a, _) = sym_addr("hot_a");
    let (b, _) = sym_addr("hot_b");
    let (m, msize) = sym_addr("main");
    let text = obj
        .segments()
        .map(|s| (s.file_range().0, s.file_range().1, s.address()))
        .find(|&(_, filesz, vaddr)| a >= vaddr && a < vaddr + filesz)
        .expect("segment with hot_a");
    let off = |vaddr: u64| vaddr - text.2 + text.0;
    Program {
        path: path.clone(),
        build_id,
        text,
        hot_a: off(a + 4),
        hot_b: off(b + 4),
        main: off(m + msize / 2),
        dir,
    }
}

/// What goes into a fixture spool.
pub struct Spec<'a> {
    pub path: &'a Path,
    pub module_path: &'a [u8],
    pub build_id: &'a [u8],
    /// Samples of main;hot_a on thread 1001, 1002 and of main;hot_b on thread 1001.
    pub a_t1: u64,
    pub a_t2: u64,
    pub b_t1: u64,
}

/// Module base address used by every fixture.
pub const BASE: u64 = 0x5555_5555_0000;

/// The header of every fixture spool: `START_US` and `INTERVAL_US`.
pub fn header() -> Header {
    Header { start_time_us: START_US, interval_us: INTERVAL_US }
}

/// Define the test program's executable segment as a module of `pid` mapped at
/// `BASE`, named `path` with build id `build_id`.
pub fn define_program<W: Write>(
    w: &mut SpoolWriter<W>,
    p: &Program,
    pid: u32,
    path: &[u8],
    build_id: &[u8],
) -> ModuleId {
    let (off, filesz, vaddr) = p.text;
    w.define_module(&NewModule {
        pid,
        start: BASE + vaddr,
        size: filesz,
        file_offset: off,
        generation: 1,
        path,
        build_id,
    })
    .unwrap()
}

/// Define the frames main, hot_a and hot_b of module `m` and the stacks
/// main;hot_a and main;hot_b, returned in that order.
pub fn define_hot_stacks<W: Write>(w: &mut SpoolWriter<W>, p: &Program, m: ModuleId) -> (StackId, StackId) {
    let f_main = w.define_frame(Frame::Module { module: m, file_relative: p.main }).unwrap();
    let f_a = w.define_frame(Frame::Module { module: m, file_relative: p.hot_a }).unwrap();
    let f_b = w.define_frame(Frame::Module { module: m, file_relative: p.hot_b }).unwrap();
    let s_main = w.define_stack(None, f_main).unwrap();
    let s_a = w.define_stack(Some(s_main), f_a).unwrap();
    let s_b = w.define_stack(Some(s_main), f_b).unwrap();
    (s_a, s_b)
}

/// Write a spool over the test program: main;hot_a and main;hot_b samples.
pub fn write_spool(p: &Program, spec: &Spec<'_>) {
    let file = std::fs::File::create(spec.path).unwrap();
    let mut w = SpoolWriter::new(std::io::BufWriter::new(file), header()).unwrap();
    let m = define_program(&mut w, p, PID, spec.module_path, spec.build_id);
    let (s_a, s_b) = define_hot_stacks(&mut w, p, m);
    let t1 = w.define_thread(PID, 1001, "main").unwrap();
    let t2 = w.define_thread(PID, 1002, "worker").unwrap();
    let mut t = START_US;
    // Interleave in proportion (the kind with the most left, relative to its
    // total, goes next) so that every time window holds the same split.
    let init = [spec.a_t1, spec.a_t2, spec.b_t1];
    let mut left = init;
    let kinds = [(t1, s_a), (t2, s_a), (t1, s_b)];
    while left.iter().sum::<u64>() > 0 {
        let mut best = 0;
        for i in 1..3 {
            // left[i]/init[i] > left[best]/init[best], in integers.
            let ahead = left[i] * init[best].max(1) > left[best] * init[i].max(1) || left[best] == 0;
            if ahead && left[i] > 0 {
                best = i;
            }
        }
        left[best] -= 1;
        t += INTERVAL_US;
        w.sample(t, kinds[best].0, kinds[best].1).unwrap();
    }
    w.into_inner().unwrap();
}

/// The standard fixture: hot_a 3 : hot_b 1 (300 : 100), real module, real build id.
pub fn standard(p: &Program, path: &Path) {
    let module_path = p.path.as_os_str().as_encoded_bytes().to_vec();
    write_spool(
        p,
        &Spec { path, module_path: &module_path, build_id: &p.build_id, a_t1: 200, a_t2: 100, b_t1: 100 },
    );
}

/// The test program and the standard fixture over it in `a.spool` in its directory.
pub fn fixture() -> (Program, PathBuf) {
    let p = program();
    let spool = p.dir.path().join("a.spool");
    standard(&p, &spool);
    (p, spool)
}

/// Run the real binary.
pub fn spulse(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spulse")).args(args).output().expect("run spulse")
}

/// Start the real binary with its stdout and stderr piped.
pub fn spawn_spulse(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start spulse")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Run and require success.
pub fn ok(args: &[&str]) -> String {
    let o = spulse(args);
    assert!(o.status.success(), "spulse {args:?} failed: {}", stderr(&o));
    stdout(&o)
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Holds the recorder's lock on a spool (`flock(LOCK_EX)`, as a running
/// recorder does) until dropped, so `follow` sees the recording as running.
pub struct RecordingLock(std::fs::File);

impl RecordingLock {
    pub fn hold(path: &Path) -> RecordingLock {
        use std::os::fd::AsRawFd;
        let f = std::fs::File::open(path).expect("open spool to lock it");
        // SAFETY: flock on a descriptor this struct owns and keeps open.
        let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(r, 0, "flock: {}", std::io::Error::last_os_error());
        RecordingLock(f)
    }
}

impl Drop for RecordingLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor is open until self.0 is dropped right after.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Whether this run must have every test oracle (`CI=true`, as `.ci/run` sets).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Check that an external oracle (`go tool pprof`, Python's `jsonschema`,
/// binutils) can run, by running `probe` (a command and its arguments).
/// Returns true when it can. When it cannot: in CI (`ci`) the test fails,
/// elsewhere a loud SKIPPED line on stderr says which check was skipped and
/// why, and
/// false is returned so the caller leaves out only that check.
pub fn oracle_in(ci: bool, what: &str, probe: &[&str], install: &str) -> bool {
    let (cmd, args) = probe.split_first().expect("probe command");
    let why = match Command::new(cmd).args(args).stdout(Stdio::null()).stderr(Stdio::null()).status() {
        Ok(st) if st.success() => return true,
        Ok(st) => format!("`{}` exited with {st}", probe.join(" ")),
        Err(e) => format!("`{cmd}` cannot run: {e}"),
    };
    if ci {
        panic!("test oracle {what} is missing in CI ({why}); .ci/run must install it ({install})");
    }
    // Written to the process's stderr directly, not through the test
    // harness's capture, so the line shows even when the test passes.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED in {}: the {what} check: {why}; install {install} to run it (with CI=true this fails)",
        std::thread::current().name().unwrap_or("this test")
    );
    false
}

/// [`oracle_in`] with this run's CI setting.
pub fn oracle(what: &str, probe: &[&str], install: &str) -> bool {
    oracle_in(in_ci(), what, probe, install)
}

/// `go tool pprof`.
pub fn have_go_pprof() -> bool {
    oracle("go tool pprof", &["go", "tool", "pprof", "-h"], "Debian's golang-go")
}

/// Python 3 with the `jsonschema` package.
pub fn have_jsonschema() -> bool {
    oracle(
        "Python jsonschema",
        &["python3", "-c", "import jsonschema"],
        "python3 and `pip install jsonschema`",
    )
}

/// A binutils program (`objcopy`, `addr2line`).
pub fn have_binutils(program: &str) -> bool {
    oracle(&format!("binutils {program}"), &[program, "--version"], "Debian's binutils")
}

/// The pprof profile in the gzipped file `path` (the `pprof` export), decoded.
pub fn read_pprof(path: &Path) -> spulse_cli::export::pprof::Profile {
    let mut raw = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap()),
        &mut raw,
    )
    .unwrap_or_else(|e| panic!("{} is not gzip: {e}", path.display()));
    <spulse_cli::export::pprof::Profile as prost::Message>::decode(&*raw)
        .unwrap_or_else(|e| panic!("{} is not a pprof profile: {e}", path.display()))
}
