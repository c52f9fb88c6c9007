//! A rotating recording's segments: their names (the recorder's rule,
//! [`spulse::segment_number`]), and the [`Chain`] that copies them one after
//! another into the merged spool `follow` tails.

use super::*;

/// If `file` is named like a segment and a later segment exists, its path.
pub(super) fn later_segment(file: &Path) -> Option<PathBuf> {
    let (seg, Some(n)) = Segments::parse(file, true).ok()?? else { return None };
    Some(seg.path(seg.next(Some(n)).ok()??))
}

/// The names of a rotating recording's segments: `dir/<prefix><number><suffix>`,
/// the number zero-padded to at least six digits.
#[derive(Debug)]
pub(super) struct Segments {
    pub(super) dir: PathBuf,
    pub(super) prefix: String,
    pub(super) suffix: String,
}

/// Fewest digits of a segment number in a file name (the recorder's rule).
pub(super) const SEQ_DIGITS: usize = spulse::SEGMENT_NUMBER_DIGITS;

impl Segments {
    /// The segments `path` names: a pattern with `{seq}` (start at the oldest
    /// segment there is: `None`), or with `one` a segment (start there: its
    /// number). `Ok(None)`: `path` is a plain spool.
    pub(super) fn parse(path: &Path, one: bool) -> Result<Option<(Segments, Option<u64>)>, CliError> {
        let shown = || escape(&path.display().to_string()).into_owned();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            if path.to_string_lossy().contains("{seq}") {
                return Err(CliError::input(format!(
                    "{}: {{seq}} must be in the file name of a segment pattern",
                    shown()
                )));
            }
            return Ok(None);
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if dir.to_string_lossy().contains("{seq}") {
            return Err(CliError::input(format!(
                "{}: {{seq}} must be in the file name of a segment pattern, not its directory",
                shown()
            )));
        }
        if let Some(at) = name.find("{seq}") {
            let (prefix, suffix) = (&name[..at], &name[at + 5..]);
            if suffix.contains("{seq}") || name.contains("{pid}") || name.contains("{timestamp}") {
                return Err(CliError::input(format!(
                    "{}: a segment pattern has one {{seq}} and no other placeholder (write the process id \
                     and start time as the recorder filled them in)",
                    shown()
                )));
            }
            return Ok(Some((Segments { dir, prefix: prefix.into(), suffix: suffix.into() }, None)));
        }
        if !one {
            return Ok(None);
        }
        // The last run of at least six digits is the segment number.
        let b = name.as_bytes();
        let mut end = b.len();
        while end > 0 {
            if !b[end - 1].is_ascii_digit() {
                end -= 1;
                continue;
            }
            let mut start = end;
            while start > 0 && b[start - 1].is_ascii_digit() {
                start -= 1;
            }
            if end - start >= SEQ_DIGITS {
                let Ok(num) = name[start..end].parse::<u64>() else { return Ok(None) };
                let seg = Segments { dir, prefix: name[..start].into(), suffix: name[end..].into() };
                return Ok(Some((seg, Some(num))));
            }
            end = start;
        }
        Err(CliError::input(format!(
            "{}: --segments: the file name has no segment number (a run of {SEQ_DIGITS} or more digits)",
            shown()
        )))
    }

    /// The path of segment `n`.
    pub(super) fn path(&self, n: u64) -> PathBuf {
        self.dir.join(format!("{}{}{}", self.prefix, spulse::segment_number(n), self.suffix))
    }

    /// The lowest-numbered segment there is after `after` (or the lowest of all).
    pub(super) fn next(&self, after: Option<u64>) -> Result<Option<u64>, CliError> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| CliError::input(format!("{}: {e}", escape(&self.dir.display().to_string()))))?;
        let mut best: Option<u64> = None;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(digits) = name.strip_prefix(&self.prefix).and_then(|r| r.strip_suffix(&self.suffix))
            else {
                continue;
            };
            if digits.len() < SEQ_DIGITS || !digits.bytes().all(|c| c.is_ascii_digit()) {
                continue;
            }
            let Ok(n) = digits.parse::<u64>() else { continue };
            if after.is_none_or(|a| n > a) && best.is_none_or(|b| n < b) {
                best = Some(n);
            }
        }
        Ok(best)
    }
}

/// The segments of a rotating recording, copied one after another into a
/// merged spool (a temporary file) that `tail` reads.
pub(super) struct Chain {
    pub(super) segments: Segments,
    /// Number, path, source and lock descriptor of the segment being read.
    pub(super) seq: u64,
    pub(super) path: PathBuf,
    pub(super) source: Source,
    pub(super) lock: File,
    pub(super) merged: tempfile::NamedTempFile,
    pub(super) out: SpoolWriter<File>,
    pub(super) shared: Shared,
    pub(super) tail: Tail,
}

impl Chain {
    /// Open the first segment (`first`, or the oldest there is), waiting as
    /// [`open_tail`] does; `None` when Ctrl-C ended the wait.
    pub(super) fn open(
        args: &FollowArgs,
        stop: &AtomicBool,
        segments: Segments,
        first: Option<u64>,
    ) -> Result<Option<Chain>, CliError> {
        let mut found = None;
        let opened = wait_for(args, stop, &mut |_| {
            let seq = match first {
                Some(n) => n,
                None => match segments.next(None) {
                    Ok(Some(n)) => n,
                    Ok(None) => {
                        return Err(spulse::Error::Io {
                            path: Some(args.file.clone()),
                            source: std::io::Error::new(
                                std::io::ErrorKind::NotFound,
                                "no segment matches it",
                            ),
                        })
                    }
                    Err(e) => {
                        return Err(spulse::Error::Io {
                            path: Some(args.file.clone()),
                            source: std::io::Error::other(e.message),
                        })
                    }
                },
            };
            let path = segments.path(seq);
            let source = Source::open_any(&path)?;
            found = Some((seq, path));
            Ok(source)
        })?;
        let Some(source) = opened else { return Ok(None) };
        let (seq, path) = found.expect("set with the source");
        let lock = File::open(&path).map_err(|e| CliError::input(format!("{}: {e}", path.display())))?;
        let merged =
            tempfile::Builder::new().prefix("spulse-follow-").suffix(".spool").tempfile().map_err(|e| {
                CliError::other(format!("cannot create a temporary file for the segments: {e}"))
            })?;
        let file = merged.as_file().try_clone().map_err(|e| CliError::other(format!("{e}")))?;
        let h = source.header();
        let out =
            SpoolWriter::new(file, Header { start_time_us: h.start_time_us, interval_us: h.interval_us })?;
        let tail = Tail::open(merged.path())?;
        Ok(Some(Chain { segments, seq, path, source, lock, merged, out, shared: Shared::merging(), tail }))
    }

    /// Copy what the current segment gained; while it is complete and a later
    /// segment exists, move on to that one. Whether the recording runs on.
    pub(super) fn advance(&mut self) -> Result<bool, CliError> {
        loop {
            // Asked before copying: once unlocked, the segment is complete.
            let running = recording_running(&self.lock, &self.path)?;
            self.pump()?;
            if running {
                return Ok(true);
            }
            // The next segment; files in the sequence that are no segment of
            // this recording (a name another user took, which the recorder
            // stepped over; a segment left empty and unlocked when the disk
            // filled) are passed over with a warning.
            let mut after = self.seq;
            let (next, path, source) = loop {
                let Some(next) = self.segments.next(Some(after))? else {
                    self.warn_if_truncated();
                    return Ok(false);
                };
                let path = self.segments.path(next);
                let e = match Source::open_any(&path) {
                    Ok(s) => break (next, path, s),
                    Err(e) => e,
                };
                let lock = match File::open(&path) {
                    Ok(f) => f,
                    // Deleted at once by retention: next time.
                    Err(_) => return Ok(true),
                };
                if recording_running(&lock, &path)? {
                    // Its writer holds it and is writing its header: next time.
                    return Ok(true);
                }
                let later = self.segments.next(Some(next))?.is_some();
                let stale = lock
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age >= ABANDONED_AFTER);
                if not_there_yet(&e) {
                    // An empty segment nobody holds: being created (the
                    // recorder locks it right after creating it) or left
                    // behind when its header could not be written.
                    if !stale {
                        return Ok(true);
                    }
                    if later {
                        warn_skipped(&path, "its header was never written");
                        after = next;
                        continue;
                    }
                    self.warn_if_truncated();
                    warn_skipped(&path, "its header was never written: the recording stopped there");
                    return Ok(false);
                }
                if later {
                    warn_skipped(&path, &format!("not a segment of this recording ({e})"));
                    after = next;
                    continue;
                }
                return Err(e.into());
            };
            let lock = File::open(&path).map_err(|e| CliError::input(format!("{}: {e}", path.display())))?;
            self.warn_if_truncated();
            let mut old = std::mem::replace(&mut self.source, source);
            self.lock = lock;
            self.seq = next;
            self.path = path;
            // The new segment's modules are defined (sharing the old one's ids
            // where they are the same) before the old segment gives its up.
            self.pump()?;
            old.finish_shared(&mut self.out, &mut self.shared).map_err(merge_error)?;
            self.out.flush()?;
        }
    }

    /// Copy what the current segment gained into the merged spool.
    pub(super) fn pump(&mut self) -> Result<(), CliError> {
        self.source.pump_shared(&mut self.out, &mut self.shared).map_err(merge_error)?;
        self.out.flush()?;
        Ok(())
    }

    pub(super) fn warn_if_truncated(&self) {
        if let Some(valid) = self.source.incomplete_tail() {
            warn_truncated(&self.path, valid);
        }
    }
}

pub(super) fn merge_error(e: MergeError) -> CliError {
    match e {
        MergeError::Source(msg) => CliError::input(msg),
        MergeError::Output(e) => CliError::other(format!("writing the merged segments: {e}")),
    }
}

/// How long an empty, unlocked segment may stay so before it counts as left
/// behind rather than being created (the recorder locks a segment right
/// after creating it and writes its header at once).
pub(super) const ABANDONED_AFTER: Duration = Duration::from_secs(1);

pub(super) fn warn_skipped(path: &Path, why: &str) {
    eprintln!("spulse: follow: passed over {}: {}", escape(&path.display().to_string()), escape(why));
}
