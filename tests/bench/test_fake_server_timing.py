"""`ladle bench serve` against the scripted fake server: measured metrics equal hand-computed ones.

The server writes chunk j of a request at arrival + ttft + j * gap (50-150 ms scale). The client's numbers add the
loopback round trip and event-loop scheduling on a shared 2-core machine, so times measured from the request start
(TTFT, E2EL) must lie in [want - 3 ms, want + TOL_MS] (a client can only see a chunk late, never early) and
gaps (a request's median ITL, TPOT) within +-TOL_MS, TOL_MS = 40 ms: errors of 1-8 ms are typical, 20-26 ms were seen
with the machine at load 8 on 2 cores, and one single gap of 98 ms for 50 in a CI run. Goodput SLOs sit 75 ms from every
TTFT. Counts, token totals and the throughput/goodput formulas (relative to the measured duration) are compared exactly
in every run; the time checks must hold in one of up to three runs (`_in_time`).
"""

from __future__ import annotations

import json

import pytest

from ladle.bench.cli import main

TOL_MS = 40.0


def near_late(got: float, want: float) -> bool:
    return want - 3.0 <= got <= want + TOL_MS

SCRIPTS = [
    {"ttft": 0.10, "chunks": [1, 1, 1, 1, 1], "gap": 0.05},   # A: TTFT 100, E2EL 300, 5 tok, TPOT 50
    {"ttft": 0.05, "chunks": [1, 3, 1, 3], "gap": 0.08},      # B: multi-token chunks: E2EL 290, 8 tok, TPOT 240/7
    {"ttft": 0.25, "chunks": [1]},                            # C: single token: no TPOT, no ITL
    {"status": 503},                                          # D: error, counted under "503"
    {"ttft": 0.05, "chunks": [2, 2], "gap": 0.05, "usage": False},  # E: no usage: 4 tokens counted via /tokenize
]


def _write_dataset(tmp_path):
    path = tmp_path / "scripted.jsonl"
    with open(path, "w") as f:
        for i, s in enumerate(SCRIPTS):
            f.write(json.dumps({"prompt": f"request {i} SCRIPT{json.dumps(s)}"}) + "\n")
    return path


def _run(fake_server, tmp_path, *extra):
    argv = ["serve", "--base-url", fake_server.base_url, "--model", "fake-model", "--dataset-name", "custom",
            "--dataset-path", str(_write_dataset(tmp_path)), "--disable-shuffle", "--num-prompts", str(len(SCRIPTS)),
            "--max-concurrency", "1", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json", *extra]
    assert main(argv) == 0
    return json.loads((tmp_path / "r.json").read_text())


def _timed_misses(r: dict) -> list[str]:
    """The scripted run's time checks (see the module docstring): the ones that missed, as text; [] when all hold."""
    misses: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            misses.append(what)

    ms = lambda xs: [x * 1000 for x in xs]  # noqa: E731
    ttft, e2el = ms(r["ttfts"]), ms(r["latencies"])
    for i, want in zip((0, 1, 2, 4), [100, 50, 250, 50]):
        check(near_late(ttft[i], want), f"ttft[{i}] {ttft[i]:.1f} ms, scripted {want}")
    for i, want in zip((0, 1, 2, 4), [300, 290, 250, 100]):
        check(near_late(e2el[i], want), f"e2el[{i}] {e2el[i]:.1f} ms, scripted {want}")
    # gaps: one late chunk stretches one gap and shortens the next (a CI run saw a single 98 ms gap for 50), so each
    # request's median gap is checked, and the gaps must add up to the time from the first to the last chunk
    for i, want in ((0, 50), (1, 80)):
        gaps = sorted(ms(r["itls"][i]))
        median = (gaps[(len(gaps) - 1) // 2] + gaps[len(gaps) // 2]) / 2
        check(abs(median - want) <= TOL_MS, f"request {i} median gap {median:.1f} ms, scripted {want} ({gaps})")
    for i in (0, 1, 4):  # E2EL - TTFT - sum(ITL): the end of the stream after its last chunk, never before it
        rest = e2el[i] - ttft[i] - sum(ms(r["itls"][i]))
        check(-1.0 <= rest <= TOL_MS, f"request {i}: E2EL - TTFT - sum(ITL) = {rest:.1f} ms")
    # aggregates: TTFT [100, 50, 250, 50]; TPOT [50, 240/7, 50/3]; E2EL [300, 290, 250, 100]
    check(near_late(r["mean_ttft_ms"], 112.5), f"mean TTFT {r['mean_ttft_ms']:.1f}")
    check(near_late(r["median_ttft_ms"], 75.0), f"median TTFT {r['median_ttft_ms']:.1f}")
    check(abs(r["median_tpot_ms"] - 240 / 7) <= TOL_MS / 3, f"median TPOT {r['median_tpot_ms']:.1f}")
    mean_tpot = (50 + 240 / 7 + 50 / 3) / 3
    check(abs(r["mean_tpot_ms"] - mean_tpot) <= TOL_MS / 3, f"mean TPOT {r['mean_tpot_ms']:.1f}, {mean_tpot:.1f}")
    check(abs(r["median_itl_ms"] - 50.0) <= TOL_MS, f"median ITL {r['median_itl_ms']:.1f}")
    check(abs(r["mean_itl_ms"] - (5 * 50 + 3 * 80) / 8) <= TOL_MS, f"mean ITL {r['mean_itl_ms']:.1f}")
    check(near_late(r["median_e2el_ms"], 270.0), f"median E2EL {r['median_e2el_ms']:.1f}")
    # duration = the serial requests' scripted times (0.94 s) plus overhead
    check(0.94 <= r["duration"] <= 0.94 + 0.25, f"duration {r['duration']:.3f} s")
    return misses


def _in_time(tmp_path, run_once, timed_misses, attempts: int = 3) -> dict:
    """Run `run_once(run_dir)` (a fresh dir per run; it makes the exact checks and returns the result JSON) until
    `timed_misses(result)` is empty, at most `attempts` times, and return that result. A client that measures
    wrongly misses the time checks every time, while one scheduling stall of the shared CI machine (a single TTFT
    44 ms late, seen once) misses them in one run only. Fails with every run's misses."""
    misses_per_run: list[list[str]] = []
    for attempt in range(attempts):
        run_dir = tmp_path / f"run{attempt}"
        run_dir.mkdir()
        r = run_once(run_dir)
        misses_per_run.append(timed_misses(r))
        if not misses_per_run[-1]:
            return r
    raise AssertionError(f"time checks missed in all {attempts} runs: {misses_per_run}")


def test_scripted_metrics(fake_server, tmp_path):
    def run_once(run_dir):  # counts and formulas: exact in every run
        r = _run(fake_server, run_dir, "--goodput", "ttft:175", "tpot:75")
        assert r["completed"] == 4 and r["failed"] == 1
        assert r["ladle"]["errors_by_kind"] == {"503": 1}
        assert r["output_lens"] == [5, 8, 1, 0, 4]
        assert r["total_output_tokens"] == 18
        assert [len(x) for x in r["itls"]] == [4, 3, 0, 0, 1]
        # throughput over the measured duration
        dur = r["duration"]
        assert r["request_throughput"] == pytest.approx(4 / dur)
        assert r["output_throughput"] == pytest.approx(18 / dur)
        assert r["total_token_throughput"] == pytest.approx((r["total_input_tokens"] + 18) / dur)
        assert r["total_input_tokens"] == sum(r["input_lens"][i] for i in (0, 1, 2, 4))
        assert r["max_concurrent_requests"] == 1
        assert r["ladle"]["num_chunks"] == 5 + 4 + 1 + 2
        return r

    r = _in_time(tmp_path, run_once, _timed_misses)
    # good: A (100 <= 175, 50 <= 75), B, E; not C (TTFT 250), in the run whose times held
    assert r["request_goodput"] == pytest.approx(3 / r["duration"])


def test_chat_backend_same_timing(fake_server, tmp_path):
    def run_once(run_dir):
        r = _run(fake_server, run_dir, "--backend", "openai-chat")
        assert r["completed"] == 4 and r["output_lens"] == [5, 8, 1, 0, 4]
        return r

    _in_time(tmp_path, run_once, lambda r: [] if near_late(r["median_ttft_ms"], 75.0)
             else [f"median TTFT {r['median_ttft_ms']:.1f}, scripted 75"])
    assert "messages" in fake_server.requests[0]["body"]
    assert fake_server.requests[0]["body"]["max_completion_tokens"] == 256


def test_payload_is_vllms(fake_server, tmp_path):
    _run(fake_server, tmp_path, "--backend", "vllm", "--ignore-eos", "--temperature", "0")
    body = fake_server.requests[0]["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 256 and body["ignore_eos"] is True and body["repetition_penalty"] == 1.0
    assert body["temperature"] == 0.0 and body["model"] == "fake-model"


def test_empty_text_chunk_counts_and_comments_do_not(fake_server, tmp_path):
    script = {"ttft": 0.05, "chunks": [0, 1, 1], "gap": 0.05, "ping": True}

    def run_once(run_dir):
        path = run_dir / "e.jsonl"
        path.write_text(json.dumps({"prompt": f"x SCRIPT{json.dumps(script)}"}) + "\n")
        argv = ["serve", "--base-url", fake_server.base_url, "--model", "fake-model", "--dataset-name", "custom",
                "--dataset-path", str(path), "--num-prompts", "1", "--disable-tqdm", "--save-result", "--result-dir",
                str(run_dir), "--result-filename", "e.json"]
        assert main(argv) == 0
        r = json.loads((run_dir / "e.json").read_text())
        assert len(r["itls"][0]) == 2 and r["output_lens"] == [2]
        return r

    def timed_misses(r):
        misses = []
        # TTFT at the empty-text chunk (t=50 ms), not at the comment or the choices-less chunk sent at t=0
        if not near_late(r["ttfts"][0] * 1000, 50):
            misses.append(f"TTFT {r['ttfts'][0] * 1000:.1f} ms, scripted 50")
        if abs(r["median_tpot_ms"] - 100.0) > TOL_MS:  # (150 - 50) / (2 - 1)
            misses.append(f"median TPOT {r['median_tpot_ms']:.1f} ms, scripted 100")
        return misses

    _in_time(tmp_path, run_once, timed_misses)
