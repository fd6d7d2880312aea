"""Build one step's model inputs from a SchedulerOutput: flat token ids, AttentionMetadata, logits indices.

Flat layout for B chunks with query lengths q_0..q_{B-1} (T = sum q_i tokens):

    tokens:           | req0: q_0 tokens | req1: q_1 tokens | ... |
    query_start_loc:  0                  q_0                q_0+q_1 ... T          [B+1]
    positions[t]    = chunk.start_position + (t - query_start_loc[i])              [T]
    slot_mapping[t] = block_ids[pos // block_size] * block_size + pos % block_size [T]

Logits are computed only at `logits_indices` (flat token indices), one entry per logit, grouped by chunk in
batch order. For chunk i with P = prompt_logprob_positions: the first P fed positions (each predicts the
next prompt token), then the chunk's last position if `sample`. `num_logits_per_req[i] = P + sample`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.core.outputs import ScheduledChunk
from ladle.layers.attention.metadata import AttentionMetadata


@dataclass
class LogitsLayout:
    """Where each chunk's logits sit in the [num_logits, V] logits tensor.

    logits_indices [num_logits] int64 (flat token index of each logit); num_logits_per_req[i] for chunk i;
    sample_rows: row of each sampling chunk's logit (chunk order, sample=True chunks only);
    prompt_rows: chunk index -> (first row, count) for chunks with prompt-logprob positions.
    """

    logits_indices: torch.Tensor
    num_logits_per_req: list[int]
    sample_rows: list[int]
    prompt_rows: dict[int, tuple[int, int]]


@dataclass
class BatchInputs:
    """Everything `model.forward` needs for one step, plus where to read logits."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 (same tensor as attn_metadata.positions)
    attn_metadata: AttentionMetadata
    logits: LogitsLayout


def build_logits_layout(chunks: list[ScheduledChunk], query_start_loc: list[int],
                        device: torch.device) -> LogitsLayout:
    """See the module docstring. Asserts P <= q (a chunk cannot predict more prompt tokens than it feeds)."""
    indices: list[int] = []
    per_req: list[int] = []
    sample_rows: list[int] = []
    prompt_rows: dict[int, tuple[int, int]] = {}
    for i, chunk in enumerate(chunks):
        start, q = query_start_loc[i], len(chunk.token_ids)
        p = chunk.prompt_logprob_positions
        assert 0 <= p <= q, f"{chunk.request_id}: prompt_logprob_positions {p} > fed tokens {q}"
        if p:
            prompt_rows[i] = (len(indices), p)
            indices.extend(range(start, start + p))
        if chunk.sample:
            sample_rows.append(len(indices))
            indices.append(start + q - 1)
        per_req.append(p + int(chunk.sample))
    return LogitsLayout(
        logits_indices=torch.tensor(indices, dtype=torch.int64).to(device, non_blocking=True),
        num_logits_per_req=per_req,
        sample_rows=sample_rows,
        prompt_rows=prompt_rows,
    )


def build_batch_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> BatchInputs:
    """Flatten the chunks of one step (host lists -> one host->device copy per tensor).

    Raises AssertionError when a chunk's block table is too short for its positions (scheduler bug).
    """
    assert chunks, "build_batch_inputs needs at least one chunk"
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    context_lens: list[int] = []
    max_blocks = max(len(c.block_ids) for c in chunks)
    table: list[list[int]] = []
    for chunk in chunks:
        q = len(chunk.token_ids)
        assert q >= 1, f"{chunk.request_id}: empty chunk"
        start = chunk.start_position
        end = start + q
        assert (end + block_size - 1) // block_size <= len(chunk.block_ids), (
            f"{chunk.request_id}: {len(chunk.block_ids)} blocks cannot hold {end} tokens")
        input_ids.extend(chunk.token_ids)
        positions.extend(range(start, end))
        ids = chunk.block_ids
        slots.extend(ids[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(query_start_loc[-1] + q)
        seq_lens.append(end)
        context_lens.append(start)
        table.append(list(ids) + [0] * (max_blocks - len(ids)))

    def dev(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    positions_t = dev(positions, torch.int64)
    metadata = AttentionMetadata(
        query_start_loc=dev(query_start_loc, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        context_lens=dev(context_lens, torch.int32),
        block_table=dev(table, torch.int32),
        slot_mapping=dev(slots, torch.int64),
        positions=positions_t,
        block_size=block_size,
        max_query_len=max(len(c.token_ids) for c in chunks),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=context_lens,
        num_actual_tokens=len(input_ids),
    )
    return BatchInputs(
        input_ids=dev(input_ids, torch.int64),
        positions=positions_t,
        attn_metadata=metadata,
        logits=build_logits_layout(chunks, query_start_loc, device),
    )
