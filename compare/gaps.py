#!/usr/bin/env python3
"""What each profiler's sampling takes from the threads it samples, measured
with the workload's gap meter (`workload --gaps S`, see compare/src/main.rs)
rather than with end-to-end run times, which drift by +-5% between runs on
the shared 2-core VM.

For each thread count and repetition, runs none / spulse / pprof / pprof-fh /
kernel-floor (`perf record -e task-clock` at the same period around the
unprofiled workload: the kernel's sampling interrupt alone) in turn (the same binaries compare/run.py builds; run it first), each for
--seconds of wall time, and reports per profiler the median over repetitions
of the values below. `spulse-stack` is spulse with its perf-stack engine
(`--engine perf-stack`: no signal, the kernel copies registers and stack, the
writer thread unwinds; woken when a ring is half full), `spulse-stack-tick`
the same drained only at the writer's 50 ms ticks (1 MiB rings), `spulse-signal` spulse forced to its perf-event
(signal) engine; `--profilers` picks which run (`none` always runs first).
  stolen   extra share of the meter threads' running time taken by
           interruptions, against the `none` run of the same repetition
  other    extra process CPU outside the meter threads while they ran
           (spulse's writer thread; start and stop are not counted), as a
           share of the meter threads' CPU
  total    stolen + other: the profiler's CPU overhead
  signals  samples the profiler recorded per second of meter-thread CPU
  per sample   total overhead / samples, in microseconds
  capture  samples / (meter threads' user CPU seconds x frequency), the
           capture ratio of a sampler of user time

Usage: python3 compare/gaps.py [--reps 5] [--freq 999] [--threads 1,2,8]
                               [--seconds 2] [--target-dir DIR] [--depth 20]
                               [--profilers spulse,spulse-stack,...] [--stack-copy BYTES]
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile

PROFILERS = ["none", "spulse", "pprof", "pprof-fh", "kernel-floor"]
ALL = PROFILERS + ["spulse-signal", "spulse-stack", "spulse-stack-tick"]


def run(binary, profiler, freq, threads, seconds, out, depth, stack_copy=None):
    name = {"pprof-fh": "pprof", "kernel-floor": "none", "spulse-signal": "spulse",
            "spulse-stack": "spulse", "spulse-stack-tick": "spulse"}.get(profiler, profiler)
    cmd = [binary, "--profiler", name, "--freq", str(freq), "--threads", str(threads), "--gaps", str(seconds),
           "--out", out, "--depth", str(depth)]
    if profiler.startswith("spulse-stack") and stack_copy:
        cmd += ["--stack-copy", str(stack_copy)]
    if profiler == "spulse-stack":
        cmd += ["--engine", "perf-stack"]
    elif profiler == "spulse-stack-tick":
        cmd += ["--engine", "perf-stack-tick"]
    elif profiler == "spulse-signal":
        cmd += ["--engine", "perf-event"]
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
    user = d.get("workload_user_s") or d["workload_cpu_s"]
    capture = d.get("samples", 0) / (user * freq)
    return stolen, other, rate, capture, typical_us


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
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--stack-copy", type=int, default=None,
                    help="the perf-stack variants' user_stack_copy in bytes (default: spulse's, 16 KiB)")
    ap.add_argument("--profilers", default=",".join(PROFILERS[1:]))
    a = ap.parse_args()
    chosen = ["none"] + [p for p in a.profilers.split(",") if p and p != "none"]
    for p in chosen:
        if p not in ALL:
            ap.error(f"unknown profiler {p}; known: {', '.join(ALL)}")
    bins = {p: os.path.join(a.target_dir, v, "release", "workload")
            for p, v in [("none", "main"), ("spulse", "main"), ("pprof", "pprof"), ("pprof-fh", "pprof-fh"),
                         ("kernel-floor", "main"), ("spulse-signal", "main"), ("spulse-stack", "main"),
                         ("spulse-stack-tick", "main")]}
    out = os.path.join(tempfile.mkdtemp(), "p.spool")
    print(f"load average before: {' '.join(open('/proc/loadavg').read().split()[:3])}", flush=True)
    print(f"| Hz | threads | depth | profiler | stolen | other CPU | total overhead | samples/s per thread-CPU-s "
          f"| us per sample | typical interruption (us) | capture (user CPU) | reps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for threads in [int(t) for t in a.threads.split(",")]:
        rows = {p: [] for p in chosen}
        for _ in range(a.reps):
            base = None
            for p in chosen:
                stolen, other, rate, capture, typical = run(bins[p], p, a.freq, threads, a.seconds, out, a.depth,
                                                            a.stack_copy)
                if p == "none":
                    base = (stolen, other)
                    continue
                rows[p].append((stolen - base[0], other - base[1], rate, capture, typical))
        for p in chosen[1:]:
            st = statistics.median(r[0] for r in rows[p])
            ot = statistics.median(r[1] for r in rows[p])
            tot = statistics.median(r[0] + r[1] for r in rows[p])
            rate = statistics.median(r[2] for r in rows[p])
            cap = statistics.median(r[3] for r in rows[p])
            typical = statistics.median(r[4] for r in rows[p])
            per = tot / rate * 1e6 if rate else float("nan")
            print(f"| {a.freq} | {threads} | {a.depth} | {p} | {st:+.2%} | {ot:+.2%} | {tot:+.2%} | {rate:.0f} "
                  f"| {per:.1f} | {typical:.1f} | {cap:.3f} | {a.reps} |", flush=True)
    print(f"load average after: {' '.join(open('/proc/loadavg').read().split()[:3])}", flush=True)


if __name__ == "__main__":
    main()
