//! Fuzz target: Writes arbitrary bytes to a temporary file in random-size appends (sizes
//! drawn from the first two bytes) and checks that `Tail` sees exactly what
//! `Snapshot` sees, in batches of at most 16,384.
//! The checks live in `spulse::read::fuzz_check_tail`, shared with
//! `tests/format_fuzz_corpus.rs`, which replays `fuzz/corpus/tail/` in CI.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    spulse::read::fuzz_check_tail(data);
});
