//! Measures `Replay`'s memory on a large spool (BENCHMARKS.md, "Spool format").
//!
//! ```text
//! cargo run --release --example spool_rss -- write /tmp/big.spool 100000000
//! /usr/bin/time -v target/release/examples/spool_rss replay /tmp/big.spool
//! ```
//!
//! `write` streams a profile-shaped spool (the generator of `benches/spool.rs`)
//! to a file without holding it in memory; `replay` opens it with `Replay`
//! (validating every record), scans every sample and prints the count, the
//! index size and the time taken. Peak RSS comes from `/usr/bin/time -v`.

#[path = "../benches/spool_profile/mod.rs"]
mod spool_profile;

use std::time::Instant;

fn main() -> Result<(), spulse::Error> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("write") if args.len() == 4 => {
            let n: u64 = args[3].parse().expect("sample count");
            let file = std::fs::File::create(&args[2])?;
            let header = spulse::Header {
                start_time_us: spool_profile::START_US,
                interval_us: 1000,
                engine: spulse::Engine::ThreadCpuTimer,
            };
            let mut w = spulse::SpoolWriter::new(file, header)?;
            let mut g = spool_profile::Generator::new(&mut w, 1);
            g.write(&mut w, n);
            let len = w.len();
            w.into_inner()?;
            println!("wrote {n} samples, {len} bytes ({:.2} bytes/sample)", len as f64 / n as f64);
        }
        Some("replay") if args.len() == 3 => {
            let t = Instant::now();
            let replay = spulse::Replay::open(&args[2])?;
            let opened = t.elapsed();
            let mut n = 0u64;
            for s in replay.samples() {
                s?;
                n += 1;
            }
            let total = t.elapsed();
            println!(
                "{n} samples; open (validate) {:.2} s, scan {:.2} s ({:.0} M samples/s); index {} entries x {} \
                 samples; {} stack nodes",
                opened.as_secs_f64(),
                (total - opened).as_secs_f64(),
                n as f64 / (total - opened).as_secs_f64() / 1e6,
                replay.index_len(),
                replay.index_stride(),
                replay.stack_count(),
            );
        }
        Some("snapshot") if args.len() == 3 => {
            let bytes = std::fs::read(&args[2])?;
            let t = Instant::now();
            let mut n = 0;
            for _ in 0..5 {
                n = spulse::Snapshot::from_bytes(&bytes)?.len();
            }
            let dt = t.elapsed().as_secs_f64() / 5.0;
            println!(
                "{n} samples; Snapshot::from_bytes {:.3} s ({:.0} M samples/s)",
                dt,
                n as f64 / dt / 1e6
            );
        }
        _ => {
            eprintln!(
                "usage: spool_rss write PATH SAMPLES | spool_rss replay PATH | spool_rss snapshot PATH"
            );
            std::process::exit(2);
        }
    }
    Ok(())
}
