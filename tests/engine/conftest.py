import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# CI has 2 cores and this machine is shared: one intra-op thread per process avoids OpenMP oversubscription,
# which made small decode matmuls ~10x slower in measurements here.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from helpers import smollm2_gguf

    from ladle.engine.tokenizer import load_tokenizer

    path = smollm2_gguf()
    return load_tokenizer(os.path.dirname(path), os.path.basename(path))


@pytest.fixture(scope="module")
def tiny_m3_dir(tmp_path_factory) -> str:
    """A tiny M3 checkpoint directory (config and tokenizer only: load it with load_format="dummy")."""
    from ladle.tools.checkpoint_m3 import make_checkpoint

    return make_checkpoint(str(tmp_path_factory.mktemp("m3") / "tiny"), "tiny", config_only=True)
