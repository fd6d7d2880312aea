"""--async-scheduling on the GPU (marked gpu): the placeholders of step N+1 are filled on the device from step N's
sampled ids, also inside CUDA-graph replays, and the pinned-memory copy of the ids is waited on through a CUDA
event. Tiny MiniMax-M3 (dummy weights, float32, the Triton kernel path, CUDA graphs captured) generates greedily
with asynchronous and synchronous scheduling; the tokens must be identical. Every request ends by length (known
ahead), so both runs schedule the same batches and no batch-size-dependent rounding can differ; one request with a
repetition penalty makes some steps drain (run synchronously) in the async run."""

from __future__ import annotations

import gc

import pytest
import torch

from ladle.core.sampling_params import SamplingParams
from ladle.engine.llm import LLM
from ladle.observe import dispatch
from ladle.tools.checkpoint_m3 import make_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("m3") / "tiny"), "tiny", config_only=True)


def _generate(m3_dir: str, async_scheduling: bool, prompts, params, engine_core_process: bool = False):
    llm = LLM(m3_dir, load_format="dummy", device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=16,
              enable_prefix_caching=False, async_scheduling=async_scheduling, seed=3,
              engine_core_process=engine_core_process)
    if not engine_core_process:  # in-process: the core (and the dispatch record) are readable here
        assert llm.core.async_scheduling is async_scheduling and llm.core.runner.graphs is not None
    outs = llm.generate(prompts, params)
    llm.shutdown()
    del llm
    # an in-process engine's KV pool stays in this process's CUDA cache after it is freed; an engine-core process
    # started next counts it as memory outside its torch and finds no room for a KV cache (session 13, all GPU
    # tests in one run)
    gc.collect()
    torch.cuda.empty_cache()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_async_equals_sync_with_cuda_graphs(m3_dir):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (300, 17, 140, 5, 64, 9)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 25, 33, 48, 12, 30)]
    params[2] = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True, repetition_penalty=1.3)
    sync = _generate(m3_dir, False, prompts, params)
    dispatch.reset()
    overlapped = _generate(m3_dir, True, prompts, params)
    assert overlapped == sync
    buckets = dispatch.snapshot()["ops"]["async_scheduling"]["buckets"]
    executed = sum(b["executed"] for b in buckets.values())
    configured = sum(b["configured"] for b in buckets.values())
    assert 0 < executed < configured  # steps overlapped, and the penalty request made some drain


def test_core_process_equals_in_process_with_cuda_graphs(m3_dir):
    """LLM's default on CUDA (the core in its own process, ladle/engine/offline_core.py) against the in-process
    core: the same greedy tokens, both with asynchronous scheduling and CUDA graphs."""
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (200, 31, 7, 90)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 44, 17, 25)]
    assert _generate(m3_dir, True, prompts, params, engine_core_process=True) == _generate(m3_dir, True, prompts,
                                                                                            params)
