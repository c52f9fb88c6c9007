//! The OS layer: the raw system calls and `/proc` reads of the recorder, the way
//! the rest of it sees Linux. `sigaction.rs` installs, restores and remembers
//! signal dispositions; `sigmask.rs` keeps SIGTRAP out of the threads' real
//! masks under an interposer; `perf.rs` opens the per-thread perf events;
//! `perf_stack.rs` the perf-stack engine's events and their mapped rings; `timer.rs`
//! arms the per-thread POSIX CPU timers and the process itimer; `tcb.rs` probes
//! glibc's thread control block; `maps.rs` finds the main thread's stack;
//! `perf_switch.rs` (the off-CPU mode's context-switch records), `pairing.rs`
//! (their pairing into intervals, and which blocked threads to capture) and
//! `blocked.rs` (a blocked thread's system call and stack, read without a
//! signal); `procfs.rs` names this process's threads under a `/proc` of
//! another pid namespace; `vdso.rs` finds a symbol of the vDSO (aarch64's signal return
//! trampoline). The
//! functions here that the signal handler calls ([`gettid`], [`now_us`],
//! [`sigaction::previous_of`] and [`sigmask::program_blocks_trap`]) are
//! async-signal-safe: a system call or a vDSO clock read, atomics, or a read
//! of the thread control block.

pub(crate) mod blocked;
pub(crate) mod maps;
pub(crate) mod pairing;
pub(crate) mod perf;
pub(crate) mod perf_kernel;
pub(crate) mod perf_stack;
pub(crate) mod perf_switch;
pub(crate) mod preloaded;
pub(crate) mod procfs;
pub(crate) mod sigaction;
pub(crate) mod sigmask;
pub(crate) mod tcb;
mod tid_map;
pub(crate) mod timer;
// Used on aarch64 only (x86_64 finds its trampoline in the action); tested on both.
#[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
pub(crate) mod vdso;

pub(crate) use procfs::list_tids;

use std::os::fd::{AsRawFd, BorrowedFd};

/// The value our perf events and timers carry in their signal information, by
/// which the handler tells our signals from anyone else's.
pub(crate) const SIGNAL_MAGIC: u64 = 0x5350_554c_5345_0001;

/// The calling thread's kernel id.
#[inline]
pub(crate) fn gettid() -> u32 {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

/// CPUs this process may run on (its affinity mask; at least 1). One
/// syscall: `std::thread::available_parallelism` also reads the cgroup quota
/// files, which costs a short-lived recorded process more than the answer is
/// worth for sizing the unwinders' cache pool.
pub(crate) fn cpus_allowed() -> usize {
    // SAFETY: an all-zero cpu_set_t is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is this thread.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return 1;
    }
    // SAFETY: CPU_COUNT reads the set that sched_getaffinity filled in.
    (unsafe { libc::CPU_COUNT(&set) } as usize).max(1)
}

/// Unix time in microseconds (vDSO clock_gettime: no lock, no allocation).
#[inline]
pub(crate) fn now_us() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000).wrapping_add(ts.tv_nsec as u64 / 1000)
}

/// Unix time in nanoseconds (the clock of the perf records, `CLOCK_REALTIME`).
pub(crate) fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// CPU time the calling thread has used.
pub(crate) fn thread_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass; the thread CPU clock exists on every Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    std::time::Duration::new(ts.tv_sec.max(0) as u64, ts.tv_nsec.clamp(0, 999_999_999) as u32)
}

/// Whether this process may lock memory beyond its limits (`CAP_IPC_LOCK`
/// in its effective set, `/proc/self/status`): perf rings then cost no
/// locked-memory allowance.
pub(crate) fn can_lock_memory() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// Whether the main executable is a Go program: a `PT_NOTE` segment of it
/// holds the Go linker's build id note (owner `Go`, type 4), read from the
/// program headers in memory (the auxiliary vector's; no file read).
pub(crate) fn go_program() -> bool {
    const PT_LOAD: u32 = 1;
    const PT_NOTE: u32 = 4;
    const PT_PHDR: u32 = 6;
    const NT_GO_BUILDID: u32 = 4;
    // SAFETY: getauxval only reads the auxiliary vector.
    let (phdr, phnum) = unsafe { (libc::getauxval(libc::AT_PHDR), libc::getauxval(libc::AT_PHNUM)) };
    if phdr == 0 || phnum == 0 || phnum > 4096 {
        return false;
    }
    // SAFETY: the kernel maps the executable's program headers at AT_PHDR, AT_PHNUM of them, for the life of the process.
    let headers = unsafe { std::slice::from_raw_parts(phdr as *const libc::Elf64_Phdr, phnum as usize) };
    // The load bias: where PT_PHDR says the headers are, against where they are.
    let bias = match headers.iter().find(|h| h.p_type == PT_PHDR) {
        Some(own) => (phdr as usize).wrapping_sub(own.p_vaddr as usize),
        None => 0,
    };
    let loaded = |start: usize, len: usize| {
        headers.iter().filter(|h| h.p_type == PT_LOAD).any(|h| {
            let seg = bias.wrapping_add(h.p_vaddr as usize);
            start >= seg && start.saturating_add(len) <= seg.saturating_add(h.p_memsz as usize)
        })
    };
    for h in headers.iter().filter(|h| h.p_type == PT_NOTE) {
        let (start, len) = (bias.wrapping_add(h.p_vaddr as usize), h.p_memsz as usize);
        if len > 1 << 16 || !loaded(start, len) {
            continue;
        }
        // SAFETY: the note segment lies within a loaded segment of the executable (checked just above), mapped for the life of the process.
        let notes = unsafe { std::slice::from_raw_parts(start as *const u8, len) };
        let mut at = 0;
        while at + 12 <= len {
            let word = |i: usize| u32::from_ne_bytes(notes[at + i..at + i + 4].try_into().unwrap_or([0; 4]));
            let (namesz, descsz, kind) = (word(0) as usize, word(4) as usize, word(8));
            let name_end = at + 12 + namesz;
            if name_end > len {
                break;
            }
            // (Go's linker writes the name padded: "Go\0\0".)
            let name = &notes[at + 12..name_end];
            if kind == NT_GO_BUILDID
                && name.iter().rposition(|&b| b != 0).is_some_and(|i| &name[..=i] == b"Go")
            {
                return true;
            }
            let pad = |n: usize| n.div_ceil(4) * 4;
            at = at + 12 + pad(namesz) + pad(descsz);
        }
    }
    false
}

/// Whether a tracer (a debugger, `strace`) is attached to this process
/// (`TracerPid` in `/proc/self/status`).
pub(crate) fn traced() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().find_map(|l| l.strip_prefix("TracerPid:")).is_some_and(|v| v.trim() != "0"))
}

/// This process's id.
#[inline]
pub(crate) fn getpid() -> u32 {
    // SAFETY: getpid takes no arguments and cannot fail.
    unsafe { libc::getpid() as u32 }
}

/// An advisory whole-file lock (`flock`).
#[derive(Clone, Copy)]
pub(crate) enum Lock {
    /// `LOCK_EX`: the recorder's, held while a recording runs.
    Exclusive,
}

/// Take `lock` on `fd` without waiting (`LOCK_NB`): `EWOULDBLOCK` when another
/// open file description holds a conflicting lock.
pub(crate) fn try_lock(fd: BorrowedFd<'_>, lock: Lock) -> std::io::Result<()> {
    let op = match lock {
        Lock::Exclusive => libc::LOCK_EX,
    };
    // SAFETY: flock on a descriptor the caller keeps open for the call.
    if unsafe { libc::flock(fd.as_raw_fd(), op | libc::LOCK_NB) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Release this open file description's lock on `fd`.
pub(crate) fn unlock(fd: BorrowedFd<'_>) {
    // SAFETY: flock on a descriptor the caller keeps open for the call.
    unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_UN) };
}

#[cfg(test)]
mod tests {
    /// A Rust test binary has no Go note (`cli/tests/record_hostile.rs`
    /// records a program that has one).
    #[test]
    fn a_rust_program_is_not_taken_for_a_go_one() {
        assert!(!super::go_program());
    }
}
