//! The perf-stack engine's kernel side: per thread, a task-clock event that
//! samples user CPU time (`exclude_kernel`, allowed with `perf_event_paranoid`
//! 2) and writes each sample, with the user registers the unwinder starts from
//! (`REGS_USER`) and a copy of the top of the user stack (`STACK_USER`), into a
//! small ring mapped from the event. No signal is sent and no handler runs: the
//! writer thread reads the rings (`stack_sampler.rs` unwinds the copies).
//!
//! # The rings and their memory bound
//! Each event's ring is `1 + data_pages` pages (the header page and a
//! power-of-two data area; `RecorderBuilder::perf_stack_ring_pages`, 64 by
//! default: 260 KiB a thread). A sample takes about `user_stack_copy` + 80
//! bytes, so the default ring (256 KiB of data, 16 KiB stack copies) holds 15
//! samples, 15 ms of a busy thread at 999 Hz; the kernel wakes the writer
//! (`watermark`) when a ring is half full, and the writer drains every ring
//! then. (With `RecorderBuilder::perf_stack_watermark(false)` the writer
//! drains only at its flush interval: the ring must then hold a whole
//! interval of samples.) A sample that finds its ring full is dropped by the kernel and
//! reported (a `PERF_RECORD_LOST` record, and the event's own lost count,
//! `PERF_FORMAT_LOST`, read when the event is closed): it counts as lost
//! (`LostSamples::ring_full`).
//!
//! Rings are kernel memory locked for the process, at most
//! [`MAX_RING_MEMORY`] (64 MiB) in all: threads beyond what fits get no event
//! (with the defaults, 252 threads have one) and are reported as never
//! sampled. An unprivileged process is also held to the kernel's
//! `perf_event_mlock_kb` per CPU plus `RLIMIT_MEMLOCK`; a thread whose ring the
//! kernel refuses gets none either.
//!
//! # Threads
//! A sampling event with a mapped ring cannot be inherited (the kernel refuses
//! to map inherited per-thread events), so one is opened per thread, at start
//! and at the writer's next tick for threads created since (its listing of
//! the threads: every tick, or in the off-CPU mode when a fork record says so)
//! ([`super::perf::PerThreadEvents`], shared with the kernel-time events): a
//! thread's first flush interval is not sampled. A thread's event goes when
//! the thread is gone; its ring is drained once more first.
//!
//! # Time
//! The events use `CLOCK_REALTIME` (`use_clockid`), so a sample's time is the
//! same clock the signal engine stamps its samples with (Unix time), which the
//! writer's module timeline compares against.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::recorder::own_fd::OwnFd;

use super::perf::{
    PerThreadEvents, PerfEventAttr, FLAG_EXCLUDE_HV, FLAG_EXCLUDE_KERNEL, PERF_COUNT_SW_TASK_CLOCK,
    PERF_EVENT_IOC_DISABLE, PERF_TYPE_SOFTWARE,
};

/// Most bytes of rings mapped at once, over all threads.
pub(crate) const MAX_RING_MEMORY: usize = 64 << 20;
/// Largest `user_stack_copy`: a sample record's size is a 16-bit field, so the
/// kernel cannot copy 64 KiB or more.
pub(crate) const MAX_STACK_COPY: u32 = 64 << 10;
/// Most data pages of one ring (4 MiB).
pub(crate) const MAX_RING_PAGES: usize = 1024;

pub(super) const SAMPLE_IP: u64 = 1 << 0;
pub(super) const SAMPLE_TID: u64 = 1 << 1;
pub(super) const SAMPLE_TIME: u64 = 1 << 2;
pub(super) const SAMPLE_REGS_USER: u64 = 1 << 12;
pub(super) const SAMPLE_STACK_USER: u64 = 1 << 13;
/// `read_format`: the event's count of samples it could not write (Linux >= 6.0).
pub(super) const FORMAT_LOST: u64 = 1 << 4;
pub(super) const FLAG_WATERMARK: u64 = 1 << 14;
pub(super) const FLAG_USE_CLOCKID: u64 = 1 << 25;

const RECORD_LOST: u32 = 2;
const RECORD_SAMPLE: u32 = 9;

/// The user registers sampled, in the order the kernel writes them (ascending
/// register number): x86_64 bp (6), sp (7), ip (8).
#[cfg(target_arch = "x86_64")]
pub(super) const REGS_MASK: u64 = (1 << 6) | (1 << 7) | (1 << 8);
/// aarch64: x29 (29), x30 = lr (30), sp (31), pc (32).
#[cfg(target_arch = "aarch64")]
pub(super) const REGS_MASK: u64 = (1 << 29) | (1 << 30) | (1 << 31) | (1 << 32);

/// Offsets in `struct perf_event_mmap_page`.
const PAGE_DATA_HEAD: usize = 1024;
const PAGE_DATA_TAIL: usize = 1032;
const PAGE_DATA_OFFSET: usize = 1040;
const PAGE_DATA_SIZE: usize = 1048;

/// What the engine was asked for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StackConfig {
    pub period_ns: u64,
    /// Bytes of user stack copied per sample (a multiple of 8, below 64 KiB).
    pub stack_copy: u32,
    /// Data pages per ring (a power of two).
    pub data_pages: usize,
    /// Whether a ring half full wakes the writer (else it drains at its ticks).
    pub watermark: bool,
}

/// User registers of a sample.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UserRegs {
    pub pc: u64,
    pub sp: u64,
    pub fp: u64,
    /// The link register (aarch64; zero on x86_64).
    pub lr: u64,
}

/// One sample record, borrowed from the ring (or the scratch copy of a record
/// that wraps around the ring's end).
pub(crate) struct StackSample<'a> {
    pub tid: u32,
    /// Unix time in nanoseconds.
    pub time_ns: u64,
    /// The sampled instruction pointer.
    pub ip: u64,
    /// `None` when the kernel had no user registers (`abi` 0).
    pub regs: Option<UserRegs>,
    /// The bytes copied from `regs.sp` upwards (fewer than asked when the
    /// stack ends sooner).
    pub stack: &'a [u8],
}

/// One thread's event and its mapped ring.
pub(crate) struct StackRing {
    /// Closed by `Drop` only if still ours.
    fd: std::mem::ManuallyDrop<OwnedFd>,
    base: *mut u8,
    map_len: usize,
    data_offset: usize,
    data_size: usize,
    /// Samples reported lost by `PERF_RECORD_LOST` records so far.
    lost_in_records: u64,
    /// Whether the event was opened with `FORMAT_LOST`.
    lost_readable: bool,
    /// The most bytes a drain found waiting since [`StackRing::take_half_full`].
    fullest: u64,
}

// SAFETY: the mapping is owned by this value alone and only the thread holding
// it (the writer) reads or advances the ring.
unsafe impl Send for StackRing {}

impl Drop for StackRing {
    fn drop(&mut self) {
        // SAFETY: `base`/`map_len` are the mapping made in `open`, unmapped once.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.map_len) };
        // The descriptor only if it is still ours (see `perf::close_if_ours`).
        // SAFETY: taken once, here, as the value is dropped; never used after.
        let fd = unsafe { std::mem::ManuallyDrop::take(&mut self.fd) };
        super::perf::close_if_ours(fd);
    }
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf reads a constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Bytes one ring maps with `data_pages`.
pub(crate) fn ring_bytes(data_pages: usize) -> usize {
    (1 + data_pages) * page_size()
}

impl StackRing {
    fn open(tid: u32, cfg: &StackConfig) -> io::Result<StackRing> {
        let data_bytes = cfg.data_pages * page_size();
        let mut attr = PerfEventAttr {
            type_: PERF_TYPE_SOFTWARE,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config: PERF_COUNT_SW_TASK_CLOCK,
            sample_period: cfg.period_ns,
            sample_type: SAMPLE_IP | SAMPLE_TID | SAMPLE_TIME | SAMPLE_REGS_USER | SAMPLE_STACK_USER,
            read_format: FORMAT_LOST,
            flags: FLAG_EXCLUDE_KERNEL | FLAG_EXCLUDE_HV | FLAG_WATERMARK | FLAG_USE_CLOCKID,
            // Wake the writer when half the ring is taken (at least one byte).
            wakeup_events: (data_bytes / 2).max(1) as u32,
            sample_regs_user: REGS_MASK,
            sample_stack_user: cfg.stack_copy,
            clockid: libc::CLOCK_REALTIME,
            ..Default::default()
        };
        let (fd, lost_readable) = open_counting_lost(tid, -1, &mut attr)?;
        StackRing::map(fd, cfg.data_pages, lost_readable)
    }

    /// Map the ring of the sampling event `fd` (`1 + data_pages` pages).
    pub(super) fn map(fd: OwnedFd, data_pages: usize, lost_readable: bool) -> io::Result<StackRing> {
        let data_bytes = data_pages * page_size();
        let map_len = ring_bytes(data_pages);
        // SAFETY: maps the event's ring (header page + data) from a perf fd we
        // own; the kernel checks the length. The mapping lives until Drop.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let mut ring = StackRing {
            fd: std::mem::ManuallyDrop::new(fd),
            base: base as *mut u8,
            map_len,
            data_offset: page_size(),
            data_size: data_bytes,
            lost_in_records: 0,
            lost_readable,
            fullest: 0,
        };
        // The kernel says where the data area is (kernels before 4.1 leave
        // these zero: then it is the pages after the header page).
        let (off, size) = (ring.header_word(PAGE_DATA_OFFSET), ring.header_word(PAGE_DATA_SIZE));
        if off != 0 && size != 0 {
            let (off, size) = (off as usize, size as usize);
            if off.checked_add(size).is_none_or(|end| end > map_len) || !size.is_power_of_two() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "perf ring data area outside the mapping",
                ));
            }
            ring.data_offset = off;
            ring.data_size = size;
        }
        Ok(ring)
    }

    fn header_atomic(&self, offset: usize) -> &AtomicU64 {
        // The kernel writes these fields concurrently, hence atomic access.
        // SAFETY: `offset` is an 8-byte-aligned u64 field of the header page,
        // mapped for the life of `self`.
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }
    }

    fn header_word(&self, offset: usize) -> u64 {
        self.header_atomic(offset).load(Ordering::Acquire)
    }

    /// The event's descriptor (other events' output may be redirected to it).
    pub(super) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Stop sampling (the ring keeps what it holds).
    pub(super) fn disable(&self) {
        // SAFETY: an ioctl on an fd we own; DISABLE takes no argument.
        unsafe { libc::ioctl(self.fd.as_raw_fd(), PERF_EVENT_IOC_DISABLE as _, 0) };
    }

    /// The event's own count of samples it could not write, if readable.
    fn lost_total(&self) -> Option<u64> {
        if !self.lost_readable {
            return None;
        }
        let mut buf = [0u64; 2];
        // SAFETY: reads at most 16 bytes into our buffer ({value, lost} for
        // read_format = FORMAT_LOST).
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, 16) };
        (n == 16).then_some(buf[1])
    }

    /// Samples lost and not reported by a lost record (read when closing).
    pub(super) fn lost_unreported(&self) -> u64 {
        self.lost_total().map_or(0, |t| t.saturating_sub(self.lost_in_records))
    }

    /// Hand every record the ring holds to `on_sample` (samples) and add lost
    /// counts to `lost`, then give the space back to the kernel. A record that
    /// does not parse (which the kernel never writes) ends the drain: the rest
    /// of the ring is skipped.
    pub(super) fn drain(
        &mut self,
        scratch: &mut Vec<u8>,
        lost: &mut u64,
        on_sample: &mut dyn FnMut(&StackSample<'_>),
    ) {
        self.drain_records(scratch, lost, &mut |kind, rec| {
            if kind == RECORD_SAMPLE {
                if let Some(s) = parse_sample(rec) {
                    on_sample(&s);
                }
            }
        });
    }

    /// Whether a drain found the ring half full or more since the last call
    /// (the reader came late: `writer/priority.rs`).
    pub(super) fn take_half_full(&mut self) -> bool {
        let half = self.fullest.saturating_mul(2) >= self.data_size as u64;
        self.fullest = 0;
        half
    }

    /// Hand every record the ring holds but lost records to `on_record`
    /// (its type and its bytes, header included), add lost counts to `lost`,
    /// then give the space back to the kernel.
    pub(super) fn drain_records(
        &mut self,
        scratch: &mut Vec<u8>,
        lost: &mut u64,
        on_record: &mut impl FnMut(u32, &[u8]),
    ) {
        let head = self.header_word(PAGE_DATA_HEAD);
        let mut tail = self.header_atomic(PAGE_DATA_TAIL).load(Ordering::Relaxed);
        let size = self.data_size as u64;
        self.fullest = self.fullest.max(head.wrapping_sub(tail).min(size));
        // SAFETY: the data area lies inside the mapping (checked in `open`).
        let data = unsafe { self.base.add(self.data_offset) } as *const u8;
        // The kernel's data areas are a power of two pages: a mask, not a
        // division a record (the division was a fifth of a switch record's
        // drain).
        let mask = if size.is_power_of_two() { Some(size - 1) } else { None };
        // Only the bytes in [tail, head) are read: the kernel has published
        // them (`head` is loaded with acquire) and writes there again only
        // after `tail` moves past them.
        while head.wrapping_sub(tail) >= 8 {
            let avail = head.wrapping_sub(tail);
            if avail > size {
                break;
            }
            let at = match mask {
                Some(m) => (tail & m) as usize,
                None => (tail % size) as usize,
            };
            let mut hdr = [0u8; 8];
            if at + 8 <= self.data_size {
                // The usual case (the kernel writes records 8-byte aligned in
                // an area of whole pages): one load, not a copy call a record.
                // SAFETY: `[at, at + 8)` is in the data area and published.
                hdr = unsafe { std::ptr::read_unaligned(data.add(at) as *const [u8; 8]) };
            } else {
                // SAFETY: `at < size`, 8 <= avail <= size, and the 8 bytes are published.
                unsafe { copy_wrapped(data, self.data_size, at, &mut hdr) };
            }
            let kind = u32::from_ne_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
            let len = u16::from_ne_bytes([hdr[6], hdr[7]]) as u64;
            if len < 8 || len > avail {
                tail = head;
                break;
            }
            let rec: &[u8] = if at + len as usize <= self.data_size {
                // SAFETY: `[at, at + len)` is in the data area and published; the
                // kernel leaves it alone until the tail moves, after the loop.
                unsafe { std::slice::from_raw_parts(data.add(at), len as usize) }
            } else {
                scratch.resize(len as usize, 0);
                // SAFETY: `at < size`, len <= avail <= size, bytes published.
                unsafe { copy_wrapped(data, self.data_size, at, scratch) };
                scratch
            };
            if kind == RECORD_LOST {
                if let Some(n) = word(rec, 16) {
                    *lost += n;
                    self.lost_in_records += n;
                }
            } else {
                on_record(kind, rec);
            }
            tail = tail.wrapping_add(len);
        }
        // Everything up to `tail` is read: the kernel may reuse it.
        self.header_atomic(PAGE_DATA_TAIL).store(tail, Ordering::Release);
    }
}

/// Open a sampling event asking for its own lost count (`FORMAT_LOST`);
/// whether the kernel gave it. A kernel before 6.0 does not know
/// `FORMAT_LOST` (EINVAL): the event is opened without it, and the lost
/// records alone then count what its ring dropped.
pub(super) fn open_counting_lost(
    tid: u32,
    cpu: i32,
    attr: &mut PerfEventAttr,
) -> io::Result<(OwnedFd, bool)> {
    attr.read_format = FORMAT_LOST;
    match super::perf::open_attr_on(tid, cpu, attr) {
        Ok(fd) => Ok((fd, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            attr.read_format = 0;
            Ok((super::perf::open_attr_on(tid, cpu, attr)?, false))
        }
        Err(e) => Err(e),
    }
}

/// Copy `out.len()` bytes of a ring's data area (`size` bytes at `data`)
/// starting at offset `at`, continuing at its start past its end.
///
/// # Safety
/// `data .. data + size` must be readable, `at < size`, `out.len() <= size`,
/// and the bytes copied must not be written while this runs.
unsafe fn copy_wrapped(data: *const u8, size: usize, at: usize, out: &mut [u8]) {
    let first = out.len().min(size - at);
    // SAFETY: the caller's contract: `[at, at + first)` and
    // `[0, out.len() - first)` lie in the area; `out` is ours.
    unsafe {
        std::ptr::copy_nonoverlapping(data.add(at), out.as_mut_ptr(), first);
        std::ptr::copy_nonoverlapping(data, out.as_mut_ptr().add(first), out.len() - first);
    }
}

/// The u64 at byte `off` of `rec`.
pub(super) fn word(rec: &[u8], off: usize) -> Option<u64> {
    let b = rec.get(off..off.checked_add(8)?)?;
    Some(u64::from_ne_bytes(b.try_into().ok()?))
}

/// Parse a `PERF_RECORD_SAMPLE` of our sample type: header, ip, pid/tid,
/// time, abi + registers, stack size + bytes + dynamic size.
fn parse_sample(rec: &[u8]) -> Option<StackSample<'_>> {
    let ip = word(rec, 8)?;
    let tid = (word(rec, 16)? >> 32) as u32;
    let time_ns = word(rec, 24)?;
    let abi = word(rec, 32)?;
    let mut off = 40;
    let nregs = REGS_MASK.count_ones() as usize;
    let regs = if abi != 0 {
        let mut r = [0u64; 4];
        for slot in r.iter_mut().take(nregs) {
            *slot = word(rec, off)?;
            off += 8;
        }
        #[cfg(target_arch = "x86_64")]
        let regs = UserRegs { fp: r[0], sp: r[1], pc: r[2], lr: 0 };
        #[cfg(target_arch = "aarch64")]
        let regs = UserRegs { fp: r[0], lr: r[1], sp: r[2], pc: r[3] };
        Some(regs)
    } else {
        None
    };
    let size = word(rec, off)? as usize;
    off += 8;
    let stack = if size == 0 {
        &[][..]
    } else {
        let bytes = rec.get(off..off.checked_add(size)?)?;
        let dyn_size = word(rec, off + size)? as usize;
        &bytes[..dyn_size.min(size)]
    };
    Some(StackSample { tid, time_ns, ip, regs, stack })
}

/// The running engine: every thread's ring, and an epoll set over them (and
/// the writer's control wake-up descriptor) for the writer to wait on.
pub(crate) struct StackEvents {
    threads: PerThreadEvents<StackRing>,
    cfg: StackConfig,
    epoll: OwnFd,
    /// Rings of threads that exited, drained once more before they go.
    closing: Vec<StackRing>,
    /// Lost samples not yet added to the recorder's counters.
    lost: u64,
    scratch: Vec<u8>,
}

/// Epoll key of the control wake-up descriptor (tids are never this).
pub(crate) const WAKE_KEY: u64 = u64::MAX;
/// Epoll key of the off-CPU mode's switch rings (`perf_switch.rs`).
pub(crate) const SWITCH_KEY: u64 = u64::MAX - 1;

/// What a wait returned for.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Woken {
    /// Some ring reached its watermark, or a thread's event hung up (the
    /// switch rings may have too: drain them as well).
    Rings,
    /// Only a switch ring of the off-CPU mode reached its watermark.
    Switches,
    /// The control descriptor, or the timeout: look at the channel and the clock.
    Other,
}

/// Add `fd` to the epoll set `epoll` under `key` (`edge`: edge-triggered, for
/// a ring whose owner may hang up while other events still write into it).
pub(crate) fn epoll_add(epoll: RawFd, fd: RawFd, key: u64, edge: bool) -> io::Result<()> {
    let flags = libc::EPOLLIN as u32 | if edge { libc::EPOLLET as u32 } else { 0 };
    let mut ev = libc::epoll_event { events: flags, u64: key };
    // SAFETY: epoll_ctl reads the event struct we pass; both fds are open.
    if unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A new epoll set (close-on-exec), at a high number out of the program's
/// way and used only while it is still ours (see `own_fd.rs`).
pub(crate) fn epoll_create() -> io::Result<OwnFd> {
    // SAFETY: epoll_create1 returns a new descriptor or -1.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(OwnFd::new(unsafe { OwnedFd::from_raw_fd(ep) }))
}

/// Wait up to `timeout` on `epoll`, handing each ready (key, events) to
/// `on_ready` (at most 16 a call). A set the program closed (or whose number
/// it reused) is not waited on, nor is a failed wait retried at once: the
/// timeout is slept instead, so the writer never spins.
pub(crate) fn epoll_wait_for(epoll: &OwnFd, timeout: Duration, on_ready: &mut dyn FnMut(u64, u32)) {
    if !epoll.is_ours() {
        std::thread::sleep(timeout);
        return;
    }
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 16];
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // Round up: a 0.4 ms wait must not spin as 0 ms.
    let ms = if Duration::from_millis(ms as u64) < timeout { ms.saturating_add(1) } else { ms };
    // SAFETY: epoll_wait writes at most `evs.len()` events into our array.
    let n = unsafe { libc::epoll_wait(epoll.as_raw_fd(), evs.as_mut_ptr(), evs.len() as i32, ms) };
    if n < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
        std::thread::sleep(timeout);
        return;
    }
    for ev in evs.iter().take(n.max(0) as usize) {
        let (key, events) = (ev.u64, ev.events);
        on_ready(key, events);
    }
}

impl StackEvents {
    /// Events for every thread but `skip`; `wake` (if any) joins the epoll set.
    pub(crate) fn start(cfg: StackConfig, skip: u32, wake: Option<RawFd>) -> io::Result<StackEvents> {
        let epoll = epoll_create()?;
        let ep = epoll.as_raw_fd();
        if let Some(w) = wake {
            epoll_add(ep, w, WAKE_KEY, false)?;
        }
        let limit = (MAX_RING_MEMORY / ring_bytes(cfg.data_pages)).max(1);
        let threads = PerThreadEvents::start(skip, limit, &mut |tid| open_registered(tid, &cfg, ep))?;
        Ok(StackEvents { threads, cfg, epoll, closing: Vec::new(), lost: 0, scratch: Vec::new() })
    }

    /// Descriptors held (one per thread with an event, and the epoll set).
    pub(crate) fn descriptors(&self) -> usize {
        self.threads.events.len() + 1
    }

    /// Events for new threads; the rings of threads that exited are kept for
    /// one more drain.
    pub(crate) fn rescan(&mut self, tids: &[u32]) {
        let cfg = self.cfg;
        let ep = self.epoll.as_raw_fd();
        let closing = &mut self.closing;
        self.threads
            .rescan(tids, &mut |tid| open_registered(tid, &cfg, ep), &mut |_, ring| closing.push(ring));
    }

    /// Stop every event; the rings keep their samples for the last drain.
    pub(crate) fn stop(&mut self) {
        for ring in self.threads.events.values() {
            ring.disable();
        }
    }

    /// Also wake the writer's wait when `fd` is ready (edge-triggered), as
    /// `key`: the off-CPU mode's switch rings ([`SWITCH_KEY`]).
    pub(crate) fn watch(&self, fd: RawFd, key: u64) -> io::Result<()> {
        epoll_add(self.epoll.as_raw_fd(), fd, key, true)
    }

    /// Wait up to `timeout` for a ring to fill to its watermark or the wake-up
    /// descriptor to be written.
    pub(crate) fn wait(&mut self, timeout: Duration) -> Woken {
        let (mut rings, mut switches) = (false, false);
        let threads = &mut self.threads;
        let closing = &mut self.closing;
        epoll_wait_for(&self.epoll, timeout, &mut |key, events| {
            if key == WAKE_KEY {
                return;
            }
            if key == SWITCH_KEY {
                switches = true;
                return;
            }
            rings = true;
            if events & (libc::EPOLLHUP as u32) != 0 {
                // The thread exited: its event reports a hang-up for good.
                // Keep the ring for the drain, out of the epoll set.
                if let Some(ring) = threads.events.remove(&(key as u32)) {
                    closing.push(ring);
                }
            }
        });
        match (rings, switches) {
            (true, _) => Woken::Rings,
            (false, true) => Woken::Switches,
            (false, false) => Woken::Other,
        }
    }

    /// Read every ring: each sample to `on_sample`; returns the samples lost
    /// since the last call. Rings of exited threads go after this drain.
    pub(crate) fn drain(&mut self, on_sample: &mut dyn FnMut(&StackSample<'_>)) -> u64 {
        let mut lost = std::mem::take(&mut self.lost);
        for ring in self.threads.events.values_mut() {
            ring.drain(&mut self.scratch, &mut lost, on_sample);
        }
        for mut ring in self.closing.drain(..) {
            ring.drain(&mut self.scratch, &mut lost, on_sample);
            lost += ring.lost_unreported();
        }
        lost
    }

    /// Close every event (after the last drain), counting what they lost
    /// unreported; returns that count.
    pub(crate) fn close_all(&mut self) -> u64 {
        let mut lost = 0;
        self.threads.close_all(&mut |_, ring| lost += ring.lost_unreported());
        for ring in self.closing.drain(..) {
            lost += ring.lost_unreported();
        }
        lost
    }
}

/// Open `tid`'s event and, with the watermark, add it to the epoll set `ep`
/// (a closed descriptor leaves the set by itself).
fn open_registered(tid: u32, cfg: &StackConfig, ep: RawFd) -> io::Result<StackRing> {
    let ring = StackRing::open(tid, cfg)?;
    if cfg.watermark {
        epoll_add(ep, ring.fd.as_raw_fd(), tid as u64, false)?;
    }
    Ok(ring)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_record(tid: u32, regs: &[u64], stack: &[u8], dyn_size: u64) -> Vec<u8> {
        let mut r = Vec::new();
        r.extend_from_slice(&RECORD_SAMPLE.to_ne_bytes());
        r.extend_from_slice(&0u16.to_ne_bytes());
        r.extend_from_slice(&0u16.to_ne_bytes());
        r.extend_from_slice(&0x1234u64.to_ne_bytes());
        r.extend_from_slice(&(((tid as u64) << 32) | 7).to_ne_bytes());
        r.extend_from_slice(&99u64.to_ne_bytes());
        r.extend_from_slice(&(if regs.is_empty() { 0u64 } else { 2 }).to_ne_bytes());
        for v in regs {
            r.extend_from_slice(&v.to_ne_bytes());
        }
        r.extend_from_slice(&(stack.len() as u64).to_ne_bytes());
        r.extend_from_slice(stack);
        if !stack.is_empty() {
            r.extend_from_slice(&dyn_size.to_ne_bytes());
        }
        let len = r.len() as u16;
        r[6..8].copy_from_slice(&len.to_ne_bytes());
        r
    }

    #[test]
    fn a_sample_record_parses_and_keeps_only_the_copied_bytes() {
        let n = REGS_MASK.count_ones() as usize;
        let regs: Vec<u64> = (1..=n as u64).map(|v| v * 0x100).collect();
        let stack: Vec<u8> = (0..64u8).collect();
        let rec = sample_record(42, &regs, &stack, 40);
        let s = parse_sample(&rec).expect("parses");
        assert_eq!((s.tid, s.time_ns, s.ip), (42, 99, 0x1234));
        assert_eq!(s.stack, &stack[..40]);
        let r = s.regs.expect("regs");
        #[cfg(target_arch = "x86_64")]
        assert_eq!((r.fp, r.sp, r.pc), (0x100, 0x200, 0x300));
        #[cfg(target_arch = "aarch64")]
        assert_eq!((r.fp, r.lr, r.sp, r.pc), (0x100, 0x200, 0x300, 0x400));
        // No registers (abi 0) and no stack.
        let bare = sample_record(5, &[], &[], 0);
        let s = parse_sample(&bare).expect("parses");
        assert!(s.regs.is_none() && s.stack.is_empty());
        // A dynamic size beyond the copy keeps the copy only.
        let beyond = sample_record(5, &regs, &stack, 1 << 40);
        let s = parse_sample(&beyond).expect("parses");
        assert_eq!(s.stack.len(), 64);
    }

    #[test]
    fn a_cut_record_is_rejected_not_read_past() {
        let n = REGS_MASK.count_ones() as usize;
        let regs: Vec<u64> = vec![7; n];
        let rec = sample_record(1, &regs, &[0u8; 32], 32);
        for cut in 0..rec.len() {
            assert!(parse_sample(&rec[..cut]).is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn wrapped_copies_continue_at_the_start() {
        let data: Vec<u8> = (0..16u8).collect();
        let mut out = [0u8; 6];
        // SAFETY: 13 < 16 and 6 <= 16 bytes of our own vector.
        unsafe { copy_wrapped(data.as_ptr(), data.len(), 13, &mut out) };
        assert_eq!(out, [13, 14, 15, 0, 1, 2]);
        let mut whole = [0u8; 16];
        // SAFETY: offset 0 < 16 and 16 <= 16 bytes of our own vector: the
        // copy reads exactly the whole area once.
        unsafe { copy_wrapped(data.as_ptr(), data.len(), 0, &mut whole) };
        assert_eq!(whole.to_vec(), data);
    }
}
