"""Agentic replay on a tiny hand-made trace: prefix structure of the synthesised prompts, the theoretical hit rate
(hand-computed), and a replay through the fake server whose prefix cache reports the achieved hit rate."""

from __future__ import annotations

import json

import pytest

from ladle.bench import agentic
from ladle.bench.cli import main

# r0: blocks [1,2,3] + 10 tail; r1: [1,2,3,4] + 20; subagent s0: [100,101]; s1: [100,101,102] + 1;
# s2: [100,101] (exactly 128 tokens); r2: [1,9] + 5
TRACE = {"id": "trace_hand", "block_size": 64, "hash_id_scope": "local", "requests": [
    {"t": 0.0, "type": "n", "in": 202, "out": 4, "hash_ids": [1, 2, 3], "api_time": 1.0, "think_time": 0.0},
    {"t": 3.0, "type": "n", "in": 276, "out": 3, "hash_ids": [1, 2, 3, 4], "api_time": 1.0, "think_time": 2.0},
    {"t": 4.5, "type": "subagent", "requests": [
        {"t": 0.0, "type": "n", "in": 128, "out": 2, "hash_ids": [100, 101], "api_time": 0.5, "think_time": 0.0},
        {"t": 1.0, "type": "n", "in": 193, "out": 2, "hash_ids": [100, 101, 102], "api_time": 0.5,
         "think_time": 0.5},
        {"t": 2.0, "type": "n", "in": 128, "out": 2, "hash_ids": [100, 101], "api_time": 0.5, "think_time": 0.5},
    ]},
    {"t": 5.0, "type": "n", "in": 133, "out": 2, "hash_ids": [1, 9], "api_time": 1.0, "think_time": 1.0},
]}
# hits at 64-token blocks: r1 192, s1 128, s2 min(128, 127//64*64=64)=64, r2 64 -> 448 of 1060 prompt tokens
# hits at 128-token blocks: r1 128, s1 128, s2 min(128, 0)=0, r2 0 -> 256
# hits at 16-token blocks: r1 192, s1 128, s2 min(128, 127//16*16=112)=112, r2 64 -> 496
TOTAL = 202 + 276 + 128 + 193 + 128 + 133


@pytest.fixture
def trace_dir(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    (d / "trace_hand.json").write_text(json.dumps(TRACE))
    return d


def test_structure_and_delays(trace_dir):
    [sess] = agentic.load_traces(str(trace_dir), None)
    kinds = [type(it).__name__ for it in sess.items]
    assert kinds == ["AgenticRequest", "AgenticRequest", "AgenticSession", "AgenticRequest"]
    assert [it.delay_s for it in sess.items] == [0.0, 2.0, 4.5 - (3.0 + 1.0), 1.0]
    assert [r.input_len for r in sess.leaves()] == [202, 276, 128, 193, 128, 133]


def test_theoretical_hit_rate_hand_computed(trace_dir):
    sessions = agentic.load_traces(str(trace_dir), None)
    st = agentic.workload_stats(sessions, 128)
    assert st["total_prompt_tokens"] == TOTAL
    assert st["theoretical_hit_rate_trace_block"] == pytest.approx(448 / TOTAL)
    assert st["theoretical_hit_rate_server_block"] == pytest.approx(256 / TOTAL)
    assert agentic.theoretical_hits(agentic.replay_order(sessions), 16) == (496, TOTAL)


def test_length_scale_keeps_structure(trace_dir):
    [sess] = agentic.load_traces(str(trace_dir), None, length_scale=0.5)
    leaves = sess.leaves()
    assert [r.block_tokens for r in leaves] == [32] * 6
    assert [r.input_len for r in leaves] == [3 * 32 + 5, 4 * 32 + 10, 64, 3 * 32 + 0, 64, 2 * 32 + 2]
    # hits: r1 96, s1 64, s2 min(64, 63//32*32=32)=32, r2 32
    assert agentic.theoretical_hits(leaves, 32) == (96 + 64 + 32 + 32, sum(r.input_len for r in leaves))


def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_synthesised_prompts_share_exactly_the_block_prefixes(trace_dir):
    [sess] = agentic.load_traces(str(trace_dir), None)
    r0, r1, s0, s1, s2, r2 = sess.leaves()
    synth = agentic.TokenSynth(vocab_size=50_000, seed=0, salt=5)
    p = {name: synth.prompt(r) for name, r in zip("r0 r1 s0 s1 s2 r2".split(), (r0, r1, s0, s1, s2, r2))}
    assert [len(v) for v in p.values()] == [202, 276, 128, 193, 128, 133]
    assert _common_prefix(p["r0"], p["r1"]) == 192  # blocks 1,2,3; r0's tail is its own
    assert _common_prefix(p["r1"], p["r2"]) == 64
    assert _common_prefix(p["s0"], p["s1"]) == 128 and p["s0"] == p["s2"]  # identical ids, no tail
    assert _common_prefix(p["r0"], p["s0"]) == 0
    assert all(6250 <= t < 43750 for t in p["r1"])  # ids in [vocab/8, 7 vocab/8)
    other = agentic.TokenSynth(vocab_size=50_000, seed=0, salt=6)
    assert _common_prefix(other.prompt(r0), p["r0"]) == 0  # another salt shares nothing (cache busting)


def _replay(fake_server, trace_dir, tmp_path, *extra):
    argv = ["serve", "--base-url", fake_server.base_url, "--dataset-name", "agentic", "--dataset-path",
            str(trace_dir), "--agentic-think-time-scale", "0.05", "--agentic-salt", "3", "--disable-tqdm",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "a.json", *extra]
    assert main(argv) == 0
    return json.loads((tmp_path / "a.json").read_text())


def test_replay_through_fake_server(fake_server, trace_dir, tmp_path):
    r = _replay(fake_server, trace_dir, tmp_path, "--num-warmups", "1")
    ag = r["ladle"]["agentic"]
    assert r["completed"] == 6 and r["failed"] == 0
    assert ag["server_block_size"] == 16  # read from /version
    assert ag["theoretical_hit_rate_trace_block"] == pytest.approx(448 / TOTAL)
    assert ag["theoretical_hit_rate_server_block"] == pytest.approx(496 / TOTAL)
    # the fake server's unlimited 16-token prefix cache achieves exactly the theoretical rate at its block size
    assert ag["achieved_hit_rate_usage"] == pytest.approx(496 / TOTAL)
    assert ag["achieved_hit_rate_metrics"] == pytest.approx(496 / TOTAL)
    reqs = fake_server.requests[1:]  # [0] is the warm-up, with a different salt
    assert _common_prefix(fake_server.requests[0]["body"]["prompt"], reqs[0]["body"]["prompt"]) < 16
    assert all(isinstance(q["body"]["prompt"], list) and q["body"]["ignore_eos"] for q in reqs)
    by_len = {len(q["body"]["prompt"]): q for q in reqs if len(q["body"]["prompt"]) != 128}
    r0, r1, s1, r2 = by_len[202], by_len[276], by_len[193], by_len[133]
    assert r0["body"]["max_tokens"] == 4
    # order within the parent: r1 starts >= 2.0*0.05 s after r0 ends; r2 1.0*0.05 s after r1 ends
    assert r1["arrival"] - r0["finish"] >= 0.1 - 0.005
    assert r2["arrival"] - r1["finish"] >= 0.05 - 0.005
    # the subagent starts 0.5*0.05 s after r1 ends and runs alongside the parent: it does not wait for r2
    assert s1["arrival"] > r1["finish"]


def test_too_long_requests_dropped_and_counted(fake_server, trace_dir, tmp_path):
    r = _replay(fake_server, trace_dir, tmp_path, "--max-model-len", "250", "--agentic-block-size", "64")
    ag = r["ladle"]["agentic"]
    assert ag["num_dropped_too_long"] == 1  # r1: 276 + 3 > 250
    assert r["completed"] == 5
    # without r1: hits s1 128, s2 64, r2 64 (block 1 is still r0's) of 1060 - 276
    assert ag["theoretical_hit_rate_trace_block"] == pytest.approx(256 / (TOTAL - 276))
