//! Showing untrusted text: thread names, module paths and function names come
//! from the spool (or from files it names), so they may hold terminal control
//! sequences (ESC, OSC, BEL, CSI as U+009B). Every place that prints such text
//! for a person (tables, `info`, error messages) passes it through [`escape`],
//! which writes each control character as a visible Rust-style escape
//! (`\u{1b}`, `\n`, `\t`) and leaves all other text as it is.
//!
//! [`fit`] cuts a line to a terminal's width in display columns, and
//! [`xml_text`] makes text acceptable to an XML 1.0 document.

use std::borrow::Cow;

use unicode_width::UnicodeWidthChar;

/// `s` with every control character (C0, DEL, C1) written as an escape.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Whether XML 1.0 allows `c` in a document (its `Char` production; Rust
/// strings cannot hold surrogates, the one other excluded range).
fn xml_char(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r') || (c >= ' ' && c != '\u{fffe}' && c != '\u{ffff}')
}

/// `s` with the characters XML 1.0 forbids (most C0 controls, U+FFFE, U+FFFF)
/// written as escapes, together with the other control characters, so that
/// the text reads the same as in the terminal tables.
pub fn xml_text(s: &str) -> Cow<'_, str> {
    if s.chars().all(|c| xml_char(c) && !c.is_control()) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() || !xml_char(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `s` cut to at most `width` terminal columns, ending in `…` when it was cut.
/// Control characters must already be escaped (they have no width).
pub fn fit(s: &str, width: usize) -> Cow<'_, str> {
    let mut used = 0;
    let mut cut_at = None;
    for (i, c) in s.char_indices() {
        let w = c.width().unwrap_or(0);
        // Remember where the text must end so that `…` still fits.
        if cut_at.is_none() && used + w + 1 > width {
            cut_at = Some(i);
        }
        used += w;
        if used > width {
            let end = cut_at.unwrap_or(i);
            let mut out = String::with_capacity(end + 3);
            out.push_str(&s[..end]);
            if width > 0 {
                out.push('…');
            }
            return Cow::Owned(out);
        }
    }
    Cow::Borrowed(s)
}

/// `n` and `word`, with an `s` unless `n` is 1 ("1 sample", "2 samples").
pub fn count(n: u64, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_control_characters_only() {
        assert_eq!(escape("plain näme"), "plain näme");
        assert_eq!(escape("a\x1b]0;x\x07b\u{9b}c\td\n"), "a\\u{1b}]0;x\\u{7}b\\u{9b}c\\td\\n");
    }

    #[test]
    fn xml_text_removes_what_xml_forbids() {
        assert_eq!(xml_text("fn<T>"), "fn<T>");
        assert_eq!(xml_text("a\x01b\u{fffe}"), "a\\u{1}b\\u{fffe}");
    }

    #[test]
    fn fits_to_columns() {
        assert_eq!(fit("abcdef", 6), "abcdef");
        assert_eq!(fit("abcdefg", 6), "abcde…");
        // Wide characters take two columns each.
        assert_eq!(fit("日本語テキスト", 6), "日本…");
        assert_eq!(fit("abc", 0), "");
    }
}
