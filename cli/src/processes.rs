//! The processes of a spool (for `info` and `top --per-process`): a process is
//! a pid that has threads or modules; its program is the name its main thread
//! (tid = pid) was last defined with, shown as the path of the module of that
//! process whose file name it matches (the kernel cuts thread names at 15
//! bytes); it *ended* when the spool retired every module of it (a recording
//! made by `spulse record` retires a process's modules when it exits, is killed
//! or execs; an embedded recording retires none).

use std::collections::BTreeMap;

use spulse::Definitions;

/// One process of a spool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessInfo {
    /// Its pid.
    pub pid: u32,
    /// Its program (see the module docs); empty when nothing names it.
    pub program: String,
    /// Samples of its threads.
    pub samples: u64,
    /// Threads defined for it.
    pub threads: usize,
    /// Whether every one of its modules was retired.
    pub ended: bool,
}

/// The processes of `defs`, by pid; `per_thread` counts samples per thread id.
pub fn processes(defs: &Definitions, per_thread: &[u64]) -> Vec<ProcessInfo> {
    let mut by_pid: BTreeMap<u32, ProcessInfo> = BTreeMap::new();
    let entry = |m: &mut BTreeMap<u32, ProcessInfo>, pid: u32| {
        m.entry(pid).or_insert_with(|| ProcessInfo {
            pid,
            program: String::new(),
            samples: 0,
            threads: 0,
            ended: false,
        });
    };
    for t in defs.threads() {
        entry(&mut by_pid, t.pid);
        let p = by_pid.get_mut(&t.pid).expect("inserted");
        p.threads += 1;
        p.samples += per_thread.get(t.id.index()).copied().unwrap_or(0);
        if t.tid == t.pid && !t.name.is_empty() {
            p.program = t.name.clone();
        }
    }
    let mut any_module: BTreeMap<u32, (bool, bool)> = BTreeMap::new(); // (has, any active)
    for m in defs.modules() {
        entry(&mut by_pid, m.pid);
        let e = any_module.entry(m.pid).or_insert((false, false));
        e.0 = true;
        e.1 |= defs.is_module_active(m.id);
    }
    for (pid, p) in by_pid.iter_mut() {
        let (has, active) = any_module.get(pid).copied().unwrap_or((false, false));
        p.ended = has && !active;
        // The latest module whose file name starts with the thread name.
        let named = defs.modules().iter().rev().filter(|m| m.pid == *pid).find(|m| {
            let name = m.path().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            !p.program.is_empty() && name.starts_with(&p.program)
        });
        match named {
            Some(m) => p.program = m.path().display().to_string(),
            None if p.program.is_empty() => {
                if let Some(m) = defs.modules().iter().find(|m| m.pid == *pid) {
                    p.program = m.path().display().to_string();
                }
            }
            None => {}
        }
    }
    by_pid.into_values().collect()
}
