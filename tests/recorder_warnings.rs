//! The live warning channel: a warning found while recording reaches
//! `Guard::warnings` and the `on_warning` callback before the guard finishes
//! (within a few writer ticks), and the final list (`Stats::warnings`, or
//! `RecorderError::WriteStopped::warnings`) holds it exactly once, in the
//! order the callback saw.

mod recorder_support;

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use recorder_support::*;
use spulse::{Error, RecorderError};

/// How long a test waits for a warning to be published (a writer tick is
/// 20 ms here; a loaded machine may delay it a lot).
const WAIT: Duration = Duration::from_secs(10);

/// A builder whose callback appends each warning to the returned list.
fn with_callback() -> (spulse::RecorderBuilder, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let b = spulse::Recorder::builder()
        .flush_interval(Duration::from_millis(20))
        .on_warning(move |w| s.lock().unwrap().push(w.to_string()));
    (b, seen)
}

/// Burn CPU until both the guard and the callback have a warning containing
/// `needle` (or `WAIT` passes); what each had then.
fn wait_for(g: &spulse::Guard, seen: &Mutex<Vec<String>>, needle: &str) -> (Vec<String>, Vec<String>) {
    let t = Instant::now();
    loop {
        let polled = g.warnings();
        let called = seen.lock().unwrap().clone();
        let has = |v: &[String]| v.iter().any(|w| w.contains(needle));
        if (has(&polled) && has(&called)) || t.elapsed() > WAIT {
            return (polled, called);
        }
        burn(0.005);
    }
}

fn count(v: &[String], needle: &str) -> usize {
    v.iter().filter(|w| w.contains(needle)).count()
}

/// The descriptors of this process whose link is `target` (by bytes).
fn fds_linking_to(target: &[u8]) -> Vec<i32> {
    let mut fds = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(link) = std::fs::read_link(e.path()) else { continue };
        if link.as_os_str().as_bytes() == target {
            if let Some(fd) = e.file_name().to_str().and_then(|n| n.parse().ok()) {
                fds.push(fd);
            }
        }
    }
    fds
}

fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap()
}

/// The program dup2s /dev/null over the spool's descriptor mid-recording:
/// the recorder writes nothing more through it, and says so while the
/// program still runs, not only when it finishes.
#[test]
fn a_spool_taken_away_is_warned_before_finish_and_once_at_the_end() {
    let _serial = serial();
    let (_dir, path) = spool_path("taken.spool");
    let (b, seen) = with_callback();
    let g = b.start(&path).unwrap();
    burn(0.1);
    let before = g.warnings();
    let spool_fds = fds_linking_to(canonical(&path).as_os_str().as_bytes());
    assert_eq!(spool_fds.len(), 1, "the recorder holds one descriptor of the spool: {spool_fds:?}");
    let null = std::fs::File::open("/dev/null").unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: test: the program replaces the recorder's descriptor on purpose
    // (the recorder must notice and never write or close it afterwards).
    assert_eq!(unsafe { libc::dup2(null.as_raw_fd(), spool_fds[0]) }, spool_fds[0]);
    let t = Instant::now();
    let (polled, called) = wait_for(&g, &seen, "closed or reused");
    let waited = t.elapsed();
    let r = g.finish();
    // SAFETY: test cleanup: the /dev/null copy made above is the program's own.
    unsafe { libc::close(spool_fds[0]) };
    assert_eq!(count(&before, "closed or reused"), 0, "{before:?}");
    assert_eq!(count(&polled, "closed or reused"), 1, "Guard::warnings before finish: {polled:?}");
    assert_eq!(count(&called, "closed or reused"), 1, "on_warning before finish: {called:?}");
    let warnings = match r {
        Err(Error::Recorder(RecorderError::WriteStopped { warnings, .. })) => warnings,
        other => panic!("expected WriteStopped, got {other:?}"),
    };
    assert_eq!(count(&warnings, "closed or reused"), 1, "{warnings:?}");
    // The callback saw exactly the final list, in its order.
    assert_eq!(*seen.lock().unwrap(), warnings);
    eprintln!("published {} ms after the spool was taken: {:?}", waited.as_millis(), polled);
}

/// The spool is deleted while recording (by hand, or by `spulse record`'s
/// collector as it ends with processes still running): the recorder says so
/// and writes nothing more into the unlinked file, which would only take
/// disk space nobody can reach until the process ends.
#[test]
fn a_deleted_spool_is_written_no_more() {
    let _serial = serial();
    let (_dir, path) = spool_path("deleted.spool");
    let (b, seen) = with_callback();
    let g = b.start(&path).unwrap();
    burn(0.1);
    let spool_fds = fds_linking_to(canonical(&path).as_os_str().as_bytes());
    assert_eq!(spool_fds.len(), 1, "the recorder holds one descriptor of the spool: {spool_fds:?}");
    std::fs::remove_file(&path).unwrap();
    let needle = "spool file was deleted";
    let (polled, called) = wait_for(&g, &seen, needle);
    let size = || std::fs::metadata(format!("/proc/self/fd/{}", spool_fds[0])).unwrap().len();
    let at_warning = size();
    burn(0.3);
    let later = size();
    let r = g.finish();
    assert_eq!(count(&polled, needle), 1, "Guard::warnings before finish: {polled:?}");
    assert_eq!(count(&called, needle), 1, "on_warning before finish: {called:?}");
    assert_eq!(later, at_warning, "0.3 s of samples after the warning went nowhere");
    let warnings = match r {
        Err(Error::Recorder(RecorderError::WriteStopped { warnings, .. })) => warnings,
        other => panic!("expected WriteStopped, got {other:?}"),
    };
    assert_eq!(count(&warnings, needle), 1, "{warnings:?}");
}

/// The program closes the perf-event engine's descriptors: the warning is
/// published while recording, and `Stats::warnings` holds it once.
#[test]
fn perf_events_taken_away_are_warned_before_finish_and_once_in_stats() {
    let _serial = serial();
    let (engine, kind) = perf_engine_for("perf_events_taken_away_are_warned_before_finish_and_once_in_stats");
    if kind != spulse::Engine::PerfEvent {
        eprintln!("SKIPPED: needs the perf-event engine");
        return;
    }
    let (_dir, path) = spool_path("events.spool");
    let (b, seen) = with_callback();
    let g = b.engine(engine).start(&path).unwrap();
    burn(0.1);
    let events = fds_linking_to(b"anon_inode:[perf_event]");
    assert!(!events.is_empty(), "the perf-event engine holds descriptors");
    for fd in &events {
        // SAFETY: test: the program closes the recorder's descriptors on purpose.
        unsafe { libc::close(*fd) };
    }
    let needle = "closed the recorder's perf-event descriptors";
    let (polled, called) = wait_for(&g, &seen, needle);
    let stats = g.finish().unwrap();
    assert_eq!(count(&polled, needle), 1, "Guard::warnings before finish: {polled:?}");
    assert_eq!(count(&called, needle), 1, "on_warning before finish: {called:?}");
    assert_eq!(count(&stats.warnings, needle), 1, "{:?}", stats.warnings);
    assert_eq!(*seen.lock().unwrap(), stats.warnings);
}

/// A rotation that steps over a segment name taken by another file says so
/// while recording, once.
#[test]
fn a_taken_segment_name_is_warned_before_finish_and_once_in_stats() {
    let _serial = serial();
    let (dir, _) = spool_path("unused");
    std::fs::write(dir.path().join("s-000001.spool"), b"not a segment").unwrap();
    let (b, seen) = with_callback();
    let g = b.rotate(Duration::from_millis(40)).start(dir.path().join("s-{seq}.spool")).unwrap();
    let (polled, called) = wait_for(&g, &seen, "already taken");
    let stats = g.finish().unwrap();
    assert_eq!(count(&polled, "already taken"), 1, "Guard::warnings before finish: {polled:?}");
    assert_eq!(count(&called, "already taken"), 1, "on_warning before finish: {called:?}");
    assert_eq!(count(&stats.warnings, "already taken"), 1, "{:?}", stats.warnings);
    assert_eq!(*seen.lock().unwrap(), stats.warnings);
}

/// Without anything going wrong while recording, what the guard showed is
/// a prefix of the final list (start-up warnings only: none where perf events
/// are allowed), and the callback saw the final list.
#[test]
fn the_guard_and_the_callback_agree_with_stats() {
    let _serial = serial();
    let (_dir, path) = spool_path("quiet.spool");
    let (b, seen) = with_callback();
    let g = b.start(&path).unwrap();
    burn(0.1);
    let polled = g.warnings();
    let stats = g.finish().unwrap();
    assert!(stats.warnings.starts_with(&polled), "{polled:?} then {:?}", stats.warnings);
    assert_eq!(*seen.lock().unwrap(), stats.warnings);
}

/// Samples lost to a full ring are said while recording, once, with the
/// reason; and only when some were lost. A ring of 2 slots at 4 kHz cannot
/// hold what arrives between two drains (a timer engine, capped at the
/// kernel's tick, may lose none: then no warning may appear).
#[test]
fn samples_lost_to_a_full_ring_are_warned_while_recording() {
    let _serial = serial();
    let (_dir, path) = spool_path("full.spool");
    let (b, seen) = with_callback();
    let g = b.ring_capacity(2).frequency_hz(4000).start(&path).unwrap();
    let needle = "the sample ring was full";
    let (polled, called) = wait_for(&g, &seen, needle);
    let stats = g.finish().unwrap();
    if stats.samples_lost.ring_full == 0 {
        eprintln!("no sample lost with the {:?} engine: checking that nothing is said", stats.engine);
        assert_eq!(count(&stats.warnings, needle), 0, "{:?}", stats.warnings);
        return;
    }
    assert_eq!(count(&polled, needle), 1, "Guard::warnings before finish: {polled:?}");
    assert_eq!(count(&called, needle), 1, "on_warning before finish: {called:?}");
    assert_eq!(count(&stats.warnings, needle), 1, "{:?}", stats.warnings);
    assert_eq!(*seen.lock().unwrap(), stats.warnings);
}

/// A thread that blocks the profiling signal and burns CPU is never
/// sampled: the final list says so, once (a thread seen blocking for a moment,
/// in a handler or while it starts, is not counted: the quiet test above).
#[test]
fn a_thread_blocking_the_signal_is_warned_at_the_end() {
    let _serial = serial();
    let (_dir, path) = spool_path("blocking.spool");
    let g = spulse::Recorder::builder().flush_interval(Duration::from_millis(20)).start(&path).unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let (burnt_tx, burnt_rx) = std::sync::mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        block_profiling_signals();
        burn(0.3);
        burnt_tx.send(()).unwrap();
        let _ = done_rx.recv();
    });
    burnt_rx.recv().unwrap();
    let stats = g.finish().unwrap();
    done_tx.send(()).unwrap();
    h.join().unwrap();
    let needle = "blocked the profiling signal";
    assert_eq!(count(&stats.warnings, needle), 1, "{stats:?}");
    assert!(stats.warnings.iter().any(|w| w.starts_with("1 thread ")), "{:?}", stats.warnings);
}
