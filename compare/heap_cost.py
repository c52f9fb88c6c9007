#!/usr/bin/env python3
"""Cost of spulse::heap::Sampled<System> against System on allocation-heavy
workloads (src/heap/workload.rs): the two binaries run interleaved, in
alternating order, --reps times; the table gives each workload's median
wall time and the ratio of the medians (and of the minima).

    cd compare && cargo build --release --bin heap_system --bin heap_sampled
    python3 heap_cost.py --reps 11
"""
import argparse
import statistics
import subprocess
import sys

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=11)
ap.add_argument("--bins", default="heap_system,heap_sampled")
ap.add_argument("--dir", default="target/release")
args = ap.parse_args()
bins = args.bins.split(",")
times = {b: {} for b in bins}
for rep in range(args.reps):
    order = bins if rep % 2 == 0 else list(reversed(bins))
    for b in order:
        out = subprocess.run([f"{args.dir}/{b}"], capture_output=True, text=True, check=True).stdout
        for line in out.split("\n"):
            if line.strip():
                name, secs = line.split()
                times[b].setdefault(name, []).append(float(secs))
    print(f"rep {rep + 1}/{args.reps}", file=sys.stderr)
base = bins[0]
print(f"| workload | {' | '.join(f'{b} median (min) s' for b in bins)} | " +
      " | ".join(f"{b} / {base} median (min)" for b in bins[1:]) + " |")
print("| --- " * (1 + 2 * len(bins) - 1) + "|")
for name in times[base]:
    cells = []
    for b in bins:
        v = times[b][name]
        cells.append(f"{statistics.median(v):.3f} ({min(v):.3f})")
    ratios = []
    for b in bins[1:]:
        m = statistics.median(times[b][name]) / statistics.median(times[base][name])
        n = min(times[b][name]) / min(times[base][name])
        ratios.append(f"{(m - 1) * 100:+.1f}% ({(n - 1) * 100:+.1f}%)")
    print(f"| {name} | {' | '.join(cells)} | {' | '.join(ratios)} |")
