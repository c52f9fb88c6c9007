//! Fuzz target: Feeds arbitrary bytes to `Snapshot::from_bytes` and checks every accessor and
//! that re-reading the validated prefix gives the same samples.
//! The checks live in `spulse::read::fuzz_check_snapshot`, shared with
//! `tests/format_fuzz_corpus.rs`, which replays `fuzz/corpus/snapshot/` in CI.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    spulse::read::fuzz_check_snapshot(data);
});
