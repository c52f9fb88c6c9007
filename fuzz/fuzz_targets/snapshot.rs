//! Fuzz target: `Snapshot::from_bytes` on arbitrary bytes, then every sample's
//! thread, stack frames and addresses. Any panic is a bug, and so is holding
//! more heap than `FORMAT.md` allows for the input (the packed container's
//! bound, section 10, "Memory", covers a spool's too). The stronger
//! cross-reader checks run on the committed corpus in
//! `tests/format_fuzz_corpus.rs` (via `spulse-testkit`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use spulse::Snapshot;
use spulse_testkit::alloc::{peak_during, Counting};
use spulse_testkit::packed::{footer_samples, memory_bound};

#[global_allocator]
static ALLOC: Counting = Counting;

fuzz_target!(|data: &[u8]| {
    let (peak, snap) = peak_during(|| Snapshot::from_bytes(data));
    let bound = memory_bound(data.len() as u64, footer_samples(data));
    assert!(peak as u64 <= bound, "{peak} bytes of heap for {} bytes (bound {bound})", data.len());
    let Ok(snap) = snap else { return };
    for s in snap.samples() {
        let _ = snap.thread(s.thread);
        for f in snap.stack_frames(s.stack) {
            let _ = snap.frame_address(f);
        }
    }
    let _ = (snap.time_range(), snap.modules().len(), snap.valid_len());
});
