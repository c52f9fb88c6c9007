//! Writing a command's output file (`export`, `pack`): never over the input
//! itself, and for a regular file through a temporary file beside it that is
//! renamed into place only once complete, so the output is either the old
//! file or the whole new one (Ctrl-C included). The temporary file has no
//! name while it is written (O_TMPFILE, where the file system has it), so a
//! process killed outright or aborted by a failed allocation leaves nothing.

use std::fs::OpenOptions;
use std::io::{BufWriter, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::display::escape;
use crate::CliError;

/// A writer that counts the bytes it passes on and remembers whether the
/// reader went away (a closed pipe), so that the writers' own error values
/// need not carry the error kind.
struct Counted<W: Write> {
    inner: W,
    bytes: u64,
    broken_pipe: bool,
}

impl<W: Write> Counted<W> {
    fn new(inner: W) -> Counted<W> {
        Counted { inner, bytes: 0, broken_pipe: false }
    }

    fn note<T>(&mut self, r: std::io::Result<T>) -> std::io::Result<T> {
        if let Err(e) = &r {
            self.broken_pipe |= e.kind() == std::io::ErrorKind::BrokenPipe;
        }
        r
    }
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let r = self.inner.write(buf);
        let n = self.note(r)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let r = self.inner.flush();
        self.note(r)
    }
}

/// Exit code of a command ended by Ctrl-C (128 + SIGINT, as shells report it).
const EXIT_INTERRUPTED: i32 = 130;

/// Where the output goes.
pub enum Target {
    /// Standard output (`-`).
    Stdout,
    /// A regular file (existing or not), written through a temporary file in
    /// its directory that is renamed over it once complete.
    Replace(PathBuf),
    /// An existing file that is not a regular file (`/dev/null`, a FIFO):
    /// written in place, since renaming over it would replace the device node.
    InPlace(PathBuf),
}

/// Decide where the output goes, refusing an output that is the input itself
/// (by device and inode, so symlinks, `./` spellings and hard links are caught)
/// before anything is opened for writing.
pub fn target(input: &Path, output: &Path) -> Result<Target, CliError> {
    if output.as_os_str() == "-" {
        return Ok(Target::Stdout);
    }
    let shown = || escape(&output.display().to_string()).into_owned();
    let out_meta = match std::fs::metadata(output) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(CliError::output(&shown(), e)),
    };
    let Some(out_meta) = out_meta else {
        return Ok(Target::Replace(output.to_path_buf()));
    };
    if let Ok(in_meta) = std::fs::metadata(input) {
        if (in_meta.dev(), in_meta.ino()) == (out_meta.dev(), out_meta.ino()) {
            return Err(CliError::input(format!(
                "{}: is the input spool {}; refusing to overwrite the recording (choose another output)",
                shown(),
                escape(&input.display().to_string())
            )));
        }
    }
    if out_meta.is_dir() {
        return Err(CliError::other(format!("{}: is a directory", shown())));
    }
    if !out_meta.is_file() {
        return Ok(Target::InPlace(output.to_path_buf()));
    }
    // A symlink to a regular file: replace the file it points to, not the link.
    let is_link = std::fs::symlink_metadata(output).is_ok_and(|m| m.file_type().is_symlink());
    if is_link {
        let real = std::fs::canonicalize(output).map_err(|e| CliError::output(&shown(), e))?;
        return Ok(Target::Replace(real));
    }
    Ok(Target::Replace(output.to_path_buf()))
}

/// What [`write`] wrote: the writer's result, where (for messages) and how
/// many bytes.
pub struct Written<T> {
    /// What the writing function returned.
    pub value: T,
    /// The output as shown in messages (`stdout` or the escaped path).
    pub name: String,
    /// Bytes written.
    pub bytes: u64,
}

/// Run `write_all` against `target` (named `out_name` in messages; `command`
/// names the command in the Ctrl-C message). `None` when standard output was
/// closed by its reader (`| head`), which is not an error.
pub fn write<T>(
    target: Target,
    out_name: &str,
    command: &'static str,
    write_all: impl FnOnce(&mut dyn Write) -> Result<T, CliError>,
) -> Result<Option<Written<T>>, CliError> {
    match target {
        Target::Stdout => {
            let mut out = Counted::new(BufWriter::new(std::io::stdout().lock()));
            match write_all(&mut out).and_then(|v| flush(&mut out, "stdout").map(|()| v)) {
                Ok(value) => Ok(Some(Written { value, name: "stdout".into(), bytes: out.bytes })),
                // The reader stopped reading (`| head`): not an error.
                Err(_) if out.broken_pipe => Ok(None),
                Err(e) => Err(e),
            }
        }
        Target::InPlace(path) => {
            let f = OpenOptions::new().write(true).truncate(true).open(&path);
            let f = f.map_err(|e| CliError::output(out_name, e))?;
            let mut out = Counted::new(BufWriter::new(f));
            let value = write_all(&mut out)?;
            flush(&mut out, out_name)?;
            Ok(Some(Written { value, name: out_name.to_string(), bytes: out.bytes }))
        }
        Target::Replace(path) => {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            let prefix = format!(".{}.", path.file_name().unwrap_or_default().to_string_lossy());
            // Ctrl-C (SIGINT, SIGTERM, SIGHUP) would end the process without
            // running drops: its handler, which ctrlc runs on a thread of its
            // own, removes the temporary file if it has a name, and exits
            // holding the lock, so this thread cannot name or rename the file
            // after it: the output is either the old file or the whole new one.
            let phase: Arc<Mutex<Phase>> = Arc::new(Mutex::new(Phase::Writing));
            {
                let phase = phase.clone();
                let shown = out_name.to_string();
                let _ = ctrlc::set_handler(move || {
                    let mut p = phase.lock().unwrap_or_else(|e| e.into_inner());
                    match std::mem::replace(&mut *p, Phase::Interrupted) {
                        Phase::Done => {}
                        Phase::Named(tmp) => {
                            let _ = std::fs::remove_file(tmp);
                            eprintln!("spulse: {command}: interrupted; {shown} left as it was");
                        }
                        // An unnamed temporary file goes with the process.
                        Phase::Writing | Phase::Interrupted => {
                            eprintln!("spulse: {command}: interrupted; {shown} left as it was")
                        }
                    }
                    std::process::exit(EXIT_INTERRUPTED);
                });
            }
            let interrupted = || CliError::other("interrupted");
            // Mode 0600 (less the umask), as the recorder creates the spool:
            // the output holds the profile (and an output replaced keeps no
            // wider mode than that). Where the file system allows it the file
            // has no name until it is complete (O_TMPFILE), so a process that
            // ends without running drops or its handler (SIGKILL, an abort on
            // a failed allocation) leaves nothing behind.
            let tmp = match Unnamed::create(dir) {
                Some(f) => Temp::Unnamed(f),
                None => {
                    let mut p = phase.lock().unwrap_or_else(|e| e.into_inner());
                    if !matches!(*p, Phase::Writing) {
                        return Err(interrupted());
                    }
                    let tmp = tempfile::Builder::new()
                        .prefix(&prefix)
                        .suffix(".tmp")
                        .permissions(std::fs::Permissions::from_mode(0o600))
                        .tempfile_in(dir)
                        .map_err(|e| CliError::output(out_name, e))?;
                    *p = Phase::Named(tmp.path().to_path_buf());
                    Temp::Named(tmp)
                }
            };
            // On any error below `tmp` is dropped, which deletes it: an existing
            // output stays as it was.
            let mut out = Counted::new(BufWriter::new(tmp));
            let value = write_all(&mut out)?;
            flush(&mut out, out_name)?;
            let bytes = out.bytes;
            let tmp = out.inner.into_inner().map_err(|e| CliError::output(out_name, e.into_error()))?;
            tmp.file().sync_all().map_err(|e| CliError::output(out_name, e))?;
            let mut p = phase.lock().unwrap_or_else(|e| e.into_inner());
            let tmp = match tmp {
                Temp::Named(t) => t,
                // Named only now, for the rename over the output.
                Temp::Unnamed(f) => {
                    if !matches!(*p, Phase::Writing) {
                        return Err(interrupted());
                    }
                    let named = f.link_in(dir, &prefix).map_err(|e| CliError::output(out_name, e))?;
                    *p = Phase::Named(named.path().to_path_buf());
                    named
                }
            };
            if !matches!(*p, Phase::Named(_)) {
                return Err(interrupted());
            }
            tmp.persist(&path).map_err(|e| CliError::output(out_name, e.error))?;
            *p = Phase::Done;
            drop(p);
            Ok(Some(Written { value, name: out_name.to_string(), bytes }))
        }
    }
}

fn flush(out: &mut impl Write, name: &str) -> Result<(), CliError> {
    out.flush().map_err(|e| CliError::output(name, e))
}

/// Where the output stands, for the Ctrl-C handler.
enum Phase {
    /// Being written to a file without a name.
    Writing,
    /// Being written to (or complete in) the named temporary file.
    Named(PathBuf),
    /// Renamed over the output.
    Done,
    /// The handler ran (and the process is exiting).
    Interrupted,
}

/// The temporary output file.
enum Temp {
    /// Created without a name (O_TMPFILE).
    Unnamed(Unnamed),
    /// Created under a temporary name (where O_TMPFILE is not supported).
    Named(tempfile::NamedTempFile),
}

impl Temp {
    fn file(&self) -> &std::fs::File {
        match self {
            Temp::Unnamed(u) => &u.0,
            Temp::Named(t) => t.as_file(),
        }
    }
}

impl Write for Temp {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Temp::Unnamed(u) => u.0.write(buf),
            Temp::Named(t) => t.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Temp::Unnamed(u) => u.0.flush(),
            Temp::Named(t) => t.flush(),
        }
    }
}

/// A file opened with O_TMPFILE in the output's directory: it has no name,
/// so it disappears with its descriptor however the process ends.
struct Unnamed(std::fs::File);

impl Unnamed {
    /// `None` where the directory's file system has no O_TMPFILE, or where
    /// `/proc/self/fd` (through which it is given a name once complete) is
    /// missing: the caller then uses a named temporary file.
    fn create(dir: &Path) -> Option<Unnamed> {
        use std::os::unix::fs::OpenOptionsExt;
        if !Path::new("/proc/self/fd").is_dir() {
            return None;
        }
        let f = OpenOptions::new()
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
            .open(dir)
            .ok()?;
        Some(Unnamed(f))
    }

    /// Give the complete file a temporary name in `dir` (linkat through
    /// `/proc/self/fd`, which needs no privilege), to be renamed over the
    /// output.
    fn link_in(self, dir: &Path, prefix: &str) -> std::io::Result<tempfile::NamedTempFile> {
        use std::os::fd::AsRawFd;
        use std::os::unix::ffi::OsStrExt;
        let from = std::ffi::CString::new(format!("/proc/self/fd/{}", self.0.as_raw_fd()))?;
        let pid = std::process::id();
        for attempt in 0u32..100 {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let name = dir.join(format!("{prefix}{pid}.{nanos:x}{attempt}.tmp"));
            let to = std::ffi::CString::new(name.as_os_str().as_bytes())?;
            // SAFETY: both paths are NUL-terminated C strings that live across
            // the call; linkat only reads them.
            let r = unsafe {
                libc::linkat(
                    libc::AT_FDCWD,
                    from.as_ptr(),
                    libc::AT_FDCWD,
                    to.as_ptr(),
                    libc::AT_SYMLINK_FOLLOW,
                )
            };
            if r == 0 {
                // `name` is absolute or relative to the current directory,
                // which this process does not change.
                let path = tempfile::TempPath::try_from_path(&name).inspect_err(|_| {
                    let _ = std::fs::remove_file(&name);
                })?;
                return Ok(tempfile::NamedTempFile::from_parts(self.0, path));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(e);
            }
        }
        Err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, "no free temporary name"))
    }
}
