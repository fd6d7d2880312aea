"""What `ladle bench` says: the missing plotting package before the first sweep point (the sweep still writes its
table and JSON), "connection refused at URL" when nothing listens, and vLLM 0.33.0's summary lines."""

from __future__ import annotations

import json
import socket

from ladle.bench import sweep
from ladle.bench.cli import main


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sweep_without_matplotlib_says_so_first_and_skips_the_plot(fake_server, tmp_path, monkeypatch, capsys):
    events: list[str] = []
    real_run_serve = __import__("ladle.bench.serve", fromlist=["run_serve"]).run_serve

    async def spy(args, argv=None):
        events.append("point " + ("after the note" if sweep.MISSING_MATPLOTLIB in capsys.readouterr().err else "?"))
        return await real_run_serve(args, argv)

    monkeypatch.setattr(sweep, "can_plot", lambda: False)
    monkeypatch.setattr("ladle.bench.serve.run_serve", spy)
    out = tmp_path / "sw"
    argv = ["sweep", "--base-url", fake_server.base_url, "--model", "fake-model", "--random-input-len", "16",
            "--random-output-len", "8", "--num-prompts", "2", "--concurrencies", "1,2", "--disable-tqdm",
            "--result-dir", str(out)]
    assert main(argv) == 0
    assert events[0] == "point after the note" and len(events) == 2
    assert sorted(p.name for p in out.iterdir()) == ["c1.json", "c2.json", "sweep.json", "sweep.md"]
    assert "pip install matplotlib" in sweep.MISSING_MATPLOTLIB


def test_no_server_and_no_model_says_connection_refused(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["serve", "--base-url", url, "--num-prompts", "2", "--disable-tqdm"]) == 1
    err = capsys.readouterr().err
    assert f"connection refused at {url}: no server answers there" in err and "Traceback" not in err


def test_no_server_without_tokenizer_says_connection_refused_first(capsys):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["serve", "--base-url", url, "--model", "m", "--num-prompts", "2", "--disable-tqdm"]) == 1
    err = capsys.readouterr().err
    assert err.index(f"connection refused at {url}") < err.index("needs --tokenizer")


def test_refused_requests_name_the_url(tmp_path, capsys):
    trace = {"id": "t", "block_size": 64, "requests": [
        {"t": 0, "type": "n", "in": 130, "out": 3, "hash_ids": [1, 2], "think_time": 0, "api_time": 1}]}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["serve", "--base-url", url, "--model", "m", "--dataset-name", "agentic", "--dataset-path",
                 str(tmp_path / "t.json"), "--agentic-vocab-size", "1000", "--max-model-len", "4096",
                 "--num-prompts", "1", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "r.json"]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["errors"][0].startswith(f"connection refused at {url}/v1/completions")
    err = capsys.readouterr().err
    assert f"warning: connection refused at {url}" in err and f"error: connection refused at {url}" in err


def test_summary_lines_are_vllms(fake_server, capsys):
    argv = ["serve", "--base-url", fake_server.base_url, "--model", "fake-model", "--random-input-len", "16",
            "--random-output-len", "8", "--num-prompts", "3", "--request-rate", "50", "--max-concurrency", "2",
            "--disable-tqdm"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    labels = [line[:40].rstrip() for line in out.splitlines() if len(line) > 40 and line[40] == " "]
    # vLLM 0.33.0 vllm/benchmarks/serve.py prints these labels, in this order (column 41 holds the value)
    assert labels[:12] == [
        "Successful requests:", "Failed requests:", "Maximum request concurrency:", "Request rate configured (RPS):",
        "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
        "Output token throughput (tok/s):", "Peak output token throughput (tok/s):", "Peak concurrent requests:",
        "Total token throughput (tok/s):"]
    assert "=========== Serving Benchmark Result ============" in out

