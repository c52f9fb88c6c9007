//! Where `spulse record` gets `libspulse_preload.so`.
//!
//! In order:
//! 1. `SPULSE_PRELOAD_LIB`, if set and not empty (a missing file is an error);
//! 2. beside this executable, as cargo builds them (`deps/`, the same
//!    directory) or as a package installs them (`../lib/spulse/`);
//! 3. the copy carried inside this executable (`cli/build.rs` explains how it
//!    gets there), written once to a private cache directory,
//!    `$XDG_CACHE_HOME/spulse/preload-<hash>/libspulse_preload.so` (else
//!    `~/.cache/...`). The directory is created mode 0700 and used only if it
//!    is a real directory owned by this user with no group or other
//!    permissions; the file is used only if it is a regular file owned by this
//!    user whose bytes are exactly the embedded ones (it is rewritten, through
//!    a temporary file and a rename, otherwise). The file has to outlive the
//!    recording: the spool names it, and `spulse top`/`export` read its symbols.
//!    If no cache directory can be used, the copy goes to a private temporary
//!    directory removed after the recording (with a warning: frames inside the
//!    library cannot be symbolized afterwards). Root, unless it set
//!    `XDG_CACHE_HOME`, uses `/var/cache/spulse/preload-<hash>/` first, which
//!    every user can read (see [`PUBLIC_CACHE`]: a process that switches from
//!    root to another user loads the library as that user).
//!
//! The dynamic loader splits `LD_PRELOAD` at spaces and colons, so a path
//! holding either would name other files (`/tmp/my cache/...` loads
//! `/tmp/my`, which anyone may create): such a path is never used
//! ([`preloadable`]). `SPULSE_PRELOAD_LIB` naming one is refused; a library
//! beside this executable or a cache directory with one is passed over for
//! the next place, and a temporary directory with one for `/tmp`.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::CliError;

/// File name of the library.
pub const LIB_NAME: &str = "libspulse_preload.so";

/// The library to preload, and the temporary directory holding it if it had to
/// go to one (keep it alive for the whole recording).
pub fn locate(embedded: &[u8]) -> Result<(PathBuf, Option<tempfile::TempDir>), CliError> {
    if let Some(p) = std::env::var_os("SPULSE_PRELOAD_LIB").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            return Err(CliError::input(format!("SPULSE_PRELOAD_LIB={}: no such file", p.display())));
        }
        let p = std::fs::canonicalize(&p).unwrap_or(p);
        return match preloadable(&p) {
            Ok(()) => Ok((p, None)),
            Err(why) => Err(CliError::input(format!("SPULSE_PRELOAD_LIB={}: {why}", p.display()))),
        };
    }
    let exe = std::env::current_exe()
        .map_err(|e| CliError::other(format!("cannot locate this executable: {e}")))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let candidates =
        [dir.join("deps").join(LIB_NAME), dir.join(LIB_NAME), dir.join("../lib/spulse").join(LIB_NAME)];
    for c in &candidates {
        // An empty file is the placeholder `cargo check` leaves (cli/build.rs).
        if std::fs::metadata(c).is_ok_and(|m| m.is_file() && m.len() > 0) {
            let p = std::fs::canonicalize(c).unwrap_or_else(|_| c.clone());
            if preloadable(&p).is_ok() {
                return Ok((p, None));
            }
        }
    }
    if !embedded.starts_with(b"\x7fELF") {
        return Err(CliError::input(format!(
            "cannot find {LIB_NAME} (looked in {}), and this spulse was built without it inside \
             (a `cargo check` build?); build it with `cargo build --release -p spulse-cli` \
             or point SPULSE_PRELOAD_LIB at it",
            candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", ")
        )));
    }
    let xdg = std::env::var_os("XDG_CACHE_HOME").filter(|d| Path::new(d).is_absolute());
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 && xdg.is_none() {
        let dir = Path::new(PUBLIC_CACHE).join(format!("preload-{:016x}", hash(embedded)));
        if let Ok(p) = install_verified(&dir, embedded, Reach::Everyone) {
            return Ok((p, None));
        }
    }
    match cache_base() {
        Some(base) => {
            let dir = base.join("spulse").join(format!("preload-{:016x}", hash(embedded)));
            match preloadable(&dir).and_then(|()| install_verified(&dir, embedded, Reach::Owner)) {
                Ok(p) => return Ok((p, None)),
                Err(e) => eprintln!(
                    "spulse: warning: cannot use the cache directory {}: {e}; the preload library goes \
                     to a temporary directory for this recording, so its own frames will not be \
                     symbolized afterwards",
                    dir.display()
                ),
            }
        }
        None => eprintln!(
            "spulse: warning: neither XDG_CACHE_HOME nor HOME is an absolute path; the preload library \
             goes to a temporary directory for this recording"
        ),
    }
    let (p, tmp) = install_in_temp_dir(embedded)?;
    Ok((p, Some(tmp)))
}

/// Install the library in a new private temporary directory (mode 0700 from
/// its creation: tempfile's own default is 0777 less the umask, which
/// `install_verified` refuses, rightly, under the usual umask 022).
fn install_in_temp_dir(embedded: &[u8]) -> Result<(PathBuf, tempfile::TempDir), CliError> {
    let mut base = std::env::temp_dir();
    if preloadable(&base.join("spulse-preload-x").join(LIB_NAME)).is_err() {
        base = PathBuf::from("/tmp");
    }
    let tmp = tempfile::Builder::new()
        .prefix("spulse-preload-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(&base)
        .map_err(|e| {
            CliError::other(format!("cannot create a directory for {LIB_NAME} in {}: {e}", base.display()))
        })?;
    preloadable(tmp.path()).map_err(|why| CliError::other(format!("{}: {why}", tmp.path().display())))?;
    let p = install_verified(tmp.path(), embedded, Reach::Owner)
        .map_err(|e| CliError::other(format!("{}: {e}", tmp.path().display())))?;
    Ok((p, tmp))
}

/// Whether `path` (a library, or a directory one goes in) can be named in
/// `LD_PRELOAD`: absolute, and without the spaces and colons the dynamic
/// loader splits the list at. The error says why not.
pub fn preloadable(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    if !path.is_absolute() {
        return Err(std::io::Error::other("not an absolute path, as LD_PRELOAD needs"));
    }
    if let Some(&c) = bytes.iter().find(|&&c| c == b' ' || c == b':') {
        let what = if c == b' ' { "a space" } else { "a colon" };
        return Err(std::io::Error::other(format!(
            "the path holds {what}, at which the dynamic loader splits LD_PRELOAD (it would load \
             other files)"
        )));
    }
    Ok(())
}

/// `$XDG_CACHE_HOME`, else `$HOME/.cache` (absolute paths only).
fn cache_base() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME").filter(|d| Path::new(d).is_absolute()).map(PathBuf::from).or_else(
        || {
            std::env::var_os("HOME")
                .filter(|d| Path::new(d).is_absolute())
                .map(|h| PathBuf::from(h).join(".cache"))
        },
    )
}

/// 64-bit FNV-1a over the bytes, 8 at a time: names the cache directory (the
/// bytes themselves are compared before use, so this only has to spread).
fn hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        h ^= u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    for &b in chunks.remainder() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ bytes.len() as u64
}

/// Root's copy of the library when root has not chosen a cache
/// (`XDG_CACHE_HOME`, an absolute path): `/var/cache/spulse/preload-<hash>/`, which every user
/// can read, since a process of the recorded tree that switches from root
/// to another user (a daemon dropping root, `su`, `setpriv`) loads it as
/// that user. Under root's own `~/.cache` (mode 0700 above it) the loader
/// refused it, printing "cannot be preloaded" on the program's stderr, and
/// the process went unrecorded. Used only if it and every directory above
/// it are root's and writable by root alone; otherwise root's `~/.cache`.
const PUBLIC_CACHE: &str = "/var/cache/spulse";

/// Who may read the copy [`install_verified`] makes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// This user only: directory 0700, file 0500.
    Owner,
    /// Everyone (root's [`PUBLIC_CACHE`]): directories 0755, file 0555, and
    /// every directory above writable by root alone.
    Everyone,
}

/// Make `dir` (mode 0700, checked; 0755 for [`Reach::Everyone`]), and
/// `dir/LIB_NAME` holding exactly `bytes`.
fn install_verified(dir: &Path, bytes: &[u8], reach: Reach) -> std::io::Result<PathBuf> {
    let bad = |what: String| std::io::Error::other(what);
    let (dir_mode, file_mode) = match reach {
        Reach::Owner => (0o700, 0o500),
        Reach::Everyone => (0o755, 0o555),
    };
    if reach == Reach::Everyone {
        // Nothing is made under a directory someone else could have replaced.
        let above = dir.parent().and_then(Path::parent).unwrap_or(Path::new("/"));
        open_to_all_and_root_only(above)?;
    }
    match std::fs::DirBuilder::new().recursive(true).mode(dir_mode).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let m = std::fs::symlink_metadata(dir)?;
    if !m.is_dir() {
        return Err(bad("not a directory (a symlink or another file is there)".into()));
    }
    if m.uid() != uid {
        return Err(bad(format!("owned by uid {}, not by this user ({uid})", m.uid())));
    }
    match reach {
        Reach::Owner if m.mode() & 0o077 != 0 => {
            return Err(bad(format!(
                "mode {:o}: group or others have access (must be 0700)",
                m.mode() & 0o777
            )))
        }
        Reach::Owner => {}
        Reach::Everyone => {
            // (A umask may have taken the others' bits from what was made.)
            if m.mode() & 0o777 != 0o755 {
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
            }
            open_to_all_and_root_only(dir)?;
        }
    }
    let path = dir.join(LIB_NAME);
    let readable = |p: &Path| {
        reach == Reach::Owner || std::fs::symlink_metadata(p).is_ok_and(|m| m.mode() & 0o777 == file_mode)
    };
    if same_bytes(&path, bytes, uid)? && readable(&path) {
        return Ok(path);
    }
    let mut tmp = tempfile::Builder::new().prefix(".lib-").tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().set_permissions(std::fs::Permissions::from_mode(file_mode))?;
    tmp.as_file().sync_all()?;
    tmp.persist(&path).map_err(|e| e.error)?;
    if !same_bytes(&path, bytes, uid)? || !readable(&path) {
        return Err(bad(format!("{} does not hold what was just written", path.display())));
    }
    Ok(path)
}

/// `Ok` when `dir` and every directory above it are root's, writable by
/// root alone and open to everyone (a `PUBLIC_CACHE` made under a
/// `/var/cache` another user may write would be theirs to replace). The
/// cache's own `spulse` directory, made by the first run with the umask, is
/// opened to everyone here.
fn open_to_all_and_root_only(dir: &Path) -> std::io::Result<()> {
    for (i, d) in dir.ancestors().enumerate() {
        let mut m = std::fs::symlink_metadata(d)?;
        if i == 1 && m.uid() == 0 && m.is_dir() && m.mode() & 0o755 != 0o755 && d == Path::new(PUBLIC_CACHE) {
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755))?;
            m = std::fs::symlink_metadata(d)?;
        }
        if !m.is_dir() || m.uid() != 0 || m.mode() & 0o022 != 0 || m.mode() & 0o001 == 0 {
            return Err(std::io::Error::other(format!(
                "{}: not a directory of root's that only root may write and everyone may enter",
                d.display()
            )));
        }
    }
    Ok(())
}

/// Whether `path` is a regular file owned by `uid` holding exactly `bytes`
/// (`Ok(false)` if it is missing or differs; not followed if it is a symlink).
fn same_bytes(path: &Path, bytes: &[u8], uid: u32) -> std::io::Result<bool> {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        // ELOOP: a symlink; replaced by the rename below.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Ok(false),
        Err(e) => return Err(e),
    };
    let m = f.metadata()?;
    if !m.is_file() || m.uid() != uid || m.len() != bytes.len() as u64 {
        return Ok(false);
    }
    let mut have = Vec::with_capacity(bytes.len());
    File::take(f, bytes.len() as u64 + 1).read_to_end(&mut have)?;
    Ok(have == bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_copy_is_verified_and_repaired() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("spulse/preload-x");
        let bytes = b"\x7fELF not really a library".to_vec();
        let p = install_verified(&dir, &bytes, Reach::Owner).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), bytes);
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        // A changed copy is replaced, not used.
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&p, b"\x7fELF tampered").unwrap();
        let p2 = install_verified(&dir, &bytes, Reach::Owner).unwrap();
        assert_eq!(std::fs::read(&p2).unwrap(), bytes);
        // A directory others can write to is refused.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = install_verified(&dir, &bytes, Reach::Owner).unwrap_err();
        assert!(e.to_string().contains("mode 777"), "{e}");
        // So is a symlink in the directory's place.
        let real = base.path().join("elsewhere");
        std::fs::create_dir(&real).unwrap();
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = base.path().join("spulse/preload-y");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let e = install_verified(&link, &bytes, Reach::Owner).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
    }

    #[test]
    fn paths_the_loader_would_split_are_not_preloadable() {
        assert!(preloadable(Path::new("/home/u/.cache/spulse/preload-1/libspulse_preload.so")).is_ok());
        for bad in ["/tmp/my cache/spulse", "/tmp/co:lon/x.so", "relative/x.so", "/a/b c:d"] {
            let e = preloadable(Path::new(bad)).unwrap_err();
            assert!(e.to_string().contains("LD_PRELOAD"), "{bad}: {e}");
        }
    }

    #[test]
    fn hash_depends_on_every_byte() {
        let a = vec![7u8; 1001];
        let mut b = a.clone();
        b[1000] = 8;
        let mut c = a.clone();
        c[3] = 8;
        assert_ne!(hash(&a), hash(&b));
        assert_ne!(hash(&a), hash(&c));
        assert_ne!(hash(&a), hash(&a[..1000]));
    }
}
