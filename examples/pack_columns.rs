//! What the samples of a packed file cost, column by column
//! (BENCHMARKS.md, "Packed container").
//!
//! ```text
//! cargo run --release --example pack_columns -- SPOOL PACKED
//! ```
//!
//! Reads the spool's samples and prints, per column, the empirical entropy
//! within each block of the packed container's size (time deltas, thread ids
//! given the previous thread id, stack ids): what an entropy coder could
//! reach. Then walks the packed file's blocks as FORMAT.md, section 10, lays
//! them out (index, LZ4 payload, coded column headers) and prints the bytes
//! each column takes before LZ4, and the payloads after it, per sample.

use std::collections::HashMap;

fn entropy_bits<K: std::hash::Hash + Eq>(it: impl Iterator<Item = K>) -> f64 {
    let mut counts: HashMap<K, u64> = HashMap::new();
    let mut n = 0u64;
    for k in it {
        *counts.entry(k).or_default() += 1;
        n += 1;
    }
    counts.values().map(|&c| c as f64 / n as f64).map(|p| -p * p.log2()).sum::<f64>() * n as f64
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap())
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().unwrap())
}

/// Bytes of the coded column of `count` values at `*pos` (header
/// included), moving `*pos` past it.
fn column_bytes(raw: &[u8], pos: &mut usize, count: u64) -> u64 {
    let h = &raw[*pos..*pos + 24];
    let (d, gw, k, f, m) = (
        le32(&h[8..12]) as u64,
        h[12] as u64,
        h[13] as u64,
        u16::from_le_bytes([h[14], h[15]]) as u64,
        le32(&h[16..20]) as u64,
    );
    let wi = 64 - d.saturating_sub(1).leading_zeros() as u64;
    let len = 24
        + (d.saturating_sub(1) * gw).div_ceil(8)
        + (f * wi).div_ceil(8)
        + (count * k).div_ceil(8)
        + (m * wi).div_ceil(8);
    *pos += len as usize;
    len
}

fn main() -> Result<(), spulse::Error> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: pack_columns SPOOL PACKED");
        std::process::exit(2);
    }
    let snap = spulse::Snapshot::open(&args[1])?;
    let samples: Vec<_> = snap.samples().collect();
    let n = samples.len() as f64;
    // The writer's block size (FORMAT.md: at most 65,536 samples a block).
    let block = 65_536;
    let (mut h_time, mut h_thread, mut h_stack) = (0.0, 0.0, 0.0);
    for b in samples.chunks(block) {
        h_time += entropy_bits(b.windows(2).map(|w| w[1].time_us.wrapping_sub(w[0].time_us)));
        // H(thread | previous thread) = H(previous, thread) - H(previous).
        h_thread += entropy_bits(b.windows(2).map(|w| (w[0].thread.get(), w[1].thread.get())))
            - entropy_bits(b[..b.len() - 1].iter().map(|s| s.thread.get()));
        h_stack += entropy_bits(b.iter().map(|s| s.stack.get()));
    }
    println!(
        "entropy within blocks of {block}, bytes a sample: time delta {:.3}, thread (given the previous) {:.3}, \
         stack {:.3}; sum {:.3}",
        h_time / n / 8.0,
        h_thread / n / 8.0,
        h_stack / n / 8.0,
        (h_time + h_thread + h_stack) / n / 8.0
    );

    let file = std::fs::read(&args[2])?;
    let len = file.len();
    let (index_at, blocks) = (le64(&file[len - 32..]) as usize, le64(&file[len - 24..]) as usize);
    let mut cols = [0u64; 4];
    let (mut payload, mut raw_total) = (0u64, 0u64);
    for i in 0..blocks {
        let e = &file[index_at + 32 * i..];
        let (at, count) = (le64(e) as usize, le32(&e[24..]) as u64);
        let (raw_len, comp) = (le32(&file[at..]) as usize, le32(&file[at + 4..]) as usize);
        let raw =
            lz4_flex::block::decompress(&file[at + 12..at + 12 + comp], raw_len).expect("a valid block");
        let mut pos = 8;
        cols[0] += 8;
        cols[1] += column_bytes(&raw, &mut pos, count - 1);
        cols[2] += column_bytes(&raw, &mut pos, count);
        cols[3] += column_bytes(&raw, &mut pos, count);
        assert_eq!(pos, raw_len, "block {i}: the columns fill the decoded block");
        payload += 12 + comp as u64;
        raw_total += raw_len as u64;
    }
    println!(
        "packed {len} bytes ({:.3} a sample): before LZ4, bytes a sample: first times {:.4}, time deltas {:.3}, \
         threads {:.3}, stacks {:.3} (sum {:.3}); blocks after LZ4 {:.3} ({:.3} of their decoded size); the rest \
         (definitions, index) {:.3}",
        len as f64 / n,
        cols[0] as f64 / n,
        cols[1] as f64 / n,
        cols[2] as f64 / n,
        cols[3] as f64 / n,
        raw_total as f64 / n,
        payload as f64 / n,
        payload as f64 / raw_total as f64,
        (len as u64 - payload) as f64 / n,
    );
    Ok(())
}
