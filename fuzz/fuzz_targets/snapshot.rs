//! Fuzz target: `Snapshot::from_bytes` on arbitrary bytes, then every sample's
//! thread, stack frames and addresses. Any panic is a bug. The stronger
//! cross-reader checks run on the committed corpus in
//! `tests/format_fuzz_corpus.rs` (via `spulse-testkit`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use spulse::Snapshot;

fuzz_target!(|data: &[u8]| {
    let Ok(snap) = Snapshot::from_bytes(data) else { return };
    for s in snap.samples() {
        let _ = snap.thread(s.thread);
        for f in snap.stack_frames(s.stack) {
            let _ = snap.frame_address(f);
        }
    }
    let _ = (snap.time_range(), snap.modules().len(), snap.valid_len());
});
