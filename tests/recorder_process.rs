//! Processes under recording: a forked child runs normally, never writes into the
//! parent's spool and can record its own; programs exec'd by a child (fork+exec,
//! `Command`) or by the recorded process itself (direct `execv`) run normally
//! and are never killed by a profiling signal. Each engine is exercised for real.

mod recorder_support;

use std::process::Command;
use std::time::Duration;

use recorder_support::*;
use spulse::EngineChoice;

/// A shell loop that burns ~0.2-0.5 s of CPU, then prints "done".
const BUSY_SH: &str = "i=0; while [ $i -lt 150000 ]; do i=$((i+1)); done; echo done";

/// Burn `cpu` seconds of CPU, giving up after 5 s of wall time.
fn burn(cpu: f64) -> u64 {
    burn_cpu(cpu, 10_000, Duration::from_secs(5))
}

fn wait_exit_code(pid: libc::pid_t) -> Result<i32, String> {
    let mut status = 0;
    // SAFETY: waiting for our own child.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    if r != pid {
        return Err(format!("waitpid failed: {}", std::io::Error::last_os_error()));
    }
    if libc::WIFSIGNALED(status) {
        return Err(format!("child killed by signal {}", libc::WTERMSIG(status)));
    }
    Ok(libc::WEXITSTATUS(status))
}

fn fork_child_records_own_spool(engine: EngineChoice) {
    let _serial = serial();
    let (dir, path) = spool_path("parent.spool");
    let child_path = dir.path().join("child.spool");
    let guard = spulse::Recorder::builder().engine(engine).start(&path).unwrap();
    burn(0.1);
    // SAFETY: the child only burns CPU, records to its own spool through the
    // public API and leaves with _exit, never returning into the test harness.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = std::panic::catch_unwind(|| {
            burn(0.2); // any stray signal of the parent's recorder would arrive here
            let g =
                spulse::Recorder::builder().engine(engine).start(&child_path).map_err(|e| e.to_string())?;
            burn(0.3);
            let st = g.finish().map_err(|e| e.to_string())?;
            if st.samples_written == 0 {
                return Err("child recorded nothing".to_string());
            }
            Ok::<(), String>(())
        });
        let code = match code {
            Ok(Ok(())) => 0,
            Ok(Err(e)) => {
                eprintln!("child: {e}");
                2
            }
            Err(_) => 3,
        };
        // SAFETY: leave the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    assert!(pid > 0, "fork failed");
    burn(0.2);
    let code = wait_exit_code(pid);
    let stats = guard.finish().unwrap();
    assert_eq!(code, Ok(0), "forked child under {engine:?} did not run normally");

    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() } as u32;
    let parent = spulse::Snapshot::open(&path).unwrap();
    assert!(parent.threads().iter().all(|t| t.pid == me), "the child wrote into the parent's spool");
    assert!(parent.modules().iter().all(|m| m.pid == me));
    assert!(stats.samples_written > 0);
    let child = spulse::Snapshot::open(&child_path).expect("the child's own spool");
    assert!(!child.is_empty());
    assert!(child.threads().iter().all(|t| t.pid == pid as u32), "child spool holds the child's threads");
}

#[test]
fn fork_under_perf_events() {
    fork_child_records_own_spool(EngineChoice::PerfEvent);
}

#[test]
fn fork_under_thread_timers() {
    fork_child_records_own_spool(EngineChoice::ThreadCpuTimer);
}

#[test]
fn fork_under_process_timer() {
    fork_child_records_own_spool(EngineChoice::ProcessTimer);
}

fn exec_from_children(engine: EngineChoice) {
    let _serial = serial();
    let (_dir, path) = spool_path("exec.spool");
    let guard = spulse::Recorder::builder().engine(engine).frequency_hz(4000).start(&path).unwrap();
    // Keep this process busy (and signalled) while the children start.
    let busy = std::thread::spawn(|| burn(0.5));
    let out = Command::new("/bin/sh").arg("-c").arg(BUSY_SH).output().expect("spawn sh");
    assert!(out.status.success(), "Command child under {engine:?}: {:?}", out.status);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "done");

    let sh = std::ffi::CString::new("/bin/sh").unwrap();
    let c = std::ffi::CString::new("-c").unwrap();
    let script = std::ffi::CString::new(BUSY_SH.replace("echo done", "exit 0")).unwrap();
    let argv = [sh.as_ptr(), c.as_ptr(), script.as_ptr(), std::ptr::null()];
    // SAFETY: the child only calls execv (async-signal-safe) and _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: argv is a null-terminated array of valid C strings.
        unsafe {
            libc::execv(sh.as_ptr(), argv.as_ptr());
            libc::_exit(127);
        }
    }
    assert!(pid > 0);
    assert_eq!(wait_exit_code(pid), Ok(0), "fork+exec child under {engine:?}");
    busy.join().unwrap();
    guard.finish().unwrap();
}

#[test]
fn exec_children_under_each_engine() {
    for e in [EngineChoice::PerfEvent, EngineChoice::ThreadCpuTimer, EngineChoice::ProcessTimer] {
        exec_from_children(e);
    }
}

/// Role of this test binary when re-executed by `direct_exec_of_recorded_process`:
/// record, burn CPU on two threads, then replace the process with a busy shell.
#[test]
fn direct_exec_role() {
    let Ok(engine) = std::env::var("SPULSE_TEST_DIRECT_EXEC") else { return };
    let engine = match engine.as_str() {
        "perf" => EngineChoice::PerfEvent,
        _ => EngineChoice::ThreadCpuTimer,
    };
    let dir = std::env::var("SPULSE_TEST_DIR").unwrap();
    let _guard = spulse::Recorder::builder()
        .engine(engine)
        .frequency_hz(4000)
        .start(std::path::Path::new(&dir).join("direct.spool"))
        .unwrap();
    let t = std::thread::spawn(|| loop {
        burn(1.0);
    });
    burn(0.3);
    let _ = &t;
    let sh = std::ffi::CString::new("/bin/sh").unwrap();
    let c = std::ffi::CString::new("-c").unwrap();
    let script = std::ffi::CString::new(BUSY_SH).unwrap();
    let argv = [sh.as_ptr(), c.as_ptr(), script.as_ptr(), std::ptr::null()];
    // SAFETY: replaces this process image; argv is null-terminated C strings.
    unsafe { libc::execv(sh.as_ptr(), argv.as_ptr()) };
    panic!("execv failed");
}

/// The recorded process itself execs (while a second thread is busy and being
/// sampled): perf events are removed at exec and POSIX timers deleted, so the
/// new program must run to completion. (The process-timer engine's itimer
/// survives exec by POSIX rules; that engine is only the last resort.)
#[test]
fn direct_exec_of_recorded_process() {
    let exe = std::env::current_exe().unwrap();
    for engine in ["perf", "timers"] {
        for round in 0..3 {
            let dir = tempfile::tempdir().unwrap();
            let out = Command::new(&exe)
                .args(["--exact", "direct_exec_role", "--nocapture", "--test-threads", "1"])
                .env("SPULSE_TEST_DIRECT_EXEC", engine)
                .env("SPULSE_TEST_DIR", dir.path())
                .output()
                .unwrap();
            assert!(
                out.status.success() && String::from_utf8_lossy(&out.stdout).contains("done"),
                "{engine} round {round}: exec'd program did not run normally: {:?}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            // The spool the process wrote before exec still opens (not finished: no guard drop).
            spulse::Snapshot::open(dir.path().join("direct.spool")).expect("spool opens");
        }
    }
}
