//! Modules coming and going: a library is dlopen'ed after start, sampled,
//! dlclose'd, and another library is dlopen'ed at the same address. The spool
//! must hold two module generations at that address, the first retired before
//! the second is defined, and every sample attributed to the library that was
//! mapped when it was taken. Stacks must continue through the library's frames
//! into the test executable, which shows the unwinder got the new library's
//! unwind tables.

mod recorder_support;

use std::hint::black_box;
use std::time::Duration;

use recorder_support::*;
use spulse::{Frame, ModuleId};

fn burn(p: &Plugin, cpu: f64) {
    let c0 = thread_cpu_seconds();
    while thread_cpu_seconds() - c0 < cpu {
        black_box(p.call(black_box(200_000)));
    }
}

#[test]
fn dlopen_dlclose_same_address_two_generations() {
    let _one = serial();
    let (dir, path) = spool_path("dl.spool");
    let alpha = build_plugin(dir.path(), "plugin_alpha").expect("build libplugin_alpha.so");
    let beta = build_plugin(dir.path(), "plugin_beta").expect("build libplugin_beta.so");

    let tick = Duration::from_millis(20);
    let guard = spulse::Recorder::builder().frequency_hz(999).flush_interval(tick).start(&path).unwrap();

    let a = Plugin::open(&alpha, "plugin_alpha").unwrap();
    std::thread::sleep(tick * 5);
    burn(&a, 0.4);
    let base_a = a.base();
    std::thread::sleep(tick * 5);
    a.close();
    // Alpha's own teardown code (its `_fini`, run by dlclose) can still be
    // sampled while `close` runs; once it returns, alpha is unmapped.
    let t_close_a = spulse_now_us();
    std::thread::sleep(tick * 5);
    let t_open_b = spulse_now_us();
    let b = Plugin::open(&beta, "plugin_beta").unwrap();
    let base_b = b.base();
    std::thread::sleep(tick * 5);
    burn(&b, 0.4);
    std::thread::sleep(tick * 5);
    b.close();
    let stats = guard.finish().unwrap();
    assert_eq!(base_a, base_b, "the loader did not reuse the address; the test needs it to");

    let snap = spulse::Snapshot::open(&path).unwrap();
    let find = |suffix: &str| -> Vec<ModuleId> {
        snap.modules().iter().filter(|m| m.path.ends_with(suffix.as_bytes())).map(|m| m.id).collect()
    };
    let ma = find("libplugin_alpha.so");
    let mb = find("libplugin_beta.so");
    assert_eq!(ma.len(), 1, "one executable mapping of alpha");
    assert_eq!(mb.len(), 1, "one executable mapping of beta");
    let (ma, mb) = (ma[0], mb[0]);
    let (da, db) = (snap.module(ma), snap.module(mb));
    assert_eq!(da.start, db.start, "same address");
    assert!(db.generation > da.generation, "beta is a later generation");
    assert!(da.generation > 0, "alpha appeared after start");
    assert!(!snap.is_module_active(ma), "alpha was retired");
    assert!(snap.deactivations().iter().any(|d| d.module == ma));
    assert!(mb > ma, "beta defined after alpha (and so after alpha's retirement)");
    assert!(stats.module_generations >= 3, "{stats:?}");

    let exe = snap.modules().iter().find(|m| m.generation == 0).map(|m| m.path.clone()).unwrap();
    let mut sym = Symbolizer::default();
    let (mut in_a, mut in_b, mut deep_a, mut deep_b) = (0, 0, 0, 0);
    for s in snap.samples() {
        let leaf = snap.stack(s.stack).frame;
        let Frame::Module { module, .. } = snap.frame(leaf) else { continue };
        if module != ma && module != mb {
            continue;
        }
        let name = sym.name(&snap, leaf);
        let reaches_exe = snap.stack_frames(s.stack).any(|f| match snap.frame(f) {
            Frame::Module { module, .. } => snap.module(module).path == exe,
            _ => false,
        });
        if module == ma {
            in_a += 1;
            deep_a += reaches_exe as u32;
            assert!(s.time_us < t_close_a, "alpha sample after alpha was closed");
            assert!(name.starts_with("plugin_alpha") || is_crt(&name), "alpha sample named {name}");
        } else {
            in_b += 1;
            deep_b += reaches_exe as u32;
            assert!(s.time_us > t_open_b, "beta sample before beta was opened");
            assert!(name.starts_with("plugin_beta") || is_crt(&name), "beta sample named {name}");
        }
    }
    eprintln!("alpha {in_a} ({deep_a} reach the exe), beta {in_b} ({deep_b}); {stats:?}");
    assert!(in_a >= 200 && in_b >= 200, "samples in the libraries: alpha {in_a}, beta {in_b}");
    assert!(deep_a as f64 >= 0.9 * in_a as f64, "alpha stacks stop in the library");
    assert!(deep_b as f64 >= 0.9 * in_b as f64, "beta stacks stop in the library");
}

/// A library opened and closed between two of the writer's checks (`ld`
/// does so with its LTO plugin at every link; a program probing a plugin
/// at start) is an unseen change, but with one object gone and none other
/// removed the modules mapped on both sides stayed mapped: the samples taken
/// meanwhile in the test executable are attributed to it, not written as
/// bare addresses (they were, every one of them, for a process that ended
/// before the next check).
#[test]
fn a_library_opened_and_closed_between_checks_leaves_the_program_attributed() {
    let _one = serial();
    let (dir, path) = spool_path("blip.spool");
    let alpha = build_plugin(dir.path(), "plugin_alpha").expect("build libplugin_alpha.so");
    // One engine (no early switch-check ticks) and a long flush interval:
    // the writer checks the loader about once a second.
    let guard = spulse::Recorder::builder()
        .frequency_hz(999)
        .engine(spulse::EngineChoice::PerfEvent)
        .flush_interval(Duration::from_secs(1))
        .start(&path)
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let tid = gettid();
    let t0 = spulse_now_us();
    Plugin::open(&alpha, "plugin_alpha").unwrap().close();
    burn_cpu(0.3, 10_000, Duration::from_secs(10));
    let t1 = spulse_now_us();
    let stats = guard.finish().unwrap();

    let snap = spulse::Snapshot::open(&path).unwrap();
    let exe = std::fs::canonicalize(std::env::current_exe().unwrap()).unwrap();
    let in_exe = |m: ModuleId| {
        use std::os::unix::ffi::OsStrExt;
        std::path::Path::new(std::ffi::OsStr::from_bytes(&snap.module(m).path)) == exe
    };
    let (mut burnt, mut attributed) = (0, 0);
    for s in snap.samples().filter(|s| snap.thread(s.thread).tid == tid && (t0..=t1).contains(&s.time_us)) {
        burnt += 1;
        // (The leaf may be the kernel or the vDSO: the burn reads its CPU clock.)
        let reaches_exe = snap
            .stack_frames(s.stack)
            .any(|f| matches!(snap.frame(f), Frame::Module { module, .. } if in_exe(module)));
        attributed += reaches_exe as u32;
    }
    eprintln!("{attributed} of {burnt} samples in the executable; {stats:?}");
    assert!(burnt >= 100, "{burnt} samples of the burn");
    assert!(attributed as f64 >= 0.98 * burnt as f64, "{attributed} of {burnt} samples in the executable");
}

/// The start-up and teardown code the toolchain links into every shared
/// library, which dlopen and dlclose run (and a sample can land in).
fn is_crt(name: &str) -> bool {
    ["_init", "_fini", "frame_dummy", "register_tm_clones", "deregister_tm_clones", "__do_global_dtors_aux"]
        .iter()
        .any(|c| name.starts_with(c))
}

fn spulse_now_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64
}
