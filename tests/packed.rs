//! The packed container (`spulse::pack`, `FORMAT.md` section 10): every reader
//! gives the same header, definitions and samples for a spool and its packed
//! file, and a packed file that is cut short or altered is an `Error::Format`
//! naming a byte offset, never a panic.

use spulse::{Error, FormatErrorKind, Replay, Snapshot, Tail, PACKED_MAGIC};
use spulse_testkit::spool::START_US;
use spulse_testkit::spool::*;

/// Everything a reader exposes about definitions, in comparable form.
fn definitions_of(d: &spulse::Definitions) -> String {
    let stacks: Vec<_> = (0..d.stack_count()).map(|i| d.stack(d.stack_id(i).unwrap())).collect();
    let active: Vec<bool> = d.modules().iter().map(|m| d.is_module_active(m.id)).collect();
    format!(
        "{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{}",
        d.header(),
        d.modules(),
        active,
        d.frames(),
        stacks,
        d.threads(),
        d.deactivations(),
        d.python_runtime_events(),
        d.sample_count(),
        d.stack_count(),
    )
}

fn assert_same(spool: &Snapshot, packed: &Snapshot) {
    assert!(!spool.is_packed());
    assert!(packed.is_packed());
    assert_eq!(definitions_of(spool), definitions_of(packed));
    assert_eq!(spool.len(), packed.len());
    assert!(spool.samples().eq(packed.samples()));
    assert_eq!(spool.time_range(), packed.time_range());
    assert!(!packed.recovered_from_truncated_tail());
}

#[test]
fn every_reader_gives_the_spools_content() {
    for seed in 0..40 {
        let (bytes, model) = build(random_ops(seed, 300 + seed as usize * 37));
        let packed = pack_bytes(&bytes);
        assert!(packed.starts_with(&PACKED_MAGIC) && packed.ends_with(&PACKED_MAGIC));
        let spool = Snapshot::from_bytes(&bytes).unwrap();
        let snap = Snapshot::from_bytes(&packed).unwrap();
        assert_snapshot_matches(&snap, &model);
        assert_same(&spool, &snap);

        // From a file, and through Replay (block by block), seeks included.
        let pf = temp_file(&packed);
        let sf = temp_file(&bytes);
        assert_same(&spool, &Snapshot::open(pf.path()).unwrap());
        let rp = Replay::open(pf.path()).unwrap();
        let rs = Replay::open(sf.path()).unwrap();
        assert!(rp.is_packed() && !rs.is_packed());
        assert_eq!(definitions_of(&rp), definitions_of(&rs));
        assert_eq!(rp.last_time_us_for_test(), rs.last_time_us_for_test());
        let all: Vec<_> = rp.samples().collect::<Result<_, _>>().unwrap();
        assert!(all.iter().copied().eq(spool.samples()));
        for &(t, _, _) in model.samples.iter().step_by(7).chain(std::iter::once(&(u64::MAX, 0, 0))) {
            let a: Vec<_> = rp.samples_from(t).collect::<Result<_, _>>().unwrap();
            let b: Vec<_> = rs.samples_from(t).collect::<Result<_, _>>().unwrap();
            assert_eq!(a, b, "seed {seed}, samples from {t}");
        }
        let stats = rp.packed_stats().unwrap();
        assert_eq!(stats.file_bytes, packed.len() as u64);
        assert_eq!(stats.column_bytes, 16 * model.samples.len() as u64);
        assert!(rs.packed_stats().is_none());
    }
}

/// Trait-free access to the running time after the last sample (a Replay's
/// `samples_from` past the end starts there).
trait LastTime {
    fn last_time_us_for_test(&self) -> u64;
}
impl LastTime for Replay {
    fn last_time_us_for_test(&self) -> u64 {
        // The last sample's time, or the start for a file without samples.
        self.samples().last().map_or(self.start_time_us(), |s| s.unwrap().time_us)
    }
}

#[test]
fn many_blocks_decode_in_order_on_two_threads() {
    // More than eight blocks of 65,536 samples: the two-thread decode.
    let (bytes, _) = spulse_testkit::profile::spool(700_000);
    let packed = pack_bytes(&bytes);
    let spool = Snapshot::from_bytes(&bytes).unwrap();
    let snap = Snapshot::from_bytes(&packed).unwrap();
    assert_same(&spool, &snap);
    let f = temp_file(&packed);
    let r = Replay::open(f.path()).unwrap();
    assert_eq!(r.packed_stats().unwrap().blocks, 11);
    assert!(r.samples().map(Result::unwrap).eq(spool.samples()));
}

#[test]
fn random_access_iteration_and_the_spool_agree_on_a_multi_block_file() {
    // 11 blocks of up to 65,536 samples, each kept coded with a checkpoint
    // every 1,024 samples: every sample read by index, in order and out of
    // order, equals the one iteration gives and the spool's.
    let (bytes, _) = spulse_testkit::profile::spool(700_000);
    let packed = pack_bytes(&bytes);
    let spool = Snapshot::from_bytes(&bytes).unwrap();
    let snap = Snapshot::open(temp_file(&packed).path()).unwrap();
    assert!(snap.is_packed());
    let want: Vec<_> = spool.samples().collect();
    assert_eq!(want.len(), 700_000);
    assert_eq!(snap.len(), want.len());
    assert!(!snap.is_empty());
    let it: Vec<_> = snap.samples().collect();
    assert!(it == want, "iteration differs from the spool's samples");
    assert!((0..snap.len()).map(|i| snap.sample(i)).eq(want.iter().copied()), "sample(i) in order");
    // Out of order: a stride that lands in a different chunk (and often a
    // different block) every time, and backwards across block boundaries.
    let n = want.len();
    for j in 0..50_000usize {
        let i = j.wrapping_mul(7_919) % n;
        assert_eq!(snap.sample(i), want[i], "sample({i})");
    }
    for i in (65_536 * 3 - 3_000..65_536 * 3 + 3_000).rev() {
        assert_eq!(snap.sample(i), want[i], "sample({i})");
    }
    // The iterator's length, and a clone taken midway, stay exact.
    let mut it = snap.samples();
    assert_eq!(it.len(), n);
    for _ in 0..100_000 {
        it.next();
    }
    assert_eq!(it.len(), n - 100_000);
    let rest = it.clone();
    assert!(rest.eq(want[100_000..].iter().copied()));
    assert!(it.eq(want[100_000..].iter().copied()));
    assert!(snap.sample_times().eq(spool.sample_times()));
    assert_eq!(snap.time_range(), spool.time_range());
    // A clone reads the same, from two threads at once (the cache of the
    // last chunk read is per snapshot and never blocks).
    let copy = snap.clone();
    std::thread::scope(|s| {
        for k in 0..2usize {
            let (snap, copy, want) = (&snap, &copy, &want);
            s.spawn(move || {
                for j in 0..20_000usize {
                    let i = (j * 104_729 + k * 31) % n;
                    assert_eq!(snap.sample(i), want[i]);
                    assert_eq!(copy.sample(n - 1 - i), want[n - 1 - i]);
                }
            });
        }
    });
}

/// An index entry's earliest and latest time and sample count.
type Entry = (u64, u64, u32);

/// The blocks of a packed file (header and payload each) and its front part,
/// read through its footer and index.
fn split_blocks(packed: &[u8]) -> (Vec<u8>, Vec<Vec<u8>>, Vec<Entry>) {
    let le64 = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap());
    let le32 = |b: &[u8]| u32::from_le_bytes(b[..4].try_into().unwrap());
    let footer = &packed[packed.len() - 32..];
    let (index_at, count) = (le64(&footer[0..8]) as usize, le64(&footer[8..16]) as usize);
    let mut blocks = Vec::new();
    let mut entries = Vec::new();
    for k in 0..count {
        let e = &packed[index_at + 32 * k..];
        let (offset, comp) = (le64(&e[0..8]) as usize, le32(&e[28..32]) as usize);
        blocks.push(packed[offset..offset + 12 + comp].to_vec());
        entries.push((le64(&e[8..16]), le64(&e[16..24]), le32(&e[24..28])));
    }
    let first = le64(&packed[index_at..]) as usize;
    (packed[..first].to_vec(), blocks, entries)
}

/// A packed file of `front`, `blocks` and an index with these entries'
/// time ranges and counts.
fn join_blocks(front: &[u8], blocks: &[Vec<u8>], entries: &[Entry]) -> Vec<u8> {
    let mut f = front.to_vec();
    let mut offsets = Vec::new();
    for b in blocks {
        offsets.push(f.len() as u64);
        f.extend_from_slice(b);
    }
    let index_at = f.len() as u64;
    for ((b, &(min, max, count)), off) in blocks.iter().zip(entries).zip(offsets) {
        f.extend_from_slice(&off.to_le_bytes());
        f.extend_from_slice(&min.to_le_bytes());
        f.extend_from_slice(&max.to_le_bytes());
        f.extend_from_slice(&count.to_le_bytes());
        f.extend_from_slice(&(b.len() as u32 - 12).to_le_bytes());
    }
    let samples: u64 = entries.iter().map(|e| e.2 as u64).sum();
    f.extend_from_slice(&index_at.to_le_bytes());
    f.extend_from_slice(&(blocks.len() as u64).to_le_bytes());
    f.extend_from_slice(&samples.to_le_bytes());
    f.extend_from_slice(&front[..8]);
    f
}

/// Where the code section of the coded column at `pos` of a decoded block
/// starts, its code width and where the column ends.
fn column_codes(raw: &[u8], pos: usize, count: u64) -> (usize, u32, usize) {
    let h = &raw[pos..pos + 24];
    let d = u32::from_le_bytes(h[8..12].try_into().unwrap()) as u64;
    let (gw, k) = (h[12] as u64, h[13] as u32);
    let f = u16::from_le_bytes([h[14], h[15]]) as u64;
    let m = u32::from_le_bytes(h[16..20].try_into().unwrap()) as u64;
    let wi = width_of(d.saturating_sub(1)) as u64;
    let codes_at = pos as u64 + 24 + (d.saturating_sub(1) * gw).div_ceil(8) + (f * wi).div_ceil(8);
    let end = codes_at + (count * k as u64).div_ceil(8) + (m * wi).div_ceil(8);
    (codes_at as usize, k, end as usize)
}

#[test]
fn corrupt_coded_bytes_deep_in_a_block_are_refused_at_open() {
    let (bytes, _) = spulse_testkit::profile::spool(700_000);
    let packed = pack_bytes(&bytes);
    let (front, blocks, entries) = split_blocks(&packed);
    assert_eq!(blocks.len(), 11);
    // Rebuilt unchanged, the file reads back (so the helpers are right).
    assert_eq!(join_blocks(&front, &blocks, &entries), packed);
    let k = 7;
    let count = entries[k].2 as usize;
    let raw_len = u32::from_le_bytes(blocks[k][0..4].try_into().unwrap()) as usize;
    let raw = lz4_flex::block::decompress(&blocks[k][12..], raw_len).unwrap();
    let times = column_codes(&raw, 8, count as u64 - 1);
    let threads = column_codes(&raw, times.2, count as u64);
    let stacks = column_codes(&raw, threads.2, count as u64);
    assert_eq!(stacks.2, raw.len());
    let block_at: u64 = front.len() as u64 + blocks[..k].iter().map(|b| b.len() as u64).sum::<u64>();
    // Flip the code of sample `i` (in the last chunk of the block, far from
    // any checkpoint) between the escape and a frequent rank; the file is
    // refused when opened, at the block's payload, by every reader.
    let flip = |(codes_at, width, _): (usize, u32, usize), i: usize| {
        assert!(width > 0);
        let mut raw = raw.clone();
        let bit = i * width as usize;
        let mut code = 0u32;
        for b in 0..width as usize {
            code |= (((raw[codes_at + (bit + b) / 8] >> ((bit + b) % 8)) & 1) as u32) << b;
        }
        let new = if code == (1 << width) - 1 { 0 } else { (1 << width) - 1 };
        for b in 0..width as usize {
            let (byte, m) = (codes_at + (bit + b) / 8, 1u8 << ((bit + b) % 8));
            raw[byte] = if new >> b & 1 == 1 { raw[byte] | m } else { raw[byte] & !m };
        }
        let mut blocks = blocks.clone();
        blocks[k] = frame_block(&raw, count);
        join_blocks(&front, &blocks, &entries)
    };
    let mut columns = 0;
    for (what, col) in [("stack", stacks), ("thread", threads), ("time", times)] {
        if col.1 == 0 {
            continue;
        }
        columns += 1;
        let bad = flip(col, count - 5);
        let e = check_readers(&bad).map(|_| ()).expect_err(what);
        assert!(matches!(e.format_kind(), Some(FormatErrorKind::PackedCorrupt(_))), "{what}: {e}");
        let msg = e.to_string();
        assert!(msg.contains(&format!("block {k}: {what} column")), "{what}: {e}");
        assert_eq!(e.offset(), Some(block_at + 12), "{what}: {e}");
        let f = temp_file(&bad);
        let e = Snapshot::open(f.path()).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains(f.path().to_str().unwrap()), "{e}");
        assert_eq!(e.offset(), Some(block_at + 12));
    }
    // The profile's time and stack columns have codes (frequent values and
    // escapes); its thread column may be plain dictionary indices.
    assert!(columns >= 2, "{columns} columns with codes");
}

#[test]
fn an_empty_spool_packs_to_an_empty_packed_file() {
    let (bytes, _) = build([]);
    let packed = pack_bytes(&bytes);
    let snap = Snapshot::from_bytes(&packed).unwrap();
    assert!(snap.is_empty());
    assert_eq!(snap.start_time_us(), START_US);
    let f = temp_file(&packed);
    assert_eq!(Replay::open(f.path()).unwrap().samples().count(), 0);
}

#[test]
fn a_truncated_spool_packs_its_complete_prefix() {
    let (bytes, _) = build(random_ops(3, 400));
    let cut = &bytes[..bytes.len() - 1];
    let spool = Snapshot::from_bytes(cut).unwrap();
    assert!(spool.recovered_from_truncated_tail());
    let f = temp_file(cut);
    let mut out = Vec::new();
    let summary = spulse::pack(&Replay::open(f.path()).unwrap(), &mut out).unwrap();
    assert_eq!(summary.samples, spool.len() as u64);
    assert_eq!(summary.bytes, out.len() as u64);
    assert_eq!(summary.spool_bytes, spool.valid_len());
    assert_same(&spool, &Snapshot::from_bytes(&out).unwrap());
}

#[test]
fn packing_a_packed_file_is_refused_and_tail_refuses_one() {
    let (bytes, _) = build(random_ops(5, 200));
    let f = temp_file(&pack_bytes(&bytes));
    let e = spulse::pack(&Replay::open(f.path()).unwrap(), Vec::new()).unwrap_err();
    assert!(e.to_string().contains("already a packed file"), "{e}");
    let e = Tail::open(f.path()).unwrap_err();
    assert!(e.to_string().contains("packed file") && e.to_string().contains("never grows"), "{e}");
}

/// Open `bytes` with every reader that accepts a packed file; each must agree
/// on success, or fail with a format error at an offset inside the file.
fn check_readers(bytes: &[u8]) -> Result<Snapshot, Error> {
    let snap = Snapshot::from_bytes(bytes);
    let f = temp_file(bytes);
    let replay = Replay::open(f.path());
    let from_file = Snapshot::open(f.path());
    match (&snap, &replay, &from_file) {
        (Ok(s), Ok(r), Ok(o)) => {
            let samples: Vec<_> = r.samples().collect::<Result<_, _>>().unwrap();
            assert!(samples.iter().copied().eq(s.samples()));
            assert!(o.samples().eq(s.samples()));
            assert_eq!(definitions_of(s), definitions_of(r));
        }
        (Err(a), Err(b), Err(c)) => {
            assert_eq!(a.offset(), b.offset());
            assert_eq!(a.offset(), c.offset());
            assert_eq!(a.format_kind(), b.format_kind());
            let at = a.offset().expect("a format error");
            assert!(at <= bytes.len() as u64, "offset {at} past the end of {} bytes", bytes.len());
        }
        _ => panic!("readers disagree: {snap:?} / {replay:?} / {from_file:?}"),
    }
    snap
}

#[test]
fn a_packed_file_cut_anywhere_is_an_error_with_its_offset() {
    let (bytes, _) = build(random_ops(7, 500));
    let packed = pack_bytes(&bytes);
    for len in 0..packed.len() {
        let e = check_readers(&packed[..len]).map(|_| ()).expect_err("a cut packed file is corrupt");
        assert!(matches!(e, Error::Format { .. }), "cut at {len}: {e}");
        if len >= 8 {
            // Past the magic, a cut always shows as a missing or misplaced footer.
            assert!(matches!(e.format_kind(), Some(FormatErrorKind::PackedCorrupt(_))), "cut at {len}: {e}");
        }
    }
    // Extra bytes after the footer are no footer either.
    let mut longer = packed.clone();
    longer.extend_from_slice(&PACKED_MAGIC);
    longer.extend_from_slice(&[0; 24]);
    assert!(check_readers(&longer).is_err());
}

#[test]
fn altered_bytes_are_errors_or_agreeing_reads_never_panics() {
    let (bytes, _) = build(random_ops(11, 600));
    let packed = pack_bytes(&bytes);
    let mut errors = 0;
    for i in 0..packed.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut b = packed.clone();
            b[i] ^= flip;
            errors += check_readers(&b).is_err() as usize;
        }
    }
    // Every byte of the frame is checked; only bytes inside the LZ4 payloads'
    // literals can change a value without breaking a rule.
    assert!(errors > packed.len(), "{errors} errors in {} flips", 3 * packed.len());
}

/// The frame parts of a packed file, to rebuild it with other blocks.
struct Parts {
    /// Magic, definitions, event positions and stack table: everything
    /// before the blocks.
    front: Vec<u8>,
}

fn parts(packed: &[u8]) -> Parts {
    let le64 = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap());
    let comp = le64(&packed[16..24]) as usize;
    let marks_at = 24 + comp;
    let marks = le64(&packed[marks_at..]) as usize;
    let table_at = marks_at + 8 + 8 * marks;
    let table_comp = u32::from_le_bytes(packed[table_at + 12..table_at + 16].try_into().unwrap()) as usize;
    Parts { front: packed[..table_at + 16 + table_comp].to_vec() }
}

/// `vals` as fields of `width` bits, least significant bit first, the last
/// byte padded with zero bits (FORMAT.md section 10, "Bit fields").
fn bit_fields(vals: &[u64], width: u32) -> Vec<u8> {
    let mut out = vec![0u8; (vals.len() * width as usize).div_ceil(8)];
    for (i, &v) in vals.iter().enumerate() {
        for b in 0..width as usize {
            if v >> b & 1 == 1 {
                let bit = i * width as usize + b;
                out[bit / 8] |= 1 << (bit % 8);
            }
        }
    }
    out
}

fn width_of(v: u64) -> u32 {
    64 - v.leading_zeros()
}

/// A coded column of `vals` in its simplest form: the dictionary in
/// ascending order, code width 0 (no frequent table, no codes), every value
/// an escape holding its dictionary index.
fn plain_column(vals: &[u64]) -> Vec<u8> {
    let mut dict = vals.to_vec();
    dict.sort_unstable();
    dict.dedup();
    let gaps: Vec<u64> = dict.windows(2).map(|w| w[1] - w[0]).collect();
    let gw = gaps.iter().map(|&g| width_of(g)).max().unwrap_or(0);
    let wi = width_of(dict.len().saturating_sub(1) as u64);
    let idx: Vec<u64> = vals.iter().map(|v| dict.binary_search(v).unwrap() as u64).collect();
    let mut out = Vec::new();
    out.extend_from_slice(&dict.first().copied().unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&(dict.len() as u32).to_le_bytes());
    out.extend_from_slice(&[gw as u8, 0, 0, 0]);
    out.extend_from_slice(&(vals.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend(bit_fields(&gaps, gw));
    out.extend(bit_fields(&idx, wi));
    out
}

/// The decoded bytes of a block: the first time, then the time deltas,
/// thread ids and stack ids as plain coded columns.
fn raw_block(times: &[u64], threads: &[u32], stacks: &[u32]) -> Vec<u8> {
    let mut raw = times[0].to_le_bytes().to_vec();
    let deltas: Vec<u64> = times.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
    raw.extend(plain_column(&deltas));
    raw.extend(plain_column(&threads.iter().map(|&v| v as u64).collect::<Vec<_>>()));
    raw.extend(plain_column(&stacks.iter().map(|&v| v as u64).collect::<Vec<_>>()));
    raw
}

/// `raw` LZ4-compressed with its 12-byte header, for `n` samples.
fn frame_block(raw: &[u8], n: usize) -> Vec<u8> {
    let comp = lz4_flex::block::compress(raw);
    let mut out = Vec::new();
    out.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    out.extend_from_slice(&(comp.len() as u32).to_le_bytes());
    out.extend_from_slice(&(n as u32).to_le_bytes());
    out.extend_from_slice(&comp);
    out
}

/// A block of these samples, built from the specification alone.
fn block(times: &[u64], threads: &[u32], stacks: &[u32]) -> Vec<u8> {
    frame_block(&raw_block(times, threads, stacks), times.len())
}

/// A packed file of `front` and one block, with an index entry claiming
/// `min..=max`.
fn assemble(front: &[u8], block: &[u8], count: u32, min: u64, max: u64) -> Vec<u8> {
    let mut f = front.to_vec();
    let offset = f.len() as u64;
    f.extend_from_slice(block);
    let index_at = f.len() as u64;
    f.extend_from_slice(&offset.to_le_bytes());
    f.extend_from_slice(&min.to_le_bytes());
    f.extend_from_slice(&max.to_le_bytes());
    f.extend_from_slice(&count.to_le_bytes());
    f.extend_from_slice(&(block.len() as u32 - 12).to_le_bytes());
    f.extend_from_slice(&index_at.to_le_bytes());
    f.extend_from_slice(&1u64.to_le_bytes());
    f.extend_from_slice(&(count as u64).to_le_bytes());
    f.extend_from_slice(&front[..8]);
    f
}

#[test]
fn block_contents_are_checked_against_definitions_and_index() {
    // A spool with 2 threads and 3 stack nodes.
    let mut w =
        spulse::SpoolWriter::new(Vec::new(), spulse::Header { start_time_us: 100, interval_us: 1 }).unwrap();
    let t0 = w.define_thread(1, 1, "a").unwrap();
    w.define_thread(1, 2, "b").unwrap();
    let f = w.define_frame(spulse::Frame::Absolute { address: 1, kernel: false }).unwrap();
    let s0 = w.define_stack(None, f).unwrap();
    let s1 = w.define_stack(Some(s0), f).unwrap();
    w.define_stack(Some(s1), f).unwrap();
    w.sample(150, t0, s0).unwrap();
    let spool = w.into_inner().unwrap();
    let front = parts(&pack_bytes(&spool)).front;
    let block_at = front.len() as u64;

    // A hand-built valid file reads back (so the helpers are right).
    let good = assemble(&front, &block(&[200, 100], &[1, 0], &[2, 0]), 2, 100, 200);
    let s = check_readers(&good).unwrap();
    let got: Vec<_> = s.samples().map(|x| (x.time_us, x.thread.get(), x.stack.get())).collect();
    assert_eq!(got, [(200, 1, 2), (100, 0, 0)]);

    let err = |bytes: &[u8]| check_readers(bytes).map(|_| ()).unwrap_err();
    let e = err(&assemble(&front, &block(&[200, 100], &[2, 0], &[2, 0]), 2, 100, 200));
    assert_eq!(e.format_kind(), Some(&FormatErrorKind::UndefinedReference { what: "thread", id: 2 }));
    assert_eq!(e.offset(), Some(block_at));
    let e = err(&assemble(&front, &block(&[200, 100], &[1, 0], &[3, 0]), 2, 100, 200));
    assert_eq!(e.format_kind(), Some(&FormatErrorKind::UndefinedReference { what: "stack", id: 3 }));
    let e = err(&assemble(&front, &block(&[200, 100], &[1, 0], &[2, 0]), 2, 100, 201));
    assert!(e.to_string().contains("differ from its index entry"), "{e}");
    assert_eq!(e.offset(), Some(block_at));
    // The header's count disagrees with the index's.
    let e = err(&assemble(&front, &block(&[200, 100, 300], &[1, 0, 0], &[2, 0, 0]), 2, 100, 300));
    assert!(e.to_string().contains("its index entry says"), "{e}");
    // A payload that decodes to fewer bytes than its header says.
    let mut b = block(&[200, 100], &[1, 0], &[2, 0]);
    b[0] += 16;
    b[8] += 1;
    let e = err(&assemble(&front, &b, 3, 100, 200));
    assert!(e.to_string().contains("decompresses to") || e.to_string().contains("does not decode"), "{e}");
    assert_eq!(e.offset(), Some(block_at + 12));
    // A block claiming more decoded bytes than its samples or its payload
    // can take is refused before any allocation for it.
    let mut b = block(&[200, 100], &[1, 0], &[2, 0]);
    b[0..4].copy_from_slice(&(1u32 << 30).to_le_bytes());
    let e = err(&assemble(&front, &b, 2, 100, 200));
    assert!(e.to_string().contains("cannot hold"), "{e}");
    assert_eq!(e.offset(), Some(block_at));

    // The layout inside the decoded block: each inconsistency is an error
    // at the block's payload, naming the column and the decoded byte.
    let good_raw = raw_block(&[200, 100], &[1, 0], &[2, 0]);
    // Offsets in the decoded block: first time (8), then the time column's
    // header; one delta, so one dictionary entry and no bit fields.
    let thread_col = 8 + 24;
    let bad = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut raw = good_raw.clone();
        edit(&mut raw);
        err(&assemble(&front, &frame_block(&raw, 2), 2, 100, 200))
    };
    type Edit<'a> = &'a dyn Fn(&mut Vec<u8>);
    let cases: [(&str, Edit); 6] = [
        // More distinct values than values.
        ("3 distinct values for 2 values", &|r| r[thread_col + 8] = 3),
        // A code width past the limit.
        ("code width 13 out of range", &|r| r[thread_col + 13] = 13),
        // A nonzero reserved field.
        ("reserved field", &|r| r[thread_col + 20] = 1),
        // Fewer escapes than values with no codes.
        ("1 escapes for 2 values with code width 0", &|r| r[thread_col + 16] = 1),
        // A byte too many after the columns.
        ("the columns end at decoded byte", &|r| r.push(0)),
        // The stack column's bit fields cut short.
        ("past the block's", &|r| {
            r.pop();
        }),
    ];
    for (what, edit) in cases {
        let e = bad(edit);
        assert!(e.to_string().contains(what), "{what}: {e}");
        assert_eq!(e.offset(), Some(block_at + 12), "{what}");
    }
    // A frequent table entry and codes that are not what they claim.
    let mut raw = 150u64.to_le_bytes().to_vec();
    raw.extend(plain_column(&[]));
    // Thread column: 1 value, dictionary {0}, code width 1, one frequent
    // entry (index 0), code 0, no escapes.
    raw.extend_from_slice(&0u64.to_le_bytes());
    raw.extend_from_slice(&1u32.to_le_bytes());
    raw.extend_from_slice(&[0, 1, 1, 0]);
    raw.extend_from_slice(&0u32.to_le_bytes());
    raw.extend_from_slice(&0u32.to_le_bytes());
    // The frequent table (1 entry of 0 bits) takes no byte; the one code
    // of 1 bit, one byte.
    raw.push(0);
    raw.extend(plain_column(&[0]));
    let one = |raw: &[u8]| assemble(&front, &frame_block(raw, 1), 1, 150, 150);
    let s = check_readers(&one(&raw)).unwrap();
    assert_eq!(
        s.samples().map(|x| (x.time_us, x.thread.get(), x.stack.get())).collect::<Vec<_>>(),
        [(150, 0, 0)]
    );
    // Code 1 is the escape of a 1-bit code, but no escapes are announced.
    let mut r = raw.clone();
    r[8 + 24 + 24] = 1;
    let e = err(&one(&r));
    assert!(e.to_string().contains("not one of the 1 frequent values"), "{e}");
    assert_eq!(e.offset(), Some(block_at + 12));
}

#[test]
fn edge_cases_round_trip() {
    use spulse::{Frame, Header, SpoolWriter};
    // (threads, samples as (time, thread, stack index)); 70,000 stack nodes.
    let far = START_US + (1 << 62);
    type Case = (usize, Vec<(u64, usize, u32)>);
    let cases: Vec<Case> = vec![
        // One sample.
        (1, vec![(START_US, 0, 0)]),
        // Samples that never vary but in time, by a constant step: a few
        // bytes a block, fewer bytes in the file than samples (Snapshot then
        // grows its columns as blocks decode rather than trusting the index).
        (1, (0..1_000_000u64).map(|i| (START_US + 3 * i, 0, 7)).collect()),
        // One thread, exactly one block, then one more sample.
        (1, (0..65_536u64).map(|i| (START_US + i, 0, (i % 5) as u32)).collect()),
        (1, (0..65_537u64).map(|i| (START_US + i, 0, (i % 5) as u32)).collect()),
        // Out-of-order times, ids at their largest, times at both ends of
        // the spool's range (hours apart: narrow columns split, wide ones for a block
        // spanning more than 71 minutes).
        (
            3,
            vec![
                (START_US, 2, 69_999),
                (START_US - 5, 0, 0),
                (far, 1, 69_999),
                (0, 2, 1),
                (START_US + 7, 1, 3),
            ],
        ),
        // Two blocks hours apart, each narrow, and a skewed stack column
        // (escapes and frequent codes mixed).
        (
            2,
            (0..140_000u64)
                .map(|i| {
                    let t = if i < 70_000 { START_US + i * 10 } else { START_US + (1 << 33) + i };
                    (t, (i % 2) as usize, if i % 5 == 0 { (i % 60_000) as u32 } else { (i % 3) as u32 })
                })
                .collect(),
        ),
    ];
    for (k, (nthreads, samples)) in cases.into_iter().enumerate() {
        let mut w =
            SpoolWriter::new(Vec::new(), Header { start_time_us: START_US, interval_us: 1000 }).unwrap();
        let threads: Vec<_> = (0..nthreads).map(|i| w.define_thread(1, i as u32, "t").unwrap()).collect();
        let f = w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
        let mut stacks = vec![w.define_stack(None, f).unwrap()];
        // A binary tree: 70,000 nodes, 17 deep.
        while stacks.len() < 70_000 {
            stacks.push(w.define_stack(Some(stacks[(stacks.len() - 1) / 2]), f).unwrap());
        }
        for &(t, h, s) in &samples {
            w.sample(t, threads[h], stacks[s as usize]).unwrap();
        }
        let bytes = w.into_inner().unwrap();
        let packed = pack_bytes(&bytes);
        if k == 1 {
            assert!(packed.len() < samples.len(), "{} bytes", packed.len());
        }
        let spool = Snapshot::from_bytes(&bytes).unwrap();
        let snap = check_readers(&packed).unwrap();
        assert_same(&spool, &snap);
        let got: Vec<_> =
            snap.samples().map(|x| (x.time_us, x.thread.get() as usize, x.stack.get())).collect();
        let want: Vec<_> = samples
            .iter()
            .map(|&(t, h, s)| (t, threads[h].get() as usize, stacks[s as usize].get()))
            .collect();
        assert_eq!(got, want, "case {k}");
    }
}

#[test]
fn a_packed_file_of_the_first_layout_is_refused_by_name() {
    let (bytes, _) = build(random_ops(19, 100));
    let mut packed = pack_bytes(&bytes);
    let n = packed.len();
    packed[..8].copy_from_slice(b"SPULSPK1");
    packed[n - 8..].copy_from_slice(b"SPULSPK1");
    let e = check_readers(&packed).map(|_| ()).unwrap_err();
    assert_eq!(e.offset(), Some(0));
    assert!(e.to_string().contains("first layout") && e.to_string().contains("pack the spool again"), "{e}");
}

/// `packed` with its definitions (decoded, then compressed again) changed
/// by `f`, the blocks moved to where they now start.
fn with_definitions(packed: &[u8], f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let le64 = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap());
    let (len, comp) = (le64(&packed[8..16]) as usize, le64(&packed[16..24]) as usize);
    let mut defs = lz4_flex::block::decompress(&packed[24..24 + comp], len).unwrap();
    f(&mut defs);
    let (front, blocks, entries) = split_blocks(packed);
    let c = lz4_flex::block::compress(&defs);
    let mut new = front[..8].to_vec();
    new.extend_from_slice(&(defs.len() as u64).to_le_bytes());
    new.extend_from_slice(&(c.len() as u64).to_le_bytes());
    new.extend_from_slice(&c);
    new.extend_from_slice(&front[24 + comp..]);
    join_blocks(&new, &blocks, &entries)
}

/// `packed` with its stack table replaced by one of `nodes` (offset in the
/// decoded definitions, parent distance or 0 for a root, frame) as plain
/// coded columns.
fn with_stack_table(packed: &[u8], nodes: &[(u64, u64, u64)]) -> Vec<u8> {
    let table_at = parts(packed).front.len();
    let (front, blocks, entries) = split_blocks(packed);
    let le64 = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap());
    let comp = le64(&packed[16..24]) as usize;
    let marks = le64(&packed[24 + comp..]) as usize;
    let start = 24 + comp + 8 + 8 * marks;
    assert!(start <= table_at);
    let mut prev = 0;
    let mut raw = plain_column(
        &nodes
            .iter()
            .map(|n| {
                let d = n.0 - prev;
                prev = n.0;
                d
            })
            .collect::<Vec<_>>(),
    );
    raw.extend(plain_column(&nodes.iter().map(|n| n.1).collect::<Vec<_>>()));
    raw.extend(plain_column(&nodes.iter().map(|n| n.2).collect::<Vec<_>>()));
    let c = lz4_flex::block::compress(&raw);
    let mut new = front[..start].to_vec();
    new.extend_from_slice(&(nodes.len() as u64).to_le_bytes());
    new.extend_from_slice(&(raw.len() as u32).to_le_bytes());
    new.extend_from_slice(&(c.len() as u32).to_le_bytes());
    new.extend_from_slice(&c);
    join_blocks(&new, &blocks, &entries)
}

/// The stack table of `packed`, decoded: (offset, parent distance, frame).
fn stack_table(packed: &[u8]) -> Vec<(u64, u64, u64)> {
    let le64 = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap());
    let le32 = |b: &[u8]| u32::from_le_bytes(b[..4].try_into().unwrap());
    let comp = le64(&packed[16..24]) as usize;
    let marks = le64(&packed[24 + comp..]) as usize;
    let at = 24 + comp + 8 + 8 * marks;
    let (n, raw_len, c) =
        (le64(&packed[at..]) as usize, le32(&packed[at + 8..]) as usize, le32(&packed[at + 12..]) as usize);
    if n == 0 {
        return Vec::new();
    }
    let raw = lz4_flex::block::decompress(&packed[at + 16..at + 16 + c], raw_len).unwrap();
    let mut pos = 0;
    let mut cols = Vec::new();
    for _ in 0..3 {
        cols.push(column_values(&raw, &mut pos, n));
    }
    assert_eq!(pos, raw.len());
    let mut off = 0;
    (0..n)
        .map(|i| {
            off += cols[0][i];
            (off, cols[1][i], cols[2][i])
        })
        .collect()
}

/// The values of the coded column at `*pos` of `raw` (FORMAT.md section 10,
/// "Coded column"), moving `*pos` past it.
fn column_values(raw: &[u8], pos: &mut usize, c: usize) -> Vec<u64> {
    let h = &raw[*pos..*pos + 24];
    let base = u64::from_le_bytes(h[0..8].try_into().unwrap());
    let d = u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
    let (gw, k) = (h[12] as u32, h[13] as u32);
    let f = u16::from_le_bytes([h[14], h[15]]) as usize;
    let m = u32::from_le_bytes(h[16..20].try_into().unwrap()) as usize;
    let wi = width_of(d.saturating_sub(1) as u64);
    let field = |at: usize, j: usize, w: u32| -> u64 {
        (0..w as usize)
            .map(|b| {
                let bit = j * w as usize + b;
                ((raw[at + bit / 8] >> (bit % 8)) & 1) as u64
            })
            .enumerate()
            .map(|(i, v)| v << i)
            .sum()
    };
    let sec = |n: usize, w: u32| (n * w as usize).div_ceil(8);
    let gaps_at = *pos + 24;
    let freq_at = gaps_at + sec(d.saturating_sub(1), gw);
    let codes_at = freq_at + sec(f, wi);
    let esc_at = codes_at + sec(c, k);
    *pos = esc_at + sec(m, wi);
    let mut dict = vec![base];
    for j in 1..d {
        let v = dict[j - 1].wrapping_add(field(gaps_at, j - 1, gw));
        dict.push(v);
    }
    let mut e = 0;
    (0..c)
        .map(|i| {
            let code = if k == 0 { u64::MAX } else { field(codes_at, i, k) };
            if k > 0 && code < f as u64 {
                dict[field(freq_at, code as usize, wi) as usize]
            } else {
                e += 1;
                dict[field(esc_at, e - 1, wi) as usize]
            }
        })
        .collect()
}

#[test]
fn the_definitions_section_is_validated_as_a_spool_is() {
    let (bytes, _) = build(random_ops(13, 400));
    let packed = pack_bytes(&bytes);
    // The first record after the definitions' header (a spool header of 18
    // bytes, counted from offset 24 as if stored decoded) made an unknown tag.
    let hlen = 8 + 8 + 2; // magic, start time (8-byte varint), interval (2)
    let b = with_definitions(&packed, |d| d[hlen] = 0x42);
    let e = check_readers(&b).map(|_| ()).unwrap_err();
    assert_eq!(e.format_kind(), Some(&FormatErrorKind::UnknownTag(0x42)));
    assert_eq!(e.offset(), Some(24 + hlen as u64));
    // The unaltered round trip through the helper reads as before.
    assert_same(
        &Snapshot::from_bytes(&bytes).unwrap(),
        &check_readers(&with_definitions(&packed, |_| ())).unwrap(),
    );
    // Compressed definitions that decode to fewer bytes than announced.
    let mut b = packed.clone();
    let len = u64::from_le_bytes(b[8..16].try_into().unwrap());
    b[8..16].copy_from_slice(&(len + 1).to_le_bytes());
    let e = check_readers(&b).map(|_| ()).unwrap_err();
    assert!(matches!(e.format_kind(), Some(FormatErrorKind::PackedCorrupt(_))), "{e}");
    assert_eq!(e.offset(), Some(24), "{e}");
    // More decoded bytes than LZ4 can give: refused before allocating.
    let mut b = packed.clone();
    b[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let e = check_readers(&b).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("255"), "{e}");
}

/// A spool shaped like a short native recording: deep stacks (a recursion
/// whose leaves vary), few frames, many stack nodes.
fn native_shaped_spool() -> Vec<u8> {
    use spulse::{Frame, Header, SpoolWriter};
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: START_US, interval_us: 1000 }).unwrap();
    let t = w.define_thread(1, 1, "sort").unwrap();
    let frames: Vec<_> = (0..150u64)
        .map(|i| w.define_frame(Frame::Absolute { address: 0x40_0000 + 0x37 * i, kernel: false }).unwrap())
        .collect();
    let mut x = 12345u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut nodes: std::collections::HashMap<(Option<spulse::StackId>, usize), spulse::StackId> =
        Default::default();
    for i in 0..1200u64 {
        let depth = 8 + (rnd() % 24) as usize;
        let mut parent = None;
        for d in 0..depth {
            let f = if d + 3 < depth { d % 20 } else { 20 + (rnd() % 130) as usize };
            parent = Some(match nodes.get(&(parent, f)) {
                Some(&s) => s,
                None => {
                    let s = w.define_stack(parent, frames[f]).unwrap();
                    nodes.insert((parent, f), s);
                    s
                }
            });
        }
        w.sample(START_US + 1000 * i, t, parent.unwrap()).unwrap();
    }
    w.into_inner().unwrap()
}

#[test]
fn a_short_native_recording_packs_to_a_fraction_through_its_stack_table() {
    let spool = native_shaped_spool();
    let snap = Snapshot::from_bytes(&spool).unwrap();
    assert!(snap.definitions().stack_count() > 2 * snap.len(), "mostly stack nodes");
    let packed = pack_bytes(&spool);
    assert_same(&snap, &check_readers(&packed).unwrap());
    let table = stack_table(&packed);
    assert_eq!(table.len(), snap.definitions().stack_count());
    // Each node stood where its record was: at the end of the definitions
    // that precede it (here: every frame, then the thread).
    assert!(table.windows(2).all(|w| w[0].0 <= w[1].0));
    // Stack nodes as columns take a few bits each: the file is well under
    // half the spool (as definitions stored as they are, about 0.8).
    let ratio = packed.len() as f64 / spool.len() as f64;
    assert!(ratio < 0.45, "packed to {ratio:.2} of the spool ({} of {} bytes)", packed.len(), spool.len());
}

#[test]
fn repeated_root_nodes_round_trip_through_the_table() {
    use spulse::{Frame, Header, SpoolWriter};
    let mut w = SpoolWriter::new(Vec::new(), Header { start_time_us: START_US, interval_us: 1000 }).unwrap();
    let t = w.define_thread(1, 1, "main").unwrap();
    w.define_frame(Frame::Absolute { address: 0x1000, kernel: false }).unwrap();
    let _ = t;
    let mut spool = w.into_inner().unwrap();
    // The writer interns nodes; another writer may repeat one (FORMAT.md
    // allows it): 20,000 records of the same root node on frame 0.
    for id in 0..20_000u64 {
        spool.push(3);
        let mut v = id;
        while v >= 0x80 {
            spool.push(v as u8 | 0x80);
            v >>= 7;
        }
        spool.extend_from_slice(&[v as u8, 0, 0]);
    }
    assert_eq!(Snapshot::from_bytes(&spool).unwrap().definitions().stack_count(), 20_000);
    let packed = pack_bytes(&spool);
    // Each takes a bit or so in the table (its position: the first one's is
    // the definitions' length, the others' 0 after it).
    assert_eq!(stack_table(&packed).len(), 20_000);
    assert!(packed.len() < 20_000 / 2, "{} bytes", packed.len());
    assert_same(&Snapshot::from_bytes(&spool).unwrap(), &check_readers(&packed).unwrap());
}

#[test]
fn a_bad_stack_table_is_an_error_at_its_offset() {
    let spool = native_shaped_spool();
    let packed = pack_bytes(&spool);
    let table = stack_table(&packed);
    let table_at = {
        let le64 = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap());
        let comp = le64(&packed[16..24]) as usize;
        (24 + comp + 8 + 8 * le64(&packed[24 + comp..]) as usize) as u64
    };
    // The table rebuilt as it is reads back the same.
    assert_same(
        &Snapshot::from_bytes(&spool).unwrap(),
        &check_readers(&with_stack_table(&packed, &table)).unwrap(),
    );
    #[allow(clippy::type_complexity)]
    let cases: Vec<(&str, Vec<(u64, u64, u64)>)> = vec![
        // The first record after the 18-byte header is the thread's.
        ("inside a record", table.iter().map(|n| (19, n.1, n.2)).collect()),
        ("past the end", {
            let mut t = table.clone();
            let n = t.len();
            t[n - 1].0 += 1_000_000;
            t
        }),
        ("inside the header", {
            let mut t = table.clone();
            t[0].0 = 3;
            t
        }),
        ("parent before node 0", {
            let mut t = table.clone();
            t[5].1 = 6;
            t
        }),
        ("undefined frame", {
            let mut t = table.clone();
            t[7].2 = 150;
            t
        }),
        ("fewer nodes than the samples use", table[..table.len() / 2].to_vec()),
    ];
    for (what, t) in cases {
        let b = with_stack_table(&packed, &t);
        let e = check_readers(&b).map(|_| ()).expect_err(what);
        assert!(matches!(e, Error::Format { .. }), "{what}: {e}");
        if what != "fewer nodes than the samples use" {
            assert_eq!(e.offset(), Some(table_at), "{what}: {e}");
        }
    }
    // A table claiming more nodes than its bytes can hold: refused before
    // anything is allocated for them.
    let mut b = packed.clone();
    b[table_at as usize..table_at as usize + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = check_readers(&b).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("nodes in"), "{e}");
}

#[test]
fn a_packed_file_through_a_pipe_is_read_by_snapshot() {
    use std::os::unix::io::AsRawFd;
    let (bytes, _) = build(random_ops(17, 300));
    let f = temp_file(&pack_bytes(&bytes));
    // `cat` writes the file into a pipe whose read end this process holds.
    let mut cat = std::process::Command::new("cat")
        .arg(f.path())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("cat runs");
    let out = cat.stdout.take().unwrap();
    let snap = Snapshot::open(format!("/proc/self/fd/{}", out.as_raw_fd())).unwrap();
    assert!(cat.wait().unwrap().success());
    assert_same(&Snapshot::from_bytes(&bytes).unwrap(), &snap);
}
