//! A pprof HTTP endpoint (cargo feature `http`, off by default).
//!
//! [`serve`] answers `GET /debug/pprof/profile?seconds=N` with a gzipped
//! pprof `Profile` of this process's CPU samples over the next `N` seconds
//! (default [`DEFAULT_SECONDS`], at most [`MAX_SECONDS`]): what
//! `go tool pprof http://HOST/debug/pprof/profile?seconds=N`, Parca and
//! Grafana Pyroscope's scrapers fetch. `GET /debug/pprof/wall?seconds=N`
//! ([`WALL_PATH`]) adds off-CPU time as a third sample type, `off-cpu` in
//! nanoseconds (where threads waited; see [`WALL_PATH`] for when it is
//! there). [`profile`] returns the CPU profile's bytes, to
//! mount on a router of your own. The profile is the one `spulse export
//! --format pprof` writes for that window (both go through [`crate::pprof`]):
//! one sample per (thread, stack) labelled `pid`, `tid` and `thread`, values
//! `samples/count` and `cpu/nanoseconds`, functions with file and line where
//! the binaries have debug info, and the executable's and libraries'
//! mappings with their build ids, so that a server can re-symbolize.
//!
//! With the `heap` feature too, `GET /debug/pprof/heap` answers with
//! [`crate::heap::profile`] (made on the connection's thread; query
//! parameters are ignored): what `go tool pprof http://HOST/debug/pprof/heap`
//! fetches.
//!
//! Answers: `200` with the profile; `400` for a `seconds` that is not a
//! whole number (digits only) in `1..=MAX_SECONDS`, for a `GET` that
//! declares a body, or for a malformed request; `404` for any other path;
//! `405` with `Allow: GET` for a method other than `GET`; `408` for a request
//! head not complete within [`HEAD_TIMEOUT`]; `409` with `Retry-After` (the
//! seconds until the current window ends, plus one) while another profile is
//! being collected in the process (one window at a time, whoever asked: the
//! server or [`profile`]); `414`/`431` for a request line or head longer
//! than [`MAX_HEAD_BYTES`]; `503` with `Retry-After: 1` when
//! [`MAX_CONNECTIONS`] connections are open already; `500` with the error's
//! text when the profile could not be made (no engine may sample, say).
//!
//! # The server, and exposing it
//!
//! The server is small and std-only: blocking sockets with timeouts, no
//! async runtime, [`httparse`] for the request head. It is built to stay up
//! whatever a client sends:
//! - one request per connection, every answer `Connection: close`;
//! - the request line and headers together are read into a fixed buffer of
//!   [`MAX_HEAD_BYTES`] (at most [`MAX_HEADERS`] headers) and must arrive
//!   within [`HEAD_TIMEOUT`] of the connection; a request body is never read
//!   (no path takes one): after the answer the server discards at most
//!   64 KiB for at most 0.25 s, so that the answer is not lost to a reset,
//!   and closes;
//! - an answer that the client does not read within [`WRITE_TIMEOUT`] is
//!   given up;
//! - at most [`MAX_CONNECTIONS`] connections are served at once (a thread
//!   each, started on demand and kept); more are answered `503` at once by
//!   the accepting thread, which never reads or waits on a client;
//! - a profile window runs on a thread of its own, and is cancelled as soon
//!   as its client closes the connection (or shuts down its sending side):
//!   the next request gets a window at once instead of `409`.
//!
//! The endpoint has no authentication and a profile shows the names of the
//! program's functions and files: bind it to a loopback address (as the
//! examples do) and, to reach it from elsewhere, put it behind a reverse
//! proxy or tunnel that authenticates. The limits above keep hostile or
//! broken clients from taking the process down or making it hoard memory,
//! but anyone who can connect can keep a window running (one at a time) or
//! hold the connections (each for at most [`HEAD_TIMEOUT`]).
//!
//! # Where the samples come from
//!
//! - If a recorder runs in this process ([`crate::start`],
//!   [`crate::RecorderBuilder::start`]), the window is cut from its live
//!   spool: a [`crate::Tail`] reads the spool to its current end (the
//!   definitions the window's samples refer to), then counts the samples
//!   timed inside the window as they are flushed. No second set of signals;
//!   the recorder's settings (frequency, depth) apply. For a rotating
//!   recording ([`crate::RecorderBuilder::rotate`]) the window is cut from
//!   the segment current when the request arrives, so the samples after a
//!   rotation inside the window are missing from that profile.
//! - If `libspulse_preload.so` records the process (`LD_PRELOAD`,
//!   `spulse record`), the window is cut from that recording's spool in the
//!   same way (the library says where it writes).
//! - Otherwise a recorder with the default settings (the `SPULSE_*`
//!   environment variables do not apply to it) records the window into a
//!   temporary spool in [`std::env::temp_dir`], which is removed after.
//!   While it runs, starting another recorder in the process fails with
//!   [`RecorderError::AlreadyRunning`].
//!
//! Symbolization runs in process, on the thread that makes the profile (the
//! server's window thread for [`serve`]), after the window closes, with the
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
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::pprof::{Counts, Window};
use crate::symbolize::{Context, Options, Symbolizer};
use crate::{Error, Guard, Recorder, RecorderError, Sample, StackId, Tail, ThreadId};

/// The path the server answers.
pub const PROFILE_PATH: &str = "/debug/pprof/profile";

/// The wall-clock profile's path: CPU samples and off-CPU time (where threads
/// waited, `RecorderBuilder::off_cpu`), with a third pprof sample type,
/// `off-cpu` in nanoseconds, as fgprof gives. Off-CPU time is there when the
/// running recorder records it, or when no recorder runs (the window's own
/// temporary recording turns the mode on).
pub const WALL_PATH: &str = "/debug/pprof/wall";

/// The window when a request gives no `seconds`.
pub const DEFAULT_SECONDS: u64 = 30;

/// The longest window a request may ask for.
pub const MAX_SECONDS: u64 = 300;

/// The most bytes of a request's line and headers together.
pub const MAX_HEAD_BYTES: usize = 8 * 1024;

/// The most headers of a request.
pub const MAX_HEADERS: usize = 32;

/// The most connections served at once (one of them may be a profile
/// window); more are answered `503` at once.
pub const MAX_CONNECTIONS: usize = 8;

/// How long a client has, from connecting, to send its request line and
/// headers; then it gets `408` and the connection is closed.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// How long an answer may take to be written (a client that does not read
/// it is given up).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the collecting thread waits between polls of the spool (and how
/// often the server's threads check whether to stop).
const POLL: Duration = Duration::from_millis(50);

/// After an answer, what the server discards of what the client still sends
/// (an unread body) before closing: closing a socket with unread data resets
/// the connection, which can destroy the answer before the client reads it.
const LINGER: Duration = Duration::from_millis(250);
const LINGER_BYTES: usize = 64 * 1024;

/// Set while a profile window is being collected in this process.
static COLLECTING: AtomicBool = AtomicBool::new(false);

/// When the window being collected ends (milliseconds since the Unix epoch),
/// for `409`'s `Retry-After`.
static WINDOW_END_MS: AtomicU64 = AtomicU64::new(0);

/// The right to collect the one window of the process; released on drop.
struct Collecting;

impl Collecting {
    fn take(duration: Duration) -> Result<Collecting, Error> {
        COLLECTING
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .map(|_| {
                WINDOW_END_MS.store(now_us() / 1000 + duration.as_millis() as u64, Ordering::SeqCst);
                Collecting
            })
            .map_err(|_| Error::Recorder(RecorderError::ProfileInProgress))
    }
}

impl Drop for Collecting {
    fn drop(&mut self) {
        COLLECTING.store(false, Ordering::SeqCst);
    }
}

/// `Retry-After` for a `409`: the whole seconds until the current window
/// ends, plus one for making its profile.
fn retry_after() -> u64 {
    let left_ms = WINDOW_END_MS.load(Ordering::SeqCst).saturating_sub(now_us() / 1000);
    left_ms.div_ceil(1000) + 1
}

/// A running pprof endpoint. Dropping it stops the server: the listening
/// socket is closed, connections being read or answered are dropped, a
/// window being collected is abandoned (its temporary spool removed), and
/// `drop` returns when every server thread has ended (each checks every
/// 50 ms or so; an answer being written to a client is given up).
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<Vec<JoinHandle<()>>>>,
    windows: Option<JoinHandle<()>>,
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
        self.shared.stop.store(true, Ordering::SeqCst);
        // Each thread checks `stop` at least every POLL; a panic in one has
        // already been reported by the panic hook. The acceptor hands back
        // the connection threads it started; when they end, the last sender
        // of window jobs is gone and the window thread ends too.
        if let Some(t) = self.acceptor.take() {
            if let Ok(workers) = t.join() {
                for w in workers {
                    let _ = w.join();
                }
            }
        }
        if let Some(t) = self.windows.take() {
            let _ = t.join();
        }
    }
}

/// What the server's threads share.
#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    /// Connections open (being read, answered, or collecting a window).
    open: AtomicUsize,
    /// Connection threads holding or about to get a connection.
    working: AtomicUsize,
}

/// One of the [`MAX_CONNECTIONS`] connection slots; freed on drop.
struct Slot(Arc<Shared>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A profile request handed to the window thread.
struct Job {
    stream: TcpStream,
    _slot: Slot,
    collecting: Collecting,
    seconds: u64,
    wall: bool,
}

/// Listen on `addr` and answer `GET /debug/pprof/profile?seconds=N` (see
/// the [module documentation](self)): a thread named `spulse-http` accepts
/// connections, threads named `spulse-http-c` (at most [`MAX_CONNECTIONS`],
/// started on demand) read and answer them, and one named `spulse-http-w`
/// collects and symbolizes the profile windows.
///
/// ```no_run
/// let server = spulse::http::serve("127.0.0.1:6060")?;
/// println!("go tool pprof http://{}/debug/pprof/profile?seconds=30", server.local_addr());
/// # Ok::<(), spulse::Error>(())
/// ```
pub fn serve(addr: impl ToSocketAddrs) -> Result<Server, Error> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(|e| Error::io(None, e))?.collect();
    let listener = TcpListener::bind(&addrs[..]).map_err(|e| {
        Error::io(
            None,
            io::Error::new(e.kind(), format!("spulse::http::serve: cannot listen on {addrs:?}: {e}")),
        )
    })?;
    let bound = listener.local_addr().map_err(|e| Error::io(None, e))?;
    listener.set_nonblocking(true).map_err(|e| Error::io(None, e))?;
    let shared = Arc::new(Shared {
        stop: AtomicBool::new(false),
        open: AtomicUsize::new(0),
        working: AtomicUsize::new(0),
    });
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let windows = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("spulse-http-w".into())
            .spawn(move || windows(&jobs_rx, &shared))
            .map_err(|e| Error::io(None, e))?
    };
    let acceptor = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("spulse-http".into())
            .spawn(move || accept(&listener, &shared, jobs_tx))
    };
    let acceptor = match acceptor {
        Ok(t) => t,
        Err(e) => {
            // The job sender went with the failed spawn: the window thread ends.
            let _ = windows.join();
            return Err(Error::io(None, e));
        }
    };
    Ok(Server { addr: bound, shared, acceptor: Some(acceptor), windows: Some(windows) })
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
    let _collecting = Collecting::take(duration)?;
    let window = collect(duration, false, &mut || {
        std::thread::sleep(POLL);
        Ok(())
    })?;
    SYMBOLIZER.with(|s| {
        let mut s = s.borrow_mut();
        let sym = s.get_or_insert_with(|| Symbolizer::new(Options::default()));
        window.encode(sym)
    })
}

// ---------------------------------------------------------------------------
// Requests and answers.

/// What a request asks for.
#[derive(Debug, PartialEq)]
enum Route {
    /// A profile of this many seconds; wall-clock (`WALL_PATH`) or CPU.
    Profile(u64, bool),
    /// The heap profile (`spulse::heap`).
    #[cfg(feature = "heap")]
    Heap,
    /// An answer without a profile.
    Refuse(Refusal),
}

/// An answer without a profile: status, text, and an extra header.
#[derive(Debug, PartialEq)]
struct Refusal {
    status: u16,
    text: String,
    header: Option<(&'static str, String)>,
}

fn refuse(status: u16, text: String) -> Refusal {
    Refusal { status, text, header: None }
}

/// The request head, as much as the routes need.
struct Head {
    method: String,
    target: String,
    /// It declares a body (a non-zero `Content-Length`, or `Transfer-Encoding`).
    body: bool,
}

fn route(head: &Head) -> Route {
    let (path, query) = head.target.split_once('?').unwrap_or((&head.target, ""));
    #[cfg(feature = "heap")]
    if path == crate::heap::HEAP_PATH {
        return heap_route(head);
    }
    let wall = path == WALL_PATH;
    if path != PROFILE_PATH && !wall {
        return Route::Refuse(refuse(
            404,
            format!("not found: {} (the pprof endpoint is {PROFILE_PATH}?seconds=N)\n", shown(path)),
        ));
    }
    if head.method != "GET" {
        return Route::Refuse(Refusal {
            status: 405,
            text: format!("method {} not allowed: {PROFILE_PATH} answers GET\n", shown(&head.method)),
            header: Some(("Allow", "GET".into())),
        });
    }
    if head.body {
        return Route::Refuse(refuse(400, format!("a GET of {PROFILE_PATH} takes no request body\n")));
    }
    let mut seconds = None;
    for (key, value) in
        query.split('&').filter(|p| !p.is_empty()).map(|p| p.split_once('=').unwrap_or((p, "")))
    {
        if key != "seconds" {
            continue;
        }
        if seconds.is_some() {
            return Route::Refuse(refuse(400, "seconds is given more than once\n".into()));
        }
        // Digits only: no sign, no spaces, no fraction.
        let n = Some(value)
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|n| (1..=MAX_SECONDS).contains(n));
        match n {
            Some(n) => seconds = Some(n),
            None => {
                return Route::Refuse(refuse(
                    400,
                    format!(
                        "bad seconds=\"{}\": expected a whole number of seconds in 1..={MAX_SECONDS}\n",
                        shown(value)
                    ),
                ));
            }
        }
    }
    Route::Profile(seconds.unwrap_or(DEFAULT_SECONDS), wall)
}

/// `GET /debug/pprof/heap` (query parameters, such as Go's `gc=1`, are
/// ignored): the heap profile, made on the connection's thread.
#[cfg(feature = "heap")]
fn heap_route(head: &Head) -> Route {
    use crate::heap::HEAP_PATH;
    if head.method != "GET" {
        return Route::Refuse(Refusal {
            status: 405,
            text: format!("method {} not allowed: {HEAP_PATH} answers GET\n", shown(&head.method)),
            header: Some(("Allow", "GET".into())),
        });
    }
    if head.body {
        return Route::Refuse(refuse(400, format!("a GET of {HEAP_PATH} takes no request body\n")));
    }
    Route::Heap
}

/// Request text as echoed in an answer: escaped, at most 64 characters.
fn shown(text: &str) -> String {
    text.chars().take(64).flat_map(char::escape_default).collect()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        414 => "URI Too Long",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// An answer's bytes: status line, headers (`Connection: close` always),
/// body (left out for a `HEAD` request).
fn answer(status: u16, headers: &[(&str, &str)], body: &[u8], head_only: bool) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} {}\r\n", reason(status)).into_bytes();
    for (k, v) in headers {
        out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(format!("Content-Length: {}\r\nConnection: close\r\n\r\n", body.len()).as_bytes());
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

fn text_answer(r: &Refusal, head_only: bool) -> Vec<u8> {
    let mut headers = vec![("Content-Type", "text/plain; charset=utf-8")];
    if let Some((k, v)) = &r.header {
        headers.push((k, v.as_str()));
    }
    answer(r.status, &headers, r.text.as_bytes(), head_only)
}

fn error_refusal(e: &Error) -> Refusal {
    match e {
        Error::Recorder(RecorderError::ProfileInProgress) => Refusal {
            status: 409,
            text: format!("{e}\n"),
            header: Some(("Retry-After", retry_after().to_string())),
        },
        Error::Recorder(RecorderError::InvalidConfig { .. }) => refuse(400, format!("{e}\n")),
        _ => refuse(500, format!("{e}\n")),
    }
}

// ---------------------------------------------------------------------------
// Sockets.

/// Wait up to `timeout` for `events` on `fd` (retrying when a signal, such
/// as the profiler's own, interrupts the wait): the events that happened.
fn poll_fd(fd: i32, events: i16, timeout: Duration) -> i16 {
    let deadline = Instant::now() + timeout;
    loop {
        let mut pfd = libc::pollfd { fd, events, revents: 0 };
        let ms = deadline.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid, writable pollfd; `fd` is open for the whole call
        // (the caller borrows the socket it belongs to).
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n > 0 {
            return pfd.revents;
        }
        let interrupted = n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted;
        if !interrupted || Instant::now() >= deadline {
            return 0;
        }
    }
}

/// Whether the client closed the connection (or shut down its sending
/// side), waiting up to `timeout` for it.
fn client_gone(s: &TcpStream, timeout: Duration) -> bool {
    poll_fd(s.as_raw_fd(), libc::POLLRDHUP, timeout) & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted)
}

/// Write all of `bytes` within [`WRITE_TIMEOUT`]; false if the client did
/// not take them (or went away, or the server is stopping).
fn write_answer(s: &mut TcpStream, bytes: &[u8], stop: &AtomicBool) -> bool {
    let deadline = Instant::now() + WRITE_TIMEOUT;
    if s.set_write_timeout(Some(POLL)).is_err() {
        return false;
    }
    let mut done = 0;
    while done < bytes.len() {
        match s.write(&bytes[done..]) {
            Ok(0) => return false,
            Ok(n) => done += n,
            Err(e) if is_timeout(&e) => {
                if stop.load(Ordering::SeqCst) || Instant::now() >= deadline {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
    true
}

/// Answer and close: write `bytes`, shut the sending side, discard what the
/// client still sends for a moment (so the answer is not lost to a reset),
/// close.
fn answer_and_close(mut s: TcpStream, bytes: &[u8], stop: &AtomicBool) {
    if !write_answer(&mut s, bytes, stop) {
        return;
    }
    let _ = s.shutdown(Shutdown::Write);
    let deadline = Instant::now() + LINGER;
    let mut sink = [0u8; 4096];
    let mut discarded = 0;
    while discarded < LINGER_BYTES {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match s.read(&mut sink) {
            Ok(0) => break,
            Ok(n) => discarded += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

/// Read and parse the request head within [`HEAD_TIMEOUT`] of `accepted`,
/// into a buffer of [`MAX_HEAD_BYTES`]. `Err(None)`: the client went away
/// (or the server is stopping), nothing to answer.
fn read_head(s: &mut TcpStream, accepted: Instant, stop: &AtomicBool) -> Result<Head, Option<Refusal>> {
    let deadline = accepted + HEAD_TIMEOUT;
    let mut buf = [0u8; MAX_HEAD_BYTES];
    let mut len = 0;
    loop {
        if len > 0 {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&buf[..len]) {
                Ok(httparse::Status::Complete(_)) => {
                    let mut body = false;
                    for h in req.headers.iter() {
                        if h.name.eq_ignore_ascii_case("transfer-encoding") {
                            body = true;
                        } else if h.name.eq_ignore_ascii_case("content-length") {
                            let v = std::str::from_utf8(h.value).unwrap_or("").trim();
                            match v.parse::<u64>() {
                                Ok(n) if v.bytes().all(|b| b.is_ascii_digit()) => body |= n > 0,
                                _ => {
                                    return Err(Some(refuse(
                                        400,
                                        format!(
                                            "bad Content-Length \"{}\"\n",
                                            shown(&String::from_utf8_lossy(h.value))
                                        ),
                                    )))
                                }
                            }
                        }
                    }
                    return Ok(Head {
                        method: req.method.unwrap_or_default().to_string(),
                        target: req.path.unwrap_or_default().to_string(),
                        body,
                    });
                }
                Ok(httparse::Status::Partial) if len == buf.len() => {
                    return Err(Some(if buf.contains(&b'\n') {
                        refuse(431, format!("the request's line and headers exceed {MAX_HEAD_BYTES} bytes\n"))
                    } else {
                        refuse(414, format!("the request line exceeds {MAX_HEAD_BYTES} bytes\n"))
                    }));
                }
                Ok(httparse::Status::Partial) => {}
                Err(httparse::Error::TooManyHeaders) => {
                    return Err(Some(refuse(431, format!("more than {MAX_HEADERS} request headers\n"))));
                }
                Err(e) => return Err(Some(refuse(400, format!("malformed request: {e}\n")))),
            }
        }
        if stop.load(Ordering::SeqCst) {
            return Err(None);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Some(refuse(
                408,
                format!(
                    "the request's line and headers did not arrive within {} s\n",
                    HEAD_TIMEOUT.as_secs()
                ),
            )));
        }
        if s.set_read_timeout(Some(left.min(POLL))).is_err() {
            return Err(None);
        }
        match s.read(&mut buf[len..]) {
            Ok(0) => return Err(None),
            Ok(n) => len += n,
            Err(e) if is_timeout(&e) => {}
            Err(_) => return Err(None),
        }
    }
}

// ---------------------------------------------------------------------------
// Threads.

/// The accepting thread: hands each connection to an idle connection thread
/// (starting one if none is idle), or answers `503` when [`MAX_CONNECTIONS`]
/// are open. Returns the connection threads it started.
fn accept(listener: &TcpListener, shared: &Arc<Shared>, jobs: Sender<Job>) -> Vec<JoinHandle<()>> {
    let (conn_tx, conn_rx) = mpsc::channel::<(TcpStream, Slot, Instant)>();
    let conn_rx = Arc::new(Mutex::new(conn_rx));
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        poll_fd(listener.as_raw_fd(), libc::POLLIN, POLL);
        loop {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    // Out of descriptors, say: the connection waits in the
                    // backlog; try again later.
                    std::thread::sleep(POLL);
                    break;
                }
            };
            let accepted = Instant::now();
            if shared.open.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
                refuse_busy(stream);
                continue;
            }
            shared.open.fetch_add(1, Ordering::SeqCst);
            let slot = Slot(shared.clone());
            if shared.working.load(Ordering::SeqCst) >= workers.len() {
                let (rx, jobs, sh) = (conn_rx.clone(), jobs.clone(), shared.clone());
                match std::thread::Builder::new()
                    .name("spulse-http-c".into())
                    .spawn(move || connections(&rx, &jobs, &sh))
                {
                    Ok(t) => workers.push(t),
                    Err(_) => {
                        drop(slot);
                        refuse_busy(stream);
                        continue;
                    }
                }
            }
            shared.working.fetch_add(1, Ordering::SeqCst);
            if conn_tx.send((stream, slot, accepted)).is_err() {
                shared.working.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
    workers
}

/// `503` without waiting: one non-blocking write of a short answer into an
/// empty socket buffer, then close, after discarding what the request sent
/// already (at most 16 KiB, without waiting for more), so that the close
/// is less likely to reset the connection before the answer is read.
fn refuse_busy(mut s: TcpStream) {
    let r = refuse(503, format!("{MAX_CONNECTIONS} connections are being served; retry in a moment\n"));
    let r = Refusal { header: Some(("Retry-After", "1".into())), ..r };
    if s.set_nonblocking(true).is_err() {
        return;
    }
    let _ = s.write(&text_answer(&r, false));
    let _ = s.shutdown(Shutdown::Write);
    let mut sink = [0u8; 4096];
    for _ in 0..4 {
        if !matches!(s.read(&mut sink), Ok(n) if n > 0) {
            break;
        }
    }
}

/// A connection thread: reads each connection's head and answers it, or
/// hands a profile request to the window thread.
fn connections(rx: &Mutex<Receiver<(TcpStream, Slot, Instant)>>, jobs: &Sender<Job>, shared: &Shared) {
    loop {
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok((stream, slot, accepted)) = next else { return };
        serve_connection(stream, slot, accepted, jobs, shared);
        shared.working.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve_connection(mut s: TcpStream, slot: Slot, accepted: Instant, jobs: &Sender<Job>, shared: &Shared) {
    let stop = &shared.stop;
    if s.set_nonblocking(false).is_err() {
        return;
    }
    let _ = s.set_nodelay(true);
    let head = match read_head(&mut s, accepted, stop) {
        Ok(head) => head,
        Err(None) => return,
        Err(Some(r)) => return answer_and_close(s, &text_answer(&r, false), stop),
    };
    let head_only = head.method == "HEAD";
    let r = match route(&head) {
        Route::Refuse(r) => r,
        Route::Profile(seconds, wall) => match Collecting::take(Duration::from_secs(seconds)) {
            Ok(collecting) => {
                // The window thread answers; if it is gone, the server is stopping.
                let _ = jobs.send(Job { stream: s, _slot: slot, collecting, seconds, wall });
                return;
            }
            Err(e) => error_refusal(&e),
        },
        #[cfg(feature = "heap")]
        Route::Heap => {
            let bytes = match crate::heap::profile() {
                Ok(body) => answer(
                    200,
                    &[
                        ("Content-Type", "application/octet-stream"),
                        ("Content-Disposition", "attachment; filename=\"heap.pb.gz\""),
                    ],
                    &body,
                    false,
                ),
                Err(e) => text_answer(&error_refusal(&e), false),
            };
            return answer_and_close(s, &bytes, stop);
        }
    };
    answer_and_close(s, &text_answer(&r, head_only), stop);
}

/// The window thread: collects each profile window (cancelled when its
/// client goes away), symbolizes it with the server's one symbolizer, and
/// answers.
fn windows(jobs: &Receiver<Job>, shared: &Shared) {
    let mut sym = Symbolizer::new(Options::default());
    let stop = &shared.stop;
    while let Ok(Job { stream, _slot, collecting, seconds, wall }) = jobs.recv() {
        if stop.load(Ordering::SeqCst) {
            continue;
        }
        let mut abandoned = false;
        let made = collect(Duration::from_secs(seconds), wall, &mut || {
            if client_gone(&stream, POLL) {
                abandoned = true;
                Err("the client closed the connection")
            } else if stop.load(Ordering::SeqCst) {
                abandoned = true;
                Err("the server is stopping")
            } else {
                Ok(())
            }
        })
        .and_then(|window| window.encode(&mut sym));
        // The next window may start while this answer is written.
        drop(collecting);
        if abandoned {
            continue;
        }
        let bytes = match made {
            Ok(body) => answer(
                200,
                &[
                    ("Content-Type", "application/octet-stream"),
                    ("Content-Disposition", "attachment; filename=\"profile.pb.gz\""),
                ],
                &body,
                false,
            ),
            Err(e) => text_answer(&error_refusal(&e), false),
        };
        answer_and_close(stream, &bytes, stop);
    }
}

/// A recorder this module started for one window, and its temporary spool
/// (removed on drop).
struct TempRecording {
    guard: Option<Guard>,
    path: PathBuf,
}

impl TempRecording {
    fn start(off_cpu: bool) -> Result<TempRecording, Error> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "spulse-http-{}-{}-{}.spool",
            std::process::id(),
            now_us(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        // The recorder expands `{...}` templates: double any brace of the
        // directory. The process's SPULSE_* settings are for its own
        // recordings, not this one (SPULSE_OUTPUT would take its path).
        let mut template = Vec::new();
        for &b in path.as_os_str().as_bytes() {
            template.push(b);
            if b == b'{' || b == b'}' {
                template.push(b);
            }
        }
        let template = PathBuf::from(std::ffi::OsString::from_vec(template));
        let guard = Recorder::builder().without_environment().off_cpu(off_cpu).start(&template)?;
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
    /// For a wall-clock window: off-CPU microseconds per (context, stack),
    /// and sorted when the window closes.
    wall: bool,
    off: HashMap<(usize, StackId), u64>,
    sorted_off: Vec<(usize, StackId, u64)>,
}

impl Counts for Collected {
    fn contexts(&self) -> &[Context] {
        &self.contexts
    }
    fn iter(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        self.sorted.iter().copied()
    }
    fn off_cpu(&self) -> impl Iterator<Item = (usize, StackId, u64)> + '_ {
        self.sorted_off.iter().copied()
    }
}

impl Collected {
    fn count(&mut self, samples: &[Sample]) {
        let (start_us, end_us) = (self.window.start_us, self.window.start_us + self.window.duration_us);
        for s in samples.iter().filter(|s| s.time_us >= start_us && s.time_us < end_us) {
            let c = self.context(s.thread);
            *self.counts.entry((c, s.stack)).or_insert(0) += 1;
        }
        if self.wall {
            // The off-CPU intervals the last poll read, by their start; one
            // that began before the window counts the part inside it.
            let intervals: Vec<_> = self.tail.off_cpu().to_vec();
            for o in intervals {
                let from = o.start_us.max(self.window.start_us);
                let to = (o.start_us + o.duration_us).min(end_us);
                if to <= from {
                    continue;
                }
                let c = self.context(o.thread);
                *self.off.entry((c, o.stack)).or_insert(0) += to - from;
            }
        }
    }

    /// The context of `thread`, made on first use.
    fn context(&mut self, thread: ThreadId) -> usize {
        if let Some(&c) = self.by_thread.get(&thread) {
            return c;
        }
        let pid = self.tail.thread(thread).pid;
        // Perf-map names of anonymous code are trusted unless the spool marks
        // Python-runtime intervals for the process (CPython's trampolines are
        // unmapped and reused outside them); the endpoint does not track the
        // intervals.
        let perf_map_allowed = !self.tail.python_runtime_events().iter().any(|e| e.pid == pid);
        let c = self.contexts.len();
        self.contexts.push(Context { thread: Some(thread), pid, perf_map_allowed });
        self.by_thread.insert(thread, c);
        c
    }

    fn encode(&self, sym: &mut Symbolizer) -> Result<Vec<u8>, Error> {
        sym.next_spool();
        let mut out = Vec::new();
        let path = if self.wall { WALL_PATH } else { PROFILE_PATH };
        let comment = format!("spulse {path}?seconds={}", self.window.duration_us.div_ceil(1_000_000));
        crate::pprof::write(self.tail.definitions(), self, self.window, sym, &comment, &mut out)
            .map_err(|e| Error::io(None, e))?;
        Ok(out)
    }
}

/// Count the samples of the next `duration`, from the running recorder's
/// spool, the preload library's, or a temporary recording. `wait` is called
/// between polls of the spool (it waits about [`POLL`]); when it returns an
/// error (why) the window is abandoned.
fn collect(
    duration: Duration,
    wall: bool,
    wait: &mut dyn FnMut() -> Result<(), &'static str>,
) -> Result<Collected, Error> {
    let abandoned = |why: &str| {
        Error::io(None, io::Error::new(io::ErrorKind::Interrupted, format!("profile abandoned: {why}")))
    };
    let (path, flush, mut temp) = match crate::recorder::live_spool() {
        Some((path, flush)) => (path, flush, None),
        None => match crate::recorder::preload_live_spool() {
            Some(Ok((path, flush))) => (path, flush, None),
            Some(Err(why)) => return Err(Error::io(None, io::Error::other(why))),
            None => {
                let t = TempRecording::start(wall)?;
                (t.path.clone(), Duration::ZERO, Some(t))
            }
        },
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
        wall,
        off: HashMap::new(),
        sorted_off: Vec::new(),
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
        wait().map_err(abandoned)?;
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
                wait().map_err(abandoned)?;
            }
        }
    }
    drop(temp);
    let mut sorted: Vec<_> = c.counts.iter().map(|(&(ctx, s), &n)| (ctx, s, n)).collect();
    sorted.sort_unstable_by_key(|&(ctx, s, _)| (ctx, s.index()));
    c.sorted = sorted;
    let mut sorted: Vec<_> = c.off.iter().map(|(&(ctx, s), &n)| (ctx, s, n)).collect();
    sorted.sort_unstable_by_key(|&(ctx, s, _)| (ctx, s.index()));
    c.sorted_off = sorted;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(url: &str) -> Route {
        route(&Head { method: "GET".into(), target: url.into(), body: false })
    }

    fn refused(url: &str) -> (u16, String) {
        match get(url) {
            Route::Refuse(r) => (r.status, r.text),
            Route::Profile(n, _) => panic!("{url}: a profile of {n} s, expected a refusal"),
            #[cfg(feature = "heap")]
            Route::Heap => panic!("a heap profile"),
        }
    }

    fn seconds(url: &str) -> u64 {
        match get(url) {
            Route::Profile(n, _) => n,
            Route::Refuse(r) => panic!("{url}: refused {}: {}", r.status, r.text),
            #[cfg(feature = "heap")]
            Route::Heap => panic!("a heap profile"),
        }
    }

    #[test]
    fn routes_the_profile_path_and_its_seconds() {
        assert_eq!(seconds("/debug/pprof/profile"), DEFAULT_SECONDS);
        assert_eq!(get("/debug/pprof/wall?seconds=3"), Route::Profile(3, true));
        assert_eq!(get("/debug/pprof/profile?seconds=3"), Route::Profile(3, false));
        assert_eq!(refused("/debug/pprof/wall?seconds=0").0, 400);
        assert_eq!(seconds("/debug/pprof/profile?seconds=3"), 3);
        assert_eq!(seconds("/debug/pprof/profile?debug=0&seconds=300"), 300);
        assert_eq!(seconds("/debug/pprof/profile?seconds=1"), 1);
        assert_eq!(seconds("/debug/pprof/profile?seconds=007"), 7);
        for bad in
            ["0", "301", "-1", "+1", " 1", "1 ", "", "abc", "3.5", "1e1", "%31", "99999999999999999999999"]
        {
            let (status, text) = refused(&format!("/debug/pprof/profile?seconds={bad}"));
            assert_eq!(status, 400, "seconds={bad}");
            assert!(text.contains("seconds") && text.contains("1..=300"), "{text}");
        }
        assert_eq!(refused("/debug/pprof/profile?seconds=1&seconds=2").0, 400);
        #[cfg(not(feature = "heap"))]
        assert_eq!(refused("/debug/pprof/heap").0, 404);
        assert_eq!(refused("/").0, 404);
        assert_eq!(refused("/debug/pprof/profile/x?seconds=3").0, 404);
        for method in ["POST", "HEAD", "PUT"] {
            match route(&Head { method: method.into(), target: PROFILE_PATH.into(), body: false }) {
                Route::Refuse(r) => {
                    assert_eq!(r.status, 405);
                    assert_eq!(r.header, Some(("Allow", "GET".to_string())));
                }
                Route::Profile(..) => panic!("{method} answered with a profile"),
                #[cfg(feature = "heap")]
                Route::Heap => panic!("a heap profile"),
            }
        }
        match route(&Head { method: "GET".into(), target: PROFILE_PATH.into(), body: true }) {
            Route::Refuse(r) => assert_eq!(r.status, 400, "{}", r.text),
            Route::Profile(..) => panic!("a GET with a body answered with a profile"),
            #[cfg(feature = "heap")]
            Route::Heap => panic!("a heap profile"),
        }
    }

    #[cfg(feature = "heap")]
    #[test]
    fn routes_the_heap_path() {
        for url in ["/debug/pprof/heap", "/debug/pprof/heap?gc=1", "/debug/pprof/heap?debug=0"] {
            assert_eq!(get(url), Route::Heap, "{url}");
        }
        assert_eq!(refused("/debug/pprof/heap/x").0, 404);
        match route(&Head { method: "POST".into(), target: "/debug/pprof/heap".into(), body: false }) {
            Route::Refuse(r) => assert_eq!((r.status, r.header), (405, Some(("Allow", "GET".to_string())))),
            other => panic!("POST: {other:?}"),
        }
        match route(&Head { method: "GET".into(), target: "/debug/pprof/heap".into(), body: true }) {
            Route::Refuse(r) => assert_eq!(r.status, 400),
            other => panic!("GET with a body: {other:?}"),
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
    fn answers_close_and_head_has_no_body() {
        let r = Refusal { status: 405, text: "no\n".into(), header: Some(("Allow", "GET".into())) };
        let get = String::from_utf8(text_answer(&r, false)).unwrap();
        assert!(get.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"), "{get}");
        assert!(get.contains("\r\nAllow: GET\r\n") && get.contains("\r\nConnection: close\r\n"), "{get}");
        assert!(get.ends_with("Content-Length: 3\r\nConnection: close\r\n\r\nno\n"), "{get}");
        let head = String::from_utf8(text_answer(&r, true)).unwrap();
        assert!(head.ends_with("\r\n\r\n"), "{head}");
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
