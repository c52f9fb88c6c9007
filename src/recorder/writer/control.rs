//! The writer thread's control channel: the messages a [`Guard`](crate::Guard)
//! and the Python-runtime marks send it, and what wakes it: the eventfd in its
//! `epoll_wait` set when the perf-stack engine's or the off-CPU mode's rings
//! are watched too, else the futex word of `exit_request.rs`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use super::WriterState;
use crate::recorder::own_fd::OwnFd;
use crate::Error;

/// Messages to the writer thread.
pub(crate) enum Control {
    /// Everything is set up: run.
    Start(Box<WriterState>),
    /// Start failed: exit.
    Abort,
    /// Stop, drain, flush, sync and report.
    Stop,
    /// A Python-runtime transition: drain, write the record stamped now, and
    /// acknowledge (the caller waits, so nothing it does afterwards can precede
    /// the record in the stream).
    Python { entering: bool, ack: std::sync::mpsc::SyncSender<Result<(), Error>> },
}

/// The sending side of the writer thread's control channel. With the
/// perf-stack engine the writer waits in `epoll_wait` on the sample rings
/// rather than on the channel, so every message also writes an eventfd in that
/// epoll set to wake it.
#[derive(Debug, Clone)]
pub(crate) struct ControlSender {
    tx: Sender<Control>,
    wake: Option<Arc<OwnFd>>,
}

impl ControlSender {
    /// Send `c` (and wake a writer waiting on the rings); `Err` when the writer
    /// thread is gone.
    pub(crate) fn send(&self, c: Control) -> Result<(), ()> {
        self.tx.send(c).map_err(|_| ())?;
        // A writer waiting on the futex word (no rings to wait on).
        crate::recorder::exit_request::wake_writer();
        // Never into a descriptor the program closed and reused.
        if let Some(w) = self.wake.as_ref().filter(|w| w.is_ours()) {
            let one = 1u64;
            // SAFETY: writes 8 bytes from our u64 to an eventfd we keep open.
            unsafe { libc::write(w.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
        }
        Ok(())
    }
}

/// The writer thread's control channel; with `wake`, also the eventfd that
/// wakes it (see [`ControlSender`]).
pub(crate) fn channel(wake: bool) -> std::io::Result<(ControlSender, Receiver<Control>, Option<Arc<OwnFd>>)> {
    let wake = if wake {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        Some(Arc::new(OwnFd::new(unsafe { OwnedFd::from_raw_fd(fd) })))
    } else {
        None
    };
    let (tx, rx) = std::sync::mpsc::channel();
    Ok((ControlSender { tx, wake: wake.clone() }, rx, wake))
}
