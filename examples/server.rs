//! A service-shaped program serving spulse's pprof endpoint (cargo feature
//! `http`): two worker threads handle "requests", each spending three units
//! of work parsing for every unit rendering, so a CPU profile shows
//! `parse_requests` at about 75% and `render_responses` at about 25% of the
//! samples, whatever share of the CPU each thread gets.
//!
//! ```text
//! cargo run --release --features http --example server -- 127.0.0.1:6060
//! go tool pprof -top http://127.0.0.1:6060/debug/pprof/profile?seconds=10
//! ```
//!
//! It listens on 127.0.0.1 unless told otherwise: the endpoint has no
//! authentication (see `spulse::http`'s "The server, and exposing it" for
//! what it limits and how to put it behind a proxy).
//!
//! `tests/http.rs` runs this file's workers and endpoint, fetches the
//! profile with `go tool pprof`, and runs them in a child process against
//! hostile clients.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Work units spent in `parse_requests` per request.
pub const PARSE_UNITS: u64 = 3;
/// Work units spent in `render_responses` per request.
pub const RENDER_UNITS: u64 = 1;
/// Loop iterations in one unit of work (a few hundred microseconds).
const UNIT: u64 = 200_000;

/// Parse `units` units of requests (stands for real work: a hash loop the
/// optimizer cannot remove).
#[inline(never)]
pub fn parse_requests(units: u64, seed: u64) -> u64 {
    let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
    for i in 0..units * UNIT {
        h = black_box((h ^ i).wrapping_mul(0x0100_0000_01b3));
    }
    h
}

/// Render `units` units of responses: the same cost per unit as
/// `parse_requests` (other constants, so the two stay two functions).
#[inline(never)]
pub fn render_responses(units: u64, seed: u64) -> u64 {
    let mut h = seed ^ 0x9e37_79b9_7f4a_7c15;
    for i in 0..units * UNIT {
        h = black_box((h ^ i).wrapping_mul(0x2545_f491_4f6c_dd1d));
    }
    h
}

/// Start the two worker threads (`worker-1`, `worker-2`); they run until
/// `stop` is set and return how many requests they handled.
pub fn spawn_workers(stop: &Arc<AtomicBool>) -> Vec<JoinHandle<u64>> {
    (1..=2)
        .map(|n| {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("worker-{n}"))
                .spawn(move || {
                    let mut handled = 0u64;
                    let mut h = n;
                    while !stop.load(Ordering::Relaxed) {
                        h = parse_requests(PARSE_UNITS, h);
                        h = render_responses(RENDER_UNITS, h);
                        handled += 1;
                    }
                    black_box(h);
                    handled
                })
                .expect("spawn a worker thread")
        })
        .collect()
}

fn main() -> Result<(), spulse::Error> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:6060".to_string());
    // Dropping `server` would stop the endpoint; it lives as long as `main`.
    let server = spulse::http::serve(addr.as_str())?;
    eprintln!("serving: go tool pprof -top http://{}/debug/pprof/profile?seconds=10", server.local_addr());
    let stop = Arc::new(AtomicBool::new(false));
    for w in spawn_workers(&stop) {
        let _ = w.join();
    }
    Ok(())
}
