//! `spulse follow` on a spool that a writer thread is still appending to, on a
//! pipe: tables per interval, and each stop condition.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use spulse::{Frame, SpoolWriter};

/// Append `rounds` rounds of 3 hot_a + 1 hot_b samples, flushing each round,
/// `pause` apart. The spool's process is `pid`.
fn writer(p: &Program, path: &Path, pid: u32, rounds: u32, pause: Duration) {
    let mut w = SpoolWriter::new(std::fs::File::create(path).unwrap(), header()).unwrap();
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
fn follow_prints_tables_while_written_and_stops_when_idle() {
    let p = program();
    let spool = p.dir.path().join("live.spool");
    let me = std::process::id();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let writer_thread = {
        let spool = spool.clone();
        let prog = program_copy(&p);
        std::thread::spawn(move || {
            ready_tx.send(()).unwrap();
            writer(&prog, &spool, me, 15, Duration::from_millis(100));
        })
    };
    ready_rx.recv().unwrap();
    let t0 = Instant::now();
    while !spool.exists() || std::fs::metadata(&spool).unwrap().len() < 16 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(5));
    }
    let child = spawn_spulse(&["follow", s(&spool), "--interval", "0.2", "--idle-exit", "3", "-n", "5"]);
    writer_thread.join().unwrap();
    let o = child.wait_with_output().unwrap();
    let out = stdout(&o);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("file idle"), "{err}");
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
fn follow_stops_when_the_writing_process_is_gone() {
    let p = program();
    let spool = p.dir.path().join("dead.spool");
    let pid = 4_190_010;
    assert!(!Path::new(&format!("/proc/{pid}")).exists());
    writer(&p, &spool, pid, 2, Duration::ZERO);
    let t0 = Instant::now();
    let o = spulse(&["follow", s(&spool), "--interval", "0.1", "--idle-exit", "0"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("writer gone"), "{}", stderr(&o));
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(stdout(&o).contains(": 80 samples"), "{}", stdout(&o));
}

#[test]
fn follow_stops_cleanly_on_sigint() {
    let p = program();
    let spool = p.dir.path().join("int.spool");
    writer(&p, &spool, std::process::id(), 1, Duration::ZERO);
    let mut child = spawn_spulse(&["follow", s(&spool), "--interval", "0.1", "--idle-exit", "0"]);
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
    writer(&p, &spool, 4_190_011, 1, Duration::ZERO);
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
    let mut child = spawn_spulse(&["follow", s(&spool), "--interval", "0.1", "--idle-exit", "0"]);
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
