//! The heap-cost workloads on `spulse::heap::Sampled<System>` at the default
//! rate (512 KiB).
#[path = "workload.rs"]
mod workload;

#[global_allocator]
static ALLOC: spulse::heap::Sampled<std::alloc::System> = spulse::heap::Sampled::new(std::alloc::System);

fn main() {
    // HEAP_RATE=bytes: another mean sampling interval (to measure the cost
    // of a sample).
    if let Some(r) = std::env::var("HEAP_RATE").ok().and_then(|r| r.parse().ok()) {
        spulse::heap::set_sample_rate(Some(r));
    }
    // HEAP_RECORD=1: run the workload under a CPU recording (spool in the
    // temp directory); HEAP_RECORD=2: with heap events too (the cost of the
    // events: BENCHMARKS.md, "Heap events").
    let record = std::env::var("HEAP_RECORD").ok().and_then(|r| r.parse::<u32>().ok()).unwrap_or(0);
    let guard = (record > 0).then(|| {
        let path = std::env::temp_dir().join(format!("heap_sampled-{}.spool", std::process::id()));
        let g = spulse::Recorder::builder().heap_events(record > 1).start(&path).expect("recording");
        (g, path)
    });
    let cpu = std::time::Instant::now();
    workload::run();
    let wall = cpu.elapsed();
    if let Some((g, path)) = guard {
        let stats = g.finish().expect("recording");
        let _ = std::fs::remove_file(&path);
        eprintln!(
            "recorded: {} CPU samples, heap events {:?}, writer CPU {:?}, workload wall {:?}",
            stats.samples_written, stats.heap_events, stats.writer_cpu, wall
        );
    }
    let s = spulse::heap::stats();
    eprintln!("samples {} live {}", s.samples, s.live_blocks);
}
