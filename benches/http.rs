//! The cost of serving a pprof profile over HTTP (`spulse::http`, cargo
//! feature `http`) on the server's threads (`spulse-http`, the acceptor;
//! `spulse-http-c`, connections; `spulse-http-w`, windows): their CPU time
//! (from `/proc/self/task/TID/schedstat`, summed) and their peak heap (a
//! counting allocator that counts those threads' allocations only), while
//! `examples/server.rs`'s two workers keep both cores busy.
//!
//! `cargo bench --bench http`: 30-second windows, for a process with no
//! recorder (the endpoint records each window into a temporary spool) and
//! with a recorder running (the window is cut from its live spool): the
//! first request (cold symbol tables) and three more (warm), each printed.
//! Under `cargo test` (no `--bench`): one 1-second window per case, checked
//! to decode as a profile with the workers' functions.
//! `SPULSE_BENCH_HTTP_SECONDS=N` sets another window length.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;

#[allow(dead_code)] // its `main` is the example's
#[path = "../examples/server.rs"]
mod server;

/// Counts the heap of the threads named `spulse-http*`.
struct ServerThreadHeap;

static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);
/// The whole process's live heap (every thread).
static PROCESS_LIVE: AtomicI64 = AtomicI64::new(0);

thread_local! {
    /// Whether this thread is a server thread (checked by name until it is).
    static IS_SERVER: Cell<bool> = const { Cell::new(false) };
}

fn on_server_thread() -> bool {
    if IS_SERVER.with(Cell::get) {
        return true;
    }
    let mut name = [0u8; 16];
    // SAFETY: PR_GET_NAME writes at most 16 bytes (NUL included) into `name`.
    let ok = unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) } == 0;
    let is = ok && name.starts_with(b"spulse-http");
    if is {
        IS_SERVER.with(|c| c.set(true));
    }
    is
}

fn count(delta: i64) {
    PROCESS_LIVE.fetch_add(delta, Ordering::Relaxed);
    if on_server_thread() {
        let now = LIVE.fetch_add(delta, Ordering::Relaxed) + delta;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counting touches only atomics and a const-initialized thread local (no
// allocation, no lock).
unsafe impl GlobalAlloc for ServerThreadHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as i64);
        // SAFETY: the caller's contract for `alloc` is passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as i64));
        // SAFETY: the caller's contract for `dealloc` is passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as i64 - layout.size() as i64);
        // SAFETY: the caller's contract for `realloc` is passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: ServerThreadHeap = ServerThreadHeap;

/// Nanoseconds each server thread (a task named `spulse-http*`) has run on
/// a CPU, by tid. Connection threads start on demand and stay, so a thread
/// missing from an earlier reading had run for 0 ns then.
fn server_cpu_ns() -> HashMap<u32, u64> {
    let mut out = HashMap::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap() {
        let e = e.unwrap();
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("spulse-http") {
            continue;
        }
        let tid: u32 = e.file_name().to_str().unwrap().parse().unwrap();
        if let Ok(s) = std::fs::read_to_string(e.path().join("schedstat")) {
            out.insert(tid, s.split_whitespace().next().unwrap().parse().unwrap());
        }
    }
    out
}

fn get(addr: SocketAddr, path: &str) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    raw[split + 4..].to_vec()
}

struct Measured {
    cpu: Duration,
    peak_heap: i64,
    wall: Duration,
    body: Vec<u8>,
}

fn serve_one(addr: SocketAddr, seconds: u64) -> Measured {
    let before_cpu = server_cpu_ns();
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let t = Instant::now();
    let body = get(addr, &format!("/debug/pprof/profile?seconds={seconds}"));
    let wall = t.elapsed();
    Measured {
        cpu: Duration::from_nanos(
            server_cpu_ns().iter().map(|(tid, ns)| ns - before_cpu.get(tid).copied().unwrap_or(0)).sum(),
        ),
        peak_heap: PEAK.load(Ordering::Relaxed) - base,
        wall,
        body,
    }
}

fn check(body: &[u8]) -> usize {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(body).read_to_end(&mut raw).unwrap();
    let p = spulse::pprof::proto::Profile::decode(&*raw).unwrap();
    assert!(p.string_table.iter().any(|s| s.ends_with("parse_requests")), "the workers' functions are named");
    p.sample.len()
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let (mut seconds, warm_runs) = if bench { (30, 3) } else { (1, 0) };
    // A shorter window for a quick look (`SPULSE_BENCH_HTTP_SECONDS=2 cargo bench --bench http`).
    if let Some(s) = std::env::var("SPULSE_BENCH_HTTP_SECONDS").ok().and_then(|s| s.parse().ok()) {
        seconds = s;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let workers = server::spawn_workers(&stop);
    let srv = spulse::http::serve("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut guard = None;
    for case in ["no recorder", "live recorder"] {
        if case == "live recorder" {
            guard = Some(spulse::start(dir.path().join("live.spool")).unwrap());
            // Some history for the Tail to read through before the window.
            std::thread::sleep(Duration::from_secs(if bench { 10 } else { 1 }));
        }
        for run in 0..=warm_runs {
            let m = serve_one(srv.local_addr(), seconds);
            let samples = check(&m.body);
            let when = if case == "no recorder" && run == 0 { "cold" } else { "warm" };
            println!(
                "http/{seconds}s/{case}/{when}: server threads' CPU {:.1} ms, peak heap {:.2} MiB, \
                 process heap after {:.2} MiB, wall {:.2} s, body {} KiB, {samples} pprof samples",
                m.cpu.as_secs_f64() * 1e3,
                m.peak_heap as f64 / (1 << 20) as f64,
                PROCESS_LIVE.load(Ordering::Relaxed) as f64 / (1 << 20) as f64,
                m.wall.as_secs_f64(),
                m.body.len() / 1024,
            );
        }
    }
    drop(guard);
    drop(srv);
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
}
