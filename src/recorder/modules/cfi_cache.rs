//! A cache of [`super::cfi_check`]'s verdicts, one small file per unwind table,
//! so that a library's FDEs are parsed once rather than at the start of every
//! recorded process (libc alone has thousands of them: this check was about a
//! third of a recorder's start-up).
//!
//! Off unless `SPULSE_CFI_CACHE` names a directory (`spulse record` sets it to
//! the user's cache directory for the tree it records). A file holds the
//! positions of the dropped search-table entries of one table, and is named
//! and keyed by what the verdict depends on: the object's GNU build id, the
//! sizes and stated addresses of `.eh_frame_hdr` and `.eh_frame`, a hash of
//! the search table, and this crate's version (whose `cfi_check` rules made
//! the verdict). An object without a build id (the Rust toolchain's
//! `librustc_driver` and `libLLVM`, whose checks were a third of a short
//! `rustc`'s CPU under `spulse record`) is keyed by two hashes of its whole
//! `.eh_frame` instead, which the verdict depends on (a few ms for their
//! 6-8 MB, against about 100 ms for their checks). A file that is
//! missing, short, oversized or does not repeat its key is ignored and
//! rewritten; files are written to a temporary name and renamed, so a reader
//! never sees half of one. The directory is created with mode 0700: the
//! verdict decides what the signal handler's unwinder may be handed, so only
//! the user who records may write it, and a file or directory that belongs to
//! another user or that group or others may write is ignored.

use std::hash::{Hash, Hasher};
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::PathBuf;

/// What stands for the build id of an object without one: this, then two
/// 64-bit hashes of its `.eh_frame` ([`content_id`]).
const CONTENT_ID: &[u8] = b"no build id; eh_frame hashes ";

/// [`CONTENT_ID`] and two hashes of `bytes` taken 8 bytes at a time, each
/// word mixed into two states by different multiply-rotate rounds (about 1
/// ns a word: SipHash of the toolchain's 14 MB of tables took 20 ms of a
/// short `rustc`), each state finished with the length and a final mix.
/// Not meant to resist a forger (whoever can make the recorded program load
/// a library owns it already), but two tables that differ collide in both
/// only by accident, and then only if their search tables' SipHash and
/// every size and address of the key agree too.
fn content_id(bytes: &[u8]) -> Vec<u8> {
    const P1: u64 = 0x9e37_79b9_7f4a_7c15;
    const P2: u64 = 0xc2b2_ae3d_27d4_eb4f;
    let mix = |mut h: u64| {
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    };
    let (mut a, mut b) = (P2, P1);
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        a = (a ^ w).wrapping_mul(P1).rotate_left(31);
        b = b.wrapping_add(w).rotate_left(27).wrapping_mul(P2);
    }
    let mut last = [0u8; 8];
    last[..words.remainder().len()].copy_from_slice(words.remainder());
    let w = u64::from_le_bytes(last);
    let n = bytes.len() as u64;
    let (a, b) = (mix(a ^ w ^ n), mix(b.wrapping_add(w).wrapping_add(n.rotate_left(32))));
    let mut id = CONTENT_ID.to_vec();
    id.extend_from_slice(&a.to_le_bytes());
    id.extend_from_slice(&b.to_le_bytes());
    id
}

/// The environment variable that names the cache directory.
pub(crate) const ENV: &str = "SPULSE_CFI_CACHE";

const MAGIC: &[u8; 8] = b"SPCFI\x01\0\0";
/// Most dropped entries a file may list (a table of a million FDEs, all dropped).
const MAX_ENTRIES: usize = 1 << 20;

/// What a verdict depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Key {
    pub build_id: Vec<u8>,
    pub hdr_svma: u64,
    pub hdr_len: u64,
    pub eh_frame_svma: u64,
    pub eh_frame_len: u64,
    pub text_svma: u64,
    /// Hash of the `.eh_frame_hdr` bytes (the search table).
    pub hdr_hash: u64,
}

impl Key {
    /// The key of an object's tables (`Option` for callers that may have
    /// no key to give: this one always has one).
    pub(crate) fn new(
        build_id: &[u8],
        hdr: &[u8],
        hdr_svma: u64,
        eh_frame: &[u8],
        eh_frame_svma: u64,
        text_svma: u64,
    ) -> Option<Key> {
        let build_id = if build_id.is_empty() { content_id(eh_frame) } else { build_id.to_vec() };
        let mut h = std::hash::DefaultHasher::new();
        hdr.hash(&mut h);
        Some(Key {
            build_id,
            hdr_svma,
            hdr_len: hdr.len() as u64,
            eh_frame_svma,
            eh_frame_len: eh_frame.len() as u64,
            text_svma,
            hdr_hash: h.finish(),
        })
    }

    /// The key's bytes as a file repeats them: the crate version, then the fields.
    /// (A content id and a build id never meet: one begins with
    /// [`CONTENT_ID`], which no 16- or 20-byte GNU build id is as long as.)
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let version = env!("CARGO_PKG_VERSION").as_bytes();
        out.extend_from_slice(&(version.len() as u32).to_le_bytes());
        out.extend_from_slice(version);
        out.extend_from_slice(&(self.build_id.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.build_id);
        for v in [
            self.hdr_svma,
            self.hdr_len,
            self.eh_frame_svma,
            self.eh_frame_len,
            self.text_svma,
            self.hdr_hash,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    fn file_name(&self) -> String {
        let id: String = self.build_id.iter().take(20).map(|b| format!("{b:02x}")).collect();
        let mut h = std::hash::DefaultHasher::new();
        self.encode().hash(&mut h);
        format!("{id}-{:016x}.cfi", h.finish())
    }
}

/// The cache directory.
#[derive(Debug, Clone)]
pub(crate) struct CfiCache {
    dir: PathBuf,
}

impl CfiCache {
    /// The cache named by `SPULSE_CFI_CACHE`, if set and not empty.
    pub(crate) fn from_env() -> Option<CfiCache> {
        let dir = std::env::var_os(ENV).filter(|d| !d.is_empty())?;
        Some(CfiCache { dir: PathBuf::from(dir) })
    }

    #[cfg(test)]
    pub(crate) fn at(dir: &std::path::Path) -> CfiCache {
        CfiCache { dir: dir.to_path_buf() }
    }

    /// The verdict stored for `key`: positions of the dropped entries, ascending.
    pub(crate) fn load(&self, key: &Key) -> Option<Vec<u32>> {
        let path = self.dir.join(key.file_name());
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .ok()?;
        let meta = file.metadata().ok()?;
        let head = MAGIC.len() + key.encode().len() + 4;
        if !meta.is_file() || meta.len() > (head + 4 * MAX_ENTRIES) as u64 {
            return None;
        }
        // Only a verdict that no other user could have written is trusted:
        // the file and its directory belong to this user and are writable by
        // nobody else (a shared or loosened directory is ignored, not used).
        let dir = std::fs::metadata(&self.dir).ok()?;
        if !private_to_me(&meta) || !private_to_me(&dir) {
            return None;
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        file.take(meta.len()).read_to_end(&mut bytes).ok()?;
        decode(&bytes, key)
    }

    /// Store the verdict for `key`. Failures are ignored: the cache only saves time.
    pub(crate) fn store(&self, key: &Key, dropped: &[u32]) {
        if dropped.len() > MAX_ENTRIES {
            return;
        }
        let _ = self.write(key, dropped);
    }

    fn write(&self, key: &Key, dropped: &[u32]) -> std::io::Result<()> {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.dir)?;
        let name = key.file_name();
        let tmp = self.dir.join(format!(".{name}.{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&tmp)?;
        let res = std::io::Write::write_all(&mut f, &encode(key, dropped))
            .and_then(|()| std::fs::rename(&tmp, self.dir.join(&name)));
        if res.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        res
    }
}

/// Owned by this process's effective user and not writable by group or others.
fn private_to_me(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    meta.uid() == me && meta.mode() & 0o022 == 0
}

fn encode(key: &Key, dropped: &[u32]) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&key.encode());
    out.extend_from_slice(&(dropped.len() as u32).to_le_bytes());
    for d in dropped {
        out.extend_from_slice(&d.to_le_bytes());
    }
    out
}

/// The verdict in `bytes`, if they are a complete file for `key` whose entries
/// ascend strictly.
fn decode(bytes: &[u8], key: &Key) -> Option<Vec<u32>> {
    let rest = bytes.strip_prefix(MAGIC.as_slice())?;
    let rest = rest.strip_prefix(key.encode().as_slice())?;
    let (count, rest) = rest.split_first_chunk::<4>()?;
    let count = u32::from_le_bytes(*count) as usize;
    if count > MAX_ENTRIES || rest.len() != count * 4 {
        return None;
    }
    let entries: Vec<u32> =
        rest.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
    entries.windows(2).all(|w| w[0] < w[1]).then_some(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(build_id: &[u8]) -> Key {
        Key::new(build_id, &[1, 2, 3, 4], 0x1000, &[0; 64], 0x2000, 0x3000).unwrap()
    }

    #[test]
    fn stores_and_loads_a_verdict_per_key() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CfiCache::at(&dir.path().join("cfi"));
        let k = key(b"\x01\x02");
        assert_eq!(cache.load(&k), None);
        cache.store(&k, &[3, 9, 12]);
        assert_eq!(cache.load(&k), Some(vec![3, 9, 12]));
        // Another build id, or the same one with other tables, is another entry.
        assert_eq!(cache.load(&key(b"\x01\x03")), None);
        let other = Key::new(b"\x01\x02", &[1, 2, 3, 5], 0x1000, &[0; 64], 0x2000, 0x3000).unwrap();
        assert_eq!(cache.load(&other), None);
        // No build id: keyed by the unwind table's bytes, one entry per content.
        let plain = |eh: &[u8]| Key::new(b"", &[1, 2, 3, 4], 0x1000, eh, 0x2000, 0x3000).unwrap();
        cache.store(&plain(&[7; 64]), &[5]);
        assert_eq!(cache.load(&plain(&[7; 64])), Some(vec![5]));
        let mut changed = [7u8; 64];
        changed[40] = 8;
        assert_eq!(cache.load(&plain(&changed)), None, "one byte of .eh_frame changed");
        assert_eq!(cache.load(&plain(&[7; 65])), None, "one byte longer");
        // Every single-bit change of a table moves both hashes.
        let base: Vec<u8> = (0..61u32).map(|i| (i * 37 % 251) as u8).collect();
        let id = content_id(&base);
        for bit in 0..base.len() * 8 {
            let mut t = base.clone();
            t[bit / 8] ^= 1 << (bit % 8);
            let other = content_id(&t);
            let n = CONTENT_ID.len();
            assert!(other[n..n + 8] != id[n..n + 8] && other[n + 8..] != id[n + 8..], "bit {bit}");
        }
        assert_eq!(cache.load(&k), Some(vec![3, 9, 12]), "the build-id entry stays");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("cfi")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn damaged_files_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CfiCache::at(dir.path());
        let k = key(b"\xaa");
        cache.store(&k, &[1, 2]);
        let path = dir.path().join(k.file_name());
        let good = std::fs::read(&path).unwrap();
        // Cut short, one byte longer, entries out of order, another key's bytes.
        let mut unordered = good.clone();
        let n = unordered.len();
        unordered[n - 8..n - 4].copy_from_slice(&5u32.to_le_bytes());
        let mut foreign = good.clone();
        foreign[MAGIC.len() + 5] ^= 1;
        for bad in [&good[..good.len() - 1], &[good.as_slice(), &[0]].concat(), &unordered, &foreign, &[][..]]
        {
            std::fs::write(&path, bad).unwrap();
            assert_eq!(cache.load(&k), None);
        }
        // A verdict that others could have written is not trusted: a file or
        // a directory writable by group or others.
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(&path, &good).unwrap();
        assert_eq!(cache.load(&k), Some(vec![1, 2]));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o620)).unwrap();
        assert_eq!(cache.load(&k), None);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(cache.load(&k), None);
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(cache.load(&k), Some(vec![1, 2]));
        // A FIFO in its place is not opened for a blocking read.
        std::fs::remove_file(&path).unwrap();
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates a node.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(cache.load(&k), None);
    }
}
