//! [`demangle`]: Rust (legacy and v0) and C++ names, normalized to one
//! spelling so that the two Rust manglings of a function make one row.

use super::*;

/// Demangle a linkage name: Rust (v0 or legacy), then C++; anything else is
/// returned as it is.
///
/// Rust names get one display whichever mangling they came in (the standard
/// library ships v0 symbols, most crates legacy ones): no hash or crate
/// disambiguator, no generic arguments (legacy symbols do not record them),
/// closures and shims as legacy spells them (`{{closure}}`, `{{vtable.shim}}`),
/// inherent methods of path types as `a::Type::f` (v0 says `<a::Type>::f`),
/// trait impl methods as `<Type as Trait>::f` (legacy says
/// `module::<impl Trait for Type>::f`).
/// A generic function therefore shows as one row for all its instances.
pub fn demangle(name: &str) -> Cow<'_, str> {
    // A PLT stub's name (`name@plt`, as the symbolizer names stubs and perf
    // does): the function's name demangled, the suffix kept.
    if let Some(stem) = name.strip_suffix("@plt") {
        return match demangle(stem) {
            Cow::Borrowed(_) => Cow::Borrowed(name),
            Cow::Owned(d) => Cow::Owned(d + "@plt"),
        };
    }
    if let Ok(d) = rustc_demangle::try_demangle(name) {
        return Cow::Owned(normalize_rust(&format!("{d:#}")));
    }
    if name.starts_with("_Z") {
        if let Ok(sym) = cpp_demangle::Symbol::new(name) {
            if let Ok(s) = sym.demangle() {
                return Cow::Owned(s);
            }
        }
    }
    Cow::Borrowed(name)
}

/// Bring a demangled Rust path to the display [`demangle`] documents.
pub(super) fn normalize_rust(s: &str) -> String {
    unwrap_inherent(&strip_generics(&legacy_impls(s)))
}

/// Legacy names a method of an impl block by the module the impl sits in:
/// `core::iter::range::<impl core::iter::traits::iterator::Iterator for
/// core::ops::range::Range<A>>::next`, where v0 says `<core::ops::range::Range<A>
/// as core::iter::traits::iterator::Iterator>::next`. Left as it is, the
/// generic-argument pass would cut the `<impl ..>` segment and leave
/// `core::iter::range::next` for every impl in that module: spell it as v0
/// does (`<Type as Trait>`, or `<Type>` for an inherent impl).
pub(super) fn legacy_impls(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find("<impl ") {
        let segment_start = at == 0 || rest[..at].ends_with("::");
        let Some(len) = balanced_len(&rest[at..]) else { break };
        if !segment_start {
            out.push_str(&rest[..at + len]);
            rest = &rest[at + len..];
            continue;
        }
        // Drop the module path the impl sits in (v0 does not print it).
        let before = &rest[..at];
        let path_len = before
            .char_indices()
            .rev()
            .take_while(|&(_, c)| c.is_alphanumeric() || c == '_' || c == ':')
            .last()
            .map_or(0, |(i, _)| before.len() - i);
        out.push_str(&before[..before.len() - path_len]);
        let inner = &rest[at + 6..at + len - 1];
        match top_level_split(inner, " for ") {
            Some((tr, ty)) => {
                out.push('<');
                out.push_str(ty);
                out.push_str(" as ");
                out.push_str(tr);
                out.push('>');
            }
            None => {
                out.push('<');
                out.push_str(inner);
                out.push('>');
            }
        }
        rest = &rest[at + len..];
    }
    out.push_str(rest);
    out
}

/// The length of the `<...>` group `s` starts with, brackets balanced (`->` is
/// not a closing bracket).
pub(super) fn balanced_len(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut depth = 0usize;
    for j in 0..b.len() {
        match b[j] {
            b'<' => depth += 1,
            b'>' if j == 0 || b[j - 1] != b'-' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(j + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// `s` split at the first `sep` outside any `<...>`.
pub(super) fn top_level_split<'a>(s: &'a str, sep: &str) -> Option<(&'a str, &'a str)> {
    let b = s.as_bytes();
    let mut depth = 0usize;
    for j in 0..b.len() {
        match b[j] {
            b'<' => depth += 1,
            b'>' if j == 0 || b[j - 1] != b'-' => depth = depth.saturating_sub(1),
            _ if depth == 0 && s[j..].starts_with(sep) => return Some((&s[..j], &s[j + sep.len()..])),
            _ => {}
        }
    }
    None
}

/// v0 spells a method of an inherent impl on a path type `<a::Type>::f`,
/// legacy `a::Type::f`: use the legacy spelling (primitive types, slices,
/// references and trait impls keep their brackets).
pub(super) fn unwrap_inherent(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        // Also inside a qualified path (`<<a::Type>::f::{{closure}} as T>::g`).
        let at_segment_start = i == 0 || out.ends_with("::") || out.ends_with('<');
        if b[i] == b'<' && at_segment_start {
            if let Some(len) = s[i + 1..].find('>') {
                let inner = &s[i + 1..i + 1 + len];
                let is_path = inner.contains("::")
                    && !inner.contains([' ', '<', '&', '*', '[', '('])
                    && inner.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_');
                if is_path && s[i + 2 + len..].starts_with("::") {
                    out.push_str(inner);
                    i += len + 2;
                    continue;
                }
            }
        }
        let ch = s[i..].chars().next().expect("in bounds");
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

/// Drop generic argument lists and spell v0's `{closure#N}`-style segments as
/// legacy does.
pub(super) fn strip_generics(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if s[i..].starts_with("{{") {
            // Legacy `{{closure}}`: already the chosen spelling.
            if let Some(len) = s[i..].find("}}") {
                out.push_str(&s[i..i + len + 2]);
                i += len + 2;
                continue;
            }
        }
        if c == b'{' {
            // v0 `{closure#0}`, `{shim:vtable#0}`, `{constant#1}`...
            if let Some(len) = s[i..].find('}') {
                let inner = &s[i + 1..i + len];
                let kind = inner.split('#').next().unwrap_or(inner);
                match kind.strip_prefix("shim:") {
                    // Legacy glues a shim to the function it wraps
                    // (`FnOnce::call_once{{vtable.shim}}`); v0 makes it a segment.
                    Some(shim) => {
                        if out.ends_with("::") {
                            out.truncate(out.len() - 2);
                        }
                        out.push_str(&format!("{{{{{shim}.shim}}}}"))
                    }
                    None => out.push_str(&format!("{{{{{kind}}}}}")),
                }
                i += len + 1;
                continue;
            }
        }
        if c == b'<' {
            let turbofish = out.ends_with("::");
            let after_name =
                out.as_bytes().last().is_some_and(|&p| p.is_ascii_alphanumeric() || p == b'_' || p == b'}');
            if turbofish || after_name {
                // A generic argument list: skip to its balanced end (`->` in a
                // `fn(..) -> T` argument is not a closing bracket).
                let mut depth = 0usize;
                let mut j = i;
                while j < b.len() {
                    match b[j] {
                        b'<' => depth += 1,
                        b'>' if j == 0 || b[j - 1] != b'-' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                    j += 1;
                }
                if j < b.len() {
                    if turbofish {
                        out.truncate(out.len() - 2);
                    }
                    i = j + 1;
                    continue;
                }
            }
        }
        let ch = s[i..].chars().next().expect("in bounds");
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}
