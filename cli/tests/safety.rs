//! The user's data and terminal are safe from the tool: an export never
//! overwrites its input and never leaves a half-written output, a closed pipe
//! ends an export quietly, hostile names from a spool reach neither the
//! terminal nor the SVG raw, numeric arguments are range-checked, and the
//! test-oracle helper skips loudly outside CI and fails in CI.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use spulse::{Frame, NewModule, SpoolWriter};

/// Files in `dir` whose names say they are export temporaries.
fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect()
}

#[test]
fn export_refuses_to_overwrite_its_input_by_any_name() {
    let (p, spool) = fixture();
    let dir = p.dir.path();
    let original = std::fs::read(&spool).unwrap();
    let link = dir.join("link.spool");
    std::os::unix::fs::symlink(&spool, &link).unwrap();
    let hard = dir.join("hard.spool");
    std::fs::hard_link(&spool, &hard).unwrap();
    let dotted = dir.join(".").join("a.spool");
    let outputs = [spool.clone(), dotted, link, hard];
    for format in ["collapsed", "pprof", "svg"] {
        for out in &outputs {
            let o = spulse(&["export", s(&spool), "--format", format, "-o", s(out)]);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "-o {}: {err}", out.display());
            assert!(err.contains("refusing to overwrite the recording"), "{err}");
            assert!(err.contains(s(out)), "names the output: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "{err}");
            assert_eq!(
                std::fs::read(&spool).unwrap(),
                original,
                "the spool is intact after -o {}",
                out.display()
            );
        }
    }
    // The input given through the link, the output by its real name: refused too.
    let o = spulse(&["export", s(&dir.join("link.spool")), "--format", "collapsed", "-o", s(&spool)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(std::fs::read(&spool).unwrap(), original);
    assert!(temporaries(dir).is_empty(), "{:?}", temporaries(dir));
}

#[test]
fn export_reports_one_line_and_replaces_output_atomically() {
    let (p, spool) = fixture();
    let out = p.dir.path().join("a.folded");
    std::fs::write(&out, "old content\n").unwrap();
    let o = spulse(&["export", s(&spool), "--format", "collapsed", "-o", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(text, "main;hot_a 300\nmain;hot_b 100\n");
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "one line on success: {err}");
    let want = format!("400 samples written to {} ({} bytes)", s(&out), text.len());
    assert!(err.contains(&want), "{err} lacks {want}");
    // A filter changes the count; the Firefox export counts what it keeps.
    let ff = p.dir.path().join("t.json");
    let o = spulse(&["export", s(&spool), "--format", "firefox", "--thread", "1002", "-o", s(&ff)]);
    let len = std::fs::metadata(&ff).unwrap().len();
    assert!(
        stderr(&o).contains(&format!("100 samples written to {} ({len} bytes)", s(&ff))),
        "{}",
        stderr(&o)
    );
    // Through a symlink, the file it points to is replaced and the link stays.
    let target = p.dir.path().join("target.folded");
    std::fs::write(&target, "x\n").unwrap();
    let link = p.dir.path().join("via-link.folded");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    ok(&["export", s(&spool), "--format", "collapsed", "-o", s(&link)]);
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::read_to_string(&target).unwrap(), text);
    // A device is written in place, never replaced.
    let o = spulse(&["export", s(&spool), "--format", "collapsed", "-o", "/dev/null"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(std::fs::metadata("/dev/null").unwrap().file_type().is_char_device_like());
    assert!(temporaries(p.dir.path()).is_empty(), "{:?}", temporaries(p.dir.path()));
}

/// `is_char_device` through the unix extension, named for what it checks.
trait CharDevice {
    fn is_char_device_like(&self) -> bool;
}

impl CharDevice for std::fs::FileType {
    fn is_char_device_like(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_char_device()
    }
}

#[test]
fn failed_export_leaves_existing_output_untouched() {
    let (p, spool) = fixture();
    let out = p.dir.path().join("a.svg");
    std::fs::write(&out, "precious earlier export\n").unwrap();
    // Writes past 2 KiB fail with EFBIG (SIGXFSZ ignored), well inside the SVG.
    // `pre_exec` runs the closure in the forked child before exec.
    // SAFETY: the closure makes only async-signal-safe calls (signal, setrlimit) and allocates nothing.
    let o = unsafe {
        Command::new(env!("CARGO_BIN_EXE_spulse"))
            .args(["export", s(&spool), "--format", "svg", "-o", s(&out)])
            .pre_exec(|| {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                let lim = libc::rlimit { rlim_cur: 2048, rlim_max: 2048 };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
            .output()
            .unwrap()
    };
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(s(&out)) && err.contains("too large"), "{err}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "precious earlier export\n");
    assert!(temporaries(p.dir.path()).is_empty(), "{:?}", temporaries(p.dir.path()));
}

#[test]
fn export_into_closed_pipe_exits_quietly() {
    let (_p, spool) = fixture();
    for format in ["collapsed", "pprof", "firefox", "svg", "speedscope"] {
        // A pipe whose read end is closed before the export starts.
        let mut fds = [0; 2];
        // SAFETY: pipe fills the two-element array with new descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: each descriptor is owned by exactly one File from here on.
        let (read_end, write_end) = unsafe {
            use std::os::fd::FromRawFd;
            (std::fs::File::from_raw_fd(fds[0]), std::fs::File::from_raw_fd(fds[1]))
        };
        drop(read_end);
        let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
            .args(["export", s(&spool), "--format", format, "-o", "-"])
            .stdout(Stdio::from(write_end))
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(0), "{format}: {}", stderr(&o));
        assert_eq!(stderr(&o), "", "{format}: nothing on stderr");
    }
}

/// A spool whose thread name, module path (and so module and function names)
/// hold terminal control sequences and XML-forbidden characters.
fn hostile_spool(dir: &Path) -> std::path::PathBuf {
    let spool = dir.join("hostile.spool");
    let mut w = SpoolWriter::new(std::fs::File::create(&spool).unwrap(), header()).unwrap();
    let m = w
        .define_module(&NewModule {
            pid: PID,
            start: BASE,
            size: 0x10000,
            file_offset: 0,
            generation: 1,
            path: b"/nonexistent/ev\x1b]0;owned\x07il\x01\x1b[2J\xc2\x9b31m",
            build_id: &[],
        })
        .unwrap();
    let f = w.define_frame(Frame::Module { module: m, file_relative: 0x1234 }).unwrap();
    let st = w.define_stack(None, f).unwrap();
    let th = w.define_thread(PID, 7, "th\x1b[31mread\x07").unwrap();
    for i in 0..5 {
        w.sample(START_US + (i + 1) * INTERVAL_US, th, st).unwrap();
    }
    w.into_inner().unwrap();
    spool
}

/// No byte of `out` is a control character other than newline (ESC, BEL, the
/// C1 CSI as UTF-8 `c2 9b`, ...).
fn assert_no_controls(what: &str, out: &[u8]) {
    let text = String::from_utf8_lossy(out);
    let bad: Vec<char> = text.chars().filter(|&c| c.is_control() && c != '\n').collect();
    assert!(bad.is_empty(), "{what}: raw control characters {bad:?} in\n{text}");
}

#[test]
fn hostile_names_are_escaped_on_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let spool = hostile_spool(dir.path());
    let o = spulse(&["info", s(&spool)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_no_controls("info", &o.stdout);
    let text = stdout(&o);
    assert!(text.contains("th\\u{1b}[31mread\\u{7}"), "thread name escaped: {text}");
    assert!(text.contains("ev\\u{1b}]0;owned\\u{7}il\\u{1}\\u{1b}[2J\\u{9b}31m"), "module escaped: {text}");
    let o = spulse(&["top", s(&spool)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_no_controls("top", &o.stdout);
    assert!(stdout(&o).contains("ev\\u{1b}]0;owned"), "{}", stdout(&o));
    let o = spulse(&["follow", s(&spool), "--interval", "0.05"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_no_controls("follow", &o.stdout);
    assert!(stdout(&o).contains("ev\\u{1b}]0;owned"), "{}", stdout(&o));
    // Collapsed stacks on stdout, with the thread and process root frames
    // whose names come from the spool.
    for shape in ["--per-thread", "--per-process"] {
        let o = spulse(&["export", s(&spool), "-f", "collapsed", "-o", "-", shape]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_no_controls(shape, &o.stdout);
    }
    let o = spulse(&["export", s(&spool), "-f", "collapsed", "-o", "-", "--per-thread"]);
    assert!(stdout(&o).contains("th\\u{1b}[31mread\\u{7} (tid 7)"), "{}", stdout(&o));
    // JSON carries the names exactly, escaped the JSON way.
    let v: serde_json::Value = serde_json::from_str(&ok(&["info", s(&spool), "--json"])).unwrap();
    assert_eq!(v["thread_list"][0]["name"], "th\x1b[31mread\x07");
    // Error messages that quote a path from the command line or a spool.
    let evil = dir.path().join("no\x1b]0;x\x07such.spool");
    for cmd in ["info", "top", "follow"] {
        let o = spulse(&[cmd, s(&evil)]);
        assert_eq!(o.status.code(), Some(2));
        assert_no_controls(cmd, &o.stderr);
        assert!(stderr(&o).contains("no\\u{1b}]0;x\\u{7}such.spool"), "{}", stderr(&o));
    }
}

#[test]
fn svg_with_control_characters_in_names_is_well_formed_xml() {
    let dir = tempfile::tempdir().unwrap();
    let spool = hostile_spool(dir.path());
    // The title holds the spool path: give it a control character too.
    let titled = dir.path().join("t\x01itle.spool");
    std::fs::copy(&spool, &titled).unwrap();
    let out = dir.path().join("h.svg");
    ok(&["export", s(&titled), "--format", "svg", "-o", s(&out)]);
    let svg = std::fs::read_to_string(&out).unwrap();
    let opts = roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() };
    let doc = roxmltree::Document::parse_with_options(&svg, opts)
        .unwrap_or_else(|e| panic!("the SVG is not well-formed XML: {e}"));
    let texts: String = doc.descendants().filter_map(|n| n.text()).collect();
    assert!(
        texts.contains("ev\\u{1b}]0:owned\\u{7}il\\u{1}"),
        "the name, escaped, is in the graph (`;` is folded to `:`)"
    );
}

#[test]
fn numeric_arguments_are_range_checked() {
    let (_p, spool) = fixture();
    let sp = s(&spool);
    let cases: &[&[&str]] = &[
        &["follow", sp, "--interval", "1e20"],
        &["follow", sp, "--interval", "0"],
        &["follow", sp, "--interval", "-1"],
        &["follow", sp, "--interval", "NaN"],
        &["follow", sp, "--interval", "inf"],
        &["follow", sp, "--idle-exit", "1e300"],
        &["follow", sp, "--idle-exit", "-0.5"],
        &["follow", sp, "--wait", "--wait-timeout", "1e20"],
        &["follow", sp, "-n", "-3"],
        &["top", sp, "-n", "99999999999999999999999"],
        &["top", sp, "--from", "-1"],
        &["top", sp, "--to", "18446744073709551616"],
        &["export", sp, "--format", "collapsed", "-o", "-", "--from", "x"],
    ];
    // `--thread` takes a tid or a name: a number out of a tid's range is a name
    // no thread has, an error that says so (not a panic).
    for args in [
        &["top", sp, "--thread", "4294967296"][..],
        &["export", sp, "--format", "collapsed", "-o", "-", "--thread", "-5"][..],
    ] {
        let o = spulse(args);
        let err = stderr(&o);
        assert!(!o.status.success(), "{args:?}: {err}");
        assert!(!err.contains("panicked") && !err.contains("internal error"), "{args:?}: {err}");
        assert!(err.contains("no thread named"), "{args:?}: {err}");
    }
    for args in cases {
        let o = spulse(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked") && !err.contains("internal error"), "{args:?}: {err}");
        assert!(err.contains("invalid value"), "{args:?}: {err}");
    }
    let o = spulse(&["follow", sp, "--interval", "1e20"]);
    assert!(stderr(&o).contains("out of range: seconds from 0.01 to 604800"), "{}", stderr(&o));
    let o = spulse(&["top", sp, "--from", "-1"]);
    assert!(
        stderr(&o).contains("`-1` is not a whole number from 0 to 18446744073709551615"),
        "{}",
        stderr(&o)
    );
    let o = spulse(&["follow", sp, "-n", "1e3"]);
    assert!(stderr(&o).contains("`1e3` is not a whole number from 0 to"), "{}", stderr(&o));
    let o = spulse(&["export", sp, "--format", "collapsed", "-o", "-", "--from", "9", "--to", "3"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--from 9 must be below --to 3"), "{}", stderr(&o));
    // The edges of the ranges are accepted.
    let o = spulse(&["follow", sp, "--interval", "0.01", "--idle-exit", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn oracle_helper_skips_loudly_outside_ci_and_fails_in_ci() {
    let missing = ["spulse-no-such-oracle-program", "--version"];
    assert!(!oracle_in(false, "(oracle helper self-test) missing tool", &missing, "nothing"));
    let failed = std::panic::catch_unwind(|| oracle_in(true, "a missing tool", &missing, "nothing"));
    assert!(failed.is_err(), "a missing oracle fails in CI");
    // A present program passes either way (the shell is on every machine).
    assert!(oracle_in(true, "sh", &["sh", "-c", "exit 0"], "sh"));
    assert!(!oracle_in(false, "(oracle helper self-test) failing sh", &["sh", "-c", "exit 3"], "sh"));
}

/// Whether process `pid` holds open a file in `dir` other than `except`
/// (the export's output under construction: a named temporary, or an
/// unnamed O_TMPFILE one, which /proc shows as `DIR/#INODE (deleted)`).
fn writing_in(pid: u32, dir: &Path, except: &Path) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .any(|l| l.parent() == Some(dir) && l != except)
}

/// Files in `dir` other than `keep`.
fn others(dir: &Path, keep: &[&Path]) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !keep.contains(&p.as_path()))
        .map(|p| p.display().to_string())
        .collect()
}

/// An export to Firefox of a spool with enough samples that it runs for a
/// while after its output file is created, over an earlier export, ended by
/// `signal` once it writes its output; returns its exit status and stderr.
fn export_ended_by(signal: &str) -> (std::process::ExitStatus, String) {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("big.spool");
    let mut w =
        SpoolWriter::new(std::io::BufWriter::new(std::fs::File::create(&spool).unwrap()), header()).unwrap();
    let th = w.define_thread(PID, PID, "main").unwrap();
    let stacks: Vec<_> = (0..64u64)
        .map(|i| {
            let f = w.define_frame(Frame::Absolute { address: 0x1000 + i * 16, kernel: false }).unwrap();
            w.define_stack(None, f).unwrap()
        })
        .collect();
    for i in 0..1_500_000u64 {
        w.sample(START_US + i * INTERVAL_US, th, stacks[(i % 64) as usize]).unwrap();
    }
    w.into_inner().unwrap();
    let out = dir.path().join("big.json");
    std::fs::write(&out, "earlier export\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["export", s(&spool), "--format", "firefox", "-o", s(&out)])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !writing_in(child.id(), dir.path(), &spool) {
        assert!(child.try_wait().unwrap().is_none(), "the export ended before its output file was seen");
        assert!(t0.elapsed() < std::time::Duration::from_secs(60), "no output file");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let st = Command::new("kill").args([signal, &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "earlier export\n");
    let left = others(dir.path(), &[&spool, &out]);
    assert!(left.is_empty(), "left behind after kill {signal}: {left:?}");
    (o.status, stderr(&o))
}

#[test]
fn interrupted_export_removes_its_temporary_file() {
    let (status, err) = export_ended_by("-INT");
    assert_eq!(status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted"), "{err}");
}

/// An export that ends without running any of its code (SIGKILL here; an
/// abort on a failed allocation is the same) leaves no file behind: its
/// output has no name until it is complete.
#[test]
fn killed_export_leaves_no_temporary_file() {
    use std::os::unix::process::ExitStatusExt;
    let (status, err) = export_ended_by("-KILL");
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{err}");
}

/// A spool of more threads than the Firefox export holds (its tables are per
/// thread: 100,000 threads of one sample each ran out of memory at 2 GB) is
/// refused with a sentence that names the other formats, which export it.
#[test]
fn firefox_export_refuses_more_threads_than_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("threads.spool");
    let file = std::fs::File::create(&spool).unwrap();
    let mut w =
        SpoolWriter::new(file, spulse::Header { start_time_us: 1_700_000_000_000_000, interval_us: 1000 })
            .unwrap();
    let frame = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let stack = w.define_stack(None, frame).unwrap();
    for i in 0..10_001u32 {
        let t = w.define_thread(7, 100 + i, "w").unwrap();
        w.sample(1_700_000_000_000_000 + u64::from(i), t, stack).unwrap();
    }
    w.into_inner().unwrap();
    let out = dir.path().join("t.json");
    let o = spulse(&["export", s(&spool), "--format", "firefox", "-o", s(&out)]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("10001 threads selected") && err.contains("at most 10000") && err.contains("pprof"),
        "{err}"
    );
    assert!(!out.exists());
    let o = spulse(&["export", s(&spool), "--format", "pprof", "-o", s(&dir.path().join("t.pb.gz"))]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // The limit counts the threads selected: one thread of the 10,001 is
    // exported, alone.
    let o = spulse(&["export", s(&spool), "--format", "firefox", "--thread", "5000", "-o", s(&out)]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let threads = v["threads"].as_array().unwrap();
    assert_eq!(threads.len(), 1, "only the selected thread");
    assert_eq!(threads[0]["tid"].to_string().trim_matches('"'), "5000");
}

/// Inputs that would mislead: one file given twice (by two names) is
/// refused, a spool beside its packed copy (the same start time) is read with
/// a warning that it counts twice, and a spool a recorder still writes (it
/// holds the spool's lock) is read with a warning that it is not complete.
#[test]
fn inputs_given_twice_or_still_recorded_are_said() {
    let (p, spool) = fixture();
    let dir = p.dir.path();
    let link = dir.join("again.spool");
    std::os::unix::fs::symlink(&spool, &link).unwrap();
    let o = spulse(&["top", s(&spool), s(&link)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("are the same file"), "{}", stderr(&o));

    let packed = dir.join("copy.spk");
    let o = spulse(&["pack", s(&spool), "-o", s(&packed)]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = spulse(&["top", s(&spool), s(&packed)]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("start at the same microsecond"), "{}", stderr(&o));
    let o = spulse(&["top", s(&spool)]);
    assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));

    // The recorder's lock, held as a running recorder holds it.
    let held = std::fs::File::open(&spool).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor `held` keeps open.
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    for args in [&["info", s(&spool)][..], &["pack", s(&spool), "-o", s(&dir.join("live.spk"))]] {
        let o = spulse(args);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        assert!(stderr(&o).contains("still being recorded"), "{args:?}: {}", stderr(&o));
    }
    drop(held);
    // Closed, the lock is gone, unless another test's child forked meanwhile
    // (the tests run on threads of one process) still holds a copy of the
    // descriptor until its `exec` closes it: a moment, waited out here.
    let mut tries = 0;
    loop {
        let o = spulse(&["info", s(&spool)]);
        if !stderr(&o).contains("still being recorded") {
            break;
        }
        tries += 1;
        assert!(tries < 100, "the lock outlived its descriptor by 2 s: {}", stderr(&o));
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Weights a spool may hold but no recorder writes (an off-CPU interval of
/// 2^63 us and more, a start at the end of time) give saturated figures,
/// never wrapped ones: pprof values stay non-negative, a function's total is
/// never below its self time, and `--to` keeps a sample at the start.
#[test]
fn huge_weights_and_times_saturate() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("huge.spool");
    let start = u64::MAX - 10;
    let file = std::fs::File::create(&spool).unwrap();
    let mut w = SpoolWriter::new(file, spulse::Header { start_time_us: start, interval_us: 1000 }).unwrap();
    let t = w.define_thread(1, 1, "t").unwrap();
    let frame = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let stack = w.define_stack(None, frame).unwrap();
    w.sample(start, t, stack).unwrap();
    w.off_cpu(t, stack, 0, u64::MAX / 2 + 1, false).unwrap();
    w.off_cpu(t, stack, 0, u64::MAX / 2 + 1, false).unwrap();
    w.into_inner().unwrap();

    let pb = dir.path().join("huge.pb.gz");
    let o = spulse(&["export", s(&spool), "--wall", "--format", "pprof", "-o", s(&pb)]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let profile = read_pprof(&pb);
    assert!(profile.sample.iter().all(|smp| smp.value.iter().all(|&v| v >= 0)), "{:?}", profile.sample);
    assert!(profile.sample.iter().any(|smp| smp.value.contains(&i64::MAX)), "{:?}", profile.sample);

    let rows: serde_json::Value =
        serde_json::from_str(&ok(&["top", s(&spool), "--wall", "--json", "-n", "0"])).unwrap();
    for r in rows.as_array().unwrap() {
        assert!(r["total_us"].as_u64() >= r["self_us"].as_u64(), "{r}");
    }
    assert!(ok(&["top", s(&spool), "--to", "5"]).starts_with("1 sample\n"));
    assert!(ok(&["top", s(&spool), "--from", "5"]).starts_with("0 samples\n"));
}
