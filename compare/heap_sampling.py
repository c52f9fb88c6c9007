#!/usr/bin/env python3
"""Accuracy of heap sampling schemes at one rate, simulated over many seeds
(no program runs: each thread's allocations laid end to end on a byte line,
sample points drawn on it, each point standing for `rate` bytes).

Schemes: Poisson (exponential intervals: Go's runtime, jemalloc, spulse
before stratification), gamma(k) intervals (a sum of k exponentials: a
renewal process k times less variable), and stratified (one point uniform
in each successive `rate`-byte stretch: spulse::heap's sampler).

Workloads: the issue's truth workload (100 MB in 1 KiB blocks, 300 MB in
64 KiB blocks, 50 MB in 4 KiB blocks, one function after the other) and
periodic loops (A bytes then B bytes, over and over: aliasing shows as a
larger spread of A's estimate than Poisson's).

    python3 compare/heap_sampling.py [--seeds 400]
"""
import argparse
import random
import statistics

ap = argparse.ArgumentParser()
ap.add_argument("--seeds", type=int, default=400)
ap.add_argument("--rate", type=int, default=512 * 1024)
args = ap.parse_args()
R = args.rate
MB = 1 << 20


class Renewal:
    """Gamma(k) intervals of mean R (k = 1: Poisson), started in equilibrium."""

    def __init__(self, k, rng):
        self.k, self.rng = k, rng
        self.pt = rng.random() * rng.gammavariate(k + 1, R / k)

    def count(self, end):
        c = 0
        while self.pt < end:
            c += 1
            self.pt += self.rng.gammavariate(self.k, R / self.k)
        return c


class Strata:
    """One point uniform in each stratum [base + nR, base + (n+1)R)."""

    def __init__(self, rng):
        self.rng = rng
        self.base = -rng.random() * R
        self.pt = self.base + rng.random() * R
        while self.pt < 0:
            self.base += R
            self.pt = self.base + rng.random() * R

    def count(self, end):
        c = 0
        while self.pt < end:
            c += 1
            self.base += R
            self.pt = self.base + self.rng.random() * R
        return c


SCHEMES = [("poisson", lambda rng: Renewal(1, rng))] + [
    (f"gamma k={k}", lambda rng, k=k: Renewal(k, rng)) for k in (4, 16, 64)
] + [("stratified", Strata)]


def estimate(make, seq, rng):
    """seq: (function, bytes) runs in allocation order -> estimated bytes per function."""
    s, pos, est = make(rng), 0.0, {}
    for f, size in seq:
        pos += size
        est[f] = est.get(f, 0) + s.count(pos) * R
    return est


def spread(errs):
    sd = statistics.pstdev(errs)
    worst = max(abs(e) for e in errs)
    within = sum(abs(e) <= 0.05 for e in errs) / len(errs)
    return f"{sd * 100:.2f}% / {worst * 100:.1f}% / {within * 100:.0f}%"


truth = [("1 KiB", 100 * MB), ("64 KiB", 300 * MB), ("live 4 KiB", 50 * MB)]
print(f"Truth workload, {args.seeds} seeds, rate {R}: per function sd / worst / share within 5 %;"
      " last column: share of runs with all three within 5 %")
print("| scheme | " + " | ".join(f for f, _ in truth) + " | all within 5 % |")
print("| --- " * (len(truth) + 2) + "|")
for name, make in SCHEMES:
    errs = {f: [] for f, _ in truth}
    ok = 0
    for seed in range(args.seeds):
        est = estimate(make, truth, random.Random(seed * 7919 + 13))
        e = {f: est[f] / b - 1 for f, b in truth}
        for f in e:
            errs[f].append(e[f])
        ok += all(abs(v) <= 0.05 for v in e.values())
    print(f"| {name} | " + " | ".join(spread(errs[f]) for f, _ in truth) + f" | {ok / args.seeds * 100:.0f}% |")

print()
print("Periodic loops (A bytes, B bytes, repeated over 200 MB): sd of A's estimate")
loops = [(1024, 64 * 1024), (64 * 1024, 448 * 1024), (100 * 1024, 412 * 1024), (256 * 1024, 256 * 1024),
         (300 * 1024, 724 * 1024), (1024 * 1024, 1024 * 1024)]
print("| scheme | " + " | ".join(f"{a // 1024}K+{b // 1024}K" for a, b in loops) + " |")
print("| --- " * (len(loops) + 1) + "|")
for name, make in SCHEMES:
    cells = []
    for a, b in loops:
        reps = 200 * MB // (a + b)
        seq = [("A", a), ("B", b)] * reps
        errs = []
        for seed in range(args.seeds // 2):
            est = estimate(make, seq, random.Random(seed * 31 + 5))
            errs.append(est.get("A", 0) / (a * reps) - 1)
        cells.append(f"{statistics.pstdev(errs) * 100:.1f}% (mean {statistics.mean(errs) * 100:+.1f}%)")
    print(f"| {name} | " + " | ".join(cells) + " |")
