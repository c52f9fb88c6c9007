//! A pprof HTTP endpoint (cargo feature `http`, off by default).
//!
//! [`serve`] starts one server thread ([`tiny_http`]: blocking I/O, no async
//! runtime) that answers `GET /debug/pprof/profile?seconds=N` with a gzipped
//! pprof `Profile` of this process's CPU samples over the next `N` seconds
//! (default [`DEFAULT_SECONDS`], at most [`MAX_SECONDS`]): what
//! `go tool pprof http://HOST/debug/pprof/profile?seconds=N`, Parca and
//! Grafana Pyroscope's scrapers fetch. [`profile`] returns the same bytes, to
//! mount on a router of your own. The profile is the one `spulse export
//! --format pprof` writes for that window (both go through [`crate::pprof`]):
//! one sample per (thread, stack) labelled `pid`, `tid` and `thread`, values
//! `samples/count` and `cpu/nanoseconds`, functions with file and line where
//! the binaries have debug info, and the executable's and libraries'
//! mappings with their build ids, so that a server can re-symbolize.
//!
//! Answers: `200` with the profile; `400` for a `seconds` that is not an
//! integer in `1..=MAX_SECONDS`; `404` for any other path; `405` for a
//! method other than `GET`; `409` while another profile is being collected
//! in the process (one window at a time, whoever asked: the server or
//! [`profile`]); `500` with the error's text when the profile could not be
//! made (no engine may sample, say).
//!
//! Where the samples come from:
//! - If a recorder runs in this process ([`crate::start`],
//!   [`crate::RecorderBuilder::start`]), the window is cut from its live
//!   spool: a [`crate::Tail`] reads the spool to its current end (the
//!   definitions the window's samples refer to), then counts the samples
//!   timed inside the window as they are flushed. No second set of signals;
//!   the recorder's settings (frequency, depth) apply. For a rotating
//!   recording ([`crate::RecorderBuilder::rotate`]) the window is cut from
//!   the segment current when the request arrives, so the samples after a
//!   rotation inside the window are missing from that profile.
//! - Otherwise a recorder with the default settings records the window into
//!   a temporary spool in [`std::env::temp_dir`], which is removed after.
//!   While it runs, starting another recorder in the process fails with
//!   [`RecorderError::AlreadyRunning`].
//!
//! Symbolization runs in process, on the thread that makes the profile (the
//! server's own thread for [`serve`]), after the window closes, with the
//! symbolizer of [`crate::symbolize`]: module files are mapped read-only, not
//! read into memory, and their symbol tables and DWARF are loaded once and
//! kept between requests (the server keeps one symbolizer; [`profile`] one
//! per calling thread). Its heap is bounded by the debug data of the modules
//! sampled (the DWARF units and line tables looked up, each module's symbol
//! table) plus, per request, the spool's definitions and one count per
//! distinct (thread, stack) of the window. BENCHMARKS.md gives the measured
//! cost of a 30-second profile.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::pprof::{Counts, Window};
use crate::symbolize::{Context, Options, Symbolizer};
use crate::{Error, Guard, Recorder, RecorderError, Sample, StackId, Tail, ThreadId};

/// The path the server answers.
pub const PROFILE_PATH: &str = "/debug/pprof/profile";

/// The window when a request gives no `seconds`.
pub const DEFAULT_SECONDS: u64 = 30;

/// The longest window a request may ask for.
pub const MAX_SECONDS: u64 = 300;

/// How long the collecting thread waits between polls of the spool (and how
/// long the server waits for a request before it checks whether to stop).
const POLL: Duration = Duration::from_millis(50);

/// Set while a profile window is being collected in this process.
static COLLECTING: AtomicBool = AtomicBool::new(false);

/// The right to collect the one window of the process; released on drop.
struct Collecting;

impl Collecting {
    fn take() -> Result<Collecting, Error> {
        COLLECTING
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .map(|_| Collecting)
            .map_err(|_| Error::Recorder(RecorderError::ProfileInProgress))
    }
}

impl Drop for Collecting {
    fn drop(&mut self) {
        COLLECTING.store(false, Ordering::SeqCst);
    }
}

/// A running pprof endpoint. Dropping it stops the server thread (a window
/// being collected is abandoned, its temporary spool removed) and waits for
/// it to end; the listening socket is closed moments later by tiny_http's
/// own accept thread.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    /// The address the server listens on (the port chosen when `serve` was
    /// given port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            // The thread checks `stop` at least every POLL; a panic in it has
            // already been reported by the panic hook.
            let _ = t.join();
        }
    }
}

/// Listen on `addr` and answer `GET /debug/pprof/profile?seconds=N` on a new
/// thread named `spulse-http` (see the [module documentation](self)).
///
/// ```no_run
/// let server = spulse::http::serve("127.0.0.1:6060")?;
/// println!("go tool pprof http://{}/debug/pprof/profile?seconds=30", server.local_addr());
/// # Ok::<(), spulse::Error>(())
/// ```
pub fn serve(addr: impl ToSocketAddrs) -> Result<Server, Error> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(|e| Error::io(None, e))?.collect();
    let http = tiny_http::Server::http(&addrs[..]).map_err(|e| {
        let kind = e.downcast_ref::<io::Error>().map_or(io::ErrorKind::Other, |e| e.kind());
        Error::io(None, io::Error::new(kind, format!("spulse::http::serve: cannot listen on {addrs:?}: {e}")))
    })?;
    let bound = http.server_addr().to_ip().ok_or_else(|| {
        Error::io(None, io::Error::other("spulse::http::serve: the server is not listening on an IP address"))
    })?;
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("spulse-http".into())
            .spawn(move || run(&http, &stop))
            .map_err(|e| Error::io(None, e))?
    };
    Ok(Server { addr: bound, stop, thread: Some(thread) })
}

/// A gzipped pprof `Profile` of this process's CPU samples over the next
/// `duration` (at most [`MAX_SECONDS`] seconds), symbolized in process: the
/// body [`serve`] answers with, for a router of your own. Blocks for the
/// window, then symbolizes on the calling thread (whose symbolizer keeps its
/// symbol tables for the next call).
///
/// Errors: [`RecorderError::InvalidConfig`] (setting `seconds`) for a zero or
/// too long `duration`; [`RecorderError::ProfileInProgress`] while another
/// window is being collected in the process; a recorder or spool error when
/// no samples can be had.
///
/// ```no_run
/// let pprof_gz: Vec<u8> = spulse::http::profile(std::time::Duration::from_secs(10))?;
/// # Ok::<(), spulse::Error>(())
/// ```
pub fn profile(duration: Duration) -> Result<Vec<u8>, Error> {
    thread_local! {
        static SYMBOLIZER: RefCell<Option<Symbolizer>> = const { RefCell::new(None) };
    }
    if duration.is_zero() || duration > Duration::from_secs(MAX_SECONDS) {
        return Err(Error::Recorder(RecorderError::InvalidConfig {
            setting: "seconds",
            message: format!("profile duration {duration:?} is outside (0 s, {MAX_SECONDS} s]"),
        }));
    }
    let _collecting = Collecting::take()?;
    let window = collect(duration, &mut || {
        std::thread::sleep(POLL);
        true
    })?;
    SYMBOLIZER.with(|s| {
        let mut s = s.borrow_mut();
        let sym = s.get_or_insert_with(|| Symbolizer::new(Options::default()));
        window.encode(sym)
    })
}

/// What a request asks for.
enum Route {
    /// A profile of this many seconds.
    Profile(u64),
    /// An answer without a profile: status and text.
    Refuse(u16, String),
}

fn route(method: &tiny_http::Method, url: &str) -> Route {
    let (path, query) = url.split_once('?').unwrap_or((url, ""));
    if path != PROFILE_PATH {
        return Route::Refuse(
            404,
            format!("not found: {} (the pprof endpoint is {PROFILE_PATH}?seconds=N)\n", shown(path)),
        );
    }
    if *method != tiny_http::Method::Get {
        return Route::Refuse(405, format!("method {method} not allowed: {PROFILE_PATH} answers GET\n"));
    }
    let mut seconds = DEFAULT_SECONDS;
    for (key, value) in
        query.split('&').filter(|p| !p.is_empty()).map(|p| p.split_once('=').unwrap_or((p, "")))
    {
        if key != "seconds" {
            continue;
        }
        match value.parse::<u64>() {
            Ok(n) if (1..=MAX_SECONDS).contains(&n) => seconds = n,
            _ => {
                return Route::Refuse(
                    400,
                    format!(
                        "bad seconds=\"{}\": expected a whole number of seconds in 1..={MAX_SECONDS}\n",
                        shown(value)
                    ),
                );
            }
        }
    }
    Route::Profile(seconds)
}

/// Request text as echoed in an answer: escaped, at most 64 characters.
fn shown(text: &str) -> String {
    text.chars().take(64).flat_map(char::escape_default).collect()
}

fn respond_text(rq: tiny_http::Request, status: u16, text: String) {
    let header = tiny_http::Header::from_bytes("Content-Type", "text/plain; charset=utf-8")
        .expect("a valid static header");
    // A client that went away is no error of the server's.
    let _ = rq.respond(tiny_http::Response::from_string(text).with_status_code(status).with_header(header));
}

fn respond_error(rq: tiny_http::Request, e: &Error) {
    let status = match e {
        Error::Recorder(RecorderError::ProfileInProgress) => 409,
        Error::Recorder(RecorderError::InvalidConfig { .. }) => 400,
        _ => 500,
    };
    respond_text(rq, status, format!("{e}\n"));
}

/// The server thread: one request at a time; while a window is collected,
/// requests that arrive are answered at once (409 for another profile).
fn run(http: &tiny_http::Server, stop: &AtomicBool) {
    let mut sym = Symbolizer::new(Options::default());
    while !stop.load(Ordering::SeqCst) {
        let Ok(Some(rq)) = http.recv_timeout(POLL) else { continue };
        match route(rq.method(), rq.url()) {
            Route::Refuse(status, text) => respond_text(rq, status, text),
            Route::Profile(seconds) => {
                let made = Collecting::take().and_then(|_collecting| {
                    let window = collect(Duration::from_secs(seconds), &mut || wait_answering(http, stop))?;
                    window.encode(&mut sym)
                });
                match made {
                    Ok(body) => {
                        let headers = [
                            ("Content-Type", "application/octet-stream"),
                            ("Content-Disposition", "attachment; filename=\"profile.pb.gz\""),
                        ]
                        .map(|(k, v)| tiny_http::Header::from_bytes(k, v).expect("a valid static header"));
                        let mut response = tiny_http::Response::from_data(body);
                        for h in headers {
                            response.add_header(h);
                        }
                        let _ = rq.respond(response);
                    }
                    Err(e) => respond_error(rq, &e),
                }
            }
        }
    }
}

/// Wait up to one poll interval, answering whatever request arrives (a
/// profile request gets 409: a window is being collected). False when the
/// server is stopping.
fn wait_answering(http: &tiny_http::Server, stop: &AtomicBool) -> bool {
    if let Ok(Some(rq)) = http.recv_timeout(POLL) {
        match route(rq.method(), rq.url()) {
            Route::Refuse(status, text) => respond_text(rq, status, text),
            Route::Profile(_) => respond_error(rq, &Error::Recorder(RecorderError::ProfileInProgress)),
        }
    }
    !stop.load(Ordering::SeqCst)
}

/// A recorder this module started for one window, and its temporary spool
/// (removed on drop).
struct TempRecording {
    guard: Option<Guard>,
    path: PathBuf,
}

impl TempRecording {
    fn start() -> Result<TempRecording, Error> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "spulse-http-{}-{}-{}.spool",
            std::process::id(),
            now_us(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let guard = Recorder::builder().start(&path)?;
        Ok(TempRecording { guard: Some(guard), path })
    }

    /// Stop the recorder: every sample it took is in the spool afterwards.
    fn finish(&mut self) -> Result<(), Error> {
        match self.guard.take() {
            Some(g) => g.finish().map(|_| ()),
            None => Ok(()),
        }
    }
}

impl Drop for TempRecording {
    fn drop(&mut self) {
        drop(self.guard.take());
        let _ = std::fs::remove_file(&self.path);
    }
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// The samples of one window, counted per (thread, stack), and the spool
/// definitions they refer to.
struct Collected {
    tail: Tail,
    window: Window,
    contexts: Vec<Context>,
    by_thread: HashMap<ThreadId, usize>,
    counts: HashMap<(usize, StackId), u64>,
    /// `counts` sorted by (context, stack), built when the window closes.
    sorted: Vec<(usize, StackId, u64)>,
}

impl Counts for Collected {
    fn contexts(&self) -> &[Context] {
        &self.contexts
    }
    fn iter(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        self.sorted.iter().copied()
    }
}

impl Collected {
    fn count(&mut self, samples: &[Sample]) {
        let end_us = self.window.start_us + self.window.duration_us;
        for s in samples.iter().filter(|s| s.time_us >= self.window.start_us && s.time_us < end_us) {
            let c = match self.by_thread.get(&s.thread) {
                Some(&c) => c,
                None => {
                    let pid = self.tail.thread(s.thread).pid;
                    // Perf-map names of anonymous code are trusted unless the
                    // spool marks Python-runtime intervals for the process
                    // (CPython's trampolines are unmapped and reused outside
                    // them); the endpoint does not track the intervals.
                    let perf_map_allowed = !self.tail.python_runtime_events().iter().any(|e| e.pid == pid);
                    let c = self.contexts.len();
                    self.contexts.push(Context { thread: Some(s.thread), pid, perf_map_allowed });
                    self.by_thread.insert(s.thread, c);
                    c
                }
            };
            *self.counts.entry((c, s.stack)).or_insert(0) += 1;
        }
    }

    fn encode(&self, sym: &mut Symbolizer) -> Result<Vec<u8>, Error> {
        sym.next_spool();
        let mut out = Vec::new();
        let comment =
            format!("spulse {PROFILE_PATH}?seconds={}", self.window.duration_us.div_ceil(1_000_000));
        crate::pprof::write(self.tail.definitions(), self, self.window, sym, &comment, &mut out)
            .map_err(|e| Error::io(None, e))?;
        Ok(out)
    }
}

/// Count the samples of the next `duration`, from the running recorder's
/// spool or from a temporary recording. `wait` is called between polls of
/// the spool (it waits about [`POLL`]); when it returns false the window is
/// abandoned.
fn collect(duration: Duration, wait: &mut dyn FnMut() -> bool) -> Result<Collected, Error> {
    let abandoned =
        || Error::io(None, io::Error::new(io::ErrorKind::Interrupted, "profile abandoned: server stopping"));
    let (path, flush, mut temp) = match crate::recorder::live_spool() {
        Some((path, flush)) => (path, flush, None),
        None => {
            let t = TempRecording::start()?;
            (t.path.clone(), Duration::ZERO, Some(t))
        }
    };
    let mut tail = Tail::open(&path)?;
    // Everything in the spool so far precedes the window: read it for the
    // definitions its samples may refer to.
    while !tail.poll()?.is_empty() {}
    let start = Instant::now();
    let window = Window { start_us: now_us(), duration_us: duration.as_micros() as u64 };
    let mut c = Collected {
        tail,
        window,
        contexts: Vec::new(),
        by_thread: HashMap::new(),
        counts: HashMap::new(),
        sorted: Vec::new(),
    };
    let mut batch: Vec<Sample> = Vec::new();
    let mut poll = |c: &mut Collected| -> Result<bool, Error> {
        batch.clear();
        batch.extend_from_slice(c.tail.poll()?);
        c.count(&batch);
        Ok(!batch.is_empty())
    };
    while start.elapsed() < duration {
        poll(&mut c)?;
        if !wait() {
            return Err(abandoned());
        }
    }
    match &mut temp {
        Some(t) => {
            // The recorder stops: every sample it took is in the spool.
            t.finish()?;
            while poll(&mut c)? {}
        }
        None => {
            // A sample taken before the window closed reaches the spool
            // within one flush interval of the running recorder.
            let drained = Instant::now() + flush * 2 + POLL;
            loop {
                while poll(&mut c)? {}
                if Instant::now() >= drained {
                    break;
                }
                if !wait() {
                    return Err(abandoned());
                }
            }
        }
    }
    drop(temp);
    let mut sorted: Vec<_> = c.counts.iter().map(|(&(ctx, s), &n)| (ctx, s, n)).collect();
    sorted.sort_unstable_by_key(|&(ctx, s, _)| (ctx, s.index()));
    c.sorted = sorted;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(url: &str) -> (u16, String) {
        match route(&tiny_http::Method::Get, url) {
            Route::Refuse(status, text) => (status, text),
            Route::Profile(n) => panic!("{url}: a profile of {n} s, expected a refusal"),
        }
    }

    fn seconds(url: &str) -> u64 {
        match route(&tiny_http::Method::Get, url) {
            Route::Profile(n) => n,
            Route::Refuse(status, text) => panic!("{url}: refused {status}: {text}"),
        }
    }

    #[test]
    fn routes_the_profile_path_and_its_seconds() {
        assert_eq!(seconds("/debug/pprof/profile"), DEFAULT_SECONDS);
        assert_eq!(seconds("/debug/pprof/profile?seconds=3"), 3);
        assert_eq!(seconds("/debug/pprof/profile?debug=0&seconds=300"), 300);
        assert_eq!(seconds("/debug/pprof/profile?seconds=1"), 1);
        for bad in ["0", "301", "-1", "", "abc", "3.5", "99999999999999999999999"] {
            let (status, text) = refused(&format!("/debug/pprof/profile?seconds={bad}"));
            assert_eq!(status, 400, "seconds={bad}");
            assert!(text.contains("seconds") && text.contains("1..=300"), "{text}");
        }
        assert_eq!(refused("/debug/pprof/heap").0, 404);
        assert_eq!(refused("/").0, 404);
        assert_eq!(refused("/debug/pprof/profile/x?seconds=3").0, 404);
        match route(&tiny_http::Method::Post, "/debug/pprof/profile") {
            Route::Refuse(status, _) => assert_eq!(status, 405),
            Route::Profile(_) => panic!("POST answered with a profile"),
        }
    }

    #[test]
    fn bad_seconds_text_is_escaped_and_cut() {
        let long = "\u{1b}[31m".repeat(100);
        let (_, text) = refused(&format!("/debug/pprof/profile?seconds={long}"));
        assert!(!text.contains('\u{1b}'), "control characters are escaped: {text:?}");
        assert!(text.len() < 1024, "the echoed value is cut: {} bytes", text.len());
    }

    #[test]
    fn profile_rejects_zero_and_too_long_windows() {
        for d in [Duration::ZERO, Duration::from_secs(MAX_SECONDS + 1)] {
            match profile(d) {
                Err(Error::Recorder(RecorderError::InvalidConfig { setting: "seconds", .. })) => {}
                other => panic!("{d:?}: {other:?}"),
            }
        }
    }
}
