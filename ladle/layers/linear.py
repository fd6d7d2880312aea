"""Linear layers that pack several checkpoint projections into one GEMM (single rank for now).

`MergedLinear` concatenates the output rows of several projections that read the same input (q/k/v, or an
MLP's gate/up), so one matmul replaces three or two. Checkpoints still store the pieces separately; the model's
name table routes each piece to `load_shard(shard_id, tensor)`, which copies it into its row range.

Row layout of `weight [sum(output_sizes), input_size]`:

    rows [0, n0)          shard 0   (e.g. "q")
    rows [n0, n0+n1)      shard 1   (e.g. "k")
    ...
"""

from __future__ import annotations

from typing import Hashable, Optional

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """y = x W^T (+ b) with W the row-concatenation of named shards.

    Args: input_size; output_sizes: ordered {shard_id: rows}; bias; dtype; device.
    forward(x [..., input_size]) -> [..., sum(output_sizes)] (nn.Linear semantics).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: dict[Hashable, int],
        bias: bool = False,
        dtype: Optional[torch.dtype] = None,
        device: "torch.device | str | None" = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes.values()), bias=bias, dtype=dtype, device=device)
        self.output_sizes = dict(output_sizes)
        self.shard_offsets: dict[Hashable, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in output_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def output_slices(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Split an output [..., sum(sizes)] into per-shard views, in shard order."""
        return list(y.split(list(self.output_sizes.values()), dim=-1))

    @torch.no_grad()
    def load_shard(self, param_name: str, shard_id: Hashable, tensor: torch.Tensor) -> None:
        """Copy one checkpoint piece into its rows of `weight` or `bias` (param_name "weight" or "bias").
        Raises ValueError on an unknown shard or a shape mismatch."""
        if shard_id not in self.shard_offsets:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shard_offsets)}")
        offset, size = self.shard_offsets[shard_id]
        param = getattr(self, param_name)
        target = param.data.narrow(0, offset, size)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"shard {shard_id!r} of {param_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shards={self.output_sizes}"
