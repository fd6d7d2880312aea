"""The command lines: the AMD/Embedded LLM MiniMax-M3 write-up's parses as written and runs (shortened) end to end
against the fake server writing vLLM's JSON fields; sweeps write one JSON per point, a table and a PNG."""

from __future__ import annotations

import json
import shlex

from ladle.bench.cli import build_parser, finalize_args, main

AMD = ("serve --backend vllm --model M --dataset-name random --random-input-len 8192 --random-output-len 1024 "
       "--random-range-ratio 0.8 --num-prompts 1280 --max-concurrency 128 --request-rate inf --ignore-eos "
       "--num-warmups 256 --percentile-metrics ttft,tpot,itl,e2el --save-result")

VLLM_FIELDS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
    "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times", "generated_texts", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")]


def test_amd_command_parses_as_written():
    args = finalize_args(build_parser().parse_args(shlex.split(AMD)))
    assert (args.command, args.backend, args.model, args.dataset_name) == ("serve", "vllm", "M", "random")
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == (8192, 1024, 0.8)
    assert (args.num_prompts, args.max_concurrency, args.num_warmups) == (1280, 128, 256)
    assert args.request_rate == float("inf") and args.ignore_eos and args.save_result
    assert args.percentile_metrics == "ttft,tpot,itl,e2el" and args.metric_percentiles == "99"
    assert (args.host, args.port, args.endpoint, args.random_range_mode) == ("127.0.0.1", 8000, None, "vllm")


def test_amd_command_runs_end_to_end(fake_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --save-result without --result-dir writes into the working directory
    argv = shlex.split(AMD.replace("--num-prompts 1280", "--num-prompts 8").replace("--num-warmups 256",
                                                                                   "--num-warmups 2"))
    assert main(argv + ["--base-url", fake_server.base_url, "--disable-tqdm"]) == 0
    [path] = list(tmp_path.glob("vllm-infqps-concurrency128-M-*.json"))
    r = json.loads(path.read_text())
    missing = [k for k in VLLM_FIELDS if k not in r]
    assert not missing
    assert list(r)[: len(VLLM_FIELDS) - 16] == VLLM_FIELDS[:-16]  # vLLM's order for the fixed fields
    assert r["completed"] == 8 and r["request_rate"] == "inf" and r["max_concurrency"] == 128
    assert all(1638 <= n <= 14746 for n in r["input_lens"])  # symmetric window around 8192 (no special tokens)
    assert all(204 <= n <= 1844 for n in r["output_lens"])
    bodies = [q["body"] for q in fake_server.requests]
    assert len(bodies) == 10 and bodies[0]["prompt"] == bodies[1]["prompt"] == bodies[2]["prompt"]  # warm-ups
    assert all(b["ignore_eos"] and b["max_tokens"] == n for b, n in zip(bodies[2:], r["output_lens"]))
    assert r["ladle"]["server"]["version"]["version"] == "fake-0"
    # the fake tokenizer adds a BOS token, so num_special_tokens_to_add = 1: input in [floor(8191*0.2), ceil(8191*1.8)]
    assert r["ladle"]["dataset"]["length_bounds"] == {"input_low": 1638, "input_high": 14744, "output_low": 204,
                                                      "output_high": 1844}


def test_sweep_writes_points_table_and_plot(fake_server, tmp_path):
    out = tmp_path / "sw"
    argv = ["sweep", "--base-url", fake_server.base_url, "--model", "fake-model", "--random-input-len", "32",
            "--random-output-len", "64", "--num-prompts", "4", "--concurrencies", "1,2,4,16", "--num-gpus", "2",
            "--disable-tqdm", "--result-dir", str(out)]
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["c1.json", "c2.json", "c4.json", "sweep.json", "sweep.md",
                                                    "sweep.png"]  # 16 > --num-prompts is dropped
    rows = json.loads((out / "sweep.json").read_text())
    c4 = json.loads((out / "c4.json").read_text())
    assert [r["concurrency"] for r in rows] == [1, 2, 4]
    assert rows[2]["tok_s_gpu"] == c4["total_token_throughput"] / 2
    assert rows[2]["intvty_med"] == 1000 / c4["median_tpot_ms"]
    assert "p90_tpot_ms" in c4 and "p99_ttft_ms" in c4 and "median_e2el_ms" in c4
    table = (out / "sweep.md").read_text()
    assert table.count("\n") == 5 and "TPOT p90" in table and "tok/s/user p99" in table
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_flags_exit_2(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["serve", "--goodput", "itl:5"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["serve", "--backend", "tgi"])
