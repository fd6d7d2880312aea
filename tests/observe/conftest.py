"""tests/observe: the tiny-engine helpers of tests/engine and the fake engine of tests/server on sys.path."""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(__file__)
for folder in ("engine", "server"):
    path = os.path.join(HERE, os.pardir, folder)
    if path not in sys.path:
        sys.path.insert(0, path)

torch.set_num_threads(1)  # as tests/engine: one intra-op thread on the shared 2-core machine
