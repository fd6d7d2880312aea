"""Fixtures for the benchmark tests: a scripted fake OpenAI server on 127.0.0.1 (see fake_server.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fake_server import FakeServer  # noqa: E402


@pytest.fixture
def fake_server():
    srv = FakeServer().start()
    yield srv
    srv.stop()
