//! Finding glibc's thread-control-block fields (`struct pthread`) that the
//! handler reads: the stack block and the kernel thread id. Probed at the first
//! start of a process on helper threads (and kept: later starts, a forked
//! child's among them, reuse it); `None` on another libc.

use std::os::raw::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::gettid;

/// A probe's answer, kept for the process: the C library does not change
/// while it runs, and a forked child (which starts a recorder of its own)
/// inherits it. 0: not probed yet; 1: `None`; else the offset plus 2. (An
/// atomic, not a `OnceLock`: a child forked while another thread of its
/// parent was probing must not wait for a thread it does not have.)
struct Probed(AtomicUsize);

impl Probed {
    const fn new() -> Probed {
        Probed(AtomicUsize::new(0))
    }

    fn get_or(&self, probe: impl FnOnce() -> Option<usize>) -> Option<usize> {
        match self.0.load(Ordering::SeqCst) {
            0 => {
                let found = probe();
                self.0.store(found.map_or(1, |o| o.saturating_add(2)), Ordering::SeqCst);
                found
            }
            1 => None,
            v => Some(v - 2),
        }
    }
}

static STACK_BLOCK_OFFSET: Probed = Probed::new();
static TID_OFFSET: Probed = Probed::new();

/// Find the offset of glibc's `stackblock`/`stackblock_size`/`guardsize` fields
/// in `struct pthread`, relative to `pthread_self()`, by inspecting two probe
/// threads with different stack sizes. `None` when the layout cannot be found
/// (another libc): then non-main threads record leaf-only samples.
pub(crate) fn stack_block_offset() -> Option<usize> {
    STACK_BLOCK_OFFSET.get_or(probe_stack_block_offset)
}

fn probe_stack_block_offset() -> Option<usize> {
    let run = |size: usize| {
        super::sigmask::spawn_quiet(
            std::thread::Builder::new().name("spulse-probe".into()).stack_size(size),
            probe_current,
        )
        .ok()?
        .join()
        .ok()?
    };
    let a = run(256 << 10)?;
    let b = run(1 << 20)?;
    (a == b).then_some(a)
}

/// Find the offset of glibc's `tid` field in `struct pthread` (relative to
/// `pthread_self()`), so the handler can read its thread id from memory instead
/// of making a `gettid` system call (~200 ns on this VM). Checked on two probe
/// threads and on the calling thread; `None` if they disagree. (A thread made
/// by a raw `clone` without glibc would read its creator's id: its samples would
/// be attributed to that thread; stack bounds are checked against `sp` and stay
/// safe either way.)
pub(crate) fn tid_offset() -> Option<usize> {
    TID_OFFSET.get_or(probe_tid_offset)
}

/// This thread's kernel thread id: read from glibc's `struct pthread` where
/// a probe already found the field ([`tid_offset`], run at a recorder's
/// start), else a `gettid` system call. Never probes, never allocates
/// (the heap sampler calls it from inside the allocator).
#[cfg(feature = "heap")]
pub(crate) fn current_tid() -> u32 {
    match TID_OFFSET.0.load(Ordering::SeqCst) {
        0 | 1 => gettid(),
        v => {
            // SAFETY: `tid`'s offset in glibc's struct pthread (`probe_tid_offset`); this thread's TCB is mapped.
            unsafe {
                std::ptr::read_volatile(
                    (libc::pthread_self() as u64).wrapping_add((v - 2) as u64) as *const u32
                )
            }
        }
    }
}

fn probe_tid_offset() -> Option<usize> {
    let find = || -> Vec<usize> {
        let tid = gettid();
        // SAFETY: pthread_self only reads the thread pointer.
        let tcb = unsafe { libc::pthread_self() } as u64;
        let mut v = Vec::new();
        // glibc's struct pthread is well over 1 KiB and holds the tid in its
        // first kilobyte; the whole struct is mapped (it is this thread's TCB).
        for off in (0..1024u64).step_by(4) {
            // SAFETY: within this thread's own struct pthread (see above).
            let w = unsafe { std::ptr::read_volatile((tcb + off) as *const u32) };
            if w == tid {
                v.push(off as usize);
            }
        }
        v
    };
    let run = || {
        super::sigmask::spawn_quiet(std::thread::Builder::new().name("spulse-probe".into()), find)
            .ok()?
            .join()
            .ok()
    };
    let (a, b, here) = (run()?, run()?, find());
    a.into_iter().find(|o| b.contains(o) && here.contains(o))
}

fn probe_current() -> Option<usize> {
    // SAFETY: standard pthread attribute queries on the calling thread; the attr
    // is initialized by pthread_getattr_np and destroyed afterwards.
    let (lo, size, tcb) = unsafe {
        let me = libc::pthread_self();
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(me, &mut attr) != 0 {
            return None;
        }
        let mut addr: *mut c_void = std::ptr::null_mut();
        let mut size: usize = 0;
        let r = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        if r != 0 {
            return None;
        }
        (addr as u64, size as u64, me as u64)
    };
    let hi = lo.checked_add(size)?;
    if !(lo < tcb && tcb < hi) {
        return None;
    }
    let mut off = 0u64;
    while tcb + off + 24 <= hi && off < 8192 {
        let p = (tcb + off) as *const u64;
        // SAFETY: [tcb, hi) is the top of this thread's own stack block (the TCB
        // and TLS glibc placed there), mapped and readable; reads are aligned
        // because the TCB is.
        let (block, bsize, guard) = unsafe {
            (std::ptr::read_volatile(p), std::ptr::read_volatile(p.add(1)), std::ptr::read_volatile(p.add(2)))
        };
        if block != 0
            && block.wrapping_add(guard) == lo
            && bsize.wrapping_sub(guard) == size
            && block.wrapping_add(bsize) >= tcb
        {
            return Some(off as usize);
        }
        off += 8;
    }
    None
}
