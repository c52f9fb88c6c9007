//! dlopen churn (issue 5): many open / sample / close cycles of two libraries
//! that the loader maps at the same address, recorded at 999 Hz. No sample may
//! be attributed to a library generation other than the one that was mapped
//! when the sample was taken.
//!
//! CI runs 60 cycles; the long campaign is
//! `SPULSE_DLOPEN_CYCLES=1000 cargo test --release --test reliability_dlopen -- --nocapture`.

mod recorder_support;

use std::hint::black_box;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use recorder_support::*;
use spulse::Frame;

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64
}

#[test]
fn dlopen_churn_never_misattributes() {
    let cycles: usize = std::env::var("SPULSE_DLOPEN_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    let (dir, path) = spool_path("churn.spool");
    let libs = [
        build_plugin(dir.path(), "plugin_alpha").expect("build alpha"),
        build_plugin(dir.path(), "plugin_beta").expect("build beta"),
    ];
    let names = ["plugin_alpha", "plugin_beta"];
    let tick = Duration::from_millis(5);
    let guard = spulse::Recorder::builder().frequency_hz(999).flush_interval(tick).start(&path).unwrap();

    // (library index, base address, open time, close time) per cycle.
    let mut log = Vec::with_capacity(cycles);
    let mut bases = std::collections::HashSet::new();
    for i in 0..cycles {
        let which = i % 2;
        let t_open = now_us();
        let p = Plugin::open(&libs[which], names[which]).unwrap();
        bases.insert(p.base());
        // Give the writer a tick to register the library (with jitter, so the
        // cycle cannot lock onto the writer's phase), then burn ~8 ms in it: the
        // writer checks the loader at least once during the burn, which is what
        // lets it attribute the samples taken before that check with certainty.
        std::thread::sleep(tick + Duration::from_micros(1000 + (i as u64 * 7919) % 3000));
        let c0 = thread_cpu_seconds();
        while thread_cpu_seconds() - c0 < 0.008 {
            black_box(p.call(black_box(20_000)));
        }
        let base = p.base();
        p.close();
        let t_close = now_us();
        log.push((which, base, t_open, t_close));
    }
    let stats = guard.finish().unwrap();

    let snap = spulse::Snapshot::open(&path).unwrap();
    let mut sym = Symbolizer::default();
    let (mut attributed, mut wrong, mut outside) = (0u64, 0u64, 0u64);
    let mut generations = std::collections::HashSet::new();
    for s in snap.samples() {
        let leaf = snap.stack(s.stack).frame;
        let Frame::Module { module, .. } = snap.frame(leaf) else { continue };
        let m = snap.module(module);
        let Some(which) = names.iter().position(|n| m.path.ends_with(format!("lib{n}.so").as_bytes())) else {
            continue;
        };
        attributed += 1;
        generations.insert(m.generation);
        // The library that was open when the sample was taken.
        let open = log.iter().find(|(_, _, t0, t1)| *t0 <= s.time_us && s.time_us <= *t1);
        match open {
            Some(&(w, base, _, _)) => {
                if w != which || !(m.start <= base + 0x10000 && base <= m.end()) {
                    eprintln!(
                        "sample at {} in {} gen {} (module {}), but {} was open",
                        s.time_us, names[which], m.generation, module, names[w]
                    );
                    wrong += 1;
                }
            }
            None => outside += 1,
        }
        // The symbol inside the module agrees with the module's file. The
        // loader also runs the library's own `_init` / `_fini` while opening and
        // closing it: symbols without a size, so those samples are named
        // `libNAME.so+0xOFFSET`, in the same file.
        let name = sym.name(&snap, leaf);
        if !name.starts_with(names[which]) && !name.starts_with(&format!("lib{}.so+0x", names[which])) {
            eprintln!("sample at {} in {} gen {} is named {name}", s.time_us, names[which], m.generation);
            wrong += 1;
        }
    }
    eprintln!(
        "dlopen churn: {cycles} cycles, {} distinct load addresses, {attributed} samples in the libraries \
         across {} module generations, {wrong} misattributed, {outside} outside any open interval; {stats:?}",
        bases.len(),
        generations.len()
    );
    assert_eq!(wrong, 0, "samples attributed to the wrong library generation");
    assert_eq!(outside, 0, "samples attributed to a library while none was open");
    assert!(bases.len() < cycles, "the loader never reused an address: the test proves nothing");
    assert!(attributed as usize >= cycles, "too few samples in the libraries: {attributed}");
    assert!(
        generations.len() * 2 >= cycles,
        "most cycles should be separate generations: {}",
        generations.len()
    );
}
