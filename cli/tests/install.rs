//! The installed tool records with nothing beside it: `cargo install --path cli`
//! into a temporary root, then `spulse record` from there (the preload library
//! comes from the copy inside the binary, written to a private cache directory).
//!
//! It reuses this build's target directory (`CARGO_TARGET_DIR`), so cargo
//! recompiles only what the install's features change. Offline and `--locked`:
//! the test never touches the network and builds what the lockfile says.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

#[test]
fn installed_spulse_records_with_nothing_beside_it() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    // target/<profile>/spulse -> target
    let target_dir: PathBuf =
        Path::new(env!("CARGO_BIN_EXE_spulse")).parent().and_then(Path::parent).unwrap().to_path_buf();
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("root");
    let cli_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o = Command::new(&cargo)
        .args(["install", "--offline", "--locked", "--quiet", "--path"])
        .arg(cli_dir)
        .arg("--root")
        .arg(&root)
        .env("CARGO_TARGET_DIR", &target_dir)
        .env_remove("CARGO_BUILD_TARGET_DIR")
        .output()
        .expect("run cargo install");
    assert!(o.status.success(), "cargo install failed: {}", stderr(&o));
    let bin = root.join("bin/spulse");
    let beside: Vec<_> =
        std::fs::read_dir(root.join("bin")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(beside, ["spulse"], "the install puts only the binary in bin/");
    assert!(!root.join("lib").exists());

    let cache = work.path().join("cache");
    let out = work.path().join("sh.spool");
    let o = Command::new(&bin)
        .args(["record", "-o"])
        .arg(&out)
        .args(["--", "sh", "-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"])
        .env("XDG_CACHE_HOME", &cache)
        .env_remove("SPULSE_PRELOAD_LIB")
        .current_dir(work.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "installed spulse record failed: {}", stderr(&o));
    assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));

    // The library went to $XDG_CACHE_HOME/spulse/preload-<hash>/, mode 0700.
    let dirs: Vec<PathBuf> =
        std::fs::read_dir(cache.join("spulse")).unwrap().map(|e| e.unwrap().path()).collect();
    let lib_dir =
        dirs.iter().find(|d| d.file_name().unwrap().to_string_lossy().starts_with("preload-")).unwrap();
    let m = std::fs::symlink_metadata(lib_dir).unwrap();
    assert!(m.is_dir() && m.mode() & 0o777 == 0o700, "mode {:o}", m.mode());
    let lib = lib_dir.join("libspulse_preload.so");
    assert!(std::fs::read(&lib).unwrap().starts_with(b"\x7fELF"));

    // The recording is real: samples of sh, and the spool names the cached library.
    let snap = spulse::Snapshot::open(&out).unwrap();
    assert!(snap.samples().len() > 0, "no samples");
    let info = ok(&["info", s(&out)]);
    assert!(info.contains("sh"), "{info}");

    // A second run reuses the verified copy (same inode), and a copy that was
    // changed is replaced before use.
    let ino = std::fs::metadata(&lib).unwrap().ino();
    let run = |name: &str| {
        let o = Command::new(&bin)
            .args(["record", "-o"])
            .arg(work.path().join(name))
            .args(["--", "true"])
            .env("XDG_CACHE_HOME", &cache)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    };
    run("2.spool");
    assert_eq!(std::fs::metadata(&lib).unwrap().ino(), ino);
    std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(&lib, b"\x7fELF garbage").unwrap();
    run("3.spool");
    assert!(std::fs::metadata(&lib).unwrap().len() > 100_000);
}

/// With no usable cache directory (here `XDG_CACHE_HOME` under a regular
/// file; for an unprivileged user, typically a `HOME` it cannot write), the
/// library goes to a private temporary directory for the recording, and the
/// recording works under the usual umask 022 (the directory was created with
/// the umask's 0755 and then refused by its own 0700 check).
#[test]
fn without_a_cache_directory_the_library_goes_to_a_private_temporary_one() {
    let work = tempfile::tempdir().unwrap();
    let bin = work.path().join("spulse");
    // Alone in its directory, so the embedded copy is used (not target/'s deps/).
    if std::fs::hard_link(env!("CARGO_BIN_EXE_spulse"), &bin).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_spulse"), &bin).unwrap();
    }
    let not_a_dir = work.path().join("file");
    std::fs::write(&not_a_dir, b"").unwrap();
    let tmp = work.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let out = work.path().join("t.spool");
    let o = record_loop(&bin, work.path(), &not_a_dir.join("cache"), &tmp, &out, true);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("goes to a temporary directory for this recording"), "{err}");
    assert!(err.contains("recorded 1 process"), "{err}");
    assert!(spulse::Snapshot::open(&out).unwrap().samples().len() > 0, "no samples");
    // The temporary directory is gone with the recording.
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.iter().all(|n| !n.to_string_lossy().starts_with("spulse-preload-")), "{left:?}");
}

/// The loader splits `LD_PRELOAD` at spaces and colons: a cache directory
/// (here `XDG_CACHE_HOME`) or a `TMPDIR` holding one is never put there
/// (`/w/my cache/...` would have the loader try `/w/my`, a file anyone able to
/// write `/w` can plant). The library goes to a private directory in `/tmp`
/// instead, the decoy is not touched, and the recording works.
#[test]
fn a_cache_path_with_a_space_or_colon_is_not_split_by_the_loader() {
    let work = tempfile::tempdir().unwrap();
    let bin = work.path().join("spulse");
    if std::fs::hard_link(env!("CARGO_BIN_EXE_spulse"), &bin).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_spulse"), &bin).unwrap();
    }
    // Decoys where the split paths would point: not libraries, so the loader
    // would complain on CMD's stderr if it tried them.
    std::fs::write(work.path().join("my"), b"not a library").unwrap();
    std::fs::write(work.path().join("co"), b"not a library").unwrap();
    for (cache, tmp) in [("my cache", "co:lon"), ("co:lon", "my cache")] {
        let tmp = work.path().join(tmp);
        std::fs::create_dir_all(&tmp).unwrap();
        let out = work.path().join(format!("{}.spool", cache.replace([' ', ':'], "_")));
        let o = record_loop(&bin, work.path(), &work.path().join(cache), &tmp, &out, false);
        let err = stderr(&o);
        assert!(o.status.success(), "{err}");
        assert!(!err.contains("ld.so"), "the loader was handed a split path: {err}");
        assert!(err.contains("splits LD_PRELOAD"), "{err}");
        assert!(err.contains("recorded 1 process"), "{err}");
        assert!(spulse::Snapshot::open(&out).unwrap().samples().len() > 0, "no samples");
    }
    assert_eq!(std::fs::read(work.path().join("my")).unwrap(), b"not a library");
}

/// Record a shell loop with the spulse binary `bin`, with `XDG_CACHE_HOME`
/// and `TMPDIR` as given, from `dir`, into `out`; the caller checks the output.
fn record_loop(
    bin: &Path,
    dir: &Path,
    cache: &Path,
    tmp: &Path,
    out: &Path,
    umask_022: bool,
) -> std::process::Output {
    let mut c = Command::new("sh");
    c.arg("-c").arg(if umask_022 { "umask 022; exec \"$0\" \"$@\"" } else { "exec \"$0\" \"$@\"" });
    c.arg(bin)
        .args(["record", "-o"])
        .arg(out)
        .args(["--", "sh", "-c", "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done"])
        .env("XDG_CACHE_HOME", cache)
        .env("TMPDIR", tmp)
        .env_remove("SPULSE_PRELOAD_LIB")
        .current_dir(dir)
        .output()
        .unwrap()
}
