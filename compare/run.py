#!/usr/bin/env python3
"""Side-by-side comparison of spulse with its peers on one workload.

Builds the workload (compare/src/main.rs) in three variants (spulse + none,
pprof-rs default unwinder, pprof-rs framehop unwinder), then for each
frequency and thread count runs every profiler in turn, repeating the whole
round --reps times so machine drift spreads over all of them alike. perf
record (and samply, when installed) profile the unprofiled variant from
outside. Prints a table and, with --write, replaces the "Side by side"
section of BENCHMARKS.md with it.

Usage: python3 compare/run.py [--reps 5] [--freqs 99,999] [--threads 1,2,8]
                              [--rounds 20000] [--write]
"""

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FUNCS = ["hot_alpha", "hot_beta", "hot_gamma"]
EXPECTED = {"hot_alpha": 0.5, "hot_beta": 0.3, "hot_gamma": 0.2}


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw)


def build(target_dir):
    """Build the three workload variants; returns {variant: binary path}."""
    bins = {}
    for variant, feats in [("main", []), ("pprof", ["pprof-default"]), ("pprof-fh", ["pprof-framehop"])]:
        td = os.path.join(target_dir, variant)
        cmd = ["cargo", "build", "--release", "--manifest-path", os.path.join(HERE, "Cargo.toml")]
        if feats:
            cmd += ["--features", ",".join(feats)]
        print("building", variant, file=sys.stderr)
        subprocess.run(cmd, check=True, env=dict(os.environ, CARGO_TARGET_DIR=td))
        bins[variant] = os.path.join(td, "release", "workload")
    print("building spulse cli", file=sys.stderr)
    subprocess.run(
        ["cargo", "build", "--release", "-p", "spulse-cli"],
        check=True,
        cwd=ROOT,
        env=dict(os.environ, CARGO_TARGET_DIR=os.path.join(target_dir, "cli")),
    )
    bins["cli"] = os.path.join(target_dir, "cli", "release", "spulse")
    return bins


def top_share(names_counts):
    total = sum(names_counts.values()) or 1
    return {f: names_counts.get(f, 0) / total for f in FUNCS}


def spulse_functions(cli, spool):
    out = sh([cli, "top", spool, "--json", "-n", "40"]).stdout
    rows = json.loads(out)
    counts = {}
    top = []
    total = sum(r["self"] for r in rows) or 1
    for r in sorted(rows, key=lambda r: -r["self"]):
        name = r["function"]
        if r["self"] >= 0.01 * total:
            top.append(name)
        # The hot functions call nothing of their own, so their total (inlined
        # helpers included) is their self time at function granularity.
        for f in FUNCS:
            if name.endswith(f):
                counts[f] = counts.get(f, 0) + r["total"]
    return counts, top[:10]


def perf_functions(data):
    t0 = time.time()
    out = sh(["perf", "report", "-i", data, "--stdio", "--no-children", "--sort", "sym", "-F", "overhead,sample,sym", "-g", "none"]).stdout
    load_s = time.time() - t0
    counts, rows, total = {}, [], 0
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\d+)\s+\[(.)\]\s+(.*)$", line)
        if not m:
            continue
        n, name = int(m.group(2)), m.group(4).strip()
        total += n
        if m.group(3) == ".":  # user-space symbols only: ours never sample the kernel
            rows.append((n, name))
        for f in FUNCS:
            if f in name:
                counts[f] = counts.get(f, 0) + n
    # perf's own top-10 by self samples, keeping only functions with >= 1% of them
    top = [name for n, name in sorted(rows, reverse=True) if n >= 0.01 * total][:10]
    # perf's "pid" sort key is per thread: "tid:comm".
    tid_out = sh(["perf", "report", "-i", data, "--stdio", "--sort", "pid", "-F", "sample,pid", "-g", "none"]).stdout
    per_tid = []
    for line in tid_out.splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+):(worker-\d+)", line)
        if m:
            per_tid.append(int(m.group(1)))
    return counts, top[:10], total, load_s, per_tid


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_one(bins, profiler, freq, threads, rounds, tmp):
    """One run; adds `tree_cpu_s`: the CPU of the whole command (the workload
    and, for perf and samply, the profiler's own process; post-processing such
    as `perf report` not included)."""
    c0 = children_cpu()
    res = run_one_inner(bins, profiler, freq, threads, rounds, tmp)
    res.setdefault("tree_cpu_s", children_cpu() - c0)
    return res


def run_one_inner(bins, profiler, freq, threads, rounds, tmp):
    spool = os.path.join(tmp, "p.spool")
    common = ["--freq", str(freq), "--threads", str(threads), "--rounds", str(rounds), "--out", spool]
    if profiler in ("none", "spulse"):
        c0 = children_cpu()
        res = json.loads(sh([bins["main"], "--profiler", profiler] + common).stdout)
        res["tree_cpu_s"] = children_cpu() - c0
        if profiler == "spulse":
            res["functions"], res["top10"] = spulse_functions(bins["cli"], spool)
        return res
    if profiler in ("pprof", "pprof-fh"):
        res = json.loads(sh([bins[profiler], "--profiler", "pprof"] + common).stdout)
        return res
    if profiler == "perf":
        data = os.path.join(tmp, "perf.data")
        c0 = children_cpu()
        out = sh(["perf", "record", "-q", "-F", str(freq), "--call-graph", "dwarf", "-o", data, "--",
                  bins["main"], "--profiler", "none"] + common).stdout
        tree = children_cpu() - c0
        res = json.loads(out.strip().splitlines()[-1])
        res["tree_cpu_s"] = tree
        res["functions"], res["top10"], res["samples"], res["load_s"], res["per_thread_samples"] = perf_functions(data)
        res["profile_bytes"] = os.path.getsize(data)
        return res
    if profiler == "samply":
        prof = os.path.join(tmp, "samply.json")
        c0 = children_cpu()
        out = sh(["samply", "record", "--save-only", "--rate", str(freq), "-o", prof, "--",
                  bins["main"], "--profiler", "none"] + common).stdout
        tree = children_cpu() - c0
        res = json.loads(out.strip().splitlines()[-1])
        res["tree_cpu_s"] = tree
        res["profile_bytes"] = os.path.getsize(prof)
        t0 = time.time()
        with open(prof) as f:
            doc = json.load(f)  # samply's native output is Firefox-profiler JSON
        res["load_s"] = time.time() - t0
        workers = [t for t in doc["threads"] if str(t.get("name", "")).startswith("worker-")]
        res["per_thread_samples"] = [t["samples"]["length"] for t in workers]
        res["samples"] = sum(res["per_thread_samples"])
        return res
    raise ValueError(profiler)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--freqs", default="99,999")
    ap.add_argument("--threads", default="1,2,8")
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--target-dir", default="/tmp/spulse-compare-target")
    a = ap.parse_args()

    bins = build(a.target_dir)
    profilers = ["none", "spulse", "pprof", "pprof-fh", "perf"]
    paranoid_path, paranoid_old = "/proc/sys/kernel/perf_event_paranoid", None
    if shutil.which("samply"):
        # samply refuses to run above level 1; as root, lower it for the run and restore it after.
        level = int(open(paranoid_path).read())
        if level > 1 and os.geteuid() == 0:
            paranoid_old = level
            open(paranoid_path, "w").write("1")
        if level <= 1 or paranoid_old is not None:
            profilers.append("samply")
    results = {}
    tmp = tempfile.mkdtemp(prefix="spulse-compare-")
    for freq in [int(x) for x in a.freqs.split(",")]:
        for threads in [int(x) for x in a.threads.split(",")]:
            for rep in range(a.reps):
                order = profilers[rep % len(profilers):] + profilers[: rep % len(profilers)]
                for p in order:
                    try:
                        r = run_one(bins, p, freq, threads, a.rounds, tmp)
                    except subprocess.CalledProcessError as e:
                        print(f"{p} {freq}Hz {threads}t failed: {e.stderr[-500:]}", file=sys.stderr)
                        continue
                    results.setdefault((freq, threads, p), []).append(r)
                    print(f"{freq}Hz {threads}t rep{rep} {p}: wall {r['wall_s']:.3f}s", file=sys.stderr)

    if paranoid_old is not None:
        open(paranoid_path, "w").write(str(paranoid_old))
    with open(os.path.join(tmp, "results.json"), "w") as f:
        json.dump([{"freq": k[0], "threads": k[1], "profiler": k[2], "runs": v} for k, v in results.items()], f)
    print("raw results:", os.path.join(tmp, "results.json"), file=sys.stderr)
    rows = []
    for (freq, threads, p), runs in sorted(results.items()):
        base = results.get((freq, threads, "none"), [])
        wall0, cpu0, rss0 = med([r["wall_s"] for r in base]), med([r["cpu_s"] for r in base]), med([r["maxrss_kb"] for r in base])
        wall, cpu = med([r["wall_s"] for r in runs]), med([r["cpu_s"] for r in runs])
        tree0, tree = med([r.get("tree_cpu_s") for r in base]), med([r.get("tree_cpu_s") for r in runs])
        cap = med([r["samples"] / (r["workload_cpu_s"] * freq) for r in runs if "samples" in r])
        acc = None
        shares = [top_share(r["functions"]) for r in runs if r.get("functions")]
        if shares:
            acc = max(abs(med([s[f] for s in shares]) - EXPECTED[f]) for f in FUNCS) * 100
        spread = None
        if threads > 1:
            sp = []
            for r in runs:
                pts = r.get("per_thread_samples") or []
                if len(pts) == threads and min(pts) > 0:
                    sp.append((max(pts) - min(pts)) / statistics.mean(pts) * 100)
            spread = med(sp)
        size = med([r["profile_bytes"] / r["wall_s"] for r in runs if "profile_bytes" in r])
        rss = med([r["maxrss_kb"] for r in runs])
        load = med([r.get("load_s") for r in runs])
        rows.append((freq, threads, p, wall / wall0 if wall0 else None, cpu / cpu0 if cpu0 else None,
                     tree / tree0 if tree0 and tree else None, cap, acc,
                     spread, size, (rss - rss0) / 1024 if rss0 else None, load, len(runs)))
    # top-10 agreement with perf, per config
    agree = {}
    for (freq, threads, p), runs in results.items():
        perf_runs = results.get((freq, threads, "perf"))
        if p == "perf" or not perf_runs or not runs[0].get("top10"):
            continue
        ptop = set(perf_runs[0]["top10"])
        agree[(freq, threads, p)] = "%d/%d" % (len(ptop & set(runs[0]["top10"])), len(ptop))
        # (functions with >= 1% of self samples in perf's top 10, found in ours)

    head = ("| Hz | threads | profiler | wall x | CPU x | CPU x, with the profiler's process | capture | worst split error (pts) | thread spread % "
            "| bytes/s | RSS added MiB | load s | top-10 shared with perf | runs |")
    lines = [head, "|" + "---|" * 14]
    for (freq, threads, p, w, c, t, cap, acc, spread, size, rss, load, n) in rows:
        lines.append("| %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d |" % (
            freq, threads, p, fmt(w, ".3f"), fmt(c, ".3f"), fmt(t, ".3f"), fmt(cap, ".1%"), fmt(acc, ".1f"), fmt(spread, ".1f"),
            fmt(size, ",.0f"), fmt(rss, ".1f"), fmt(load, ".3f"), agree.get((freq, threads, p), "n/a"), n))
    table = "\n".join(lines)
    print(table)
    if a.write:
        uname = platform.uname()
        section = (
            "## Side by side\n\n"
            f"Measured {datetime.date.today()} on {uname.node} ({os.cpu_count()} cores, Linux {uname.release}) by\n"
            f"`python3 compare/run.py --reps {a.reps} --freqs {a.freqs} --threads {a.threads} --rounds {a.rounds} --write`.\n"
            "Each cell is the median of the runs; runs of all profilers alternate within each repetition.\n"
            "`wall x`/`CPU x`: time against no profiler until profiling ended (process CPU; spulse: after `finish`, which drains, writes and syncs; pprof-rs: before it builds its report; perf's own process is not counted). `CPU x, with the profiler's process`: the whole command's CPU (getrusage of the children: the workload from exec to exit, and perf's or samply's own process while it records) against the same for no profiler.\n"
            "`capture`: samples / (workload threads' CPU seconds x frequency). `worst split error`: largest\n"
            "distance, in percentage points, between a function's share of the three hot functions' samples and\n"
            "its known share (50/30/20). `thread spread`: (max - min) / mean of per-thread samples.\n"
            "`top-10 shared with perf`: of perf's user-space functions with >= 1% of self samples (at most 10),\n"
            "how many are among ours (names as each tool demangles them; spulse lists inlined functions as\n"
            "their own rows, so an inlined helper can take a place). RSS is the workload's VmHWM.\n\n"
            + table + "\n"
        )
        path = os.path.join(ROOT, "BENCHMARKS.md")
        text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
        if "## Side by side\n" in text:
            text = re.sub(r"## Side by side\n.*?(?=\n## |\Z)", section, text, flags=re.S)
        else:
            text = text.rstrip("\n") + "\n\n" + section
        open(path, "w").write(text)


if __name__ == "__main__":
    main()
