//! What a recording ends with: the processes, samples and losses of the
//! spools the collector finished, the warnings their recorders left in
//! `.stats` files, and the processes that could not record (`.error`
//! files), grouped by reason.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use super::collector::Collector;
use super::handoff::{parse_name, process_dirs, read_small, warning_line};

pub(super) struct Summary {
    pub(super) processes: usize,
    pub(super) samples: u64,
    pub(super) lost: u64,
    pub(super) warnings: Vec<String>,
    /// Of those, the ones not already printed while the command ran (see
    /// `Collector::live_warnings`).
    pub(super) fresh: Vec<String>,
    /// Processes that left an `.error` file (could not record).
    pub(super) unrecorded: usize,
    /// CPU time (user, system; microseconds) the recorded processes spent
    /// before the recorder started in them (from their stats files).
    pub(super) before_us: (u64, u64),
    /// CPU time (microseconds) spulse itself took in the recorded processes:
    /// each recorder's start and its writer thread (from their stats files).
    pub(super) own_us: u64,
    /// Processes whose recorder could not sample kernel time because the
    /// kernel refused it (their stats say so), and those that said at all.
    pub(super) kernel_refused: usize,
    pub(super) kernel_known: usize,
    /// Processes whose descriptor limit (`ulimit -n`) left the recorder no
    /// room for the kernel-time events (an eighth of it is its budget).
    pub(super) kernel_budget: usize,
}

impl Collector {
    pub(super) fn summary(&self) -> Summary {
        let mut pids = HashSet::new();
        let mut samples = 0;
        let mut lost = 0;
        let mut warnings = Vec::new();
        // What processes' recorders reported (`Stats::warnings`, a write
        // failure), grouped by message, with the pids that said it.
        let mut reported: Vec<(String, Vec<u32>)> = Vec::new();
        let mut discarded = 0u64;
        let mut before_us = (0u64, 0u64);
        let mut own_us = 0u64;
        let (mut kernel_refused, mut kernel_known, mut kernel_budget) = (0, 0, 0);
        for d in &self.done {
            if d.discarded {
                discarded += 1;
                continue;
            }
            if d.opened {
                pids.insert(d.pid);
            }
            samples += d.samples;
            lost += d.dropped;
            if let Some(m) = &d.error {
                warnings.push(m.clone());
            }
            // Samples the process's own recorder lost (written at its exit),
            // and why it stopped writing, if it did.
            // A stats file the process mapped at start and never wrote (it
            // exec'd, or was killed) is zeros: no stats, as a missing one.
            let stats = read_small(&d.path.with_extension("stats")).and_then(|t| {
                let t = t.trim_end_matches('\0');
                if t.is_empty() {
                    Err(None)
                } else {
                    Ok(t.to_string())
                }
            });
            match stats {
                Ok(text) => {
                    let (first, rest) = text.split_once('\n').unwrap_or((&text, ""));
                    let field = |n| first.split_whitespace().nth(n).and_then(|v| v.parse::<u64>().ok());
                    if let Some(l) = field(1) {
                        lost += l;
                    }
                    // Bounded: a process's CPU time before its constructor
                    // is under a day, and the sum cannot overflow.
                    let day = 86_400_000_000;
                    before_us.0 += field(2).unwrap_or(0).min(day);
                    before_us.1 += field(3).unwrap_or(0).min(day);
                    own_us += field(5).unwrap_or(0).min(day);
                    match field(4) {
                        Some(3) => {
                            kernel_refused += 1;
                            kernel_known += 1;
                        }
                        Some(6) => {
                            kernel_budget += 1;
                            kernel_known += 1;
                        }
                        Some(1 | 2 | 4 | 5) => kernel_known += 1,
                        _ => {}
                    }
                    for w in rest.lines().filter(|l| !l.trim().is_empty()).take(16) {
                        let w = warning_line(w);
                        match reported.iter_mut().find(|(m, _)| *m == w) {
                            Some((_, pids)) => pids.push(d.pid),
                            None => reported.push((w, vec![d.pid])),
                        }
                    }
                }
                Err(None) => {}
                Err(Some(why)) => {
                    warnings.push(format!("process {}: its stats file was not read: {why}", d.pid))
                }
            }
        }
        let group = |w: &str, pids: &[u32]| match pids {
            [one] => format!("process {one}: {w}"),
            many => format!("{} processes (first {}): {w}", many.len(), many[0]),
        };
        // Everything before the recorders' own warnings is new to the user.
        let mut fresh = warnings.clone();
        for (w, pids) in reported {
            let unshown: Vec<u32> =
                pids.iter().copied().filter(|&p| !self.live.shown.contains(&(p, w.clone()))).collect();
            if !unshown.is_empty() {
                fresh.push(group(&w, &unshown));
            }
            warnings.push(group(&w, &pids));
        }
        let before = warnings.len();
        if discarded > 0 {
            warnings.push(format!(
                "{discarded} process spool{} not merged (writing the output had failed)",
                if discarded == 1 { " was" } else { "s were" }
            ));
        }
        // Processes that could not record, grouped by reason: a full
        // directory gives the same reason for every process of a big tree.
        let mut unrecorded: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for rd in
            process_dirs(&self.dir, self.users.as_deref()).iter().filter_map(|d| std::fs::read_dir(d).ok())
        {
            for e in rd.flatten() {
                if let Some((pid, _)) = parse_name(&e.file_name(), "error") {
                    let why = match read_small(&e.path()) {
                        Ok(text) if !text.trim().is_empty() => text.trim().to_string(),
                        Ok(_) | Err(None) => empty_reason(&self.dir),
                        Err(Some(why)) => format!("its error file was not read: {why}"),
                    };
                    unrecorded.entry(why).or_default().push(pid);
                }
            }
        }
        let mut count = 0;
        for (why, mut who) in unrecorded {
            count += who.len();
            who.sort_unstable();
            if let [pid] = who[..] {
                warnings.push(format!("process {pid} was not recorded: {why}"));
            } else {
                let shown: Vec<String> = who.iter().take(10).map(u32::to_string).collect();
                let more = if who.len() > 10 { ", ..." } else { "" };
                warnings.push(format!(
                    "{} processes were not recorded (pids {}{more}): {why}",
                    who.len(),
                    shown.join(", ")
                ));
            }
        }
        // What came after the recorders' own warnings is new too.
        fresh.extend_from_slice(&warnings[before..]);
        Summary {
            processes: pids.len(),
            samples,
            lost,
            warnings,
            fresh,
            unrecorded: count,
            before_us,
            own_us,
            kernel_refused,
            kernel_known,
            kernel_budget,
        }
    }
}

/// What to say for an empty `.error` file: the library writes the reason in
/// one write, so an empty file means that write failed, most likely because
/// the directory's file system is full.
fn empty_reason(dir: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let full = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok().and_then(|c| {
        // SAFETY: all-zero bytes are a valid statvfs (plain integers) to overwrite.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a NUL-terminated path and a valid struct to fill.
        (unsafe { libc::statvfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_bavail == 0)
    });
    match full {
        Some(true) => format!(
            "no reason could be written: the file system of {} (TMPDIR) is full",
            dir.parent().unwrap_or(dir).display()
        ),
        _ => "no reason was written (its error file is empty; was the file system of TMPDIR full?)".into(),
    }
}
