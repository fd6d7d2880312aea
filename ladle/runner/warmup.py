"""Kernel warm-up at startup: compile, before the engine serves, the Triton kernel variants that served steps use.

Triton compiles a kernel once per constexpr configuration (ladle picks tiles from local-shape buckets) and once per
specialisation of its integer arguments (a value equal to 1, or divisible by 16, gets its own binary), at the first
launch that needs it. The memory-profile step (one shape) and the decode CUDA-graph capture (decode shapes only)
leave most prefill and mixed-step variants uncompiled, so without this the first served steps pay for the compiles.
Measured on the H200 (benchmarks/results/round8/README.md, call 1): the FP8 60-layer M3 proxy served issue 11's
c = 32 line in 78.3 s on a cold Triton cache and in 60.4 s when the same server ran it again; a single 8,922-token
prefill took 12.1 s cold against 0.37 s warm.

What runs: for every token bucket (powers of two up to max_num_batched_tokens, and that value itself) seven steps
through the model's forward, logits and the sampler (greedy and random draws):
  - five mixed steps, the shape of a chunked-prefill step: decode rows over a cached context, a prefill chunk over
    that context, fresh prefill chunks. Four with a context of max_model_len (served decode rows have long contexts:
    the block-table width, and the indexer's NB_P2 from it, is the longest row's) pairing T and T - 5 (or T - 3)
    tokens with 16 and 9 requests, all four ways (the MSA kernels take both counts as integers, each specialised on
    divisibility by 16), and 3T/5 tokens with 7 requests over a short context (moe_align's chunk width is the power of
    two of T x (top-k + 1), which changes inside a token bucket);
  - two single-request prefills of min(T, max_model_len) and 3 tokens fewer (one request: the `== 1` specialisation).
What stays uncovered compiles at its first step as before: e.g. a step whose longest row is shorter than the
warm-up's (a smaller NB_P2). Two kernel-side rules keep the variant count small: the request-lookup width has one
value up to 255 requests (ladle/kernels/_common.py `reqs_p2`) and block tables are 16-column aligned
(ladle/runner/input_batch.py `table_width`).
The steps use the real KV pool's blocks (ids from 1: the pool is empty at startup) and zero those blocks afterwards,
so the pool is as allocated (all zeros) when serving starts; the runner's request state, block table and sampler
are not touched (the draws use a sampler of their own). The token ids are a fixed pseudo-random sequence so the
router spreads tokens over experts as real text does. Launches are counted in the dispatch record, as the CUDA-graph
capture's are. Cost on the FP8 60-layer proxy with a fresh Triton cache: 87.2 s (benchmarks/results/round9, call
1), nearly all of it compiling what the first requests would compile otherwise, and no kernel compiled while the
c = 32 and c = 128 lines were served (197 cubins after startup and after both; round 8's warm-up without the two
one-sided (T, B) pairs: 69.5 s, and 4 kernels still compiled while serving). Triton's cache on disk makes a restart
cheap.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from ladle.core.outputs import ScheduledChunk
from ladle.core.sampling_params import SamplingParams
from ladle.runner.input_batch import build_batch_inputs
from ladle.runner.request_state import RequestState, build_sampling_tensors
from ladle.runner.sampler import Sampler

if TYPE_CHECKING:
    from ladle.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

Step = list[tuple[int, int]]  # chunks of one step: (start_position, num_tokens)


def token_buckets(max_num_tokens: int) -> list[int]:
    """Powers of two from 2 up to max_num_tokens, and max_num_tokens itself (ascending, distinct)."""
    out, p = [], 2
    while p < max_num_tokens:
        out.append(p)
        p *= 2
    return out + [max_num_tokens]


def _mixed_step(num_tokens: int, num_reqs: int, context: int, max_num_seqs: int, max_model_len: int) -> Step:
    """A chunked-prefill step of exactly `num_tokens` tokens and, where it can, `num_reqs` requests: decode rows over a
    cached context of `context` tokens, one prefill chunk over the same context, fresh prefill chunks of
    <= max_model_len; [] when the request cap or max_model_len cannot make that many tokens."""
    context = max(1, min(context, max_model_len - 2))
    fresh = -(-max(0, num_tokens - (max_model_len - context)) // max_model_len)  # chunks from 0 beyond the context one
    decodes = max(0, min(num_reqs - 1 - fresh, num_tokens - 2, max_num_seqs - 1 - fresh))
    chunks: Step = [(context, 1)] * decodes
    left = num_tokens - decodes
    q = min(left, max_model_len - context)
    chunks.append((context, q))
    left -= q
    while left > 0 and len(chunks) < max_num_seqs:
        q = min(left, max_model_len)
        chunks.append((0, q))
        left -= q
    return chunks if left == 0 else []


def warmup_step_shapes(max_num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> list[Step]:
    """The warm-up steps (module docstring), each a list of (start_position, num_tokens) chunks; every step has at
    most max_num_tokens tokens and max_num_seqs chunks, and no chunk ends past max_model_len."""
    long_context, short_context = max_model_len - 2, block_size + 3
    steps: list[Step] = []
    for t in token_buckets(max_num_tokens):
        # the MSA kernels take T and B as integers: each of the four (T % 16 == 0, B % 16 == 0) pairs is a binary
        mixed = ((t, 16, long_context),  # both divisible by 16
                 (t - 5, 9, long_context),  # neither
                 (t, 9, long_context),  # T only (a full 32K-token step of 29 requests, say)
                 (t - 3, 16, long_context),  # B only
                 (-(-3 * t // 5), 7, short_context))  # T * (top-k + shared) in the power of two below t's
        for tokens, reqs, context in mixed:
            if tokens >= 2:
                steps.append(_mixed_step(tokens, reqs, context, max_num_seqs, max_model_len))
        single = min(t, max_model_len)
        steps += [[(0, single)], [(0, single - 3)] if single > 3 else []]
    seen, out = set(), []
    for s in steps:
        key = tuple(s)
        if s and key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _blocks(step: Step, block_size: int) -> int:
    return sum(-(-(start + q) // block_size) for start, q in step)


def step_chunks(step: Step, block_size: int, token_ids: Optional[list[int]] = None,
                prefix: str = "warmup") -> list[ScheduledChunk]:
    """ScheduledChunks of a synthetic step (warm-up, the runner's memory-profile step): each chunk samples, its
    blocks numbered consecutively from 1 (block 0 is the null block), its tokens `token_ids[:q]` (zeros if None)."""
    chunks, next_block = [], 1
    for i, (start, q) in enumerate(step):
        nb = -(-(start + q) // block_size)
        ids = token_ids[:q] if token_ids is not None else [0] * q
        chunks.append(ScheduledChunk(f"{prefix}-{i}", ids, start, list(range(next_block, next_block + nb)), True))
        next_block += nb
    return chunks


@torch.inference_mode()
def warm_up_kernels(runner: "ModelRunner") -> tuple[int, float]:
    """Run the warm-up steps on `runner` (module docstring). Returns (steps run, seconds). Steps whose blocks do not
    fit the pool are skipped (a tiny pool); the used blocks are zeroed at the end."""
    from ladle.layers.vocab_parallel_embedding import VocabParallelEmbedding

    t0 = time.perf_counter()
    bs = runner.block_size
    sched = runner.scheduler_config
    shapes = warmup_step_shapes(sched.max_num_batched_tokens, sched.max_num_seqs, runner.max_model_len, bs)
    free_blocks = runner.num_blocks - 1  # block 0 is the null block
    vocab = next(m.num_embeddings for m in runner.model.modules() if isinstance(m, VocabParallelEmbedding))
    ids = np.random.default_rng(0).integers(0, vocab, size=max(q for s in shapes for _, q in s)).tolist()
    sampler = Sampler(runner.device, seed=0)
    draws = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0))
    used, ran = 0, 0
    for step in shapes:
        need = _blocks(step, bs)
        if need > free_blocks:
            continue
        chunks = step_chunks(step, bs, ids)
        used = max(used, need)
        batch = build_batch_inputs(chunks, bs, runner.device)
        hidden = runner._forward(batch, runner.kv_caches)
        logits = runner.model.compute_logits(hidden[batch.logits.logits_indices])
        positions = [start + q for start, q in step]
        for params in draws:
            states = [RequestState(f"warmup-{i}", [0], [], params) for i in range(len(step))]
            sampler.sample(logits, build_sampling_tensors(states, positions, logits.shape[1], runner.device))
        ran += 1
    for cache in runner.kv_caches:
        for t in (cache.key_cache, cache.value_cache, cache.index_key_cache):
            if t is not None:
                t[1:used + 1].zero_()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return ran, time.perf_counter() - t0
