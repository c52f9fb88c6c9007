//! The write side: [`SpoolWriter`], which validates and appends records.
//! ([`pack`](crate::pack), which reads a spool and writes a packed file, sits
//! above both the read and the write side, in `src/pack.rs`.)

mod writer;
pub use writer::{NewModule, SpoolWriter};
