//! The context-switch workloads of BENCHMARKS.md ("Context switches"), under
//! one profiler chosen on the command line; prints one JSON object.
//!
//! Usage: switch --mode pingpong|echo|idle|blockers --profiler none|spulse|pprof --freq HZ
//!               [--kernel-time on|off] [--off-cpu on|off]
//!               [--engine auto|perf-event|thread-timer|process-timer|perf-stack] [--round-trips N]
//!               [--clients N] [--seconds S] [--threads N] [--busy N]
//!
//! * `pingpong`: two threads hand a futex word back and forth N times (30,000
//!   by default): the pattern of a channel, an async runtime's wake-ups, a
//!   contended lock. Reports wall and process CPU microseconds per round trip.
//! * `echo`: a thread-per-connection TCP echo server on loopback and N client
//!   threads (8 by default) sending 64-byte requests for S seconds (3):
//!   requests per second and the 99th-percentile round trip in microseconds.
//!
//! * `idle`: N threads (1,000 by default) blocked on a futex for S seconds
//!   (3): what the recorder costs while they stay blocked (`writer_cpu_us`).
//!
//! `--off-cpu on` records off-CPU time too (`RecorderBuilder::off_cpu`).
//!
//! The profiler starts before any worker thread exists (as `spulse::start` in
//! `main` or `spulse record` would), so every thread is covered.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn process_cpu_us() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1e6 + ts.tv_nsec as f64 / 1e3
}

/// Set `w` to 1 and wake every thread waiting on it.
fn release_all(w: &AtomicU32) {
    w.store(1, Ordering::Release);
    // SAFETY: FUTEX_WAKE on a live AtomicU32, waking every waiter.
    unsafe {
        libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX, 0, 0, 0)
    };
}

fn futex_wait(w: &AtomicU32, v: u32) {
    while w.load(Ordering::Acquire) == v {
        // SAFETY: FUTEX_WAIT on a live AtomicU32; returns at once if it changed.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                w.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                v,
                std::ptr::null::<u8>(),
                0,
                0,
            )
        };
    }
}

fn futex_set(w: &AtomicU32, v: u32) {
    w.store(v, Ordering::Release);
    // SAFETY: FUTEX_WAKE on a live AtomicU32.
    unsafe {
        libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1, 0, 0, 0)
    };
}

fn pingpong(n: usize) -> String {
    let word = Arc::new(AtomicU32::new(0));
    let w2 = word.clone();
    let peer = std::thread::spawn(move || {
        for _ in 0..n {
            futex_wait(&w2, 0);
            futex_set(&w2, 0);
        }
    });
    let (t0, c0) = (Instant::now(), process_cpu_us());
    for _ in 0..n {
        futex_set(&word, 1);
        futex_wait(&word, 1);
    }
    let (wall, cpu) = (t0.elapsed().as_secs_f64() * 1e6, process_cpu_us() - c0);
    peer.join().unwrap();
    format!("\"us_per_round_trip\": {:.3}, \"cpu_us_per_round_trip\": {:.3}", wall / n as f64, cpu / n as f64)
}

fn echo(clients: usize, seconds: f64) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for _ in 0..clients {
            let (mut s, _) = listener.accept().unwrap();
            s.set_nodelay(true).unwrap();
            conns.push(std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                while s.read_exact(&mut buf).is_ok() {
                    if s.write_all(&buf).is_err() {
                        break;
                    }
                }
            }));
        }
        for c in conns {
            c.join().unwrap();
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let hs: Vec<_> = (0..clients)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                s.set_nodelay(true).unwrap();
                let mut lat = Vec::with_capacity(1 << 16);
                let mut buf = [7u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    s.write_all(&buf).unwrap();
                    s.read_exact(&mut buf).unwrap();
                    lat.push(t.elapsed().as_nanos() as u64);
                }
                lat
            })
        })
        .collect();
    let c0 = process_cpu_us();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    let cpu = process_cpu_us() - c0;
    let mut all: Vec<u64> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
    server.join().unwrap();
    all.sort_unstable();
    let p99 = all.get(all.len() * 99 / 100).copied().unwrap_or(0) as f64 / 1e3;
    format!(
        "\"requests_per_s\": {:.0}, \"p99_us\": {:.1}, \"cpu_s\": {:.3}, \"cpu_us_per_request\": {:.3}",
        all.len() as f64 / seconds,
        p99,
        cpu / 1e6,
        cpu as f64 / all.len().max(1) as f64
    )
}

/// N threads blocked on one futex word for `seconds`, then released.
fn idle(n: usize, seconds: f64) -> String {
    let word = Arc::new(AtomicU32::new(0));
    let hs: Vec<_> = (0..n)
        .map(|_| {
            let w = word.clone();
            std::thread::Builder::new().stack_size(64 << 10).spawn(move || futex_wait(&w, 0)).unwrap()
        })
        .collect();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    release_all(&word);
    for h in hs {
        h.join().unwrap();
    }
    format!("\"mode\": \"idle\", \"threads\": {n}, \"seconds\": {:.3}", t0.elapsed().as_secs_f64())
}

/// `idle` threads blocked on one futex word and `busy` threads each blocking
/// about 1,000 times a second (a 1 ms sleep to an absolute deadline), for
/// `seconds`: the issue's "1,000 idle threads and 100 threads blocking 1,000
/// times a second". `blockings` counts the context switches of the busy
/// threads (a sleep whose deadline has passed does not block).
fn blockers(idle: usize, busy: usize, seconds: f64) -> String {
    let word = Arc::new(AtomicU32::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let blockings = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut hs: Vec<_> = (0..idle)
        .map(|_| {
            let w = word.clone();
            std::thread::Builder::new().stack_size(64 << 10).spawn(move || futex_wait(&w, 0)).unwrap()
        })
        .collect();
    for _ in 0..busy {
        let (stop, blockings) = (stop.clone(), blockings.clone());
        hs.push(
            std::thread::Builder::new()
                .stack_size(64 << 10)
                .spawn(move || {
                    let mut next = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                    // SAFETY: clock_gettime writes the timespec we pass.
                    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut next) };
                    let switches = || {
                        // SAFETY: getrusage writes the rusage struct we pass.
                        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
                        // SAFETY: as above, for the calling thread.
                        unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
                        (ru.ru_nvcsw + ru.ru_nivcsw) as u64
                    };
                    let s0 = switches();
                    while !stop.load(Ordering::Relaxed) {
                        next.tv_nsec += 1_000_000;
                        if next.tv_nsec >= 1_000_000_000 {
                            next.tv_nsec -= 1_000_000_000;
                            next.tv_sec += 1;
                        }
                        // SAFETY: sleeps to the absolute time in our timespec.
                        unsafe {
                            libc::clock_nanosleep(libc::CLOCK_MONOTONIC, libc::TIMER_ABSTIME, &next, std::ptr::null_mut())
                        };
                    }
                    blockings.fetch_add(switches() - s0, Ordering::Relaxed);
                })
                .unwrap(),
        );
    }
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    release_all(&word);
    for h in hs {
        h.join().unwrap();
    }
    format!(
        "\"idle\": {idle}, \"busy\": {busy}, \"seconds\": {:.3}, \"blockings\": {}",
        t0.elapsed().as_secs_f64(),
        blockings.load(Ordering::Relaxed)
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = arg(&args, "--mode", "pingpong");
    let profiler = arg(&args, "--profiler", "none");
    let freq: u32 = arg(&args, "--freq", "999").parse().unwrap();
    let kernel = arg(&args, "--kernel-time", "on") == "on";
    let off_cpu = arg(&args, "--off-cpu", "off") == "on";
    let engine = match arg(&args, "--engine", "auto").as_str() {
        "auto" => spulse::EngineChoice::Auto,
        "perf-event" => spulse::EngineChoice::PerfEvent,
        "thread-timer" => spulse::EngineChoice::ThreadCpuTimer,
        "process-timer" => spulse::EngineChoice::ProcessTimer,
        "perf-stack" => spulse::EngineChoice::PerfStack,
        e => panic!("unknown --engine {e}"),
    };
    let dir = std::env::temp_dir().join(format!("switch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spool = dir.join("s.spool");
    let guard = (profiler == "spulse").then(|| {
        spulse::Recorder::builder()
            .frequency_hz(freq)
            .kernel_time(kernel)
            .off_cpu(off_cpu)
            .engine(engine)
            .start(&spool)
            .expect("spulse start")
    });
    #[cfg(any(feature = "pprof-default", feature = "pprof-framehop"))]
    let pguard = (profiler == "pprof")
        .then(|| pprof::ProfilerGuardBuilder::default().frequency(freq as i32).build().unwrap());
    #[cfg(not(any(feature = "pprof-default", feature = "pprof-framehop")))]
    assert!(profiler != "pprof", "built without a pprof feature");
    let body = match mode.as_str() {
        "pingpong" => pingpong(arg(&args, "--round-trips", "30000").parse().unwrap()),
        "idle" => idle(
            arg(&args, "--threads", "1000").parse().unwrap(),
            arg(&args, "--seconds", "3").parse().unwrap(),
        ),
        "blockers" => blockers(
            arg(&args, "--threads", "1000").parse().unwrap(),
            arg(&args, "--busy", "100").parse().unwrap(),
            arg(&args, "--seconds", "3").parse().unwrap(),
        ),
        _ => {
            echo(arg(&args, "--clients", "8").parse().unwrap(), arg(&args, "--seconds", "3").parse().unwrap())
        }
    };
    let mut extra = String::new();
    if let Some(g) = guard {
        let st = g.finish().unwrap();
        extra = format!(
            ", \"samples\": {}, \"kernel_time\": \"{}\", \"engine\": \"{}\", \"descriptors\": {}, \
             \"writer_cpu_us\": {}, \"off_cpu_intervals\": {}, \"off_cpu_waits\": {}, \"off_cpu_records_lost\": {}, \"off_cpu_with_stack\": {}, \"off_cpu_captures_raced\": {}, \"off_cpu_captures\": {}, \"spool_bytes\": {}, \"warnings\": {:?}",
            st.samples_written,
            st.kernel_time,
            st.engine.name(),
            st.descriptors,
            st.writer_cpu.as_micros(),
            st.off_cpu.as_ref().map_or(0, |o| o.intervals),
            st.off_cpu.as_ref().map_or(0, |o| o.waits),
            st.off_cpu.as_ref().map_or(0, |o| o.records_lost),
            st.off_cpu.as_ref().map_or(0, |o| o.with_stack),
            st.off_cpu.as_ref().map_or(0, |o| o.captures_raced),
            st.off_cpu.as_ref().map_or(0, |o| o.captures),
            st.bytes,
            st.warnings
        );
    }
    #[cfg(any(feature = "pprof-default", feature = "pprof-framehop"))]
    if let Some(g) = pguard {
        let n: usize = g.report().build().map(|r| r.data.values().sum::<isize>() as usize).unwrap_or(0);
        extra = format!(", \"samples\": {n}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("{{\"mode\": \"{mode}\", \"profiler\": \"{profiler}\", \"freq\": {freq}, {body}{extra}}}");
}
