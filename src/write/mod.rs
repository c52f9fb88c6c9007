//! The write side: [`SpoolWriter`], which validates and appends records.

mod writer;
pub use writer::{NewModule, SpoolWriter};
