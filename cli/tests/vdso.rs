//! vDSO frames are named: this test process records itself calling
//! `clock_gettime(CLOCK_MONOTONIC)` (answered by the vDSO, no system call) in a
//! loop, and `spulse top` names the vDSO function from its own copy of the
//! vDSO (same kernel, same build id). A vDSO module with another build id is
//! left unnamed rather than misnamed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use spulse::{Frame, NewModule, SpoolWriter};

#[inline(never)]
fn read_clock_for(cpu: Duration) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    let mut acc = 0u64;
    let start = Instant::now();
    let mut c0 = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec passed.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut c0) };
    loop {
        for _ in 0..10_000 {
            // SAFETY: clock_gettime writes the timespec passed.
            unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
            acc = acc.wrapping_add(ts.tv_nsec as u64);
        }
        let mut c = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes the timespec passed.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut c) };
        let used = Duration::new(c.tv_sec as u64, c.tv_nsec as u32)
            .saturating_sub(Duration::new(c0.tv_sec as u64, c0.tv_nsec as u32));
        if used >= cpu || start.elapsed() > Duration::from_secs(10) {
            return acc;
        }
    }
}

#[test]
fn vdso_functions_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("vdso.spool");
    let guard = spulse::Recorder::builder().frequency_hz(999).start(&spool).expect("start");
    std::hint::black_box(read_clock_for(Duration::from_millis(500)));
    let stats = guard.finish().expect("finish");
    let rows: Value = serde_json::from_str(&ok(&["top", s(&spool), "--json", "-n", "0"])).unwrap();
    let rows = rows.as_array().unwrap();
    let vdso: Vec<&Value> =
        rows.iter().filter(|r| r["module"].as_str().unwrap_or("").contains("vdso")).collect();
    let self_in_vdso: u64 = vdso.iter().map(|r| r["self"].as_u64().unwrap()).sum();
    assert!(
        self_in_vdso * 10 >= stats.samples_written,
        "too few samples in the vDSO ({self_in_vdso} of {}): {rows:?}",
        stats.samples_written
    );
    for r in &vdso {
        let name = r["function"].as_str().unwrap();
        assert!(!name.contains('+'), "an unnamed vDSO frame: {r}");
    }
    assert!(
        vdso.iter().any(|r| r["function"].as_str().unwrap().contains("clock_gettime")),
        "no clock_gettime among the vDSO rows: {vdso:?}"
    );
}

#[test]
fn a_vdso_of_another_build_is_not_named() {
    let p = program();
    let path = p.dir.path().join("other.spool");
    let mut w = SpoolWriter::new(std::fs::File::create(&path).unwrap(), header()).unwrap();
    let m = w
        .define_module(&NewModule {
            pid: PID,
            start: 0x7fff_0000_0000,
            size: 0x2000,
            file_offset: 0,
            generation: 1,
            path: b"linux-vdso.so.1",
            build_id: &[0xab; 20],
        })
        .unwrap();
    let f = w.define_frame(Frame::Module { module: m, file_relative: 0x800 }).unwrap();
    let st = w.define_stack(None, f).unwrap();
    let th = w.define_thread(PID, PID, "main").unwrap();
    w.sample(START_US + 1, th, st).unwrap();
    w.into_inner().unwrap();
    let rows: Value = serde_json::from_str(&ok(&["top", s(&path), "--json", "--split-unknown"])).unwrap();
    assert_eq!(rows[0]["function"], "linux-vdso.so.1+0x800", "{rows}");
    // By default: the module's one unknown row.
    let rows: Value = serde_json::from_str(&ok(&["top", s(&path), "--json"])).unwrap();
    assert_eq!((&rows[0]["function"], &rows[0]["module"]), (&"[unknown]".into(), &"linux-vdso.so.1".into()));
}
