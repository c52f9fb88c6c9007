//! The recorder's edges: every builder value is checked before anything is
//! created; path templates, `SPULSE_OUTPUT` and `overwrite(true)`; errors that
//! read as sentences under `Debug`; the followers' lock; threads that block the
//! profiling signal counted in `Stats`.

mod recorder_support;

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use recorder_support::*;
use spulse::{Error, RecorderError};

fn disposition(sig: i32) -> usize {
    // SAFETY: querying a disposition (null new action).
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut cur);
        cur.sa_sigaction
    }
}

/// Names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .map(|s| s.trim().to_string())
        .collect()
}

/// Whether another open file description can take a shared lock on `path` now.
fn shared_lock_free(path: &Path) -> bool {
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: flock on a descriptor we own.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        assert_eq!(e.raw_os_error(), Some(libc::EWOULDBLOCK), "flock failed otherwise: {e}");
    }
    r == 0
}

#[test]
fn bad_builder_values_are_errors_that_leave_nothing_behind() {
    let _serial = serial();
    let (dir, path) = spool_path("bad.spool");
    let b = spulse::Recorder::builder;
    let limit = format!("limit of {} MiB", spulse::RecorderBuilder::MAX_RING_BYTES >> 20);
    let cases: Vec<(spulse::RecorderBuilder, &str)> = vec![
        (b().flush_interval(Duration::from_secs(u64::MAX)), "flush_interval"),
        (b().flush_interval(Duration::ZERO), "flush_interval"),
        (b().flush_interval(Duration::from_micros(999)), "flush_interval"),
        (b().flush_interval(Duration::from_secs(601)), "flush_interval"),
        (b().ring_capacity(1 << 20).max_stack_depth(4095), "ring_capacity 1048576 with max_stack_depth 4095"),
        (b().ring_capacity(1 << 16).max_stack_depth(1000), &limit),
        (b().ring_capacity(0), "ring_capacity 0"),
        (b().ring_capacity(1), "ring_capacity 1"),
        (b().ring_capacity(usize::MAX), "ring_capacity"),
        (b().ring_capacity((1 << 20) + 1), "ring_capacity"),
        (b().mode(0o7777), "mode 0o7777"),
        (b().mode(0o4600), "setuid"),
        (b().mode(0o1600), "sticky"),
        (b().mode(0o200), "mode 0o200"),
        (b().mode(0o400), "read and write"),
        (b().max_stack_depth(4096), "max_stack_depth 4096"),
        (b().max_stack_depth(0), "max_stack_depth 0"),
        (b().frequency_hz(100_001), "100001 Hz"),
    ];
    let (prof, trap) = (disposition(libc::SIGPROF), disposition(libc::SIGTRAP));
    for (builder, named) in cases {
        let e = builder.start(&path).expect_err(named);
        let msg = e.to_string();
        assert!(msg.contains(named), "error for {named:?} does not name it: {msg}");
        match &e {
            Error::Recorder(RecorderError::InvalidConfig { setting, .. }) => {
                let settings = ["flush_interval", "ring_capacity", "mode", "max_stack_depth", "frequency_hz"];
                assert!(settings.contains(setting), "{named}: unexpected setting {setting}");
                assert!(
                    named.contains(setting) || !settings.iter().any(|s| named.contains(s)),
                    "{named}: {setting}"
                );
            }
            other => panic!("{named}: expected InvalidConfig, got {other}"),
        }
        assert!(!path.exists(), "{named}: a file was left behind");
        assert_eq!(disposition(libc::SIGPROF), prof, "{named}: SIGPROF handler left installed");
        assert_eq!(disposition(libc::SIGTRAP), trap, "{named}: SIGTRAP handler left installed");
        assert!(!thread_names().iter().any(|n| n == "spulse-writer"), "{named}: writer thread left running");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    // The edges of the ranges are accepted and record.
    for builder in [
        b().flush_interval(Duration::from_secs(600)).ring_capacity(2),
        b().flush_interval(Duration::from_millis(1)).ring_capacity(1 << 20).max_stack_depth(28),
        b().mode(0o600).max_stack_depth(4095).ring_capacity(4096),
    ] {
        let g = builder.start(&path).unwrap();
        burn(0.02);
        g.finish().unwrap();
        spulse::Snapshot::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn path_templates_expand_pid_and_timestamp() {
    let _serial = serial();
    let (dir, _) = spool_path("x");
    let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let g = spulse::start(dir.path().join("run-{pid}-{timestamp}.spool")).unwrap();
    let after = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let got = g.path().to_path_buf();
    g.finish().unwrap();
    let name = got.file_name().unwrap().to_str().unwrap().to_string();
    let rest = name.strip_prefix(&format!("run-{}-", std::process::id())).expect(&name);
    let secs: u64 = rest.strip_suffix(".spool").unwrap().parse().unwrap();
    assert!((before..=after).contains(&secs), "{secs} not in {before}..={after}");
    assert_eq!(got.parent(), Some(dir.path()));
    spulse::Snapshot::open(&got).unwrap();

    // Running "the same program" again gets a new file instead of an error.
    std::thread::sleep(Duration::from_millis(1100));
    let g = spulse::start(dir.path().join("run-{pid}-{timestamp}.spool")).unwrap();
    assert_ne!(g.path(), got);
    g.finish().unwrap();

    // Braces: doubled ones are literal, unknown placeholders are errors.
    let g = spulse::start(dir.path().join("{{lit}}.spool")).unwrap();
    assert_eq!(g.path(), dir.path().join("{lit}.spool"));
    g.finish().unwrap();
    for bad in ["{pdi}.spool", "x{.spool", "y}.spool"] {
        let e = spulse::start(dir.path().join(bad)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("placeholder") && msg.contains("{pid}"), "{msg}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
}

#[test]
fn spulse_output_overrides_the_path() {
    let _serial = serial();
    let (dir, given) = spool_path("given.spool");
    let env_path = dir.path().join("from-env-{pid}.spool");
    // SAFETY (edition 2021 set_var): every test of this binary holds the serial lock.
    std::env::set_var("SPULSE_OUTPUT", &env_path);
    let r = spulse::start(&given).and_then(|g| {
        let p = g.path().to_path_buf();
        g.finish().map(|_| p)
    });
    std::env::set_var("SPULSE_OUTPUT", dir.path().join("{nope}"));
    let bad = spulse::Recorder::builder().start(&given).map(|_| ());
    std::env::set_var("SPULSE_OUTPUT", ""); // empty: as if not set
    let empty = spulse::start(&given).and_then(|g| g.finish());
    std::env::remove_var("SPULSE_OUTPUT");

    let expected = dir.path().join(format!("from-env-{}.spool", std::process::id()));
    assert_eq!(r.unwrap(), expected);
    spulse::Snapshot::open(&expected).unwrap();
    let bad = bad.unwrap_err().to_string();
    assert!(bad.starts_with("SPULSE_OUTPUT: ") && bad.contains("{nope}"), "{bad}");
    empty.unwrap();
    spulse::Snapshot::open(&given).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn an_existing_spool_is_refused_with_a_sentence_or_replaced_when_asked() {
    let _serial = serial();
    let (dir, path) = spool_path("again.spool");
    spulse::start(&path).unwrap().finish().unwrap();
    let first = std::fs::read(&path).unwrap();

    // The README's example run twice: the error names the ways out, and its
    // Debug form (what `main() -> Result` prints) is the same sentence.
    let e = spulse::start(&path).unwrap_err();
    let (shown, debug) = (e.to_string(), format!("{e:?}"));
    assert_eq!(debug, shown);
    for needle in
        ["again.spool", "already exists", "{pid}", "{timestamp}", "SPULSE_OUTPUT", "overwrite(true)"]
    {
        assert!(shown.contains(needle), "{needle:?} missing from: {shown}");
    }
    assert!(!debug.contains("Os {") && !debug.contains("code:"), "{debug}");
    match &e {
        Error::Io { source, .. } => assert_eq!(source.kind(), std::io::ErrorKind::AlreadyExists),
        other => panic!("unexpected {other}"),
    }
    assert_eq!(std::fs::read(&path).unwrap(), first, "refused start touched the file");

    // overwrite(true): a new spool, mode 0600, in place of the old.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let g = spulse::Recorder::builder().overwrite(true).start(&path).unwrap();
    burn(0.05);
    g.finish().unwrap();
    assert_ne!(std::fs::read(&path).unwrap(), first);
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    spulse::Snapshot::open(&path).unwrap();

    // A symlink at the path is removed, never followed.
    let target = dir.path().join("target");
    std::fs::write(&target, b"keep me").unwrap();
    let link = dir.path().join("link.spool");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    spulse::Recorder::builder().overwrite(true).start(&link).unwrap().finish().unwrap();
    assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_file());

    // Neither a directory nor a FIFO is replaced (and opening the FIFO never blocks).
    let sub = dir.path().join("sub.spool");
    std::fs::create_dir(&sub).unwrap();
    let e = spulse::Recorder::builder().overwrite(true).start(&sub).unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
    assert!(
        matches!(&e, Error::Recorder(RecorderError::OverwriteRefused { path, .. }) if *path == sub),
        "{e}"
    );
    assert!(sub.is_dir());
    let fifo = dir.path().join("fifo.spool");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let e = spulse::Recorder::builder().overwrite(true).start(&fifo).unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");

    // A spool whose recorder still holds its lock is not replaced.
    let held = std::fs::File::open(&path).unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    let e = spulse::Recorder::builder().overwrite(true).start(&path).unwrap_err();
    assert!(e.to_string().contains("running recorder"), "{e}");
    assert!(
        matches!(&e, Error::Recorder(RecorderError::OverwriteRefused { path: p, .. }) if *p == path),
        "{e}"
    );
    drop(held);
    spulse::Snapshot::open(&path).unwrap();
}

#[test]
fn the_spool_is_locked_exactly_while_recording() {
    let _serial = serial();
    let (_dir, path) = spool_path("locked.spool");
    let g = spulse::start(&path).unwrap();
    assert!(!shared_lock_free(&path), "a follower must see the recording as running");
    burn(0.05);
    assert!(!shared_lock_free(&path));
    g.finish().unwrap();
    assert!(shared_lock_free(&path), "the lock must be released when the recording finishes");

    // A forked child shares the spool's open file description (and so the
    // lock) until it exits: finishing releases the lock all the same.
    std::fs::remove_file(&path).unwrap();
    let g = spulse::start(&path).unwrap();
    // SAFETY: the child only calls pause (async-signal-safe) until killed.
    let child = unsafe { libc::fork() };
    if child == 0 {
        loop {
            // SAFETY: pause has no preconditions.
            unsafe { libc::pause() };
        }
    }
    assert!(child > 0, "fork failed");
    g.finish().unwrap();
    let free = shared_lock_free(&path);
    // SAFETY: killing and reaping the child forked above.
    unsafe {
        libc::kill(child, libc::SIGKILL);
        libc::waitpid(child, std::ptr::null_mut(), 0);
    }
    assert!(free, "a forked child must not keep the finished recording locked");

    // Dropping the guard releases it too.
    std::fs::remove_file(&path).unwrap();
    let g = spulse::start(&path).unwrap();
    assert!(!shared_lock_free(&path));
    drop(g);
    assert!(shared_lock_free(&path));
}

#[test]
fn stats_count_threads_that_block_the_profiling_signal() {
    let _serial = serial();
    let (_dir, path) = spool_path("blocked.spool");
    let g = spulse::start(&path).unwrap();
    let spin = |block: bool| {
        std::thread::spawn(move || {
            if block {
                block_profiling_signals();
            }
            let tid = gettid();
            burn(0.3);
            tid
        })
    };
    let (blocked, free) = (spin(true), spin(false));
    let (blocked, free) = (blocked.join().unwrap(), free.join().unwrap());
    let stats = g.finish().unwrap();
    let snap = spulse::Snapshot::open(&path).unwrap();
    let per = per_thread(&snap);
    assert!(per.get(&free).copied().unwrap_or(0) > 50, "{per:?}");
    // Its system time (the clock reads of `burn`) is still sampled where the
    // kernel allows it: the kernel-time events send no signal. Its user time
    // cannot be.
    let kernel = kernel_leaves(&snap);
    let user_of_blocked =
        per.get(&blocked).copied().unwrap_or(0) - kernel.get(&blocked).copied().unwrap_or(0);
    assert_eq!(user_of_blocked, 0, "a thread blocking the signal cannot be sampled in user mode");
    if emulated() {
        // qemu-user's own threads (its RCU thread blocks every signal) are in
        // /proc/self/task too.
        assert!(stats.threads_blocking_signal >= 1, "{stats:?}");
    } else {
        assert_eq!(stats.threads_blocking_signal, 1, "{stats:?}");
    }
    assert!(stats.threads_never_sampled >= 1, "{stats:?}");
    assert!(stats.threads_seen >= 3, "{stats:?}"); // this test's thread and the two spinners
    assert!(stats.threads_seen > stats.threads_never_sampled, "{stats:?}");
}
