#!/usr/bin/env python3
"""The recorder's fixed cost for a 5 ms program (BENCHMARKS.md, issue 17).

Builds a C program that burns 5 ms of CPU and prints its peak RSS (VmHWM) at
exit, then runs it plain and under LD_PRELOAD=libspulse_preload.so with kernel
time on and off, interleaved, and prints the medians of wall time, CPU time
(user + sys, from wait4) and peak RSS.

Usage: python3 compare/fixed_cost.py target/release/deps/libspulse_preload.so [ROUNDS]
"""
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROGRAM = r"""
#include <time.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
static void hwm(void) {
    FILE *f = fopen("/proc/self/status", "r"); char l[256];
    while (fgets(l, sizeof l, f)) if (!strncmp(l, "VmHWM:", 6)) fputs(l, stderr);
    fclose(f);
}
int main(void) {
    struct timespec t; double s, c; volatile unsigned long x = 0;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); s = t.tv_sec + t.tv_nsec / 1e9;
    do {
        for (int i = 0; i < 10000; i++) x = x * 31 + i;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); c = t.tv_sec + t.tv_nsec / 1e9;
    } while (c - s < 0.005);
    /* Registered after the recorder's exit handler, so it runs first: the
       peak of a running recorder, before it finishes. */
    atexit(hwm);
    return 0;
}
"""


def main():
    lib = os.path.abspath(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    work = tempfile.mkdtemp(prefix="spulse-fixed-")
    src, prog = os.path.join(work, "burn5.c"), os.path.join(work, "burn5")
    with open(src, "w") as f:
        f.write(PROGRAM)
    subprocess.run(["cc", "-O2", "-o", prog, src], check=True)
    spools = os.path.join(work, "sp")
    os.makedirs(spools)
    confs = {"plain": None, "kernel time on": "1", "kernel time off": "0"}
    res = {k: [] for k in confs}
    for _ in range(rounds):
        for name, kt in confs.items():
            for f in glob.glob(os.path.join(spools, "*")):
                os.unlink(f)
            env = dict(os.environ)
            if kt is not None:
                env.update(LD_PRELOAD=lib, SPULSE_OUTPUT=os.path.join(spools, "x-{pid}.spool"),
                           SPULSE_KERNEL_TIME=kt)
            r, w = os.pipe()
            t0 = time.monotonic()
            pid = os.posix_spawn(prog, [prog], env, file_actions=[(os.POSIX_SPAWN_DUP2, w, 2)])
            os.close(w)
            _, status, ru = os.wait4(pid, 0)
            wall = time.monotonic() - t0
            out = os.read(r, 4096).decode()
            os.close(r)
            assert status == 0, out
            res[name].append((wall * 1e3, (ru.ru_utime + ru.ru_stime) * 1e3, int(out.split()[1])))
    for name, v in res.items():
        med = [statistics.median(x[i] for x in v) for i in range(3)]
        print(f"{name:16s} wall {med[0]:6.2f} ms  cpu {med[1]:6.2f} ms  VmHWM {med[2]:6.0f} KB  (n={len(v)})")


if __name__ == "__main__":
    main()
