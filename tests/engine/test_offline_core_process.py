"""The offline LLM with its engine core in its own process (`engine_core_process=True`, ladle/engine/offline_core.py)
on the tiny MiniMax-M3 config with dummy weights: every field of the final outputs equals the in-process LLM's
(greedy and seeded sampling, n > 1, logprobs, prompt logprobs, stop strings, max_tokens); a rejected prompt aborts
its whole call and leaves the core serving with no blocks held; a killed core raises EngineError now and later;
an interrupt aborts the call and frees its blocks; shutdown and interpreter exit leave no process behind, also for a
script without a main guard, and so does dropping an LLM; generate after shutdown is a clear EngineError in both modes;
a token-id prompt outside the vocabulary is a ValueError before anything runs (it used to fail the whole batch's
step); settings refused by the model's config are one ConfigError in both modes, before a core process starts (it
used to be an EngineError from the started core); the CPU default stays in-process."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from ladle.core.outputs import RequestRejected
from ladle.core.sampling_params import SamplingParams
from ladle.engine import offline_core
from ladle.engine.client import EngineError
from ladle.engine.config_resolve import ConfigError
from ladle.engine.llm import LLM

ENGINE = dict(load_format="dummy", max_model_len=128, kv_cache_memory_bytes=4 << 20, seed=3)


@pytest.fixture(scope="module")
def pair(tiny_m3_dir):
    """(in-process LLM, core-process LLM) on the same config."""
    local = LLM(tiny_m3_dir, engine_core_process=False, **ENGINE)
    remote = LLM(tiny_m3_dir, engine_core_process=True, **ENGINE)
    yield local, remote
    remote.shutdown()


def _prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randrange(4, 24))] for _ in range(n)]


def _fields(outputs) -> list:
    """Every field a caller reads, per request and choice (request ids differ by construction)."""
    rows = []
    for ro in outputs:
        rows.append((ro.prompt_token_ids, ro.prompt_logprobs, ro.finished))
        rows += [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.logprobs)
                 for c in ro.outputs]
    return rows


def test_modes_and_defaults(pair, tiny_m3_dir):
    local, remote = pair
    assert local.remote is None and local.core is not None
    assert remote.core is None and remote.remote.is_healthy()
    assert remote.engine_config.parallel.engine_core_process is True
    assert local.engine_config.parallel.engine_core_process is False
    default = LLM(tiny_m3_dir, **ENGINE)  # CPU: in-process unless asked
    assert default.remote is None and default.engine_config.parallel.engine_core_process is False


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11, n=3, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True),
], ids=["greedy", "seeded-n3", "logprobs"])
def test_same_outputs_as_in_process(pair, params):
    local, remote = pair
    prompts = _prompts(7, seed=5)
    assert _fields(remote.generate(prompts, params)) == _fields(local.generate(prompts, params))


def test_stop_string_finishes_like_in_process(pair):
    local, remote = pair
    prompts = _prompts(6, seed=9)
    probe = local.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    # a stop string taken from the middle of each greedy text: the request must end there in both modes
    stops = [o.outputs[0].text[3:6] for o in probe if len(o.outputs[0].text) > 8]
    assert stops, "no text long enough to cut a stop string from"
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=stops)
    got, want = remote.generate(prompts, params), local.generate(prompts, params)
    assert _fields(got) == _fields(want)
    assert any(o.outputs[0].finish_reason == "stop" for o in got)
    # the core heard of the stop hits after its last message; the next call's messages come after them
    remote.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    stats = remote.core_stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"], stats


def test_rejected_prompt_aborts_the_call_and_keeps_serving(pair):
    local, remote = pair
    fits, too_long = _prompts(3, seed=1), [list(range(3, 3 + ENGINE["max_model_len"] + 4))]
    with pytest.raises(RequestRejected, match="maximum context length"):
        remote.generate(fits + too_long, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert _fields(remote.generate(fits, params)) == _fields(local.generate(fits, params))
    stats = remote.core_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def test_killed_core_raises_engine_error_now_and_later(tiny_m3_dir):
    llm = LLM(tiny_m3_dir, engine_core_process=True, **ENGINE)
    pid = llm.remote._core.proc.pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="exited"):
        llm.generate(_prompts(2, seed=2), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    assert time.monotonic() - t0 < 5
    with pytest.raises(EngineError, match="not running"):
        llm.generate(_prompts(1, seed=3), SamplingParams(max_tokens=4))
    llm.shutdown()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_shutdown_and_exit_leave_no_process(tiny_m3_dir, tmp_path):
    llm = LLM(tiny_m3_dir, engine_core_process=True, **ENGINE)
    pid = llm.remote._core.proc.pid
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert not psutil.pid_exists(pid)
    # a script file with no `if __name__ == "__main__":` guard that never calls shutdown: the core does not re-run
    # the script (runner.worker.main_module_left_alone), and the interpreter exits promptly with 0, taking the core with it
    script = textwrap.dedent(f"""
        import os, sys
        from ladle.core.sampling_params import SamplingParams
        from ladle.engine.llm import LLM
        llm = LLM({tiny_m3_dir!r}, engine_core_process=True, **{ENGINE!r})
        print(llm.remote._core.proc.pid, flush=True)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    """)
    path = tmp_path / "unguarded.py"
    path.write_text(script)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    core_pid = int(done.stdout.split()[0])
    time.sleep(0.5)
    assert not psutil.pid_exists(core_pid) or psutil.Process(core_pid).status() == psutil.STATUS_ZOMBIE
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_interrupt_aborts_the_call_and_frees_its_blocks(pair, monkeypatch):
    """Ctrl-C while the driver processes step outputs (raised on its third step's outputs: deterministic, unlike a
    timer): KeyboardInterrupt reaches the caller, the call's requests are aborted in the core, the LLM goes on."""
    local, remote = pair
    real, calls = remote.remote._process, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(remote.remote, "_process", interrupted)
    with pytest.raises(KeyboardInterrupt):
        remote.generate(_prompts(8, seed=4) * 4, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    monkeypatch.undo()
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = _prompts(2, seed=6)
    assert _fields(remote.generate(prompts, params)) == _fields(local.generate(prompts, params))
    stats = remote.core_stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"], stats


def test_token_id_outside_the_vocabulary_is_refused_before_anything_runs(pair):
    """It used to reach the model, fail the whole step (every request batched with it ended with finish_reason
    "error" and no tokens) and return without raising."""
    local, remote = pair
    vocab = len(local.tokenizer)
    fits = _prompts(2, seed=8)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for llm in (local, remote):
        for bad in (vocab, -1):
            with pytest.raises(ValueError, match=rf"token id {bad} in prompt 1 is out of range \[0, {vocab}\)"):
                llm.generate([fits[0], [5, bad, 6], fits[1]], params)
        with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
            llm.generate(fits + fits[:1], [params, params])
    assert _fields(remote.generate(fits, params)) == _fields(local.generate(fits, params))
    assert all(o.outputs[0].finish_reason == "length" for o in remote.generate(fits, params))
    for llm in (local, remote):
        stats = llm.core_stats()
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.mark.parametrize("in_own_process", [False, True], ids=["in-process", "core-process"])
def test_generate_after_shutdown_says_so(tiny_m3_dir, in_own_process):
    with LLM(tiny_m3_dir, engine_core_process=in_own_process, **ENGINE) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    llm.shutdown()  # idempotent after the `with` block
    with pytest.raises(EngineError, match="this LLM was shut down"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


def test_dropping_an_llm_stops_its_core_process(tiny_m3_dir):
    """LLMs created and dropped in a loop: each core process (and its KV cache and ipc dir) goes with its LLM, not at
    interpreter exit."""
    llm = LLM(tiny_m3_dir, engine_core_process=True, **ENGINE)
    pid, ipc_dir = llm.remote._core.proc.pid, llm.remote._core.ipc_dir
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    del llm
    gc.collect()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(ipc_dir)


@pytest.mark.parametrize("in_own_process", [False, True], ids=["in-process", "core-process"])
def test_refused_settings_are_one_config_error_before_a_process_starts(tiny_m3_dir, monkeypatch, in_own_process):
    def no_spawn(*_):
        raise AssertionError("a core process was started for a refused config")

    monkeypatch.setattr(offline_core, "spawn_core", no_spawn)
    kw = {**ENGINE, "max_model_len": 10**7, "tensor_parallel_size": 3}
    with pytest.raises(ConfigError, match="2 settings of this LLM") as refused:
        LLM(tiny_m3_dir, engine_core_process=in_own_process, **kw)
    assert "--max-model-len 10000000" in str(refused.value) and "--tensor-parallel-size 3" in str(refused.value)
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(os.path.join(tiny_m3_dir, "missing"), engine_core_process=in_own_process, **ENGINE)


def test_served_model_name_is_refused(tiny_m3_dir, monkeypatch):
    """A serving field: the offline LLM reports no model name, so it is refused (ladle generate refuses the flag
    too), before anything loads."""
    monkeypatch.setattr(offline_core, "spawn_core", lambda *_: pytest.fail("a core process was started"))
    with pytest.raises(ConfigError, match="served_model_name: the offline LLM serves no API"):
        LLM(tiny_m3_dir, served_model_name="m", **ENGINE)


def test_request_output_carries_the_prompt_text(pair):
    """vLLM's quickstart reads `output.prompt`: the text given, None for a token-id prompt."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for llm in pair:
        outs = llm.generate(["Name three soups.", [5, 6, 7]], params)
        assert [o.prompt for o in outs] == ["Name three soups.", None]
