//! The perf-stack engine's writer side: turn the samples the kernel copied into
//! the per-thread rings (`sys/perf_stack.rs`) into the same raw samples the
//! signal handler produces, by unwinding each one with framehop, here in the
//! writer thread, against the copied stack bytes.
//!
//! The unwinder is the handler's current module snapshot (the writer thread
//! is the one that replaces it, so it stays alive while used here) and the
//! same walk (`handler::unwind::unwind_into`); every stack read is served from
//! the copy, and a read outside it fails, which ends the walk as a truncated
//! stack. Nothing of the sampled thread's live memory is read. The samples go
//! through the writer's usual path (held until the module check covers them,
//! interned, written), and the counters are the handler's: `signals` counts
//! the samples the kernel delivered, `truncated` and `foreign_stack` (no
//! registers or no stack copy: leaf only) as in the handler, and lost samples
//! (ring full) `lost_ring_full`.

use std::sync::atomic::Ordering;

use super::handler::unwind::{unwind_into, Regs};
use super::handler::Counters;
use super::modules::{NativeCache, UnwindSnapshot};
use super::sys::blocked::{self, Missed};
use super::sys::pairing::Capture;
use super::sys::perf_kernel::KernelRings;
use super::sys::perf_stack::{StackEvents, StackSample};

/// One unwound sample waiting to be written; its addresses are
/// `addrs[start..start + len]` of the batch.
pub(crate) struct Unwound {
    pub time_us: u64,
    pub tid: u32,
    pub generation: u64,
    pub truncated: bool,
    /// Sample intervals it stands for (kernel-time samples: 8 or 9).
    pub weight: u32,
    /// A kernel-time sample: written with a kernel-mode leaf.
    pub kernel: bool,
    pub start: usize,
    pub len: usize,
}

/// The writer's unwinding state for the perf-stack engine.
pub(crate) struct StackSampler {
    cache: Box<NativeCache>,
    /// Samples of the last [`StackSampler::collect`], in ring order per thread.
    pub(crate) batch: Vec<Unwound>,
    pub(crate) addrs: Vec<u64>,
    out: Vec<u64>,
    /// A second output buffer (trial walks of `capture_blocked`).
    scratch: Vec<u64>,
}

impl StackSampler {
    /// A sampler keeping at most `depth` frames per sample.
    pub(crate) fn new(depth: usize) -> StackSampler {
        StackSampler {
            cache: Box::new(NativeCache::new_in()),
            batch: Vec::new(),
            addrs: Vec::new(),
            out: vec![0; depth.max(1)],
            scratch: vec![0; depth.max(1)],
        }
    }

    /// Forget the samples of the last batch (after they were written).
    pub(crate) fn clear(&mut self) {
        self.batch.clear();
        self.addrs.clear();
    }

    /// Drain every ring of `events` and unwind each sample with `snap` into
    /// [`StackSampler::batch`] (appended to what it holds); update `counters`.
    pub(crate) fn collect(&mut self, events: &mut StackEvents, snap: &UnwindSnapshot, counters: &Counters) {
        let StackSampler { cache, batch, addrs, out, .. } = self;
        let lost = events.drain(&mut |s: &StackSample<'_>| {
            counters.signals.fetch_add(1, Ordering::Relaxed);
            let (n, truncated, on_stack) = unwind_sample(s, snap, cache, out);
            if !on_stack {
                counters.foreign_stack.fetch_add(1, Ordering::Relaxed);
            }
            if n == 0 {
                counters.lost_unwind_failed.fetch_add(1, Ordering::Relaxed);
                return;
            }
            if truncated {
                counters.truncated.fetch_add(1, Ordering::Relaxed);
            }
            batch.push(Unwound {
                time_us: s.time_ns / 1000,
                tid: s.tid,
                generation: snap.generation,
                truncated,
                weight: 1,
                kernel: false,
                start: addrs.len(),
                len: n,
            });
            addrs.extend_from_slice(&out[..n]);
        });
        if lost > 0 {
            counters.lost_ring_full.fetch_add(lost, Ordering::Relaxed);
        }
    }
}

impl StackSampler {
    /// Drain the kernel-time rings and unwind each sample's user stack into
    /// [`StackSampler::batch`] (appended to what it holds), each weighing
    /// `weight()` intervals. A sample whose user pc or any frame lies in
    /// `own` (the signal return trampoline our handler returns through: the
    /// period ended while the kernel returned from our own signal) is the
    /// profiler's time, not the program's: dropped and counted
    /// (`Counters::own_dropped`).
    pub(crate) fn collect_kernel(
        &mut self,
        rings: &mut KernelRings,
        snap: &UnwindSnapshot,
        counters: &Counters,
        own: Option<(u64, u64)>,
        weight: &mut dyn FnMut() -> u32,
    ) {
        let StackSampler { cache, batch, addrs, out, .. } = self;
        let in_own = |a: u64| own.is_some_and(|(lo, hi)| (lo..hi).contains(&a));
        let lost = rings.drain(&mut |s: &StackSample<'_>| {
            let w = weight();
            // A kernel sample without user registers or stack has no user
            // frame to charge (its ip is a kernel address).
            let Some(r) = s.regs.filter(|_| !s.stack.is_empty()) else {
                counters.lost_unwind_failed.fetch_add(w as u64, Ordering::Relaxed);
                return;
            };
            let regs = Regs { pc: r.pc, sp: r.sp, fp: r.fp, lr: r.lr };
            // The writer puts the kernel-mode leaf on top: it takes one of the
            // `max_stack_depth` frames, as in the handler.
            let keep = out.len().saturating_sub(1).max(1);
            let (n, truncated) = unwind_copy(&regs, s.stack, snap, cache, &mut out[..keep]);
            if n == 0 {
                counters.lost_unwind_failed.fetch_add(w as u64, Ordering::Relaxed);
                return;
            }
            if out[..n].iter().any(|&a| in_own(a) || in_own(a.wrapping_sub(1))) {
                counters.own_dropped.fetch_add(w as u64, Ordering::Relaxed);
                return;
            }
            if truncated {
                counters.truncated.fetch_add(1, Ordering::Relaxed);
            }
            counters.kernel.fetch_add(w as u64, Ordering::Relaxed);
            batch.push(Unwound {
                time_us: s.time_ns / 1000,
                tid: s.tid,
                generation: snap.generation,
                truncated,
                weight: w,
                kernel: true,
                start: addrs.len(),
                len: n,
            });
            addrs.extend_from_slice(&out[..n]);
        });
        if lost > 0 {
            counters.lost_ring_full.fetch_add(lost, Ordering::Relaxed);
        }
    }
}

impl StackSampler {
    /// Capture blocked thread `tid` for the off-CPU mode (`sys/blocked.rs`:
    /// no signal, the thread not woken) and unwind its stack copy with
    /// `snap`: the leaf is the pc its system call returns to. `copy` is the
    /// buffer for the stack bytes (its length is how much is copied), `buf`
    /// for the `/proc` reads; `schedstat`: see `blocked::capture`.
    pub(crate) fn capture_blocked(
        &mut self,
        tid: u32,
        snap: &UnwindSnapshot,
        copy: &mut [u8],
        buf: &mut Vec<u8>,
        is_code: &dyn Fn(u64) -> bool,
        schedstat: bool,
    ) -> Result<Capture, Missed> {
        let taken = blocked::capture(tid, copy, buf, schedstat)?;
        let (b, n) = (taken.blocked, taken.copied);
        let bytes = &copy[..n];
        let regs = Regs { pc: b.pc, sp: b.sp, fp: 0, lr: 0 };
        let (mut len, mut truncated) = unwind_copy(&regs, bytes, snap, &mut self.cache, &mut self.out);
        // `/proc/<tid>/syscall` gives no frame pointer, and code built with
        // frame pointers (Rust's std, for one) has unwind rules that need it:
        // the walk then stops at the first such frame. The system call
        // wrapper leaves the register as its caller set it, pointing at the
        // nearest frame record above `sp`, so try the lowest few plausible
        // frame records of the copy and keep the deepest walk (the first of
        // equals): a wrong guess skips frames or stops early.
        let mut best: Option<(usize, bool, u64)> = None;
        for fp in frame_record_candidates(b.sp, bytes, is_code).take(8) {
            let r = Regs { pc: b.pc, sp: b.sp, fp, lr: 0 };
            let (l, t) = unwind_copy(&r, bytes, snap, &mut self.cache, &mut self.scratch);
            if l > best.map_or(len, |(bl, _, _)| bl) {
                best = Some((l, t, fp));
            }
        }
        if let Some((_, _, fp)) = best {
            let r = Regs { pc: b.pc, sp: b.sp, fp, lr: 0 };
            (len, truncated) = unwind_copy(&r, bytes, snap, &mut self.cache, &mut self.out);
        }
        let addrs = if len == 0 { vec![b.pc] } else { self.out[..len].to_vec() };
        Ok(Capture {
            at_ns: taken.from_ns,
            end_ns: taken.to_ns,
            syscall: b.nr,
            generation: snap.generation,
            truncated: truncated || len == 0,
            addrs,
            stack: None,
        })
    }
}

/// Addresses in the stack copied from `sp` that hold a plausible frame record
/// (a word followed by a return address into known code), lowest first.
fn frame_record_candidates<'a>(
    sp: u64,
    bytes: &'a [u8],
    is_code: &'a dyn Fn(u64) -> bool,
) -> impl Iterator<Item = u64> + 'a {
    let word = move |i: usize| -> Option<u64> {
        Some(u64::from_ne_bytes(bytes.get(i * 8..i * 8 + 8)?.try_into().ok()?))
    };
    let end = sp.saturating_add(bytes.len() as u64);
    (0..bytes.len() / 8).filter_map(move |i| {
        let at = sp + 8 * i as u64;
        // The saved frame pointer itself is not checked: callers built
        // without frame pointers leave anything in the register.
        let ret = word(i + 1)?;
        (at + 16 <= end && ret > 0x1000 && is_code(ret - 1)).then_some(at)
    })
}

/// Unwind from `regs` over the stack bytes copied from `regs.sp` upwards.
fn unwind_copy(
    regs: &Regs,
    bytes: &[u8],
    snap: &UnwindSnapshot,
    cache: &mut NativeCache,
    out: &mut [u64],
) -> (usize, bool) {
    let lo = regs.sp;
    let mut read = |addr: u64| -> Result<u64, ()> {
        let off = addr.checked_sub(lo).ok_or(())? as usize;
        let end = off.checked_add(8).ok_or(())?;
        let w = bytes.get(off..end).ok_or(())?;
        Ok(u64::from_ne_bytes(w.try_into().map_err(|_| ())?))
    };
    unwind_into(&snap.unwinder, cache, regs, &mut read, out)
}

/// Unwind one sample into `out` (leaf first): the number of addresses,
/// whether the walk stopped before the root, and whether there was a stack to
/// walk. A sample without registers or without stack bytes keeps its leaf only.
fn unwind_sample(
    s: &StackSample<'_>,
    snap: &UnwindSnapshot,
    cache: &mut NativeCache,
    out: &mut [u64],
) -> (usize, bool, bool) {
    let regs = match s.regs {
        Some(r) if !s.stack.is_empty() => Regs { pc: r.pc, sp: r.sp, fp: r.fp, lr: r.lr },
        Some(r) => return leaf_only(r.pc, out),
        None => return leaf_only(s.ip, out),
    };
    let (n, truncated) = unwind_copy(&regs, s.stack, snap, cache, out);
    (n, truncated, true)
}

fn leaf_only(pc: u64, out: &mut [u64]) -> (usize, bool, bool) {
    match out.first_mut() {
        Some(w) if pc != 0 => {
            *w = pc;
            (1, true, false)
        }
        _ => (0, true, false),
    }
}
