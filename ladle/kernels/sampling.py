"""The sampling op: temperature, min-p, top-k, top-p and the seeded draw, batched, with no host sync and no
per-request Python loop. The one home of this math: the engine's `ladle.runner.sampler.Sampler` applies penalties and
banned ids, then calls `sample` here; the GPU suite times that same path.

Order (ARCHITECTURE.md "Sampling and logprobs"; penalties are the caller's): temperature -> min_p -> top_k -> top_p.
  probs  = softmax(logits / T)                                  (rows with T == 0 are greedy: argmax of logits)
  min_p  : drop p < min_p * max(p)
  top_k  : keep the k most likely; **top_k == 0 means off** (the one encoding, shared with SamplingParams and
           SamplingTensors: 0 is the zero of a count, needs no vocabulary size, and a zero-filled row is "off";
           the comparison is k > 0, so nothing below 1 ever filters)
  top_p  : keep the smallest prefix of the sorted survivors whose mass reaches top_p of their total
           (the most likely token always survives)
  draw   : token = argmax_v p_v / E_v with E_v = -log(u_v) — the "exponential race" / Gumbel-max trick, an exact
           sample from p normalised (Efraimidis & Spirakis 2006); no renormalisation or cumsum search needed.
u_v is counter-based: a 32-bit integer hash of (seed, step, v), so a request with seed s samples the same tokens on
any batch composition, on CPU and GPU alike (the Triton kernel and its torch reference `race_ref` compute the
identical hash). The hash is Chris Wellons' "lowbias32" mixer (public domain, github.com/skeeto/hash-prospector).

Callers pass `seeds` [B] int64 (a fixed per-request seed: the user's seed + choice index, or a random one drawn on
the host at admission for unseeded requests) and `steps` [B] int64 (the engine passes the absolute position of the
token being sampled), so every draw has a distinct counter. The flags `use_*` are host-side facts the caller
already knows from the requests' SamplingParams; they skip whole passes (a full-vocabulary sort when no request
asks for top-k/top-p). `use_triton` is the backend asked for; the eligibility rule of op "sample_race" decides.
"""

from __future__ import annotations

import torch

from ladle.kernels._common import decide_triton, tl, triton, triton_ok  # the guarded import (no Triton: references)
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

dispatch.register("sample_race", "triton", "cuda (or interpreter); probs [B, V] float32 contiguous")

_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers
_SEED_SALT = 0x9E3779B9


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _race_kernel(probs_ptr, seeds_ptr, steps_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    step = tl.load(steps_ptr + row)
    s_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    s_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(s_lo ^ _mix32(s_hi ^ 0x9E3779B9))
    key = _mix32(key ^ (step & 0xFFFFFFFF).to(tl.uint32))
    best_val = tl.full([BLOCK], -1.0, dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        mask = offs < V
        p = tl.load(probs_ptr + row.to(tl.int64) * stride + offs, mask=mask, other=0.0)
        h = _mix32(_mix32(key + offs.to(tl.uint32)))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(mask, p / (-tl.log(u)), -1.0)
        better = score > best_val
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, offs, best_idx)
    top = tl.max(best_val, 0)
    cand = tl.where(best_val == top, best_idx, 2147483647)
    tl.store(out_ptr + row, tl.min(cand, 0).to(tl.int64))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def race_uniforms_ref(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u [B, V] float32 in (0, 1): the counter-based uniforms the race uses (torch twin of the Triton hash)."""
    s_lo = seeds & 0xFFFFFFFF
    s_hi = (seeds >> 32) & 0xFFFFFFFF
    key = _mix32_t(s_lo ^ _mix32_t(s_hi ^ _SEED_SALT))
    key = _mix32_t(key ^ (steps & 0xFFFFFFFF))
    offs = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32_t(_mix32_t((key[:, None] + offs[None, :]) & 0xFFFFFFFF))
    return ((h >> 8).float() + 0.5) * (1.0 / 16777216.0)


def race_ref(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """argmax_v probs / -log(u) (first index on ties) -> [B] int64."""
    u = race_uniforms_ref(seeds, steps, probs.shape[1])
    return (probs / -torch.log(u)).argmax(dim=-1)


@timed_op
def race(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *, use_triton: bool = True) -> torch.Tensor:
    """Draw one token per row from unnormalised probs [B, V] float32 (zeros are never drawn unless a row is all
    zero). seeds, steps [B] int64. Returns [B] int64. The Triton kernel when asked for (`use_triton`) and eligible
    (op "sample_race"), else `race_ref`; both draw the same token from the same (probs, seed, step)."""
    assert probs.dim() == 2 and probs.dtype == torch.float32 and probs.stride(1) == 1
    assert seeds.shape == steps.shape == (probs.shape[0],) and seeds.dtype == steps.dtype == torch.int64
    reason = triton_ok(probs, seeds, steps)
    if not decide_triton("sample_race", probs.shape[0], use_triton, reason):
        return race_ref(probs, seeds, steps)
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    if probs.shape[0] > 0:
        block = min(4096, triton.next_power_of_2(probs.shape[1]))
        _race_kernel[(probs.shape[0],)](probs, seeds, steps, out, probs.shape[1], probs.stride(0), BLOCK=block,
                                        num_warps=8)
    return out


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, *, use_top_k: bool = True, use_top_p: bool = True,
                   use_min_p: bool = True) -> torch.Tensor:
    """softmax(logits / T) with min-p, top-k, top-p applied (dropped entries are 0; not renormalised).

    logits [B, V] float32; temperature/top_p/min_p [B] float32; top_k [B] int32/int64 (0: off). Rows with T == 0
    are computed with T = 1 (the caller takes argmax for them). Returns [B, V] float32.

    Tokens of equal probability are kept or dropped together (top-k keeps every token >= the k-th largest; top-p
    keeps a token when the mass of strictly more likely tokens is below top_p of the total), so the kept set is a
    function of the values alone, never of the sort's tie order: a seeded row draws the same token whatever the
    batch, device or sort algorithm (bf16 logits tie often).
    """
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if use_min_p:
        probs = probs * (probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True))
    if not (use_top_k or use_top_p):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    if use_top_k:
        k = torch.where(top_k > 0, top_k.to(torch.int64).clamp(max=vocab), vocab)
        kth = sorted_p.gather(1, (k - 1)[:, None])  # [B, 1] the k-th largest probability
        sorted_p = sorted_p * (sorted_p >= kth)
    if use_top_p:
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass before each entry in sort order
        idx = torch.arange(vocab, device=logits.device)
        first = torch.where(sorted_p[:, 1:] != sorted_p[:, :-1], idx[1:], 0)  # where each tie group starts
        first = torch.cat([torch.zeros_like(first[:, :1]), first], dim=1).cummax(dim=-1).values
        before = before.gather(1, first)  # mass strictly more likely than each entry
        sorted_p = sorted_p * (before < top_p[:, None] * sorted_p.sum(dim=-1, keepdim=True))
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    *,
    all_greedy: bool = False,
    use_top_k: bool = True,
    use_top_p: bool = True,
    use_min_p: bool = True,
    use_triton: bool = True,
) -> torch.Tensor:
    """Sample one token per row. logits [B, V] float32 (after penalties); temperature, top_p, min_p [B] float32;
    top_k [B] int32/int64 (0 off); seeds, steps [B] int64. Returns token ids [B] int64 on logits' device.
    Greedy rows (temperature == 0) return argmax(logits). No host sync; the `use_*`/`all_greedy` flags are
    host-side knowledge that lets whole passes be skipped; `use_triton` is passed to `race`."""
    assert logits.dim() == 2 and logits.dtype == torch.float32
    greedy = logits.argmax(dim=-1)
    if all_greedy:
        return greedy
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p, use_top_k=use_top_k, use_top_p=use_top_p,
                           use_min_p=use_min_p)
    drawn = race(probs.contiguous(), seeds, steps, use_triton=use_triton)
    return torch.where(temperature > 0, drawn, greedy)
