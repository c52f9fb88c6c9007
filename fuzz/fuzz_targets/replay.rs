//! Fuzz target: arbitrary bytes written to a file and opened with `Replay` (a
//! small index, so seeks go through it), then a full scan and a seek to the
//! middle of the time range. Any panic is a bug. The stronger cross-reader
//! checks run on the committed corpus in `tests/format_fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spulse::Replay;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("spulse-fuzz-replay-{}", std::process::id()));
    std::fs::write(&path, data).expect("write the input to a temporary file");
    if let Ok(replay) = Replay::options().index_limit(2).open(&path) {
        let (lo, hi) = replay
            .samples()
            .flatten()
            .fold((u64::MAX, 0), |(lo, hi), s| (lo.min(s.time_us), hi.max(s.time_us)));
        replay.samples_from(lo / 2 + hi / 2).for_each(drop);
    }
    let _ = std::fs::remove_file(&path);
});
