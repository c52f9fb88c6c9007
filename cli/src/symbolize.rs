//! Offline symbolization of spool frames: the library's symbolizer
//! (`spulse::symbolize`, cargo feature `pprof`), which the `http` endpoint
//! also uses in process. See its documentation for what is read and how.

pub use spulse::symbolize::*;
