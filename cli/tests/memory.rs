//! Export memory is bounded by the distinct stacks, not the samples: the peak
//! RSS of `spulse export` on a spool with 40 times more samples (same stacks)
//! stays within a few MB of the small one's. Alone in its test binary so that
//! no other child process shares `RUSAGE_CHILDREN`.

use std::path::Path;
use std::process::Command;

use spulse::{Frame, Header, NewModule, SpoolWriter};

fn spool(path: &Path, samples: u64) {
    let header = Header { start_time_us: 1_000_000, interval_us: 100 };
    let file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut w = SpoolWriter::new(file, header).unwrap();
    let m = w
        .define_module(&NewModule {
            pid: 1,
            start: 0x10000,
            size: 0x100000,
            file_offset: 0,
            generation: 0,
            path: b"/nonexistent/app",
            build_id: b"",
        })
        .unwrap();
    let threads: Vec<_> = (0..4).map(|i| w.define_thread(1, 10 + i, "t").unwrap()).collect();
    let mut leaves = Vec::new();
    for i in 0..200u64 {
        let mut s = None;
        for d in 0..10u64 {
            let f = w.define_frame(Frame::Module { module: m, file_relative: (i * 10 + d) * 16 }).unwrap();
            s = Some(w.define_stack(s, f).unwrap());
        }
        leaves.push(s.unwrap());
    }
    for i in 0..samples {
        w.sample(1_000_000 + i * 100, threads[(i % 4) as usize], leaves[(i * 7 % 200) as usize]).unwrap();
    }
    w.into_inner().unwrap();
}

fn max_rss_children_kb() -> i64 {
    // SAFETY: getrusage only writes the struct we pass, which is zeroed and ours.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru), 0);
        ru.ru_maxrss
    }
}

fn export(spool: &Path, format: &str, out: &Path) {
    let st = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["export", spool.to_str().unwrap(), "--format", format, "-o", out.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn export_memory_does_not_grow_with_samples() {
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.spool");
    let big = dir.path().join("big.spool");
    spool(&small, 100_000);
    spool(&big, 4_000_000);
    let big_len = std::fs::metadata(&big).unwrap().len();
    assert!(big_len > 16 << 20, "big spool is {big_len} bytes");
    let out = dir.path().join("out");
    for f in ["pprof", "collapsed"] {
        export(&small, f, &out);
    }
    let base = max_rss_children_kb();
    for f in ["pprof", "collapsed"] {
        export(&big, f, &out);
    }
    let after = max_rss_children_kb();
    eprintln!("peak RSS: {base} KB (100k samples), {after} KB (4M samples, {big_len} bytes)");
    // Holding even 4 bytes per sample would add 16 MB.
    assert!(after - base < 6 * 1024, "peak RSS grew from {base} KB to {after} KB");
}
