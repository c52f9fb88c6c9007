//! Fuzz target: arbitrary bytes (after the first, which sets the append size)
//! written to a file in appends, with a `Tail` polled after each; batches must
//! stay within `Tail::MAX_BATCH`. Any panic is a bug. The stronger cross-reader
//! checks run on the committed corpus in `tests/format_fuzz_corpus.rs`.
#![no_main]

use std::io::Write;

use libfuzzer_sys::fuzz_target;
use spulse::Tail;

fuzz_target!(|data: &[u8]| {
    let Some((&step, data)) = data.split_first() else { return };
    let path = std::env::temp_dir().join(format!("spulse-fuzz-tail-{}", std::process::id()));
    let mut file = std::fs::File::create(&path).expect("create a temporary file");
    let mut chunks = data.chunks(1 + step as usize);
    file.write_all(chunks.next().unwrap_or_default()).expect("write the temporary file");
    if let Ok(mut tail) = Tail::open(&path) {
        for chunk in chunks {
            while let Ok(batch) = tail.poll() {
                assert!(batch.len() <= Tail::MAX_BATCH);
                if batch.is_empty() {
                    break;
                }
            }
            file.write_all(chunk).expect("append to the temporary file");
        }
        while matches!(tail.poll(), Ok(b) if !b.is_empty()) {}
    }
    let _ = std::fs::remove_file(&path);
});
