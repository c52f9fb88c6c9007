//! The pprof endpoint (`spulse::http`, cargo feature `http`) in a
//! service-shaped process: this test binary runs `examples/server.rs`'s two
//! workers (three units of `parse_requests` for every unit of
//! `render_responses`) and its endpoint, and fetches profiles with
//! `go tool pprof` (the client Parca and Pyroscope's scrapers speak), with a
//! plain HTTP client for the refusals, and with `spulse::http::profile`
//! while a recorder runs.
//!
//! `go tool pprof` is the oracle: in CI (`CI=true`, where `.ci/run` installs
//! Debian's golang-go) a missing `go` fails the test; elsewhere the test says
//! loudly on stderr that the `go tool pprof` check was skipped and fetches the
//! same window with the plain HTTP client instead.
//!
//! One test function: a process has one recorder and one profile window at
//! a time, so the scenarios run in order.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use spulse::pprof::Profile;
use spulse::{Error, RecorderError};

#[allow(dead_code)] // its `main` is the example's, not the test's
#[path = "../examples/server.rs"]
mod server;

/// One HTTP/1.1 GET: (status, body).
fn get(addr: SocketAddr, path: &str) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).expect("connect to the endpoint");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read the answer");
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a complete HTTP head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status =
        head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("status in {head}"));
    (status, raw[split + 4..].to_vec())
}

/// `go tool pprof -top URL` with its home and cache in `tmp`: its output.
fn go_pprof_top(url: &str, tmp: &Path) -> String {
    let out = Command::new("go")
        .args(["tool", "pprof", "-top", "-nodecount=50", url])
        .env("HOME", tmp)
        .env("PPROF_TMPDIR", tmp)
        .env("GOCACHE", tmp.join("gocache"))
        .env("GOFLAGS", "-mod=mod")
        .output()
        .expect("`go` is required for this test: install Debian's golang-go (`apt-get install golang-go`)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "go tool pprof failed:\n{}\n{text}", String::from_utf8_lossy(&out.stderr));
    text
}

/// cum% of the first `-top` row whose function name ends with `name` (cum,
/// not flat: the loops' own code is attributed to the functions inlined into
/// them).
fn cum_percent(top: &str, name: &str) -> f64 {
    top.lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() >= 6 && cols[5..].join(" ").ends_with(name))
                .then(|| cols[4].trim_end_matches('%').parse().ok())
        })
        .flatten()
        .next()
        .unwrap_or_else(|| panic!("no row for {name} in:\n{top}"))
}

/// The share of `parse_requests` among the two hot functions: 3/4 by
/// construction.
fn assert_parse_share(parse: f64, render: f64, what: &str) {
    let share = parse / (parse + render);
    assert!(
        (0.65..=0.85).contains(&share),
        "{what}: parse_requests {parse} vs render_responses {render}: {share:.3} of the two, expected 0.75"
    );
}

fn temp_spools() -> Vec<String> {
    let prefix = format!("spulse-http-{}-", std::process::id());
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

/// Whether `go` runs. Without it: in CI a failure, elsewhere a SKIPPED line.
fn go_available() -> bool {
    let why = match Command::new("go").arg("version").output() {
        Ok(o) if o.status.success() => return true,
        Ok(o) => format!("`go version` exited with {}", o.status),
        Err(e) => format!("`go` cannot run: {e}"),
    };
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("go tool pprof is missing in CI ({why}); .ci/run must install Debian's golang-go");
    }
    // Straight to the process's stderr, past the harness's capture.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED in tests/http.rs: the go tool pprof check ({why}); the window is fetched with a plain \
         HTTP client instead; install Debian's golang-go to run it (with CI=true this fails)"
    );
    false
}

/// Sample weight of the samples whose leaf location has a function named `...suffix`.
fn weight_of(p: &Profile, suffix: &str) -> i64 {
    let s = |i: i64| p.string_table[i as usize].as_str();
    p.sample
        .iter()
        .filter(|smp| {
            let loc = &p.location[smp.location_id[0] as usize - 1];
            loc.line.iter().any(|l| s(p.function[l.function_id as usize - 1].name).ends_with(suffix))
        })
        .map(|smp| smp.value[0])
        .sum()
}

fn decode(gz: &[u8]) -> Profile {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz).read_to_end(&mut raw).expect("a gzip body");
    Profile::decode(&*raw).expect("a pprof Profile")
}

#[test]
fn endpoint_serves_go_tool_pprof_and_refuses_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let workers = server::spawn_workers(&stop);
    let srv = spulse::http::serve("127.0.0.1:0").expect("serve on an ephemeral port");
    let addr = srv.local_addr();
    assert_ne!(addr.port(), 0);

    // Refusals, each with a text naming the problem.
    for (path, status, says) in [
        ("/debug/pprof/profile?seconds=0", 400, "bad seconds=\"0\""),
        ("/debug/pprof/profile?seconds=301", 400, "1..=300"),
        ("/debug/pprof/profile?seconds=abc", 400, "bad seconds=\"abc\""),
        ("/debug/pprof/profile?seconds=", 400, "bad seconds"),
        ("/debug/pprof/heap", 404, "not found: /debug/pprof/heap"),
        ("/", 404, "not found"),
    ] {
        let (got, body) = get(addr, path);
        let body = String::from_utf8_lossy(&body);
        assert_eq!(got, status, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body:?} should say {says:?}");
    }
    assert!(temp_spools().is_empty(), "a refused request recorded: {:?}", temp_spools());

    // go tool pprof over HTTP (or, without go outside CI, a plain client),
    // no recorder running: the endpoint records the window itself. A second
    // request during the window gets 409, and so does `profile`.
    let have_go = go_available();
    let url = format!("http://{addr}/debug/pprof/profile?seconds=3");
    let fetched = std::thread::scope(|s| {
        let fetch = s.spawn(|| {
            if have_go {
                Ok(go_pprof_top(&url, tmp.path()))
            } else {
                Err(get(addr, "/debug/pprof/profile?seconds=3"))
            }
        });
        // The window has started once its temporary spool exists.
        let t = std::time::Instant::now();
        while temp_spools().is_empty() {
            assert!(t.elapsed() < Duration::from_secs(120), "the profile request never started a window");
            assert!(!fetch.is_finished(), "the profile request ended before a window started");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (status, body) = get(addr, "/debug/pprof/profile?seconds=1");
        assert_eq!(status, 409, "{}", String::from_utf8_lossy(&body));
        assert!(String::from_utf8_lossy(&body).contains("already being collected"));
        match spulse::http::profile(Duration::from_secs(1)) {
            Err(Error::Recorder(RecorderError::ProfileInProgress)) => {}
            other => panic!("profile() during a window: {:?}", other.map(|b| b.len())),
        }
        assert_eq!(temp_spools().len(), 1, "one temporary spool while the window records");
        fetch.join().unwrap()
    });
    match fetched {
        Ok(top) => {
            assert!(top.contains("Duration: 3s"), "a 3-second profile:\n{top}");
            let (parse, render) =
                (cum_percent(&top, "parse_requests"), cum_percent(&top, "render_responses"));
            assert_parse_share(parse, render, &format!("go tool pprof -top:\n{top}\n"));
            assert!(parse + render >= 80.0, "the workers are most of the samples:\n{top}");
        }
        Err((status, body)) => {
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            let p = decode(&body);
            assert_eq!(p.duration_nanos, 3_000_000_000);
            let (parse, render) = (weight_of(&p, "parse_requests"), weight_of(&p, "render_responses"));
            let all: i64 = p.sample.iter().map(|smp| smp.value[0]).sum();
            assert_parse_share(parse as f64, render as f64, "a 3-second window over plain HTTP");
            assert!(
                (parse + render) * 10 >= all * 8,
                "the workers are most of the samples: {parse}+{render} of {all}"
            );
        }
    }
    assert!(temp_spools().is_empty(), "the temporary spool is removed: {:?}", temp_spools());

    // A recorder is running: the window is cut from its spool (no second
    // recorder, no temporary spool), symbolized with files and lines, with
    // the executable's mapping and build id.
    let live = tmp.path().join("live.spool");
    let guard = spulse::start(&live).expect("start a recorder");
    let gz = spulse::http::profile(Duration::from_secs(2)).expect("a profile from the live spool");
    assert!(temp_spools().is_empty(), "no temporary spool beside a running recorder");
    let stats = guard.finish().expect("the recorder finishes");
    assert!(stats.samples_written > 0, "the recorder kept recording: {stats:?}");
    let p = decode(&gz);
    let s = |i: i64| p.string_table[i as usize].as_str();
    assert_eq!(p.duration_nanos, 2_000_000_000);
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let exe_mapping = p
        .mapping
        .iter()
        .find(|m| Path::new(s(m.filename)) == exe)
        .unwrap_or_else(|| panic!("no mapping of {}", exe.display()));
    assert!(s(exe_mapping.build_id).len() >= 16, "the executable's build id: {:?}", s(exe_mapping.build_id));
    assert!(exe_mapping.has_functions && exe_mapping.has_line_numbers);
    let parse_fn =
        p.function.iter().find(|f| s(f.name).ends_with("parse_requests")).expect("parse_requests is named");
    assert!(s(parse_fn.filename).ends_with("examples/server.rs"), "file {:?}", s(parse_fn.filename));
    assert_parse_share(
        weight_of(&p, "parse_requests") as f64,
        weight_of(&p, "render_responses") as f64,
        "profile() from a live spool",
    );
    let threads: Vec<&str> = p
        .sample
        .iter()
        .flat_map(|smp| smp.label.iter().filter(|l| s(l.key) == "thread").map(|l| s(l.str)))
        .collect();
    assert!(threads.contains(&"worker-1") && threads.contains(&"worker-2"), "thread labels: {threads:?}");

    // Dropping the server stops it: its thread has ended when `drop`
    // returns, and the port closes (tiny_http's accept thread closes it on
    // its own, moments later).
    drop(srv);
    let names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .collect();
    assert!(
        !names.iter().any(|n| n.trim_end() == "spulse-http"),
        "the server thread outlived drop: {names:?}"
    );
    let t = std::time::Instant::now();
    while TcpStream::connect(addr).is_ok() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{addr} still accepts 10 s after the server was dropped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        assert!(w.join().unwrap() > 0);
    }
}
