//! The on-disk layer: constants of the spool format, the varint codec
//! (`varint`), the record codec (`record`, with the sample record's layout and
//! fast decoders in `record::sample`) and the validation rules shared by the
//! writer and every reader (`defs`), which check what the record codec decodes.
//!
//! The packed container (`spulse pack`) has its frame and block codec in
//! `packed`.
//!
//! `FORMAT.md` at the repository root is the byte-level specification; this module
//! is its only implementation. Readers (`crate::read`) and the writer
//! (`crate::write`) mirror each other around it.

pub(crate) mod defs;
pub(crate) mod packed;
pub(crate) mod record;
pub(crate) mod varint;

mod types;
pub use packed::{is_packed, MAX_BLOCK_SAMPLES, PACKED_MAGIC, PACKED_MAGIC_V2};
pub use types::*;

/// The eight-byte magic value every spool starts with.
pub const MAGIC: [u8; 8] = *b"SPULSE3\0";

/// The longest a valid stream header can be: the magic and two varints (start
/// time and interval) of at most ten bytes each. Readers decide on the header
/// from this many bytes, so a file that is not a spool is rejected without
/// reading more of it.
pub(crate) const MAX_HEADER_LEN: usize = MAGIC.len() + 2 * varint::MAX_LEN;

/// The longest record: a module record (its tag, six varints, the two
/// length-prefixed strings at their limits). A reader's buffer holds at least
/// this many bytes, so that any record fits in it whole.
pub(crate) const MAX_RECORD_LEN: usize =
    1 + 8 * varint::MAX_LEN + limits::MAX_PATH_LEN as usize + limits::MAX_BUILD_ID_LEN as usize;

/// The shortest sample record: its tag and three one-byte varints. Readers
/// bound the number of samples in `n` bytes by `n / MIN_SAMPLE_RECORD_LEN`,
/// so sample columns reserved from it never reallocate.
pub(crate) const MIN_SAMPLE_RECORD_LEN: usize = 4;

/// Record tags (the first byte of every record).
pub mod tag {
    /// Defines an executable mapping and its stable module id.
    pub const MODULE: u8 = 1;
    /// Interns a module-relative or absolute instruction address.
    pub const FRAME: u8 = 2;
    /// Interns one prefix-linked stack node.
    pub const STACK: u8 = 3;
    /// Interns a process and thread identity.
    pub const THREAD: u8 = 4;
    /// Associates a timestamp delta, thread, and stack.
    pub const SAMPLE: u8 = 5;
    /// Marks a process as entering or leaving Python-runtime mode.
    pub const PYTHON_RUNTIME: u8 = 6;
    /// Retires every active mapping of one process.
    pub const PROCESS_MODULE_DEACTIVATION: u8 = 7;
    /// Retires one mapping generation.
    pub const MODULE_DEACTIVATION: u8 = 8;
    /// An off-CPU interval: a thread, the stack it left the CPU in, when and
    /// for how long (beyond the seed; only recordings in off-CPU mode hold it).
    pub const OFF_CPU: u8 = 9;
    /// A sampled heap allocation or its free: a thread, the allocation's
    /// stack, when, the block, and the bytes it stands for (beyond the seed;
    /// only recordings with heap events hold it).
    pub const HEAP: u8 = 10;
}

/// Frame kinds (the first field of a frame record after its id).
pub mod frame_kind {
    /// Module id + file-relative address.
    pub const MODULE: u64 = 0;
    /// Absolute address + user/kernel mode bit.
    pub const ABSOLUTE: u64 = 1;
    /// Reserved: the truncated-stack marker, followed by a zero payload.
    pub const TRUNCATED: u64 = 2;
    /// A label frame (`[blocked: futex]`, `[waiting for CPU]`): a short UTF-8
    /// name instead of an address (beyond the seed; off-CPU mode only).
    pub const LABEL: u64 = 3;
}

/// Limits a reader enforces (and the writer refuses to exceed).
pub mod limits {
    /// Longest module path, in bytes.
    pub const MAX_PATH_LEN: u64 = 4096;
    /// Longest GNU build id, in bytes.
    pub const MAX_BUILD_ID_LEN: u64 = 64;
    /// Longest thread name, in bytes.
    pub const MAX_THREAD_NAME_LEN: u64 = 256;
    /// Longest label of a label frame, in bytes.
    pub const MAX_LABEL_LEN: u64 = 64;
    /// Deepest stack, in frames (nodes from leaf to root, inclusive).
    pub const MAX_STACK_DEPTH: u32 = 4096;
    /// Most definitions of one kind (ids are below this).
    pub const MAX_IDS: u64 = u32::MAX as u64;
}
