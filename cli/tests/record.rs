//! `spulse record` on real process trees.
//!
//! This test binary is its own workload: run with `SPULSE_TEST_ROLE` set, it
//! plays one process of a tree (burn CPU, fork, exec through a shell, exit
//! non-zero, get SIGKILLed, write garbage into its spool, call
//! `spulse::start` itself) and reports its main thread's CPU time into a
//! results directory; run without it, it runs the tests (harness = false,
//! so that a workload process runs no test machinery). Every process burns
//! its CPU on its main thread, and each test compares that thread's samples
//! in the merged spool with the CPU time the thread measured for itself.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use spulse::Snapshot;

const ROLE: &str = "SPULSE_TEST_ROLE";
const RESULTS: &str = "SPULSE_TEST_RESULTS";
const HZ: u32 = 499;

// ---------------------------------------------------------------- workload

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Spin on this thread until it has used `d` more CPU time.
fn burn(d: Duration) {
    let end = thread_cpu() + d;
    let mut x = 1u64;
    // Long stretches of pure user-mode work between clock reads: the clock
    // read is a system call, whose kernel time is sampled apart (as [kernel]
    // leaves) and is not what this comparison is about.
    while thread_cpu() < end {
        for i in 0..300_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(std::hint::black_box(i));
        }
        std::hint::black_box(x);
    }
}

/// This thread's user-mode CPU time (`getrusage(RUSAGE_THREAD)`).
fn thread_user() -> Duration {
    // SAFETY: a zeroed rusage is a valid out-parameter; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_THREAD on the calling thread, writing `ru`.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    Duration::new(ru.ru_utime.tv_sec as u64, ru.ru_utime.tv_usec as u32 * 1000)
}

/// Write `<results>/<pid>`: "tid user_ns" (user-mode CPU time: the samples it
/// is compared with are the user-mode ones).
fn report() {
    let dir = std::env::var_os(RESULTS).expect("results dir");
    // SAFETY: getpid and gettid have no preconditions.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    std::fs::write(Path::new(&dir).join(pid.to_string()), format!("{tid} {}", thread_user().as_nanos()))
        .unwrap();
}

fn me() -> PathBuf {
    std::env::current_exe().unwrap()
}

fn role_cmd(role: &str) -> Command {
    let mut c = Command::new(me());
    c.env(ROLE, role);
    c
}

/// Exit through libc `exit`, so atexit handlers (the preload's finish) run.
fn exit(code: i32) -> ! {
    std::io::stdout().flush().ok();
    // SAFETY: exit runs atexit handlers and ends the process.
    unsafe { libc::exit(code) }
}

fn run_role(role: &str) -> ! {
    let ms = |v: u64| Duration::from_millis(v);
    match role {
        "burn" => {
            burn(ms(400));
            report();
            exit(0)
        }
        "burn_then_exec" => {
            burn(ms(400));
            let e = Command::new("/bin/true").exec();
            panic!("exec /bin/true: {e}")
        }
        "burn_fail" => {
            burn(ms(400));
            report();
            exit(7)
        }
        "tree" => {
            // fork without exec: the child burns on its own.
            // SAFETY: fork; the child only burns, reports and exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                burn(ms(400));
                report();
                exit(0);
            }
            // exec through a shell: sh forks and execs this program.
            let mut sh = Command::new("sh");
            sh.arg("-c").arg("\"$0\"; true").arg(me()).env(ROLE, "burn");
            let mut sh = sh.spawn().unwrap();
            // a child that exits non-zero.
            let mut fail = role_cmd("burn_fail").spawn().unwrap();
            burn(ms(400));
            assert_eq!(fail.wait().unwrap().code(), Some(7));
            assert!(sh.wait().unwrap().success());
            let mut st = 0;
            // SAFETY: waits for our forked child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            report();
            exit(5)
        }
        "short_children_ending_in__exit" => {
            // Forked workers that burn 60 ms each and end with `_exit`, as
            // Python's multiprocessing workers do: no `atexit` handler runs.
            let mut kids = Vec::new();
            for _ in 0..3 {
                // SAFETY: fork; the child burns, reports and calls `_exit`.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    burn(ms(60));
                    report();
                    // SAFETY: ends the child without its atexit handlers.
                    unsafe { libc::_exit(0) }
                }
                kids.push(pid);
            }
            for pid in kids {
                let mut st = 0;
                // SAFETY: waits for our forked child.
                unsafe { libc::waitpid(pid, &mut st, 0) };
            }
            burn(ms(100));
            report();
            exit(0)
        }
        "exits_without_atexit" => {
            // A child that ends with `_exit`, one that execs, and the root
            // ending with `_exit`: none runs the preload's `atexit` handler,
            // and each one's last wait is still open when it ends.
            // SAFETY: fork; the child reports, sleeps and calls `_exit`.
            let a = unsafe { libc::fork() };
            if a == 0 {
                report();
                std::thread::sleep(ms(400));
                // SAFETY: ends the process without its atexit handlers.
                unsafe { libc::_exit(0) }
            }
            // SAFETY: fork; the child reports, sleeps and execs.
            let b = unsafe { libc::fork() };
            if b == 0 {
                report();
                std::thread::sleep(ms(400));
                let e = Command::new("/bin/true").exec();
                panic!("exec /bin/true: {e}");
            }
            for pid in [a, b] {
                let mut st = 0;
                // SAFETY: waits for our forked child.
                unsafe { libc::waitpid(pid, &mut st, 0) };
            }
            report();
            // A failed exec returns its error; the process is recorded on.
            let e = Command::new("/nonexistent/spulse-test").exec();
            assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
            std::thread::sleep(ms(500));
            // SAFETY: ends the process without its atexit handlers.
            unsafe { libc::_exit(3) }
        }
        "exec_in_handler" => {
            // A handler that execs (async-signal-safe; it fails here) at every
            // SIGALRM while the main thread allocates: the exec's request to
            // the writer may come while this thread holds the allocator's lock.
            extern "C" fn on_alarm(_: libc::c_int) {
                let path = c"/nonexistent/spulse-test";
                let argv = [path.as_ptr(), std::ptr::null()];
                // SAFETY: execv with a NUL-terminated path and argv; it fails.
                unsafe { libc::execv(path.as_ptr(), argv.as_ptr()) };
            }
            // SAFETY: a handler that only calls execv; a 5 ms interval timer.
            unsafe {
                libc::signal(libc::SIGALRM, on_alarm as *const () as libc::sighandler_t);
                let every = libc::timeval { tv_sec: 0, tv_usec: 5_000 };
                let it = libc::itimerval { it_interval: every, it_value: every };
                libc::setitimer(libc::ITIMER_REAL, &it, std::ptr::null_mut());
            }
            let t0 = Instant::now();
            let mut kept = Vec::new();
            while t0.elapsed() < ms(1000) {
                let v: Vec<u8> = Vec::with_capacity(16 + kept.len() % 2000);
                kept.push(v);
                if kept.len() > 64 {
                    kept.clear();
                }
            }
            exit(0)
        }
        "kill_tree" => {
            let dir = PathBuf::from(std::env::var_os(RESULTS).unwrap());
            let mut victim = role_cmd("victim").spawn().unwrap();
            let marker = dir.join("victim-ready");
            let t0 = Instant::now();
            while !marker.exists() {
                assert!(t0.elapsed() < Duration::from_secs(60), "the victim never got ready");
                std::thread::sleep(ms(5));
            }
            victim.kill().unwrap(); // SIGKILL
            victim.wait().unwrap();
            burn(ms(300));
            report();
            exit(0)
        }
        "victim" => {
            // Burn 400 ms, report it, then keep burning until SIGKILLed.
            burn(ms(400));
            report();
            let dir = PathBuf::from(std::env::var_os(RESULTS).unwrap());
            // SAFETY: getpid has no preconditions.
            std::fs::write(dir.join("victim-ready"), unsafe { libc::getpid() }.to_string()).unwrap();
            loop {
                burn(ms(100));
            }
        }
        "garbage" => {
            // Append nonsense to this process's own per-process spool (the
            // channel to the collector), then keep working normally.
            let dir = PathBuf::from(std::env::var_os("SPULSE_RECORD_DIR").expect("run by spulse record"));
            // SAFETY: getpid has no preconditions.
            let pid = unsafe { libc::getpid() };
            burn(ms(200));
            let mine = std::fs::read_dir(&dir)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .find(|p| {
                    p.file_name().unwrap().to_str().unwrap().starts_with(&format!("{pid}."))
                        && p.extension().is_some_and(|e| e == "spool")
                })
                .expect("own spool");
            // The recorder's writer thread writes at its own file offset, so
            // garbage appended at the end could be overwritten by a flush that
            // lands before the SIGKILL below. Write it 64 KiB past the end
            // instead: whatever the writer adds in between, the hole of zero
            // bytes (tag 0, not a record) and the garbage after it stay.
            let f = std::fs::OpenOptions::new().write(true).open(&mine).unwrap();
            let end = f.metadata().unwrap().len() + 65536;
            use std::os::unix::fs::FileExt;
            f.write_all_at(&[0xee; 64], end).unwrap();
            f.write_all_at(b"\x01\x00\x05garbage that claims to be a module", end + 64).unwrap();
            // A fake spool for another "process" too: not even a header.
            std::fs::write(dir.join("4000000.1.spool"), b"not a spool at all").unwrap();
            // End here: the process's earlier samples stay readable.
            // SAFETY: signalling this process itself.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            unreachable!("SIGKILL ends the process")
        }
        "garbage_tree" => {
            let mut g = role_cmd("garbage").spawn().unwrap();
            let mut b = role_cmd("burn").spawn().unwrap();
            burn(ms(300));
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(g.wait().unwrap().signal(), Some(libc::SIGKILL));
            assert!(b.wait().unwrap().success());
            report();
            exit(0)
        }
        "embedded" => {
            let dir = PathBuf::from(std::env::var_os(RESULTS).unwrap());
            let own = dir.join("embedded.spool");
            let msg = match spulse::start(&own) {
                Ok(_) => "STARTED".to_string(),
                Err(e) => e.to_string(),
            };
            std::fs::write(dir.join("embedded-result"), msg).unwrap();
            burn(Duration::from_millis(300));
            report();
            exit(0)
        }
        "live" => {
            // Two processes busy for long enough to be watched.
            // SAFETY: fork; the child only burns and exits.
            let pid = unsafe { libc::fork() };
            burn(ms(1500));
            if pid == 0 {
                exit(0);
            }
            let mut st = 0;
            // SAFETY: waits for our forked child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            exit(0)
        }
        other => panic!("unknown role {other}"),
    }
}

// ---------------------------------------------------------------- helpers

struct Run {
    _dir: tempfile::TempDir,
    results: PathBuf,
    spool: PathBuf,
    out: Output,
}

fn record_role(role: &str, extra: &[&str]) -> Run {
    record_role_with(role, extra, &[])
}

fn record_role_with(role: &str, extra: &[&str], envs: &[(&str, &Path)]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("results");
    std::fs::create_dir(&results).unwrap();
    let spool = dir.path().join("out.spool");
    let out = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-F", &HZ.to_string(), "-o"])
        .arg(&spool)
        .args(extra)
        .arg("--")
        .arg(me())
        .env(ROLE, role)
        .env(RESULTS, &results)
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    Run { _dir: dir, results, spool, out }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// pid -> (tid, cpu seconds) from the results directory.
fn reports(results: &Path) -> HashMap<u32, (u32, f64)> {
    let mut m = HashMap::new();
    for e in std::fs::read_dir(results).unwrap().flatten() {
        let Ok(pid) = e.file_name().to_str().unwrap().parse::<u32>() else { continue };
        let text = std::fs::read_to_string(e.path()).unwrap();
        let mut it = text.split_whitespace();
        let tid = it.next().unwrap().parse().unwrap();
        let ns: u64 = it.next().unwrap().parse().unwrap();
        m.insert(pid, (tid, ns as f64 / 1e9));
    }
    m
}

/// Samples per (pid, tid).
fn samples_by_thread(s: &Snapshot) -> HashMap<(u32, u32), u64> {
    let d = s.definitions();
    let mut m = HashMap::new();
    for smp in s.samples() {
        let t = d.thread(smp.thread);
        *m.entry((t.pid, t.tid)).or_insert(0) += 1;
    }
    m
}

fn open_complete(path: &Path) -> Snapshot {
    let s = Snapshot::open(path).unwrap_or_else(|e| panic!("merged spool unreadable: {e}"));
    assert!(!s.recovered_from_truncated_tail(), "a finished recording ends on a record boundary");
    s
}

/// User-mode samples per (pid, tid): those whose leaf is not a kernel-mode frame.
fn user_samples_by_thread(s: &Snapshot) -> HashMap<(u32, u32), u64> {
    let d = s.definitions();
    let mut m = HashMap::new();
    for smp in s.samples() {
        if let spulse::Frame::Absolute { kernel: true, .. } = d.frame(d.stack(smp.stack).frame) {
            continue;
        }
        let t = d.thread(smp.thread);
        *m.entry((t.pid, t.tid)).or_insert(0) += 1;
    }
    m
}

/// Each reported thread's user-mode samples are within 10% of its user-mode
/// CPU time x frequency: like with like, so time the kernel spends on the
/// thread's behalf (the clock reads, page faults, a busy machine's
/// switches), which goes to kernel-mode samples, cannot move the comparison.
fn check_accuracy(s: &Snapshot, reps: &HashMap<u32, (u32, f64)>) {
    let by = user_samples_by_thread(s);
    for (&pid, &(tid, cpu)) in reps {
        let expected = cpu * HZ as f64;
        let got = by.get(&(pid, tid)).copied().unwrap_or(0) as f64;
        assert!(
            (got - expected).abs() <= 0.10 * expected,
            "process {pid} thread {tid}: {got} samples for {cpu:.3} s of CPU at {HZ} Hz (expected {expected:.0} +-10%)"
        );
    }
}

fn check_all_retired(s: &Snapshot) {
    let d = s.definitions();
    assert!(!d.modules().is_empty());
    for m in d.modules() {
        assert!(
            !d.is_module_active(m.id),
            "module {:?} of pid {} ({}) still active",
            m.id,
            m.pid,
            m.path().display()
        );
    }
}

/// The ids are dense per kind and every thread and module carries its pid:
/// the pids of threads and modules are the same set.
fn check_pids(s: &Snapshot) -> Vec<u32> {
    let d = s.definitions();
    let mut tp: Vec<u32> = d.threads().iter().map(|t| t.pid).collect();
    tp.sort_unstable();
    tp.dedup();
    let mut mp: Vec<u32> = d.modules().iter().map(|m| m.pid).collect();
    mp.sort_unstable();
    mp.dedup();
    for p in &tp {
        assert!(mp.contains(p), "threads of pid {p} but no module of it");
    }
    tp
}

fn spulse(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_spulse")).args(args).output().unwrap();
    assert!(o.status.success(), "spulse {args:?}: {}", stderr(&o));
    String::from_utf8(o.stdout).unwrap()
}

/// `info`, `top --pid`, `top --per-process` and the exports show every process.
fn check_views(spool: &Path, s: &Snapshot, pids: &[u32]) {
    let path = spool.to_str().unwrap();
    let by = samples_by_thread(s);
    let samples_of = |pid: u32| by.iter().filter(|((p, _), _)| *p == pid).map(|(_, n)| *n).sum::<u64>();
    let info: serde_json::Value = serde_json::from_str(&spulse(&["info", "--json", path])).unwrap();
    let list = info["process_list"].as_array().unwrap();
    for &pid in pids {
        let p = list
            .iter()
            .find(|p| p["pid"] == pid)
            .unwrap_or_else(|| panic!("pid {pid} not in info: {list:?}"));
        assert_eq!(p["ended"], true, "{p}");
        assert_eq!(p["samples"].as_u64().unwrap(), samples_of(pid), "{p}");
        assert!(!p["program"].as_str().unwrap().is_empty(), "{p}");
        let top = spulse(&["top", "--pid", &pid.to_string(), "-n", "1", path]);
        assert!(top.starts_with(&format!("{} samples", samples_of(pid))), "top --pid {pid}: {top}");
    }
    let text = spulse(&["info", path]);
    assert!(text.contains("PROGRAM") && text.contains("ENDED"), "{text}");
    let per: serde_json::Value =
        serde_json::from_str(&spulse(&["top", "--per-process", "--json", "-n", "3", path])).unwrap();
    for &pid in pids {
        let sec = per.as_array().unwrap().iter().find(|p| p["pid"] == pid).expect("a section per process");
        assert_eq!(sec["samples"].as_u64().unwrap(), samples_of(pid));
    }
    let dir = tempfile::tempdir().unwrap();
    let ss = dir.path().join("x.speedscope.json");
    spulse(&["export", "-f", "speedscope", "-o", ss.to_str().unwrap(), path]);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&ss).unwrap()).unwrap();
    let names: Vec<String> =
        v["profiles"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap().to_string()).collect();
    for &pid in pids {
        assert!(
            names.iter().any(|n| n.contains(&format!("pid {pid}"))),
            "speedscope profile for pid {pid}: {names:?}"
        );
    }
    let ff = dir.path().join("x.firefox.json");
    spulse(&["export", "-f", "firefox", "-o", ff.to_str().unwrap(), path]);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&ff).unwrap()).unwrap();
    let ff_pids: std::collections::HashSet<String> = v["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["pid"].to_string().trim_matches('"').to_string())
        .collect();
    for &pid in pids {
        assert!(ff_pids.contains(&pid.to_string()), "firefox process for pid {pid}: {ff_pids:?}");
    }
}

// ---------------------------------------------------------------- tests

fn tree_fork_exec_and_nonzero_exit() {
    let r = record_role("tree", &[]);
    assert_eq!(r.out.status.code(), Some(5), "exit status of CMD; stderr: {}", stderr(&r.out));
    let err = stderr(&r.out);
    assert!(err.contains("recorded") && err.contains("spulse top"), "summary: {err}");
    let s = open_complete(&r.spool);
    let reps = reports(&r.results);
    // root, its forked child, the program sh exec'd, the child exiting 7.
    assert_eq!(reps.len(), 4, "reports: {reps:?}");
    check_accuracy(&s, &reps);
    check_all_retired(&s);
    let pids = check_pids(&s);
    for p in reps.keys() {
        assert!(pids.contains(p), "pid {p} missing from {pids:?}");
    }
    check_views(&r.spool, &s, &reps.keys().copied().collect::<Vec<_>>());
    // The shell exec'd this program: its pid has this program's module, and
    // the shell image before it was retired before the program's modules came.
    let exe = std::fs::canonicalize(me()).unwrap();
    for p in reps.keys() {
        assert!(
            s.definitions().modules().iter().any(|m| m.pid == *p && Path::new(m.path()) == exe),
            "pid {p} has no module for the test program"
        );
    }
}

/// Forked children that live 60 ms and end with `_exit` keep their samples,
/// with every engine: the interposed `_exit` wakes the writer for a last
/// tick (before, the signal engines' writers could not be woken, and such a
/// child lost everything since its recorder started).
fn short_children_ending_in_exit_keep_their_samples() {
    for engine in ["perf-event", "thread-timer"] {
        let r =
            record_role_with("short_children_ending_in__exit", &[], &[("SPULSE_ENGINE", Path::new(engine))]);
        assert_eq!(r.out.status.code(), Some(0), "{engine}: stderr: {}", stderr(&r.out));
        let s = open_complete(&r.spool);
        let reps = reports(&r.results);
        assert_eq!(reps.len(), 4, "{engine}: the root and three children: {reps:?}");
        let by = user_samples_by_thread(&s);
        for (&pid, &(tid, cpu)) in &reps {
            let expected = cpu * HZ as f64;
            let got = by.get(&(pid, tid)).copied().unwrap_or(0) as f64;
            // The child's first few ms (its recorder's start) are not
            // sampled: at least 70% of a 60 ms burn. At most what the CPU
            // allows, counted twice nowhere: the user time is the kernel's
            // tick-based split of the thread's run time (it read 54 ms where
            // the perf events counted 66, the burn's 60 ms and the child's
            // start, on a loaded CI machine), so the upper bound is loose.
            assert!(
                got >= 0.7 * expected && got <= 1.4 * expected + 4.0,
                "{engine}: process {pid}: {got} samples for {cpu:.3} s of CPU at {HZ} Hz (expected {expected:.0})"
            );
        }
    }
}

/// A process that ends with `_exit` or `exec` runs no `atexit` handler: the
/// preload finishes its recording in those calls, so a wait still open then
/// (a shell's `wait4` for its last command) is in the spool, not lost; after
/// an `exec` that fails, the process is recorded on.
fn exits_without_atexit_keep_their_last_wait() {
    let r = record_role("exits_without_atexit", &["--off-cpu"]);
    assert_eq!(r.out.status.code(), Some(3), "stderr: {}", stderr(&r.out));
    let s = open_complete(&r.spool);
    let reps = reports(&r.results);
    assert_eq!(reps.len(), 3, "root and two children: {reps:?}");
    let mut blocked: HashMap<u32, u64> = reps.keys().map(|&p| (p, 0)).collect();
    for o in s.definitions().off_cpu_intervals() {
        if o.state == spulse::OffCpuState::Blocked {
            if let Some(us) = blocked.get_mut(&s.thread(o.thread).pid) {
                *us += o.duration_us;
            }
        }
    }
    let mut us: Vec<u64> = blocked.values().copied().collect();
    us.sort_unstable();
    // Each child slept 400 ms before `_exit` or `exec`; the root waited for
    // them, failed an `exec`, then slept 500 ms before `_exit`.
    assert!(us[0] >= 380_000 && us[1] >= 380_000, "children blocked {us:?} us: {blocked:?}");
    assert!(us[2] >= 850_000, "root blocked {} us: {blocked:?}", us[2]);
}

/// A program whose signal handler calls `exec` (which fails) 200 times a
/// second while its main thread allocates runs as without the recorder: the
/// interposed `exec`'s wait for the writer is bounded and not repeated while
/// unanswered, and nothing the handler does waits on the allocator.
fn exec_in_a_signal_handler_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "--off-cpu", "-o"])
        .arg(dir.path().join("out.spool"))
        .arg("--")
        .arg(me())
        .env(ROLE, "exec_in_handler")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // It runs 1 s; the bound is for a loaded machine (it could hang for good).
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running after 60 s: the program hung");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0));
}

fn sigkilled_child_keeps_samples() {
    let r = record_role("kill_tree", &[]);
    assert_eq!(r.out.status.code(), Some(0), "stderr: {}", stderr(&r.out));
    let s = open_complete(&r.spool);
    let reps = reports(&r.results);
    assert_eq!(reps.len(), 2, "root and victim: {reps:?}");
    let by = samples_by_thread(&s);
    let victim_pid: u32 = std::fs::read_to_string(r.results.join("victim-ready")).unwrap().parse().unwrap();
    // The victim reported 400 ms, then burned on until SIGKILLed: everything up
    // to the report is in the spool, less at most one flush interval (100 ms).
    let (vtid, vcpu) = reps[&victim_pid];
    let got = by.get(&(victim_pid, vtid)).copied().unwrap_or(0) as f64;
    assert!(got >= (vcpu - 0.1) * HZ as f64 * 0.9, "victim: {got} samples for at least {vcpu:.3} s");
    // The rest of the tree is recorded as usual.
    let mut rest = reps.clone();
    rest.remove(&victim_pid);
    assert_eq!(rest.len(), 1);
    check_accuracy(&s, &rest);
    check_all_retired(&s);
}

fn garbage_from_a_child_never_corrupts() {
    let r = record_role("garbage_tree", &[]);
    assert_eq!(r.out.status.code(), Some(0), "stderr: {}", stderr(&r.out));
    let err = stderr(&r.out);
    let s = open_complete(&r.spool);
    // The garbage writer's spool was refused from the first bad byte on, with a warning naming it.
    assert!(err.contains("stopped reading its spool"), "warning: {err}");
    assert!(err.contains("4000000"), "the fake spool is reported: {err}");
    let reps = reports(&r.results);
    assert_eq!(reps.len(), 2, "root and burn: {reps:?}");
    check_accuracy(&s, &reps);
    check_all_retired(&s);
    // Three processes are in the spool (the garbage writer's samples before the garbage stay).
    assert_eq!(check_pids(&s).len(), 3, "{err}");
    assert!(!check_pids(&s).contains(&4_000_000));
}

/// The recorder's unwind-table verdicts are written to the cache by the first
/// recording and read, not rewritten, by the next, whose stacks are as good.
fn cfi_verdicts_are_cached_across_recordings() {
    let cache = tempfile::tempdir().unwrap();
    let dir = cache.path().join("cfi");
    let listing = || -> BTreeMap<String, std::time::SystemTime> {
        std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| (e.file_name().into_string().unwrap(), e.metadata().unwrap().modified().unwrap()))
            .collect()
    };
    let first = record_role_with("burn", &[], &[("SPULSE_CFI_CACHE", &dir)]);
    assert_eq!(first.out.status.code(), Some(0), "stderr: {}", stderr(&first.out));
    let filled = listing();
    // This test program and the C library at least, each named by its build id.
    assert!(filled.len() >= 2, "{filled:?}");
    assert!(filled.keys().all(|n| n.ends_with(".cfi") && !n.starts_with('.')), "{filled:?}");
    let second = record_role_with("burn", &[], &[("SPULSE_CFI_CACHE", &dir)]);
    assert_eq!(second.out.status.code(), Some(0), "stderr: {}", stderr(&second.out));
    assert_eq!(listing(), filled, "the second recording rewrote or added verdicts");
    let s = open_complete(&second.spool);
    check_accuracy(&s, &reports(&second.results));
    // Every sample of the burning thread unwinds to the thread's root (main).
    let d = s.definitions();
    let exe = std::fs::canonicalize(me()).unwrap();
    let exe_modules: Vec<_> =
        d.modules().iter().filter(|m| Path::new(m.path()) == exe).map(|m| m.id).collect();
    let mut deepest_in_exe = 0;
    for smp in s.samples() {
        let mut node = Some(smp.stack);
        let mut in_exe = 0;
        while let Some(n) = node {
            let st = d.stack(n);
            if let spulse::Frame::Module { module, .. } = d.frame(st.frame) {
                in_exe += exe_modules.contains(&module) as u32;
            }
            node = st.parent;
        }
        deepest_in_exe = deepest_in_exe.max(in_exe);
    }
    assert!(deepest_in_exe >= 3, "stacks unwind through the program: {deepest_in_exe} frames at most");
}

/// A program without a build id (the Rust toolchain's `librustc_driver` and
/// `libLLVM` have none, and their checks were a third of a short `rustc`'s
/// CPU) has its verdict cached too, keyed by its unwind table's bytes: the
/// second recording adds and rewrites nothing, and a rebuild with other code
/// gets a verdict of its own.
fn cfi_verdicts_of_a_program_without_a_build_id_are_cached() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("cfi");
    let build = |body: &str| {
        let src = work.path().join("spin.c");
        std::fs::write(
            &src,
            format!("int main(void) {{ volatile unsigned long x = 0; {body} return 0; }}\n"),
        )
        .unwrap();
        let exe = work.path().join("spin");
        let o = Command::new("cc")
            .args(["-O1", "-Wl,--build-id=none", "-o"])
            .arg(&exe)
            .arg(&src)
            .output()
            .expect("run cc");
        assert!(o.status.success(), "cc: {}", String::from_utf8_lossy(&o.stderr));
        exe
    };
    let record = |exe: &Path| {
        let spool = work.path().join("spin.spool");
        let _ = std::fs::remove_file(&spool);
        let out = Command::new(env!("CARGO_BIN_EXE_spulse"))
            .args(["record", "-o"])
            .arg(&spool)
            .arg("--")
            .arg(exe)
            .env("SPULSE_CFI_CACHE", &dir)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "stderr: {}", stderr(&out));
    };
    // The file names begin with the id's first 20 bytes in hex: for an
    // object without a build id, those of "no build id; eh_fram".
    let prefix: String = b"no build id; eh_fram".iter().map(|b| format!("{b:02x}")).collect();
    let listing = || -> BTreeMap<String, std::time::SystemTime> {
        std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| (e.file_name().into_string().unwrap(), e.metadata().unwrap().modified().unwrap()))
            .filter(|(n, _)| n.starts_with(&prefix))
            .collect()
    };
    let exe = build("for (x = 0; x < 1000000; x++) ;");
    record(&exe);
    let first = listing();
    assert_eq!(first.len(), 1, "one verdict for the program without a build id: {first:?}");
    record(&exe);
    assert_eq!(listing(), first, "the second recording rewrote or added its verdict");
    // Other code, another table: a verdict of its own.
    let exe = build("for (x = 0; x < 1000000; x++) ; for (x = 0; x < 1000; x += 3) x ^= 1;");
    record(&exe);
    assert_eq!(listing().len(), 2, "{:?}", listing());
}

/// Start `spulse record -o DIR/out.spool -- sh -c SCRIPT` (SCRIPT may use
/// `$PIDS`, a file in DIR), wait until `$PIDS` has `lines` lines.
fn record_sh(dir: &Path, script: &str, lines: usize) -> std::process::Child {
    let child = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o"])
        .arg(dir.join("out.spool"))
        .args(["--", "sh", "-c", script])
        .env("PIDS", dir.join("pids"))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(dir.join("pids")).map_or(0, |s| s.lines().count()) < lines {
        assert!(t0.elapsed() < Duration::from_secs(20), "the command did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Wait up to `limit` for `child`; its exit code and how long it took.
fn wait_for(child: &mut std::process::Child, limit: Duration) -> (Option<i32>, Duration) {
    let t0 = std::time::Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return (st.code(), t0.elapsed());
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return (None, t0.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pids_in(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("pids")).unwrap().lines().filter_map(|l| l.trim().parse().ok()).collect()
}

fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(')').is_some_and(|(_, r)| !r.trim_start().starts_with('Z')))
}

/// SIGTERM to `spulse record` reaches the whole tree, a grandchild too: the
/// command ends as a whole and `record` with it, at once (before, only its
/// children got the signal, and the collector waited for the orphaned
/// grandchild to finish by itself). A second signal stops the waiting for a
/// tree that ignores the first.
fn signals_reach_the_whole_tree_and_a_second_one_stops_the_wait() {
    let work = tempfile::tempdir().unwrap();
    let mut rec = record_sh(work.path(), "sleep 60 & echo $! >> \"$PIDS\"; wait; echo after", 1);
    // SAFETY: kill on the pid of our own child.
    unsafe { libc::kill(rec.id() as i32, libc::SIGTERM) };
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(st) = rec.try_wait().unwrap() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "record waited for the tree");
        std::thread::sleep(Duration::from_millis(20));
    };
    // The command died of the SIGTERM passed on, and `record` ends as it did.
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}");
    let grandchild = pids_in(work.path())[0];
    std::thread::sleep(Duration::from_millis(200));
    assert!(!running(grandchild), "the grandchild {grandchild} still runs");

    // A tree that ignores SIGTERM (an ignored signal stays ignored across exec).
    let work = tempfile::tempdir().unwrap();
    // (The shell burns some CPU first: samples to find in the output.)
    let script = "trap '' TERM; i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done; \
                  sleep 60 & echo $! >> \"$PIDS\"; wait";
    let mut rec = record_sh(work.path(), script, 1);
    // Past the recorders' flush interval (100 ms): the burn is in the spools.
    std::thread::sleep(Duration::from_millis(400));
    // SAFETY: kill on the pid of our own child.
    unsafe { libc::kill(rec.id() as i32, libc::SIGTERM) };
    // Past the 2 s after which `record` says what it waits for.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(rec.try_wait().unwrap().is_none(), "record ended while the tree runs");
    // SAFETY: kill on the pid of our own child, not yet reaped.
    unsafe { libc::kill(rec.id() as i32, libc::SIGTERM) };
    let (code, took) = wait_for(&mut rec, Duration::from_secs(30));
    let sleeper = pids_in(work.path())[0];
    let left = running(sleeper);
    // SAFETY: kill on the sleeper this test's tree started and the recorder left running.
    unsafe { libc::kill(sleeper, libc::SIGKILL) };
    assert_eq!(code, Some(143), "took {took:?}");
    assert!(took < Duration::from_secs(10), "a second signal did not stop the wait: {took:?}");
    assert!(left, "the tree ignoring SIGTERM was still running");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut rec.stderr.take().unwrap(), &mut err).unwrap();
    assert!(
        err.contains(
            "waiting for the command's processes to end (a second signal, such as Ctrl-C, stops waiting"
        ),
        "the wait is explained: {err}"
    );
    let s = open_complete(&work.path().join("out.spool"));
    assert!(!check_pids(&s).is_empty(), "what was recorded before is in the output");
}

/// A spool the recorded program put in the handoff directory under the pid
/// of a process outside the tree (one that runs on: here this test itself)
/// is read as it is, never waited for: `record` ends with its command.
fn a_spool_under_a_foreign_pid_is_not_waited_for() {
    let work = tempfile::tempdir().unwrap();
    let first = work.path().join("first.spool");
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o"])
        .arg(&first)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    let script = format!(
        "cp \"{}\" \"$SPULSE_RECORD_DIR/{}.0.spool\"; echo done >> \"$PIDS\"",
        first.display(),
        std::process::id()
    );
    let mut rec = record_sh(work.path(), &script, 1);
    let (code, took) = wait_for(&mut rec, Duration::from_secs(30));
    assert_eq!(code, Some(0), "took {took:?}");
    assert!(took < Duration::from_secs(10), "record waited {took:?} for a process outside the tree");
}

/// A pprof profile's first mapping is its main binary to `go tool pprof`
/// (`File:`): in a tree started through a shell it is the executable of the
/// busiest process, not the shell's (the first recorded).
fn pprof_names_the_busiest_program_as_its_main_binary() {
    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("results");
    std::fs::create_dir(&results).unwrap();
    let spool = dir.path().join("sh.spool");
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-F", &HZ.to_string(), "-o"])
        .arg(&spool)
        .args(["--", "sh", "-c", "\"$0\"; true"])
        .arg(me())
        .env(ROLE, "burn")
        .env(RESULTS, &results)
        .output()
        .unwrap();
    assert!(o.status.success(), "stderr: {}", stderr(&o));
    let pb = dir.path().join("sh.pb.gz");
    spulse(&["export", "-f", "pprof", "-o", pb.to_str().unwrap(), spool.to_str().unwrap()]);
    let mut raw = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::GzDecoder::new(std::fs::File::open(&pb).unwrap()),
        &mut raw,
    )
    .unwrap();
    let p = <spulse_cli::export::pprof::Profile as prost::Message>::decode(&*raw).unwrap();
    let first = &p.string_table[p.mapping[0].filename as usize];
    let exe = std::fs::canonicalize(me()).unwrap();
    assert_eq!(Path::new(first), exe, "the first of {} mappings", p.mapping.len());
}

fn embedded_start_is_refused_and_recorded_once() {
    let r = record_role("embedded", &[]);
    assert_eq!(r.out.status.code(), Some(0), "stderr: {}", stderr(&r.out));
    let msg = std::fs::read_to_string(r.results.join("embedded-result")).unwrap();
    assert!(msg.contains("already recorded"), "embedded start: {msg}");
    assert!(!r.results.join("embedded.spool").exists());
    let s = open_complete(&r.spool);
    check_accuracy(&s, &reports(&r.results));
}

fn exit_status_propagates() {
    let dir = tempfile::tempdir().unwrap();
    // A command killed by a signal ends `record` by the same signal (a
    // parent reads the same status as unrecorded: before, it read exit
    // 128 + the signal); one that exits 128 + n is not taken for killed.
    use std::os::unix::process::ExitStatusExt;
    for (i, (script, code, signal)) in [
        ("exit 3", Some(3), None),
        ("kill -9 $$", None, Some(9)),
        ("kill -SEGV $$", None, Some(11)),
        ("exit 139", Some(139), None),
        ("true", Some(0), None),
        // Started from `record` (posix_spawn) CMD has glibc's two internal
        // signals at their default, not ignored, as from a shell.
        // (Only those two: the test's own caller may ignore others, such as
        // SIGINT for a background job, which CMD inherits rightly.)
        (
            "v=$(sed -n 's/^SigIgn:[[:space:]]*//p' /proc/$$/status); exit $(( 0x$v >> 31 & 3 ))",
            Some(0),
            None,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let spool = dir.path().join(format!("s{i}.spool"));
        let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
            .args(["record", "-o"])
            .arg(&spool)
            .args(["--", "sh", "-c", script])
            .output()
            .unwrap();
        assert_eq!(o.status.code(), code, "{script}: {:?} {}", o.status, stderr(&o));
        assert_eq!(o.status.signal(), signal, "{script}: {:?} {}", o.status, stderr(&o));
        let s = open_complete(&spool);
        check_all_retired(&s);
    }
    // The default output is <program>-<pid>.spool in the current directory, never overwritten.
    for _ in 0..2 {
        let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
            .current_dir(dir.path())
            .args(["record", "--", "true"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let defaults: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_str().unwrap().starts_with("true-"))
        .collect();
    assert_eq!(defaults.len(), 2);
}

/// An option `record` does not have, before the command, is an error that
/// names it (it was taken for the command: "--rotate: command not found");
/// the command's own options pass through, with or without `--`.
fn unknown_options_are_refused_and_the_commands_pass_through() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "--rotate", "100ms", "-o"])
        .arg(dir.path().join("r.spool"))
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("unexpected argument '--rotate'"), "{}", stderr(&o));
    assert!(!dir.path().join("r.spool").exists());
    for (i, with_dashes) in [false, true].into_iter().enumerate() {
        let spool = dir.path().join(format!("e{i}.spool"));
        let mut c = Command::new(env!("CARGO_BIN_EXE_spulse"));
        c.args(["record", "-o"]).arg(&spool);
        if with_dashes {
            c.arg("--");
        }
        let o = c.args(["/bin/echo", "-n", "a", "--b"]).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(String::from_utf8_lossy(&o.stdout), "a --b");
        open_complete(&spool);
    }
}

/// The CPU time the children of this process have used (user + system),
/// as far as they were waited for.
fn children_cpu() -> Duration {
    // SAFETY: getrusage writes into the zeroed, writable `ru`.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_CHILDREN with a valid rusage.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) }, 0);
    let d = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    d(ru.ru_utime) + d(ru.ru_stime)
}

/// The CPU time each process spent before the recorder started in it (exec,
/// the dynamic loader) is summed and said: more than nothing (an exec always
/// costs CPU), less than all the CPU the tree used.
fn cpu_before_the_recorder_is_said() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("before.spool");
    let before = children_cpu();
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o"])
        .arg(&spool)
        .args(["--", "sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10; do /bin/true; done"])
        .output()
        .unwrap();
    let tree = children_cpu() - before;
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("recorded 11 processes"), "{err}");
    let line = err.lines().find(|l| l.contains("not sampled:")).unwrap_or_else(|| panic!("no line: {err}"));
    let ms: f64 =
        line.split("not sampled: ").nth(1).and_then(|r| r.split(" ms").next()).unwrap().parse().unwrap();
    assert!(ms > 0.0, "{line}");
    assert!(ms <= tree.as_secs_f64() * 1000.0, "{line}: more than the tree's {tree:?}");

    // A process that burns 0.4 s (sampled) and then execs another program:
    // that image's "before" is its own exec and loading, not the CPU the
    // first image burnt (before: about 400 ms said unsampled).
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o"])
        .arg(dir.path().join("exec.spool"))
        .arg("--")
        .arg(me())
        .env(ROLE, "burn_then_exec")
        .env(RESULTS, dir.path())
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let line = err.lines().find(|l| l.contains("not sampled:")).unwrap_or_else(|| panic!("no line: {err}"));
    let ms: f64 =
        line.split("not sampled: ").nth(1).and_then(|r| r.split(" ms").next()).unwrap().parse().unwrap();
    assert!(ms < 200.0, "the burn before the exec was sampled: {line}");
}

fn static_binary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("static-exe");
    std::fs::write(&exe, minimal_static_elf()).unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let spool = dir.path().join("st.spool");
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o"])
        .arg(&spool)
        .arg("--")
        .arg(&exe)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("statically linked") && err.contains("LD_PRELOAD"), "{err}");
    assert!(!spool.exists(), "no empty spool is left behind");

    // A 32-bit program (an i386 ELF header): the loader would refuse the
    // 64-bit library with an error line of its own, and record nothing.
    let mut elf32 = vec![0u8; 52];
    elf32[..7].copy_from_slice(b"\x7fELF\x01\x01\x01");
    elf32[16] = 2; // ET_EXEC
    elf32[18] = 3; // EM_386
    let exe32 = dir.path().join("exe32");
    std::fs::write(&exe32, elf32).unwrap();
    std::fs::set_permissions(&exe32, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o"])
        .arg(&spool)
        .arg("--")
        .arg(&exe32)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = stderr(&o);
    assert!(err.contains("32-bit ELF") && err.contains("nothing would be recorded"), "{err}");
    assert!(!spool.exists(), "no empty spool is left behind");
}

/// A 64-bit ELF executable for this machine with one PT_LOAD and no
/// PT_INTERP: what a static link produces, as far as the loader goes.
fn minimal_static_elf() -> Vec<u8> {
    let machine: u16 = if cfg!(target_arch = "aarch64") { 183 } else { 62 };
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&machine.to_le_bytes());
    e.extend_from_slice(&1u32.to_le_bytes()); // version
    e.extend_from_slice(&0x400078u64.to_le_bytes()); // entry
    e.extend_from_slice(&64u64.to_le_bytes()); // phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // flags
    e.extend_from_slice(&64u16.to_le_bytes()); // ehsize
    e.extend_from_slice(&56u16.to_le_bytes()); // phentsize
    e.extend_from_slice(&1u16.to_le_bytes()); // phnum
    e.extend_from_slice(&[0; 6]); // shentsize, shnum, shstrndx
    e.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    e.extend_from_slice(&5u32.to_le_bytes()); // R+X
    e.extend_from_slice(&0u64.to_le_bytes()); // offset
    e.extend_from_slice(&0x400000u64.to_le_bytes()); // vaddr
    e.extend_from_slice(&0x400000u64.to_le_bytes()); // paddr
    e.extend_from_slice(&0x80u64.to_le_bytes()); // filesz
    e.extend_from_slice(&0x80u64.to_le_bytes()); // memsz
    e.extend_from_slice(&0x1000u64.to_le_bytes()); // align
    e.resize(0x80, 0);
    e
}

fn follow_works_live_on_a_multiprocess_recording() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("live.spool");
    let mut rec = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-F", &HZ.to_string(), "-o"])
        .arg(&spool)
        .arg("--")
        .arg(me())
        .env(ROLE, "live")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let follow = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["follow", "--interval", "0.2", "--wait", "--wait-timeout", "30", "-n", "5"])
        .arg(&spool)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // While it runs, the spool is valid and grows with samples of both processes.
    let t0 = Instant::now();
    let mut seen_two_live = false;
    while rec.try_wait().unwrap().is_none() {
        if let Ok(s) = Snapshot::open(&spool) {
            let pids: std::collections::HashSet<u32> =
                s.samples().map(|x| s.definitions().thread(x.thread).pid).collect();
            if pids.len() >= 2 && rec.try_wait().unwrap().is_none() {
                seen_two_live = true;
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(rec.wait().unwrap().success());
    assert!(seen_two_live, "samples of both processes were readable while recording");
    let fo = follow.wait_with_output().unwrap();
    assert!(fo.status.success(), "follow: {}", stderr(&fo));
    let text = String::from_utf8_lossy(&fo.stdout);
    let total = open_complete(&spool).len();
    assert!(
        text.contains(&format!("{total} samples")),
        "follow's last table counts all {total} samples:\n{text}"
    );
}

fn sigkill_of_the_recorder_leaves_a_readable_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("k.spool");
    let mut rec = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-F", &HZ.to_string(), "-o"])
        .arg(&spool)
        .arg("--")
        .arg(me())
        .env(ROLE, "live")
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if Snapshot::open(&spool).is_ok_and(|s| s.len() > 100) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no samples appeared");
        std::thread::sleep(Duration::from_millis(20));
    }
    rec.kill().unwrap();
    rec.wait().unwrap();
    let s = Snapshot::open(&spool).expect("a readable prefix");
    assert!(s.len() > 100);
    // End the orphaned workload.
    // SAFETY: signals the process group we created for the recording.
    unsafe { libc::kill(-(rec.id() as i32), libc::SIGKILL) };
}

fn node_jit_frames_are_named_per_process() {
    let node = which("node").expect(
        "node is needed for this test (it records a real JIT): install Node.js (apt-get install nodejs)",
    );
    let dir = tempfile::tempdir().unwrap();
    let child = dir.path().join("child.js");
    std::fs::write(
        &child,
        "function childHotLoopZeta(n) { let s = 0; for (let i = 0; i < n; i++) { s = (s * 31 + i) % 1000003; } return s; }\n\
         let t = 0; const end = Date.now() + 700; while (Date.now() < end) { t += childHotLoopZeta(20000); }\n\
         console.log(t);\n",
    )
    .unwrap();
    let app = dir.path().join("app.js");
    std::fs::write(
        &app,
        format!(
            "const {{ execFileSync }} = require('child_process');\n\
             function parentHotLoopAlpha(n) {{ let s = 0; for (let i = 0; i < n; i++) {{ s = (s * 17 + i) % 999983; }} return s; }}\n\
             let t = 0; const end = Date.now() + 700; while (Date.now() < end) {{ t += parentHotLoopAlpha(20000); }}\n\
             console.log(t);\n\
             process.stdout.write(execFileSync(process.execPath, ['--perf-basic-prof', {:?}]));\n",
            child.to_str().unwrap()
        ),
    )
    .unwrap();
    let spool = dir.path().join("node.spool");
    let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .args(["record", "-o", spool.to_str().unwrap(), "--"])
        .arg(&node)
        .arg("--perf-basic-prof")
        .arg(&app)
        .current_dir(dir.path()) // node may leave V8 log files in its working directory
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let s = open_complete(&spool);
    check_all_retired(&s);
    let pids = check_pids(&s);
    let per: serde_json::Value = serde_json::from_str(&spulse(&[
        "top",
        "--per-process",
        "--json",
        "-n",
        "0",
        spool.to_str().unwrap(),
    ]))
    .unwrap();
    for p in &pids {
        let _ = std::fs::remove_file(format!("/tmp/perf-{p}.map"));
    }
    // Each JS function is named (from its own process's perf map) in exactly
    // the process that ran it, with a good share of that process's samples.
    for (func, other) in
        [("parentHotLoopAlpha", "childHotLoopZeta"), ("childHotLoopZeta", "parentHotLoopAlpha")]
    {
        let mut owners = Vec::new();
        for sec in per.as_array().unwrap() {
            let fns = sec["functions"].as_array().unwrap();
            let hit = fns.iter().find(|f| f["function"].as_str().unwrap().contains(func));
            if let Some(f) = hit {
                assert!(f["module"].as_str().unwrap().starts_with("perf-"), "{f}");
                assert!(f["self_percent"].as_f64().unwrap() > 20.0, "{func} is hot in its process: {f}");
                assert!(
                    !fns.iter().any(|f| f["function"].as_str().unwrap().contains(other)),
                    "{other} must not appear in the process of {func}"
                );
                owners.push(sec["pid"].as_u64().unwrap());
            }
        }
        assert_eq!(owners.len(), 1, "{func} named in exactly one process: {per}");
    }
}

fn which(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(prog)).find(|p| p.is_file())
}

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        run_role(&role);
    }
    let tests: &[(&str, fn())] = &[
        ("tree_fork_exec_and_nonzero_exit", tree_fork_exec_and_nonzero_exit),
        (
            "short_children_ending_in_exit_keep_their_samples",
            short_children_ending_in_exit_keep_their_samples,
        ),
        ("sigkilled_child_keeps_samples", sigkilled_child_keeps_samples),
        ("exits_without_atexit_keep_their_last_wait", exits_without_atexit_keep_their_last_wait),
        ("exec_in_a_signal_handler_does_not_hang", exec_in_a_signal_handler_does_not_hang),
        ("garbage_from_a_child_never_corrupts", garbage_from_a_child_never_corrupts),
        ("cfi_verdicts_are_cached_across_recordings", cfi_verdicts_are_cached_across_recordings),
        (
            "cfi_verdicts_of_a_program_without_a_build_id_are_cached",
            cfi_verdicts_of_a_program_without_a_build_id_are_cached,
        ),
        ("embedded_start_is_refused_and_recorded_once", embedded_start_is_refused_and_recorded_once),
        (
            "pprof_names_the_busiest_program_as_its_main_binary",
            pprof_names_the_busiest_program_as_its_main_binary,
        ),
        (
            "signals_reach_the_whole_tree_and_a_second_one_stops_the_wait",
            signals_reach_the_whole_tree_and_a_second_one_stops_the_wait,
        ),
        ("a_spool_under_a_foreign_pid_is_not_waited_for", a_spool_under_a_foreign_pid_is_not_waited_for),
        ("exit_status_propagates", exit_status_propagates),
        (
            "unknown_options_are_refused_and_the_commands_pass_through",
            unknown_options_are_refused_and_the_commands_pass_through,
        ),
        ("cpu_before_the_recorder_is_said", cpu_before_the_recorder_is_said),
        ("static_binary_is_refused", static_binary_is_refused),
        ("cpu_no_recorder_could_see_is_said", cpu_no_recorder_could_see_is_said),
        ("follow_works_live_on_a_multiprocess_recording", follow_works_live_on_a_multiprocess_recording),
        (
            "sigkill_of_the_recorder_leaves_a_readable_prefix",
            sigkill_of_the_recorder_leaves_a_readable_prefix,
        ),
        ("node_jit_frames_are_named_per_process", node_jit_frames_are_named_per_process),
    ];
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let mut failed = Vec::new();
    for (name, f) in tests {
        if !filter.is_empty() && !filter.iter().any(|p| name.contains(p.as_str())) {
            continue;
        }
        eprintln!("test {name} ...");
        if std::panic::catch_unwind(f).is_err() {
            failed.push(*name);
            eprintln!("test {name} FAILED");
        } else {
            eprintln!("test {name} ok");
        }
    }
    if !failed.is_empty() {
        eprintln!("failed: {failed:?}");
        std::process::exit(1);
    }
}

/// CPU the recording cannot account for is said, with where such time goes:
/// a statically linked program run by the command's shell (the loader never
/// loads the library into it) burns 0.6 s unseen, and the summary names that
/// much; a tree of dynamic programs only gets no such line.
fn cpu_no_recorder_could_see_is_said() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("burn.c");
    std::fs::write(
        &src,
        "#include <stdlib.h>\n#include <time.h>\n\
         int main(int c, char **v) { double s = c > 1 ? atof(v[1]) : 0.5; struct timespec a, b;\n\
         clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a); volatile unsigned long x = 0;\n\
         do { for (int i = 0; i < 100000; i++) x += i; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b); }\n\
         while ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9 < s); return 0; }\n",
    )
    .unwrap();
    let build = |name: &str, extra: &[&str]| {
        let exe = work.path().join(name);
        let o = Command::new("cc")
            .args(["-O1"])
            .args(extra)
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .output()
            .expect("run cc");
        assert!(o.status.success(), "cc {extra:?}: {}", String::from_utf8_lossy(&o.stderr));
        exe
    };
    let dynamic = build("burn", &[]);
    let fixed = build("burn_static", &["-static"]);
    let record = |name: &str, script: String| {
        let o = Command::new(env!("CARGO_BIN_EXE_spulse"))
            .args(["record", "-o"])
            .arg(work.path().join(name))
            .args(["--", "sh", "-c"])
            .arg(script)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        stderr(&o)
    };
    let err = record("mixed.spool", format!("{} 0.4; {} 0.6", dynamic.display(), fixed.display()));
    let line = err.lines().find(|l| l.starts_with("spulse: not seen:")).unwrap_or_else(|| panic!("{err}"));
    // "... the other N s ran where no recorder could sample it: ... static ..."
    let unseen: f64 = line
        .split("the other ")
        .nth(1)
        .and_then(|r| r.split(" s ").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!((0.45..=0.9).contains(&unseen), "0.6 s burnt unseen, the line says {unseen}: {line}");
    assert!(line.contains("static"), "{line}");
    let err = record("dynamic.spool", format!("{0} 0.4; {0} 0.6", dynamic.display()));
    assert!(!err.contains("not seen"), "every process was recorded: {err}");
}
