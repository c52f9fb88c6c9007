//! Fuzz target: Writes arbitrary bytes to a temporary file and checks that `Replay` agrees
//! with `Snapshot` (same error, or same samples, recovery flag and seeks).
//! The checks live in `spulse::read::fuzz_check_replay`, shared with
//! `tests/format_fuzz_corpus.rs`, which replays `fuzz/corpus/replay/` in CI.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    spulse::read::fuzz_check_replay(data);
});
