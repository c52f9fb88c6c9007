//! Export formats. Each module writes one format from an aggregation (or, for
//! the Firefox Profiler, from the sample stream) and a symbolizer.

pub mod collapsed;
pub mod firefox;
pub mod pprof;
pub mod speedscope;
pub mod svg;
