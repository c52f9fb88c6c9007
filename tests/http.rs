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
//! The in-process scenarios are one test function: a process has one
//! recorder and one profile window at a time, so they run in order. The
//! hostile-client cases each run the server in a child process (this test
//! binary again, as `child_server_process`), so that a server that aborts,
//! panics or hoards memory fails its test instead of taking the harness with
//! it; each ends by checking that the child still answers a profile request.

use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message;
use spulse::pprof::proto::Profile;
use spulse::{Error, RecorderError};

#[allow(dead_code)] // its `main` is the example's, not the test's
#[path = "../examples/server.rs"]
mod server;

/// An HTTP answer.
#[derive(Debug)]
struct Answer {
    status: u16,
    /// Header names lowercased.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Parse a whole answer read until the server closed the connection.
fn parse_answer(raw: &[u8]) -> Answer {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete HTTP head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("status in {head}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Answer { status, headers, body: raw[split + 4..].to_vec() }
}

/// Send `request` on a new connection and read the answer to the end (the
/// server closes every connection after one answer), waiting at most
/// `timeout` for each read.
fn exchange(addr: SocketAddr, request: &[u8], timeout: Duration) -> std::io::Result<Answer> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(request)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    Ok(parse_answer(&raw))
}

/// One HTTP/1.1 GET.
fn get_answer(addr: SocketAddr, path: &str) -> Answer {
    exchange(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        Duration::from_secs(120),
    )
    .unwrap_or_else(|e| panic!("GET {path} from {addr}: {e}"))
}

/// One HTTP/1.1 GET: (status, body).
fn get(addr: SocketAddr, path: &str) -> (u16, Vec<u8>) {
    let a = get_answer(addr, path);
    (a.status, a.body)
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
        ("/debug/pprof/profile?seconds=+1", 400, "bad seconds=\"+1\""),
        ("/debug/pprof/profile?seconds=%31", 400, "bad seconds"),
        ("/debug/pprof/goroutine", 404, "not found: /debug/pprof/goroutine"),
        ("/", 404, "not found"),
    ] {
        let (got, body) = get(addr, path);
        let body = String::from_utf8_lossy(&body);
        assert_eq!(got, status, "{path}: {body}");
        assert!(body.contains(says), "{path}: {body:?} should say {says:?}");
    }
    // Another method on the profile path: 405 saying which method is allowed
    // (the declared body is never read: the answer comes at once).
    for method in ["POST", "PUT", "DELETE", "HEAD"] {
        let a = exchange(
            addr,
            format!("{method} /debug/pprof/profile HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 99999999999\r\n\r\n")
                .as_bytes(),
            Duration::from_secs(60),
        )
        .unwrap_or_else(|e| panic!("{method}: {e}"));
        assert_eq!(a.status, 405, "{method}: {a:?}");
        assert_eq!(a.header("allow"), Some("GET"), "{method}: 405 names the allowed method: {a:?}");
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
        let a = get_answer(addr, "/debug/pprof/profile?seconds=1");
        assert_eq!(a.status, 409, "{}", a.text());
        assert!(a.text().contains("already being collected"));
        // Retry-After: the rest of the 3-second window (and a second for
        // the answer), in whole seconds.
        let retry: u64 = a
            .header("retry-after")
            .unwrap_or_else(|| panic!("409 without Retry-After: {a:?}"))
            .parse()
            .unwrap_or_else(|e| panic!("Retry-After is not whole seconds ({e}): {a:?}"));
        assert!((1..=4).contains(&retry), "Retry-After {retry} for the rest of a 3-second window");
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

    // Dropping the server stops it: its threads (the acceptor, the
    // connection threads, the window thread) have ended and the listening
    // socket is closed when `drop` returns.
    drop(srv);
    let names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .collect();
    assert!(!names.iter().any(|n| n.starts_with("spulse-http")), "a server thread outlived drop: {names:?}");
    assert!(TcpStream::connect(addr).is_err(), "{addr} still accepts after the server was dropped");
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        assert!(w.join().unwrap() > 0);
    }
}

// ---------------------------------------------------------------------------
// Hostile clients, each against a server in a child process.

/// Set in the environment of a child server: `plain` (the endpoint only) or
/// `workers` (the endpoint and `examples/server.rs`'s two workers).
const CHILD_ENV: &str = "SPULSE_HTTP_TEST_CHILD";

/// Not a check of its own: run with [`CHILD_ENV`] set (by [`ChildServer`]),
/// this is the child server process; it prints `LISTENING <addr>` and serves
/// until its standard input closes. Without it, it returns at once.
#[test]
fn child_server_process() {
    let Ok(mode) = std::env::var(CHILD_ENV) else { return };
    let stop = Arc::new(AtomicBool::new(false));
    let _workers = if mode == "workers" { server::spawn_workers(&stop) } else { Vec::new() };
    // "blocked": a recorder in off-CPU mode runs, and a thread waits for the
    // whole life of the process (see `wall_window_counts_a_thread_blocked_throughout`).
    // ("blocked" under LD_PRELOAD: the preloaded library records instead.)
    let _recording = (mode == "blocked").then(|| {
        let dir = std::env::var_os("TMPDIR").expect("the child's TMPDIR");
        let guard = std::env::var_os("LD_PRELOAD").is_none().then(|| {
            spulse::Recorder::builder()
                .off_cpu(true)
                .start(Path::new(&dir).join("recording.spool"))
                .expect("the child records")
        });
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("blocked-whole".into())
            .spawn(move || {
                let _ = rx.recv();
            })
            .unwrap();
        (guard, tx)
    });
    // "sleepers": a recorder in off-CPU mode with a flush interval of 2 s,
    // and a thread sleeping 1 ms at a time for the life of the process (see
    // `wall_window_cuts_summed_short_waits_at_its_edges`).
    // "sleepers-spread": the same with the default flush interval (see
    // `wall_window_spreads_blocked_time_when_asked`).
    let _sleepers = (mode == "sleepers" || mode == "sleepers-spread").then(|| {
        let dir = std::env::var_os("TMPDIR").expect("the child's TMPDIR");
        let mut b = spulse::Recorder::builder().off_cpu(true);
        if mode == "sleepers" {
            b = b.flush_interval(Duration::from_secs(2));
        }
        let guard = b.start(Path::new(&dir).join("recording.spool")).expect("the child records");
        std::thread::Builder::new()
            .name("short-sleeper".into())
            .spawn(|| loop {
                std::thread::sleep(Duration::from_millis(1));
            })
            .unwrap();
        guard
    });
    let srv = spulse::http::serve("127.0.0.1:0").expect("the child serves");
    println!("\nLISTENING {}", srv.local_addr());
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    std::process::exit(0);
}

/// A server in a child process (this test binary, running
/// `child_server_process`); killed on drop.
struct ChildServer {
    child: Child,
    addr: SocketAddr,
    /// Its TMPDIR, where the endpoint's temporary spools go.
    tmp: tempfile::TempDir,
}

impl ChildServer {
    fn start(mode: &str, env: &[(&str, &std::ffi::OsStr)]) -> ChildServer {
        let tmp = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "child_server_process", "--nocapture", "--test-threads", "1"])
            .env(CHILD_ENV, mode)
            .env("TMPDIR", tmp.path())
            .env_remove("SPULSE_OUTPUT")
            .env_remove("LD_PRELOAD")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start the child server");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest's "test child_server_process ... " may precede it.
                if let Some((_, a)) = line.split_once("LISTENING ") {
                    let _ = tx.send(a.trim().parse::<SocketAddr>().unwrap());
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("the child server did not start listening: {:?}", child.wait());
            }
        };
        ChildServer { child, addr, tmp }
    }

    /// Panics if the child has exited (it aborted, say).
    fn assert_alive(&mut self, after: &str) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("the server process is gone after {after}: {status}");
        }
    }

    /// Peak resident memory so far (VmHWM), in bytes.
    fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc/PID/status");
        kb * 1024
    }

    /// The endpoint's temporary spools in the child's TMPDIR.
    fn temp_spools(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.tmp.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("spulse-http-"))
            .map(|e| e.path())
            .collect()
    }

    /// After a hostile client: the process lives, a plain request is
    /// answered within `prompt`, and a 1-second profile is served.
    fn assert_serving(&mut self, after: &str, prompt: Duration) {
        self.assert_alive(after);
        let t = Instant::now();
        let a = exchange(self.addr, b"GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", prompt)
            .unwrap_or_else(|e| panic!("after {after}: a plain request failed after {:?}: {e}", t.elapsed()));
        assert_eq!(a.status, 404, "after {after}: {a:?}");
        assert!(t.elapsed() <= prompt, "after {after}: answered in {:?}", t.elapsed());
        let a = exchange(
            self.addr,
            b"GET /debug/pprof/profile?seconds=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            Duration::from_secs(60),
        )
        .unwrap_or_else(|e| panic!("after {after}: the profile request failed: {e}"));
        assert_eq!(a.status, 200, "after {after}: {}", a.text());
        decode(&a.body);
        self.assert_alive(after);
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A POST whose declared body never comes, to a path that takes none: the
/// answer comes at once, the body is never read (tiny_http allocated it
/// whole: 99999999999 bytes aborted the process).
#[test]
fn huge_content_length_is_never_read() {
    let mut c = ChildServer::start("plain", &[]);
    let a = exchange(
        c.addr,
        b"POST /anything HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 99999999999\r\n\r\n",
        Duration::from_secs(30),
    )
    .expect("an answer to the POST");
    assert_eq!(a.status, 404, "{a:?}");
    c.assert_serving("Content-Length: 99999999999", Duration::from_secs(10));
    assert_eq!(a.header("connection"), Some("close"), "{a:?}");
}

/// `Content-Length: u64::MAX` (tiny_http panicked with "capacity overflow"
/// and closed the listener).
#[test]
fn u64_max_content_length_is_never_read() {
    let mut c = ChildServer::start("plain", &[]);
    let a = exchange(
        c.addr,
        b"POST /debug/pprof/profile HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 18446744073709551615\r\n\r\n",
        Duration::from_secs(30),
    )
    .expect("an answer to the POST");
    assert_eq!(a.status, 405, "{a:?}");
    assert_eq!(a.header("allow"), Some("GET"), "{a:?}");
    c.assert_serving("Content-Length: 18446744073709551615", Duration::from_secs(10));
}

/// A client that declares a body and never sends it, and one that never
/// finishes its head: neither holds up anyone else, the first gets its
/// answer at once and the second is dropped after the head timeout.
#[test]
fn slow_clients_do_not_hold_up_others() {
    let mut c = ChildServer::start("plain", &[]);
    let mut slow_body = TcpStream::connect(c.addr).unwrap();
    slow_body
        .write_all(b"POST /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 100000\r\n\r\n")
        .unwrap();
    let mut slow_head = TcpStream::connect(c.addr).unwrap();
    slow_head.write_all(b"GET /debug/pprof/profile HTTP/1.1\r\nHost: x\r\nConnection: close\r\n").unwrap();
    let t = Instant::now();
    // Others are served while both hold their connections.
    c.assert_serving("a client holding back its body and one holding back its head", Duration::from_secs(5));
    // The POST was answered (404) without its body, and closed.
    slow_body.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut raw = Vec::new();
    slow_body.read_to_end(&mut raw).expect("the server answers and closes the body-less POST");
    assert_eq!(parse_answer(&raw).status, 404);
    // The unfinished head is answered 408 and closed once the head timeout
    // (10 s from the connection) has passed, not before.
    slow_head.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut raw = Vec::new();
    slow_head.read_to_end(&mut raw).expect("the server closes an unfinished head");
    let waited = t.elapsed();
    assert_eq!(parse_answer(&raw).status, 408, "{}", String::from_utf8_lossy(&raw));
    assert!(waited >= Duration::from_secs(9), "closed after {waited:?}, before the head timeout");
    assert!(waited < Duration::from_secs(40), "closed after {waited:?}");
    c.assert_alive("slow clients");
}

/// 60,000 pipelined requests from a client that reads nothing: one answer,
/// the connection closed, and everyone else served meanwhile.
#[test]
fn pipelined_flood_without_reading_does_not_hold_up_others() {
    let mut c = ChildServer::start("plain", &[]);
    let flood: Vec<u8> = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".repeat(60_000);
    let mut s = TcpStream::connect(c.addr).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
    let flooder = std::thread::spawn(move || {
        let r = s.write_all(&flood);
        (s, r)
    });
    std::thread::sleep(Duration::from_millis(300));
    c.assert_serving("a pipelined flood", Duration::from_secs(5));
    let (_s, written) = flooder.join().unwrap();
    // The server closed the flood's connection after one answer: the
    // flooder's writes fail (or, had they all fit in the socket buffers,
    // went unread).
    let _ = written;
}

/// A header line of 200 MiB without CRLF: the connection is closed once the
/// head passes its cap, and the server's memory stays small (tiny_http
/// buffered the whole line: 213 MB peak).
#[test]
fn endless_header_line_is_cut_off() {
    let mut c = ChildServer::start("plain", &[]);
    std::thread::sleep(Duration::from_millis(200));
    let before = c.peak_rss();
    let mut s = TcpStream::connect(c.addr).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Long: ").unwrap();
    let chunk = vec![b'a'; 1 << 20];
    let mut sent = 0usize;
    let mut refused = None;
    while sent < 200 << 20 {
        match s.write(&chunk) {
            Ok(n) => sent += n,
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    let grew = c.peak_rss().saturating_sub(before);
    assert!(refused.is_some(), "the server took all {sent} bytes of one header line");
    assert!(sent < 64 << 20, "the server read {sent} bytes of one header line before closing");
    assert!(grew < 32 << 20, "the server's peak RSS grew by {grew} bytes over a 200 MiB header line");
    c.assert_serving("a 200 MiB header line", Duration::from_secs(10));
}

/// More connections than the server serves at once: the next one is
/// answered `503` with `Retry-After` at once (by the accepting thread, which
/// reads nothing), and once the others close, requests are served again.
#[test]
fn connections_over_the_cap_get_503_at_once() {
    let mut c = ChildServer::start("plain", &[]);
    // They send nothing: each holds a connection thread until it closes (or
    // the head timeout). The backlog is accepted in order, so the next
    // connection is over the cap.
    let held: Vec<TcpStream> =
        (0..spulse::http::MAX_CONNECTIONS).map(|_| TcpStream::connect(c.addr).unwrap()).collect();
    let t = Instant::now();
    let mut over = TcpStream::connect(c.addr).unwrap();
    over.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut raw = Vec::new();
    over.read_to_end(&mut raw).expect("the connection over the cap is answered and closed");
    let a = parse_answer(&raw);
    assert_eq!(a.status, 503, "{a:?}");
    assert_eq!(a.header("retry-after"), Some("1"), "{a:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "503 after {:?}", t.elapsed());
    drop(held);
    // The held connections' threads see them close and take new ones. Until
    // then: 503, or a reset when the request arrived after that answer's close.
    let t = Instant::now();
    loop {
        match exchange(
            c.addr,
            b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            Duration::from_secs(30),
        ) {
            Ok(a) if a.status == 404 => break,
            Ok(a) => assert_eq!(a.status, 503, "{a:?}"),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        }
        assert!(t.elapsed() < Duration::from_secs(5), "still 503 {:?} after the others closed", t.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    c.assert_serving("connections over the cap", Duration::from_secs(10));
}

/// `SPULSE_OUTPUT` (and `SPULSE_ROTATE`) set for the process: the endpoint's
/// own window still goes to a temporary spool (it answered 500 to every
/// request: the window went to that path), and the path is left alone.
#[test]
fn spulse_output_in_the_environment_is_not_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.spool");
    let missing = dir.path().join("missing/out.spool");
    let one = std::ffi::OsStr::new("1");
    for (env, why) in [
        (vec![("SPULSE_OUTPUT", out.as_os_str())], "SPULSE_OUTPUT"),
        (vec![("SPULSE_OUTPUT", missing.as_os_str())], "SPULSE_OUTPUT in a missing directory"),
        (vec![("SPULSE_OUTPUT", out.as_os_str()), ("SPULSE_ROTATE", one)], "SPULSE_OUTPUT and SPULSE_ROTATE"),
    ] {
        let mut c = ChildServer::start("plain", &env);
        // Twice: the second window must not find the first one's file.
        c.assert_serving(why, Duration::from_secs(10));
        c.assert_serving(why, Duration::from_secs(10));
        assert!(!out.exists(), "{why}: the endpoint's window went to {}", out.display());
        assert!(c.temp_spools().is_empty(), "{why}: temporary spools left: {:?}", c.temp_spools());
    }
}

/// `libspulse_preload.so` beside the test binary; if it is not built, a
/// failure under CI=true, else a loud SKIPPED naming `case` and `None`.
fn preload_library(case: &str) -> Option<std::path::PathBuf> {
    let lib = std::env::current_exe().unwrap().parent().unwrap().join("libspulse_preload.so");
    if lib.exists() {
        return Some(lib);
    }
    let why = format!("{} is not built", lib.display());
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{why}: the workspace's test build builds it (cargo test --workspace)");
    }
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED in tests/http.rs: {case} ({why}; `cargo build --release -p spulse-preload` builds it; \
         with CI=true this fails)"
    );
    None
}

/// The program is recorded by `libspulse_preload.so` (LD_PRELOAD, as under
/// `spulse record`): the window is cut from that recording (the endpoint
/// answered 500, "already recorded by libspulse_preload.so").
#[test]
fn preloaded_recording_serves_the_window() {
    let Some(lib) = preload_library("the preloaded-recording case") else { return };
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("pre-{pid}.spool");
    let mut c = ChildServer::start(
        "workers",
        &[("LD_PRELOAD", lib.as_os_str()), ("SPULSE_OUTPUT", template.as_os_str())],
    );
    let spool = dir.path().join(format!("pre-{}.spool", c.child.id()));
    assert!(spool.exists(), "the preloaded library records the child into {}", spool.display());
    let url = "/debug/pprof/profile?seconds=3";
    let a = std::thread::scope(|s| {
        let fetch = s.spawn(|| get_answer(c.addr, url));
        // No second recorder: no temporary spool while the window runs.
        while !fetch.is_finished() {
            assert!(c.temp_spools().is_empty(), "a temporary spool beside the preloaded recording");
            std::thread::sleep(Duration::from_millis(20));
        }
        fetch.join().unwrap()
    });
    assert_eq!(a.status, 200, "{}", a.text());
    let p = decode(&a.body);
    assert_eq!(p.duration_nanos, 3_000_000_000);
    assert_parse_share(
        weight_of(&p, "parse_requests") as f64,
        weight_of(&p, "render_responses") as f64,
        "a window cut from the preloaded recording",
    );
    c.assert_alive("a profile under LD_PRELOAD");
}

/// A client that gives up on its profile: the window is cancelled (and its
/// temporary spool removed) at once, not left to run its 60 seconds with
/// every other profile request refused 409.
#[test]
fn client_disconnect_cancels_the_window() {
    let mut c = ChildServer::start("plain", &[]);
    let mut s = TcpStream::connect(c.addr).unwrap();
    s.write_all(b"GET /debug/pprof/profile?seconds=60 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let t = Instant::now();
    while c.temp_spools().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(60), "the window never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    let a = exchange(
        c.addr,
        b"GET /debug/pprof/profile?seconds=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        Duration::from_secs(30),
    )
    .unwrap();
    assert_eq!(a.status, 409, "a second window while the first runs: {a:?}");
    drop(s);
    let gone = Instant::now();
    loop {
        let a = exchange(
            c.addr,
            b"GET /debug/pprof/profile?seconds=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            Duration::from_secs(60),
        )
        .unwrap();
        if a.status == 200 {
            break;
        }
        assert_eq!(a.status, 409, "{a:?}");
        assert!(
            gone.elapsed() < Duration::from_secs(15),
            "the abandoned 60-second window still runs {:?} after its client left",
            gone.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(c.temp_spools().is_empty(), "temporary spools left: {:?}", c.temp_spools());
    c.assert_alive("a client that gave up");
}

/// `GET /debug/pprof/wall?seconds=N`: CPU samples plus an `off-cpu` sample
/// type in nanoseconds (the window's own recording runs in off-CPU mode): a
/// thread sleeping in 100 ms steps through a 1 s window shows about a second
/// of off-CPU time, with no signal sent to it.
#[test]
fn wall_endpoint_has_off_cpu_time() {
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    // Named: the other tests of this binary run in the same process, and
    // may sleep during the window too.
    let sleeper = std::thread::Builder::new()
        .name("wall-sleeper".into())
        .spawn(move || {
            while !s2.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(100));
            }
        })
        .unwrap();
    let srv = spulse::http::serve("127.0.0.1:0").expect("serve on an ephemeral port");
    let (status, body) = get(srv.local_addr(), "/debug/pprof/wall?seconds=1");
    stop.store(true, Ordering::SeqCst);
    sleeper.join().unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let p = decode(&body);
    let s = |i: i64| p.string_table[i as usize].as_str();
    let types: Vec<(&str, &str)> = p.sample_type.iter().map(|t| (s(t.r#type), s(t.unit))).collect();
    assert_eq!(types, [("samples", "count"), ("cpu", "nanoseconds"), ("off-cpu", "nanoseconds")]);
    let slept: i64 = p
        .sample
        .iter()
        .filter(|smp| smp.label.iter().any(|l| s(l.key) == "thread" && s(l.str) == "wall-sleeper"))
        .filter(|smp| {
            let loc = &p.location[smp.location_id[0] as usize - 1];
            loc.line.iter().any(|l| {
                s(p.function[l.function_id as usize - 1].name).starts_with("[blocked: clock_nanosleep")
            })
        })
        .map(|smp| smp.value[2])
        .sum();
    assert!((700_000_000..=1_100_000_000).contains(&slept), "{slept} ns of off-CPU sleep in a 1 s window");
    // The endpoint's own threads (the acceptor, the window, the connection
    // answering this request) wait throughout: never in the profile.
    let own: Vec<&str> = p
        .sample
        .iter()
        .flat_map(|smp| smp.label.iter())
        .filter(|l| s(l.key) == "thread" && s(l.str).starts_with("spulse-"))
        .map(|l| s(l.str))
        .collect();
    assert!(own.is_empty(), "spulse's own threads in the profile: {own:?}");
}

/// A wall-clock window cut from a running recorder (off-CPU mode) counts a
/// thread that stays blocked from before the window to after it (the child's
/// `blocked-whole`, waiting on a channel no one sends to): the whole window
/// of off-CPU time, in the futex it waits in. (It counted nothing: the
/// recorder writes an interval when its thread wakes, and the window only
/// saw intervals written before it closed.)
#[test]
fn wall_window_counts_a_thread_blocked_throughout() {
    wall_window_with_a_thread_blocked_throughout(&[]);
}

/// The same, with the preloaded library recording the child (`SPULSE_OFF_CPU=1`):
/// the window asks it through `spulse_preload_split_off_cpu`.
#[test]
fn wall_window_from_a_preloaded_recording_counts_a_thread_blocked_throughout() {
    let Some(lib) = preload_library("the preloaded wall window") else { return };
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("pre-{pid}.spool");
    let one = std::ffi::OsStr::new("1");
    wall_window_with_a_thread_blocked_throughout(&[
        ("LD_PRELOAD", lib.as_os_str()),
        ("SPULSE_OUTPUT", template.as_os_str()),
        ("SPULSE_OFF_CPU", one),
    ]);
}

fn wall_window_with_a_thread_blocked_throughout(env: &[(&str, &std::ffi::OsStr)]) {
    // (No sleep here: this process's other tests may be cutting a wall
    // window that counts its sleeps. The thread blocked before the child
    // served; the recorder captures it at its first tick, long before the
    // window's end.)
    let mut c = ChildServer::start("blocked", env);
    let (status, body) = get(c.addr, "/debug/pprof/wall?seconds=2");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let p = decode(&body);
    let s = |i: i64| p.string_table[i as usize].as_str();
    let thread = |smp: &spulse::pprof::proto::Sample| {
        smp.label.iter().find(|l| s(l.key) == "thread").map_or("", |l| s(l.str))
    };
    let leaf = |smp: &spulse::pprof::proto::Sample| {
        let l = &p.location[smp.location_id[0] as usize - 1].line[0];
        s(p.function[l.function_id as usize - 1].name)
    };
    let waited: i64 =
        p.sample.iter().filter(|smp| thread(smp) == "blocked-whole").map(|smp| smp.value[2]).sum();
    let in_futex: i64 = p
        .sample
        .iter()
        .filter(|smp| thread(smp) == "blocked-whole" && leaf(smp) == "[blocked: futex]")
        .map(|smp| smp.value[2])
        .sum();
    let stacks: Vec<(String, i64)> = p
        .sample
        .iter()
        .filter(|smp| smp.value[2] > 0)
        .map(|smp| {
            let names: Vec<&str> = smp
                .location_id
                .iter()
                .flat_map(|&id| p.location[id as usize - 1].line.iter())
                .map(|l| s(p.function[l.function_id as usize - 1].name))
                .collect();
            (names.join(" <- "), smp.value[2])
        })
        .collect();
    assert!(
        (1_800_000_000..=2_100_000_000).contains(&waited),
        "{waited} ns of off-CPU time of the blocked thread in a 2 s window; off-CPU stacks: {stacks:#?}"
    );
    assert_eq!(in_futex, waited, "charged to the futex it waits in: {stacks:#?}");
    c.assert_alive("a wall profile with a running recorder");
}

/// A thread sleeping 1 ms at a time (short waits, summed into one record a
/// tick: FORMAT.md, tag 9) under a recorder whose ticks are 2 s apart: a 1 s
/// wall window counts its time off the CPU within the window, about the
/// whole window (the window asks the recorder to cut the sums at its start
/// and end). This thread is off the CPU nearly all the time, so a sum placed
/// at its first wait across the start would still land mostly inside: the
/// cut itself is checked by `a_split_cuts_the_sums_where_the_records_reach_it`
/// (`src/recorder/sys/pairing.rs`).
#[test]
fn wall_window_cuts_summed_short_waits_at_its_edges() {
    let mut c = ChildServer::start("sleepers", &[]);
    // Sums under way before the window opens.
    std::thread::sleep(Duration::from_millis(1500));
    let (status, body) = get(c.addr, "/debug/pprof/wall?seconds=1");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let p = decode(&body);
    let s = |i: i64| p.string_table[i as usize].as_str();
    let off: i64 = p
        .sample
        .iter()
        .filter(|smp| smp.label.iter().any(|l| s(l.key) == "thread" && s(l.str) == "short-sleeper"))
        .map(|smp| smp.value[2])
        .sum();
    // Its CPU time (and the truncation of each wait to microseconds) is
    // what it lacks of the whole window.
    assert!((850_000_000..=1_020_000_000).contains(&off), "{off} ns off the CPU in a 1 s window");
    c.assert_alive("a wall profile cutting summed waits");
}

/// `GET /debug/pprof/wall?seconds=1&spread_blocked=1`: a thread sleeping
/// 1 ms at a time has nearly all its time summed without a stack (`[blocked,
/// under 5 ms]`); asked to, the window charges it to the stacks of its sleeps
/// that have one, `[blocked: clock_nanosleep]`, and its total stays.
#[test]
fn wall_window_spreads_blocked_time_when_asked() {
    let mut c = ChildServer::start("sleepers-spread", &[]);
    std::thread::sleep(Duration::from_millis(500));
    let (status, body) = get(c.addr, "/debug/pprof/wall?seconds=1&spread_blocked=1");
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let p = decode(&body);
    let s = |i: i64| p.string_table[i as usize].as_str();
    let leaf = |smp: &spulse::pprof::proto::Sample| {
        let loc = &p.location[smp.location_id[0] as usize - 1];
        loc.line.first().map_or("", |l| s(p.function[l.function_id as usize - 1].name)).to_string()
    };
    let mine: Vec<_> = p
        .sample
        .iter()
        .filter(|smp| smp.label.iter().any(|l| s(l.key) == "thread" && s(l.str) == "short-sleeper"))
        .collect();
    let off: i64 = mine.iter().map(|smp| smp.value[2]).sum();
    let in_sleep: i64 =
        mine.iter().filter(|smp| leaf(smp) == "[blocked: clock_nanosleep]").map(|smp| smp.value[2]).sum();
    assert!((850_000_000..=1_020_000_000).contains(&off), "{off} ns off the CPU in a 1 s window");
    assert!(in_sleep * 10 >= off * 9, "{in_sleep} of {off} ns charged to the sleep's stacks");
    assert!(s(p.comment[0]).ends_with("&spread_blocked=1"), "{:?}", s(p.comment[0]));
    c.assert_alive("a wall profile with spread_blocked=1");
}
