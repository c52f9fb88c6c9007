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
//! `snapshot` times `Snapshot::from_bytes` (wall, and the calling thread's CPU
//! time; with `SPULSE_ONE_THREAD` set, the one-thread load) and `json`
//! compares it with the serde_json parse of the same data (wall time: the
//! spool loads on two threads). `write PATH SAMPLES TICK_US` spaces the
//! generator's ticks `TICK_US` apart instead of 1 ms (10,000 gives a 5.8-hour
//! profile of 10 M samples). `pack SPOOL OUT` writes the packed file of a
//! spool, and `open PATH` opens a spool or packed file once with
//! `Snapshot::open` (for the peak RSS of that alone; `open PATH iterate`
//! then reads every sample); `compare SPOOL PACKED` times `Snapshot::open`
//! of each, the serde_json parse of the same samples into typed columns, and
//! `Snapshot::open` plus iterating every sample of each, in interleaved
//! rounds (median of 7, wall and process CPU time).

use spulse_testkit::profile as spool_profile;

use std::time::{Duration, Instant};

/// CPU time consumed by this thread: unlike wall time, it does not grow when
/// other processes compete for the machine's cores.
fn cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec and the clock id is a constant
    // the kernel supports; clock_gettime writes only into `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time consumed by the whole process (every thread).
fn process_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: as in `cpu_time`, with the process-wide clock.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn main() -> Result<(), spulse::Error> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("write") if args.len() == 4 || args.len() == 5 => {
            let n: u64 = args[3].parse().expect("sample count");
            let tick_us: u64 = args.get(4).map_or(1000, |t| t.parse().expect("tick in microseconds"));
            let file = std::fs::File::create(&args[2])?;
            let header = spulse::Header { start_time_us: spool_profile::START_US, interval_us: tick_us };
            let mut w = spulse::SpoolWriter::new(file, header)?;
            let mut g = spool_profile::Generator::new(&mut w, 1);
            g.tick_us = tick_us;
            g.write(&mut w, n);
            let len = w.len();
            w.into_inner()?;
            println!("wrote {n} samples, {len} bytes ({:.2} bytes/sample)", len as f64 / n as f64);
        }
        Some("replay") if args.len() == 3 => {
            let (t, c) = (Instant::now(), cpu_time());
            let replay = spulse::Replay::open(&args[2])?;
            let (opened, opened_cpu) = (t.elapsed(), cpu_time() - c);
            let mut best_cpu = Duration::MAX;
            let mut n = 0u64;
            for _ in 0..3 {
                let c = cpu_time();
                n = 0;
                for s in replay.samples() {
                    s?;
                    n += 1;
                }
                best_cpu = best_cpu.min(cpu_time() - c);
            }
            let rate = |d: Duration| n as f64 / d.as_secs_f64() / 1e6;
            println!(
                "{n} samples; open (validate) {:.2} s wall, {:.2} s CPU ({:.0} M samples/s); scan (best of 3) \
                 {:.3} s CPU ({:.0} M samples/s); index {} entries x {} samples; {} stack nodes",
                opened.as_secs_f64(),
                opened_cpu.as_secs_f64(),
                rate(opened_cpu),
                best_cpu.as_secs_f64(),
                rate(best_cpu),
                replay.index_len(),
                replay.index_stride(),
                replay.stack_count(),
            );
        }
        Some("snapshot") if args.len() == 3 => {
            let bytes = std::fs::read(&args[2])?;
            // Large spools load on two threads: this thread's CPU time is not
            // the whole cost, so wall time is shown too.
            let (mut best, mut best_wall) = (Duration::MAX, Duration::MAX);
            let mut n = 0;
            for _ in 0..5 {
                let (c, w) = (cpu_time(), Instant::now());
                n = match std::env::var("SPULSE_ONE_THREAD") {
                    Ok(_) => spulse::Snapshot::from_bytes_split(&bytes, usize::MAX)?.len(),
                    Err(_) => spulse::Snapshot::from_bytes(&bytes)?.len(),
                };
                best = best.min(cpu_time() - c);
                best_wall = best_wall.min(w.elapsed());
            }
            let (dt, wall) = (best.as_secs_f64(), best_wall.as_secs_f64());
            println!(
                "{n} samples; Snapshot::from_bytes best of 5: {wall:.3} s wall ({:.0} M samples/s), {dt:.3} s CPU \
                 of the calling thread",
                n as f64 / wall / 1e6
            );
        }
        Some("json") if args.len() == 3 => {
            // Loading the spool versus parsing the same data as JSON, in wall
            // time (the spool loads on two threads; the JSON parse on one).
            let bytes = std::fs::read(&args[2])?;
            let snap = spulse::Snapshot::from_bytes(&bytes)?;
            let json = spool_profile::to_json(&snap);
            drop(snap);
            let (mut spool_best, mut json_best) = (Duration::MAX, Duration::MAX);
            for _ in 0..3 {
                let t = Instant::now();
                let n = spulse::Snapshot::from_bytes(&bytes)?.len();
                spool_best = spool_best.min(t.elapsed());
                let t = Instant::now();
                let v: std::collections::HashMap<String, Vec<u64>> =
                    serde_json::from_slice(&json).expect("valid JSON");
                json_best = json_best.min(t.elapsed());
                assert_eq!(v["time"].len(), n);
            }
            // The same JSON parsed into generic values, as JSON.parse does.
            let mut value = Duration::MAX;
            for _ in 0..3 {
                let t = Instant::now();
                let v: serde_json::Value = serde_json::from_slice(&json).expect("valid JSON");
                value = value.min(t.elapsed());
                drop(v);
            }
            println!(
                "spool {} bytes loaded in {:.3} s; JSON {} bytes parsed into typed columns in {:.3} s ({:.1}x), \
                 into serde_json::Value in {:.3} s ({:.1}x) (wall, best of 3 each)",
                bytes.len(),
                spool_best.as_secs_f64(),
                json.len(),
                json_best.as_secs_f64(),
                json_best.as_secs_f64() / spool_best.as_secs_f64(),
                value.as_secs_f64(),
                value.as_secs_f64() / spool_best.as_secs_f64(),
            );
        }
        Some("pack") if args.len() == 4 => {
            let replay = spulse::Replay::open(&args[2])?;
            let out = std::io::BufWriter::new(std::fs::File::create(&args[3])?);
            let s = spulse::pack(&replay, out)?;
            println!(
                "packed {} samples into {} blocks, {} bytes ({:.3} of the spool's {})",
                s.samples,
                s.blocks,
                s.bytes,
                s.bytes as f64 / s.spool_bytes as f64,
                s.spool_bytes
            );
        }
        Some("compare") if args.len() == 4 => {
            // Interleaved rounds: Snapshot::open of the packed file, of the
            // spool, and serde_json parsing the same samples into typed
            // columns; wall times, median of the rounds.
            let (spool, packed) = (&args[2], &args[3]);
            let snap = spulse::Snapshot::open(spool)?;
            let json = spool_profile::columns_json(&snap);
            drop(snap);
            // Wall and process CPU time (all threads) of each load: on a
            // shared machine the wall time of the two-thread loads suffers
            // most from the other processes, the CPU time much less.
            // Then each snapshot opened and every sample iterated (a packed
            // file's samples are decoded on access, so opening alone does
            // not show the whole cost of reading them).
            const K: usize = 5;
            let mut t: [Vec<f64>; K] = Default::default();
            let mut cpu: [Vec<f64>; K] = Default::default();
            let timed =
                |k: usize, t: &mut [Vec<f64>; K], cpu: &mut [Vec<f64>; K], f: &mut dyn FnMut() -> usize| {
                    let (s, c) = (Instant::now(), process_cpu_time());
                    let n = f();
                    t[k].push(s.elapsed().as_secs_f64());
                    cpu[k].push((process_cpu_time() - c).as_secs_f64());
                    n
                };
            let open_iterate = |path: &str| {
                let snap = spulse::Snapshot::open(path).unwrap();
                let mut acc = 0u64;
                for s in snap.samples() {
                    acc = acc.wrapping_add(s.time_us ^ s.thread.get() as u64 ^ (s.stack.get() as u64) << 32);
                }
                std::hint::black_box(acc);
                snap.len()
            };
            for round in 0..7 {
                let a = timed(0, &mut t, &mut cpu, &mut || spulse::Snapshot::open(packed).unwrap().len());
                let b = timed(1, &mut t, &mut cpu, &mut || spulse::Snapshot::open(spool).unwrap().len());
                let c = timed(2, &mut t, &mut cpu, &mut || {
                    let v: (Vec<u64>, Vec<u32>, Vec<u32>) =
                        serde_json::from_slice(&json).expect("valid JSON");
                    v.0.len()
                });
                let d = timed(3, &mut t, &mut cpu, &mut || open_iterate(packed));
                let e = timed(4, &mut t, &mut cpu, &mut || open_iterate(spool));
                assert!(a == b && b == c && c == d && d == e);
                println!(
                    "round {round}: packed {:.1} ms ({:.1} CPU), spool {:.1} ms ({:.1} CPU), JSON {:.1} ms ({:.1} CPU); \
                     open + iterate: packed {:.1} ms ({:.1} CPU), spool {:.1} ms ({:.1} CPU)",
                    t[0][round] * 1e3,
                    cpu[0][round] * 1e3,
                    t[1][round] * 1e3,
                    cpu[1][round] * 1e3,
                    t[2][round] * 1e3,
                    cpu[2][round] * 1e3,
                    t[3][round] * 1e3,
                    cpu[3][round] * 1e3,
                    t[4][round] * 1e3,
                    cpu[4][round] * 1e3,
                );
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (p, s, j) = (median(&mut t[0]), median(&mut t[1]), median(&mut t[2]));
            let (pc, sc, jc) = (median(&mut cpu[0]), median(&mut cpu[1]), median(&mut cpu[2]));
            let (pi, si) = (median(&mut t[3]), median(&mut t[4]));
            let (pic, sic) = (median(&mut cpu[3]), median(&mut cpu[4]));
            println!(
                "median of 7: packed {:.1} ms, spool {:.1} ms ({:.2}x the packed), JSON typed {:.1} ms ({:.1}x); \
                 CPU: packed {:.1} ms, spool {:.1} ms ({:.2}x), JSON {:.1} ms ({:.1}x)",
                p * 1e3,
                s * 1e3,
                s / p,
                j * 1e3,
                j / p,
                pc * 1e3,
                sc * 1e3,
                sc / pc,
                jc * 1e3,
                jc / pc
            );
            println!(
                "median of 7, open + iterate every sample: packed {:.1} ms, spool {:.1} ms ({:.2}x the packed), \
                 JSON parse {:.1}x the packed; CPU: packed {:.1} ms, spool {:.1} ms ({:.2}x), JSON {:.1}x",
                pi * 1e3,
                si * 1e3,
                si / pi,
                j / pi,
                pic * 1e3,
                sic * 1e3,
                sic / pic,
                jc / pic
            );
        }
        Some("open") if args.len() == 3 || (args.len() == 4 && args[3] == "iterate") => {
            // One `Snapshot::open` (a spool or a packed file), for peak RSS;
            // with `iterate`, then every sample read in order.
            let t = Instant::now();
            let snap = spulse::Snapshot::open(&args[2])?;
            let wall = t.elapsed();
            let mut acc = 0u64;
            if args.len() == 4 {
                for s in snap.samples() {
                    acc = acc.wrapping_add(s.time_us ^ s.thread.get() as u64 ^ (s.stack.get() as u64) << 32);
                }
            }
            println!(
                "{} samples ({}); Snapshot::open {:.3} s{}; decoded columns (16 bytes a sample) {} bytes",
                snap.len(),
                if snap.is_packed() { "packed" } else { "spool" },
                wall.as_secs_f64(),
                if args.len() == 4 {
                    format!(", with iteration {:.3} s ({acc:x})", t.elapsed().as_secs_f64())
                } else {
                    String::new()
                },
                16 * snap.len()
            );
        }
        _ => {
            eprintln!(
                "usage: spool_rss write PATH SAMPLES [TICK_US] | replay PATH | snapshot PATH | json PATH | \
                 pack SPOOL OUT | open PATH [iterate] | compare SPOOL PACKED"
            );
            std::process::exit(2);
        }
    }
    Ok(())
}
