//! The spool encoding against FORMAT.md: round trips of random valid spools
//! through every reader, one test per rejection rule, truncation at every byte,
//! FORMAT.md's worked example, and the size of a profile-shaped spool. One
//! test binary; each module is one area.

mod doc;
mod heap;
mod off_cpu;
mod rejections;
mod roundtrip;
mod size;
mod truncation;
