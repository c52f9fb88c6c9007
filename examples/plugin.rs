//! Plugins coming and going: builds two small C libraries with the system `cc`,
//! then, while recording, dlopens the first, runs it, dlcloses it and dlopens
//! the second (usually at the same address). Prints the module generations the
//! spool recorded and how many samples each library got.
//!
//! ```text
//! cargo run --release --example plugin [out.spool]
//! ```

use spulse_testkit::symbols as support;

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

fn run(p: &support::Plugin, wall: Duration) {
    let end = Instant::now() + wall;
    while Instant::now() < end {
        black_box(p.call(black_box(100_000)));
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = std::env::args().nth(1);
    let path = arg.clone().unwrap_or_else(|| "plugin.spool".to_string());
    if arg.is_none() {
        let _ = std::fs::remove_file(&path);
    }
    let dir = tempfile::tempdir()?;
    let libs = [
        ("plugin_alpha", support::build_plugin(dir.path(), "plugin_alpha")?),
        ("plugin_beta", support::build_plugin(dir.path(), "plugin_beta")?),
    ];

    let guard = spulse::Recorder::builder().flush_interval(Duration::from_millis(20)).start(&path)?;
    for (name, lib) in &libs {
        let p = support::Plugin::open(lib, name)?;
        println!("loaded {} at {:#x}", lib.display(), p.base());
        std::thread::sleep(Duration::from_millis(60));
        run(&p, Duration::from_millis(500));
        p.close();
        std::thread::sleep(Duration::from_millis(60));
    }
    let stats = guard.finish()?;
    println!(
        "{} samples, {} module generations, engine {}",
        stats.samples_written, stats.module_generations, stats.engine
    );

    let snap = spulse::Snapshot::open(&path)?;
    let mut per_module: HashMap<spulse::ModuleId, u64> = HashMap::new();
    for s in snap.samples() {
        if let spulse::Frame::Module { module, .. } = snap.frame(snap.stack(s.stack).frame) {
            *per_module.entry(module).or_default() += 1;
        }
    }
    println!("\nmodules recorded after start:");
    for m in snap.modules().iter().filter(|m| m.generation > 0) {
        println!(
            "  module {:3}  generation {}  {:#x}..{:#x}  {}  {}  samples {}",
            m.id,
            m.generation,
            m.start,
            m.end(),
            if snap.is_module_active(m.id) { "active " } else { "retired" },
            m.path().display(),
            per_module.get(&m.id).copied().unwrap_or(0)
        );
    }
    println!("\nnext: cargo run --release -p spulse-cli -- top {path}");
    Ok(())
}
