//! Packed container benchmarks (figures in BENCHMARKS.md, section "Packed
//! container").
//!
//! On the profile-shaped spool of `benches/spool.rs` (see
//! `spulse_testkit::profile`), packed with `spulse::pack`: the two files'
//! sizes, `Snapshot::open` of the packed file and of the spool (alone, and
//! followed by iterating every sample), and `serde_json` parsing the same
//! samples into typed columns (`Vec<u64>` times, `Vec<u32>` threads and
//! stacks). Run the real figures with
//! `cargo bench --bench packed` (10 million samples); under
//! `cargo test --all-targets` each benchmark runs once on a small spool.
//! Peak memory is measured outside criterion: `spool_rss open` (see
//! `examples/spool_rss.rs`) under `/usr/bin/time -v`.

use spulse_testkit::profile as spool_profile;

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use spulse::{Replay, Snapshot};

fn sample_count() -> u64 {
    if let Ok(n) = std::env::var("SPULSE_BENCH_SAMPLES") {
        return n.parse().expect("SPULSE_BENCH_SAMPLES is a number");
    }
    if std::env::args().any(|a| a == "--bench") {
        10_000_000
    } else {
        20_000
    }
}

fn packed_benches(c: &mut Criterion) {
    let n = sample_count();
    let (bytes, _) = spool_profile::spool(n);
    let dir = tempfile::tempdir().unwrap();
    let spool_path = dir.path().join("profile.spool");
    std::fs::write(&spool_path, &bytes).unwrap();
    let packed_path = dir.path().join("profile.spk");
    let summary = spulse::pack(
        &Replay::open(&spool_path).unwrap(),
        std::io::BufWriter::new(std::fs::File::create(&packed_path).unwrap()),
    )
    .unwrap();
    let snap = Snapshot::open(&spool_path).unwrap();
    let packed = Snapshot::open(&packed_path).unwrap();
    assert!(packed.is_packed());
    assert!(packed.samples().eq(snap.samples()), "the packed file holds the spool's samples");
    let json = spool_profile::columns_json(&snap);
    let parsed: (Vec<u64>, Vec<u32>, Vec<u32>) = serde_json::from_slice(&json).unwrap();
    assert_eq!(parsed.0.len() as u64, n);
    drop((snap, packed, parsed));
    eprintln!(
        "packed: {n} samples; spool {} bytes ({:.2} bytes/sample), packed {} bytes ({:.2} bytes/sample, {:.3} of \
         the spool) in {} blocks; decoded columns {} bytes; JSON columns {} bytes",
        bytes.len(),
        bytes.len() as f64 / n as f64,
        summary.bytes,
        summary.bytes as f64 / n as f64,
        summary.bytes as f64 / bytes.len() as f64,
        summary.blocks,
        16 * n,
        json.len(),
    );

    let mut g = c.benchmark_group("packed");
    g.sample_size(10);
    g.throughput(Throughput::Elements(n));
    g.bench_function(BenchmarkId::new("snapshot_open_packed", n), |b| {
        b.iter(|| Snapshot::open(&packed_path).unwrap().len());
    });
    g.bench_function(BenchmarkId::new("snapshot_open_spool", n), |b| {
        b.iter(|| Snapshot::open(&spool_path).unwrap().len());
    });
    // Opening and then reading every sample: a packed file's samples are
    // decoded on access, so opening alone is not the whole cost.
    let iterate = |snap: Snapshot| {
        snap.samples().fold(0u64, |a, s| {
            a.wrapping_add(s.time_us ^ s.thread.get() as u64 ^ (s.stack.get() as u64) << 32)
        })
    };
    g.bench_function(BenchmarkId::new("snapshot_open_iterate_packed", n), |b| {
        b.iter(|| iterate(Snapshot::open(&packed_path).unwrap()));
    });
    g.bench_function(BenchmarkId::new("snapshot_open_iterate_spool", n), |b| {
        b.iter(|| iterate(Snapshot::open(&spool_path).unwrap()));
    });
    g.bench_function(BenchmarkId::new("json_parse_typed_columns", n), |b| {
        b.iter(|| {
            let v: (Vec<u64>, Vec<u32>, Vec<u32>) = serde_json::from_slice(black_box(&json)).unwrap();
            v.0.len()
        });
    });
    g.bench_function(BenchmarkId::new("replay_open_packed", n), |b| {
        b.iter(|| Replay::open(&packed_path).unwrap().sample_count());
    });
    g.bench_function(BenchmarkId::new("pack", n), |b| {
        let replay = Replay::open(&spool_path).unwrap();
        b.iter(|| spulse::pack(&replay, std::io::sink()).unwrap().bytes);
    });
    g.finish();
}

criterion_group!(benches, packed_benches);
criterion_main!(benches);
