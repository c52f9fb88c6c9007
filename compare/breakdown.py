#!/usr/bin/env python3
"""Where the cost of a spulse sample goes: the compare workload's gap meter
(`workload --gaps S`, see compare/src/main.rs) with spulse's handler stopped
after each phase in turn (`WORKLOAD_HANDLER_PHASE`, the `testing` feature's
knob), against no profiler and against the kernel's own sampling.

Variants, run in turn in every repetition (interleaved, so drift hits all):
  none       no profiler (the baseline every other run is taken against)
  floor      `perf record -e task-clock` at the same period: the kernel's
             sampling interrupt, no signal
  classify   spulse's events and signal; the handler returns as soon as it
             knows the signal is its own: the kernel's part of a sample
  claim      + thread id, name, unwinder cache claimed
  registers  + ring slot claimed, registers and time read
  unwind     + the stack unwound into the slot (then dropped)
  full       the whole handler: the sample is published and written

For each: `stolen` (extra share of the meter threads' time taken by
interruptions), `writer` (extra process CPU outside the meter threads while
they ran: spulse's writer thread), the per-sample cost both from the totals
and from the typical interruption (median of gaps >= 5 us, which load and host
noise move far less), in microseconds; the last column is what a variant adds
over `classify` (its typical interruption, plus its writer CPU per sample).

Usage: python3 compare/breakdown.py [--reps 5] [--threads 1,2,8] [--depth 20]
                                    [--seconds 2] [--kernel-time 0|1]
(after `compare/run.py` or a `cargo build --release` of compare/ into
/tmp/spulse-compare-target/main)."""

import argparse
import json
import os
import statistics
import subprocess
import tempfile

import gaps

VARIANTS = ["none", "floor", "classify", "claim", "registers", "unwind", "full"]


def run(binary, variant, freq, threads, depth, seconds, kernel_time, out):
    profiler = {"none": "none", "floor": "none"}.get(variant, "spulse")
    cmd = [binary, "--profiler", profiler, "--freq", str(freq), "--threads", str(threads), "--depth", str(depth),
           "--gaps", str(seconds), "--out", out]
    if variant == "floor":
        cmd = ["perf", "record", "-q", "-e", "task-clock", "-c", str(1_000_000_000 // freq), "-o", out + ".perf",
               "--"] + cmd
    env = dict(os.environ, SPULSE_KERNEL_TIME=str(kernel_time))
    env.pop("WORKLOAD_HANDLER_PHASE", None)
    if variant in ("classify", "claim", "registers", "unwind"):
        env["WORKLOAD_HANDLER_PHASE"] = variant
    lines = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()
    d = json.loads(lines[-1])
    return {
        "stolen": d["gap_stolen_ticks"] / d["gap_running_ticks"],
        # Process CPU outside the meter threads while they ran (spulse's
        # writer thread: start-up and finish are outside the window).
        "writer": (d["window_cpu_s"] - d["workload_cpu_s"]) / d["workload_cpu_s"],
        "typical": gaps.typical_gap_us(d),
        "cpu": d["workload_cpu_s"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--freq", type=int, default=999)
    ap.add_argument("--threads", default="1,2,8")
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--kernel-time", type=int, default=1)
    ap.add_argument("--target-dir", default="/tmp/spulse-compare-target")
    a = ap.parse_args()
    binary = os.path.join(a.target_dir, "main", "release", "workload")
    out = os.path.join(tempfile.mkdtemp(), "p.spool")
    load = os.getloadavg()[0]
    print(f"depth {a.depth}, {a.freq} Hz, kernel time {a.kernel_time}, {a.reps} reps, load {load:.1f}")
    print("| threads | variant | stolen | writer CPU | us per sample (totals) | typical interruption (us) "
          "| over classify (typical + writer, us) |")
    print("|---|---|---|---|---|---|---|")
    for threads in [int(t) for t in a.threads.split(",")]:
        rows = {v: [] for v in VARIANTS}
        for _ in range(a.reps):
            for v in VARIANTS:
                rows[v].append(run(binary, v, a.freq, threads, a.depth, a.seconds, a.kernel_time, out))
        med = {v: {k: statistics.median(r[k] for r in rows[v]) for k in rows[v][0]} for v in VARIANTS}
        base = med["none"]
        for v in VARIANTS[1:]:
            m = med[v]
            stolen = m["stolen"] - base["stolen"]
            m = dict(m, writer=m["writer"] - base["writer"])
            per = (stolen + m["writer"]) / a.freq * 1e6
            over = m["typical"] - med["classify"]["typical"] + (m["writer"] - med["classify"]["writer"] + base["writer"]) / a.freq * 1e6
            print(f"| {threads} | {v} | {stolen:+.2%} | {m['writer']:.3%} | {per:.1f} | {m['typical']:.2f} "
                  f"| {over:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
