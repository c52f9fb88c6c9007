//! The readers' behaviour beyond decoding: `Snapshot`'s two-thread load
//! against the sequential one, `Tail` over a growing file, and paths that are
//! not spools or not files at all. One test binary; each module is one area.
//! (The fuzz corpus replay, `format_fuzz_corpus.rs`, is a binary of its own:
//! its counting global allocator must see one test at a time.)

mod parallel;
mod tail;
mod untrusted_files;
