"""Build one step's model inputs from its scheduled chunks (`SchedulerOutput.chunks`, a list of ScheduledChunk): flat
token ids, the AttentionMetadata that the runner wraps in the step's ForwardContext, logits indices.

Flat layout for B chunks with query lengths q_0..q_{B-1} (T = sum q_i tokens):

    tokens:           | req0: q_0 tokens | req1: q_1 tokens | ... |
    query_start_loc:  0                  q_0                q_0+q_1 ... T          [B+1]
    positions[t]    = chunk.start_position + (t - query_start_loc[i])              [T]
    slot_mapping[t] = block_ids[pos // block_size] * block_size + pos % block_size [T]

Logits are computed only at `logits_indices` (flat token indices), one entry per logit, grouped by chunk in
batch order. For chunk i with P = prompt_logprob_positions: the first P fed positions (each predicts the
next prompt token), then the chunk's last position if `sample`. `num_logits_per_req[i] = P + sample`.

Host work is numpy over whole arrays (no per-token Python), and the step's integer tensors travel in two
host->device copies: one int64 pack (input_ids | positions | slot_mapping | logits_indices | sample
positions | placeholder rows) and one int32 pack (query_start_loc | seq_lens | context_lens | block_table); the
tensors in BatchInputs are contiguous views of those two device buffers, each segment starting 16-byte aligned.
On CUDA both copies start from pinned memory without blocking (`to_device`), so the host can build a step while the
previous one still runs (asynchronous scheduling).

Placeholders (asynchronous scheduling): a decode chunk whose token is still being sampled by the step in flight
feeds PLACEHOLDER_TOKEN_ID; `placeholders` gives (chunk indices, rows of that step's sampled-id tensor) of such chunks,
and BatchInputs carries them as `placeholder_dst` (flat token index) / `placeholder_src` (sampled row) for the
runner to fill `input_ids` on the device before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Optional, Sequence

import numpy as np
import torch

from ladle.core.outputs import ScheduledChunk
from ladle.layers.attention.metadata import AttentionMetadata


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device` without making the host wait for queued device work: on CUDA through pinned
    memory and a non-blocking copy (a copy from pageable memory may first wait for the stream to drain, CUDA runtime
    API docs, "API synchronization behavior"; PyTorch's caching host allocator keeps the pinned buffer until the
    copy is done); elsewhere `host.to(device)`."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class LogitsLayout:
    """Where each chunk's logits sit in the [num_logits, V] logits tensor.

    logits_indices [num_logits] int64 (flat token index of each logit); num_logits_per_req[i] for chunk i;
    sample_rows: row of each sampling chunk's logit (chunk order, sample=True chunks only);
    prompt_rows: chunk index -> (first row, count) for chunks with prompt-logprob positions (empty: then
    the rows are exactly the sampling chunks', in order, and sample_rows == range(num_logits));
    sample_positions [len(sample_rows)] int64: absolute position of the token each sampling chunk samples
    (= its seq_len), on the device (the sampler's counter-based draw reads it);
    every_token: logits_indices == arange(T) (e.g. a decode step sampling every request): logits can be
    computed from the hidden states without a gather.
    """

    logits_indices: torch.Tensor
    num_logits_per_req: list[int]
    sample_rows: list[int]
    prompt_rows: dict[int, tuple[int, int]]
    sample_positions: Optional[torch.Tensor] = None
    every_token: bool = False

    @property
    def num_logits(self) -> int:
        return int(self.logits_indices.shape[0])


@dataclass
class BatchInputs:
    """Everything `model.forward` needs for one step, plus where to read logits."""

    input_ids: torch.Tensor  # [T] int64 (PLACEHOLDER_TOKEN_ID at placeholder_dst until the runner fills them)
    positions: torch.Tensor  # [T] int64 (same tensor as attn_metadata.positions)
    attn_metadata: AttentionMetadata
    logits: LogitsLayout
    placeholder_dst: Optional[torch.Tensor] = None  # [P] int64 flat token indices of the placeholders, or None
    placeholder_src: Optional[torch.Tensor] = None  # [P] int64 their rows in the in-flight step's sampled ids


def _logits_rows(q: np.ndarray, qsl: np.ndarray, sample: np.ndarray, p: np.ndarray):
    """Steps with prompt logprobs: (logits_indices [L] int64 numpy, num_logits_per_req, sample_rows, prompt_rows);
    see the module docstring. Asserts P <= q (a chunk cannot predict more prompt tokens than it feeds)."""
    assert (p <= q).all() and (p >= 0).all(), f"prompt_logprob_positions {p.tolist()} > fed tokens {q.tolist()}"
    per_req = p + sample
    first = np.zeros(len(q) + 1, np.int64)
    np.cumsum(per_req, out=first[1:])
    owner = np.repeat(np.arange(len(q)), per_req)
    k = np.arange(int(first[-1])) - first[owner]  # rank of each logit within its chunk
    # logit k < P of chunk i sits at token start_i + k; the sample logit (k == P) at start_i + q_i - 1
    indices = qsl[owner] + np.where(k < p[owner], k, q[owner] - 1)
    sample_rows = (first[1:] - 1)[sample.astype(bool)].tolist()
    prompt_rows = {int(i): (int(first[i]), int(p[i])) for i in np.flatnonzero(p)}
    return indices, per_req.tolist(), sample_rows, prompt_rows


# Block-table widths are multiples of this: the width reaches the kernels as an integer argument and a stride, which
# Triton specialises by divisibility by 16, so an exact width would compile two binaries of each kernel and the
# second at a served step (ladle/runner/warmup.py). Padding columns hold the null block 0, as short rows always did.
TABLE_WIDTH_ALIGN = 16


def table_width(num_blocks: int) -> int:
    """Block-table columns for a longest row of `num_blocks` blocks: rounded up to TABLE_WIDTH_ALIGN (>= it)."""
    return max(1, -(-num_blocks // TABLE_WIDTH_ALIGN)) * TABLE_WIDTH_ALIGN


def _table_from_chunks(chunks: list[ScheduledChunk], width: int) -> np.ndarray:
    """[B, width] int32 block table padded with the null block 0."""
    table = np.zeros((len(chunks), width), np.int32)
    for i, c in enumerate(chunks):
        table[i, :len(c.block_ids)] = c.block_ids
    return table


def _pack(arrays: list, dtype, device: torch.device) -> list[torch.Tensor]:
    """Lay 1-D arrays or lists out in one host buffer (each segment padded to 16 bytes, so every view starts
    aligned), copy it to `device` once and return a view per segment."""
    align = 16 // np.dtype(dtype).itemsize
    sizes = [len(a) for a in arrays]
    padded = [-(-n // align) * align for n in sizes]
    host = np.zeros(sum(padded), dtype)
    o = 0
    for a, n, m in zip(arrays, sizes, padded):
        host[o:o + n] = a
        o += m
    views = to_device(torch.from_numpy(host), device).split_with_sizes(padded)  # (Tensor.split wraps it in Python)
    return [v if m == n else v[:n] for v, n, m in zip(views, sizes, padded)]


def build_batch_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device,
                       block_table: Optional[np.ndarray] = None,
                       placeholders: Optional[tuple[Sequence[int], Sequence[int]]] = None) -> BatchInputs:
    """Flatten the chunks of one step (two host->device copies; per-token work in numpy, per-chunk scalars in
    plain Python, which is cheaper than numpy calls for the few hundred values of a decode step).

    block_table: the step's [B, >= max blocks] int32 table when the caller keeps one (ModelRunner updates
    its rows incrementally); built from `chunk.block_ids` when None. placeholders: (chunk indices, sampled rows)
    of the placeholder chunks (module docstring). Raises AssertionError when a chunk's block table is too short for
    its positions (scheduler bug) or a chunk is empty.
    """
    assert chunks, "build_batch_inputs needs at least one chunk"
    num_reqs = len(chunks)
    q = [len(c.token_ids) for c in chunks]  # [B]
    starts = [c.start_position for c in chunks]  # [B] context lens
    seq_lens = [s + n for s, n in zip(starts, q)]  # [B]
    width = table_width(max(len(c.block_ids) for c in chunks))
    assert min(q) >= 1, "empty chunk"
    assert all((e + block_size - 1) // block_size <= len(c.block_ids) for e, c in zip(seq_lens, chunks)), (
        f"block tables too short: {[len(c.block_ids) for c in chunks]} blocks for {seq_lens} tokens")
    qsl = [0, *accumulate(q)]  # [B+1]
    num_tokens, max_query_len = qsl[-1], max(q)
    sample_idx = [i for i, c in enumerate(chunks) if c.sample]
    has_prompt_logprobs = any(c.prompt_logprob_positions for c in chunks)
    if block_table is None:
        block_table = _table_from_chunks(chunks, width)
    if block_table.shape[1] < width:  # a caller's table of the exact width: pad to the aligned one
        block_table = np.pad(block_table, ((0, 0), (0, width - block_table.shape[1])))
    table = np.ascontiguousarray(block_table[:, :width], dtype=np.int32)  # [B, width]
    if max_query_len == 1:  # decode: one token per request, position = context length
        input_ids, positions = [c.token_ids[0] for c in chunks], starts
        slots = [c.block_ids[p // block_size] * block_size + p % block_size for c, p in zip(chunks, starts)]
    else:
        input_ids = np.fromiter(chain.from_iterable(c.token_ids for c in chunks), np.int64, num_tokens)
        owner = np.repeat(np.arange(num_reqs), q)  # [T] chunk of each token
        positions = np.arange(num_tokens) - np.asarray(qsl)[owner] + np.asarray(starts)[owner]
        slots = table[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    if not has_prompt_logprobs:  # the usual step: one logit per sampling chunk, at its last fed token
        indices = [qsl[i + 1] - 1 for i in sample_idx]
        per_req, sample_rows, prompt_rows = [int(c.sample) for c in chunks], list(range(len(indices))), {}
        every_token = max_query_len == 1 and len(sample_idx) == num_reqs
    else:
        sample_mask = np.zeros(num_reqs, np.int64)
        sample_mask[sample_idx] = 1
        indices, per_req, sample_rows, prompt_rows = _logits_rows(
            np.asarray(q), np.asarray(qsl), sample_mask,
            np.array([c.prompt_logprob_positions for c in chunks], np.int64))
        every_token = len(indices) == num_tokens and bool((indices == np.arange(num_tokens)).all())
    sample_positions = [seq_lens[i] for i in sample_idx]
    int64_arrays = [input_ids, positions, slots, indices, sample_positions]
    if placeholders:
        chunk_idx, rows = placeholders
        int64_arrays += [chunk_idx if num_tokens == num_reqs else [qsl[i] for i in chunk_idx], rows]
    ids_t, pos_t, slots_t, idx_t, spos_t, *fill_t = _pack(int64_arrays, np.int64, device)
    qsl_t, seq_t, ctx_t, table_t = _pack([qsl, seq_lens, starts, table.reshape(-1)], np.int32, device)
    metadata = AttentionMetadata(
        query_start_loc=qsl_t,
        seq_lens=seq_t,
        context_lens=ctx_t,
        block_table=table_t.view(num_reqs, width),
        slot_mapping=slots_t,
        positions=pos_t,
        block_size=block_size,
        max_query_len=max_query_len,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=starts,
        num_actual_tokens=num_tokens,
    )
    return BatchInputs(input_ids=ids_t, positions=pos_t, attn_metadata=metadata,
                       logits=LogitsLayout(idx_t, per_req, sample_rows, prompt_rows, spos_t, every_token),
                       placeholder_dst=fill_t[0] if fill_t else None, placeholder_src=fill_t[1] if fill_t else None)
