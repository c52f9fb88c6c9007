//! A hostile spool of a few very deep, distinct chains with a sample at every
//! stack prefix: `top` visits each distinct stack node once, and the exports
//! hold memory bounded by the distinct stacks while they write output that is
//! (for the formats that spell every stack in full) the sum of the depths.
//! Peak RSS is measured per child with `wait4`, so it does not depend on the
//! other tests or on machine speed.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use spulse::{Frame, Header, NewModule, SpoolWriter};
use spulse_cli::aggregate::aggregate;
use spulse_cli::report::{CallTree, Shape};
use spulse_cli::select::Filter;
use spulse_cli::symbolize::{Options, Symbolizer};

/// A module name long enough that the folded text dwarfs everything else.
const MODULE: &str = "a_module_with_a_rather_long_file_name_for_the_deep_chain_spool.so";

/// `chains` chains of `depth` distinct frames; every stack prefix has one sample.
fn deep_spool(path: &Path, chains: u64, depth: u64) {
    let header = Header { start_time_us: 1_000_000, interval_us: 100 };
    let file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut w = SpoolWriter::new(file, header).unwrap();
    let mp = format!("/nonexistent/{MODULE}");
    let m = w
        .define_module(&NewModule {
            pid: 1,
            start: 0x10000,
            size: 1 << 30,
            file_offset: 0,
            generation: 0,
            path: mp.as_bytes(),
            build_id: b"",
        })
        .unwrap();
    let th = w.define_thread(1, 1, "main").unwrap();
    let mut t = 1_000_000;
    for c in 0..chains {
        let mut s = None;
        for d in 0..depth {
            let f = w.define_frame(Frame::Module { module: m, file_relative: (c * depth + d) * 16 }).unwrap();
            let st = w.define_stack(s, f).unwrap();
            s = Some(st);
            t += 100;
            w.sample(t, th, st).unwrap();
        }
    }
    w.into_inner().unwrap();
}

/// Run the real binary with stdout counted (not kept); returns (stdout bytes,
/// stdout lines, peak RSS in KB) of that one child.
// The child is reaped by `wait4` (for its own rusage), not by `Child::wait`.
#[allow(clippy::zombie_processes)]
fn run_measured(args: &[&str]) -> (u64, u64, i64) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (mut bytes, mut lines) = (0u64, 0u64);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = stdout.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        bytes += n as u64;
        lines += buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
    }
    let mut status = 0;
    // SAFETY: wait4 on our own child, with pointers to locals it fills in; the
    // child is reaped here and never waited for through `Child` again.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        assert_eq!(
            libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut ru),
            child.id() as libc::pid_t
        );
        ru
    };
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "spulse {args:?} failed: {status}");
    (bytes, lines, ru.ru_maxrss)
}

/// The folded text of the chains: every prefix of every chain, one sample each.
fn expected_folded_bytes(chains: u64, depth: u64) -> u64 {
    let mut total = 0;
    for c in 0..chains {
        let mut line = 0u64;
        for d in 0..depth {
            let name = format!("{MODULE}+{:#x}", (c * depth + d) * 16).len() as u64;
            line += name + u64::from(d > 0);
            total += line + " 1\n".len() as u64;
        }
    }
    total
}

/// One test, so that no other test's memory is in this process when a child
/// is started (a child's peak RSS counts the pages it shares with its parent
/// until it executes the binary); the in-process part comes last.
#[test]
fn deep_chains_stay_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.spool");
    deep_spool(&big, 10, 4096);
    assert!(std::fs::metadata(&big).unwrap().len() < 1 << 20);

    // The real binary agrees, and stays small.
    // The frames are in a module whose file is gone: `--split-unknown` keeps
    // each a function of its own (by default they are one `[unknown]`).
    let (bytes, lines, rss) = run_measured(&["top", big.to_str().unwrap(), "-n", "5", "--split-unknown"]);
    assert_eq!(lines, 1 + 1 + 5, "total line, header, 5 rows ({bytes} bytes)");
    assert!(rss < 64 * 1024, "top peak RSS {rss} KB");
    // By default the module's code is one row: every sample once in its
    // total, however deep the chain (consecutive frames of it are one).
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["top", big.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    assert!(o.status.success());
    let rows: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(rows.as_array().unwrap().len(), 1, "{rows}");
    assert_eq!(
        (&rows[0]["function"], &rows[0]["self"], &rows[0]["total"]),
        (&"[unknown]".into(), &40_960.into(), &40_960.into())
    );

    let b = big.to_str().unwrap();
    // Spelling 10 x 4096 stacks in full would take gigabytes; these formats
    // share prefixes (pprof's locations, Firefox's stack table) or draw only
    // what is wide enough (SVG), so memory stays far below that.
    for (format, max_kb) in [("pprof", 96 * 1024), ("svg", 256 * 1024), ("firefox", 192 * 1024)] {
        let (bytes, _, rss) = run_measured(&["export", b, "--format", format, "-o", "-", "--split-unknown"]);
        eprintln!("{format}: {bytes} bytes, peak RSS {rss} KB");
        assert!(bytes > 0);
        assert!(rss < max_kb, "{format}: peak RSS {rss} KB");
    }

    // Folded stacks and speedscope spell every stack: on 10 x 512 chains the
    // output is ~100 MB, the memory a small fraction of it.
    let small = dir.path().join("small.spool");
    deep_spool(&small, 10, 512);
    let sm = small.to_str().unwrap();
    let want = expected_folded_bytes(10, 512);
    let (bytes, lines, rss) =
        run_measured(&["export", sm, "--format", "collapsed", "-o", "-", "--split-unknown"]);
    eprintln!("collapsed: {bytes} bytes, peak RSS {rss} KB");
    assert_eq!((bytes, lines), (want, 5120));
    assert!(rss * 1024 < want as i64 / 4, "collapsed: peak RSS {rss} KB for {want} bytes of output");
    let (bytes, _, rss) = run_measured(&["export", sm, "--format", "speedscope", "-o", "-"]);
    eprintln!("speedscope: {bytes} bytes, peak RSS {rss} KB");
    assert!(rss < 32 * 1024, "speedscope: peak RSS {rss} KB");

    // In process: the work is one lookup per distinct stack node.
    let replay = spulse_cli::input::open_replay(&big).unwrap();
    let agg = aggregate(&replay, &Filter::default(), false).unwrap();
    let mut sym = Symbolizer::new(Options::default());
    let tree =
        CallTree::build_shaped(&replay, &agg, &mut sym, Shape { split_unknown: true, ..Shape::default() });
    assert_eq!(tree.len(), 40_960);
    let stats = tree.function_stats(&sym);
    // One lookup per spool stack record, not one per frame of every stack
    // (which would be 10 x 4096 x 4097 / 2).
    assert_eq!(sym.lookups(), 40_960);
    assert_eq!(stats.len(), 40_960);
    assert!(stats.iter().all(|s| s.self_samples == 1));
    let total: u64 = stats.iter().map(|s| s.total_samples).sum();
    assert_eq!(total, 10 * 4096 * 4097 / 2, "a frame at depth d is on 4096 - d stacks");
    assert_eq!(stats.iter().map(|s| s.total_samples).max(), Some(4096));
}
