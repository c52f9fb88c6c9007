//! The packed container (`spulse pack`): constants, the fixed-width fields of
//! its frame, and the codec of one block of samples. `FORMAT.md`, section 10,
//! specifies every byte; the writer is `crate::pack`, the readers
//! `crate::read::packed`.
//!
//! A block holds up to [`MAX_BLOCK_SAMPLES`] samples as three *coded
//! columns* (time deltas, thread ids, stack ids), then compressed as one LZ4
//! block (`lz4_flex`). A coded column is a per-block dictionary of the
//! column's distinct values (sorted, stored as bit-packed gaps) and, for each
//! value, a fixed-width code: the rank of the value among the block's most
//! frequent ones, or an escape whose dictionary index is in a second
//! fixed-width section. Every section is bit-packed at the narrowest width
//! its values need, so a value costs a few bits rather than whole bytes (LZ4
//! has no entropy coder; this is the part of one that fixed widths allow).
//! Decoding is table lookups on fixed-width bit fields, with no branch on the
//! data: see [`Column::decode_into`].

mod bits;
mod block;
mod column;
mod frame;
mod stacks;

pub(crate) use bits::*;
pub(crate) use block::*;
pub(crate) use column::*;
pub(crate) use frame::*;
pub use frame::{is_packed, MAX_BLOCK_SAMPLES, PACKED_MAGIC, PACKED_MAGIC_V2};
pub(crate) use stacks::*;

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(times: &[u64], threads: &[u32], stacks: &[u32]) {
        let n = times.len();
        let (mut raw, mut out) = (Vec::new(), Vec::new());
        let c = encode_block(times, threads, stacks, &mut raw, &mut out);
        let len = le32(&out[0..4]) as usize;
        assert_eq!(len, raw.len());
        assert!(len as u64 <= max_raw_len(n as u32));
        assert_eq!(le32(&out[4..8]), c);
        assert_eq!(le32(&out[8..12]) as usize, n);
        let mut dec = Vec::new();
        decompress(&out[12..], len, &mut dec).unwrap();
        let (mut t, mut h, mut s) = (vec![0; n], vec![0; n], vec![0; n]);
        let (lo, hi) = decode_block(
            &mut DecodeBufs::default(),
            &dec,
            len,
            n,
            u32::MAX as usize + 1,
            u32::MAX as usize + 1,
            &mut (&mut t[..], &mut h[..], &mut s[..]),
        )
        .unwrap();
        assert_eq!((&t[..], &h[..], &s[..]), (times, threads, stacks));
        assert_eq!(lo, *times.iter().min().unwrap());
        assert_eq!(hi, *times.iter().max().unwrap());
        // Checked without decoding, then read back chunk by chunk from the
        // checkpoints, as a `Snapshot` does.
        let big = u32::MAX as usize + 1;
        let c = check_block(&mut DecodeBufs::default(), &dec, len, n, big, big).unwrap();
        assert_eq!((c.lo, c.hi, c.last), (lo, hi, times[n - 1]));
        assert_eq!(c.marks.len(), n.div_ceil(CHUNK));
        let mut bufs = DecodeBufs::default();
        for (k, m) in c.marks.iter().enumerate() {
            let (s, e) = (k * CHUNK, ((k + 1) * CHUNK).min(n));
            assert_eq!(m.time, times[s]);
            let mut t = m.time;
            let mut got = vec![0u64; e - s - 1];
            c.cols[0].decode_range(&dec, &mut bufs, s, m.esc[0] as usize, &mut got, |d| {
                t = t.wrapping_add(d);
                t
            });
            assert_eq!(got, times[s + 1..e], "times of chunk {k}");
            for (col, want) in [(&c.cols[1], threads), (&c.cols[2], stacks)].into_iter().zip([1, 2]) {
                let mut got = vec![0u32; e - s];
                col.0.decode_range(&dec, &mut bufs, s, m.esc[want] as usize, &mut got, |v| v as u32);
                assert_eq!(got, col.1[s..e], "column {want} of chunk {k}");
            }
        }
        // Ids are checked as `decode_block` checks them.
        let max_s = *stacks.iter().max().unwrap() as usize;
        assert!(matches!(
            check_block(&mut DecodeBufs::default(), &dec, len, n, big, max_s),
            Err(BlockError::Undefined { what: "stack", .. })
        ));
        // Ids are checked against the definitions.
        let max_h = *threads.iter().max().unwrap() as usize;
        let e = decode_block(
            &mut DecodeBufs::default(),
            &dec,
            len,
            n,
            max_h,
            usize::MAX,
            &mut (&mut t[..], &mut h[..], &mut s[..]),
        )
        .unwrap_err();
        assert!(matches!(e, BlockError::Undefined { what: "thread", id } if id == max_h as u64), "{e:?}");
        // A size the payload does not decode to is an error, not a panic.
        assert!(decompress(&out[12..], len - 1, &mut dec).is_err());
    }

    #[test]
    fn blocks_round_trip() {
        for n in [1u64, 2, 7, 1000, 1003, 1024, 1025, 2049, 65_536] {
            let times: Vec<u64> =
                (0..n).map(|i| 1_700_000_000_000_000u64.wrapping_add(i * 997 % 5000) ^ (i << 56)).collect();
            let threads: Vec<u32> = (0..n as u32).map(|i| i % 7).collect();
            let stacks: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2_654_435_761) % 70_000).collect();
            round_trip(&times, &threads, &stacks);
        }
        // Extremes: every id at its largest, times at both ends of u64
        // (deltas of any size, both signs), one distinct value per column.
        round_trip(&[u64::MAX, 0, u64::MAX, 1 << 63], &[u32::MAX; 4], &[u32::MAX, 0, u32::MAX, 5]);
        round_trip(&[5; 300], &[0; 300], &[3; 300]);
        // Skewed values (escape codes and frequent ranks mixed).
        let profile: Vec<u32> = (0..20_000u32).map(|i| if i % 3 == 0 { i * 7 } else { i % 5 }).collect();
        let times: Vec<u64> = (0..20_000u64).map(|i| 1000 * i + (i * 37) % 41).collect();
        round_trip(&times, &profile, &profile);
    }

    /// An escape that is not a dictionary index is refused by `check_block`
    /// wherever it is in the escape section (the check goes a chunk of
    /// indices at a time).
    #[test]
    fn an_escape_past_the_dictionary_is_an_error() {
        let n = 6000u64;
        let times: Vec<u64> = (0..n).map(|i| 1000 * i).collect();
        let threads: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        let stacks: Vec<u32> = (0..n as u32).map(|i| if i % 3 == 0 { i * 7 } else { i % 5 }).collect();
        let (mut raw, mut out) = (Vec::new(), Vec::new());
        encode_block(&times, &threads, &stacks, &mut raw, &mut out);
        let len = le32(&out[0..4]) as usize;
        let mut dec = Vec::new();
        decompress(&out[12..], len, &mut dec).unwrap();
        let mut pos = 8;
        let _ = Column::parse(&dec, len, &mut pos, n as usize - 1, "time").unwrap();
        let _ = Column::parse(&dec, len, &mut pos, n as usize, "thread").unwrap();
        let sc = Column::parse(&dec, len, &mut pos, n as usize, "stack").unwrap();
        let (wi, d, m) = (sc.index_width as usize, sc.dict.len(), sc.escapes);
        assert!(m > CHUNK + 3 && d < 1 << wi, "{m} escapes, {d} entries of {wi} bits");
        let big = u32::MAX as usize + 1;
        assert!(check_block(&mut DecodeBufs::default(), &dec, len, n as usize, big, big).is_ok());
        for j in [0, CHUNK + 3, m - 1] {
            let mut bad = dec.clone();
            for b in j * wi..(j + 1) * wi {
                bad[sc.escapes_at + b / 8] |= 1 << (b % 8);
            }
            match check_block(&mut DecodeBufs::default(), &bad, len, n as usize, big, big) {
                Err(BlockError::Layout(msg)) => {
                    assert!(msg.contains("stack column: an escape is not one of the"), "{msg}")
                }
                other => panic!("escape {j}: {other:?}"),
            }
        }
    }

    /// `check_times` sums a group of deltas at once when they only move time
    /// forward without wrapping, and one at a time otherwise: its extremes
    /// must equal the samples' in every mix of the two (`round_trip` compares
    /// them with the true minimum and maximum).
    #[test]
    fn time_extremes_in_every_kind_of_group() {
        let n = 5000u64;
        let ids: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        // Rising, with a step back every 37 samples (and a larger one in a
        // group of its own), or only rising.
        let mut t = 1_700_000_000_000_000u64;
        let mut back = Vec::new();
        for i in 0..n {
            t = match i {
                _ if i % 37 == 36 => t - 150,
                2000 => t - 1_000_000,
                _ => t + 100 + i % 7,
            };
            back.push(t);
        }
        round_trip(&back, &ids, &ids);
        let rising: Vec<u64> = (0..n).map(|i| 1000 + 10 * i + i % 3).collect();
        round_trip(&rising, &ids, &ids);
        // Rising until the time wraps past 2^64 - 1 (small deltas, whose sum
        // overflows in the group where it happens).
        let wrap: Vec<u64> = (0..n).map(|i| (u64::MAX - 20_000).wrapping_add(7 * i)).collect();
        round_trip(&wrap, &ids, &ids);
        // Rising by deltas of 2^40 and more (summed one at a time).
        let big: Vec<u64> = (0..n).map(|i| i * (1 << 40) + i % 5).collect();
        round_trip(&big, &ids, &ids);
        // A group whose deltas wrap to a small sum although its times dip
        // below every other and peak above: only its first sample and last
        // time would be seen if it were summed at once.
        let mut dip: Vec<u64> = vec![1_000_000, 0, 5_000_000, 1_000_001];
        dip.extend((4..n).map(|i| 1_000_000 + i));
        round_trip(&dip, &ids, &ids);
        // The largest delta of a group the fast way, then one too large.
        let edge: Vec<u64> = (0..n).map(|i| i * ((1 << 40) - 1) + (i / 100) * 2).collect();
        round_trip(&edge, &ids, &ids);
        // As a profile's deltas are: hundreds of distinct values, a few of
        // them frequent (8-bit codes, read as the bytes themselves), the rare
        // ones escapes, some of those steps back.
        let n = 20_000u64;
        let ids: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        let mut t = 1_700_000_000_000_000u64;
        let mut profile = Vec::new();
        for i in 0..n {
            // Every 44th a rare delta (one of about 450, a fifth of them
            // steps back), the others among 255 frequent ones.
            let r = i / 44;
            t = match i % 44 {
                43 if r % 5 == 0 => t - (r + 1),
                43 => t + 100_000 + r,
                _ => t + 1000 + (i * 7919) % 255,
            };
            profile.push(t);
        }
        let (mut raw, mut out) = (Vec::new(), Vec::new());
        encode_block(&profile, &ids, &ids, &mut raw, &mut out);
        let mut dec = Vec::new();
        decompress(&out[12..], raw.len(), &mut dec).unwrap();
        let time = Column::parse(&dec, raw.len(), &mut 8, profile.len() - 1, "time").unwrap();
        assert_eq!(time.code_width, 8, "{} distinct deltas, {} escapes", time.dict.len(), time.escapes);
        assert!(time.escapes > 0 && time.dict.iter().any(|&d| d >> 63 == 1));
        round_trip(&profile, &ids, &ids);
    }

    #[test]
    fn escapes_counted_from_packed_bits_at_every_width() {
        for width in 1..=8u32 {
            let esc = (1u64 << width) - 1;
            for n in [0usize, 1, 7, 8, 9, 100, 1001] {
                // Escapes at irregular places, and every other code too.
                let vals: Vec<u64> = (0..n as u64)
                    .map(|i| if i % 3 == 0 || i % 7 == 5 { esc } else { i.wrapping_mul(0x9E37_79B9) % esc })
                    .collect();
                let want = vals.iter().filter(|&&v| v == esc).count();
                // Ones after the section (what follows a column), and with
                // no padding: the tail's fields must not be counted, and the
                // loads must stay inside.
                for after in [&[0xffu8; 9][..], &[]] {
                    let mut raw = vec![0x5au8; 3];
                    let mut w = BitWriter::new(&mut raw);
                    for &v in &vals {
                        w.put(v, width);
                    }
                    w.finish();
                    let end = 3 + section_len(n as u64, width) as usize;
                    raw.truncate(end);
                    raw.extend_from_slice(after);
                    assert_eq!(count_escapes(&raw, 3, width, n), want, "width {width}, {n} codes");
                }
            }
        }
    }

    #[test]
    fn fields_compared_with_a_bound_from_packed_bits_at_every_width() {
        for width in 1..=8u32 {
            let top = 1u64 << width;
            for d in [1, 2, top / 2 + 1, top - 1, top].into_iter().filter(|&d| (1..=top).contains(&d)) {
                for n in [1usize, 7, 8, 9, 100, 1001] {
                    // Every field below `d`, then one field (first, middle,
                    // last) set to each value from `d` on.
                    let ok: Vec<u64> = (0..n as u64).map(|i| i.wrapping_mul(0x9E37_79B9) % d).collect();
                    let mut cases = vec![(ok.clone(), true)];
                    for at in [0, n / 2, n - 1] {
                        for v in d..top {
                            let mut bad = ok.clone();
                            bad[at] = v;
                            cases.push((bad, false));
                        }
                    }
                    for (vals, want) in cases {
                        // Ones after the section: fields past `n` are not compared.
                        let mut raw = vec![0x5au8; 3];
                        let mut w = BitWriter::new(&mut raw);
                        for &v in &vals {
                            w.put(v, width);
                        }
                        w.finish();
                        raw.truncate(3 + section_len(n as u64, width) as usize);
                        raw.extend_from_slice(&[0xff; 9]);
                        assert_eq!(
                            fields_below(&raw, 3, width, n, d),
                            want,
                            "width {width}, d {d}, {vals:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn unpack_reads_every_width_up_to_the_end_of_the_block() {
        for width in 0..=16u32 {
            for n in [0usize, 1, 7, 8, 9, 100, 1001] {
                let vals: Vec<u64> =
                    (0..n as u64).map(|i| i.wrapping_mul(0x9E37_79B9) % (1 << width).max(1)).collect();
                // A section after 3 bytes of something else, and nothing after
                // it but the padding (the tightest case for the loads).
                let mut raw = vec![0xa5u8; 3];
                let mut w = BitWriter::new(&mut raw);
                for &v in &vals {
                    w.put(v, width);
                }
                w.finish();
                raw.extend_from_slice(&[0; RAW_PADDING]);
                let mut out = Vec::new();
                let got = unpack(&raw, 3, width, n, &mut out);
                assert!(got.iter().map(|&v| v as u64).eq(vals.iter().copied()), "width {width}, {n} values");
            }
        }
    }

    #[test]
    fn bit_fields_round_trip_at_every_width() {
        for width in 0..=64u32 {
            let vals: Vec<u64> = (0..77u64)
                .map(|i| {
                    i.wrapping_mul(0x9E37_79B9_7F4A_7C15) & if width == 64 { !0 } else { (1 << width) - 1 }
                })
                .collect();
            let mut out = Vec::new();
            let mut w = BitWriter::new(&mut out);
            for &v in &vals {
                w.put(v, width);
            }
            w.finish();
            assert_eq!(out.len() as u64, section_len(77, width));
            out.resize(out.len() + RAW_PADDING, 0);
            for (i, &v) in vals.iter().enumerate() {
                assert_eq!(field(&out, 0, i, width), v, "width {width}");
                if width <= 56 {
                    assert_eq!(narrow_field(&out, 0, i, width), v, "width {width}");
                }
            }
        }
    }
}
