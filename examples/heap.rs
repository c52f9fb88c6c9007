//! A heap profile of this program: `Sampled<System>` as the global
//! allocator, a workload, and the profile written to `heap.pb.gz` (and, with
//! `--serve`, served at `http://127.0.0.1:6060/debug/pprof/heap` until
//! Ctrl-C; that needs the `http` feature). The workload runs under a CPU
//! recording with heap events (`heap.spool`), whose allocations over time
//! the Firefox export shows.
//!
//! ```text
//! cargo run --release --example heap --features heap,pprof
//! go tool pprof -sample_index=inuse_space -top heap.pb.gz
//! go tool pprof -sample_index=alloc_space -top heap.pb.gz
//! cargo run --release -p spulse-cli -- info heap.spool
//! cargo run --release -p spulse-cli -- export heap.spool -o heap.json  # open in profiler.firefox.com
//! ```

use std::alloc::System;
use std::collections::BTreeMap;
use std::hint::black_box;

use spulse::heap::Sampled;

#[global_allocator]
static ALLOC: Sampled<System> = Sampled::new(System);

/// Allocates and frees: shows in `alloc_space` only.
#[inline(never)]
fn churn_strings() {
    for i in 0..200_000 {
        black_box(format!("request {i} with a body of some length"));
    }
}

/// Keeps what it allocates: shows in `inuse_space` too.
#[inline(never)]
fn build_index() -> BTreeMap<u64, Vec<u8>> {
    let index = (0..20_000u64).map(|i| (i, vec![0u8; 1024 + (i % 7) as usize * 512])).collect();
    // (Not a tail call into `collect`: its frame stays on the stack, so the
    // tree's nodes are charged here as well as its values.)
    black_box(index)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let recording = spulse::Recorder::builder().heap_events(true).overwrite(true).start("heap.spool")?;
    churn_strings();
    let index = build_index();
    let stats = recording.finish()?;
    spulse::heap::write_profile("heap.pb.gz")?;
    if let Some(h) = stats.heap_events {
        println!("heap.spool written: {} heap events", h.written);
    }
    let s = spulse::heap::stats();
    println!(
        "heap.pb.gz written: {} samples, {} live sampled blocks ({} entries kept)",
        s.samples,
        s.live_blocks,
        index.len()
    );
    #[cfg(feature = "http")]
    if std::env::args().any(|a| a == "--serve") {
        let server = spulse::http::serve("127.0.0.1:6060")?;
        println!("serving http://{}/debug/pprof/heap (Ctrl-C to stop)", server.local_addr());
        loop {
            std::thread::park();
        }
    }
    drop(index);
    Ok(())
}
