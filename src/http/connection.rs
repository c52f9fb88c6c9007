//! One connection's socket, bounded in time and bytes: waiting on it,
//! reading the request head into a fixed buffer within [`HEAD_TIMEOUT`],
//! writing an answer within [`WRITE_TIMEOUT`], and closing without losing
//! the answer to a reset.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::routes::{refuse, shown, Head, Refusal};
use super::{HEAD_TIMEOUT, LINGER, LINGER_BYTES, MAX_HEADERS, MAX_HEAD_BYTES, POLL, WRITE_TIMEOUT};

/// Wait up to `timeout` for `events` on `fd` (retrying when a signal, such
/// as the profiler's own, interrupts the wait): the events that happened.
pub(super) fn poll_fd(fd: i32, events: i16, timeout: Duration) -> i16 {
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
pub(super) fn client_gone(s: &TcpStream, timeout: Duration) -> bool {
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
pub(super) fn answer_and_close(mut s: TcpStream, bytes: &[u8], stop: &AtomicBool) {
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
pub(super) fn read_head(
    s: &mut TcpStream,
    accepted: Instant,
    stop: &AtomicBool,
) -> Result<Head, Option<Refusal>> {
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
