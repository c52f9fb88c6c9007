//! Readers opening paths that are not spools, or not files at all: an endless
//! device, a FIFO with no writer, a huge file with a bad magic, a directory, a
//! stream longer than `Snapshot`'s bound. Each must end promptly in an error
//! that names the path (and the offset, for a format error), never in a hang
//! or in unbounded memory; and a spool piped through a FIFO must still read.
//!
//! Each reader runs on its own thread with a generous deadline, so a reader
//! that blocks or reads forever fails the test instead of hanging the suite.

use spulse_testkit::emulator;

use std::ffi::CString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use spulse::{Error, FormatErrorKind, Frame, Header, Replay, Snapshot, SpoolWriter, Tail};

/// Far above what any of these reads needs; only a hang or an endless read
/// reaches it.
const DEADLINE: Duration = Duration::from_secs(60);

type Outcome = Result<(), Error>;

/// Run `open` on its own thread; panic if it has not returned by the deadline.
fn within_deadline(what: &str, open: impl FnOnce() -> Outcome + Send + 'static) -> Outcome {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(open());
    });
    rx.recv_timeout(DEADLINE).unwrap_or_else(|_| panic!("{what}: no answer within {DEADLINE:?}"))
}

/// Every reader, opening `path` and reading all of it.
fn readers(path: &Path) -> Vec<(&'static str, Outcome)> {
    let p = path.to_path_buf();
    let snapshot = within_deadline("Snapshot", move || Snapshot::open(&p).map(drop));
    let p = path.to_path_buf();
    let replay = within_deadline("Replay", move || {
        Replay::open(&p).and_then(|r| r.samples().try_for_each(|s| s.map(drop)))
    });
    let p = path.to_path_buf();
    let tail = within_deadline("Tail", move || {
        let mut t = Tail::open(&p)?;
        while !t.poll()?.is_empty() {}
        Ok(())
    });
    vec![("Snapshot", snapshot), ("Replay", replay), ("Tail", tail)]
}

/// The error is an I/O error naming `path` whose message contains `needle`.
fn assert_refused(who: &str, r: &Outcome, path: &Path, needle: &str) {
    match r {
        Err(e @ Error::Io { path: Some(p), .. }) => {
            assert_eq!(p, path, "{who}: {e}");
            let msg = e.to_string();
            assert!(msg.contains(needle), "{who}: {msg:?} should say {needle:?}");
            assert!(
                msg.starts_with(&path.display().to_string()),
                "{who}: {msg:?} should start with the path"
            );
        }
        other => panic!("{who}: expected an I/O error naming {}, got {other:?}", path.display()),
    }
}

fn assert_format_error(who: &str, r: &Outcome, path: &Path, kind: FormatErrorKind, offset: u64) {
    match r {
        Err(Error::Format { path: Some(p), offset: o, kind: k }) => {
            assert_eq!((p.as_path(), o, k), (path, &offset, &kind), "{who}");
        }
        other => panic!("{who}: expected {kind:?} at {offset} in {}, got {other:?}", path.display()),
    }
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
}

/// A valid spool of `samples` samples.
fn spool(samples: u64) -> Vec<u8> {
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: 1_000_000, interval_us: 1000 }).unwrap();
    let t = w.define_thread(1, 1, "main").unwrap();
    let f = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let s = w.define_stack(None, f).unwrap();
    for i in 0..samples {
        w.sample(1_000_000 + i * 1000, t, s).unwrap();
    }
    w.into_inner().unwrap()
}

#[test]
fn dev_zero_is_refused_by_every_reader() {
    let path = PathBuf::from("/dev/zero");
    for (who, r) in readers(&path) {
        assert_refused(who, &r, &path, "character device");
    }
}

#[test]
fn a_directory_is_refused_by_every_reader() {
    let dir = tempfile::tempdir().unwrap();
    for (who, r) in readers(dir.path()) {
        assert_refused(who, &r, dir.path(), "directory");
    }
}

/// Nobody will ever write to this FIFO: `Snapshot` reads it as empty at once
/// (a truncated header at offset 0); `Replay` and `Tail`, which need a file they
/// can re-read, refuse it. None of them waits for a writer.
#[test]
fn a_fifo_without_writer_ends_promptly_in_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("no-writer.fifo");
    mkfifo(&fifo);
    let results = readers(&fifo);
    assert_format_error(results[0].0, &results[0].1, &fifo, FormatErrorKind::TruncatedHeader, 0);
    for (who, r) in &results[1..] {
        assert_refused(who, r, &fifo, "FIFO");
    }
}

/// A writer that is connected and streams a spool larger than the pipe buffer:
/// `Snapshot` waits for its data (as `cat` would) and reads exactly the spool.
#[test]
fn a_spool_streamed_through_a_fifo_reads_in_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("stream.fifo");
    mkfifo(&fifo);
    let bytes = spool(200_000);
    assert!(bytes.len() > 256 * 1024, "larger than any pipe buffer");
    let expect = Snapshot::from_bytes(&bytes).unwrap();
    // A reader end held open here lets the writer end open without blocking;
    // the pipe then has a writer before `Snapshot` opens it.
    let _keep = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
    let mut writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    std::thread::spawn(move || {
        // Errors end the stream early, which the comparison below reports.
        let _ = writer.write_all(&bytes);
    });
    let p = fifo.clone();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(Snapshot::open(&p));
    });
    let snap = rx.recv_timeout(DEADLINE).expect("Snapshot of a FIFO within the deadline").unwrap();
    assert!(!snap.recovered_from_truncated_tail());
    assert_eq!(snap.len(), 200_000);
    assert!(snap.samples().eq(expect.samples()));
}

/// A stream longer than the bound is refused with an error naming the path and
/// the bound, after reading no more than the bound (plus one byte).
#[test]
fn a_stream_longer_than_the_bound_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("long.fifo");
    mkfifo(&fifo);
    let bytes = spool(1000);
    assert!(bytes.len() > 2048 && bytes.len() < 32 * 1024, "fits the pipe buffer");
    let _keep = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
    let mut writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    writer.write_all(&bytes).unwrap();
    drop(writer);
    let p = fifo.clone();
    let r = within_deadline("Snapshot", move || Snapshot::open_with_stream_limit(&p, 2048).map(drop));
    assert_refused("Snapshot", &r, &fifo, "longer than 2048 bytes");
    // The same bytes within the bound (exactly at it) read in full.
    let fifo = dir.path().join("at-bound.fifo");
    mkfifo(&fifo);
    let _keep = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&fifo).unwrap();
    let mut writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    writer.write_all(&bytes).unwrap();
    drop(writer);
    let p = fifo.clone();
    let len = bytes.len() as u64;
    let r = within_deadline("Snapshot", move || {
        Snapshot::open_with_stream_limit(&p, len).map(|s| assert_eq!(s.len(), 1000))
    });
    r.unwrap();
}

/// A 1 TiB (sparse) file whose first bytes are not the magic: every reader
/// rejects it from its first bytes. Reading it in full would exhaust memory
/// (Snapshot) or take hours (Replay, Tail).
#[test]
fn a_huge_file_with_a_bad_magic_is_rejected_from_its_first_bytes() {
    let file = tempfile::NamedTempFile::new().unwrap();
    file.as_file().write_all(b"NOTSPULSE\x00\x00").unwrap();
    file.as_file().set_len(1 << 40).expect("a sparse 1 TiB file on the temporary directory's file system");
    for (who, r) in readers(file.path()) {
        assert_format_error(who, &r, file.path(), FormatErrorKind::BadMagic, 0);
    }
    // A valid header followed by a record that is wrong from its first byte is
    // rejected there too, without reading the rest of the terabyte.
    let mut head = spool(0);
    let at = head.len() as u64;
    head.push(0x0b); // tags 9 and 10 are the off-CPU interval and the heap event (FORMAT.md); 11 is unknown
    std::fs::write(file.path(), &head).unwrap();
    file.as_file().set_len(1 << 40).unwrap();
    let results = readers(file.path());
    for (who, r) in &results[1..] {
        assert_format_error(who, r, file.path(), FormatErrorKind::UnknownTag(11), at);
    }
    // `Snapshot` reads a file whole, and a terabyte does not fit: it says so
    // (or, where it does fit, reports the bad record).
    match &results[0].1 {
        Err(e @ Error::Io { path: Some(p), source }) => {
            assert_eq!((p.as_path(), source.kind()), (file.path(), std::io::ErrorKind::OutOfMemory), "{e}");
        }
        r => assert_format_error("Snapshot", r, file.path(), FormatErrorKind::UnknownTag(11), at),
    }
}

/// With its address space limited to 8 GiB (a child process of this test),
/// `Snapshot` asked to open a valid 64 GiB sparse spool returns an error naming
/// the path instead of aborting on the failed allocation.
#[test]
fn snapshot_of_a_file_too_large_for_memory_is_an_error_not_an_abort() {
    if let Some(path) = std::env::var_os("SPULSE_TEST_SNAPSHOT_RLIMIT") {
        let limit = libc::rlimit { rlim_cur: 8 << 30, rlim_max: 8 << 30 };
        // SAFETY: setrlimit reads the struct we pass; lowering our own limit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) }, 0);
        match Snapshot::open(&path) {
            Err(e @ Error::Io { path: Some(_), .. }) => println!("RESULT refused: {e}"),
            other => println!("RESULT unexpected: {:?}", other.map(|s| s.len())),
        }
        return;
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), spool(3)).unwrap();
    file.as_file().set_len(64 << 30).expect("a sparse 64 GiB file on the temporary directory's file system");
    let out = emulator::self_command()
        .args([
            "--exact",
            "untrusted_files::snapshot_of_a_file_too_large_for_memory_is_an_error_not_an_abort",
            "--nocapture",
        ])
        .env("SPULSE_TEST_SNAPSHOT_RLIMIT", file.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.lines().find_map(|l| l.split_once("RESULT ").map(|x| x.1)).expect("child result");
    let want = format!("refused: {}: cannot allocate", file.path().display());
    assert!(line.starts_with(&want), "{line}");
}
