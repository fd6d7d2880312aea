"""MSA (MiniMax sparse attention) block selection: the torch reference of the indexer's top-k.

Semantics (design/minimax_m3.md §3.5; transformers `MiniMaxM3VLIndexer.forward`, MOD:553-599):

  s_g(t, j) = iq[t, g] · ik[j]                 fp32, raw dot: no scale, no ReLU, no head weights
  S_g(t, b) = max_{j in block b, j <= p_t} s_g(t, j)      blocks of `block_size` keys anchored at position 0;
                                                       future blocks are invalid (-inf)
  S_g(t, b_t - l) = +inf for l < local_blocks   (clamped at 0; the query's own block b_t = p_t // block_size)
  Sel(t, g) = the min(topk, b_t + 1) best blocks    ties: lower block index wins (spec §3.5.9; transformers'
                                                       torch.topk orders ties arbitrarily, so tests compare sets
                                                       on tie-free inputs)

Output layout (ARCHITECTURE.md "MSA selection"): `selected_block_ids [num_kv_heads, num_tokens, topk] int32` of
*logical* block indices within the sequence; valid entries left-packed in ascending order, so the local block
b_t (the largest visible block) sits in the last valid slot; -1 after. Readers map ids through `block_table`.

    token t at p_t = 37, block 16, topk 4, visible blocks 0,1,2 (b_t = 2):  [0, 1, 2, -1]
    token t at p_t = 150, visible 0..9, best others {7, 2, 5}:              [2, 5, 7, 9]
"""

from __future__ import annotations

import torch


def msa_block_scores(index_q: torch.Tensor, index_k: torch.Tensor, q_positions: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """Block-pooled index scores for one sequence.

    index_q [Tq, ni, di] (post-norm, post-RoPE), index_k [S, di] keys of sequence positions 0..S-1,
    q_positions [Tq] int64 absolute positions (< S). Returns [ni, Tq, ceil(S / block_size)] float32, -inf where a
    block holds no visible key.
    """
    s = index_k.shape[0]
    scores = torch.einsum("tgd,sd->gts", index_q.float(), index_k.float())  # [ni, Tq, S]
    key_pos = torch.arange(s, device=index_k.device)
    future = key_pos[None, :] > q_positions[:, None]  # [Tq, S]
    scores = scores.masked_fill(future[None], float("-inf"))
    nb = -(-s // block_size)
    pad = nb * block_size - s
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    return scores.view(scores.shape[0], scores.shape[1], nb, block_size).amax(dim=-1)


def msa_select_blocks(block_scores: torch.Tensor, q_positions: torch.Tensor, block_size: int, topk: int,
                      local_blocks: int) -> torch.Tensor:
    """Top-k block selection in the documented layout.

    block_scores [ni, Tq, nb] float32 (from `msa_block_scores`), q_positions [Tq] int64.
    Returns selected_block_ids [ni, Tq, topk] int32 (left-packed ascending, local block last, -1 padding).
    """
    ni, tq, nb = block_scores.shape
    scores = block_scores.clone()
    q_block = q_positions // block_size  # [Tq]
    for l in range(local_blocks):
        forced = (q_block - l).clamp(min=0)[None, :, None].expand(ni, tq, 1)
        scores.scatter_(-1, forced, float("inf"))
    k = min(topk, nb)
    # Stable descending sort: among equal scores the lower block index comes first.
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :k], idx[..., :k]
    valid = vals > float("-inf")
    big = torch.iinfo(torch.int64).max
    packed = torch.sort(torch.where(valid, idx, torch.full_like(idx, big)), dim=-1).values
    packed = torch.where(packed == big, torch.full_like(packed, -1), packed)
    out = torch.full((ni, tq, topk), -1, dtype=torch.int32, device=block_scores.device)
    out[..., :k] = packed.to(torch.int32)
    return out


def selection_key_mask(selected_block_ids: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Expand selections to keys: [ni, Tq, topk] int32 -> [ni, Tq, seq_len] bool (True = key's block selected).

    Causality is not applied here (the caller ANDs it with j <= p_t).
    """
    ni, tq, _ = selected_block_ids.shape
    nb = -(-seq_len // block_size)
    ids = selected_block_ids.long()
    ids = torch.where(ids < 0, torch.full_like(ids, nb), ids)  # -1 -> a throwaway column
    keep = torch.zeros(ni, tq, nb + 1, dtype=torch.bool, device=ids.device)
    keep.scatter_(-1, ids, True)
    return keep[..., :nb].repeat_interleave(block_size, dim=-1)[..., :seq_len]
