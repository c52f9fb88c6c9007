//! `libspulse_preload.so` records a process only when it was preloaded: loaded
//! with `dlopen` (Python's `ctypes.CDLL`) it starts nothing and says why on
//! stderr, and every way of naming it in `LD_PRELOAD` still records.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The library as `spulse record` finds it (cargo's layout: built with the tool).
fn lib() -> PathBuf {
    let lib = Path::new(env!("CARGO_BIN_EXE_spulse")).parent().unwrap().join("deps/libspulse_preload.so");
    assert!(lib.is_file(), "{} is built with the tool", lib.display());
    lib
}

/// Run `cmd`, failing the test if it has not exited within 60 s (a hang in the
/// library's constructor must fail, not stall the suite).
fn run_bounded(mut cmd: Command) -> Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start the command");
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!("{cmd:?} still running after 60 s; stderr: {}", stderr(&o));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The spool files in `dir`.
fn spools(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "spool"))
        .collect();
    v.sort();
    v
}

/// A small shared library of our own, to stand before ours in `LD_PRELOAD`.
fn other_lib(dir: &Path) -> PathBuf {
    let src = dir.join("other.c");
    std::fs::write(&src, "int spulse_test_other(int x) { return x + 1; }\n").unwrap();
    let so = dir.join("libother.so");
    let o = Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&so).arg(&src).output().expect("run cc");
    assert!(o.status.success(), "cc: {}", stderr(&o));
    so
}

const LOAD_WITH_CTYPES: &str = "import ctypes, sys\nctypes.CDLL(sys.argv[1])\nprint('loaded')\n";

/// Python loads the library with `ctypes.CDLL` (dlopen): no recorder starts,
/// no spool is written, one stderr line says why, the process exits normally.
#[test]
fn dlopen_does_not_record() {
    if !oracle("python3", &["python3", "-c", "import ctypes"], "python3") {
        return;
    }
    let lib = lib();
    let dir = tempfile::tempdir().unwrap();
    let other = other_lib(dir.path());
    // Also with another library preloaded: being in a process that has an
    // LD_PRELOAD is not being named in it.
    for preload in [None, Some(&other)] {
        let mut c = Command::new("python3");
        c.args(["-c", LOAD_WITH_CTYPES])
            .arg(&lib)
            .current_dir(dir.path())
            .env_remove("SPULSE_RECORD_DIR")
            .env("SPULSE_OUTPUT", dir.path().join("dl-{pid}.spool"));
        match preload {
            Some(p) => c.env("LD_PRELOAD", p),
            None => c.env_remove("LD_PRELOAD"),
        };
        let o = run_bounded(c);
        let err = stderr(&o);
        assert!(o.status.success(), "python3 exited with {}: {err}", o.status);
        assert_eq!(stdout(&o), "loaded\n", "stderr: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "one line on stderr: {err:?}");
        assert!(
            lines[0].starts_with("spulse: not recording: ")
                && lines[0].contains("LD_PRELOAD")
                && lines[0].contains("/etc/ld.so.preload")
                && lines[0].contains("libspulse_preload.so"),
            "{err}"
        );
        assert_eq!(spools(dir.path()), Vec::<PathBuf>::new(), "LD_PRELOAD={preload:?}");
    }
}

/// Every spelling of the library in `LD_PRELOAD` that the loader accepts
/// still records: absolute, relative, with `..` or `//`, through a symlink,
/// by bare name found in the library path, and after another library
/// (separated by a space or a colon).
#[test]
fn preload_spellings_record() {
    let lib = lib();
    let deps = lib.parent().unwrap().to_path_buf();
    let dir = tempfile::tempdir().unwrap();
    let other = other_lib(dir.path());
    let link = dir.path().join("libsymlinked.so");
    std::os::unix::fs::symlink(&lib, &link).unwrap();
    let abs = lib.to_str().unwrap().to_string();
    let cases: Vec<(&str, String, Option<&Path>)> = vec![
        ("absolute", abs.clone(), None),
        ("relative", "./libspulse_preload.so".into(), Some(&deps)),
        ("dotdot", format!("{}/../deps/libspulse_preload.so", deps.display()), None),
        ("doubled-slashes", format!("{}//libspulse_preload.so", deps.display()), None),
        ("symlink", link.to_str().unwrap().into(), None),
        ("after-space", format!("{} {abs}", other.display()), None),
        ("after-colon", format!("{}:{abs}", other.display()), None),
    ];
    // perl ends through exit(3), so the library's exit handler finishes the
    // recording.
    let busy = ["-e", "my $i = 0; $i++ while $i < 1e7"];
    for (name, preload, cwd) in &cases {
        let mut c = Command::new("perl");
        c.args(busy)
            .env("LD_PRELOAD", preload)
            .env_remove("SPULSE_RECORD_DIR")
            .env_remove("LD_LIBRARY_PATH")
            .env("SPULSE_OUTPUT", dir.path().join(format!("{name}-{{pid}}.spool")))
            .current_dir(cwd.unwrap_or(dir.path()));
        check_recorded(name, preload, c, dir.path());
    }
    // A bare name, which the loader looks for in the library path.
    let mut c = Command::new("perl");
    c.args(busy)
        .env("LD_PRELOAD", "libspulse_preload.so")
        .env("LD_LIBRARY_PATH", &deps)
        .env_remove("SPULSE_RECORD_DIR")
        .env("SPULSE_OUTPUT", dir.path().join("bare-{pid}.spool"))
        .current_dir(dir.path());
    check_recorded("bare", "libspulse_preload.so", c, dir.path());
}

fn check_recorded(name: &str, preload: &str, c: Command, dir: &Path) {
    let o = run_bounded(c);
    assert!(o.status.success() && o.stderr.is_empty(), "{name} (LD_PRELOAD={preload}): {}", stderr(&o));
    let mine: Vec<PathBuf> = spools(dir)
        .into_iter()
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(&format!("{name}-")))
        .collect();
    assert_eq!(mine.len(), 1, "{name} (LD_PRELOAD={preload}): one spool, found {mine:?}");
    let v: serde_json::Value = serde_json::from_str(&ok(&["info", "--json", s(&mine[0])])).unwrap();
    let samples = v["samples"].as_u64().unwrap();
    assert!(samples > 0, "{name} (LD_PRELOAD={preload}): {samples} samples");
}
