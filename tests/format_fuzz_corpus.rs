//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/`) through the same
//! cross-reader checks of `spulse_testkit::fuzz` (`fuzz_check_*`), so every
//! seed and every crash ever found stays a regression test in CI. A counting
//! global allocator asserts that no input makes a reader allocate more than a
//! small multiple of its size, including synthesized hostile inputs made of
//! nothing but tiny definitions.
//!
//! `SPULSE_WRITE_CORPUS=1 cargo test --test format_fuzz_corpus seed_corpus_is_current`
//! regenerates the seeds.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use spulse_testkit::alloc::{peak_during, Counting};
use spulse_testkit::spool::*;

/// Tests in this file run one at a time while measuring.
static SERIAL: Mutex<()> = Mutex::new(());

#[global_allocator]
static ALLOC: Counting = Counting;

/// Fixed buffers a reader may hold regardless of input size: Replay's 1 MiB
/// chunk (once for validation, once for iteration), Tail's 1 MiB read chunk
/// and 16,384-sample batch, plus slack for the test harness.
const FIXED: usize = 6 << 20;
/// Allowed bytes of heap per byte of input for one reader ...
const PER_BYTE: usize = 24;
/// ... and for a fuzz check, which holds two readers at once.
const PER_BYTE_CHECK: usize = 2 * PER_BYTE;

fn measured(data: &[u8], check: fn(&[u8])) -> usize {
    peak_during(|| check(data)).0
}

/// A fuzz target: its name and the function it runs on one input.
type Target = (&'static str, fn(&[u8]));

fn targets() -> [Target; 4] {
    [
        ("snapshot", spulse_testkit::fuzz::fuzz_check_snapshot),
        ("replay", spulse_testkit::fuzz::fuzz_check_replay),
        ("tail", spulse_testkit::fuzz::fuzz_check_tail),
        ("packed", spulse_testkit::fuzz::fuzz_check_packed),
    ]
}

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target)
}

#[test]
fn committed_corpus_passes_every_check_with_bounded_allocation() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (target, check) in targets() {
        let mut n = 0;
        for entry in std::fs::read_dir(corpus_dir(target)).unwrap() {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let peak = measured(&data, check);
            // A packed file may hold far more samples than bytes: its bound
            // (FORMAT.md, section 10) counts them, twice for two readers.
            let bound = (PER_BYTE_CHECK * data.len() + FIXED)
                .max(2 * spulse_testkit::packed::memory_bound_of(&data) as usize);
            assert!(peak <= bound, "{}: peak heap {peak} for {} bytes", path.display(), data.len());
            n += 1;
        }
        assert!(n >= 8, "fuzz/corpus/{target} has only {n} files");
    }
}

/// Hostile but valid inputs made of the smallest records that each cost the
/// reader memory: the peak stays within the same per-byte bound.
#[test]
fn tiny_definitions_cost_a_bounded_multiple_of_their_size() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let header = b"SPULSE3\0\x00\x00".to_vec();
    let uvar = |mut v: u64, out: &mut Vec<u8>| {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    };
    let n = 100_000u64;
    let mut kinds: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut threads = header.clone();
    let mut modules = header.clone();
    let mut frames = header.clone();
    let mut python = header.clone();
    let mut stacks = header.clone();
    let mut samples = header.clone();
    stacks.extend_from_slice(&[2, 0, 2, 0]);
    samples.extend_from_slice(&[2, 0, 2, 0, 3, 0, 0, 0, 4, 0, 0, 0, 0]);
    for i in 0..n {
        threads.push(4);
        uvar(i, &mut threads);
        threads.extend_from_slice(&[0, 0, 0]);
        modules.push(1);
        uvar(i, &mut modules);
        modules.push(0);
        uvar(i, &mut modules);
        modules.extend_from_slice(&[1, 0, 0, 0, 0]);
        frames.push(2);
        uvar(i, &mut frames);
        frames.extend_from_slice(&[2, 0]);
        python.extend_from_slice(&[6, 0, 0, (i % 2 == 0) as u8]);
        stacks.push(3);
        uvar(i, &mut stacks);
        stacks.extend_from_slice(&[0, 0]);
        samples.extend_from_slice(&[5, 0, 0, 0]);
    }
    kinds.extend([
        ("threads", threads),
        ("modules", modules),
        ("frames", frames),
        ("python", python),
        ("stacks", stacks),
        ("samples", samples),
    ]);
    for (what, data) in &kinds {
        let file = temp_file(data);
        let readers: [(&str, &dyn Fn()); 3] = [
            ("Snapshot", &|| {
                assert!(!spulse::Snapshot::from_bytes(data).unwrap().recovered_from_truncated_tail())
            }),
            ("Replay", &|| assert!(spulse::Replay::open(file.path()).unwrap().samples().all(|s| s.is_ok()))),
            ("Tail", &|| {
                let mut t = spulse::Tail::open(file.path()).unwrap();
                while !t.poll().unwrap().is_empty() {}
            }),
        ];
        for (reader, run) in readers {
            let peak = peak_during(run).0;
            println!("{reader} on {what}: {:.1} bytes of heap per byte", peak as f64 / data.len() as f64);
            assert!(peak <= PER_BYTE * data.len() + FIXED, "{reader} on {what}: peak heap {peak}");
        }
        for (target, check) in targets() {
            let peak = measured(data, check);
            assert!(
                peak <= PER_BYTE_CHECK * data.len() + FIXED,
                "{target} on {what}: peak heap {peak} for {} bytes ({:.1} per byte)",
                data.len(),
                peak as f64 / data.len() as f64
            );
        }
    }
}

/// The seed corpus is generated: valid spools, truncated ones and corrupt ones.
/// This test checks that the committed seeds are exactly what the generator
/// makes today (so the corpus follows format changes); with
/// `SPULSE_WRITE_CORPUS=1` it rewrites them instead.
#[test]
fn seed_corpus_is_current() {
    let mut seeds: Vec<(String, Vec<u8>)> = Vec::new();
    for (i, n) in [(1u64, 0usize), (2, 20), (3, 100), (4, 400)] {
        let (bytes, model) = build(random_ops(i, n));
        seeds.push((format!("valid-{n}"), bytes.clone()));
        if model.boundaries.len() > 2 {
            // Cut inside the last and a middle record.
            let last = model.boundaries[model.boundaries.len() - 2] as usize;
            seeds.push((format!("truncated-{n}"), bytes[..last + 1].to_vec()));
            let mid = model.boundaries[model.boundaries.len() / 2] as usize;
            seeds.push((format!("truncated-mid-{n}"), bytes[..mid + 1].to_vec()));
            // Corrupt: a flipped byte in the middle, an unknown tag at a boundary.
            let mut flipped = bytes.clone();
            flipped[mid] ^= 0x5a;
            seeds.push((format!("corrupt-flip-{n}"), flipped));
            let mut tagged = bytes.clone();
            tagged.insert(mid, 0x09);
            seeds.push((format!("corrupt-tag-{n}"), tagged));
        }
    }
    seeds.push(("header-only".into(), build(std::iter::empty()).0));
    seeds.push(("short-header".into(), b"SPULSE3\0\x80\x80".to_vec()));
    seeds.push(("bad-magic".into(), b"SPULSE2\0\x00\x00".to_vec()));
    // The packed target's seeds: packed files, cut and altered ones, and the
    // shortest inputs that start like one.
    let mut packed_seeds: Vec<(String, Vec<u8>)> = Vec::new();
    for (i, n) in [(1u64, 0usize), (2, 20), (3, 100), (4, 400)] {
        let bytes = pack_bytes(&build(random_ops(i, n)).0);
        let mid = bytes.len() / 2;
        packed_seeds.push((format!("valid-{n}"), bytes.clone()));
        packed_seeds.push((format!("truncated-{n}"), bytes[..bytes.len() - 1].to_vec()));
        packed_seeds.push((format!("truncated-mid-{n}"), bytes[..mid].to_vec()));
        let mut flipped = bytes.clone();
        flipped[mid] ^= 0x5a;
        packed_seeds.push((format!("corrupt-flip-{n}"), flipped));
    }
    // Hand-built shapes that cost the most memory a byte or a sample (one of
    // them refused), and one of 262,144 identical samples in 300 bytes.
    {
        use spulse_testkit::packed::{hostile, Hostile};
        packed_seeds.push(("hostile-wide-codes".into(), hostile(Hostile::WideCodes, 3)));
        packed_seeds.push(("hostile-one-sample-blocks".into(), hostile(Hostile::OneSampleBlocks, 100)));
        packed_seeds.push(("hostile-full-dictionaries".into(), hostile(Hostile::FullDictionaries, 1)));
        packed_seeds.push(("hostile-max-per-sample".into(), hostile(Hostile::MaxPerSample, 2)));
        packed_seeds.push(("hostile-repetitive".into(), hostile(Hostile::Repetitive, 4)));
    }
    packed_seeds.push(("magic-only".into(), spulse::PACKED_MAGIC.to_vec()));
    packed_seeds.push(("first-layout-magic".into(), b"SPULSPK1".to_vec()));
    packed_seeds.push(("spool".into(), build(random_ops(5, 50)).0));
    let write = std::env::var_os("SPULSE_WRITE_CORPUS").is_some();
    for (target, _) in targets() {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        let seeds = if target == "packed" { &packed_seeds } else { &seeds };
        for (name, data) in seeds {
            let mut data = data.clone();
            if target == "tail" {
                // The first two bytes seed the append sizes.
                data.splice(0..0, [name.len() as u8, 7]);
            }
            let path = dir.join(format!("seed-{name}"));
            if write {
                std::fs::write(&path, data).unwrap();
            } else {
                let committed = std::fs::read(&path)
                    .unwrap_or_else(|e| panic!("{}: {e} (run with SPULSE_WRITE_CORPUS=1)", path.display()));
                assert!(committed == data, "{} is stale: run with SPULSE_WRITE_CORPUS=1", path.display());
            }
        }
    }
}

/// `FORMAT.md`, section 10: what a reader of a packed file of `len` bytes
/// holding `samples` samples may allocate.
fn packed_bound(len: usize, samples: usize) -> usize {
    spulse_testkit::packed::memory_bound(len as u64, samples as u64) as usize
}

/// Packed files whose blocks are shaped to cost the most memory a byte or a
/// sample (`spulse_testkit::packed::Hostile`): every reader stays within
/// the bound `FORMAT.md` states, and the shape the old reader expanded 600
/// times over (12-bit codes for one frequent value) is refused.
#[test]
fn hostile_packed_files_cost_at_most_the_stated_bound() {
    use spulse_testkit::packed::{hostile, Hostile};
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cases = [
        (Hostile::WideCodes, 24_000),
        (Hostile::OneSampleBlocks, 24_000),
        (Hostile::FullDictionaries, 40),
        (Hostile::MaxPerSample, 100),
        (Hostile::Repetitive, 200),
    ];
    for (kind, blocks) in cases {
        let data = hostile(kind, blocks);
        let file = temp_file(&data);
        let samples = match kind {
            Hostile::WideCodes | Hostile::OneSampleBlocks => blocks,
            Hostile::MaxPerSample => blocks * 4095,
            _ => blocks << 16,
        };
        // Replay holds one block at a time: its bound has no term per sample.
        #[allow(clippy::type_complexity)]
        let readers: [(&str, usize, &dyn Fn() -> Result<usize, spulse::Error>); 3] = [
            ("Snapshot::from_bytes", samples, &|| spulse::Snapshot::from_bytes(&data).map(|s| s.len())),
            ("Snapshot::open", samples, &|| spulse::Snapshot::open(file.path()).map(|s| s.len())),
            ("Replay", 0, &|| {
                let r = spulse::Replay::open(file.path())?;
                let n = r.samples().count();
                Ok(n)
            }),
        ];
        for (reader, counted, run) in readers {
            let bound = packed_bound(data.len(), counted);
            let (peak, got) = peak_during(run);
            println!(
                "{reader} on {kind:?} ({} bytes, {samples} samples): peak {peak} bytes, {:.1} a byte, \
                 {:.2} a sample, bound {bound}",
                data.len(),
                peak as f64 / data.len() as f64,
                peak as f64 / samples as f64
            );
            match kind {
                Hostile::WideCodes => {
                    let e = got.expect_err("12-bit codes for one frequent value are refused");
                    assert!(e.to_string().contains("code width 12 for 1 frequent values"), "{e}");
                }
                _ => assert_eq!(got.unwrap(), samples, "{reader} on {kind:?}"),
            }
            assert!(peak <= bound, "{reader} on {kind:?}: peak heap {peak} over the bound {bound}");
        }
    }
}
