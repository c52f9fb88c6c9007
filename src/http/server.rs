//! The server's threads: the acceptor, which bounds the connections open
//! at once to [`MAX_CONNECTIONS`] and never waits on a client; the
//! connection threads, which read each request and answer it or hand a
//! profile request on; the one window thread, which collects, symbolizes
//! and answers the profile windows; and (feature `heap`) the one heap
//! thread, which makes and answers the heap profiles one at a time with a
//! symbolizer of its own, kept between requests.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::connection::{answer_and_close, client_gone, poll_fd, read_head};
use super::routes::{answer, error_refusal, refuse, route, text_answer, Ask, Refusal, Route};
use super::window::collect;
use super::{Collecting, MAX_CONNECTIONS, POLL};
use crate::symbolize::{Options, Symbolizer};
use crate::Error;

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
    #[cfg(feature = "heap")]
    heaps: Option<JoinHandle<()>>,
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
        #[cfg(feature = "heap")]
        if let Some(t) = self.heaps.take() {
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

/// Where a connection thread hands the requests it does not answer itself.
#[derive(Clone)]
struct Jobs {
    windows: Sender<Job>,
    /// Heap profiles: made on one thread, whose symbolizer (the debug data
    /// of every module, tens of megabytes) is kept between requests. Made on
    /// each connection thread, each kept its own: eight requests at once
    /// held 455 MB, and a service that had answered a few bursts 711 MB.
    #[cfg(feature = "heap")]
    heaps: Sender<(TcpStream, Slot)>,
}

/// A profile request handed to the window thread.
struct Job {
    stream: TcpStream,
    _slot: Slot,
    collecting: Collecting,
    ask: Ask,
}

/// Listen on `addr` and answer `GET /debug/pprof/profile?seconds=N` (see
/// the [module documentation](crate::http)): a thread named `spulse-http` accepts
/// connections, threads named `spulse-http-c` (at most [`MAX_CONNECTIONS`],
/// started on demand) read and answer them, one named `spulse-http-w`
/// collects and symbolizes the profile windows, and (feature `heap`) one
/// named `spulse-http-h` makes the heap profiles.
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
    #[cfg(feature = "heap")]
    let (heap_tx, heap_rx) = mpsc::channel::<(TcpStream, Slot)>();
    #[cfg(feature = "heap")]
    let heaps = {
        let shared = shared.clone();
        crate::recorder::spawn_quiet(std::thread::Builder::new().name("spulse-http-h".into()), move || {
            heaps(&heap_rx, &shared)
        })
        .map_err(|e| Error::io(None, e))?
    };
    let jobs = Jobs {
        windows: jobs_tx,
        #[cfg(feature = "heap")]
        heaps: heap_tx,
    };
    let windows = {
        let shared = shared.clone();
        crate::recorder::spawn_quiet(std::thread::Builder::new().name("spulse-http-w".into()), move || {
            windows(&jobs_rx, &shared)
        })
        .map_err(|e| Error::io(None, e))?
    };
    let acceptor = {
        let shared = shared.clone();
        // Its connection threads inherit its mask.
        crate::recorder::spawn_quiet(std::thread::Builder::new().name("spulse-http".into()), move || {
            accept(&listener, &shared, jobs)
        })
    };
    let acceptor = match acceptor {
        Ok(t) => t,
        Err(e) => {
            // The job senders went with the failed spawn: the window and
            // heap threads end.
            let _ = windows.join();
            #[cfg(feature = "heap")]
            let _ = heaps.join();
            return Err(Error::io(None, e));
        }
    };
    Ok(Server {
        addr: bound,
        shared,
        acceptor: Some(acceptor),
        windows: Some(windows),
        #[cfg(feature = "heap")]
        heaps: Some(heaps),
    })
}

/// The accepting thread: hands each connection to an idle connection thread
/// (starting one if none is idle), or answers `503` when [`MAX_CONNECTIONS`]
/// are open. Returns the connection threads it started.
fn accept(listener: &TcpListener, shared: &Arc<Shared>, jobs: Jobs) -> Vec<JoinHandle<()>> {
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
                match crate::recorder::spawn_quiet(
                    std::thread::Builder::new().name("spulse-http-c".into()),
                    move || connections(&rx, &jobs, &sh),
                ) {
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
fn connections(rx: &Mutex<Receiver<(TcpStream, Slot, Instant)>>, jobs: &Jobs, shared: &Shared) {
    loop {
        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok((stream, slot, accepted)) = next else { return };
        serve_connection(stream, slot, accepted, jobs, shared);
        shared.working.fetch_sub(1, Ordering::SeqCst);
    }
}

fn serve_connection(mut s: TcpStream, slot: Slot, accepted: Instant, jobs: &Jobs, shared: &Shared) {
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
        Route::Profile(ask) => match Collecting::take(Duration::from_secs(ask.seconds)) {
            Ok(collecting) => {
                // The window thread answers; if it is gone, the server is stopping.
                let _ = jobs.windows.send(Job { stream: s, _slot: slot, collecting, ask });
                return;
            }
            Err(e) => error_refusal(&e),
        },
        #[cfg(feature = "heap")]
        Route::Heap => {
            // The heap thread answers; if it is gone, the server is stopping.
            let _ = jobs.heaps.send((s, slot));
            return;
        }
    };
    answer_and_close(s, &text_answer(&r, head_only), stop);
}

/// The heap thread: makes each heap profile with its one symbolizer and
/// answers it, one request at a time (the others wait in the channel, each
/// holding its connection slot).
#[cfg(feature = "heap")]
fn heaps(jobs: &Receiver<(TcpStream, Slot)>, shared: &Shared) {
    let mut sym = Symbolizer::new(Options::default());
    let stop = &shared.stop;
    while let Ok((stream, slot)) = jobs.recv() {
        if stop.load(Ordering::SeqCst) || client_gone(&stream, Duration::ZERO) {
            continue;
        }
        let bytes = profile_answer(crate::heap::profile_with(&mut sym), "heap.pb.gz");
        answer_and_close(stream, &bytes, stop);
        drop(slot);
    }
}

/// The window thread: collects each profile window (cancelled when its
/// client goes away), symbolizes it with the server's one symbolizer, and
/// answers.
fn windows(jobs: &Receiver<Job>, shared: &Shared) {
    let mut sym = Symbolizer::new(Options::default());
    let stop = &shared.stop;
    while let Ok(Job { stream, _slot, collecting, ask }) = jobs.recv() {
        if stop.load(Ordering::SeqCst) {
            continue;
        }
        let mut abandoned = false;
        let made = collect(Duration::from_secs(ask.seconds), ask.wall, ask.spread_blocked, &mut || {
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
        let bytes = profile_answer(made, "profile.pb.gz");
        answer_and_close(stream, &bytes, stop);
    }
}

/// The answer carrying a gzipped profile as the attachment `file`, or the
/// refusal its error makes.
fn profile_answer(made: Result<Vec<u8>, Error>, file: &str) -> Vec<u8> {
    match made {
        Ok(body) => {
            let disposition = format!("attachment; filename=\"{file}\"");
            answer(
                200,
                &[("Content-Type", "application/octet-stream"), ("Content-Disposition", &disposition)],
                &body,
                false,
            )
        }
        Err(e) => text_answer(&error_refusal(&e), false),
    }
}
