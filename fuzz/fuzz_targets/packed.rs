//! Fuzz target: the packed-file readers on arbitrary bytes (seeded with packed
//! files): `Snapshot::from_bytes`, then the same bytes as a file through
//! `Replay` (frame and every block checked at open, then decoded block by
//! block). Any panic is a bug. The stronger cross-reader checks run on the
//! committed corpus in `tests/format_fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spulse::{Replay, Snapshot};

fuzz_target!(|data: &[u8]| {
    if let Ok(snap) = Snapshot::from_bytes(data) {
        for s in snap.samples() {
            let _ = snap.thread(s.thread);
            for f in snap.stack_frames(s.stack) {
                let _ = snap.frame_address(f);
            }
        }
    }
    let path = std::env::temp_dir().join(format!("spulse-fuzz-packed-{}", std::process::id()));
    std::fs::write(&path, data).expect("write the input to a temporary file");
    if let Ok(replay) = Replay::open(&path) {
        let last = replay.samples().flatten().last().map_or(0, |s| s.time_us);
        replay.samples_from(last).for_each(drop);
    }
    let _ = std::fs::remove_file(&path);
});
