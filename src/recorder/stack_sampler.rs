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

use rustc_hash::FxHashMap as HashMap;

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
    /// What `capture_blocked` read of the code (a function's start by pc,
    /// the call before a return address), for the module generation it
    /// holds: a few system calls each, the same addresses at every capture.
    code: CodeReads,
    /// Samples whose walk stopped at the executable's frames while its
    /// tables were being checked: see [`Waiting`].
    waiting: Waiting,
}

/// Samples kept (registers and stack bytes) while the executable's unwind
/// tables are being checked (`modules::DeferredTables`: a few hundred ms for
/// a large debug build), to be unwound again once they are, rather than
/// written stopped at the executable's first frame: the kernel's stack copy
/// is in hand, so the walk can wait. At most [`Waiting::MAX_BYTES`] of stack
/// bytes; a sample beyond that is written stopped there, as before.
#[derive(Default)]
struct Waiting {
    samples: Vec<WaitingSample>,
    bytes: Vec<u8>,
}

struct WaitingSample {
    time_ns: u64,
    tid: u32,
    generation: u64,
    regs: Regs,
    /// Its stack copy: `bytes[stack.start..stack.end]`.
    stack: std::ops::Range<usize>,
    /// A kernel-time sample's weight (`None`: a user-time sample).
    kernel: Option<u32>,
}

impl Waiting {
    /// 16 MiB: 1,000 samples of the default 16 KiB copy (one busy thread
    /// for a second at the default rate, eight for an eighth of one).
    const MAX_BYTES: usize = 16 << 20;

    /// Keep `s` if the walk `(n, truncated)` in `out` stopped at the code
    /// whose tables are pending in `snap` and there is room: true if kept.
    fn keep(
        &mut self,
        snap: &UnwindSnapshot,
        out: &[u64],
        n: usize,
        regs: Regs,
        s: &StackSample<'_>,
        kernel: Option<u32>,
    ) -> bool {
        let Some(pending) = &snap.unwinder.pending else { return false };
        let stopped_there = n > 0 && {
            let last = out[n - 1];
            let lookup = if n == 1 { last } else { last.wrapping_sub(1) };
            pending.contains(&lookup)
        };
        if !stopped_there || self.bytes.len() + s.stack.len() > Self::MAX_BYTES {
            return false;
        }
        let start = self.bytes.len();
        self.bytes.extend_from_slice(s.stack);
        self.samples.push(WaitingSample {
            time_ns: s.time_ns,
            tid: s.tid,
            generation: snap.generation,
            regs,
            stack: start..self.bytes.len(),
            kernel,
        });
        true
    }
}

/// Reads of our own code by [`StackSampler::capture_blocked`], kept for one
/// module generation (a library unloaded or loaded makes them stale); at
/// most [`CodeReads::MAX`] of each, then cleared.
#[derive(Default)]
struct CodeReads {
    generation: u64,
    starts: HashMap<u64, Option<u64>>,
    calls: HashMap<u64, Option<Call>>,
}

impl CodeReads {
    const MAX: usize = 4096;

    fn at(&mut self, generation: u64) -> &mut CodeReads {
        if self.generation != generation || self.starts.len() > Self::MAX || self.calls.len() > Self::MAX {
            self.starts.clear();
            self.calls.clear();
            self.generation = generation;
        }
        self
    }
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
            code: CodeReads::default(),
            waiting: Waiting::default(),
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
        let StackSampler { cache, batch, addrs, out, waiting, .. } = self;
        let lost = events.drain(&mut |s: &StackSample<'_>| {
            counters.signals.fetch_add(1, Ordering::Relaxed);
            let (n, truncated, on_stack) = unwind_sample(s, snap, cache, out);
            if !on_stack {
                counters.foreign_stack.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(r) = s.regs.filter(|_| on_stack && truncated) {
                let regs = Regs { pc: r.pc, sp: r.sp, fp: r.fp, lr: r.lr };
                if waiting.keep(snap, out, n, regs, s, None) {
                    return;
                }
            }
            let unwound = Unwound::user(s.time_ns, s.tid, snap.generation, (n, truncated));
            push(unwound, &out[..n], batch, addrs, counters);
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
        let StackSampler { cache, batch, addrs, out, waiting, .. } = self;
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
            if truncated && waiting.keep(snap, out, n, regs, s, Some(w)) {
                return;
            }
            let unwound = Unwound::kernel(s.time_ns, s.tid, snap.generation, (n, truncated), w);
            push_kernel(unwound, &out[..n], own, batch, addrs, counters);
        });
        if lost > 0 {
            counters.lost_ring_full.fetch_add(lost, Ordering::Relaxed);
        }
    }
}

impl StackSampler {
    /// Whether samples wait for the executable's tables (see [`Waiting`]).
    pub(crate) fn has_waiting(&self) -> bool {
        !self.waiting.samples.is_empty()
    }

    /// Unwind the samples kept while the executable's tables were pending
    /// into [`StackSampler::batch`] (appended to what it holds), with `snap`:
    /// the same module generation as theirs, with the tables checked, or
    /// still pending (the check given up, or the modules about to change:
    /// they then stop at the executable's frames, as they would have).
    pub(crate) fn release_waiting(
        &mut self,
        snap: &UnwindSnapshot,
        counters: &Counters,
        own: Option<(u64, u64)>,
    ) {
        let StackSampler { cache, batch, addrs, out, waiting, .. } = self;
        for w in waiting.samples.drain(..) {
            let bytes = &waiting.bytes[w.stack.clone()];
            let out = match w.kernel {
                Some(_) => {
                    let keep = out.len().saturating_sub(1).max(1);
                    &mut out[..keep]
                }
                None => &mut out[..],
            };
            let walk = unwind_copy(&w.regs, bytes, snap, cache, out);
            let frames = &out[..walk.0];
            match w.kernel {
                None => {
                    push(Unwound::user(w.time_ns, w.tid, w.generation, walk), frames, batch, addrs, counters)
                }
                Some(weight) => {
                    let u = Unwound::kernel(w.time_ns, w.tid, w.generation, walk, weight);
                    push_kernel(u, frames, own, batch, addrs, counters)
                }
            }
        }
        waiting.bytes = Vec::new();
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
        bias_of: &dyn Fn(u64) -> Option<u64>,
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
        // wrapper leaves the register as its caller set it, pointing at that
        // caller's frame record, somewhere above `sp`: see [`choose_frame_record`].
        if len > 0 {
            let stopped_at = self.out[len - 1];
            // The start of the function the walk stopped in (its unwind
            // table entry, read from our own memory).
            let f_pc = stopped_at.wrapping_sub(1);
            let code = self.code.at(snap.generation);
            let f_start = *code
                .starts
                .entry(f_pc)
                .or_insert_with(|| bias_of(f_pc).and_then(|b| function_start(f_pc, b)));
            let is_code = |a: u64| bias_of(a).is_some();
            let mut best: Option<(Choice, u64)> = None;
            for fp in frame_record_candidates(b.sp, bytes, &is_code).take(32) {
                let r = Regs { pc: b.pc, sp: b.sp, fp, lr: 0 };
                let (l, t) = unwind_copy(&r, bytes, snap, &mut self.cache, &mut self.scratch);
                if l <= len {
                    continue;
                }
                let ret = self.scratch[len];
                let call = *self.code.calls.entry(ret).or_insert_with(|| call_before(ret));
                let Some(choice) = Choice::of(stopped_at, f_start, call, !t, fp) else { continue };
                if best.as_ref().is_none_or(|(c, _)| choice > *c) {
                    best = Some((choice, fp));
                }
            }
            if let Some((_, fp)) = best {
                let r = Regs { pc: b.pc, sp: b.sp, fp, lr: 0 };
                (len, truncated) = unwind_copy(&r, bytes, snap, &mut self.cache, &mut self.out);
            }
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

/// How well a guessed frame record fits the frame whose unwinding needed it
/// (see [`StackSampler::capture_blocked`]). The candidates are the words of
/// the stack copy followed by an address in known code, lowest first; among
/// them lie the real record of the function `f` that made the system call,
/// stale records left in its frame by calls made before it (a walk through
/// one goes on into functions that are not `f`'s callers, often deeper than
/// the real walk, and may reach the root as well), arrays of function
/// pointers (each read as a return address into the function before it),
/// and the records of `f`'s callers above it (a walk from one skips `f`'s
/// caller). A return address must follow a call instruction (not a function
/// pointer), and not a call to an address past `f`'s pc. The best fit is a
/// call to `f`'s start (its unwind table entry's), direct or through a GOT
/// slot (read from our own memory): no other record holds one. Then (a call
/// to `f` through a register or a PLT stub cannot be checked) a walk that
/// reaches the thread's root, then the lowest record (the callers' lie
/// above).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Choice {
    /// The call before the return address is to `f`'s start.
    to_f: bool,
    /// The walk reached the root.
    complete: bool,
    /// Lower records first.
    lower: std::cmp::Reverse<u64>,
}

impl Choice {
    /// `at`: the return address into `f` the walk stopped at without a frame
    /// pointer; `f_start`: `f`'s start, if known; `call`: the call before the
    /// return address the candidate record at `fp` holds (the next frame of
    /// its walk, [`call_before`]); `complete`: that walk reached the root.
    /// `None` if there is no call instruction there, or a call past `f`'s pc.
    fn of(at: u64, f_start: Option<u64>, call: Option<Call>, complete: bool, fp: u64) -> Option<Choice> {
        let to_f = match call? {
            Call::Direct(t) if t > at.wrapping_sub(1) => return None,
            Call::Direct(t) => Some(t) == f_start,
            _ => false,
        };
        Some(Choice { to_f, complete, lower: std::cmp::Reverse(fp) })
    }
}

/// The start of the function holding `pc` in the object loaded with `bias`:
/// the greatest initial location at most `pc` in the search table of its
/// `.eh_frame_hdr` (found through its program headers), read from our own
/// memory (`process_vm_readv`: an unmapped address is a `None`). Only the
/// usual encodings (a table of 32-bit offsets from the header); `None` for
/// others, and for an object whose ELF header is not at `bias`.
fn function_start(pc: u64, bias: u64) -> Option<u64> {
    fn read<const N: usize>(at: u64) -> Option<[u8; N]> {
        let mut b = [0u8; N];
        (blocked::copy_stack(at, &mut b).ok()? == N).then_some(b)
    }
    let u16_at = |at: u64| read::<2>(at).map(u16::from_le_bytes);
    let u32_at = |at: u64| read::<4>(at).map(u32::from_le_bytes);
    let u64_at = |at: u64| read::<8>(at).map(u64::from_le_bytes);
    if read::<4>(bias)? != *b"\x7fELF" {
        return None;
    }
    let phoff = u64_at(bias.checked_add(32)?)?;
    let (phentsize, phnum) = (u16_at(bias.checked_add(54)?)? as u64, u16_at(bias.checked_add(56)?)?);
    let mut hdr = None;
    for i in 0..phnum.min(256) as u64 {
        let ph = bias.checked_add(phoff)?.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(ph)? == 0x6474_e550 {
            hdr = Some(bias.checked_add(u64_at(ph.checked_add(16)?)?)?);
            break;
        }
    }
    let hdr = hdr?;
    let [version, ptr_enc, count_enc, table_enc] = read::<4>(hdr)?;
    let ptr_size = match ptr_enc & 0x0f {
        0x03 | 0x0b => 4,
        0x00 | 0x04 | 0x0c => 8,
        _ => return None,
    };
    if version != 1 || count_enc != 0x03 || table_enc != 0x3b {
        return None;
    }
    let count = u32_at(hdr.checked_add(4 + ptr_size)?)? as u64;
    let table = hdr.checked_add(4 + ptr_size + 4)?;
    let loc = |i: u64| -> Option<u64> {
        let rel = u32_at(table.checked_add(i.checked_mul(8)?)?)? as i32;
        Some(hdr.wrapping_add(rel as i64 as u64))
    };
    // The last entry at most pc.
    let (mut lo, mut hi) = (0u64, count);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if loc(mid)? <= pc {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if lo == 0 {
        return None;
    }
    loc(lo - 1)
}

/// The call instruction that ends just before a return address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    /// A direct call, to this address.
    Direct(u64),
    /// A call through the 8-byte slot at this address (`call [rip + disp]`:
    /// a GOT entry, as Rust calls into another crate).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Slot(u64),
    /// A call through a register or other memory.
    Indirect,
}

/// The call instruction whose return address is `ret`, read from this
/// process's own memory (`process_vm_readv`: an unmapped address is a
/// `None`, never a fault).
fn call_before(ret: u64) -> Option<Call> {
    let mut code = [0u8; 8];
    let from = ret.checked_sub(code.len() as u64)?;
    if blocked::copy_stack(from, &mut code).ok()? != code.len() {
        return None;
    }
    match decode_call(&code, ret)? {
        Call::Slot(at) => {
            let mut slot = [0u8; 8];
            Some(match blocked::copy_stack(at, &mut slot) {
                Ok(8) => Call::Direct(u64::from_ne_bytes(slot)),
                _ => Call::Indirect,
            })
        }
        call => Some(call),
    }
}

/// [`call_before`] on the 8 code bytes before `ret`.
#[cfg(target_arch = "x86_64")]
fn decode_call(code: &[u8; 8], ret: u64) -> Option<Call> {
    // `call rel32`: e8 and a displacement from the return address.
    if code[3] == 0xe8 {
        let rel = i32::from_le_bytes([code[4], code[5], code[6], code[7]]);
        return Some(Call::Direct(ret.wrapping_add(rel as i64 as u64)));
    }
    // `call r/m64`: ff /2 (after any prefix), ending at the return address:
    // its length from the ModRM byte, the SIB byte and the displacement.
    for at in 0..7usize {
        let (op, modrm) = (code[at], code[at + 1]);
        if op != 0xff || (modrm >> 3) & 7 != 2 {
            continue;
        }
        let (md, rm) = (modrm >> 6, modrm & 7);
        let mut len = 2;
        if md != 3 && rm == 4 {
            len += 1;
            if md == 0 && code.get(at + 2).is_some_and(|sib| sib & 7 == 5) {
                len += 4;
            }
        }
        len += match (md, rm) {
            (0, 5) => 4,
            (1, _) => 1,
            (2, _) => 4,
            _ => 0,
        };
        if at + len == code.len() {
            if modrm == 0x15 {
                let disp = i32::from_le_bytes([code[at + 2], code[at + 3], code[at + 4], code[at + 5]]);
                return Some(Call::Slot(ret.wrapping_add(disp as i64 as u64)));
            }
            return Some(Call::Indirect);
        }
    }
    None
}

/// [`call_before`] on the 8 code bytes before `ret`.
#[cfg(target_arch = "aarch64")]
fn decode_call(code: &[u8; 8], ret: u64) -> Option<Call> {
    let insn = u32::from_le_bytes([code[4], code[5], code[6], code[7]]);
    let at = ret.wrapping_sub(4);
    if insn & 0xfc00_0000 == 0x9400_0000 {
        // bl imm26: a signed word offset.
        let off = (((insn & 0x03ff_ffff) << 6) as i32 >> 6) as i64 * 4;
        return Some(Call::Direct(at.wrapping_add(off as u64)));
    }
    // blr, blraa/blrab and their zero-modifier forms.
    if insn & 0xffff_fc1f == 0xd63f_0000 || insn & 0xfeff_f800 == 0xd63f_0800 {
        return Some(Call::Indirect);
    }
    None
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
impl Unwound {
    /// A user-time sample from the walk `(n, truncated)`.
    fn user(time_ns: u64, tid: u32, generation: u64, (len, truncated): (usize, bool)) -> Unwound {
        Unwound {
            time_us: time_ns / 1000,
            tid,
            generation,
            truncated,
            weight: 1,
            kernel: false,
            start: 0,
            len,
        }
    }

    /// A kernel-time sample weighing `weight` intervals.
    fn kernel(time_ns: u64, tid: u32, generation: u64, walk: (usize, bool), weight: u32) -> Unwound {
        Unwound { weight, kernel: true, ..Unwound::user(time_ns, tid, generation, walk) }
    }
}

/// Append user-time sample `u` with addresses `frames` to the batch, or count
/// it lost if the walk found no frame.
fn push(mut u: Unwound, frames: &[u64], batch: &mut Vec<Unwound>, addrs: &mut Vec<u64>, counters: &Counters) {
    if frames.is_empty() {
        counters.lost_unwind_failed.fetch_add(u.weight as u64, Ordering::Relaxed);
        return;
    }
    if u.truncated {
        counters.truncated.fetch_add(1, Ordering::Relaxed);
    }
    u.start = addrs.len();
    batch.push(u);
    addrs.extend_from_slice(frames);
}

/// [`push`] for a kernel-time sample: one whose user pc or any frame lies in
/// `own` (the signal return trampoline) is dropped and counted
/// (`Counters::own_dropped`); see [`StackSampler::collect_kernel`].
fn push_kernel(
    u: Unwound,
    frames: &[u64],
    own: Option<(u64, u64)>,
    batch: &mut Vec<Unwound>,
    addrs: &mut Vec<u64>,
    counters: &Counters,
) {
    let in_own = |a: u64| own.is_some_and(|(lo, hi)| (lo..hi).contains(&a));
    if !frames.is_empty() && frames.iter().any(|&a| in_own(a) || in_own(a.wrapping_sub(1))) {
        counters.own_dropped.fetch_add(u.weight as u64, Ordering::Relaxed);
        return;
    }
    if !frames.is_empty() {
        counters.kernel.fetch_add(u.weight as u64, Ordering::Relaxed);
    }
    push(u, frames, batch, addrs, counters);
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The 8 bytes before a return address: `tail` at the end, `0xcc`
    /// (int3 padding) before it.
    fn before(tail: &[u8]) -> [u8; 8] {
        let mut code = [0xccu8; 8];
        code[8 - tail.len()..].copy_from_slice(tail);
        code
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn calls_before_a_return_address_are_decoded() {
        let ret = 0x5000_1000u64;
        // call rel32 (-0x800): to ret - 0x800.
        assert_eq!(
            decode_call(&before(&[0xe8, 0x00, 0xf8, 0xff, 0xff]), ret),
            Some(Call::Direct(ret - 0x800))
        );
        // call rel32 (+0x20).
        assert_eq!(decode_call(&before(&[0xe8, 0x20, 0, 0, 0]), ret), Some(Call::Direct(ret + 0x20)));
        // call [rip + 0x3020]: through the slot there.
        assert_eq!(
            decode_call(&before(&[0xff, 0x15, 0x20, 0x30, 0x00, 0x00]), ret),
            Some(Call::Slot(ret + 0x3020))
        );
        for tail in [
            &[0xff, 0xd0][..],                           // call rax
            &[0x41, 0xff, 0xd4],                         // call r12
            &[0xff, 0x50, 0x18],                         // call [rax + 0x18]
            &[0xff, 0x54, 0x24, 0x08],                   // call [rsp + 8]
            &[0xff, 0x94, 0x24, 0x00, 0x01, 0x00, 0x00], // call [rsp + 0x100]
            &[0x41, 0xff, 0x10],                         // call [r8]
        ] {
            assert_eq!(decode_call(&before(tail), ret), Some(Call::Indirect), "{tail:x?}");
        }
        for tail in [
            &[0xc3][..],               // the end of the function before: ret
            &[0x5d, 0xc3],             // pop rbp; ret
            &[0x0f, 0x1f, 0x40, 0x00], // nop padding
            &[0xff, 0xe0],             // jmp rax (ff /4), not a call
            &[0xff, 0x15, 0x10],       // too short for its displacement
        ] {
            assert_eq!(decode_call(&before(tail), ret), None, "{tail:x?}");
        }
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn calls_before_a_return_address_are_decoded() {
        let ret = 0x5000_1000u64;
        let word = |w: u32| before(&w.to_le_bytes());
        // bl -0x800 (imm26 = -0x200 words).
        assert_eq!(
            decode_call(&word(0x9400_0000 | (0x0400_0000 - 0x200)), ret),
            Some(Call::Direct(ret - 4 - 0x800))
        );
        assert_eq!(decode_call(&word(0x9400_0010), ret), Some(Call::Direct(ret - 4 + 0x40)));
        assert_eq!(decode_call(&word(0xd63f_0100), ret), Some(Call::Indirect)); // blr x8
        assert_eq!(decode_call(&word(0xd65f_03c0), ret), None); // ret
        assert_eq!(decode_call(&word(0xd503_201f), ret), None); // nop
    }

    #[test]
    fn the_call_to_the_waiting_function_then_a_complete_walk_then_the_lowest_record() {
        let fit = |to_f, complete, fp| Choice { to_f, complete, lower: std::cmp::Reverse(fp) };
        // The call to f itself beats a lower record with a complete walk.
        assert!(fit(true, false, 0x7000_0100) > fit(false, true, 0x7000_0010));
        // Then a complete walk beats a truncated one from a lower record (a
        // stale record's walk into memory that is no frame).
        assert!(fit(false, true, 0x7000_0100) > fit(false, false, 0x7000_0010));
        // Then the lowest record (the callers' lie above).
        assert!(fit(false, true, 0x7000_0010) > fit(false, true, 0x7000_0100));
    }

    #[inline(never)]
    fn a_function_of_ours(x: u64) -> u64 {
        std::hint::black_box(x).wrapping_mul(3)
    }

    /// The start of a function of this test binary, from its own unwind
    /// table, and none outside every function.
    #[test]
    fn a_functions_start_is_read_from_its_unwind_table() {
        let f = a_function_of_ours as *const () as u64;
        let exe = crate::recorder::modules::scan(
            &std::fs::read_link("/proc/self/exe").unwrap().into_os_string().into_encoded_bytes(),
            &|_| false,
            false,
        );
        let obj =
            exe.iter().find(|o| o.segments.iter().any(|s| (s.avma..s.avma + s.size).contains(&f))).unwrap();
        // Under qemu-user, `process_vm_readv` reads the host's addresses, not
        // the guest's: nothing is read, and the start is unknown (the
        // candidates are then chosen by the walk alone). Checked for real.
        let probe = 0x5eed_u64;
        let mut copy = [0u8; 8];
        let reads = blocked::copy_stack(std::hint::black_box(&probe) as *const u64 as u64, &mut copy).ok()
            == Some(8)
            && u64::from_ne_bytes(copy) == probe;
        if !reads {
            eprintln!(
                "process_vm_readv does not read this process's memory here (qemu-user): no function start"
            );
            assert_eq!(function_start(f + 3, obj.key.bias), None);
            return;
        }
        assert_eq!(function_start(f + 3, obj.key.bias), Some(f));
        assert_eq!(function_start(f, obj.key.bias), Some(f));
        assert_eq!(a_function_of_ours(2), 6);
        // Not an ELF object there.
        assert_eq!(function_start(f, f), None);
    }
}
