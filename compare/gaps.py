#!/usr/bin/env python3
"""What each profiler's sampling takes from the threads it samples, measured
with the workload's gap meter (`workload --gaps S`, see compare/src/main.rs)
rather than with end-to-end run times, which drift by +-5% between runs on
the shared 2-core VM.

For each thread count and repetition, runs none / spulse / pprof / pprof-fh /
kernel-floor (`perf record -e task-clock` at the same period around the
unprofiled workload: the kernel's sampling interrupt alone) in turn (the same binaries compare/run.py builds; run it first), each for
--seconds of wall time, and reports per profiler the median over repetitions
of:
  stolen   extra share of the meter threads' running time taken by
           interruptions, against the `none` run of the same repetition
  other    extra process CPU outside the meter threads while they ran
           (spulse's writer thread; start and stop are not counted), as a
           share of the meter threads' CPU
  total    stolen + other: the profiler's CPU overhead
  signals  samples the profiler recorded per second of meter-thread CPU
  per sample   total overhead / samples, in microseconds

Usage: python3 compare/gaps.py [--reps 5] [--freq 999] [--threads 1,2,8]
                               [--seconds 2] [--target-dir DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile

PROFILERS = ["none", "spulse", "pprof", "pprof-fh", "kernel-floor"]


def run(binary, profiler, freq, threads, seconds, out):
    name = {"pprof-fh": "pprof", "kernel-floor": "none"}.get(profiler, profiler)
    cmd = [binary, "--profiler", name, "--freq", str(freq), "--threads", str(threads), "--gaps", str(seconds),
           "--out", out]
    if profiler == "kernel-floor":
        # The kernel's own task-clock sampling at the same period, with no
        # signal, no stack copy and no unwinding: perf record's cost inside
        # the workload's threads is the floor any perf-event sampler pays.
        period_ns = str(1_000_000_000 // freq)
        cmd = ["perf", "record", "-q", "-e", "task-clock", "-c", period_ns, "-o", out + ".perf", "--"] + cmd
    lines = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()
    d = json.loads(lines[-1])
    if profiler == "kernel-floor":
        d["samples"] = round(d["workload_cpu_s"] * freq)
    typical_us = typical_gap_us(d)
    stolen = d["gap_stolen_ticks"] / d["gap_running_ticks"]
    other = (d["window_cpu_s"] - d["workload_cpu_s"]) / d["workload_cpu_s"]
    rate = d.get("samples", 0) / d["workload_cpu_s"]
    return stolen, other, rate, typical_us


def typical_gap_us(d):
    """Median length of the interruptions of 5 us or more (a sample's: the
    timer interrupt, the signal and the handler; the scheduler's 250 Hz tick
    falls in the same range in every run), in microseconds. Host noise and
    descheduling move it far less than the total of stolen time."""
    hist, width = d.get("gap_hist"), d.get("gap_hist_bucket_ticks")
    if not hist or not width:
        return float("nan")
    tsc_hz = d.get("tsc_hz") or 2.596e9
    lo = int(5e-6 * tsc_hz / width)
    tail = hist[lo:-1]
    n = sum(tail)
    acc = 0
    for i, c in enumerate(tail):
        acc += c
        if acc * 2 >= n:
            return (lo + i + 0.5) * width / tsc_hz * 1e6
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--freq", type=int, default=999)
    ap.add_argument("--threads", default="1,2,8")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--target-dir", default="/tmp/spulse-compare-target")
    a = ap.parse_args()
    bins = {p: os.path.join(a.target_dir, v, "release", "workload")
            for p, v in [("none", "main"), ("spulse", "main"), ("pprof", "pprof"), ("pprof-fh", "pprof-fh"),
                         ("kernel-floor", "main")]}
    out = os.path.join(tempfile.mkdtemp(), "p.spool")
    print(f"| Hz | threads | profiler | stolen | other CPU | total overhead | samples/s per thread-CPU-s "
          f"| us per sample | typical interruption (us) | reps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for threads in [int(t) for t in a.threads.split(",")]:
        rows = {p: [] for p in PROFILERS}
        for _ in range(a.reps):
            base = None
            for p in PROFILERS:
                stolen, other, rate, typical = run(bins[p], p, a.freq, threads, a.seconds, out)
                if p == "none":
                    base = (stolen, other)
                    continue
                rows[p].append((stolen - base[0], other - base[1], rate, typical))
        for p in PROFILERS[1:]:
            st = statistics.median(r[0] for r in rows[p])
            ot = statistics.median(r[1] for r in rows[p])
            tot = statistics.median(r[0] + r[1] for r in rows[p])
            rate = statistics.median(r[2] for r in rows[p])
            typical = statistics.median(r[3] for r in rows[p])
            per = tot / rate * 1e6 if rate else float("nan")
            print(f"| {a.freq} | {threads} | {p} | {st:+.2%} | {ot:+.2%} | {tot:+.2%} | {rate:.0f} | {per:.1f} "
                  f"| {typical:.1f} | {a.reps} |", flush=True)


if __name__ == "__main__":
    main()
