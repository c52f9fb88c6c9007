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
//! [`crate::heap::profile`] (made on the server's one heap thread, one
//! request at a time, with a symbolizer of its own kept between requests;
//! query parameters are ignored): what `go tool pprof
//! http://HOST/debug/pprof/heap` fetches.
//!
//! Answers: `200` with the profile; `400` for a `seconds` that is not a
//! whole number (digits only) in `1..=MAX_SECONDS`, for a `spread_blocked`
//! other than `0` or `1` or given to the CPU profile, for a `GET` that
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
//! kept between requests (the server keeps one symbolizer for its windows
//! and one for heap profiles; [`profile`] one per calling thread). Its heap is bounded by the debug data of the modules
//! sampled (the DWARF units and line tables looked up, each module's symbol
//! table) plus, per request, the spool's definitions and one count per
//! distinct (thread, stack) of the window. BENCHMARKS.md gives the measured
//! cost of a 30-second profile.

mod connection;
mod routes;
mod server;
mod window;

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::symbolize::{Options, Symbolizer};
use crate::{Error, RecorderError};

pub use server::{serve, Server};

/// The path the server answers.
pub const PROFILE_PATH: &str = "/debug/pprof/profile";

/// The wall-clock profile's path: CPU samples and off-CPU time (where threads
/// waited, `RecorderBuilder::off_cpu`), with a third pprof sample type,
/// `off-cpu` in nanoseconds, as fgprof gives. Off-CPU time is there when the
/// running recorder records it, or when no recorder runs (the window's own
/// temporary recording turns the mode on). A running recorder writes a wait
/// when its thread wakes: when the window closes it asks the recorder to
/// write the part up to the window's end of every wait still open, so a
/// thread blocked across the whole window counts the whole window. With
/// `spread_blocked=1` (`?seconds=N&spread_blocked=1`) each thread's blocked
/// time without a stack (`[blocked]`, `[blocked, under 5 ms]`) is charged to
/// the stacks of its waits with one in the window, in proportion
/// ([`crate::spread`]; the `--spread-blocked` of `spulse top`); `0`, the
/// default, leaves it as measured.
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
pub(crate) const POLL: Duration = Duration::from_millis(50);

/// After an answer, what the server discards of what the client still sends
/// (an unread body) before closing: closing a socket with unread data resets
/// the connection, which can destroy the answer before the client reads it.
pub(crate) const LINGER: Duration = Duration::from_millis(250);
pub(crate) const LINGER_BYTES: usize = 64 * 1024;

/// Set while a profile window is being collected in this process.
static COLLECTING: AtomicBool = AtomicBool::new(false);

/// When the window being collected ends (milliseconds since the Unix epoch),
/// for `409`'s `Retry-After`.
static WINDOW_END_MS: AtomicU64 = AtomicU64::new(0);

/// The right to collect the one window of the process; released on drop.
pub(crate) struct Collecting;

impl Collecting {
    pub(crate) fn take(duration: Duration) -> Result<Collecting, Error> {
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
pub(crate) fn retry_after() -> u64 {
    let left_ms = WINDOW_END_MS.load(Ordering::SeqCst).saturating_sub(now_us() / 1000);
    left_ms.div_ceil(1000) + 1
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
    let window = window::collect(duration, false, false, &mut || {
        std::thread::sleep(POLL);
        Ok(())
    })?;
    SYMBOLIZER.with(|s| {
        let mut s = s.borrow_mut();
        let sym = s.get_or_insert_with(|| Symbolizer::new(Options::default()));
        window.encode(sym)
    })
}

pub(crate) fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

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
