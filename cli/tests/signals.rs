//! Programs that own signals run under `spulse record` as they do without it,
//! and are still sampled (issue 25):
//!
//! * a C program that installs its own handler for SIGTRAP (the perf-event
//!   engine's signal) by `signal`, by `sigaction` (read back as set) and
//!   one-shot (`SA_RESETHAND`), for SIGPROF, SIGURG, a real-time signal, an
//!   `ITIMER_REAL` SIGALRM, and a `signalfd` over SIGURG, SIGPROF and a
//!   real-time signal: exactly its own signals reach it, it exits 0, and the
//!   spool holds its CPU time;
//! * a C program whose threads all block every signal and read them by
//!   `sigtimedwait` or `signalfd` reads none of spulse's and is sampled; one
//!   that sends itself a SIGTRAP meanwhile reads it (not killed); a program
//!   reads back the signal mask it set, SIGTRAP included;
//! * `cargo build` of a crate with path dependencies (one with a build
//!   script) links (LLVM's rust-lld and llvm tools own SIGTRAP), and rustc,
//!   the build script and the linker are in the spool.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn compile_program(dir: &Path) -> PathBuf {
    compile(dir, "owns_signals")
}

/// `tests/data/<name>.c`, compiled into `dir`.
fn compile(dir: &Path, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/{name}.c"));
    let exe = dir.join(name);
    let out =
        Command::new("cc").args(["-O1", "-pthread", "-o"]).arg(&exe).arg(&src).output().expect("run cc");
    assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// Executable paths of the processes the spool recorded (their first module).
fn programs(spool: &Path) -> Vec<String> {
    let snap = spulse::Snapshot::open(spool).unwrap_or_else(|e| panic!("{}: {e}", spool.display()));
    let d = snap.definitions();
    d.modules().iter().map(|m| String::from_utf8_lossy(&m.path).into_owned()).collect()
}

#[test]
fn programs_that_own_signals_run_as_without_spulse_and_are_sampled() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_program(dir.path());
    for how in [
        "sigtrap-signal",
        "sigtrap-sigaction",
        "sigtrap-oneshot",
        "sigprof",
        "sigurg",
        "sigrt",
        "sigalrm",
        "signalfd",
    ] {
        let bare = Command::new(&exe).arg(how).output().unwrap();
        assert!(bare.status.success(), "{how} without spulse: {:?} {}", bare.status, stderr(&bare));
        let spool = dir.path().join(format!("{how}.spool"));
        let o = spulse(&["record", "-o", s(&spool), "--", s(&exe), how]);
        assert!(o.status.success(), "{how} under spulse record: {:?}\n{}", o.status, stderr(&o));
        let snap = spulse::Snapshot::open(&spool).unwrap();
        let n = snap.samples().count();
        // 0.6 s of CPU at 999 Hz (the SIGALRM case too: it burns what is left
        // after its alarms): at least a third of it, even on a loaded machine
        // (the samples follow CPU time, not wall time).
        let least = 200;
        assert!(n >= least, "{how}: only {n} samples");
    }
}

/// The daemon pattern: every thread blocks every signal and reads them with
/// `sigtimedwait` or `signalfd` on the full set. The perf-event engine's
/// SIGTRAP used to be queued to the blocking thread (`si_code` TRAP_PERF,
/// flag TRAP_PERF_FLAG_ASYNC) and the program read it as its own: measured
/// on Linux 6.18, 1,180-1,760 SIGTRAPs read in 1.2-1.8 s of CPU, exit 3, and
/// 34-86 samples instead of about 1,800. Now the preload library keeps
/// SIGTRAP out of the threads' real masks (`pthread_sigmask`/`sigprocmask`
/// are interposed): none read, every thread sampled.
#[test]
fn a_program_blocking_every_signal_and_reading_them_reads_none_of_spulses_and_is_sampled() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(dir.path(), "blocks_all_signals");
    for how in ["sigtimedwait", "signalfd"] {
        let bare = Command::new(&exe).arg(how).output().unwrap();
        assert!(bare.status.success(), "{how} without spulse: {:?} {}", bare.status, stdout(&bare));
        let spool = dir.path().join(format!("{how}.spool"));
        let o = spulse(&["record", "-o", s(&spool), "--", s(&exe), how]);
        assert!(
            o.status.success(),
            "{how} under spulse record: {:?}\n{}{}",
            o.status,
            stdout(&o),
            stderr(&o)
        );
        // Three threads of 0.6 s of CPU each at 999 Hz: at least a third.
        let n = spulse::Snapshot::open(&spool).unwrap().samples().count();
        assert!(n >= 600, "{how}: only {n} samples");
        assert!(!stderr(&o).contains("blocked the profiling signal"), "{how}: {}", stderr(&o));
    }
}

/// The same program sends itself a SIGTRAP (`kill`) after blocking every
/// signal: its thread's real mask does not block SIGTRAP, so it reaches
/// spulse's handler, which leaves it pending and blocked for the program
/// (queued again, SIGTRAP added to the thread's mask) instead of passing it
/// to the default action (a core dump). The program reads it as it does
/// bare. That thread now really blocks SIGTRAP, so the writer stops the
/// perf-event engine at its next tick and says so; until then the engine's
/// SIGTRAPs can be pending for that thread and read (52 in the run that
/// measured it): the program may exit 3 for those, but it is not killed.
#[test]
fn a_sigtrap_sent_to_a_program_blocking_it_stays_pending_for_the_program() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(dir.path(), "blocks_all_signals");
    for how in ["sigtimedwait", "signalfd"] {
        let bare = Command::new(&exe).args([how, "kill"]).output().unwrap();
        assert!(bare.status.success(), "{how} kill without spulse: {:?} {}", bare.status, stdout(&bare));
        let spool = dir.path().join(format!("{how}-kill.spool"));
        let o = spulse(&["record", "-o", s(&spool), "--", s(&exe), how, "kill"]);
        let out = stdout(&o);
        assert!(
            matches!(o.status.code(), Some(0 | 3)),
            "{how} kill under spulse record: {:?}\n{out}{}",
            o.status,
            stderr(&o)
        );
        assert!(out.contains("its own 1 of 1"), "{how} kill: the program did not read its SIGTRAP: {out}");
        assert!(
            stderr(&o).contains("was left pending for the program, so the perf-event engine stopped"),
            "{how} kill: {}",
            stderr(&o)
        );
    }
}

/// A program reads back the mask it set, SIGTRAP included, through
/// `pthread_sigmask` and `sigprocmask`, while its real mask does not block
/// SIGTRAP under `spulse record` (it does bare); so does a thread it creates
/// meanwhile, which reads a SIGTRAP sent to it (`tgkill`) by `sigtimedwait`
/// instead of dying of it.
#[test]
fn a_program_reads_back_the_signal_mask_it_set_under_record() {
    let dir = tempfile::tempdir().unwrap();
    let exe = compile(dir.path(), "sigmask_view");
    let bare = Command::new(&exe).output().unwrap();
    assert!(bare.status.success(), "without spulse: {:?} {}", bare.status, stdout(&bare));
    assert!(stdout(&bare).contains("real-blocks-trap 1"), "{}", stdout(&bare));
    let spool = dir.path().join("view.spool");
    let o = spulse(&["record", "-o", s(&spool), "--", s(&exe)]);
    assert!(o.status.success(), "under spulse record: {:?}\n{}{}", o.status, stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("ok 12 steps"), "{}", stdout(&o));
    assert!(stdout(&o).contains("real-blocks-trap 0"), "{}", stdout(&o));
    // The SIGTRAP left pending for the thread stopped the perf-event engine.
    assert!(stderr(&o).contains("was left pending for the program"), "{}", stderr(&o));
}

#[test]
fn cargo_build_links_under_record_with_rustc_build_scripts_and_the_linker_in_the_spool() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let w = |p: &str, text: &str| {
        let p = root.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    w(
        "app/Cargo.toml",
        "[package]\nname = \"app\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[dependencies]\nalpha = { path = \"../alpha\" }\nbeta = { path = \"../beta\" }\n",
    );
    w("app/src/main.rs", "fn main() { println!(\"{} {}\", alpha::value(), beta::VALUE); }\n");
    w(
        "alpha/Cargo.toml",
        "[package]\nname = \"alpha\"\nversion = \"0.1.0\"\nedition = \"2021\"\nbuild = \"build.rs\"\n",
    );
    w(
        "alpha/build.rs",
        "fn main() { let n: u64 = (0..2_000_000u64).map(|i| i % 7).sum(); println!(\"cargo:rustc-env=ALPHA={n}\"); }\n",
    );
    w("alpha/src/lib.rs", "pub fn value() -> &'static str { env!(\"ALPHA\") }\n");
    w("beta/Cargo.toml", "[package]\nname = \"beta\"\nversion = \"0.1.0\"\nedition = \"2021\"\n");
    w("beta/src/lib.rs", "pub const VALUE: u32 = 7;\n");
    let spool = root.join("build.spool");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o", s(&spool), "--", &cargo, "build", "--offline", "--quiet"])
        .current_dir(root.join("app"))
        .env("CARGO_TARGET_DIR", root.join("target"))
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .output()
        .unwrap();
    assert!(o.status.success(), "cargo build under spulse record: {:?}\n{}", o.status, stderr(&o));
    let run = Command::new(root.join("target/debug/app")).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&run.stdout).trim(),
        "2000000 7".replace("2000000", &(0..2_000_000u64).map(|i| i % 7).sum::<u64>().to_string())
    );
    let progs = programs(&spool);
    let has = |f: &dyn Fn(&str) -> bool| progs.iter().any(|p| f(p));
    assert!(has(&|p| p.ends_with("/rustc") || p.contains("librustc_driver")), "no rustc in {progs:?}");
    assert!(
        has(&|p| p.contains("build-script-build") || p.contains("build_script_build")),
        "no build script in {progs:?}"
    );
    assert!(
        has(&|p| p.ends_with("/rust-lld")
            || p.ends_with("/ld")
            || p.contains("ld.bfd")
            || p.contains("ld.gold")
            || p.contains("ld.lld")
            || p.ends_with("/cc")
            || p.contains("collect2")),
        "no linker in {progs:?}"
    );
}

/// `info` shows what the recorder said did not go as configured (the
/// `<spool>.warnings` file beside it), and a hostile one (a FIFO) neither
/// hangs it nor is read.
#[test]
fn info_shows_the_recorders_warnings_from_beside_the_spool() {
    let (_p, spool) = fixture();
    let out = ok(&["info", s(&spool)]);
    assert!(out.contains("warnings:        none"), "{out}");
    let side = spulse::warnings_path(&spool);
    std::fs::write(&side, "the perf-event engine stopped there\n").unwrap();
    let out = ok(&["info", s(&spool)]);
    assert!(out.contains("warning:         the perf-event engine stopped there"), "{out}");
    let json = ok(&["info", "--json", s(&spool)]);
    assert!(json.contains("the perf-event engine stopped there"), "{json}");
    std::fs::remove_file(&side).unwrap();
    let c = std::ffi::CString::new(side.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let mut child = spawn_spulse(&["info", s(&spool)]);
    let t0 = std::time::Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success());
            break;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "info hung on a FIFO beside the spool");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
