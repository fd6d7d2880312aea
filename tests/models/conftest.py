"""Fixtures shared by the MiniMax-M3 tests (test_minimax_m3_*.py). None is autouse, so the other tests in this
folder are unaffected; an M3 module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")` and by
naming `ckpt`."""

from __future__ import annotations

import pytest
import torch

from ladle.tools.checkpoint_m3 import make_checkpoint


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: tiny ops on a shared 2-core box only gain contention from more
    (25x slower measured)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """Directory of the tiny MiniMax-M3 checkpoint (release layout, random weights), one per test module."""
    return make_checkpoint(str(tmp_path_factory.mktemp("m3") / "tiny"), "tiny")


@pytest.fixture(scope="module")
def lm(ckpt):
    """The tiny checkpoint loaded as a float32 CPU MiniMaxM3ForCausalLM (the torch reference path)."""
    from drivers.minimax_m3_paged import load_m3_dir

    return load_m3_dir(ckpt, torch.float32)
