//! `spulse record` prints a recorded process's warnings while the command
//! still runs (the preloaded recorder's `on_warning` hands them to the
//! collector through `<pid>.<ns>.warnings`), and does not print them again
//! in the summary.

mod common;

use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;

/// Burns CPU, replaces its recorder's spool descriptor with /dev/null (found
/// by its link ending in `.spool`), then waits, burning a little, for a file
/// `go` in its directory: exit 0 when it appears, 3 when it has not after
/// about 30 s (4: no spool descriptor found).
const TAKER: &str = r#"
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static volatile unsigned long sink;
static void burn(double secs) {
  struct timespec a, b; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
  for (;;) { for (int i = 0; i < 100000; i++) sink += i * i;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
    if ((b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9 > secs) break; }
}
int main(void) {
  burn(0.2);
  int null = open("/dev/null", O_WRONLY);
  DIR *d = opendir("/proc/self/fd");
  if (null < 0 || !d) return 5;
  int fds[64], n = 0;
  struct dirent *e;
  char p[64], link[4096];
  while ((e = readdir(d)) && n < 64) {
    int fd = atoi(e->d_name);
    if (fd < 3 || fd == null || fd == dirfd(d)) continue;
    snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
    ssize_t len = readlink(p, link, sizeof link - 1);
    if (len <= 6) continue;
    link[len] = 0;
    if (strcmp(link + len - 6, ".spool") == 0) fds[n++] = fd;
  }
  closedir(d);
  if (n == 0) return 4;
  for (int i = 0; i < n; i++) dup2(null, fds[i]);
  for (int i = 0; i < 3000; i++) {
    if (access("go", F_OK) == 0) return 0;
    burn(0.001);
    usleep(10000);
  }
  return 3;
}
"#;

fn compile(dir: &Path) -> std::path::PathBuf {
    let src = dir.join("taker.c");
    std::fs::write(&src, TAKER).unwrap();
    let exe = dir.join("taker");
    let o = Command::new("cc").args(["-O1", "-o"]).arg(&exe).arg(&src).output().expect("run cc");
    assert!(o.status.success(), "cc: {}", stderr(&o));
    exe
}

#[test]
fn a_warning_is_printed_while_the_command_runs_and_once() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = compile(tmp.path());
    let out = tmp.path().join("o.spool");
    let mut child = Command::new(env!("CARGO_BIN_EXE_spulse"))
        .current_dir(tmp.path())
        .arg("record")
        .arg("-o")
        .arg(&out)
        .arg("--")
        .arg(&exe)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start spulse record");
    let (tx, rx) = mpsc::channel::<String>();
    let err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The warning must come while the command waits for `go` (it exits 3
    // by itself after about 30 s; a loaded machine gets 20 s to print it).
    let mut lines = Vec::new();
    let start = Instant::now();
    let live = loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(l) => {
                let hit = l.contains("warning: process") && l.contains("writing the spool");
                lines.push(l);
                if hit {
                    break true;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) if start.elapsed() < Duration::from_secs(20) => {}
            Err(_) => break false,
        }
    };
    let seen_after = start.elapsed();
    std::fs::write(tmp.path().join("go"), b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("spulse record still running 60 s after `go`; stderr so far: {lines:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    reader.join().unwrap();
    lines.extend(rx.try_iter());
    let text = lines.join("\n");
    assert!(live, "no warning while the command ran (waited {seen_after:?}): {text}");
    // Exit 0: the command was still waiting for `go` when the warning came.
    assert_eq!(status.code(), Some(0), "{text}");
    let printed = lines.iter().filter(|l| l.contains("writing the spool")).count();
    assert_eq!(printed, 1, "printed once, not again in the summary: {text}");
    assert!(text.contains("closed or reused by the program"), "{text}");
    // The failure's line says what it cost and points at the warning, which
    // says why: the cause is printed once.
    assert_eq!(text.matches("closed or reused").count(), 1, "{text}");
    assert!(text.contains("stopped writing early") && text.contains("samples written before"), "{text}");
    // The file beside the output still holds every warning.
    let beside = std::fs::read_to_string(spulse::warnings_path(&out)).unwrap();
    assert!(beside.contains("writing the spool"), "{beside}");
    eprintln!("warning printed {} ms after the start", seen_after.as_millis());
}
