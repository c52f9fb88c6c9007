//! The stack of a sampled allocation: framehop over the recorder's module
//! tables (the same scan, the same checked `.eh_frame` data, the same
//! `MustNotAllocateDuringUnwind` unwinder the CPU signal handler uses), walked
//! synchronously from the allocating thread's own registers.
//!
//! The unwinder is built at the process's first allocation (normally in the
//! runtime's start-up, before `main`, on its only thread: threads that sample
//! while another builds it go without their stacks), or at the first sample
//! if sampling was off then (with the re-entrancy guard set, so the
//! allocations of the scan itself pass through unsampled), and rebuilt when a walk ends in code outside every
//! object it knows and the loader's counters say objects were loaded or
//! unloaded since (checked at most once per [`RECHECK_NS`]: the loader is
//! never called on the ordinary sample path, see [`refresh`]). It is published through an `AtomicPtr`; a
//! replaced one is freed only when no unwind is running (a reader count),
//! otherwise leaked. Nothing here blocks: a thread that finds the unwinder
//! being built, or all [`CACHES`] unwinder caches in use, records the
//! allocation without its stack (the "[no stack]" entry).
//!
//! A walk reads stack memory only inside `[sp, top)` of the calling thread:
//! `sp` read at the start of the walk, `top` the end of the thread's stack as
//! `pthread_getattr_np` reports it (once per thread, kept in a `const`
//! thread-local). Both are mapped for as long as the walk runs. There is no
//! walk (the sample has no stack) unless `sp` lies on that stack: an
//! allocation made on another stack (a signal handler on an alternate signal
//! stack mapped apart, as Rust's own; a coroutine) would read `[sp, top)`
//! across whatever lies between that stack and the thread's.
//!
//! The walk itself runs on a stack of its own ([`WALK_STACK`] bytes with a
//! guard page, one per cache, taken with its cache), not on the allocating
//! thread's: the unwinder needs up to ~18 KiB (gimli's evaluation storage
//! lives on the stack), more than a thread with a small stack has left, or
//! an alternate signal stack inside the thread's own (an array of one of its
//! frames, where the bounds above hold) can hold. On the thread's stack a
//! sample costs only the frames down to the switch. (Before, a sample on a
//! stack with less than 32 KiB left went without its stack, and each sample
//! asked the kernel whether it ran on an alternate signal stack: a
//! `sigaltstack` call of about 300 ns, over half of a sample's cost.)

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};

use framehop::{FrameAddress, Unwinder as _};

use crate::recorder::modules::{self, ExecSegment, NativeCache, NativeUnwinder};

/// framehop caches (about 33 KB each), allocated with the unwinder: at most
/// this many threads unwind at once.
pub const CACHES: usize = 8;

/// One loaded object, for the profile's mappings.
#[cfg_attr(not(feature = "pprof"), allow(dead_code))]
pub(crate) struct Object {
    pub path: Vec<u8>,
    pub build_id: Vec<u8>,
    pub segments: Vec<ExecSegment>,
}

/// One unwinder cache: its busy flag, the cache, and its walk stack.
type CacheSlot = (AtomicBool, std::cell::UnsafeCell<NativeCache>, Option<WalkStack>);

pub(crate) struct State {
    unwinder: NativeUnwinder,
    /// The caches, each with its walk stack (`None`: it could not be mapped,
    /// and walks with that cache are not made).
    caches: Box<[CacheSlot]>,
    /// The loader's (adds, subs) when this state was built.
    dl: (u64, u64),
    #[cfg_attr(not(feature = "pprof"), allow(dead_code))]
    pub objects: Vec<Object>,
    /// Every object's executable segments, (start, end), sorted.
    code: Vec<(u64, u64)>,
}

impl State {
    fn knows(&self, addr: u64) -> bool {
        let i = self.code.partition_point(|r| r.0 <= addr);
        i > 0 && addr < self.code[i - 1].1
    }
}

// SAFETY: the unwinder and objects are immutable once published; a cache and
// its walk stack are used only by the thread that set its flag with a CAS
// (acquire) until it clears it (release).
unsafe impl Sync for State {}
// SAFETY: plain owned data (the walk stacks are mappings no one else uses).
unsafe impl Send for State {}

const NONE: u64 = 0;
const BUILDING: u64 = 1;
const READY: u64 = 2;

/// NONE, BUILDING or READY.
static PHASE: AtomicU64 = AtomicU64::new(NONE);
static STATE: AtomicPtr<State> = AtomicPtr::new(std::ptr::null_mut());
static READERS: AtomicUsize = AtomicUsize::new(0);
/// Samples taken without a stack (unwinder not ready, no free cache).
pub(crate) static NO_STACK: AtomicU64 = AtomicU64::new(0);
/// Replaced unwinders that could not be freed (a walk was running).
pub(crate) static LEAKED: AtomicU64 = AtomicU64::new(0);

/// Bytes of each walk's own stack (below it, a guard page): the unwinder
/// needs up to ~18 KiB (measured 17.7 KiB for a walk that misses framehop's
/// cache); the rest is for a signal handler of the program that interrupts a
/// walk (it runs on the stack in use).
pub const WALK_STACK: usize = 128 << 10;

/// A walk's own stack: an anonymous mapping of [`WALK_STACK`] bytes above a
/// guard page, unmapped with the state.
struct WalkStack {
    base: *mut libc::c_void,
    len: usize,
}

impl WalkStack {
    fn new() -> Option<WalkStack> {
        let guard = 4096;
        let len = WALK_STACK + guard;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let stack = WalkStack { base, len };
        // SAFETY: the lowest page of the mapping made above, ours alone.
        if unsafe { libc::mprotect(base, guard, libc::PROT_NONE) } != 0 {
            return None;
        }
        Some(stack)
    }

    /// The first address above the stack (16-byte aligned).
    fn top(&self) -> u64 {
        self.base as u64 + self.len as u64
    }
}

impl Drop for WalkStack {
    fn drop(&mut self) {
        // The state that owns it is dropped only when no walk holds it (see `refresh`).
        // SAFETY: our own mapping, used by no walk any more.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

thread_local! {
    /// This thread's stack, `[low, top)`: `top` 0 until read, 1 if it could
    /// not be read.
    static STACK: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

fn build() -> State {
    let exe = std::fs::read_link("/proc/self/exe")
        .map(|p| p.into_os_string().into_encoded_bytes())
        .unwrap_or_default();
    let dl = modules::dl_counters();
    let scanned = modules::scan(&exe, &|_| false, false);
    let snap = modules::initial_snapshot(&scanned, 0);
    let objects: Vec<Object> = scanned
        .into_iter()
        .map(|o| Object { path: o.key.path, build_id: o.build_id, segments: o.segments })
        .collect();
    let mut code: Vec<(u64, u64)> =
        objects.iter().flat_map(|o| &o.segments).map(|s| (s.avma, s.avma.saturating_add(s.size))).collect();
    code.sort_unstable();
    let caches = (0..CACHES)
        .map(|_| {
            (AtomicBool::new(false), std::cell::UnsafeCell::new(NativeCache::new_in()), WalkStack::new())
        })
        .collect();
    State { unwinder: snap.unwinder, caches, dl, objects, code }
}

/// Build the state if none is published, or rebuild it if `recheck` (a walk
/// met code outside every known object) and the loader's counters changed
/// since it was built (checked at most once per [`RECHECK_NS`]). Call with
/// the re-entrancy guard set (this allocates). Never waits.
///
/// The loader is called (`dl_iterate_phdr`, which takes its lock) only here:
/// for the first build, and for those rate-limited rechecks. A forked child
/// never rebuilds what its parent built, and does not take over a build the
/// parent had under way at the fork (the parent's threads may have held the
/// loader's lock then, which the child would wait for forever): in the first
/// case it keeps the parent's tables, in the second its samples go without
/// stacks.
fn refresh(recheck: bool) {
    let phase = PHASE.load(Ordering::Acquire);
    match phase & 0xff {
        READY if !recheck => return,
        READY => {
            let now = coarse_ns();
            let last = LAST_CHECK.load(Ordering::Relaxed);
            if now.wrapping_sub(last) < RECHECK_NS
                || LAST_CHECK.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_err()
            {
                return;
            }
            // SAFETY: getpid has no preconditions.
            if unsafe { libc::getpid() } as u64 != BUILT_BY.load(Ordering::Relaxed) {
                // A forked child: another thread of the parent may have held
                // the loader's lock at the fork. It keeps the parent's tables.
                return;
            }
            READERS.fetch_add(1, Ordering::SeqCst);
            let current = STATE.load(Ordering::SeqCst);
            // SAFETY: counted in READERS before the load: a replaced state is
            // freed only while READERS is zero.
            let stale = current.is_null() || unsafe { (*current).dl } != modules::dl_counters();
            READERS.fetch_sub(1, Ordering::SeqCst);
            if !stale {
                return;
            }
        }
        BUILDING => return,
        _ => {}
    }
    if PHASE.compare_exchange(phase, BUILDING, Ordering::AcqRel, Ordering::Relaxed).is_err() {
        return;
    }
    // SAFETY: getpid has no preconditions.
    BUILT_BY.store(unsafe { libc::getpid() } as u64, Ordering::Relaxed);
    let next = Box::into_raw(Box::new(build()));
    let old = STATE.swap(next, Ordering::SeqCst);
    if !old.is_null() {
        if READERS.load(Ordering::SeqCst) == 0 {
            // SAFETY: `old` was swapped out above, so no walk can load it any
            // more; every walk that loaded it counted itself in READERS
            // before loading, and the count is zero now: none holds it.
            drop(unsafe { Box::from_raw(old) });
        } else {
            LEAKED.fetch_add(1, Ordering::Relaxed);
        }
    }
    PHASE.store(READY, Ordering::Release);
}

/// Build the unwinder if no thread has started to (the process's first
/// allocation through [`super::Sampled`], normally in the runtime's start-up
/// before `main`, on its only thread), with the re-entrancy guard set. Costs
/// one load once built.
#[cold]
pub(crate) fn build_early() {
    if PHASE.load(Ordering::Relaxed) == NONE {
        let _ = super::sampler::guarded(|| refresh(false));
    }
}

/// Least time between two checks of the loader's counters.
pub const RECHECK_NS: u64 = 1_000_000_000;
static LAST_CHECK: AtomicU64 = AtomicU64::new(0);
/// The process that built the published state.
static BUILT_BY: AtomicU64 = AtomicU64::new(0);

fn coarse_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes the timespec we pass (a vDSO call: no system call, no lock).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64)
}

/// The calling thread's stack, `[low, top)` (`top` 0 if unknown).
fn stack_bounds() -> (u64, u64) {
    let (low, top) = STACK.with(Cell::get);
    if top > 1 {
        return (low, top);
    }
    if top == 1 {
        return (0, 0);
    }
    // SAFETY: pthread_getattr_np fills `attr` for the calling thread (glibc
    // allocates with its own malloc, not through this allocator); the stack
    // address and size are read from it, then it is destroyed.
    let (low, top) = unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            (0, 0)
        } else {
            let mut addr: *mut libc::c_void = std::ptr::null_mut();
            let mut size: libc::size_t = 0;
            let ok = libc::pthread_attr_getstack(&attr, &mut addr, &mut size) == 0;
            libc::pthread_attr_destroy(&mut attr);
            if ok {
                (addr as u64, (addr as u64).saturating_add(size as u64))
            } else {
                (0, 0)
            }
        }
    };
    STACK.with(|c| c.set(if top > 1 { (low, top) } else { (0, 1) }));
    if top > 1 {
        (low, top)
    } else {
        (0, 0)
    }
}

/// The end of the stack a walk starting here may read (`[sp, top)`), if the
/// calling code runs on its thread's own stack; 0 if not (another stack, or
/// bounds unknown). No system call: on an alternate signal stack inside the
/// thread's own, the bounds hold, and the walk runs on a stack of its own.
#[inline(never)]
fn walkable_top() -> u64 {
    let (low, top) = stack_bounds();
    let here = 0u8;
    let sp = std::hint::black_box(&here) as *const u8 as u64;
    if top == 0 || sp >= top || sp < low {
        return 0;
    }
    top
}

/// Registers of the caller of this function's caller... precisely: the pc,
/// sp and frame pointer at the point of the `asm!` inside [`capture`].
#[derive(Clone, Copy)]
struct Regs {
    pc: u64,
    sp: u64,
    fp: u64,
    #[allow(dead_code)]
    lr: u64,
}

/// Walk the calling thread's stack into `out` (leaf first: the pc inside this
/// function, then return addresses). Returns how many were written; 0 when no
/// stack could be had. Call with the re-entrancy guard set (the first call
/// builds the unwinder, which allocates). Never waits for another thread.
#[inline(never)]
pub(crate) fn capture(out: &mut [u64]) -> usize {
    refresh(false);
    if PHASE.load(Ordering::Acquire) != READY {
        NO_STACK.fetch_add(1, Ordering::Relaxed);
        return 0;
    }
    let top = walkable_top();
    READERS.fetch_add(1, Ordering::SeqCst);
    let state = STATE.load(Ordering::SeqCst);
    let (n, unknown) = if state.is_null() || top == 0 {
        (0, false)
    } else {
        // SAFETY: counted in READERS before the load: the state is not freed
        // while we hold it (see `refresh`).
        let state = unsafe { &*state };
        let n = walk(state, top, out);
        // The walk ended in code no object of the state holds: maybe a
        // library loaded since.
        (n, n > 0 && !state.knows(out[n - 1]))
    };
    READERS.fetch_sub(1, Ordering::SeqCst);
    if unknown {
        refresh(true);
    }
    if n == 0 {
        NO_STACK.fetch_add(1, Ordering::Relaxed);
    }
    n
}

#[inline(never)]
fn walk(state: &State, top: u64, out: &mut [u64]) -> usize {
    let Some(regs) = regs() else { return 0 };
    let Some((flag, cache, stack)) = state.caches.iter().find(|(busy, _, _)| {
        busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }) else {
        return 0;
    };
    let n = match stack {
        Some(stack) => {
            let mut job = Walk {
                unwinder: &state.unwinder,
                // (We set the cache's flag with the CAS above.)
                // SAFETY: the flag is ours: no one else uses the cache until we clear it below.
                cache: unsafe { &mut *cache.get() },
                regs,
                top,
                out,
                n: 0,
            };
            // `run_walk` takes the `Walk` it is given, which outlives the call.
            // SAFETY: the stack is this cache's, which we hold (the flag).
            unsafe { on_stack(stack.top(), run_walk, (&mut job as *mut Walk).cast()) };
            job.n
        }
        None => 0,
    };
    flag.store(false, Ordering::Release);
    n
}

/// What [`run_walk`] does, on the walk's own stack: unwind from `regs` (taken
/// on the thread's stack, whose frames stay live and unchanged meanwhile),
/// reading only inside `[regs.sp, top)`.
struct Walk<'a> {
    unwinder: &'a NativeUnwinder,
    cache: &'a mut NativeCache,
    regs: Regs,
    top: u64,
    out: &'a mut [u64],
    n: usize,
}

extern "C" fn run_walk(job: *mut libc::c_void) {
    // (`walk` waits in `on_stack` until this returns.)
    // SAFETY: `walk` passes its own `Walk`, alive and not otherwise used meanwhile.
    let job = unsafe { &mut *job.cast::<Walk>() };
    let (sp, top) = (job.regs.sp, job.top);
    let mut read_stack = |addr: u64| -> Result<u64, ()> {
        if !addr.is_multiple_of(8) || addr < sp || addr.checked_add(8).is_none_or(|e| e > top) {
            return Err(());
        }
        // [sp, top) is the allocating thread's live stack above the frame of
        // `walk` (sp was read inside it, and `walk` waits in `on_stack` until
        // this returns).
        // SAFETY: inside that mapped span, 8-byte aligned, its 8 bytes within it.
        Ok(unsafe { std::ptr::read_volatile(addr as *const u64) })
    };
    job.n = unwind_into(job.unwinder, job.cache, &job.regs, &mut read_stack, job.out);
}

/// Call `f(arg)` with the stack pointer at `top`, and come back to the
/// caller's stack.
///
/// # Safety
/// `top` must be the 16-byte aligned end of a mapped stack no one else uses
/// meanwhile, large enough for `f`; `f` must not unwind (an `extern "C"` Rust
/// function aborts on a panic instead).
#[inline(never)]
// SAFETY: an unsafe function; its callers uphold the contract under "Safety" above.
unsafe fn on_stack(top: u64, f: extern "C" fn(*mut libc::c_void), arg: *mut libc::c_void) {
    // `rsp` is kept in `r12` (callee-saved, so `f` preserves it) and
    // restored; `top` is 16-byte aligned, so `f` starts with the alignment
    // the ABI gives a callee; every register `f` may change is declared
    // clobbered. On aarch64 the same with `x20`, the link register clobbered.
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the caller's contract (a free stack at `top`), and the registers above.
        unsafe {
            std::arch::asm!(
                "mov r12, rsp",
                "mov rsp, {top}",
                "call {f}",
                "mov rsp, r12",
                top = in(reg) top,
                f = in(reg) f,
                in("rdi") arg,
                out("r12") _,
                clobber_abi("C"),
            );
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: the caller's contract (a free stack at `top`), and the registers above.
        unsafe {
            std::arch::asm!(
                "mov x20, sp",
                "mov sp, {top}",
                "blr {f}",
                "mov sp, x20",
                top = in(reg) top,
                f = in(reg) f,
                in("x0") arg,
                out("x20") _,
                clobber_abi("C"),
            );
        }
    }
}

fn unwind_into<F>(
    unwinder: &NativeUnwinder,
    cache: &mut NativeCache,
    regs: &Regs,
    read_stack: &mut F,
    out: &mut [u64],
) -> usize
where
    F: FnMut(u64) -> Result<u64, ()>,
{
    let mut iter = unwinder.frames.iter_frames(regs.pc, native_regs(regs), cache, read_stack);
    let mut n = 0;
    while n < out.len() {
        match iter.next() {
            Ok(Some(frame)) => {
                let (addr, lookup) = match frame {
                    FrameAddress::InstructionPointer(pc) => (pc, pc),
                    FrameAddress::ReturnAddress(ra) => (ra.get(), ra.get() - 1),
                };
                out[n] = addr;
                n += 1;
                if unwinder.pending.as_ref().is_some_and(|r| r.contains(&lookup)) {
                    break;
                }
            }
            Ok(None) | Err(_) => break,
        }
    }
    n
}

#[cfg(target_arch = "x86_64")]
fn native_regs(r: &Regs) -> framehop::UnwindRegsNative {
    framehop::UnwindRegsNative::new(r.pc, r.sp, r.fp)
}

#[cfg(target_arch = "aarch64")]
fn native_regs(r: &Regs) -> framehop::UnwindRegsNative {
    let code_mask = framehop::aarch64::PtrAuthMask(u64::MAX >> 16);
    framehop::UnwindRegsNative::new_with_ptr_auth_mask(code_mask, r.lr, r.sp, r.fp)
}

/// The registers at this point of the calling function (inlined into `walk`,
/// so the pc, sp and frame pointer are `walk`'s, consistent with each other).
#[inline(always)]
fn regs() -> Option<Regs> {
    #[cfg(target_arch = "x86_64")]
    {
        let (pc, sp, fp): (u64, u64, u64);
        // SAFETY: reads three registers; no memory access, no stack change.
        unsafe {
            std::arch::asm!(
                "lea {pc}, [rip]",
                "mov {sp}, rsp",
                "mov {fp}, rbp",
                pc = out(reg) pc,
                sp = out(reg) sp,
                fp = out(reg) fp,
                options(nomem, nostack, preserves_flags),
            );
        }
        Some(Regs { pc, sp, fp, lr: 0 })
    }
    #[cfg(target_arch = "aarch64")]
    {
        let (pc, sp, fp, lr): (u64, u64, u64, u64);
        // SAFETY: reads four registers; no memory access, no stack change.
        unsafe {
            std::arch::asm!(
                "adr {pc}, .",
                "mov {sp}, sp",
                "mov {fp}, x29",
                "mov {lr}, x30",
                pc = out(reg) pc,
                sp = out(reg) sp,
                fp = out(reg) fp,
                lr = out(reg) lr,
                options(nomem, nostack, preserves_flags),
            );
        }
        Some(Regs { pc, sp, fp, lr })
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        None
    }
}

/// Run `f` on the published state (building it first if needed: call with
/// the re-entrancy guard set or from outside the allocator).
#[cfg(feature = "pprof")]
pub(crate) fn with_state<R>(f: impl FnOnce(Option<&State>) -> R) -> R {
    refresh(false);
    READERS.fetch_add(1, Ordering::SeqCst);
    let state = STATE.load(Ordering::SeqCst);
    // SAFETY: counted in READERS before the load (see `refresh`).
    let r = f(if state.is_null() { None } else { Some(unsafe { &*state }) });
    READERS.fetch_sub(1, Ordering::SeqCst);
    r
}
