//! Threads: named threads that start before and after recording begins, some
//! short-lived, each burning a different amount of CPU. Prints, per thread, its
//! CPU time, the samples it got and their ratio to CPU time x frequency.
//!
//! ```text
//! cargo run --release --example threads [out.spool]
//! ```

use spulse_testkit::symbols as support;

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::mpsc;
use std::time::Duration;

use support::{gettid, thread_cpu_seconds as thread_cpu};

/// Burn `cpu` seconds of this thread's CPU time (at most 10 s of wall time).
fn burn(cpu: f64) {
    black_box(support::burn_cpu(cpu, 5_000, Duration::from_secs(10)));
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
