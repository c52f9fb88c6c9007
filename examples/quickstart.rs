//! Quickstart: record a small multi-threaded workload with known hot functions,
//! then print where the time went and what to run next.
//!
//! ```text
//! cargo run --release --example quickstart [out.spool]
//! ```

use spulse_testkit::symbols as support;

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

#[inline(never)]
fn parse_records(rounds: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for i in 0..rounds {
        h = (h ^ black_box(i)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

#[inline(never)]
fn compress_block(rounds: u64) -> u64 {
    let mut x = 1u64;
    for i in 0..rounds {
        x = x.rotate_left(7) ^ black_box(i).wrapping_mul(31);
    }
    x
}

#[inline(never)]
fn ingest(deadline: Instant) -> u64 {
    let mut acc = 0;
    while Instant::now() < deadline {
        // Three times the iterations parsing as compressing.
        acc ^= parse_records(300_000);
        acc ^= compress_block(100_000);
    }
    acc
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = std::env::args().nth(1);
    let path = arg.clone().unwrap_or_else(|| "quickstart.spool".to_string());
    if arg.is_none() {
        // The default output is ours to replace; a path given explicitly must not exist.
        let _ = std::fs::remove_file(&path);
    }

    let guard = spulse::start(&path)?;
    let deadline = Instant::now() + Duration::from_millis(1500);
    let workers: Vec<_> = (0..3)
        .map(|i| std::thread::Builder::new().name(format!("worker-{i}")).spawn(move || ingest(deadline)))
        .collect::<Result<_, _>>()?;
    for w in workers {
        black_box(w.join().expect("worker"));
    }
    let stats = guard.finish()?;

    println!(
        "recorded {} samples ({} lost) with the {} engine in {:.2} s: {} bytes in {path}",
        stats.samples_written,
        stats.lost(),
        stats.engine,
        stats.duration.as_secs_f64(),
        stats.bytes
    );

    let snap = spulse::Snapshot::open(&path)?;
    let mut sym = support::Symbolizer::default();
    let mut names: HashMap<spulse::FrameId, String> = HashMap::new();
    let mut self_time: HashMap<String, u64> = HashMap::new();
    let mut threads: HashMap<String, u64> = HashMap::new();
    for s in snap.samples() {
        let leaf = snap.stack(s.stack).frame;
        let name = names.entry(leaf).or_insert_with(|| sym.name(&snap, leaf)).clone();
        *self_time.entry(name).or_default() += 1;
        *threads.entry(snap.thread(s.thread).name.clone()).or_default() += 1;
    }
    let total = snap.len().max(1) as f64;
    let mut top: Vec<_> = self_time.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    println!("\nwhere the CPU time went (self time, top 5):");
    for (name, n) in top.iter().take(5) {
        println!("  {:5.1}%  {name}", 100.0 * *n as f64 / total);
    }
    let mut th: Vec<_> = threads.into_iter().collect();
    th.sort();
    println!("\nsamples per thread:");
    for (name, n) in th {
        println!("  {n:6}  {name}");
    }
    println!("\nnext: cargo run --release -p spulse-cli -- top {path}");
    Ok(())
}
