"""Log-sum-exp merge of split-K attention partials (used by msa_sparse_attention.py when NUM_SPLITS > 1).

Partials of one (token t, query head h) over NUM_SPLITS splits of the key set, all fp32:
    pacc [T, Hq, NUM_SPLITS, D]   unnormalised sum_j p_j v_j of the split, p_j = 2^(s_j - m)
    pml  [T, Hq, NUM_SPLITS, 2]   (m, l): running max in log2 units (-inf for a split with no keys), sum_j p_j
Merge (standard split-softmax identity, e.g. FlashDecoding): M = max_s m_s (0 if all -inf), w_s = 2^(m_s - M),
    out = sum_s w_s acc_s / sum_s w_s l_s        (0 when the denominator is 0: no visible key at all)

Two device forms:
  * `_merge_kernel`, grid (T, Hq): the separate second launch (the "two-launch" path);
  * `merge_group`, a @triton.jit helper called by the last-arriving split program of a (token, kv-head) inside the
    attention kernel itself (the "fused" path; see ladle/kernels/split_counters.py for the arrival counter). It
    reads the partials with cache_modifier=".cg" (they were written by other SMs).
`merge_partials_ref` is the float64 torch reference of the identity.
"""

from __future__ import annotations

import torch

from ladle.kernels._common import tl, triton


@triton.jit
def _merge_kernel(pacc_ptr, pml_ptr, out_ptr, num_heads, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (t.to(tl.int64) * num_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(pml_ptr + base * 2)
    l = tl.load(pml_ptr + base * 2 + 1)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)  # splits with no keys have m = -inf -> weight 0
    denom = tl.sum(l * w, axis=0)
    acc = tl.load(pacc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :])
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def merge_group(pacc_ptr, pml_ptr, row_base, row_ok, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                BLOCK_G: tl.constexpr):
    """Merged output [BLOCK_G, HEAD_DIM] fp32 of the rows `row_base` ([BLOCK_G] int64 = (t * Hq + head) *
    NUM_SPLITS, i.e. the split-0 partial index of each row); rows with row_ok False come out 0. Loops over the
    splits (one [BLOCK_G, D] tile live at a time) instead of loading a [BLOCK_G, NUM_SPLITS, D] block."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(pml_ptr + (row_base + s) * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, m_s)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(pml_ptr + (row_base + s) * 2, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(pml_ptr + (row_base + s) * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
        w = tl.math.exp2(m_s - m_max)  # a split with no keys has m = -inf -> weight 0
        denom += l_s * w
        a = tl.load(pacc_ptr + (row_base + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0, cache_modifier=".cg")
        acc += a * w[:, None]
    return acc / tl.where(denom > 0, denom, 1.0)[:, None]


def merge_partials_ref(pacc: torch.Tensor, pml: torch.Tensor) -> torch.Tensor:
    """Float64 reference of the merge: pacc [T, Hq, S, D], pml [T, Hq, S, 2] (log2 max, sum) -> [T, Hq, D]."""
    pacc, pml = pacc.double(), pml.double()
    m, l = pml[..., 0], pml[..., 1]
    top = m.amax(dim=2, keepdim=True)
    top = torch.where(torch.isinf(top) & (top < 0), torch.zeros_like(top), top)
    w = torch.exp2(m - top)  # [T, Hq, S]
    denom = (l * w).sum(dim=2)
    num = (pacc * w[..., None]).sum(dim=2)
    return num / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
