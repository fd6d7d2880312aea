"""RMSNorm with an optional fused residual add (plain torch).

Formula (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; HF LlamaRMSNorm ordering):
    y = weight * (x / sqrt(mean(x^2) + eps))
computed in float32 and cast back to the input dtype before the weight multiply, as transformers does, so
bf16/fp16 results round the same way as the reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension.

    forward(x, residual=None):
      x        [..., hidden] model dtype
      residual [..., hidden] model dtype or None
    Returns `y` when residual is None; otherwise `(y, x + residual)`, where y = norm(x + residual) and the
    second value is the new residual stream (vLLM's fused add-norm contract: the add happens once, here).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: Optional[torch.dtype] = None,
                 device: "torch.device | str | None" = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.eps)
        return self.weight * xf.to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
