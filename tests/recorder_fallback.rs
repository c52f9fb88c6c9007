//! Automatic fallback: in a process where `perf_event_open` is refused (a
//! seccomp filter returning EACCES, as container runtimes do), the default
//! engine choice must fall back to per-thread CPU timers, say so in `Stats`
//! and in the spool header, and still reach the requested rate.

mod recorder_support;

use std::hint::black_box;
use std::time::Duration;

use recorder_support::*;

/// Refuse `perf_event_open` with EACCES for this thread and the threads it creates.
fn refuse_perf_event_open() {
    const RET_ERRNO: u32 = 0x0005_0000;
    const RET_ALLOW: u32 = 0x7fff_0000;
    let nr = libc::SYS_perf_event_open as u32;
    let mut filter = [
        // A = seccomp_data.nr
        libc::sock_filter { code: 0x20, jt: 0, jf: 0, k: 0 },
        // if A == nr goto refuse else goto allow
        libc::sock_filter { code: 0x15, jt: 0, jf: 1, k: nr },
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: RET_ERRNO | libc::EACCES as u32 },
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: RET_ALLOW },
    ];
    let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_mut_ptr() };
    // SAFETY: standard seccomp filter installation on the calling thread; the
    // program only refuses one system call.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog),
            0,
            "seccomp: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Burn `cpu` seconds of CPU (the clock read every 100 000 rounds); returns the CPU time used.
fn burn(cpu: f64) -> f64 {
    let c0 = thread_cpu_seconds();
    black_box(burn_cpu(cpu, 100_000, Duration::from_secs(10)));
    thread_cpu_seconds() - c0
}

/// Child role (re-executed by the test below): refuse perf events, record with
/// the default engine choice, print what happened.
#[test]
fn fallback_role() {
    let Ok(path) = std::env::var("SPULSE_TEST_FALLBACK_SPOOL") else { return };
    // qemu-user has no perf_event_open (ENOSYS) and refuses seccomp filters:
    // there the emulator itself is the refusal under test.
    let refusal = if emulated() && !perf_event_open_implemented() {
        eprintln!(
            "perf_event_open is not implemented by this emulator: testing the fallback from that refusal"
        );
        "not implemented"
    } else {
        refuse_perf_event_open();
        "denied"
    };
    // Forcing the refused engine is an error that says what and why, and
    // leaves nothing installed or created.
    let forced = std::path::PathBuf::from(format!("{path}.forced"));
    let e = spulse::Recorder::builder().engine(spulse::EngineChoice::PerfEvent).start(&forced).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("perf_event_open") && msg.contains(refusal), "{msg}");
    // The OS error is the error's source, typed.
    let errno = if refusal == "denied" { libc::EACCES } else { libc::ENOSYS };
    match &e {
        spulse::Error::Recorder(spulse::RecorderError::EngineRefused { what, source }) => {
            assert!(what.contains("perf_event_open"), "{what}");
            assert_eq!(source.raw_os_error(), Some(errno), "{source}");
        }
        other => panic!("expected EngineRefused, got {other}"),
    }
    let source = std::error::Error::source(&e).expect("the OS error as source");
    assert_eq!(source.downcast_ref::<std::io::Error>().and_then(|e| e.raw_os_error()), Some(errno));
    assert!(!forced.exists());
    // SAFETY: querying a disposition (null new action).
    let trap = unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGTRAP, std::ptr::null(), &mut cur);
        cur.sa_sigaction
    };
    assert_eq!(trap, libc::SIG_DFL, "SIGTRAP handler left installed after a refused start");
    let g = spulse::Recorder::builder().frequency_hz(999).start(&path).unwrap();
    let tid = gettid();
    let cpu = burn(1.0);
    let stats = g.finish().unwrap();
    println!("RESULT {} {} {cpu} {tid}", stats.engine, stats.samples_written);
}

#[test]
fn perf_refused_falls_back_to_thread_timers() {
    let (_dir, path) = spool_path("fallback.spool");
    let out = run_role("fallback_role", "SPULSE_TEST_FALLBACK_SPOOL", &path);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let line = stdout.lines().find_map(|l| l.split_once("RESULT ").map(|x| x.1)).expect("child result");
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f[0], "thread-cpu-timer", "engine after perf was refused");
    let cpu: f64 = f[2].parse().unwrap();
    let tid: u32 = f[3].parse().unwrap();
    let snap = spulse::Snapshot::open(&path).unwrap();
    let n = snap.samples().filter(|s| snap.thread(s.thread).tid == tid).count() as f64;
    let ratio = n / (cpu * 999.0);
    eprintln!("fallback: {n} samples for {cpu:.3} CPU-s: capture {ratio:.3}");
    assert!((0.9..=1.1).contains(&ratio), "capture {ratio:.3}");
}
