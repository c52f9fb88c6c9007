#!/usr/bin/env python3
"""The echo server bare and under spulse in interleaved pairs of long runs:

    cd compare && cargo build --release --bin switch && python3 echo_pairs.py REPS SECONDS

Prints the medians (requests/s, CPU per request, p99), their ratios and each pair's own requests/s ratio."""
import json, os, subprocess, statistics, sys
B=os.path.join(os.path.dirname(os.path.abspath(__file__)), "target/release/switch")
reps=int(sys.argv[1]); secs=sys.argv[2]
cfg={"bare":[B,"--mode","echo","--profiler","none","--seconds",secs],"spulse":[B,"--mode","echo","--profiler","spulse","--seconds",secs]}
res={n:[] for n in cfg}; cpu={n:[] for n in cfg}; p99={n:[] for n in cfg}
for r in range(reps):
  for n in cfg:
    j=json.loads([l for l in subprocess.run(cfg[n],capture_output=True,text=True).stdout.splitlines() if l.startswith("{")][0])
    res[n].append(j["requests_per_s"]); cpu[n].append(j["cpu_us_per_request"]); p99[n].append(j["p99_us"])
for n in cfg:
  print(n, "req/s median", statistics.median(res[n]), "ratio %.3f"%(statistics.median(res[n])/statistics.median(res["bare"])), "cpu/req %.2f ratio %.3f"%(statistics.median(cpu[n]), statistics.median(cpu[n])/statistics.median(cpu["bare"])), "range", min(res[n]), max(res[n]), "p99 us median %.1f ratio %.3f"%(statistics.median(p99[n]), statistics.median(p99[n])/statistics.median(p99["bare"])))
print("per-rep ratios", ["%.3f"%(s/b) for s,b in zip(res["spulse"],res["bare"])])
