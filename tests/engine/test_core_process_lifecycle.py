"""The engine-core process's logging and ipc dir (ladle/engine/core_process.py, ladle/engine/core_spawn.py), with a
real spawned core on the tiny MiniMax-M3 config (dummy weights): the core logs as its parent is configured (WARNING:
none of its INFO lines; INFO with ladle's CLI format: its INFO lines in that format; nothing configured: no INFO
line); a core whose parent is killed (SIGKILL or SIGTERM) removes its ipc dir as it exits; the next spawn removes a
stale `ladle-core-*` dir whose owners are all dead, and keeps one with a live owner and one not made by ladle."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

import ladle
from ladle.cli import LOG_FORMAT
from ladle.core.sampling_params import SamplingParams
from ladle.engine.core_spawn import IPC_DIR_PREFIX
from ladle.engine.llm import LLM

ENGINE = dict(load_format="dummy", max_model_len=128, kv_cache_memory_bytes=4 << 20, seed=3)
# build_engine's last line; only the core process builds the engine in this mode
CORE_INFO_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO ladle\.engine\.engine_factory: engine ready",
                            re.MULTILINE)


def _run_core_once(tiny_m3_dir: str) -> None:
    llm = LLM(tiny_m3_dir, engine_core_process=True, **ENGINE)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("level", [logging.WARNING, logging.INFO], ids=["warning", "info"])
def test_core_logs_as_its_parent_is_configured(tiny_m3_dir, capfd, level):
    """The parent configured as a user's basicConfig(level=WARNING) or as `ladle serve` does (INFO, LOG_FORMAT), on
    stderr. It used to be a fixed INFO basicConfig in the core: its INFO lines showed at WARNING too."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)  # sys.stderr as capfd set it up: the core's fd 2 is captured too
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    saved_level = root.level
    root.addHandler(handler)
    root.setLevel(level)
    try:
        capfd.readouterr()
        _run_core_once(tiny_m3_dir)
    finally:
        root.removeHandler(handler)
        root.setLevel(saved_level)
    err = capfd.readouterr().err
    if level == logging.WARNING:
        assert " INFO " not in err, err[-3000:]
    else:
        assert CORE_INFO_LINE.search(err), err[-3000:]


def _wait_gone(pid: int, path: str, timeout_s: float = 120.0) -> None:
    """Poll until process `pid` is gone (or a zombie) and `path` does not exist; generous, not a speed check."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        if dead and not os.path.exists(path):
            return
        time.sleep(0.2)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_core_removes_its_ipc_dir_when_its_parent_is_killed(tiny_m3_dir, tmp_path, signum):
    """The parent is a script that configures no logging (as `ladle generate`): no INFO line from its core either."""
    script = textwrap.dedent(f"""
        import time
        from ladle.engine.llm import LLM
        llm = LLM({tiny_m3_dir!r}, engine_core_process=True, **{ENGINE!r})
        print(llm.remote._core.proc.pid, llm.remote._core.ipc_dir, flush=True)
        time.sleep(600)
    """)
    path = tmp_path / "parent.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(ladle.__file__))}
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
    try:
        line = parent.stdout.readline().split()
        assert len(line) == 2, parent.stderr.read()[-3000:] if parent.poll() is not None else line
        core_pid, ipc_dir = int(line[0]), line[1]
        assert os.path.isdir(ipc_dir) and os.path.basename(ipc_dir).startswith(IPC_DIR_PREFIX)
        parent.send_signal(signum)
        parent.wait(60)
        _wait_gone(core_pid, ipc_dir)
        assert not psutil.pid_exists(core_pid) or psutil.Process(core_pid).status() == psutil.STATUS_ZOMBIE
        assert not os.path.exists(ipc_dir)
        err = parent.stderr.read()
        assert " INFO " not in err and "Traceback" not in err, err[-3000:]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
        parent.stderr.close()


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_next_spawn_removes_stale_ipc_dirs_only(tiny_m3_dir):
    made = {}
    for kind, pids in [("dead", [_dead_pid(), _dead_pid()]), ("live", [_dead_pid(), os.getpid()]), ("foreign", None)]:
        made[kind] = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
        if pids is not None:
            with open(os.path.join(made[kind], "owners"), "w") as f:
                f.write("".join(f"{pid}\n" for pid in pids))
    try:
        _run_core_once(tiny_m3_dir)
        assert not os.path.exists(made["dead"])
        assert os.path.isdir(made["live"]) and os.path.isdir(made["foreign"])
    finally:
        for path in made.values():
            shutil.rmtree(path, ignore_errors=True)
