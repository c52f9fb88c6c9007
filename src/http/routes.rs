//! Requests and answers: what a request head asks for ([`route`]), and the
//! bytes of an answer (a profile, or a refusal with its status and text).

use super::{retry_after, DEFAULT_SECONDS, MAX_SECONDS, PROFILE_PATH, WALL_PATH};
use crate::{Error, RecorderError};

/// What a request asks for.
#[derive(Debug, PartialEq)]
pub(super) enum Route {
    /// A profile window.
    Profile(Ask),
    /// The heap profile (`spulse::heap`).
    #[cfg(feature = "heap")]
    Heap,
    /// An answer without a profile.
    Refuse(Refusal),
}

/// What a profile request asks for.
#[derive(Debug, PartialEq, Clone, Copy)]
pub(super) struct Ask {
    /// The window's length.
    pub(super) seconds: u64,
    /// Wall-clock (`WALL_PATH`: CPU and off-CPU) rather than CPU.
    pub(super) wall: bool,
    /// `spread_blocked=1`: blocked time without a stack charged to each
    /// thread's waits with one (`crate::spread`; wall-clock only).
    pub(super) spread_blocked: bool,
}

/// An answer without a profile: status, text, and an extra header.
#[derive(Debug, PartialEq)]
pub(super) struct Refusal {
    pub(super) status: u16,
    pub(super) text: String,
    pub(super) header: Option<(&'static str, String)>,
}

pub(super) fn refuse(status: u16, text: String) -> Refusal {
    Refusal { status, text, header: None }
}

/// The request head, as much as the routes need.
pub(super) struct Head {
    pub(super) method: String,
    pub(super) target: String,
    /// It declares a body (a non-zero `Content-Length`, or `Transfer-Encoding`).
    pub(super) body: bool,
}

pub(super) fn route(head: &Head) -> Route {
    let (path, query) = head.target.split_once('?').unwrap_or((&head.target, ""));
    #[cfg(feature = "heap")]
    if path == crate::heap::HEAP_PATH {
        return heap_route(head);
    }
    let wall = path == WALL_PATH;
    if path != PROFILE_PATH && !wall {
        return Route::Refuse(refuse(
            404,
            format!("not found: {} (the pprof endpoint is {PROFILE_PATH}?seconds=N)\n", shown(path)),
        ));
    }
    if head.method != "GET" {
        return Route::Refuse(Refusal {
            status: 405,
            text: format!("method {} not allowed: {PROFILE_PATH} answers GET\n", shown(&head.method)),
            header: Some(("Allow", "GET".into())),
        });
    }
    if head.body {
        return Route::Refuse(refuse(400, format!("a GET of {PROFILE_PATH} takes no request body\n")));
    }
    let mut seconds = None;
    let mut spread_blocked = None;
    for (key, value) in
        query.split('&').filter(|p| !p.is_empty()).map(|p| p.split_once('=').unwrap_or((p, "")))
    {
        if key == "spread_blocked" {
            if !wall {
                return Route::Refuse(refuse(
                    400,
                    format!("spread_blocked applies to {WALL_PATH} (CPU profiles have no blocked time)\n"),
                ));
            }
            if spread_blocked.is_some() {
                return Route::Refuse(refuse(400, "spread_blocked is given more than once\n".into()));
            }
            spread_blocked = match value {
                "1" => Some(true),
                "0" => Some(false),
                _ => {
                    return Route::Refuse(refuse(
                        400,
                        format!("bad spread_blocked=\"{}\": expected 0 or 1\n", shown(value)),
                    ))
                }
            };
            continue;
        }
        if key != "seconds" {
            continue;
        }
        if seconds.is_some() {
            return Route::Refuse(refuse(400, "seconds is given more than once\n".into()));
        }
        // Digits only: no sign, no spaces, no fraction.
        let n = Some(value)
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|n| (1..=MAX_SECONDS).contains(n));
        match n {
            Some(n) => seconds = Some(n),
            None => {
                return Route::Refuse(refuse(
                    400,
                    format!(
                        "bad seconds=\"{}\": expected a whole number of seconds in 1..={MAX_SECONDS}\n",
                        shown(value)
                    ),
                ));
            }
        }
    }
    Route::Profile(Ask {
        seconds: seconds.unwrap_or(DEFAULT_SECONDS),
        wall,
        spread_blocked: spread_blocked.unwrap_or(false),
    })
}

/// `GET /debug/pprof/heap` (query parameters, such as Go's `gc=1`, are
/// ignored): the heap profile, made on the connection's thread.
#[cfg(feature = "heap")]
fn heap_route(head: &Head) -> Route {
    use crate::heap::HEAP_PATH;
    if head.method != "GET" {
        return Route::Refuse(Refusal {
            status: 405,
            text: format!("method {} not allowed: {HEAP_PATH} answers GET\n", shown(&head.method)),
            header: Some(("Allow", "GET".into())),
        });
    }
    if head.body {
        return Route::Refuse(refuse(400, format!("a GET of {HEAP_PATH} takes no request body\n")));
    }
    Route::Heap
}

/// Request text as echoed in an answer: escaped, at most 64 characters.
pub(super) fn shown(text: &str) -> String {
    text.chars().take(64).flat_map(char::escape_default).collect()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        414 => "URI Too Long",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// An answer's bytes: status line, headers (`Connection: close` always),
/// body (left out for a `HEAD` request).
pub(super) fn answer(status: u16, headers: &[(&str, &str)], body: &[u8], head_only: bool) -> Vec<u8> {
    let mut out = format!("HTTP/1.1 {status} {}\r\n", reason(status)).into_bytes();
    for (k, v) in headers {
        out.extend_from_slice(format!("{k}: {v}\r\n").as_bytes());
    }
    out.extend_from_slice(format!("Content-Length: {}\r\nConnection: close\r\n\r\n", body.len()).as_bytes());
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

pub(super) fn text_answer(r: &Refusal, head_only: bool) -> Vec<u8> {
    let mut headers = vec![("Content-Type", "text/plain; charset=utf-8")];
    if let Some((k, v)) = &r.header {
        headers.push((k, v.as_str()));
    }
    answer(r.status, &headers, r.text.as_bytes(), head_only)
}

pub(super) fn error_refusal(e: &Error) -> Refusal {
    match e {
        Error::Recorder(RecorderError::ProfileInProgress) => Refusal {
            status: 409,
            text: format!("{e}\n"),
            header: Some(("Retry-After", retry_after().to_string())),
        },
        Error::Recorder(RecorderError::InvalidConfig { .. }) => refuse(400, format!("{e}\n")),
        _ => refuse(500, format!("{e}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(url: &str) -> Route {
        route(&Head { method: "GET".into(), target: url.into(), body: false })
    }

    fn refused(url: &str) -> (u16, String) {
        match get(url) {
            Route::Refuse(r) => (r.status, r.text),
            Route::Profile(a) => panic!("{url}: a profile of {} s, expected a refusal", a.seconds),
            #[cfg(feature = "heap")]
            Route::Heap => panic!("a heap profile"),
        }
    }

    fn seconds(url: &str) -> u64 {
        match get(url) {
            Route::Profile(a) => a.seconds,
            Route::Refuse(r) => panic!("{url}: refused {}: {}", r.status, r.text),
            #[cfg(feature = "heap")]
            Route::Heap => panic!("a heap profile"),
        }
    }

    #[test]
    fn routes_the_profile_path_and_its_seconds() {
        assert_eq!(seconds("/debug/pprof/profile"), DEFAULT_SECONDS);
        let ask = |seconds, wall, spread_blocked| Route::Profile(Ask { seconds, wall, spread_blocked });
        assert_eq!(get("/debug/pprof/wall?seconds=3"), ask(3, true, false));
        assert_eq!(get("/debug/pprof/profile?seconds=3"), ask(3, false, false));
        assert_eq!(get("/debug/pprof/wall?seconds=3&spread_blocked=1"), ask(3, true, true));
        assert_eq!(get("/debug/pprof/wall?spread_blocked=0"), ask(DEFAULT_SECONDS, true, false));
        assert_eq!(refused("/debug/pprof/profile?spread_blocked=1").0, 400);
        assert_eq!(refused("/debug/pprof/wall?spread_blocked=yes").0, 400);
        assert_eq!(refused("/debug/pprof/wall?spread_blocked=1&spread_blocked=1").0, 400);
        assert_eq!(refused("/debug/pprof/wall?seconds=0").0, 400);
        assert_eq!(seconds("/debug/pprof/profile?seconds=3"), 3);
        assert_eq!(seconds("/debug/pprof/profile?debug=0&seconds=300"), 300);
        assert_eq!(seconds("/debug/pprof/profile?seconds=1"), 1);
        assert_eq!(seconds("/debug/pprof/profile?seconds=007"), 7);
        for bad in
            ["0", "301", "-1", "+1", " 1", "1 ", "", "abc", "3.5", "1e1", "%31", "99999999999999999999999"]
        {
            let (status, text) = refused(&format!("/debug/pprof/profile?seconds={bad}"));
            assert_eq!(status, 400, "seconds={bad}");
            assert!(text.contains("seconds") && text.contains("1..=300"), "{text}");
        }
        assert_eq!(refused("/debug/pprof/profile?seconds=1&seconds=2").0, 400);
        #[cfg(not(feature = "heap"))]
        assert_eq!(refused("/debug/pprof/heap").0, 404);
        assert_eq!(refused("/").0, 404);
        assert_eq!(refused("/debug/pprof/profile/x?seconds=3").0, 404);
        for method in ["POST", "HEAD", "PUT"] {
            match route(&Head { method: method.into(), target: PROFILE_PATH.into(), body: false }) {
                Route::Refuse(r) => {
                    assert_eq!(r.status, 405);
                    assert_eq!(r.header, Some(("Allow", "GET".to_string())));
                }
                Route::Profile(..) => panic!("{method} answered with a profile"),
                #[cfg(feature = "heap")]
                Route::Heap => panic!("a heap profile"),
            }
        }
        match route(&Head { method: "GET".into(), target: PROFILE_PATH.into(), body: true }) {
            Route::Refuse(r) => assert_eq!(r.status, 400, "{}", r.text),
            Route::Profile(..) => panic!("a GET with a body answered with a profile"),
            #[cfg(feature = "heap")]
            Route::Heap => panic!("a heap profile"),
        }
    }

    #[cfg(feature = "heap")]
    #[test]
    fn routes_the_heap_path() {
        for url in ["/debug/pprof/heap", "/debug/pprof/heap?gc=1", "/debug/pprof/heap?debug=0"] {
            assert_eq!(get(url), Route::Heap, "{url}");
        }
        assert_eq!(refused("/debug/pprof/heap/x").0, 404);
        match route(&Head { method: "POST".into(), target: "/debug/pprof/heap".into(), body: false }) {
            Route::Refuse(r) => assert_eq!((r.status, r.header), (405, Some(("Allow", "GET".to_string())))),
            other => panic!("POST: {other:?}"),
        }
        match route(&Head { method: "GET".into(), target: "/debug/pprof/heap".into(), body: true }) {
            Route::Refuse(r) => assert_eq!(r.status, 400),
            other => panic!("GET with a body: {other:?}"),
        }
    }

    #[test]
    fn bad_seconds_text_is_escaped_and_cut() {
        let long = "\u{1b}[31m".repeat(100);
        let (_, text) = refused(&format!("/debug/pprof/profile?seconds={long}"));
        assert!(!text.contains('\u{1b}'), "control characters are escaped: {text:?}");
        assert!(text.len() < 1024, "the echoed value is cut: {} bytes", text.len());
    }

    #[test]
    fn answers_close_and_head_has_no_body() {
        let r = Refusal { status: 405, text: "no\n".into(), header: Some(("Allow", "GET".into())) };
        let get = String::from_utf8(text_answer(&r, false)).unwrap();
        assert!(get.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"), "{get}");
        assert!(get.contains("\r\nAllow: GET\r\n") && get.contains("\r\nConnection: close\r\n"), "{get}");
        assert!(get.ends_with("Content-Length: 3\r\nConnection: close\r\n\r\nno\n"), "{get}");
        let head = String::from_utf8(text_answer(&r, true)).unwrap();
        assert!(head.ends_with("\r\n\r\n"), "{head}");
    }
}
