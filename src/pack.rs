//! [`pack`]: write a spool as a packed file (`FORMAT.md`, section 10).
//!
//! The spool is read twice through its [`Replay`]: once record by record to
//! copy the definition records (every record but samples, in stream order)
//! and note how many samples precede each event record, then sample by
//! sample into blocks. Memory stays at one block of samples plus the
//! definitions, however long the spool. The definitions are checked again
//! (as a reader checks them) before anything is written, and every sample
//! against them.

use std::io::Write;

use crate::format::packed::*;
use crate::format::record::{self, Record};
use crate::format::tag;
use crate::read::Replay;
use crate::{Error, FormatErrorKind};

/// What [`pack`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackSummary {
    /// Samples written.
    pub samples: u64,
    /// Blocks written.
    pub blocks: u64,
    /// Bytes written in all.
    pub bytes: u64,
    /// Bytes of the spool that were packed (its validated prefix).
    pub spool_bytes: u64,
}

/// A [`Write`] that counts what it passes on.
struct Counted<W> {
    inner: W,
    bytes: u64,
}

impl<W: Write> Counted<W> {
    fn put(&mut self, b: &[u8]) -> Result<(), Error> {
        self.inner.write_all(b)?;
        self.bytes += b.len() as u64;
        Ok(())
    }
}

/// Write the spool that `replay` opened as a packed file to `out`: the same
/// header, definitions and samples, which [`Snapshot`](crate::Snapshot) and
/// [`Replay`] read back identically. A spool whose final record was cut
/// short is packed up to it (as every reader reads it). `out` should be a
/// temporary file renamed into place once this returns: a packed file cut
/// short is corrupt, never recovered as a spool's tail is.
///
/// # Example
///
/// ```
/// use spulse::{Frame, Header, Replay, Snapshot, SpoolWriter};
///
/// let dir = tempfile::tempdir().unwrap();
/// let spool = dir.path().join("app.spool");
/// let mut w = SpoolWriter::new(std::fs::File::create(&spool)?, Header { start_time_us: 0, interval_us: 1000 })?;
/// let t = w.define_thread(1, 1, "main")?;
/// let f = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false })?;
/// let s = w.define_stack(None, f)?;
/// for i in 0..3 {
///     w.sample(1000 * i, t, s)?;
/// }
/// w.into_inner()?;
///
/// let mut packed = Vec::new();
/// let summary = spulse::pack(&Replay::open(&spool)?, &mut packed)?;
/// assert_eq!(summary.samples, 3);
/// let (a, b) = (Snapshot::open(&spool)?, Snapshot::from_bytes(&packed)?);
/// assert!(b.is_packed());
/// assert!(a.samples().eq(b.samples()));
/// # Ok::<(), spulse::Error>(())
/// ```
pub fn pack<W: Write>(replay: &Replay, out: W) -> Result<PackSummary, Error> {
    if replay.is_packed() {
        return Err(Error::from(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the input is already a packed file",
        )));
    }
    let records = definition_records(replay)?;
    let marks = &records.marks;
    // The stack nodes as a table when they can be one, else left in the
    // definitions (only identical root nodes: see `max_table_nodes`).
    let mut table = Vec::new();
    let (defs_bytes, nodes) = if encode_stack_table(&records.nodes, &mut table) {
        (&records.rest, &records.nodes[..])
    } else {
        table.clear();
        table.extend_from_slice(&[0u8; STACK_TABLE_HEAD_LEN as usize]);
        (&records.all, &[][..])
    };
    // The definitions as a reader of the packed file will decode them.
    let defs =
        crate::read::packed::load_definitions(defs_bytes, HEAD_LEN_V3, marks, 8, u64::MAX, Some((nodes, 0)))
            .map_err(|e| Error::format(e.offset().unwrap_or(0), FormatErrorKind::ChangedSinceOpen))?;
    let (threads, stacks) = (defs.threads().len() as u64, defs.stack_count() as u64);

    let mut out = Counted { inner: out, bytes: 0 };
    let compressed = lz4_flex::block::compress(defs_bytes);
    out.put(&PACKED_MAGIC)?;
    out.put(&(defs_bytes.len() as u64).to_le_bytes())?;
    out.put(&(compressed.len() as u64).to_le_bytes())?;
    out.put(&compressed)?;
    out.put(&(marks.len() as u64).to_le_bytes())?;
    for m in marks {
        out.put(&m.to_le_bytes())?;
    }
    out.put(&table)?;

    let cap = MAX_BLOCK_SAMPLES as usize;
    let (mut times, mut ths, mut sts) =
        (Vec::with_capacity(cap), Vec::with_capacity(cap), Vec::with_capacity(cap));
    let (mut raw, mut block) = (Vec::new(), Vec::new());
    let mut index = Vec::new();
    let mut samples = 0u64;
    let mut flush = |out: &mut Counted<W>, times: &mut Vec<u64>, ths: &mut Vec<u32>, sts: &mut Vec<u32>| {
        if times.is_empty() {
            return Ok::<(), Error>(());
        }
        block.clear();
        let compressed = encode_block(times, ths, sts, &mut raw, &mut block);
        index.push(IndexEntry {
            offset: out.bytes,
            min_time_us: *times.iter().min().expect("not empty"),
            max_time_us: *times.iter().max().expect("not empty"),
            count: times.len() as u32,
            compressed,
        });
        out.put(&block)?;
        times.clear();
        ths.clear();
        sts.clear();
        Ok(())
    };
    for s in replay.samples() {
        let s = s?;
        if s.thread.get() as u64 >= threads || s.stack.get() as u64 >= stacks {
            return Err(Error::format(0, FormatErrorKind::ChangedSinceOpen));
        }
        times.push(s.time_us);
        ths.push(s.thread.get());
        sts.push(s.stack.get());
        samples += 1;
        if times.len() == cap {
            flush(&mut out, &mut times, &mut ths, &mut sts)?;
        }
    }
    flush(&mut out, &mut times, &mut ths, &mut sts)?;
    if records.marks.last().is_some_and(|&m| m > samples) {
        return Err(Error::format(0, FormatErrorKind::ChangedSinceOpen));
    }
    let index_at = out.bytes;
    let mut tail = Vec::with_capacity(index.len() * INDEX_ENTRY_LEN as usize + FOOTER_LEN as usize);
    for e in &index {
        e.encode(&mut tail);
    }
    tail.extend_from_slice(&index_at.to_le_bytes());
    tail.extend_from_slice(&(index.len() as u64).to_le_bytes());
    tail.extend_from_slice(&samples.to_le_bytes());
    tail.extend_from_slice(&PACKED_MAGIC);
    out.put(&tail)?;
    out.inner.flush()?;
    Ok(PackSummary { samples, blocks: index.len() as u64, bytes: out.bytes, spool_bytes: replay.valid_len() })
}

/// The spool's definitions: its header and every record but samples.
struct DefinitionRecords {
    /// All of them, byte for byte in stream order.
    all: Vec<u8>,
    /// The same without the stack-node records.
    rest: Vec<u8>,
    /// The stack nodes, each placed at the offset in `rest` where it stood.
    nodes: Vec<TableNode>,
    /// For each event record (tags 6 to 9), the number of samples before it.
    marks: Vec<u64>,
}

/// The spool's definitions, read once through `replay`.
fn definition_records(replay: &Replay) -> Result<DefinitionRecords, Error> {
    let mut defs = Vec::new();
    record::encode_header(replay.header(), &mut defs);
    let mut without = defs.clone();
    let mut nodes = Vec::new();
    let mut marks = Vec::new();
    let mut samples = 0u64;
    let changed = |at: u64| Error::format(at, FormatErrorKind::ChangedSinceOpen);
    let (start, end) = replay.data_range();
    let mut buf = vec![0u8; 1 << 20];
    let (mut filled, mut pos, mut file_pos) = (0usize, 0usize, start);
    loop {
        while pos < filled {
            let rest = &buf[pos..filled];
            let (rec, len) = match record::decode(rest) {
                Ok(r) => r,
                Err(record::DecodeError::Incomplete) => break,
                Err(_) => return Err(changed(file_pos - (filled - pos) as u64)),
            };
            match rec {
                Record::Sample(_) => samples += 1,
                Record::Stack { parent, frame, .. } => {
                    nodes.push(TableNode { at: without.len() as u64, parent, frame });
                    defs.extend_from_slice(&rest[..len]);
                }
                _ => {
                    if matches!(
                        rest[0],
                        tag::PYTHON_RUNTIME
                            | tag::PROCESS_MODULE_DEACTIVATION
                            | tag::MODULE_DEACTIVATION
                            | tag::OFF_CPU
                            | tag::HEAP
                    ) {
                        marks.push(samples);
                    }
                    defs.extend_from_slice(&rest[..len]);
                    without.extend_from_slice(&rest[..len]);
                }
            }
            pos += len;
        }
        if file_pos >= end {
            if pos < filled {
                return Err(changed(file_pos - (filled - pos) as u64));
            }
            break;
        }
        buf.copy_within(pos..filled, 0);
        filled -= pos;
        pos = 0;
        let want = ((end - file_pos) as usize).min(buf.len() - filled);
        let n = replay.read_at(&mut buf[filled..filled + want], file_pos)?;
        if n == 0 {
            return Err(changed(file_pos));
        }
        filled += n;
        file_pos += n as u64;
    }
    Ok(DefinitionRecords { all: defs, rest: without, nodes, marks })
}
