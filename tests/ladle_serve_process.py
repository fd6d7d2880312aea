"""`python -m ladle serve` as a subprocess, for the end-to-end tests of tests/server, tests/bench and tests/models:
a free port, the readiness wait on GET /health, the log tail, and a SIGTERM stop.

It sits in tests/ (on sys.path through tests/conftest.py, as pytest's default import mode puts a rootless
conftest's folder there) so every test folder can import it; keep its module name unique across tests/.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Optional, Union

import httpx

STARTUP_TIMEOUT_S = float(os.environ.get("LADLE_TEST_STARTUP_TIMEOUT", "300"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, proc: Optional[subprocess.Popen] = None, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Poll GET {base_url}/health until 200. Raises RuntimeError if `proc` exits first, TimeoutError after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"`ladle serve` exited with status {proc.returncode} during startup")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {base_url} not ready after {timeout:.0f} s")


class LadleServeProcess:
    """`python -m ladle serve <args> --port <free port> --uvicorn-log-level warning`, stdout and stderr to
    `log_path`. `start()` waits until it answers /health; `stop()` sends SIGTERM and returns the exit status."""

    def __init__(self, args: list[str], log_path: Union[str, pathlib.Path], env: Optional[dict] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = pathlib.Path(log_path)
        cmd = [sys.executable, "-m", "ladle", "serve", *args, "--port", str(self.port),
               "--uvicorn-log-level", "warning"]
        with open(self.log_path, "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> "LadleServeProcess":
        """Wait until ready; if it exits or times out, kill it and raise RuntimeError with the log tail."""
        try:
            wait_ready(self.url, self.proc, timeout)
        except Exception as e:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"`ladle serve` did not start ({e}); its log:\n{self.log_tail()}") from None
        return self

    def log_tail(self, num_chars: int = 5000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout: float = 30) -> Union[int, str]:
        """SIGTERM (uvicorn stops, the lifespan shuts the engine down), then SIGKILL after `timeout` seconds.
        Returns the exit status, or "no exit within <timeout> s"."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return f"no exit within {timeout:.0f} s"
