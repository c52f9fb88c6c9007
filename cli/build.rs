//! Lets the `spulse` binary carry `libspulse_preload.so`, so that an installed
//! tool (`cargo install --path cli`) records with nothing beside it.
//!
//! The preload library is a dependency of this package (`spulse-preload`,
//! crate types `cdylib` and `rlib`), so cargo builds its cdylib into the same
//! `deps/` directory as every other artifact of this build, and a binary target
//! is compiled only after all of its dependencies have finished (including
//! their linking: a binary needs its dependencies' objects, so cargo does not
//! start it on their metadata alone). `src/main.rs` includes the library's bytes
//! from the path this script passes in `SPULSE_PRELOAD_SO`.
//!
//! `cargo check` and `cargo clippy` build no cdylib: for them, if nothing is
//! there yet, this script leaves an empty file at that path (created only if
//! absent, so it never replaces a built library; a real build overwrites it).
//! The binary treats empty bytes as "not embedded" and says so.

use std::path::PathBuf;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // OUT_DIR is <build-dir>/<profile>/build/spulse-cli-<hash>/out; the
    // dependencies' artifacts are in <build-dir>/<profile>/deps.
    let deps = out.ancestors().nth(3).expect("OUT_DIR has the cargo layout").join("deps");
    let lib = deps.join("libspulse_preload.so");
    if !lib.exists() {
        let _ = std::fs::create_dir_all(&deps);
        // create_new: if the real library appeared meanwhile, leave it alone.
        let _ = std::fs::OpenOptions::new().write(true).create_new(true).open(&lib);
    }
    println!("cargo:rustc-env=SPULSE_PRELOAD_SO={}", lib.display());
    println!("cargo:rerun-if-changed=build.rs");
}
