//! Typed values of the format: ids, the header, and the decoded definitions.

use std::path::Path;

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub(crate) u32);

        impl $name {
            /// The dense index of this id (its definition order, from 0).
            #[inline]
            pub fn index(self) -> usize {
                self.0 as usize
            }
            /// The raw id as stored in the spool.
            #[inline]
            pub fn get(self) -> u32 {
                self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

typed_id!(
    /// Id of a module definition (tag 1).
    ModuleId
);
typed_id!(
    /// Id of a frame definition (tag 2).
    FrameId
);
typed_id!(
    /// Id of a stack node definition (tag 3).
    StackId
);
typed_id!(
    /// Id of a thread definition (tag 4).
    ThreadId
);
typed_id!(
    /// Index of a label frame's text (frame kind 3), in definition order.
    LabelId
);

/// The sampling engine that ran a recording, as reported by
/// [`Stats`](crate::Stats) and [`Guard::engine`](crate::Guard::engine). The
/// spool itself does not record it: its header is only the magic, the start
/// time and the requested interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Engine {
    /// No engine (a guard that was already stopped).
    Unknown,
    /// Per-thread `perf_event_open` task-clock events.
    PerfEvent,
    /// Per-thread `perf_event_open` task-clock events that copy the user stack
    /// into a ring, unwound by the writer thread (no signal).
    PerfStack,
    /// Per-thread CPU-clock POSIX timers (`timer_create`).
    ThreadCpuTimer,
    /// The process-wide `setitimer(ITIMER_PROF)` timer.
    ProcessTimer,
}

impl Engine {
    /// A short human name ("perf-event", "thread-cpu-timer", ...).
    pub fn name(self) -> &'static str {
        match self {
            Engine::Unknown => "unknown",
            Engine::PerfEvent => "perf-event",
            Engine::PerfStack => "perf-stack",
            Engine::ThreadCpuTimer => "thread-cpu-timer",
            Engine::ProcessTimer => "process-timer",
        }
    }
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The stream header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Profile start, unix time in microseconds. The first sample's delta is
    /// relative to it.
    pub start_time_us: u64,
    /// Requested sample interval in microseconds.
    pub interval_us: u64,
}

/// A module (an executable mapping) as defined by a tag-1 record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// Its id.
    pub id: ModuleId,
    /// The process that mapped it.
    pub pid: u32,
    /// First mapped address.
    pub start: u64,
    /// Size of the mapped span in bytes (`start + size` does not overflow).
    pub size: u64,
    /// File offset of the first mapped byte.
    pub file_offset: u64,
    /// The recorder's module-table generation in which the mapping appeared.
    pub generation: u64,
    /// Path of the mapped file, as raw bytes.
    pub path: Vec<u8>,
    /// GNU build id, possibly empty.
    pub build_id: Vec<u8>,
}

impl Module {
    /// The path as a `Path`.
    pub fn path(&self) -> &Path {
        use std::os::unix::ffi::OsStrExt;
        Path::new(std::ffi::OsStr::from_bytes(&self.path))
    }

    /// The build id as lowercase hex.
    pub fn build_id_hex(&self) -> String {
        self.build_id.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// One past the last mapped address.
    pub fn end(&self) -> u64 {
        self.start + self.size
    }

    /// The absolute address of a file-relative address inside this module.
    pub fn absolute(&self, file_relative: u64) -> Option<u64> {
        let off = file_relative.checked_sub(self.file_offset)?;
        if off >= self.size {
            return None;
        }
        self.start.checked_add(off)
    }

    /// The file-relative address of an absolute address, if it is mapped here.
    pub fn file_relative(&self, address: u64) -> Option<u64> {
        let off = address.checked_sub(self.start)?;
        if off >= self.size {
            return None;
        }
        self.file_offset.checked_add(off)
    }
}

/// A frame as defined by a tag-2 record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Frame {
    /// An address inside a known module, as a file-relative address. For every
    /// frame but a stack's leaf it points into the call instruction.
    Module {
        /// The module.
        module: ModuleId,
        /// File offset of the instruction (`address - start + file_offset`).
        file_relative: u64,
    },
    /// An address that matched no module.
    Absolute {
        /// The absolute instruction address.
        address: u64,
        /// Whether it is a kernel address.
        kernel: bool,
    },
    /// The truncated-stack marker: the unwinder stopped before the root.
    Truncated,
    /// A label instead of an address (FORMAT.md, frame kind 3): the leaf of
    /// an off-CPU stack, such as `blocked: futex` or `waiting for CPU`. Its
    /// text is [`Definitions::label`](crate::Definitions::label).
    Label(LabelId),
}

/// Why a thread was off the CPU during an [`OffCpuInterval`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OffCpuState {
    /// It blocked (sleep, lock, I/O: it gave up the CPU itself).
    Blocked,
    /// It was preempted: runnable, waiting for a CPU.
    Preempted,
}

/// An off-CPU interval (tag 9): a thread was off the CPU from `start_us` for
/// `duration_us`, having left it in `stack`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OffCpuInterval {
    /// The thread.
    pub thread: ThreadId,
    /// The stack it left the CPU in (normally with a label frame as its leaf).
    pub stack: StackId,
    /// When it left the CPU, unix microseconds.
    pub start_us: u64,
    /// How long it stayed off, microseconds (`start_us + duration_us` does
    /// not overflow).
    pub duration_us: u64,
    /// Blocked or preempted.
    pub state: OffCpuState,
    /// How many samples precede this record in the stream.
    pub samples_before: u64,
}

/// A sampled heap allocation, or the free of one (tag 10): the
/// allocating thread's stack, the block, and the bytes of allocation the
/// sample stands for (the sampler takes one allocation for about every
/// sampling interval's bytes, so each sample weighs that much).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HeapEvent {
    /// The thread that allocated (or freed) the block.
    pub thread: ThreadId,
    /// The stack of the block's allocation (for a free too).
    pub stack: StackId,
    /// When, unix microseconds.
    pub time_us: u64,
    /// The block's address (an allocation and its free have the same one;
    /// an address may be reused after its free).
    pub address: u64,
    /// The block's size in bytes, as the program asked for it.
    pub size: u64,
    /// The bytes of allocation this sample stands for (its weight; a free
    /// carries its allocation's): allocated bytes add up to an estimate of
    /// all the bytes allocated, and those still allocated minus those freed
    /// to an estimate of the bytes in use.
    pub bytes: u64,
    /// False for an allocation, true for a free.
    pub freed: bool,
    /// How many samples precede this record in the stream.
    pub samples_before: u64,
}

/// A thread identity as defined by a tag-4 record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Thread {
    /// Its id.
    pub id: ThreadId,
    /// Process id.
    pub pid: u32,
    /// Kernel thread id.
    pub tid: u32,
    /// Thread name (may be empty).
    pub name: String,
}

/// One sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sample {
    /// Absolute timestamp, unix microseconds.
    pub time_us: u64,
    /// The sampled thread.
    pub thread: ThreadId,
    /// The leaf node of its stack.
    pub stack: StackId,
}

/// A Python-runtime transition (tag 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PythonRuntimeEvent {
    /// The process.
    pub pid: u32,
    /// When, unix microseconds.
    pub time_us: u64,
    /// Entering (true) or leaving (false) Python-runtime mode.
    pub entering: bool,
    /// How many samples precede this record in the stream.
    pub samples_before: u64,
}

/// A module retirement (tags 7 and 8, one entry per retired module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deactivation {
    /// The retired module.
    pub module: ModuleId,
    /// How many samples precede the retiring record in the stream.
    pub samples_before: u64,
}

/// One node of a prefix-linked stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StackNode {
    /// The caller-side rest of the stack, or `None` at the root.
    pub parent: Option<StackId>,
    /// This node's frame.
    pub frame: FrameId,
}
