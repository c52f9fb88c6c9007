//! A synthetic spool shaped like a real profile, shared by `benches/spool.rs`,
//! `tests/format/size.rs` and `examples/spool_rss.rs`: a few thousand distinct
//! leaf stacks of depth 10-60 sharing call-path prefixes, chosen with a skewed
//! (Zipf-like) popularity, interned lazily on first use as a recorder does;
//! several threads sampled at 1 kHz with jitter and occasional out-of-order
//! arrival (negative deltas).

use std::io::Write;

use spulse::{Frame, Header, NewModule, SpoolWriter, StackId, ThreadId};

pub const START_US: u64 = 1_700_000_000_000_000;
pub const THREADS: usize = 6;
pub const LEAF_STACKS: usize = 3_000;

/// Deterministic xorshift64*.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// The shape of the profile: every leaf stack as a frame path (root first).
pub struct Shape {
    paths: Vec<Vec<usize>>,
    /// Cumulative popularity of the leaves (for sampling).
    cdf: Vec<f64>,
    frames: usize,
}

impl Shape {
    pub fn new(seed: u64) -> Shape {
        let mut rng = Rng::new(seed);
        let frames = 6_000;
        let trunk: Vec<usize> = (0..4).collect();
        // 60 shared call paths of depth 8-40 below a common trunk ...
        let bases: Vec<Vec<usize>> = (0..60)
            .map(|_| {
                let depth = 4 + rng.below(33) as usize;
                let mut p = trunk.clone();
                p.extend((0..depth).map(|_| 4 + rng.below(frames as u64 - 4) as usize));
                p
            })
            .collect();
        // ... each leaf stack one of them plus its own tail, depth 10-60 in all.
        let paths: Vec<Vec<usize>> = (0..LEAF_STACKS)
            .map(|_| {
                let mut p = bases[rng.below(bases.len() as u64) as usize].clone();
                let target = (10 + rng.below(51) as usize).max(p.len() + 2).min(60);
                while p.len() < target {
                    p.push(4 + rng.below(frames as u64 - 4) as usize);
                }
                p
            })
            .collect();
        let mut cdf = Vec::with_capacity(LEAF_STACKS);
        let mut acc = 0.0;
        for i in 0..LEAF_STACKS {
            acc += 1.0 / (i as f64 + 1.0).powf(1.1);
            cdf.push(acc);
        }
        Shape { paths, cdf, frames }
    }

    fn pick(&self, rng: &mut Rng) -> usize {
        let x = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * self.cdf[self.cdf.len() - 1];
        self.cdf.partition_point(|&c| c < x).min(self.cdf.len() - 1)
    }
}

/// Streams samples of the profile into a writer, defining stacks lazily.
pub struct Generator {
    shape: Shape,
    rng: Rng,
    threads: Vec<ThreadId>,
    frame_ids: Vec<Option<spulse::FrameId>>,
    /// Interned stack node per (parent node, frame) along each path.
    leaf_ids: Vec<Option<StackId>>,
    nodes: std::collections::HashMap<(Option<StackId>, usize), StackId>,
    modules: Vec<spulse::ModuleId>,
    tick: u64,
    /// Microseconds between ticks (1,000: a 1 kHz profile).
    pub tick_us: u64,
    pending: Vec<(u64, usize, usize)>,
    last_time: u64,
    /// Bytes taken by sample records alone.
    pub sample_bytes: u64,
    pub samples: u64,
}

impl Generator {
    pub fn new<W: Write>(w: &mut SpoolWriter<W>, seed: u64) -> Generator {
        let shape = Shape::new(seed);
        let mut modules = Vec::new();
        for i in 0..10u64 {
            let path = format!("/usr/lib/x86_64-linux-gnu/libexample{i}.so.1");
            modules.push(
                w.define_module(&NewModule {
                    pid: 4242,
                    start: 0x7f00_0000_0000 + i * 0x100_0000,
                    size: 0x80_0000,
                    file_offset: 0,
                    generation: 0,
                    path: path.as_bytes(),
                    build_id: &[i as u8; 20],
                })
                .unwrap(),
            );
        }
        let threads = (0..THREADS)
            .map(|i| w.define_thread(4242, 4242 + i as u32, &format!("worker-{i}")).unwrap())
            .collect();
        Generator {
            frame_ids: vec![None; shape.frames],
            leaf_ids: vec![None; LEAF_STACKS],
            shape,
            rng: Rng::new(seed ^ 0xabcdef),
            threads,
            nodes: Default::default(),
            modules,
            tick: 0,
            tick_us: 1000,
            pending: Vec::new(),
            last_time: START_US,
            sample_bytes: 0,
            samples: 0,
        }
    }

    fn frame<W: Write>(&mut self, w: &mut SpoolWriter<W>, f: usize) -> spulse::FrameId {
        if let Some(id) = self.frame_ids[f] {
            return id;
        }
        let m = self.modules[f % self.modules.len()];
        let id = w
            .define_frame(Frame::Module { module: m, file_relative: (f as u64 * 0x1f3) % 0x80_0000 })
            .unwrap();
        self.frame_ids[f] = Some(id);
        id
    }

    fn stack<W: Write>(&mut self, w: &mut SpoolWriter<W>, leaf: usize) -> StackId {
        if let Some(id) = self.leaf_ids[leaf] {
            return id;
        }
        let mut parent = None;
        for i in 0..self.shape.paths[leaf].len() {
            let f = self.shape.paths[leaf][i];
            parent = Some(match self.nodes.get(&(parent, f)) {
                Some(&id) => id,
                None => {
                    let fid = self.frame(w, f);
                    let id = w.define_stack(parent, fid).unwrap();
                    self.nodes.insert((parent, f), id);
                    id
                }
            });
        }
        let id = parent.unwrap();
        self.leaf_ids[leaf] = Some(id);
        id
    }

    /// Append `n` samples.
    pub fn write<W: Write>(&mut self, w: &mut SpoolWriter<W>, n: u64) {
        let goal = self.samples + n;
        while self.samples < goal {
            if self.pending.is_empty() {
                // One tick (1 ms by default): each busy thread sampled once, with jitter.
                self.tick += 1;
                for t in 0..THREADS {
                    if self.rng.below(10) < 8 {
                        let time = START_US + self.tick * self.tick_us + t as u64 * 150 + self.rng.below(40);
                        let leaf = self.shape.pick(&mut self.rng);
                        self.pending.push((time, t, leaf));
                    }
                }
                // Occasionally one arrives late (out of order).
                if self.pending.len() > 1 && self.rng.below(50) == 0 {
                    self.pending.swap(0, 1);
                }
                self.pending.reverse();
                continue;
            }
            let (time, t, leaf) = self.pending.pop().unwrap();
            let stack = self.stack(w, leaf);
            let before = w.len();
            w.sample(time, self.threads[t], stack).unwrap();
            self.sample_bytes += w.len() - before;
            self.last_time = time;
            self.samples += 1;
        }
    }
}

/// A whole spool of `n` samples in memory, plus its generator (for statistics).
pub fn spool(n: u64) -> (Vec<u8>, Generator) {
    let header = Header { start_time_us: START_US, interval_us: 1000 };
    let mut w = SpoolWriter::new(Vec::with_capacity(n as usize * 6 + (1 << 20)), header).unwrap();
    let mut g = Generator::new(&mut w, 1);
    g.write(&mut w, n);
    (w.into_inner().unwrap(), g)
}

/// The same data as JSON column arrays (what a JSON-based profiler would store).
pub fn to_json(snap: &spulse::Snapshot) -> Vec<u8> {
    let mut out = Vec::with_capacity(snap.len() * 30);
    let column = |out: &mut Vec<u8>, name: &str, values: &mut dyn Iterator<Item = u64>, last: bool| {
        write!(out, "\"{name}\":[").unwrap();
        let mut first = true;
        for v in values {
            if !first {
                out.push(b',');
            }
            first = false;
            write!(out, "{v}").unwrap();
        }
        out.extend_from_slice(if last { b"]" } else { b"]," });
    };
    out.push(b'{');
    column(&mut out, "time", &mut snap.samples().map(|s| s.time_us), false);
    column(&mut out, "thread", &mut snap.samples().map(|s| s.thread.get() as u64), false);
    column(&mut out, "stack", &mut snap.samples().map(|s| s.stack.get() as u64), false);
    let stacks = || (0..snap.stack_count()).map(|i| snap.stack(snap.stack_id(i).unwrap()));
    column(
        &mut out,
        "stack_parent",
        &mut stacks().map(|s| s.parent.map_or(0, |p| p.get() as u64 + 1)),
        false,
    );
    column(&mut out, "stack_frame", &mut stacks().map(|s| s.frame.get() as u64), false);
    column(
        &mut out,
        "frame_address",
        &mut (0..snap.frames().len()).map(|i| snap.frame_address(snap.frame_id(i).unwrap()).unwrap_or(0)),
        true,
    );
    out.push(b'}');
    out
}

/// The samples alone as three JSON arrays, `[[times], [threads], [stacks]]`,
/// which serde_json parses into typed columns `(Vec<u64>, Vec<u32>, Vec<u32>)`
/// (the packed-file benchmark's comparison).
pub fn columns_json(snap: &spulse::Snapshot) -> Vec<u8> {
    let mut out = Vec::with_capacity(snap.len() * 26);
    out.push(b'[');
    for c in 0..3 {
        out.push(b'[');
        for (i, s) in snap.samples().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let v = match c {
                0 => s.time_us,
                1 => s.thread.get() as u64,
                _ => s.stack.get() as u64,
            };
            write!(out, "{v}").unwrap();
        }
        out.extend_from_slice(if c == 2 { b"]" } else { b"]," });
    }
    out.push(b']');
    out
}
