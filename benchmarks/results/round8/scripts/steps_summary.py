"""Summary of a served point from /debug/steps and /debug/shapes (round 8, call 1): steps since T0 (epoch seconds)
split into decode-only and prefill-carrying steps, the first and the slowest steps, prefill rate per step kind, and
the measured per-op rows (--observe-timing; cumulative since the server started, also written to OPS_JSON).
Host times overlap under --async-scheduling (their sum is up to ~2x the wall time; round 14): the sampled steps' GPU
time, printed per kind since round 14, is each step's own.
Usage: python3 steps_summary.py URL T0 [OPS_JSON]"""
import json
import statistics
import sys
import urllib.request

url, t0 = sys.argv[1], float(sys.argv[2])
get = lambda path: json.load(urllib.request.urlopen(url + path, timeout=60))
steps = [s for s in get("/debug/steps?last=4096")["history"] if s["t"] >= t0 and s.get("host_ms") is not None]
print(f"steps since t0: {len(steps)}, host s {sum(s['host_ms'] for s in steps) / 1e3:.1f}")
dec = [s for s in steps if not s["prefill_tokens"]]
pre = [s for s in steps if s["prefill_tokens"]]
for name, group in (("decode-only", dec), ("with prefill", pre)):
    if group:
        # Under --async-scheduling consecutive steps' host times overlap (ladle/observe/steps.py): their sum is up to
        # ~2x the wall time. The sampled steps' GPU time (--observe-timing) is each step's own.
        gpu = [s["gpu_ms"] for s in group if s.get("gpu_ms") is not None]
        print(f"{name}: {len(group)} steps, host s {sum(s['host_ms'] for s in group) / 1e3:.1f}, median host ms "
              f"{statistics.median(s['host_ms'] for s in group):.2f}, tokens {sum(s['num_tokens'] for s in group)}, "
              f"prefill tokens {sum(s['prefill_tokens'] for s in group)}, mean reqs "
              f"{statistics.mean(s['num_reqs'] for s in group):.1f}"
              + (f", sampled GPU ms median {statistics.median(gpu):.2f} ({len(gpu)} steps)" if gpu else ""))
by = {}
for s in dec:
    by.setdefault(s["num_reqs"], []).append(s["host_ms"])
print("decode-only host ms by batch: " + " ".join(f"{b}:{statistics.median(v):.1f}x{len(v)}" for b, v in sorted(by.items())))
buckets = {}
for s in pre:
    k = min(32768, 1 << max(0, (s["prefill_tokens"] - 1).bit_length()))
    r = buckets.setdefault(k, [0, 0.0, 0])
    r[0] += 1; r[1] += s["host_ms"]; r[2] += s["prefill_tokens"]
print("prefill steps by prefill-token bucket (<=): " + " | ".join(
    f"{k}: {r[0]} steps {r[1] / 1e3:.1f}s {1e3 * r[2] / r[1]:.0f} tok/s" for k, r in sorted(buckets.items())))
row = lambda s: (f"  reqs {s['num_reqs']:3d} tok {s['num_tokens']:6d} pre {s['prefill_tokens']:6d} host {s['host_ms']:8.1f}"
                 f" gpu {s['gpu_ms'] if s['gpu_ms'] is None else round(s['gpu_ms'], 1)} wait {s['waiting']} run {s['running']}")
print("first 24 steps:"); [print(row(s)) for s in steps[:24]]
print("slowest 12 steps:"); [print(row(s)) for s in sorted(steps, key=lambda s: -s["host_ms"])[:12]]
shapes = get("/debug/shapes")
ops = (shapes.get("measured") or {}).get("ops") or []
print(f"measured ops (cumulative, {shapes.get('measured', {}).get('sampled_steps')} sampled steps):")
for r in ops[:28]:
    print(f"  {r['op']:34s} {str(r['bucket']):14s} {str(r['m_bucket']):8s} {r['total_ms']:10.1f} ms {r['samples']:6d} x {r['mean_us']:9.1f} us")
if len(sys.argv) > 3:
    json.dump(ops, open(sys.argv[3], "w"))
