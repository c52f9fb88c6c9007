//! Spool format benchmarks (figures in BENCHMARKS.md, section "Spool format").
//!
//! On a generated profile (see `spulse_testkit::profile`): writer encode rate, `Snapshot`
//! open (from memory and from a file), `Replay` validation and sequential scan,
//! `Tail` drain, and parsing the same data as JSON with serde_json. Run the real
//! figures with `cargo bench --bench spool` (10 million samples); under
//! `cargo test --all-targets` each benchmark runs once on a small spool.

use spulse_testkit::profile as spool_profile;

use std::collections::HashMap;
use std::hint::black_box;
use std::io::Write;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use spulse::{Replay, Snapshot, SpoolWriter, Tail};

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

/// Re-emit a snapshot's definitions and samples through a writer.
fn rewrite<W: Write>(snap: &Snapshot, out: W) -> W {
    let mut w = SpoolWriter::new(out, *snap.header()).unwrap();
    for m in snap.modules() {
        w.define_module(&spulse::NewModule {
            pid: m.pid,
            start: m.start,
            size: m.size,
            file_offset: m.file_offset,
            generation: m.generation,
            path: &m.path,
            build_id: &m.build_id,
        })
        .unwrap();
    }
    for t in snap.threads() {
        w.define_thread(t.pid, t.tid, &t.name).unwrap();
    }
    for &f in snap.frames() {
        w.define_frame(f).unwrap();
    }
    for i in 0..snap.stack_count() {
        let node = snap.stack(snap.stack_id(i).unwrap());
        w.define_stack(node.parent, node.frame).unwrap();
    }
    for s in snap.samples() {
        w.sample(s.time_us, s.thread, s.stack).unwrap();
    }
    w.into_inner().unwrap()
}

fn spool_benches(c: &mut Criterion) {
    let n = sample_count();
    let (bytes, generator) = spool_profile::spool(n);
    let snap = Snapshot::from_bytes(&bytes).unwrap();
    assert_eq!(snap.len() as u64, n);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("profile.spool");
    std::fs::write(&path, &bytes).unwrap();
    let json = spool_profile::to_json(&snap);
    eprintln!(
        "spool: {n} samples, {} stack nodes, {} frames, {} bytes ({:.2} bytes/sample overall, {:.2} per \
         sample record); JSON {} bytes ({:.1}x)",
        snap.stack_count(),
        snap.frames().len(),
        bytes.len(),
        bytes.len() as f64 / n as f64,
        generator.sample_bytes as f64 / n as f64,
        json.len(),
        json.len() as f64 / bytes.len() as f64,
    );

    let mut g = c.benchmark_group("spool");
    g.sample_size(10);
    g.throughput(Throughput::Elements(n));

    g.bench_function(BenchmarkId::new("write", n), |b| {
        b.iter(|| rewrite(&snap, std::io::sink()));
    });
    g.bench_function(BenchmarkId::new("snapshot_from_bytes", n), |b| {
        b.iter(|| Snapshot::from_bytes(black_box(&bytes)).unwrap().len());
    });
    g.bench_function(BenchmarkId::new("snapshot_open", n), |b| {
        b.iter(|| Snapshot::open(&path).unwrap().len());
    });
    g.bench_function(BenchmarkId::new("replay_open", n), |b| {
        b.iter(|| Replay::open(&path).unwrap().sample_count());
    });
    let replay = Replay::open(&path).unwrap();
    g.bench_function(BenchmarkId::new("replay_scan", n), |b| {
        b.iter(|| {
            let mut sum = 0u64;
            for s in replay.samples() {
                sum = sum.wrapping_add(s.unwrap().time_us);
            }
            sum
        });
    });
    g.bench_function(BenchmarkId::new("tail_drain", n), |b| {
        b.iter(|| {
            let mut tail = Tail::open(&path).unwrap();
            let mut count = 0;
            loop {
                let batch = tail.poll().unwrap();
                if batch.is_empty() {
                    break count;
                }
                count += batch.len();
            }
        });
    });
    g.bench_function(BenchmarkId::new("json_parse", n), |b| {
        b.iter(|| {
            let v: HashMap<String, Vec<u64>> = serde_json::from_slice(black_box(&json)).unwrap();
            v["time"].len()
        });
    });
    // The same JSON into generic values, as `JSON.parse` in seed 003's comparison.
    g.bench_function(BenchmarkId::new("json_parse_value", n), |b| {
        b.iter(|| {
            let v: serde_json::Value = serde_json::from_slice(black_box(&json)).unwrap();
            v["time"].as_array().map(Vec::len)
        });
    });
    g.finish();
}

criterion_group!(benches, spool_benches);
criterion_main!(benches);
