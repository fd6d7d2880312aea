"""Server errors, a request that never answers and a server that is not there: counted, never a crash."""

from __future__ import annotations

import json
import socket

from ladle.bench.cli import main


def _dataset(tmp_path, scripts):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i} SCRIPT{json.dumps(s)}"}) + "\n"
                            for i, s in enumerate(scripts)))
    return str(path)


def _serve(base_url, tmp_path, dataset, n, *extra):
    argv = ["serve", "--base-url", base_url, "--model", "fake-model", "--dataset-name", "custom", "--dataset-path",
            dataset, "--disable-shuffle", "--num-prompts", str(n), "--disable-tqdm", "--save-result",
            "--result-dir", str(tmp_path), "--result-filename", "r.json", *extra]
    rc = main(argv)
    return rc, (json.loads((tmp_path / "r.json").read_text()) if rc == 0 else None)


def test_errors_counted_per_status_and_timeout(fake_server, tmp_path):
    scripts = [{"status": 503}, {"status": 503}, {"status": 400}, {"hang": True}, {"ttft": 0.01, "chunks": [1, 1]}]
    rc, r = _serve(fake_server.base_url, tmp_path, _dataset(tmp_path, scripts), 5, "--request-timeout", "1.0")
    assert rc == 0
    assert r["completed"] == 1 and r["failed"] == 4
    assert r["ladle"]["errors_by_kind"] == {"503": 2, "400": 1, "timeout": 1}
    assert r["errors"][0].startswith("HTTP 503") and r["errors"][4] == ""
    assert r["output_lens"] == [0, 0, 0, 0, 2]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_connection_refused_counted(tmp_path):
    # agentic replay needs no tokenizer, so the run itself starts and every request fails to connect
    trace = {"id": "t", "block_size": 64, "requests": [
        {"t": 0, "type": "n", "in": 130, "out": 3, "hash_ids": [1, 2], "think_time": 0, "api_time": 1}]}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    rc, r = _serve(f"http://127.0.0.1:{_closed_port()}", tmp_path, "unused", 1, "--dataset-name", "agentic",
                   "--dataset-path", str(tmp_path / "t.json"), "--agentic-vocab-size", "1000", "--max-model-len",
                   "4096", "--agentic-salt", "1")
    assert rc == 0
    assert r["completed"] == 0 and r["failed"] == 1
    assert r["ladle"]["errors_by_kind"] == {"connection_error": 1}


def test_unreachable_server_without_tokenizer_is_a_clean_error(tmp_path, capsys):
    rc = main(["serve", "--base-url", f"http://127.0.0.1:{_closed_port()}", "--model", "m", "--num-prompts", "2",
               "--disable-tqdm"])
    assert rc == 1
    assert "needs --tokenizer" in capsys.readouterr().err
