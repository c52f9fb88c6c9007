#!/usr/bin/env python3
"""Per-sample cost of `spulse record` against embedded recording of the same
program, with the gap meter of compare/src/main.rs (see gaps.py).

Per repetition: the workload unprofiled (`--profiler none`), recording itself
(`--profiler spulse`, embedded), and under `spulse record` with
`--profiler none` (the preloaded library records it); the last two are each
compared with the unprofiled run of the same repetition, with gaps.py's
formulas. Build the workload first (compare/run.py, or
`cargo build --release --manifest-path compare/Cargo.toml --target-dir
/tmp/spulse-compare-target/main`) and the tool (`cargo build --release -p
spulse-cli`).

Usage: python3 compare/record_gaps.py [--reps 5] [--threads 1] [--freq 999]
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def last_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--freq", default="999")
    ap.add_argument("--workload", default="/tmp/spulse-compare-target/main/release/workload")
    ap.add_argument("--spulse", default=os.path.join(HERE, "..", "target", "release", "spulse"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    common = ["--freq", a.freq, "--threads", a.threads, "--gaps", "2"]
    rows = {"embedded": [], "spulse record": []}
    for rep in range(a.reps):
        base = last_json([a.workload, "--profiler", "none"] + common + ["--out", os.path.join(tmp, "n.spool")])
        b_stolen = base["gap_stolen_ticks"] / base["gap_running_ticks"]
        b_other = (base["window_cpu_s"] - base["workload_cpu_s"]) / base["workload_cpu_s"]
        for name in rows:
            out = os.path.join(tmp, f"{rep}-{name.replace(' ', '_')}.spool")
            if name == "embedded":
                d = last_json([a.workload, "--profiler", "spulse"] + common + ["--out", out])
                samples = d["samples"]
            else:
                d = last_json([a.spulse, "record", "-F", a.freq, "-o", out, "--", a.workload, "--profiler", "none"]
                              + common + ["--out", os.path.join(tmp, "unused.spool")])
                info = subprocess.run([a.spulse, "info", "--json", out], check=True, capture_output=True, text=True)
                samples = json.loads(info.stdout)["samples"]
            stolen = d["gap_stolen_ticks"] / d["gap_running_ticks"] - b_stolen
            other = (d["window_cpu_s"] - d["workload_cpu_s"]) / d["workload_cpu_s"] - b_other
            us = (stolen + other) * d["workload_cpu_s"] / samples * 1e6
            rows[name].append((stolen, other, samples / d["workload_cpu_s"], us))
    print("| threads | recording | stolen | other CPU | samples per CPU-s | us per sample | reps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, v in rows.items():
        med = [statistics.median(x[i] for x in v) for i in range(4)]
        print(f"| {a.threads} | {name} | {med[0] * 100:.2f}% | {med[1] * 100:.2f}% | {med[2]:.0f} | {med[3]:.1f} | {a.reps} |")


if __name__ == "__main__":
    main()
