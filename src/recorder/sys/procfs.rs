//! This process's threads under `/proc`, where `/proc` may belong to another
//! pid namespace.
//!
//! A thread id from `gettid` (and the ids `perf_event_open` and
//! `timer_create` take) is the thread's id in its own pid namespace. A
//! `/proc` names threads as the namespace that mounted it sees them: in a
//! program started in a new pid namespace without a `/proc` of its own
//! (`unshare -pf CMD`, no `--mount-proc`), `/proc/self/task` lists ids
//! such as 23221 for a thread whose own id is 2. Opening a perf event or a
//! timer for 23221 then fails (`ESRCH`) or names another process's thread,
//! and `/proc/self/task/2` is not this thread: before this module such a
//! program was recorded with no sample at all.
//!
//! Where the two agree (the process's `/proc/self` link names its own pid,
//! almost always) every function here is the identity on ids. Where they do
//! not, each task's `NSpid:` line (`/proc/self/task/<id>/status`: its id in
//! the mount's namespace first, in its own namespace last) translates them,
//! and the translation is kept until a thread is not found in it.

use std::io;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

/// Whether this process's `/proc` is another namespace's: 0 not checked
/// yet, 1 its own, 2 another's. The fork child hook clears it
/// ([`forget_after_fork`]): a child may be in another namespace than its
/// parent was (the first process of a new one).
static CHECKED: AtomicU8 = AtomicU8::new(0);

/// Ids as (own namespace, the `/proc` mount's), for the pid in the first
/// field; used only where the `/proc` is another namespace's.
static TRANSLATION: Mutex<(u32, Vec<(u32, u32)>)> = Mutex::new((0, Vec::new()));

/// Whether `/proc/self` names a pid other than this process's own: `/proc`
/// belongs to another pid namespace (false if `/proc` cannot be read).
/// Checked once a process; then one atomic load.
pub(crate) fn foreign() -> bool {
    match CHECKED.load(Ordering::Relaxed) {
        1 => return false,
        2 => return true,
        _ => {}
    }
    let pid = super::getpid();
    let foreign = std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str().and_then(|s| s.parse::<u32>().ok()))
        .is_some_and(|named| named != pid);
    CHECKED.store(1 + u8::from(foreign), Ordering::Relaxed);
    foreign
}

/// Check again at the next call (a forked child: async-signal-safe, one
/// atomic store).
pub(crate) fn forget_after_fork() {
    CHECKED.store(0, Ordering::Relaxed);
}

/// Every thread id of this process, as `gettid` gives them.
pub(crate) fn list_tids() -> io::Result<Vec<u32>> {
    let listed = listed_tids()?;
    if !foreign() {
        return Ok(listed);
    }
    let pairs = translate_all(&listed);
    let own = pairs.iter().map(|&(own, _)| own).collect();
    remember(pairs);
    Ok(own)
}

/// The name under `/proc/self/task` of the thread whose own id is `tid`
/// (the same id unless [`foreign`]; `tid` itself if it is not found, so the
/// read that follows fails as for a thread that is gone).
pub(crate) fn task_name(tid: u32) -> u32 {
    if !foreign() {
        return tid;
    }
    if let Some(name) = lookup(tid) {
        return name;
    }
    let Ok(listed) = listed_tids() else { return tid };
    let pairs = translate_all(&listed);
    let found = pairs.iter().find(|&&(own, _)| own == tid).map(|&(_, name)| name);
    remember(pairs);
    found.unwrap_or(tid)
}

/// The path of `file` of the thread whose own id is `tid`.
pub(crate) fn task_path(tid: u32, file: &str) -> String {
    format!("/proc/self/task/{}/{file}", task_name(tid))
}

/// The entries of `/proc/self/task`, as that `/proc` names them.
fn listed_tids() -> io::Result<Vec<u32>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc/self/task")? {
        let e = e?;
        if let Some(t) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
            v.push(t);
        }
    }
    Ok(v)
}

/// (own id, listed id) for each listed thread still there to be read.
fn translate_all(listed: &[u32]) -> Vec<(u32, u32)> {
    listed
        .iter()
        .filter_map(|&name| {
            let status = std::fs::read_to_string(format!("/proc/self/task/{name}/status")).ok()?;
            Some((own_id(&status)?, name))
        })
        .collect()
}

/// The last id of a `status` file's `NSpid:` line: the task's id in its own
/// pid namespace.
fn own_id(status: &str) -> Option<u32> {
    status.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_ascii_whitespace().last()?.parse().ok()
}

/// Keep `pairs` (not if another thread holds the table: never waited for,
/// since a child forked while the writer held it would wait forever).
fn remember(pairs: Vec<(u32, u32)>) {
    let mut t = match TRANSLATION.try_lock() {
        Ok(t) => t,
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    *t = (super::getpid(), pairs);
}

/// The kept translation of `tid` (none while another thread holds the
/// table: the caller then lists the threads itself).
fn lookup(tid: u32) -> Option<u32> {
    let t = match TRANSLATION.try_lock() {
        Ok(t) => t,
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return None,
    };
    if t.0 != super::getpid() {
        return None;
    }
    t.1.iter().find(|&&(own, _)| own == tid).map(|&(_, name)| name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_nspid_is_the_own_id() {
        assert_eq!(own_id("Name:\tx\nNSpid:\t23221\t2\nNSpgid:\t1\n"), Some(2));
        assert_eq!(own_id("NSpid:\t77\n"), Some(77));
        assert_eq!(own_id("Name:\tx\n"), None, "a kernel without NSpid");
        assert_eq!(own_id("NSpid:\t\n"), None);
    }

    /// This thread is listed under its own id, and its path leads to its
    /// own `status` (in a `/proc` of another namespace too).
    #[test]
    fn a_thread_is_found_under_its_own_id() {
        let me = super::super::gettid();
        assert!(list_tids().unwrap().contains(&me));
        let status = std::fs::read_to_string(task_path(me, "status")).unwrap();
        assert_eq!(own_id(&status), Some(me));
        if !foreign() {
            assert_eq!(task_name(me), me);
        }
    }
}
