//! The processes of a spool (for `info`, `top --per-process` and the Firefox
//! export): a process is a pid that has threads or modules; its program is
//! [`program_module`]'s path (the executable of its latest image), else the
//! name its main thread (tid = pid) was last defined with; it *ended* when the
//! spool retired every module of it (a recording made by `spulse record`
//! retires a process's modules when it exits, is killed or execs; an embedded
//! recording retires none).

use std::collections::BTreeMap;

use spulse::{Definitions, Module};

/// The executable a process ran last ([`Definitions::executable_of`]).
/// Thread names are not used: they are cut at 15 bytes, taken on a thread's
/// first sample (a forked child keeps its parent's until it execs), and a
/// program's work may run on threads other than its main one.
pub fn program_module(defs: &Definitions, pid: u32) -> Option<&Module> {
    defs.executable_of(pid)
}

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
        if let Some(m) = program_module(defs, *pid) {
            p.program = m.path().display().to_string();
        }
    }
    by_pid.into_values().collect()
}
