//! Fuzz target: the packed-file readers on arbitrary bytes (seeded with packed
//! files): `Snapshot::from_bytes`, then the same bytes as a file through
//! `Replay` (frame and every block checked at open, then decoded block by
//! block). Any panic is a bug, and so is a reader holding more heap than
//! `FORMAT.md` (section 10, "Memory") allows for the input's size and the
//! samples its footer claims. The stronger cross-reader checks run on the
//! committed corpus in `tests/format_fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spulse::{Replay, Snapshot};
use spulse_testkit::alloc::{peak_during, Counting};
use spulse_testkit::packed::{footer_samples, memory_bound};

#[global_allocator]
static ALLOC: Counting = Counting;

fuzz_target!(|data: &[u8]| {
    let len = data.len() as u64;
    let (peak, snap) = peak_during(|| Snapshot::from_bytes(data));
    let bound = memory_bound(len, footer_samples(data));
    assert!(peak as u64 <= bound, "Snapshot held {peak} bytes for {len} (bound {bound})");
    if let Ok(snap) = snap {
        for s in snap.samples() {
            let _ = snap.thread(s.thread);
            for f in snap.stack_frames(s.stack) {
                let _ = snap.frame_address(f);
            }
        }
    }
    let path = std::env::temp_dir().join(format!("spulse-fuzz-packed-{}", std::process::id()));
    std::fs::write(&path, data).expect("write the input to a temporary file");
    let (peak, _) = peak_during(|| {
        if let Ok(replay) = Replay::open(&path) {
            let last = replay.samples().flatten().last().map_or(0, |s| s.time_us);
            replay.samples_from(last).for_each(drop);
        }
    });
    assert!(peak as u64 <= memory_bound(len, 0), "Replay held {peak} bytes for {len}");
    let _ = std::fs::remove_file(&path);
});
