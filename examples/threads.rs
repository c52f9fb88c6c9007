//! Threads: named threads that start before and after recording begins, some
//! short-lived, each burning a different amount of CPU. Prints, per thread, its
//! CPU time, the samples it got and their ratio to CPU time x frequency.
//!
//! ```text
//! cargo run --release --example threads [out.spool]
//! ```

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn thread_cpu() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the struct we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

fn gettid() -> u32 {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

#[inline(never)]
fn burn(cpu: f64) {
    let c0 = thread_cpu();
    let end = Instant::now() + Duration::from_secs(10);
    let mut h = 1u64;
    while thread_cpu() - c0 < cpu && Instant::now() < end {
        for i in 0..5_000u64 {
            h = (h ^ black_box(i)).wrapping_mul(0x100_0000_01b3);
        }
    }
    black_box(h);
}

fn spawn(name: String, cpu: f64, tx: mpsc::Sender<(u32, String, f64)>) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            let c0 = thread_cpu();
            burn(cpu);
            tx.send((gettid(), name, thread_cpu() - c0)).unwrap();
        })
        .unwrap()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = std::env::args().nth(1);
    let path = arg.clone().unwrap_or_else(|| "threads.spool".to_string());
    if arg.is_none() {
        let _ = std::fs::remove_file(&path);
    }
    let (tx, rx) = mpsc::channel();
    // Two threads exist before recording starts (they wait for the signal to work).
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let early_tx = tx.clone();
    let early = std::thread::Builder::new().name("early".into()).spawn(move || {
        go_rx.recv().unwrap();
        let c0 = thread_cpu();
        burn(0.3);
        early_tx.send((gettid(), "early".into(), thread_cpu() - c0)).unwrap();
    })?;

    let hz = 999;
    let guard = spulse::Recorder::builder().frequency_hz(hz).start(&path)?;
    go_tx.send(())?;
    let mut hs = vec![early];
    for i in 0..4 {
        hs.push(spawn(format!("steady-{i}"), 0.1 * (i + 1) as f64, tx.clone()));
    }
    for i in 0..20 {
        // Short-lived threads created while recording (covered by inheritance).
        hs.push(spawn(format!("short-{i}"), 0.01, tx.clone()));
    }
    drop(tx);
    for h in hs {
        h.join().unwrap();
    }
    let stats = guard.finish()?;
    let snap = spulse::Snapshot::open(&path)?;
    let mut per_tid: HashMap<u32, u64> = HashMap::new();
    for s in snap.samples() {
        *per_tid.entry(snap.thread(s.thread).tid).or_default() += 1;
    }
    let mut rows: Vec<(u32, String, f64)> = rx.iter().collect();
    rows.sort_by(|a, b| a.1.cmp(&b.1));
    println!(
        "{} samples with the {} engine; {} threads in the spool\n",
        stats.samples_written,
        stats.engine,
        snap.threads().len()
    );
    println!("  {:10} {:>8} {:>8} {:>8}", "thread", "CPU ms", "samples", "ratio");
    let (mut cpu_all, mut n_all) = (0.0, 0);
    for (tid, name, cpu) in rows {
        let n = per_tid.get(&tid).copied().unwrap_or(0);
        cpu_all += cpu;
        n_all += n;
        println!("  {name:10} {:8.1} {n:8} {:8.3}", cpu * 1e3, n as f64 / (cpu * hz as f64));
    }
    println!("  {:10} {:8.1} {n_all:8} {:8.3}", "all", cpu_all * 1e3, n_all as f64 / (cpu_all * hz as f64));
    println!("\nnext: cargo run --release -p spulse-cli -- top {path}");
    Ok(())
}
