"""Fixtures for the benchmark tests: a scripted fake OpenAI server on 127.0.0.1 (see fake_server.py); tests/engine
on the path for its SmolLM2 engine helpers."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, "engine"))  # tests/engine/helpers.py (SmolLM2)

from fake_server import FakeServer  # noqa: E402


@pytest.fixture
def fake_server():
    srv = FakeServer().start()
    yield srv
    srv.stop()
