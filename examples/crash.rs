//! Crash: a recorded process dies by SIGKILL mid-recording; its spool still opens
//! with everything the writer flushed before the kill.
//!
//! ```text
//! cargo run --release --example crash [out.spool]
//! ```
//! The example re-runs itself as a child that records, burns CPU and kills itself
//! with SIGKILL; the parent then opens what the child left behind.

use std::hint::black_box;
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

#[inline(never)]
fn doomed_work(until: Instant) -> u64 {
    let mut h = 1u64;
    while Instant::now() < until {
        for i in 0..10_000u64 {
            h = (h ^ black_box(i)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

fn child(path: &str) -> ! {
    let _guard = spulse::Recorder::builder()
        .flush_interval(Duration::from_millis(20))
        .start(path)
        .unwrap_or_else(|e| {
            eprintln!("child: {e}");
            std::process::exit(2)
        });
    black_box(doomed_work(Instant::now() + Duration::from_millis(800)));
    // SIGKILL: no destructor, no final flush, no sync.
    // SAFETY: killing ourselves.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL cannot be caught");
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "--child" {
        child(&args[2]);
    }
    let arg = args.get(1).cloned();
    let path = arg.clone().unwrap_or_else(|| "crash.spool".to_string());
    if arg.is_none() {
        let _ = std::fs::remove_file(&path);
    }
    let status = std::process::Command::new(std::env::current_exe()?).args(["--child", &path]).status()?;
    println!("child ended: {status:?} (signal {:?})", status.signal());
    let snap = spulse::Snapshot::open(&path)?;
    println!(
        "{path}: {} samples, {} modules, {} threads, {} valid bytes of {}{}",
        snap.len(),
        snap.modules().len(),
        snap.threads().len(),
        snap.valid_len(),
        snap.file_len(),
        if snap.recovered_from_truncated_tail() { " (a torn last record was dropped)" } else { "" }
    );
    println!("next: cargo run --release -p spulse-cli -- top {path}");
    Ok(())
}
