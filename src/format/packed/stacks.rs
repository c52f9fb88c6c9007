//! The stack table of a packed file (`FORMAT.md`, section 10, "Stack
//! table"): the definitions' stack-node records (tag 3), taken out of the
//! definitions stream and stored as three coded columns in one LZ4 block.
//!
//! A stack node record spends most of its bytes on what a column says in a
//! few bits: its id (always the next one), its parent (almost always a node
//! defined just before it) and its frame (one of few). On a short recording
//! of a native program they are most of the definitions, and the
//! definitions most of the file; as columns they take about a fifth.

use super::*;

/// One node of the stack table, in id order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TableNode {
    /// Where its record stood: a byte offset in the decoded definitions
    /// (the start of the record it came before, or their end).
    pub at: u64,
    /// The parent's id (`None` for a root node).
    pub parent: Option<u64>,
    /// The frame's id.
    pub frame: u64,
}

/// The table's fixed part: node count (`u64`), decoded and compressed
/// lengths of its payload (`u32` each).
pub(crate) const STACK_TABLE_HEAD_LEN: u64 = 16;

/// Most nodes a table whose payload decodes to `raw_len` bytes may hold:
/// every column of two or more distinct values takes at least a bit per
/// node, so only a table of identical root nodes can go past this (and the
/// writer leaves such nodes in the definitions instead). This is what bounds
/// a reader's memory for the table by the file's size.
pub(crate) fn max_table_nodes(raw_len: u64) -> u64 {
    raw_len.saturating_mul(8).saturating_add(4096).min(u32::MAX as u64)
}

/// The table of `nodes` (head and payload) onto `out`; `false` (and nothing
/// written) when they cannot be stored as a table (see [`max_table_nodes`]).
pub(crate) fn encode_stack_table(nodes: &[TableNode], out: &mut Vec<u8>) -> bool {
    if nodes.is_empty() {
        out.extend_from_slice(&[0u8; STACK_TABLE_HEAD_LEN as usize]);
        return true;
    }
    let mut raw = Vec::new();
    let mut prev = 0u64;
    let positions: Vec<u64> = nodes
        .iter()
        .map(|n| {
            let d = n.at.wrapping_sub(prev);
            prev = n.at;
            d
        })
        .collect();
    let parents: Vec<u64> =
        nodes.iter().enumerate().map(|(i, n)| n.parent.map_or(0, |p| (i as u64).wrapping_sub(p))).collect();
    let frames: Vec<u64> = nodes.iter().map(|n| n.frame).collect();
    encode_column(&positions, false, &mut raw);
    encode_column(&parents, false, &mut raw);
    encode_column(&frames, false, &mut raw);
    if nodes.len() as u64 > max_table_nodes(raw.len() as u64) || raw.len() > u32::MAX as usize {
        return false;
    }
    let compressed = lz4_flex::block::compress(&raw);
    out.extend_from_slice(&(nodes.len() as u64).to_le_bytes());
    out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    out.extend_from_slice(&(compressed.len() as u32).to_le_bytes());
    out.extend_from_slice(&compressed);
    true
}

/// The table's head: node count, decoded and compressed payload lengths.
pub(crate) fn parse_stack_table_head(h: &[u8; STACK_TABLE_HEAD_LEN as usize]) -> (u64, u32, u32) {
    (le64(&h[0..8]), le32(&h[8..12]), le32(&h[12..16]))
}

/// Decode a table of `count` nodes from its LZ4 `payload`, which must decode
/// to exactly `raw_len` bytes; the error says what was wrong (the caller
/// adds where). Checks the lengths before allocating; what the nodes refer
/// to is checked as they are defined.
pub(crate) fn decode_stack_table(count: u64, raw_len: u32, payload: &[u8]) -> Result<Vec<TableNode>, String> {
    if raw_len as u64 > max_decompressed(payload.len() as u64) {
        return Err(format!(
            "{raw_len} decoded bytes from a payload of {} bytes (LZ4 decodes at most 255 a byte)",
            payload.len()
        ));
    }
    if count > max_table_nodes(raw_len as u64) {
        return Err(format!(
            "{count} nodes in {raw_len} decoded bytes (at most {})",
            max_table_nodes(raw_len as u64)
        ));
    }
    if count == 0 {
        return if raw_len == 0 && payload.is_empty() {
            Ok(Vec::new())
        } else {
            Err("an empty table with a payload".into())
        };
    }
    let len = raw_len as usize;
    let mut raw = Vec::new();
    prepare_raw(&mut raw, len);
    decompress_exact(payload, &mut raw[..len])?;
    let n = count as usize;
    let mut pos = 0usize;
    let cols = [
        Column::parse(&raw, len, &mut pos, n, "position")?,
        Column::parse(&raw, len, &mut pos, n, "parent")?,
        Column::parse(&raw, len, &mut pos, n, "frame")?,
    ];
    if pos != len {
        return Err(format!("{} bytes after the frame column", len - pos));
    }
    let mut bufs = DecodeBufs::default();
    let mut vals = [vec![0u64; n], vec![0u64; n], vec![0u64; n]];
    for (c, v) in cols.iter().zip(vals.iter_mut()) {
        c.decode_into(&raw, &mut bufs, v, |x| x)?;
    }
    let mut at = 0u64;
    let mut nodes = Vec::with_capacity(n);
    #[allow(clippy::needless_range_loop)] // `i` is the node's index in three columns
    for i in 0..n {
        at = at.checked_add(vals[0][i]).ok_or_else(|| format!("node {i}: its position overflows 64 bits"))?;
        let parent = match vals[1][i] {
            0 => None,
            d => Some(
                (i as u64)
                    .checked_sub(d)
                    .ok_or_else(|| format!("node {i}: its parent is {d} nodes back, before node 0"))?,
            ),
        };
        nodes.push(TableNode { at, parent, frame: vals[2][i] });
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_round_trips_and_bad_lengths_are_refused() {
        let nodes: Vec<TableNode> = (0..3000u64)
            .map(|i| TableNode {
                at: 18 + i / 7 * 11,
                parent: if i % 40 == 0 { None } else { Some(i - 1 - i % 3 % (i % 40)) },
                frame: (i * 31) % 150,
            })
            .collect();
        let mut out = Vec::new();
        assert!(encode_stack_table(&nodes, &mut out));
        let (count, raw_len, comp) = parse_stack_table_head(out[..16].try_into().unwrap());
        assert_eq!((count, comp as usize), (3000, out.len() - 16));
        // A few bits a node: well under the 6 or more bytes of its record.
        assert!(out.len() < 3000 * 2, "{} bytes", out.len());
        assert_eq!(decode_stack_table(count, raw_len, &out[16..]).unwrap(), nodes);
        assert!(decode_stack_table(count, raw_len + 1, &out[16..]).is_err());
        assert!(decode_stack_table(count + 1, raw_len, &out[16..]).is_err());
        assert!(decode_stack_table(count, u32::MAX, &out[16..]).unwrap_err().contains("255"));
        assert!(decode_stack_table(u64::MAX, raw_len, &out[16..]).unwrap_err().contains("nodes in"));
        // Columns of one value each take no bits: past the bound, the nodes
        // are left to the definitions (only nodes at offset 0 come to this).
        let same = vec![TableNode { at: 0, parent: None, frame: 0 }; 10_000];
        assert!(!encode_stack_table(&same, &mut Vec::new()));
    }
}
