//! The write side: [`SpoolWriter`], which validates and appends records, and
//! [`pack`], which writes a spool as a packed file.

mod pack;
mod writer;
pub use pack::{pack, PackSummary};
pub use writer::{NewModule, SpoolWriter};
