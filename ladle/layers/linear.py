"""Linear layers that know their tensor-parallel shard and their quantization method.

Tensor parallelism (Megatron-LM's split, Shoeybi et al. 2019, "Megatron-LM", §3): a column-parallel layer splits
the output features of W [out, in] over `tp_size` ranks (rank r holds rows [r*out/tp, (r+1)*out/tp) and computes
its slice of y; concatenating the rank outputs gives the full y); a row-parallel layer splits the input features
(rank r holds columns [r*in/tp, ...) and computes a partial sum; summing the rank outputs — an all-reduce — gives
the full y). Every layer allocates its per-rank shapes and its parameters' `weight_loader` slices rank r's part
out of the full checkpoint tensor; the one collective, `all_reduce_across_ranks`, goes through ladle/distributed.

Weight-loading protocol (ladle/models/weights.py drives it): every parameter carries
    param.weight_loader(param, loaded_weight, shard_id=None) -> int   (elements of `param` written)
where `loaded_weight` is the FULL checkpoint tensor (all ranks) and `shard_id` names the checkpoint piece of a
merged layer ("q"/"k"/"v"/extra heads for QKVParallelLinear, 0..n-1 for MergedColumnParallelLinear; None = the
whole tensor, for a merged layer the pieces already concatenated in shard order). Raises ValueError on an unknown
shard or a shape mismatch. `param.shard_dim` says which dim is split over ranks (None: replicated).
Under tensor parallelism `loaded_weight` is a lazy tensor-like view (ladle/models/checkpoint_slice.py): loaders
select their part with narrow / split / x[i] / x[a:b] (no I/O) before any other torch op, which reads it.

Quantization slot: each layer has `quant_method` (the constructor's, else the construction scope's — see
ladle/layers/quant_slot.py —, else an `UnquantizedLinearMethod`), whose `create_weights(layer, ...)` registers the
parameters and `apply(layer, x, bias)` runs the GEMM (FP8: ladle/quant/fp8.py).

Head-sharded outputs (QKVParallelLinear): n heads over tp ranks give n/tp heads per rank when n >= tp; when
tp > n (more ranks than KV heads) each head is held by tp/n ranks, rank r holding head r // (tp/n):

    4 KV heads, tp 8:  rank 0 1 | 2 3 | 4 5 | 6 7
                       head  0  |  1  |  2  |  3
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ladle.distributed.parallel_state import tensor_model_parallel_all_reduce
from ladle.layers.quant_slot import scoped_linear_method
from ladle.observe.op_timing import timed_gemm


def head_shard(num_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first head, heads per rank) of rank `tp_rank` for `num_heads` heads over `tp_size` ranks (module doc:
    split when num_heads >= tp_size, else replicated tp_size / num_heads times). Raises ValueError when neither
    count divides the other."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} not in [0, {tp_size})")
    if num_heads >= tp_size:
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} heads do not split evenly over tp_size {tp_size}")
        per_rank = num_heads // tp_size
        return tp_rank * per_rank, per_rank
    if tp_size % num_heads:
        raise ValueError(f"tp_size {tp_size} is not a multiple of {num_heads} replicated heads")
    return tp_rank // (tp_size // num_heads), 1


def all_reduce_across_ranks(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """THE tensor-parallel all-reduce (sum over ranks) of the layer kit: the identity at tp_size 1, else
    `ladle.distributed.tensor_model_parallel_all_reduce` (NCCL on CUDA, gloo on CPU) in the process's group.
    Raises RuntimeError when this process's group does not have `tp_size` ranks."""
    if tp_size == 1:
        return x
    return tensor_model_parallel_all_reduce(x, tp_size)


def set_weight_loader(param: nn.Parameter, loader, shard_dim: Optional[int]) -> nn.Parameter:
    """Attach the loading protocol's attributes: `param.weight_loader` and `param.shard_dim` (None: replicated)."""
    param.weight_loader = loader
    param.shard_dim = shard_dim
    return param


def check_shape(what: str, got: torch.Size, expected: Sequence[int]) -> None:
    """Raise ValueError (naming `what`) when a checkpoint tensor's shape is not `expected`."""
    if tuple(got) != tuple(expected):
        raise ValueError(f"{what}: checkpoint shape {tuple(got)} != expected {tuple(expected)}")


def replicated_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> int:
    """Weight loader of a parameter every rank holds whole (norm weights, router): the full checkpoint tensor, same
    shape, cast to the parameter dtype. Raises ValueError on a shard id or a shape mismatch."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter has no shard {shard_id!r}")
    check_shape("tensor", loaded_weight.shape, param.shape)
    param.data.copy_(loaded_weight)
    return param.numel()


class UnquantizedLinearMethod:
    """The plain dense method: weight [out_per_rank, in_per_rank] in the model dtype, y = x W^T + b."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, device, weight_loader, shard_dim: Optional[int]) -> None:
        """Register `layer.weight` [sum(output_partition_sizes), input_size_per_partition] (uninitialised) with
        the given weight_loader / shard_dim attributes."""
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype,
                                          device=device), requires_grad=False)
        layer.register_parameter("weight", set_weight_loader(weight, weight_loader, shard_dim))

    @timed_gemm
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., in_per_rank] -> [..., out_per_rank] in x's dtype."""
        return F.linear(x, layer.weight, bias)


@dataclass(frozen=True)
class OutputShard:
    """One checkpoint piece of a column-parallel output. Rows of the full checkpoint tensor [full_rows, in]
    `src_start : src_start + rows` land at rows `local_start : local_start + rows` of this rank's weight."""

    full_rows: int
    src_start: int
    rows: int
    local_start: int


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), W's output features split over ranks; forward returns this rank's columns of y
    (x [..., input_size] -> [..., output_size_per_partition]; no gather: the consumer is head- or row-parallel).

    Subclasses declare several output shards (`_shard_specs`); one GEMM computes them all, `split(y)` returns
    per-shard views in declaration order.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: Optional[torch.dtype] = None,
                 device: "torch.device | str | None" = None, tp_rank: int = 0, tp_size: int = 1,
                 quant_method: Optional[UnquantizedLinearMethod] = None) -> None:
        super().__init__()
        self.input_size, self.tp_rank, self.tp_size = input_size, tp_rank, tp_size
        self.shards: dict[Hashable, OutputShard] = {}
        local = 0
        for shard_id, num_heads, head_size in self._shard_specs(output_size):
            first, per_rank = head_shard(num_heads, tp_rank, tp_size)
            self.shards[shard_id] = OutputShard(num_heads * head_size, first * head_size, per_rank * head_size, local)
            local += per_rank * head_size
        self.output_partition_sizes = [s.rows for s in self.shards.values()]
        self.output_size_per_partition = local
        self.quant_method = quant_method or scoped_linear_method("column") or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_partition_sizes, dtype, device,
                                         self.weight_loader, shard_dim=0)
        self.bias = None
        if bias:
            b = nn.Parameter(torch.empty(local, dtype=dtype, device=device), requires_grad=False)
            self.bias = set_weight_loader(b, self.weight_loader, 0)

    def _shard_specs(self, output_size: int) -> list[tuple[Hashable, int, int]]:
        """[(shard_id, num_heads, head_size)]: one shard of `output_size` one-row "heads" (plain row split)."""
        return [(None, output_size, 1)]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> int:
        """Copy this rank's rows of checkpoint piece `shard_id` (module doc); shard_id None on a layer with several
        shards = the pieces concatenated in shard order (a checkpoint that stores the merged tensor)."""
        if shard_id is None and list(self.shards) != [None]:
            sizes = [s.full_rows for s in self.shards.values()]
            check_shape("merged tensor rows", loaded_weight.shape[:1], [sum(sizes)])
            pieces = loaded_weight.split(sizes, dim=0)
            return sum(self.weight_loader(param, p, sid) for sid, p in zip(self.shards, pieces))
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shards)}")
        s = self.shards[shard_id]
        check_shape(f"shard {shard_id!r}", loaded_weight.shape, [s.full_rows, *param.shape[1:]])
        dst = param.data.narrow(0, s.local_start, s.rows)
        dst.copy_(loaded_weight.narrow(0, s.src_start, s.rows))
        return dst.numel()

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """y [..., output_size_per_partition] -> per-shard column views, in shard order."""
        return list(y.split(self.output_partition_sizes, dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out_per_rank={self.output_partition_sizes}, "
                f"tp={self.tp_rank}/{self.tp_size}, bias={self.bias is not None}")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one GEMM (an MLP's gate and up: shard ids 0, 1).
    Each piece is split over ranks on its own, so rank r's weight is [gate_r; up_r] and `split(y)` gives
    (gate_r, up_r). output_sizes: full (all-rank) rows of each piece."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **kw) -> None:
        self._sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, **kw)

    def _shard_specs(self, output_size: int) -> list[tuple[Hashable, int, int]]:
        return [(i, n, 1) for i, n in enumerate(self._sizes)]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections (shard ids "q", "k", "v") in one GEMM, split by heads: rank r holds
    num_heads = total_num_heads / tp query heads and num_kv_heads KV heads (replicated when tp > total_num_kv_heads,
    module doc). `extra_heads` {shard_id: (total heads, head size)} appends more head-sharded outputs of the same
    input to the GEMM, split like KV heads: MiniMax-M3's MSA index q (one head per KV head, so rank r's index
    heads belong to its KV heads) and index k (one head, held by every rank) ride as "iq"/"ik".

    forward(x [T, hidden]) -> [T, (num_heads + 2 num_kv_heads) head_size + extras]; `split` -> [q, k, v, *extras].
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, extra_heads: Optional[dict[str, tuple[int, int]]] = None, **kw) -> None:
        self.head_size, self.total_num_heads, self.total_num_kv_heads = head_size, total_num_heads, total_num_kv_heads
        self.extra_heads = dict(extra_heads or {})
        tp_rank, tp_size = kw.get("tp_rank", 0), kw.get("tp_size", 1)
        self.num_heads = head_shard(total_num_heads, tp_rank, tp_size)[1]
        self.num_kv_heads = head_shard(total_num_kv_heads, tp_rank, tp_size)[1]
        out = (total_num_heads + 2 * total_num_kv_heads) * head_size + sum(n * d for n, d in self.extra_heads.values())
        super().__init__(hidden_size, out, bias, **kw)

    def _shard_specs(self, output_size: int) -> list[tuple[Hashable, int, int]]:
        d = self.head_size
        specs = [("q", self.total_num_heads, d), ("k", self.total_num_kv_heads, d), ("v", self.total_num_kv_heads, d)]
        return specs + [(sid, n, hd) for sid, (n, hd) in self.extra_heads.items()]


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b), W's input features split over ranks: rank r holds W[:, r*in/tp : (r+1)*in/tp] and computes
    the partial sum x_r W_r^T (+ b on rank 0 only, so the sum adds it once).

    forward(x [..., input_size_per_partition]) -> [..., output_size]. With reduce_results (default) the partial
    sums go through `all_reduce_across_ranks` (a no-op at tp_size 1). reduce_results=False returns the partial
    sum.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: Optional[torch.dtype] = None,
                 device: "torch.device | str | None" = None, tp_rank: int = 0, tp_size: int = 1,
                 reduce_results: bool = True, quant_method: Optional[UnquantizedLinearMethod] = None) -> None:
        super().__init__()
        if input_size % tp_size:
            raise ValueError(f"input_size {input_size} does not split over tp_size {tp_size}")
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size, self.reduce_results = tp_rank, tp_size, reduce_results
        self.input_size_per_partition = input_size // tp_size
        self.quant_method = quant_method or scoped_linear_method("row") or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.input_size_per_partition, [output_size], dtype, device,
                                         self.weight_loader, shard_dim=1)
        self.bias = None
        if bias:
            b = nn.Parameter(torch.empty(output_size, dtype=dtype, device=device), requires_grad=False)
            self.bias = set_weight_loader(b, self.weight_loader, None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> int:
        """Weight: columns of this rank out of the full [output_size, input_size]; bias: the full vector."""
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear has no shard {shard_id!r}")
        if param.shard_dim is None:
            check_shape("bias", loaded_weight.shape, param.shape)
            param.data.copy_(loaded_weight)
            return param.numel()
        check_shape("weight", loaded_weight.shape, [self.output_size, self.input_size])
        n = self.input_size_per_partition
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * n, n))
        return param.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = self.quant_method.apply(self, x, bias)
        return all_reduce_across_ranks(y, self.tp_size) if self.reduce_results else y

    def extra_repr(self) -> str:
        return (f"in_per_rank={self.input_size_per_partition}, out={self.output_size}, "
                f"tp={self.tp_rank}/{self.tp_size}, bias={self.bias is not None}")
