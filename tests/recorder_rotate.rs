//! Rotating spools: `RecorderBuilder::rotate` starts a new segment every
//! interval, `retain` keeps the newest N (only files the recorder created),
//! every segment opens on its own, and the segments' samples add up to `Stats`.

mod recorder_support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use recorder_support::*;
use spulse::{Error, RecorderError, Snapshot};

/// The segment files in `dir` named `prefix<6 digits>.spool`, by number.
fn segments(dir: &Path, prefix: &str) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name()?.to_str()?.to_string();
            let num = name.strip_prefix(prefix)?.strip_suffix(".spool")?;
            if num.len() != 6 {
                return None;
            }
            Some((num.parse().ok()?, p.clone()))
        })
        .collect();
    out.sort();
    out
}

/// Burn CPU on this thread for `wall` of wall-clock time.
fn busy_for(wall: Duration) {
    let t = Instant::now();
    while t.elapsed() < wall {
        burn(0.005);
    }
}

fn invalid_setting(e: &Error) -> &'static str {
    match e {
        Error::Recorder(RecorderError::InvalidConfig { setting, .. }) => setting,
        other => panic!("expected an invalid setting, got {other:?}"),
    }
}

#[test]
fn segments_appear_at_the_interval_open_alone_and_add_up_to_the_stats() {
    let _serial = serial();
    let (dir, _) = spool_path("unused");
    let every = Duration::from_millis(100);
    let started = Instant::now();
    let g = spulse::Recorder::builder()
        .flush_interval(Duration::from_millis(10))
        .rotate(every)
        .start(dir.path().join("seg-{seq}.spool"))
        .unwrap();
    assert_eq!(g.path(), dir.path().join("seg-000000.spool"));
    busy_for(Duration::from_millis(1000));
    let stats = g.finish().unwrap();
    let elapsed = started.elapsed();

    let segs = segments(dir.path(), "seg-");
    let nums: Vec<u64> = segs.iter().map(|s| s.0).collect();
    assert_eq!(nums, (0..stats.segments_written).collect::<Vec<_>>(), "numbered densely from 0");
    assert_eq!(stats.segments_deleted, 0);
    // A new segment at each due time (the first flush at or after it), never more.
    let most = (elapsed.as_secs_f64() / every.as_secs_f64()).floor() as u64 + 1;
    assert!(
        (3..=most).contains(&stats.segments_written),
        "{} segments in {elapsed:?} at {every:?}",
        stats.segments_written
    );

    let mut total = 0u64;
    let mut bytes = 0u64;
    let mut burn_samples = 0u64;
    let mut first_start = None;
    let mut last_sample = 0u64;
    for (k, (_, p)) in segs.iter().enumerate() {
        // Each segment alone: a complete spool with its own header and definitions.
        let snap = Snapshot::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(!snap.recovered_from_truncated_tail(), "{}", p.display());
        assert!(!snap.modules().is_empty(), "{}: no module definitions", p.display());
        let start = snap.start_time_us();
        let first = *first_start.get_or_insert(start);
        // Segment k starts no earlier than k intervals after the first (2 ms for clock steps).
        assert!(
            start + 2_000 >= first + k as u64 * every.as_micros() as u64,
            "segment {k} started {} us after the first",
            start - first
        );
        if let Some((lo, hi)) = snap.time_range() {
            assert!(lo + 1_000 >= last_sample, "segment {k} has samples before the previous one's last");
            last_sample = hi;
        }
        total += snap.len() as u64;
        bytes += std::fs::metadata(p).unwrap().len();
        burn_samples += leaf_counts(&snap)
            .iter()
            .filter(|((_, name), _)| name.contains("burn_cpu"))
            .map(|(_, n)| n)
            .sum::<u64>();
    }
    assert_eq!(total, stats.samples_written, "the segments' samples add up to Stats");
    assert_eq!(bytes, stats.bytes, "the segments' sizes add up to Stats");
    assert!(stats.samples_written > 100, "{} samples", stats.samples_written);
    // The busy loop is named from each segment's own module definitions.
    assert!(burn_samples * 2 > total, "{burn_samples} of {total} samples named burn_cpu");
}

#[test]
fn retention_keeps_exactly_the_newest_n_and_only_its_own_files() {
    let _serial = serial();
    let (dir, _) = spool_path("unused");
    let g = spulse::Recorder::builder()
        .flush_interval(Duration::from_millis(5))
        .rotate(Duration::from_millis(40))
        .retain(3)
        .start(dir.path().join("r-{seq}.spool"))
        .unwrap();
    // Once segment 1 exists, put another file in segment 0's place: retention
    // must leave it alone.
    let seg0 = dir.path().join("r-000000.spool");
    let t = Instant::now();
    while !dir.path().join("r-000001.spool").exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "no second segment");
        busy_for(Duration::from_millis(5));
    }
    std::fs::rename(&seg0, dir.path().join("moved.spool")).unwrap();
    std::fs::write(&seg0, b"someone else's").unwrap();
    busy_for(Duration::from_millis(500));
    let stats = g.finish().unwrap();

    assert!(stats.segments_written >= 6, "{} segments", stats.segments_written);
    let left = segments(dir.path(), "r-");
    let nums: Vec<u64> = left.iter().map(|s| s.0).collect();
    let n = stats.segments_written;
    assert_eq!(nums, vec![0, n - 3, n - 2, n - 1], "the newest 3, and the foreign file");
    assert_eq!(std::fs::read(&seg0).unwrap(), b"someone else's");
    // Segment 0 was not deleted (it was no longer ours), nor counted.
    assert_eq!(stats.segments_deleted, n - 4);
    for (_, p) in &left[1..] {
        Snapshot::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
    Snapshot::open(dir.path().join("moved.spool")).unwrap();
}

/// A finished segment whose inode now holds another file (file systems reuse
/// inode numbers: ext4 soon after a delete; here the same inode rewritten in
/// place stands for it): retention matches more than (device, inode) and
/// leaves it alone.
#[test]
fn retention_leaves_a_file_that_reuses_a_segments_inode() {
    let _serial = serial();
    let (dir, _) = spool_path("unused");
    let g = spulse::Recorder::builder()
        .flush_interval(Duration::from_millis(5))
        .rotate(Duration::from_millis(250))
        .retain(2)
        .start(dir.path().join("i-{seq}.spool"))
        .unwrap();
    let seg0 = dir.path().join("i-000000.spool");
    let t = Instant::now();
    while !dir.path().join("i-000001.spool").exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "no second segment");
        busy_for(Duration::from_millis(5));
    }
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(&seg0).unwrap().ino();
    // Same inode, other content (truncated and rewritten through a new open).
    std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&seg0)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"another file on a reused inode"))
        .unwrap();
    assert_eq!(std::fs::metadata(&seg0).unwrap().ino(), ino);
    busy_for(Duration::from_millis(1200));
    let stats = g.finish().unwrap();
    assert!(stats.segments_written >= 5, "{} segments", stats.segments_written);
    assert_eq!(std::fs::read(&seg0).unwrap(), b"another file on a reused inode", "not deleted");
    let n = stats.segments_written;
    let nums: Vec<u64> = segments(dir.path(), "i-").iter().map(|s| s.0).collect();
    assert_eq!(nums, vec![0, n - 2, n - 1]);
    assert_eq!(stats.segments_deleted, n - 3);
}

#[test]
fn a_python_runtime_mark_is_repeated_in_each_new_segment() {
    let _serial = serial();
    let (dir, _) = spool_path("unused");
    let g = spulse::Recorder::builder()
        .flush_interval(Duration::from_millis(5))
        .rotate(Duration::from_millis(20))
        .start(dir.path().join("py-{seq}.spool"))
        .unwrap();
    busy_for(Duration::from_millis(10));
    let last = || segments(dir.path(), "py-").last().unwrap().0;
    let before = last();
    spulse::python_runtime_enter().unwrap();
    let after = last();
    let t = Instant::now();
    while last() < after + 2 {
        assert!(t.elapsed() < Duration::from_secs(20), "no new segments");
        busy_for(Duration::from_millis(5));
    }
    spulse::python_runtime_leave().unwrap();
    g.finish().unwrap();
    for (num, p) in segments(dir.path(), "py-") {
        let snap = Snapshot::open(&p).unwrap();
        let ev: Vec<bool> = snap.python_runtime_events().iter().map(|e| e.entering).collect();
        if num < before {
            assert!(ev.is_empty(), "segment {num}: {ev:?}");
        }
        if num == after + 1 {
            // Created inside Python mode and left before the mode ended: the
            // segment says so itself, at its start.
            assert_eq!(ev, [true], "segment {num}");
        }
    }
}

#[test]
fn rotation_settings_are_checked_before_anything_is_created() {
    let _serial = serial();
    let (dir, _) = spool_path("unused");
    let b = || spulse::Recorder::builder();
    let seq = dir.path().join("x-{seq}.spool");
    let plain = dir.path().join("x.spool");
    let second = Duration::from_secs(1);
    // Rotating needs {seq}; {seq} needs rotating.
    assert_eq!(invalid_setting(&b().rotate(second).start(&plain).unwrap_err()), "path");
    let e = b().start(&seq).unwrap_err();
    assert_eq!(invalid_setting(&e), "path");
    assert!(e.to_string().contains("{seq}"), "{e}");
    // A literal "{seq}" is still possible.
    let g = b().start(dir.path().join("lit-{{seq}}.spool")).unwrap();
    g.finish().unwrap();
    assert!(dir.path().join("lit-{seq}.spool").exists());
    // Retention only with rotation, and at least 1.
    assert_eq!(invalid_setting(&b().retain(2).start(&plain).unwrap_err()), "retain");
    assert_eq!(invalid_setting(&b().rotate(second).retain(0).start(&seq).unwrap_err()), "retain");
    // Interval bounds, and not shorter than a flush.
    assert_eq!(invalid_setting(&b().rotate(Duration::from_millis(1)).start(&seq).unwrap_err()), "rotate");
    let e = b()
        .flush_interval(Duration::from_millis(500))
        .rotate(Duration::from_millis(100))
        .start(&seq)
        .unwrap_err();
    assert_eq!(invalid_setting(&e), "rotate");
    assert_eq!(
        invalid_setting(&b().rotate(Duration::from_secs(40 * 86_400)).start(&seq).unwrap_err()),
        "rotate"
    );
    // The environment: SPULSE_ROTATE and SPULSE_RETAIN stand for the settings.
    std::env::set_var("SPULSE_ROTATE", "soon");
    let e = b().start(&seq).unwrap_err();
    assert_eq!(invalid_setting(&e), "SPULSE_ROTATE");
    std::env::set_var("SPULSE_ROTATE", "0.05");
    assert_eq!(invalid_setting(&b().start(&plain).unwrap_err()), "path");
    std::env::set_var("SPULSE_RETAIN", "-1");
    assert_eq!(invalid_setting(&b().start(&seq).unwrap_err()), "SPULSE_RETAIN");
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 1, "nothing created by a refused start: {names:?}");
    std::env::set_var("SPULSE_RETAIN", "2");
    let g = b().flush_interval(Duration::from_millis(5)).start(dir.path().join("env-{seq}.spool")).unwrap();
    busy_for(Duration::from_millis(300));
    let stats = g.finish().unwrap();
    std::env::remove_var("SPULSE_ROTATE");
    std::env::remove_var("SPULSE_RETAIN");
    assert!(stats.segments_written >= 3, "{} segments", stats.segments_written);
    assert_eq!(segments(dir.path(), "env-").len(), 2);
    assert_eq!(stats.segments_deleted, stats.segments_written - 2);
}

/// Whether some descriptor holds `flock(LOCK_EX)` on the file at `path`.
fn locked(path: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: flock on a descriptor that `f` keeps open for the call.
    let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    r != 0
}

#[test]
fn each_segment_follows_the_overwrite_and_lock_rules() {
    let _serial = serial();
    let builder = || {
        spulse::Recorder::builder().flush_interval(Duration::from_millis(5)).rotate(Duration::from_millis(30))
    };

    // While recording, the segments left behind are unlocked (complete) and
    // the newest one is locked.
    let (dir, _) = spool_path("unused");
    let g = builder().start(dir.path().join("l-{seq}.spool")).unwrap();
    let t = Instant::now();
    while segments(dir.path(), "l-").len() < 3 {
        assert!(t.elapsed() < Duration::from_secs(20), "no third segment");
        busy_for(Duration::from_millis(5));
    }
    let segs = segments(dir.path(), "l-");
    assert!(!locked(&segs[0].1), "a finished segment is unlocked");
    assert!(locked(&segments(dir.path(), "l-").last().unwrap().1), "the newest segment is locked");
    g.finish().unwrap();
    assert!(segments(dir.path(), "l-").iter().all(|(_, p)| !locked(p)));

    // A later segment's path taken (another user's file in a shared
    // directory): without overwrite, the recording goes on under the next free
    // number, leaves the file untouched, and says so.
    let (dir, _) = spool_path("unused");
    let taken = dir.path().join("o-000001.spool");
    std::fs::write(&taken, b"not a segment").unwrap();
    let g = builder().start(dir.path().join("o-{seq}.spool")).unwrap();
    let t = Instant::now();
    while !dir.path().join("o-000003.spool").exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "no segment after the taken one");
        busy_for(Duration::from_millis(5));
    }
    let stats = g.finish().unwrap();
    assert_eq!(std::fs::read(&taken).unwrap(), b"not a segment");
    let w: Vec<&String> = stats.warnings.iter().filter(|w| w.contains("already taken")).collect();
    assert_eq!(w.len(), 1, "{:?}", stats.warnings);
    assert!(w[0].contains("o-000001.spool") && w[0].contains("o-000002.spool"), "{}", w[0]);
    for (n, p) in segments(dir.path(), "o-") {
        if n != 1 {
            Snapshot::open(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        }
    }
    // Names taken beyond the bound (16 in a row): the recording stops with the
    // error naming the last one tried, and counts what it lost.
    let (dir, _) = spool_path("unused");
    for n in 1..=17 {
        std::fs::write(dir.path().join(format!("o-{n:06}.spool")), b"not a segment").unwrap();
    }
    let last = dir.path().join("o-000017.spool");
    let g = builder().start(dir.path().join("o-{seq}.spool")).unwrap();
    // 30 ms rotations: a second is many of them, even on a loaded machine.
    busy_for(Duration::from_millis(1000));
    match g.finish() {
        Err(Error::Recorder(RecorderError::WriteStopped { source, samples_lost, .. })) => match *source {
            Error::Io { path: Some(p), source } => {
                assert_eq!(p, last);
                assert_eq!(source.kind(), std::io::ErrorKind::AlreadyExists);
                assert!(samples_lost > 0, "the samples after it are counted as lost");
            }
            other => panic!("expected the last taken segment path as the error, got {other:?}"),
        },
        other => panic!("expected the last taken segment path as the error, got {other:?}"),
    }
    assert_eq!(std::fs::read(&last).unwrap(), b"not a segment");
    Snapshot::open(dir.path().join("o-000000.spool")).unwrap();
    let taken = dir.path().join("o-000001.spool");
    // With overwrite, it is replaced by the segment.
    let g = builder().overwrite(true).start(dir.path().join("o-{seq}.spool")).unwrap();
    let t = Instant::now();
    // (o-000002 is one of the taken files until the segment replaces it.)
    while Snapshot::open(dir.path().join("o-000002.spool")).is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "no third segment");
        busy_for(Duration::from_millis(5));
    }
    let stats = g.finish().unwrap();
    assert!(stats.segments_written >= 3, "{} segments", stats.segments_written);
    assert!(!Snapshot::open(&taken).unwrap().modules().is_empty());
}
