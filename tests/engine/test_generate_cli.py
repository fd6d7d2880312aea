"""`ladle generate` (ladle/cli.py cmd_generate) on the tiny MiniMax-M3 config with dummy weights: where the engine
core runs follows the offline API (in-process on CPU unless --engine-core-process is given, and then it is honoured:
it used to be ignored), bad sampling values are refused before anything loads, and a refused prompt is a one-line
error, not a traceback."""

from __future__ import annotations

import pytest

from ladle import cli
from ladle.engine import llm as llm_module

ENGINE = ["--load-format", "dummy", "--kv-cache-memory-bytes", str(4 << 20), "--max-model-len", "256", "--max-tokens", "3"]


@pytest.fixture
def started(monkeypatch):
    """The EngineConfig of every engine `ladle generate` starts."""
    configs = []
    real = llm_module._start

    def record(config):
        configs.append(config)
        return real(config)

    monkeypatch.setattr(llm_module, "_start", record)
    return configs


@pytest.mark.parametrize("flags, in_own_process", [([], False), (["--engine-core-process"], True),
                                                   (["--no-engine-core-process"], False)],
                         ids=["cpu-default", "core-process", "in-process"])
def test_engine_core_process_flag_is_honoured(tiny_m3_dir, started, capsys, flags, in_own_process):
    assert cli.main(["generate", "hello", tiny_m3_dir, *ENGINE, *flags]) == 0
    assert [c.parallel.engine_core_process for c in started] == [in_own_process]
    assert capsys.readouterr().out.strip()


def test_bad_sampling_values_are_refused_before_loading(tiny_m3_dir, started, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "hello", tiny_m3_dir, *ENGINE, "--temperature", "-1", "--max-model-len", "0"])
    assert exit_.value.code == 1 and started == []
    err = capsys.readouterr().err
    assert "temperature must be non-negative" in err and "--max-model-len must be positive" in err


def test_serving_flags_are_refused_by_name_before_loading(tiny_m3_dir, started, capsys):
    """--served-model-name was accepted and ignored (generate prints the text; no API reports a name); it and the
    other `ladle serve` flags are flag refusals (exit 2) naming `ladle serve`, in one message."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "hello", tiny_m3_dir, *ENGINE, "--served-model-name=m3", "--port", "9000"])
    assert exit_.value.code == 2 and started == []
    err = capsys.readouterr().err
    assert "--served-model-name: `ladle generate` prints the answer here and reports no model name" in err
    assert "`ladle serve MODEL --served-model-name NAME`" in err
    assert "--port: a `ladle serve` flag; `ladle generate` prints the answer here and serves no HTTP API" in err


def test_refused_prompt_is_a_message_not_a_traceback(tiny_m3_dir, started, capsys):
    assert cli.main(["generate", "hello " * 40, tiny_m3_dir, *ENGINE, "--max-model-len", "16"]) == 1
    err = capsys.readouterr().err
    assert "ladle generate: error: This model's maximum context length is 16 tokens" in err
    assert "Traceback" not in err
