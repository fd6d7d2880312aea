"""Persistent zeroed int32 arrival counters for "last program finishes the job" split kernels.

A split kernel (split-K attention, split-over-blocks indexer) normally needs a second launch to combine the per-split
partials. Instead, each of the NUM_SPLITS programs of one work item (a (token, kv-head) pair, a query tile, ...)
writes its partial, then does `old = tl.atomic_add(counter + item, 1, sem="acq_rel")`; the one program that sees
`old == NUM_SPLITS - 1` arrived last, reads every partial, writes the final result and stores 0 back into its
counter. See `arrive` below (the device side) and the kernels in msa_sparse_attention.py / msa_indexer.py;
moe_align.py also keeps per-expert counts in its buffer (accumulated by one launch, zeroed by the last program to
arrive in the next one of the same call, or by its single program), under the same reset invariant.

Buffer contract (the reset invariant):
  * one int32 buffer per (device, owner key), allocated with torch.zeros on first use and kept for the life of the
    process; it only ever grows, and a grown-out buffer is kept alive too (a captured CUDA graph may still hold its
    address);
  * between launches every entry is 0: each launch increments an entry exactly NUM_SPLITS times and its last
    program stores 0 back, so the next launch (or CUDA-graph replay) starts from zero without any host-side
    memset - the buffer is never re-zeroed by a host op after its allocation;
  * consequently launches that use the same owner key must not run concurrently (one stream per device, as in
    the runner), and a launch must not be aborted half way (a trap leaves counters non-zero; call `reset_all`).
Growing allocates (torch.zeros), so it must happen in an eager call: the runner's CUDA-graph warm-up calls run
every bucket eagerly before capture; growing during capture raises RuntimeError.
"""

from __future__ import annotations

import torch

from ladle.kernels._common import tl, triton

MIN_ENTRIES = 4096  # 16 KiB: decode shapes never grow past the first allocation
_BUFFERS: dict[tuple[str, str], torch.Tensor] = {}  # (owner key, str(device)) -> [n] int32, all zero at rest
_RETIRED: list[torch.Tensor] = []  # outgrown buffers, kept alive for graphs captured with their address


def split_counters(key: str, device: torch.device, num_entries: int) -> torch.Tensor:
    """The zero-at-rest int32 counter buffer of `key` on `device`, with at least `num_entries` entries (its first
    `num_entries` are what a launch may touch). Raises RuntimeError if it must grow while a CUDA graph is being
    captured (warm up eagerly at the largest shape first)."""
    device = torch.device(device)
    name = (key, str(device))
    buf = _BUFFERS.get(name)
    if buf is None or buf.numel() < num_entries:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split counters '{key}' must grow to {num_entries} during CUDA-graph capture; "
                               "run the same shape eagerly once before capturing")
        if buf is not None:
            _RETIRED.append(buf)
        size = max(MIN_ENTRIES, triton.next_power_of_2(num_entries))
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        _BUFFERS[name] = buf
    return buf


def reset_all() -> None:
    """Zero every live buffer (host memsets; only for recovery after an aborted launch, never inside a graph)."""
    for buf in _BUFFERS.values():
        buf.zero_()


@triton.jit
def arrive(counter_ptr, NUM_SPLITS):
    """Count this program's arrival at `counter_ptr` (scalar int32 pointer); True in the program that arrived last.
    NUM_SPLITS: the number of programs that arrive at this counter (a constexpr, or a runtime int32 such as
    `tl.num_programs(0)` where it depends on the shape).

    Call after this program's partial stores. Ordering (PTX memory model): the CTA barrier makes every thread's
    stores happen before the (single-thread) atomic; the atomic's release half publishes them at GPU scope, so the
    last arriver's acquire half sees every other program's partials. The last arriver must then read partials with
    `cache_modifier=".cg"` (L2, never a stale L1 line) after `tl.debug_barrier()`, and call `release` when done."""
    tl.debug_barrier()
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return old == NUM_SPLITS - 1


@triton.jit
def release(counter_ptr):
    """Last arriver: put the counter back to 0 (every other program of this item has already incremented it, so
    nothing races with this store; the next launch on the stream sees 0)."""
    tl.store(counter_ptr, 0)
