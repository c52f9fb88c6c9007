//! `spulse follow` on a spool that a writer thread is still appending to, on a
//! pipe and on an 80x24 pseudo-terminal: tables per interval, each stop
//! condition, and `--wait`. The recorder's side of the end-of-recording
//! contract (an exclusive `flock` held while recording) is played by the test
//! process with [`RecordingLock`].

mod common;

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use spulse::{Frame, SpoolWriter};

/// Append `rounds` rounds of 3 hot_a + 1 hot_b samples, flushing each round,
/// `pause` apart. The spool's process is `pid`. With `lock`, the recorder's
/// lock is held from creation until the last round is written.
fn writer(p: &Program, path: &Path, pid: u32, rounds: u32, pause: Duration, lock: bool) {
    let file = std::fs::File::create(path).unwrap();
    let _lock = lock.then(|| RecordingLock::hold(path));
    let mut w = SpoolWriter::new(file, header()).unwrap();
    let m = define_program(&mut w, p, pid, p.path.as_os_str().as_encoded_bytes(), &p.build_id);
    let th = w.define_thread(pid, pid, "main").unwrap();
    let (s_a, s_b) = define_hot_stacks(&mut w, p, m);
    w.flush().unwrap();
    let mut t = START_US;
    for _ in 0..rounds {
        for st in [s_a, s_a, s_b, s_a].into_iter().cycle().take(40) {
            t += INTERVAL_US;
            w.sample(t, th, st).unwrap();
        }
        w.flush().unwrap();
        std::thread::sleep(pause);
    }
}

fn tables(out: &str) -> Vec<&str> {
    out.split("--- ").filter(|t| !t.is_empty()).collect()
}

#[test]
fn follow_prints_tables_while_recording_and_stops_when_it_ends() {
    let p = program();
    let spool = p.dir.path().join("live.spool");
    let me = std::process::id();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let writer_thread = {
        let spool = spool.clone();
        let prog = program_copy(&p);
        std::thread::spawn(move || {
            ready_tx.send(()).unwrap();
            writer(&prog, &spool, me, 15, Duration::from_millis(100), true);
        })
    };
    ready_rx.recv().unwrap();
    let t0 = Instant::now();
    while !spool.exists() || std::fs::metadata(&spool).unwrap().len() < 16 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    let child = spawn_spulse(&["follow", s(&spool), "--interval", "0.2", "-n", "5"]);
    writer_thread.join().unwrap();
    let o = child.wait_with_output().unwrap();
    let out = stdout(&o);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("stopped: recording ended"), "{err}");
    let t = tables(&out);
    assert!(t.len() >= 4, "several tables while the writer ran: {out}");
    // Tables grow, and the last one holds everything with the 3:1 split.
    let last = t.last().unwrap();
    assert!(last.contains(": 600 samples"), "{last}");
    let a = last.lines().find(|l| l.contains("hot_a (hotprog)")).expect("hot_a row");
    assert!(a.contains("75.00%"), "{a}");
    assert!(t.first().unwrap().contains("samples"), "{out}");
    assert!(!out.contains("\x1b["), "no terminal control codes on a pipe");
}

/// A copy of the program description sharing the same binary (the writer thread needs its own).
fn program_copy(p: &Program) -> Program {
    Program {
        dir: tempfile::tempdir().unwrap(),
        path: p.path.clone(),
        build_id: p.build_id.clone(),
        text: p.text,
        hot_a: p.hot_a,
        hot_b: p.hot_b,
        main: p.main,
    }
}

#[test]
fn follow_ends_with_the_recording_not_with_its_process() {
    // The spool names this very process, which is alive: only the lock tells
    // that nobody records any more (PIDs mean nothing across namespaces).
    let p = program();
    let spool = p.dir.path().join("done.spool");
    writer(&p, &spool, std::process::id(), 2, Duration::ZERO, false);
    let t0 = Instant::now();
    let o = spulse(&["follow", s(&spool), "--interval", "0.1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("stopped: recording ended"), "{}", stderr(&o));
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(stdout(&o).contains(": 80 samples"), "{}", stdout(&o));
    // While the lock is held it keeps following, here until the file is idle.
    let lock = RecordingLock::hold(&spool);
    let t0 = Instant::now();
    let o = spulse(&["follow", s(&spool), "--interval", "0.1", "--idle-exit", "0.5"]);
    drop(lock);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("stopped: file idle for 0.5 s"), "{}", stderr(&o));
    assert!(t0.elapsed() >= Duration::from_millis(500));
    assert!(stdout(&o).contains(": 80 samples"), "{}", stdout(&o));
}

#[test]
fn follow_stops_cleanly_on_sigint() {
    let p = program();
    let spool = p.dir.path().join("int.spool");
    writer(&p, &spool, std::process::id(), 1, Duration::ZERO, false);
    let _lock = RecordingLock::hold(&spool);
    let mut child = spawn_spulse(&["follow", s(&spool), "--interval", "0.1"]);
    // The first table means the Ctrl-C handler is installed.
    let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut reader, &mut first).unwrap();
    assert!(first.starts_with("--- "), "{first}");
    let st = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut reader, &mut rest).unwrap();
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "follow did not stop on SIGINT");
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("interrupted"), "{}", stderr(&o));
    assert!(rest.contains("hot_a"), "{rest}");
}

#[test]
fn follow_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.spool");
    let o = spulse(&["follow", s(&missing)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains(&format!("{}: No such file", s(&missing))), "{}", stderr(&o));
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "not a spool at all, just text\n").unwrap();
    let o = spulse(&["follow", s(&text)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("at byte offset 0: not a spulse spool"), "{}", stderr(&o));
    // A corrupt record after valid ones: reported with its offset, exit 2.
    let p = program();
    let spool = dir.path().join("c.spool");
    writer(&p, &spool, 4_190_011, 1, Duration::ZERO, false);
    let at = std::fs::metadata(&spool).unwrap().len();
    std::fs::OpenOptions::new().append(true).open(&spool).unwrap().write_all(&[0xee, 0, 0, 0]).unwrap();
    let o = spulse(&["follow", s(&spool), "--idle-exit", "0.5"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains(&format!("at byte offset {at}: unknown record tag")), "{}", stderr(&o));
    assert_eq!(stderr(&o).trim_end().lines().count(), 1, "{}", stderr(&o));
    let o = spulse(&["follow", s(&spool), "--interval", "0"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn follow_rereads_perf_maps_as_they_grow() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("jit.spool");
    let pid = std::process::id();
    let map = format!("/tmp/perf-{pid}.map");
    let _ = std::fs::remove_file(&map);
    let mut w = SpoolWriter::new(std::fs::File::create(&spool).unwrap(), header()).unwrap();
    let th = w.define_thread(pid, pid, "jit").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x7e00_0000_0040, kernel: false }).unwrap();
    let st = w.define_stack(None, f).unwrap();
    for i in 0..5 {
        w.sample(START_US + (i + 1) * INTERVAL_US, th, st).unwrap();
    }
    w.into_inner().unwrap();
    let _lock = RecordingLock::hold(&spool);
    let mut child = spawn_spulse(&["follow", s(&spool), "--interval", "0.1"]);
    let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let mut seen_unknown = false;
    let mut seen_name = false;
    let t0 = Instant::now();
    while !seen_name && t0.elapsed() < Duration::from_secs(10) {
        line.clear();
        if std::io::BufRead::read_line(&mut reader, &mut line).unwrap() == 0 {
            break;
        }
        if line.contains("[unknown] 0x7e0000000040") && !seen_unknown {
            seen_unknown = true;
            // The JIT writes its map only now.
            std::fs::write(&map, "7e0000000000 100 jitted_fn\n").unwrap();
        }
        seen_name |= line.contains("jitted_fn (perf-");
    }
    let _ = Command::new("kill").args(["-INT", &child.id().to_string()]).status();
    let o = child.wait_with_output().unwrap();
    let _ = std::fs::remove_file(&map);
    assert!(seen_unknown && seen_name, "unknown first, then named: {}", stderr(&o));
}

#[test]
fn follow_waits_for_a_spool_that_does_not_exist_yet() {
    let p = program();
    let spool = p.dir.path().join("later.spool");
    let mut child = spawn_spulse(&["follow", "--wait", s(&spool), "--interval", "0.1"]);
    // One line says that it waits.
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut err, &mut line).unwrap();
    assert!(line.contains("waiting for the spool to appear") && line.contains(s(&spool)), "{line}");
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().unwrap().is_none(), "still waiting");
    writer(&p, &spool, std::process::id(), 3, Duration::from_millis(100), true);
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(10), "follow did not end with the recording");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{rest}");
    assert!(!rest.contains("waiting"), "the waiting line is printed once: {rest}");
    assert!(rest.contains("stopped: recording ended") && rest.contains("; 120 samples"), "{rest}");
    assert!(stdout(&o).contains(": 120 samples"), "{}", stdout(&o));
}

#[test]
fn follow_wait_gives_up_after_its_timeout_or_on_ctrl_c() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("never.spool");
    let t0 = Instant::now();
    let o = spulse(&["follow", "--wait", "--wait-timeout", "0.4", s(&spool)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(t0.elapsed() >= Duration::from_millis(400));
    let err = stderr(&o);
    assert!(err.contains("waiting for the spool to appear (up to 0.4 s"), "{err}");
    assert!(err.contains(&format!("{}: did not appear within 0.4 s", s(&spool))), "{err}");
    assert_eq!(err.lines().count(), 2, "{err}");
    // Without --wait a missing spool is an error at once; --wait-timeout needs --wait.
    let o = spulse(&["follow", s(&spool)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("No such file"), "{}", stderr(&o));
    let o = spulse(&["follow", s(&spool), "--wait-timeout", "1"]);
    assert_eq!(o.status.code(), Some(2));
    // Ctrl-C while waiting ends it cleanly.
    let mut child = spawn_spulse(&["follow", "--wait", s(&spool)]);
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut err, &mut line).unwrap();
    assert!(line.contains("(Ctrl-C to stop)"), "{line}");
    let st = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{rest}");
    assert!(rest.contains("interrupted while waiting"), "{rest}");
}

/// A pseudo-terminal of `cols` x `rows`: (master, slave).
fn pty(cols: u16, rows: u16) -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (0, 0);
    let ws = libc::winsize { ws_row: rows, ws_col: cols, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: openpty writes two new descriptors into the two integers; the
    // name buffer and termios may be null, the window size is read only.
    let r = unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), &ws) };
    assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: each descriptor is owned by exactly one File from here on.
    unsafe { (std::fs::File::from_raw_fd(master), std::fs::File::from_raw_fd(slave)) }
}

/// Display columns of a line (the tables hold ASCII and `…`).
fn columns(line: &str) -> usize {
    line.chars().count()
}

#[test]
fn follow_on_an_80x24_terminal_fits_and_restores_the_screen() {
    let p = program();
    let spool = p.dir.path().join("tty.spool");
    // 40 functions with 150-character names, in a module file that is not
    // there (named `NAME+0xOFFSET`), hotter the lower their index.
    let long = format!("/nonexistent/{}", "very_long_module_name_".repeat(7));
    let mut w = SpoolWriter::new(std::fs::File::create(&spool).unwrap(), header()).unwrap();
    let _lock = RecordingLock::hold(&spool);
    let m = w
        .define_module(&spulse::NewModule {
            pid: PID,
            start: BASE,
            size: 0x10000,
            file_offset: 0,
            generation: 1,
            path: long.as_bytes(),
            build_id: &[],
        })
        .unwrap();
    let th = w.define_thread(PID, PID, "main").unwrap();
    let mut t = START_US;
    for i in 0..40u64 {
        let f = w.define_frame(Frame::Module { module: m, file_relative: 0x100 + i * 16 }).unwrap();
        let st = w.define_stack(None, f).unwrap();
        for _ in 0..(50 - i) {
            t += INTERVAL_US;
            w.sample(t, th, st).unwrap();
        }
    }
    w.into_inner().unwrap();

    let (master, slave) = pty(80, 24);
    let mut child = Command::new(env!("CARGO_BIN_EXE_spulse"))
        // One row per address (by default the module's are one `[unknown]` row).
        .args(["follow", s(&spool), "--interval", "0.1", "-n", "50", "--split-unknown"])
        .stdin(std::process::Stdio::null())
        .stdout(slave.try_clone().unwrap())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(slave);
    // Read the terminal until the child is gone (EIO once no slave is open).
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut master = master;
        let mut buf = [0u8; 4096];
        while let Ok(n) = std::io::Read::read(&mut master, &mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut screen: Vec<u8> = Vec::new();
    let t0 = Instant::now();
    // Three tables drawn, then Ctrl-C.
    while String::from_utf8_lossy(&screen).matches("--- ").count() < 3 {
        assert!(t0.elapsed() < Duration::from_secs(10), "no tables: {}", String::from_utf8_lossy(&screen));
        if let Ok(chunk) = rx.recv_timeout(Duration::from_millis(100)) {
            screen.extend(chunk);
        }
    }
    let st = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{err}");
    assert!(err.contains("stopped: interrupted; 1220 samples"), "{err}");
    while let Ok(chunk) = rx.recv_timeout(Duration::from_millis(500)) {
        screen.extend(chunk);
    }
    let text = String::from_utf8_lossy(&screen).replace("\r\n", "\n");

    // Alternate screen on first, off (with the cursor back) before the end.
    assert!(text.starts_with("\x1b[?1049h"), "{text:?}");
    let (alt, after) = text.split_once("\x1b[?25h\x1b[?1049l").expect("alternate screen left");
    assert_eq!(alt.matches("\x1b[?1049h").count(), 1);
    let frames: Vec<&str> = alt.split("\x1b[H\x1b[2J").skip(1).collect();
    assert!(frames.len() >= 3, "{alt:?}");
    for frame in &frames {
        let lines: Vec<&str> = frame.split('\n').collect();
        // Header, column line and 21 rows, then the cursor on the empty last row.
        assert_eq!(lines.len(), 24, "{frame}");
        assert_eq!(*lines.last().unwrap(), "", "nothing written on the last row: {frame}");
        assert!(
            lines[0].starts_with("--- ") && lines[0].contains("1220 samples"),
            "header on screen: {frame}"
        );
        assert!(lines[1].contains("FUNCTION (MODULE)"), "{frame}");
        for l in &lines {
            assert!(columns(l) <= 80, "{} columns: {l}", columns(l));
            assert!(!l.contains('\x1b'), "{l:?}");
        }
        // Long names are cut with an ellipsis; the hottest comes first.
        assert!(lines[2].ends_with('…') && lines[2].contains("very_long_module_name_"), "{frame}");
        assert!(lines[2].trim_start().starts_with("50 "), "{frame}");
    }
    // Back on the normal screen: the final table once, 50 rows as asked, cut to 80 columns.
    let final_lines: Vec<&str> = after.lines().collect();
    assert!(final_lines[0].starts_with("--- "), "{after}");
    assert_eq!(final_lines.iter().filter(|l| l.contains("very_long_module_name_")).count(), 40, "{after}");
    assert!(final_lines.iter().all(|l| columns(l) <= 80), "{after}");
    assert!(!after.contains('\x1b'), "{after:?}");
}

#[test]
fn follow_waits_for_the_header_of_a_running_recording() {
    // The recorder created and locked the file but has written only part of
    // the header: without --wait this is not an error while the lock is held.
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("young.spool");
    let mut w = SpoolWriter::new(Vec::new(), header()).unwrap();
    let th = w.define_thread(PID, PID, "main").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let st = w.define_stack(None, f).unwrap();
    for i in 0..7 {
        w.sample(START_US + (i + 1) * INTERVAL_US, th, st).unwrap();
    }
    let bytes = w.into_inner().unwrap();
    let mut file = std::fs::File::create(&spool).unwrap();
    let lock = RecordingLock::hold(&spool);
    file.write_all(&bytes[..4]).unwrap();
    let mut child = spawn_spulse(&["follow", s(&spool), "--interval", "0.1"]);
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut err, &mut line).unwrap();
    assert!(line.contains("waiting for the recorder to write the spool's header"), "{line}");
    file.write_all(&bytes[4..]).unwrap();
    drop(lock);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{rest}");
    assert!(rest.contains("stopped: recording ended") && rest.contains("; 7 samples"), "{rest}");
    // The same partial header with nobody recording is an error at once.
    std::fs::write(&spool, &bytes[..4]).unwrap();
    let o = spulse(&["follow", s(&spool)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("file ends inside the stream header"), "{}", stderr(&o));
}
