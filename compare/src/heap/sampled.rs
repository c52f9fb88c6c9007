//! The heap-cost workloads on `spulse::heap::Sampled<System>` at the default
//! rate (512 KiB).
#[path = "workload.rs"]
mod workload;

#[global_allocator]
static ALLOC: spulse::heap::Sampled<std::alloc::System> = spulse::heap::Sampled::new(std::alloc::System);

fn main() {
    workload::run();
    let s = spulse::heap::stats();
    eprintln!("samples {} live {}", s.samples, s.live_blocks);
}
