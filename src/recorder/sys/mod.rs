//! The OS layer: every raw system call the recorder makes outside the signal
//! handler.

pub(crate) mod perf;
pub(crate) mod timer;

use std::io;

/// Every thread id of this process.
pub(crate) fn list_tids() -> io::Result<Vec<u32>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc/self/task")? {
        let e = e?;
        if let Some(t) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
            v.push(t);
        }
    }
    Ok(v)
}
