//! `/tmp/perf-<pid>.map`: names for anonymous executable memory (JITs,
//! CPython's perf trampoline), read only from a regular file the user owns.
//!
//! A JIT writes a line for each piece of code it emits, and reuses addresses:
//! where ranges overlap, the later line wins. The lines are painted, in file
//! order, onto a map of disjoint ranges (each later line cutting what it
//! covers out of the earlier ones), so a lookup is one ordered search rather
//! than a scan of every line (a map of a million lines took 71 s of CPU for
//! one `top`). Names live in one buffer: a line costs its text and about 32
//! bytes, not a `String` each (a 270 MB map of tiny lines needed 1.3 GB
//! more), and at most [`MAX_PERF_MAP_LINES`] lines are kept.

use std::collections::BTreeMap;

use super::*;

pub(super) struct PerfMap {
    /// Disjoint ranges by start: (end, name's offset and length in `names`).
    ranges: BTreeMap<u64, (u64, u32, u32)>,
    names: String,
    pub(super) path: String,
}

impl PerfMap {
    /// A map of `lines` (start, end, name) in file order: later lines win.
    pub(super) fn new<'a>(lines: impl IntoIterator<Item = (u64, u64, &'a str)>, path: String) -> PerfMap {
        let mut m = PerfMap { ranges: BTreeMap::new(), names: String::new(), path };
        for line in lines {
            if !m.push(line) {
                break;
            }
        }
        m
    }

    /// Paint the next line; false if the names' buffer is full (4 GiB: not
    /// reached within [`MAX_PERF_MAP_BYTES`]).
    fn push(&mut self, (start, end, name): (u64, u64, &str)) -> bool {
        let (Ok(off), Ok(len)) = (u32::try_from(self.names.len()), u32::try_from(name.len())) else {
            return false;
        };
        if u32::try_from(self.names.len() + name.len()).is_err() {
            return false;
        }
        self.names.push_str(name);
        self.paint(start, end, (off, len));
        true
    }

    /// Lay `[start, end)` named `name` over what is there.
    fn paint(&mut self, start: u64, end: u64, name: (u32, u32)) {
        if start >= end {
            return;
        }
        // A range begun before `start` that reaches into it keeps its part
        // before, and its part after `end` if it goes beyond.
        if let Some((&s, &(e, no, nl))) = self.ranges.range(..start).next_back() {
            if e > start {
                self.ranges.insert(s, (start, no, nl));
                if e > end {
                    self.ranges.insert(end, (e, no, nl));
                }
            }
        }
        // Ranges begun inside `[start, end)` go, but for a part beyond `end`.
        let inside: Vec<u64> = self.ranges.range(start..end).map(|(&s, _)| s).collect();
        for s in inside {
            let (e, no, nl) = self.ranges.remove(&s).expect("listed");
            if e > end {
                self.ranges.insert(end, (e, no, nl));
            }
        }
        self.ranges.insert(start, (end, name.0, name.1));
    }

    pub(super) fn lookup(&self, address: u64) -> Option<&str> {
        let (_, &(end, off, len)) = self.ranges.range(..=address).next_back()?;
        (address < end).then(|| &self.names[off as usize..off as usize + len as usize])
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

/// One line of a perf map: `START SIZE NAME` (hex), `None` if malformed.
fn parse_line(line: &str) -> Option<(u64, u64, &str)> {
    let mut parts = line.trim_end().splitn(3, ' ');
    let (start, size, name) = (parts.next()?, parts.next()?, parts.next()?);
    let (start, size) = (parse_hex(start)?, parse_hex(size)?);
    let end = start.checked_add(size)?;
    (size != 0 && !name.is_empty()).then_some((start, end, name))
}

/// Load `/tmp/perf-<pid>.map` if it is a regular file (not a symlink) owned
/// by the current user; at most [`MAX_PERF_MAP_BYTES`] are read and
/// [`MAX_PERF_MAP_LINES`] lines kept. Malformed lines are skipped.
pub(super) fn load_perf_map(pid: u32) -> Option<PerfMap> {
    let path = format!("/tmp/perf-{pid}.map");
    let (file, _, _) = open_regular(Path::new(&path), u64::MAX, libc::O_NOFOLLOW)?;
    if Some(file.metadata().ok()?.uid()) != my_uid() {
        return None;
    }
    // Line by line: the text read is not held whole.
    let mut reader = std::io::BufReader::new(file.take(MAX_PERF_MAP_BYTES));
    let mut buf = Vec::new();
    let mut m = PerfMap::new([], format!("perf-{pid}.map"));
    let mut kept = 0;
    while kept < MAX_PERF_MAP_LINES {
        buf.clear();
        match std::io::BufRead::read_until(&mut reader, b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let line = String::from_utf8_lossy(&buf);
        if let Some(l) = parse_line(line.trim_end_matches(['\n', '\r'])) {
            if !m.push(l) {
                break;
            }
            kept += 1;
        }
    }
    Some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The painted map answers as the last line holding the address would,
    /// on random overlapping lines, against a scan of every line.
    #[test]
    fn lookups_match_the_last_line_that_holds_the_address() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for round in 0..200 {
            let n = 1 + next(40) as usize;
            let lines: Vec<(u64, u64, String)> = (0..n)
                .map(|i| {
                    let s = next(200);
                    (s, s + 1 + next(60), format!("f{round}_{i}"))
                })
                .collect();
            let m = PerfMap::new(lines.iter().map(|(s, e, n)| (*s, *e, n.as_str())), "p".into());
            for a in 0..280 {
                let want = lines.iter().rev().find(|(s, e, _)| a >= *s && a < *e).map(|(_, _, n)| n.as_str());
                assert_eq!(m.lookup(a), want, "round {round}, address {a}");
            }
            // Disjoint, each range non-empty.
            let mut last_end = 0;
            for (&s, &(e, _, _)) in &m.ranges {
                assert!(s >= last_end && e > s, "round {round}: {s}..{e} after {last_end}");
                last_end = e;
            }
        }
    }

    #[test]
    fn lines_parse() {
        assert_eq!(
            parse_line("1000 80 LazyCompile:*f a.js:1"),
            Some((0x1000, 0x1080, "LazyCompile:*f a.js:1"))
        );
        assert_eq!(parse_line("0x10 0x0 zero"), None);
        assert_eq!(parse_line("ffffffffffffffff 2 wraps"), None);
        assert_eq!(parse_line("10 2"), None);
        assert_eq!(parse_line("zz 2 x"), None);
    }
}
