//! A shared library whose own global allocator is `spulse::heap::Sampled`,
//! the way a Python or Node extension written in Rust would use it: the
//! heap tests (`tests/heap.rs`, `a_shared_library_loaded_later_samples`)
//! load it with `dlopen` after the process started and call it from several
//! threads. Built as a `cdylib`: `cargo build --release --example heap_dylib
//! --features heap`.

use std::alloc::System;
use std::hint::black_box;

use spulse::heap::Sampled;

#[global_allocator]
static ALLOC: Sampled<System> = Sampled::new(System);

/// Allocate and free `bytes` bytes in 1 KiB blocks; the samples this
/// library's sampler has taken in all, afterwards.
#[no_mangle]
pub extern "C" fn spulse_heap_dylib_churn(bytes: u64) -> u64 {
    for _ in 0..bytes / 1024 {
        black_box(Vec::<u8>::with_capacity(1024));
    }
    spulse::heap::stats().samples
}
