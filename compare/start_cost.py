#!/usr/bin/env python3
"""The recorder's start cost and memory on a program with a large executable
(BENCHMARKS.md, "Start cost and memory (issue 14)").

Generates a program whose executable holds FUNCS small functions (500,000 by
default: 16 MB of `.eh_frame` and 4 MB of `.eh_frame_hdr`), each with its own
unwind entry, and a `main` that calls ten of them deep into a loop burning CPU.
It runs plain and under `LD_PRELOAD` of each given `libspulse_preload.so`
(the recorder starts before `main` and finishes at exit), interleaved, and
prints the medians of:

- start: from the recorder's start (the spool header's start time, taken when
  `start` begins) to `main` (just after `start` returned); and from the start to
  the first sample in the spool (`spulse info --json`);
- CPU time of the whole run (user + sys, `wait4`), against the plain run;
- memory at steady state (after BURN seconds of CPU, before the recorder
  finishes), against the plain run: anonymous and file-backed resident memory
  (`RssAnon`, `RssFile` in `/proc/self/status`; the executable's tables that
  the recorder reads in place are file pages, shared with the page cache) and
  the malloc'd heap in use (`mallinfo2`: `uordblks + hblkhd`);
- samples whose stack stops at the executable's first frame ("cut": taken
  while the check of its tables was still running; one thread at 999 Hz, so
  about one per millisecond of the check).

Usage: python3 compare/start_cost.py SPULSE_BIN ROUNDS LABEL=PRELOAD.so[,VAR=VALUE...] ...
(each LABEL a configuration, run once per round in the order given; VAR=VALUE
sets an environment variable for it, such as SPULSE_CFI_CACHE=/tmp/cfi for the
verdict cache, which is otherwise off).
Environment: FUNCS (default 500000), BURN (seconds, default 0.5).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MAIN = r"""
#define _GNU_SOURCE
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
extern long big_f0(long);
static double burn_s;
static double cpu(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec / 1e9; }
long spin(long x) {
    double s = cpu(); volatile unsigned long h = 0;
    while (cpu() - s < burn_s) for (int i = 0; i < 10000; i++) h = h * 31 + i;
    return (long)h + x;
}
static long status_kb(const char *key) {
    char l[256]; long v = -1; size_t n = strlen(key); FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(l, sizeof l, f)) if (!strncmp(l, key, n)) v = atol(l + n);
    if (f) fclose(f);
    return v;
}
int main(void) {
    struct timeval tv; gettimeofday(&tv, NULL);
    long long main_us = (long long)tv.tv_sec * 1000000 + tv.tv_usec;
    burn_s = atof(getenv("BURN"));
    big_f0(1);
    struct mallinfo2 m = mallinfo2();
    printf("%lld %ld %ld %ld\n", main_us, status_kb("RssAnon:"), status_kb("RssFile:"),
           (long)((m.uordblks + m.hblkhd) / 1024));
    return 0;
}
"""


def build(work, funcs):
    asm = os.path.join(work, "funcs.s")
    with open(asm, "w") as out:
        out.write("\t.text\n")
        for i in range(funcs):
            nxt = f"big_f{i + 1}" if i < 9 else "spin"
            out.write(
                f"\t.globl big_f{i}\n\t.type big_f{i}, @function\nbig_f{i}:\n\t.cfi_startproc\n"
                "\tpushq %rbp\n\t.cfi_def_cfa_offset 16\n\t.cfi_offset %rbp, -16\n"
                "\tmovq %rsp, %rbp\n\t.cfi_def_cfa_register %rbp\n"
                f"\tcall {nxt}\n\tpopq %rbp\n\t.cfi_def_cfa %rsp, 8\n\tret\n\t.cfi_endproc\n"
            )
        out.write('\t.section .note.GNU-stack,"",@progbits\n')
    src = os.path.join(work, "main.c")
    with open(src, "w") as f:
        f.write(MAIN)
    prog = os.path.join(work, "bigexe")
    subprocess.run(["cc", "-O2", "-o", prog, src, asm], check=True)
    os.unlink(asm)
    return prog


def run(prog, spulse, lib, extra, spools):
    for f in os.listdir(spools):
        os.unlink(os.path.join(spools, f))
    env = dict(os.environ, BURN=os.environ.get("BURN", "0.5"))
    env.pop("SPULSE_CFI_CACHE", None)
    env.update(extra)
    spool = os.path.join(spools, "x.spool")
    if lib:
        env.update(LD_PRELOAD=lib, SPULSE_OUTPUT=spool)
    r, w = os.pipe()
    t0 = time.monotonic()
    pid = os.posix_spawn(prog, [prog], env, file_actions=[(os.POSIX_SPAWN_DUP2, w, 1)])
    os.close(w)
    _, status, ru = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    out = os.read(r, 4096).decode()
    os.close(r)
    assert status == 0, out
    main_us, anon, file_kb, heap = (int(x) for x in out.split())
    row = {"wall_ms": wall * 1e3, "cpu_ms": (ru.ru_utime + ru.ru_stime) * 1e3, "anon_kb": anon,
           "file_kb": file_kb, "heap_kb": heap}
    if lib:
        info = json.loads(subprocess.run([spulse, "info", "--json", spool], check=True,
                                         capture_output=True).stdout)
        row["start_to_main_ms"] = (main_us - info["start_time_us"]) / 1e3
        row["start_to_first_sample_ms"] = (info["first_sample_us"] - info["start_time_us"]) / 1e3
        row["samples"] = info["samples"]
        folded = subprocess.run([spulse, "export", spool, "-f", "collapsed", "-o", "-"], check=True,
                                capture_output=True, text=True).stdout
        # Samples whose stack stops at the executable's first frame (taken
        # before the check of its tables was done).
        row["cut"] = sum(int(l.rsplit(" ", 1)[1]) for l in folded.splitlines()
                         if l.startswith(("[truncated];spin", "[truncated];big_f")))
    return row


def main():
    spulse, rounds = sys.argv[1], int(sys.argv[2])
    libs = [("plain", None, {})]
    for a in sys.argv[3:]:
        label, rest = a.split("=", 1)
        lib, *env = rest.split(",")
        libs.append((label, lib, dict(e.split("=", 1) for e in env)))
    work = tempfile.mkdtemp(prefix="spulse-start-")
    prog = build(work, int(os.environ.get("FUNCS", "500000")))
    sizes = subprocess.run(["readelf", "-SW", prog], capture_output=True, text=True).stdout
    for line in sizes.splitlines():
        if ".eh_frame" in line:
            f = line.split("]", 1)[1].split()
            print(f"{f[0]}: {int(f[4], 16):,} bytes")
    spools = os.path.join(work, "sp")
    os.makedirs(spools)
    res = {name: [] for name, _, _ in libs}
    for _ in range(rounds):
        for name, lib, extra in libs:
            res[name].append(run(prog, spulse, lib and os.path.abspath(lib), extra, spools))
    keys = ("cpu_ms", "anon_kb", "file_kb", "heap_kb")
    base = {k: statistics.median(r[k] for r in res["plain"]) for k in keys}
    print("medians; + is against the plain run")
    for name, rows in res.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        line = f"{name:10s} cpu {med['cpu_ms']:7.1f} ms (+{med['cpu_ms'] - base['cpu_ms']:.1f})"
        line += f"  RssAnon +{med['anon_kb'] - base['anon_kb']:.0f} KB"
        line += f"  RssFile +{med['file_kb'] - base['file_kb']:.0f} KB"
        line += f"  heap +{med['heap_kb'] - base['heap_kb']:.0f} KB"
        if "samples" in med:
            line += f"  start->main {med['start_to_main_ms']:.2f} ms"
            line += f"  start->1st sample {med['start_to_first_sample_ms']:.2f} ms"
            line += f"  samples {med['samples']:.0f} (cut {med['cut']:.0f})"
        print(line + f"  (n={len(rows)})")


if __name__ == "__main__":
    main()
