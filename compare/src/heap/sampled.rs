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
    workload::run();
    let s = spulse::heap::stats();
    eprintln!("samples {} live {}", s.samples, s.live_blocks);
}
