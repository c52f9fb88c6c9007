//! The terminal side of `follow`: the alternate screen (left on every way
//! out, and by the panic hook) and one table fitted to the terminal.

use super::*;

/// Whether the alternate screen is on (see [`restore_terminal`]).
pub(super) static ALT_SCREEN_ON: AtomicBool = AtomicBool::new(false);

/// The alternate screen, entered on creation and left (with the cursor shown
/// again) on drop, so every way out of `run` restores the terminal.
pub(super) struct AltScreen;

impl AltScreen {
    pub(super) fn enter() -> AltScreen {
        let mut out = std::io::stdout().lock();
        // Alternate screen on, cursor hidden.
        let _ = out.write_all(b"\x1b[?1049h\x1b[?25l");
        let _ = out.flush();
        ALT_SCREEN_ON.store(true, Ordering::SeqCst);
        AltScreen
    }
}

impl Drop for AltScreen {
    fn drop(&mut self) {
        restore_terminal();
    }
}

/// Leave the alternate screen if `follow` entered it, showing the cursor
/// again (the normal screen comes back as it was). Idempotent; the panic hook
/// calls it before printing, so that the message lands on the normal screen.
pub fn restore_terminal() {
    if ALT_SCREEN_ON.swap(false, Ordering::SeqCst) {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(b"\x1b[?25h\x1b[?1049l");
        let _ = out.flush();
    }
}

/// The terminal a table is fitted to: lines are cut to `width` columns, and
/// the function rows are cut so that the whole table, header included, fits
/// in `rows` lines.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fit {
    pub(super) width: Option<usize>,
    pub(super) rows: Option<usize>,
}

/// Print one table, fitted to `fit`; `redraw` clears the screen first.
#[allow(clippy::too_many_arguments)]
pub(super) fn print_table(
    tail: &Tail,
    live: &Live,
    sym: &mut Symbolizer,
    args: &FollowArgs,
    fit_to: Fit,
    redraw: bool,
    elapsed: Duration,
    new: u64,
) -> Result<(), CliError> {
    let agg = live.aggregate();
    let stats = top_with(tail, &agg, sym, args.symbols.shape());
    let header = format!(
        "--- {} at {:.1} s: {} samples (+{new}), {} threads ---",
        escape(&args.file.display().to_string()),
        elapsed.as_secs_f64(),
        live.select.selected(),
        tail.threads().len()
    );
    let limit = match fit_to.rows {
        Some(rows) => {
            let fit_rows = rows.saturating_sub(NON_TABLE_ROWS).max(1);
            if args.limit.n == 0 {
                fit_rows
            } else {
                args.limit.n.min(fit_rows)
            }
        }
        None => args.limit.n,
    };
    let width = fit_to.width.map(|w| w.max(1));
    // Drawn into memory first, then written at once (no flicker).
    let mut frame: Vec<u8> = Vec::new();
    if redraw {
        // Cursor home, clear the screen.
        frame.extend_from_slice(b"\x1b[H\x1b[2J");
    }
    let header = match width {
        Some(w) => fit(&header, w),
        None => header.as_str().into(),
    };
    let _ = writeln!(frame, "{header}");
    let _ = write_table(&mut frame, &stats, sym, agg.total, limit, width);
    if !redraw {
        frame.push(b'\n');
    }
    with_stdout(|out| out.write_all(&frame))
}
