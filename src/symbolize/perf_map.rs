//! `/tmp/perf-<pid>.map`: names for anonymous executable memory (JITs,
//! CPython's perf trampoline), read only from a regular file the user owns.

use super::*;

pub(super) struct PerfMap {
    /// (start, end, name) in file order; later lines win.
    pub(super) entries: Vec<(u64, u64, String)>,
    pub(super) path: String,
}

impl PerfMap {
    pub(super) fn lookup(&self, address: u64) -> Option<&str> {
        self.entries.iter().rev().find(|(s, e, _)| address >= *s && address < *e).map(|(_, _, n)| n.as_str())
    }
}

pub(super) fn my_uid() -> Option<u32> {
    // /proc/self is owned by the effective uid of the process that looks at it.
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

pub(super) fn parse_hex(s: &str) -> Option<u64> {
    let s = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).unwrap_or(s);
    u64::from_str_radix(s, 16).ok()
}

/// Load `/tmp/perf-<pid>.map` if it is a regular file (not a symlink) owned
/// by the current user; at most [`MAX_PERF_MAP_BYTES`] are read. Malformed
/// lines are skipped.
pub(super) fn load_perf_map(pid: u32) -> Option<PerfMap> {
    let path = format!("/tmp/perf-{pid}.map");
    let (file, _, _) = open_regular(Path::new(&path), u64::MAX, libc::O_NOFOLLOW)?;
    if Some(file.metadata().ok()?.uid()) != my_uid() {
        return None;
    }
    let mut text = Vec::new();
    file.take(MAX_PERF_MAP_BYTES).read_to_end(&mut text).ok()?;
    let text = String::from_utf8_lossy(&text);
    let mut entries = Vec::new();
    for line in text.lines() {
        let mut parts = line.trim_end().splitn(3, ' ');
        let (Some(start), Some(size), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (Some(start), Some(size)) = (parse_hex(start), parse_hex(size)) else { continue };
        let Some(end) = start.checked_add(size) else { continue };
        if size == 0 || name.is_empty() {
            continue;
        }
        entries.push((start, end, name.to_string()));
    }
    let name = format!("perf-{pid}.map");
    Some(PerfMap { entries, path: name })
}
