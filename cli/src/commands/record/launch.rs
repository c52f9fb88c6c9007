//! Before CMD runs: finding the program as `execvp` will, refusing a static
//! executable (`LD_PRELOAD` would be ignored), the unwind-table cache the
//! recorded processes are pointed at, and creating the output spool.

use std::ffi::OsString;
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::CliError;

/// The variable that tells the recorder where to keep its unwind-table verdicts.
pub(super) const CFI_CACHE_ENV: &str = "SPULSE_CFI_CACHE";

/// Where the recorded processes keep the recorder's verdicts on unwind tables
/// (checked once per library build instead of at every process start): the
/// user's `SPULSE_CFI_CACHE` if set (empty turns the cache off), else
/// `$XDG_CACHE_HOME/spulse/cfi` or `~/.cache/spulse/cfi`. `None` leaves the
/// environment as it is.
pub(super) fn cfi_cache_dir() -> Option<PathBuf> {
    if std::env::var_os(CFI_CACHE_ENV).is_some() {
        return None;
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| Path::new(d).is_absolute())
        .map(PathBuf::from)
        .or_else(|| {
        std::env::var_os("HOME")
            .filter(|d| Path::new(d).is_absolute())
            .map(|h| PathBuf::from(h).join(".cache"))
    })?;
    Some(base.join("spulse").join("cfi"))
}

/// Find CMD the way `execvp` will: as given if it holds a slash, else on `PATH`.
pub(super) fn resolve_program(cmd: &OsString) -> Result<PathBuf, CliError> {
    use std::os::unix::ffi::OsStrExt;
    let shown = || cmd.to_string_lossy().into_owned();
    if cmd.as_bytes().contains(&b'/') {
        return Ok(PathBuf::from(cmd));
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    for dir in std::env::split_paths(&path) {
        let p = dir.join(cmd);
        if let Ok(m) = std::fs::metadata(&p) {
            use std::os::unix::fs::PermissionsExt;
            if m.is_file() && m.permissions().mode() & 0o111 != 0 {
                return Ok(p);
            }
        }
    }
    Err(CliError::input(format!("{}: command not found on PATH", shown())))
}

/// Refuse a statically linked ELF executable: it has no dynamic loader, so
/// `LD_PRELOAD` would be silently ignored and the spool would stay empty.
/// Scripts and anything that is not ELF are left to the kernel.
pub(super) fn check_dynamic(program: &Path) -> Result<(), CliError> {
    use object::read::elf::{FileHeader, ProgramHeader};
    use std::io::Read;
    let shown = program.display();
    let mut f = File::open(program).map_err(|e| CliError::input(format!("{shown}: {e}")))?;
    // The ELF header and program headers are at the start of the file; 64 KiB
    // covers them for any real executable.
    let mut data = Vec::new();
    Read::by_ref(&mut f)
        .take(64 << 10)
        .read_to_end(&mut data)
        .map_err(|e| CliError::input(format!("{shown}: {e}")))?;
    if !data.starts_with(b"\x7fELF") {
        return Ok(());
    }
    // Another class or machine than the preload library's (a 32-bit
    // program): the loader refuses the library, with an error line of its
    // own on stderr, and nothing is recorded.
    let class =
        if cfg!(target_pointer_width = "64") { object::elf::ELFCLASS64 } else { object::elf::ELFCLASS32 };
    let machine = if cfg!(target_arch = "x86_64") {
        Some(object::elf::EM_X86_64)
    } else if cfg!(target_arch = "aarch64") {
        Some(object::elf::EM_AARCH64)
    } else {
        None
    };
    // e_machine: two bytes at offset 18, in the file's byte order (EI_DATA).
    let e_machine = data.get(18..20).map(|b| match data.get(5) {
        Some(&object::elf::ELFDATA2MSB) => u16::from_be_bytes([b[0], b[1]]),
        _ => u16::from_le_bytes([b[0], b[1]]),
    });
    if data.get(4) != Some(&class) || machine.is_some_and(|m| e_machine.is_some_and(|e| e != m)) {
        return Err(CliError::input(format!(
            "{shown} is built for another architecture or word size ({}-bit ELF, machine {}) than spulse's \
             preload library ({}, {}-bit): the loader would refuse to load it, and nothing would be recorded",
            if data.get(4) == Some(&object::elf::ELFCLASS64) { 64 } else { 32 },
            e_machine.unwrap_or(0),
            std::env::consts::ARCH,
            usize::BITS,
        )));
    }
    fn interp<E: FileHeader>(data: &[u8]) -> Option<(bool, bool)> {
        let h = E::parse(data).ok()?;
        let endian = h.endian().ok()?;
        let phdrs = h.program_headers(endian, data).ok()?;
        let has_interp = phdrs.iter().any(|p| p.p_type(endian) == object::elf::PT_INTERP);
        let dynamic_object = h.e_type(endian) == object::elf::ET_DYN;
        let has_dynamic = phdrs.iter().any(|p| p.p_type(endian) == object::elf::PT_DYNAMIC);
        Some((has_interp, dynamic_object && has_dynamic))
    }
    let found = if data.get(4) == Some(&object::elf::ELFCLASS64) {
        interp::<object::elf::FileHeader64<object::Endianness>>(&data)
    } else {
        interp::<object::elf::FileHeader32<object::Endianness>>(&data)
    };
    match found {
        Some((false, _)) => Err(CliError::input(format!(
            "{shown} is statically linked (it names no ELF interpreter, so no dynamic loader runs in it): \
             LD_PRELOAD cannot load spulse into it and nothing would be recorded. Record a dynamically \
             linked build, or link spulse into the program and call spulse::start"
        ))),
        _ => Ok(()),
    }
}

/// Create `path` with mode 0600 (like an embedded recorder's spool), failing
/// if anything exists there (never overwrite, never follow a symlink).
pub(super) fn create_new(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
}

/// `<program>-<pid>.spool` in the current directory, or `<program>-<pid>-N.spool`.
pub(super) fn default_output(cmd: &OsString, pid: u32) -> Result<(File, PathBuf), CliError> {
    let program =
        Path::new(cmd).file_name().map_or_else(|| "spulse".into(), |n| n.to_string_lossy().into_owned());
    for n in 0..1000 {
        let name =
            if n == 0 { format!("{program}-{pid}.spool") } else { format!("{program}-{pid}-{n}.spool") };
        let path = PathBuf::from(name);
        match create_new(&path) {
            Ok(f) => return Ok((f, path)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                let dir = std::env::current_dir().map_or_else(|_| ".".into(), |d| d.display().to_string());
                return Err(CliError::other(format!(
                    "{}: {e} (the default output goes to the current directory, {dir}; -o PATH puts it elsewhere)",
                    path.display()
                )));
            }
        }
    }
    Err(CliError::other(format!("no free output name for {program}-{pid}.spool in the current directory")))
}
