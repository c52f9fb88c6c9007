//! The allocation-heavy workloads of the heap-sampling cost benchmark
//! (`heap_cost.py`): the same code in every binary, which differ only in their
//! global allocator. Each prints `name seconds` per workload.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

/// xorshift64*: the same sequence in every binary.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Serialize a document of 2,000 records to JSON text and parse it back.
fn serde_json_round_trip(rounds: usize) {
    let mut rng = Rng(7);
    let doc: Vec<serde_json::Value> = (0..2000)
        .map(|i| {
            serde_json::json!({
                "id": i,
                "name": format!("user-{}", rng.next() % 100_000),
                "tags": (0..(rng.next() % 8)).map(|t| format!("tag{t}")).collect::<Vec<_>>(),
                "score": (rng.next() % 1000) as f64 / 7.0,
                "nested": { "a": [1, 2, 3], "b": "text of some length here" },
            })
        })
        .collect();
    let doc = serde_json::Value::Array(doc);
    for _ in 0..rounds {
        let text = serde_json::to_string(&doc).unwrap();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        black_box(back);
    }
}

/// Insert and remove random keys with small string values.
fn btreemap_churn(ops: usize) {
    let mut rng = Rng(11);
    let mut map: BTreeMap<u64, String> = BTreeMap::new();
    for _ in 0..ops {
        let k = rng.next() % 50_000;
        if rng.next() % 2 == 0 {
            map.insert(k, format!("value {k}"));
        } else {
            map.remove(&k);
        }
    }
    black_box(map.len());
}

/// Eight threads allocating and freeing small blocks (16-256 bytes), each
/// keeping a window of 1,024 live.
fn many_threads_small(per_thread: usize) {
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            std::thread::spawn(move || {
                let mut rng = Rng(13 + t);
                let mut window: Vec<Vec<u8>> = (0..1024).map(|_| Vec::new()).collect();
                for i in 0..per_thread {
                    let size = 16 + (rng.next() % 241) as usize;
                    window[i % 1024] = Vec::with_capacity(size);
                    black_box(&window[i % 1024]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// The `threads` workload's allocations per thread: `HEAP_PER_THREAD`, else 1 M.
fn per_thread() -> usize {
    std::env::var("HEAP_PER_THREAD").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000)
}

/// The workloads by name, with their default sizes.
pub fn all() -> Vec<(&'static str, Box<dyn Fn()>)> {
    vec![
        ("serde_json", Box::new(|| serde_json_round_trip(60))),
        ("btreemap", Box::new(|| btreemap_churn(3_000_000))),
        // HEAP_PER_THREAD=n: another number of allocations per thread (the
        // threads are created anew each round).
        ("threads", Box::new(|| many_threads_small(per_thread()))),
    ]
}

#[allow(dead_code)]
pub fn run() {
    let only = std::env::args().nth(1);
    let go = |name: &str, f: &dyn Fn()| {
        if only.as_deref().is_some_and(|o| o != name) {
            return;
        }
        let t = Instant::now();
        f();
        println!("{name} {:.6}", t.elapsed().as_secs_f64());
    };
    go("serde_json", &|| serde_json_round_trip(60));
    go("btreemap", &|| btreemap_churn(3_000_000));
    go("threads", &|| many_threads_small(per_thread()));
}
