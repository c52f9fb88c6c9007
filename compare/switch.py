#!/usr/bin/env python3
"""The context-switch table of BENCHMARKS.md: a futex ping-pong and a TCP echo
server (compare/src/bin/switch.rs) bare, under spulse (each engine setting),
pprof-rs and perf record, at 99 and 999 Hz, as root and as an unprivileged
user. Prints a Markdown table of medians over --reps runs.

    cd compare && cargo build --release --features pprof-framehop --bin switch
    python3 switch.py --reps 5 [--bin target/release/switch] [--label NAME]

Unprivileged runs use `setpriv --reuid=65534 --regid=65534 --clear-groups`
(the binary must be readable and executable by that user). `perf record` runs
as root only (an unprivileged perf record with kernel time is refused at
paranoid 2; with --all-user it matches spulse's unprivileged engine)."""
import argparse, json, os, statistics, subprocess, sys, tempfile

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=5)
p.add_argument("--bin", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "target/release/switch"))
p.add_argument("--label", default="spulse")
p.add_argument("--modes", default="pingpong,echo")
p.add_argument("--freqs", default="99,999")
p.add_argument("--users", default="root,nobody")
p.add_argument("--round-trips", type=int, default=200000, help="ping-pong round trips (200,000: about 1-2 s, long enough for the automatic engine's switch check)")
p.add_argument("--only", default="", help="configuration names to run, separated by semicolons")
a = p.parse_args()

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    return None

def configs(freq, user):
    c = [("bare", ["--profiler", "none"], None)]
    c.append((f"{a.label}", ["--profiler", "spulse", "--freq", str(freq)], None))
    c.append((f"{a.label}, perf events named", ["--profiler", "spulse", "--freq", str(freq), "--engine", "perf-event"], None))
    c.append((f"{a.label}, thread timers", ["--profiler", "spulse", "--freq", str(freq), "--engine", "thread-timer"], None))
    if user == "root":
        c.append((f"{a.label} kernel time off", ["--profiler", "spulse", "--freq", str(freq), "--kernel-time", "off"], None))
    c.append(("pprof-rs (framehop)", ["--profiler", "pprof", "--freq", str(freq)], None))
    if user == "root":
        tmp = tempfile.mkdtemp()
        c.append(("perf record -e task-clock", ["--profiler", "none"],
                  ["perf", "record", "-q", "-e", "task-clock", "-F", str(freq), "-o", os.path.join(tmp, "p.data"), "--"]))
        c.append(("perf record --per-thread", ["--profiler", "none"],
                  ["perf", "record", "-q", "--per-thread", "-e", "task-clock", "-F", str(freq), "-o", os.path.join(tmp, "q.data"), "--"]))
    only = [o for o in a.only.split(";") if o]
    return [x for x in c if not only or x[0] in only]

rows = []
for mode in a.modes.split(","):
    for user in a.users.split(","):
        for freq in [int(f) for f in a.freqs.split(",")]:
            # Interleaved: each round runs every configuration once, so a
            # change of the machine's load shifts all of them alike.
            cs = configs(freq, user)
            results = {name: [] for name, _, _ in cs}
            for _ in range(a.reps):
                for name, args, wrap in cs:
                    cmd = (wrap or []) + [a.bin, "--mode", mode] + args + (["--round-trips", str(a.round_trips)] if mode == "pingpong" else [])
                    if user != "root":
                        cmd = NOBODY + cmd
                    r = run(cmd)
                    if r:
                        results[name].append(r)
            key = "cpu_us_per_round_trip" if mode == "pingpong" else "requests_per_s"
            base = statistics.median(v[key] for v in results["bare"]) if results.get("bare") else None
            cbase = statistics.median(v["cpu_us_per_request"] for v in results["bare"]) if base and mode != "pingpong" else None
            for name, args, wrap in cs:
                vals = results[name]
                ends = sorted({v.get("engine", "") for v in vals} - {""})
                if ends:
                    name = f"{name} (ran: {', '.join(ends)})"
                if not vals:
                    rows.append((mode, user, freq, name, "failed", "", "", ""))
                    continue
                if mode == "pingpong":
                    w = statistics.median(v["us_per_round_trip"] for v in vals)
                    c = statistics.median(v["cpu_us_per_round_trip"] for v in vals)
                    rows.append((mode, user, freq, name, f"{w:.2f} us", f"{c:.2f} us cpu", f"{c / base:.2f}x" if base else "", f"{min(v['us_per_round_trip'] for v in vals):.2f}-{max(v['us_per_round_trip'] for v in vals):.2f}"))
                else:
                    r = statistics.median(v["requests_per_s"] for v in vals)
                    q = statistics.median(v["p99_us"] for v in vals)
                    cr = statistics.median(v["cpu_us_per_request"] for v in vals)
                    rows.append((mode, user, freq, name, f"{r:.0f} req/s, {cr:.2f} CPU us/request", f"p99 {q:.0f} us", f"{r / base:.3f}x; CPU {cr / cbase:.3f}x" if base else "", f"{min(v['requests_per_s'] for v in vals):.0f}-{max(v['requests_per_s'] for v in vals):.0f}"))
                print(" | ".join(str(x) for x in rows[-1]), file=sys.stderr, flush=True)

print("| workload | user | Hz | profiler | median | | vs bare (CPU per round trip; requests/s) | range |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print("| " + " | ".join(str(x) for x in r) + " |")
