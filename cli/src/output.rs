//! Writing a command's output file (`export`, `pack`): never over the input
//! itself, and for a regular file through a temporary file beside it that is
//! renamed into place only once complete, so the output is either the old
//! file or the whole new one (Ctrl-C included).

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
            // own, removes the temporary file named here before exiting. It is
            // installed before the file exists, and the rename into place holds
            // the lock, so the file is either removed or complete.
            let pending: Arc<Mutex<Option<PathBuf>>> = Arc::new(Mutex::new(None));
            {
                let pending = pending.clone();
                let shown = out_name.to_string();
                let _ = ctrlc::set_handler(move || {
                    let tmp = pending.lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some(tmp) = tmp {
                        let _ = std::fs::remove_file(tmp);
                        eprintln!("spulse: {command}: interrupted; {shown} left as it was");
                    }
                    std::process::exit(EXIT_INTERRUPTED);
                });
            }
            // Mode 0600 (less the umask), as the recorder creates the spool:
            // the output holds the profile (and an output replaced keeps no
            // wider mode than that).
            let tmp = {
                let mut guard = pending.lock().unwrap_or_else(|e| e.into_inner());
                let tmp = tempfile::Builder::new()
                    .prefix(&prefix)
                    .suffix(".tmp")
                    .permissions(std::fs::Permissions::from_mode(0o600))
                    .tempfile_in(dir)
                    .map_err(|e| CliError::output(out_name, e))?;
                *guard = Some(tmp.path().to_path_buf());
                tmp
            };
            // On any error below `tmp` is dropped, which deletes it: an existing
            // output stays as it was.
            let mut out = Counted::new(BufWriter::new(tmp));
            let value = write_all(&mut out)?;
            flush(&mut out, out_name)?;
            let bytes = out.bytes;
            let tmp = out.inner.into_inner().map_err(|e| CliError::output(out_name, e.into_error()))?;
            tmp.as_file().sync_all().map_err(|e| CliError::output(out_name, e))?;
            {
                let mut guard = pending.lock().unwrap_or_else(|e| e.into_inner());
                if guard.take().is_none() {
                    // The handler already removed it and is exiting.
                    return Err(CliError::other("interrupted"));
                }
                tmp.persist(&path).map_err(|e| CliError::output(out_name, e.error))?;
            }
            Ok(Some(Written { value, name: out_name.to_string(), bytes }))
        }
    }
}

fn flush(out: &mut impl Write, name: &str) -> Result<(), CliError> {
    out.flush().map_err(|e| CliError::output(name, e))
}
