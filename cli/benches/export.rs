//! Export throughput and symbolization cost.
//!
//! - `export/pprof` and `export/collapsed`: open, validate and stream a spool of
//!   10 million samples (with `--bench`; 50,000 in criterion's test mode, as run
//!   by `cargo test --all-targets`) into a pprof / folded-stacks export written
//!   to a sink, symbolization disabled (frames become `module+0xoffset`).
//! - `firefox-load/json`, `firefox-load/jslb-skeleton` and
//!   `firefox-load/jslb-full`: what a consumer of a Firefox export of 1 million
//!   samples (with `--bench`; 50,000 in test mode) spends loading it. `json`
//!   parses the `.json` export into a `serde_json::Value`; `jslb-skeleton`
//!   parses the `.jslb` container's slab table and root JSON and maps every
//!   placeholder to its slab (typed slabs as borrowed byte slices, as the
//!   profiler wraps them in typed arrays without copying); `jslb-full` also
//!   parses the JSON slabs (sample stacks, weights, strings...). The file
//!   sizes (and gzipped sizes) are printed.
//! - `symbolize/quickstart-cold` and `-warm`: resolve every frame of a
//!   quickstart recording, with a fresh symbolizer (loading and parsing every
//!   module file) and with the modules already loaded. Skipped, with a note,
//!   when the quickstart example has not been built.

use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use spulse::{Frame, Header, NewModule, Replay, SpoolWriter};
use spulse_cli::aggregate::aggregate;
use spulse_cli::export::{self, Job};
use spulse_cli::report::symbolize_all;
use spulse_cli::select::Filter;
use spulse_cli::symbolize::{Options, Symbolizer};

fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Write a synthetic spool: 8 threads, 4,000 distinct leaf stacks of depth 8
/// to 40 over 64 functions' worth of frames, `samples` samples.
fn synthetic(path: &Path, samples: u64) {
    let file = std::fs::File::create(path).unwrap();
    let header = Header { start_time_us: 1_700_000_000_000_000, interval_us: 1000 };
    let mut w = SpoolWriter::new(std::io::BufWriter::with_capacity(1 << 20, file), header).unwrap();
    let m = w
        .define_module(&NewModule {
            pid: 77,
            start: 0x5555_0000_0000,
            size: 1 << 24,
            file_offset: 0,
            generation: 1,
            path: b"/nonexistent/bench/app",
            build_id: &[1, 2, 3, 4],
        })
        .unwrap();
    let frames: Vec<_> = (0..512u64)
        .map(|i| w.define_frame(Frame::Module { module: m, file_relative: 0x1000 + i * 0x40 }).unwrap())
        .collect();
    let threads: Vec<_> = (0..8).map(|i| w.define_thread(77, 100 + i, &format!("t{i}")).unwrap()).collect();
    // Deterministic xorshift.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut leaves = Vec::new();
    let roots: Vec<_> = (0..16).map(|i| w.define_stack(None, frames[i]).unwrap()).collect();
    for _ in 0..4000 {
        let mut s = roots[(rnd() % 16) as usize];
        let depth = 8 + rnd() % 33;
        for _ in 1..depth {
            s = w.define_stack(Some(s), frames[(rnd() % 512) as usize]).unwrap();
        }
        leaves.push(s);
    }
    let mut t = 1_700_000_000_000_000u64;
    for i in 0..samples {
        t += 125;
        // Skewed: a few stacks are hot.
        let r = rnd();
        let leaf = if r % 4 == 0 { leaves[(r >> 8) as usize % 4000] } else { leaves[(r >> 8) as usize % 40] };
        w.sample(t, threads[(i % 8) as usize], leaf).unwrap();
    }
    w.into_inner().unwrap();
}

struct Sink;
impl std::io::Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn export_once(path: &Path, pprof: bool) {
    let replay = Replay::open(path).unwrap();
    let job = Job {
        replay: &replay,
        filter: &Filter::default(),
        title: "bench",
        output: "sink",
        shape: Default::default(),
    };
    let mut sym = Symbolizer::new(Options { dirs: Vec::new(), disabled: true });
    // As `spulse export` does: select, aggregate, symbolize, write.
    let exporter = if pprof { export::pprof::export } else { export::collapsed::export };
    exporter(&job, &mut sym, &mut Sink).unwrap();
}

fn bench_export(c: &mut Criterion) {
    let samples = if full_run() { 10_000_000 } else { 50_000 };
    let path = std::env::temp_dir().join(format!("spulse-bench-{samples}.spool"));
    synthetic(&path, samples);
    eprintln!(
        "export input: {} ({} bytes, {samples} samples)",
        path.display(),
        path.metadata().unwrap().len()
    );
    let mut g = c.benchmark_group("export");
    g.sample_size(10).measurement_time(Duration::from_secs(if full_run() { 40 } else { 1 }));
    g.bench_function("pprof", |b| b.iter(|| export_once(&path, true)));
    g.bench_function("collapsed", |b| b.iter(|| export_once(&path, false)));
    g.finish();
    // The spool is kept for measuring the binary's peak memory by hand
    // (`/usr/bin/time -v spulse export ...`); remove the small one.
    if !full_run() {
        let _ = std::fs::remove_file(&path);
    }
}

/// What loading a `.jslb` file found: typed slabs (type, bytes) borrowed from
/// the file, and JSON slabs (parsed, or only located).
#[derive(Default)]
struct Mapped<'a> {
    typed: Vec<(json_slabs::SlabType, &'a [u8])>,
    json: Vec<serde_json::Value>,
    json_bytes: usize,
}

/// Replace every placeholder in `v` by `null`, mapping its slab; JSON slabs
/// are parsed (and walked) only with `parse_json`.
fn map_slabs<'a>(
    f: &json_slabs::ParsedFile<'a>,
    v: &mut serde_json::Value,
    parse_json: bool,
    out: &mut Mapped<'a>,
) {
    use serde_json::Value;
    match v {
        Value::Object(m) if m.len() == 1 && m.contains_key(json_slabs::SLAB_REF_KEY) => {
            let i = m[json_slabs::SLAB_REF_KEY].as_u64().expect("slab index") as usize;
            let p = json_slabs::SlabPlaceholder(i);
            let slab = f.slab_at(p).expect("placeholder resolves");
            if slab.slab_type == json_slabs::SlabType::Json {
                out.json_bytes += slab.bytes.len();
                if parse_json {
                    let mut sub: Value = serde_json::from_slice(slab.bytes).expect("JSON slab");
                    map_slabs(f, &mut sub, parse_json, out);
                    out.json.push(sub);
                }
            } else {
                out.typed.push((slab.slab_type, slab.bytes));
            }
            *v = Value::Null;
        }
        Value::Object(m) => m.values_mut().for_each(|x| map_slabs(f, x, parse_json, out)),
        Value::Array(a) => a.iter_mut().for_each(|x| map_slabs(f, x, parse_json, out)),
        _ => {}
    }
}

/// Load a `.jslb` file: slab table, root JSON, placeholders mapped.
fn load_jslb(bytes: &[u8], parse_json: bool) -> (serde_json::Value, Mapped<'_>) {
    let f = json_slabs::ParsedFile::parse(bytes).expect("JSLB");
    let mut root: serde_json::Value = serde_json::from_slice(f.root_json_bytes()).expect("root JSON");
    let mut out = Mapped::default();
    map_slabs(&f, &mut root, parse_json, &mut out);
    (root, out)
}

fn gz_len(bytes: &[u8]) -> usize {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap().len()
}

fn bench_firefox_load(c: &mut Criterion) {
    let samples = if full_run() { 1_000_000 } else { 50_000 };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ff.spool");
    synthetic(&path, samples);
    let replay = Replay::open(&path).unwrap();
    let job = Job {
        replay: &replay,
        filter: &Filter::default(),
        title: "bench",
        output: "memory",
        shape: Default::default(),
    };
    let export_to = |exporter: export::Exporter| {
        let mut sym = Symbolizer::new(Options { dirs: Vec::new(), disabled: true });
        let mut out = Vec::new();
        exporter(&job, &mut sym, &mut out).unwrap();
        out
    };
    let json = export_to(export::firefox::export);
    let jslb = export_to(export::jslb::export);
    let (_, m) = load_jslb(&jslb, false);
    let typed: usize = m.typed.iter().map(|(_, b)| b.len()).sum();
    let root = json_slabs::ParsedFile::parse(&jslb).unwrap().root_json_bytes().len();
    eprintln!(
        "firefox export of {samples} samples: .json {} bytes ({} gzipped); .jslb {} bytes ({} gzipped): \
         skeleton {root}, {} typed slabs {typed}, JSON slabs {}",
        json.len(),
        gz_len(&json),
        jslb.len(),
        gz_len(&jslb),
        m.typed.len(),
        m.json_bytes
    );
    let mut g = c.benchmark_group("firefox-load");
    g.sample_size(10).measurement_time(Duration::from_secs(if full_run() { 20 } else { 1 }));
    g.bench_function("json", |b| b.iter(|| serde_json::from_slice::<serde_json::Value>(&json).unwrap()));
    g.bench_function("jslb-skeleton", |b| b.iter(|| load_jslb(&jslb, false).1.typed.len()));
    g.bench_function("jslb-full", |b| b.iter(|| load_jslb(&jslb, true).1.json.len()));
    g.finish();
}

fn quickstart_spool() -> Option<(tempfile::TempDir, PathBuf)> {
    let exe = std::env::current_exe().ok()?;
    let qs = exe.parent()?.parent()?.join("examples").join("quickstart");
    if !qs.exists() {
        eprintln!("symbolize benches skipped: build the quickstart example first ({})", qs.display());
        return None;
    }
    let dir = tempfile::tempdir().ok()?;
    let spool = dir.path().join("qs.spool");
    let ok = std::process::Command::new(&qs).arg(&spool).output().ok()?.status.success();
    ok.then_some((dir, spool))
}

fn bench_symbolize(c: &mut Criterion) {
    let Some((_dir, spool)) = quickstart_spool() else { return };
    let replay = Replay::open(&spool).unwrap();
    let agg = aggregate(&replay, &Filter::default(), false).unwrap();
    let mut g = c.benchmark_group("symbolize");
    g.sample_size(10);
    g.bench_function("quickstart-cold", |b| {
        b.iter(|| {
            let mut sym = Symbolizer::new(Options::default());
            symbolize_all(&replay, &agg, &mut sym);
            sym.files_loaded()
        })
    });
    let mut warm = Symbolizer::new(Options::default());
    symbolize_all(&replay, &agg, &mut warm);
    g.bench_function("quickstart-warm", |b| {
        b.iter(|| {
            warm.clear_frame_cache();
            symbolize_all(&replay, &agg, &mut warm);
        })
    });
    g.finish();
}

criterion_group!(benches, bench_export, bench_firefox_load, bench_symbolize);
criterion_main!(benches);
