//! The heap-cost workloads on the system allocator.
#[path = "workload.rs"]
mod workload;

#[global_allocator]
static ALLOC: std::alloc::System = std::alloc::System;

fn main() {
    workload::run();
}
