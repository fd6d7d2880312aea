"""Token embedding (single rank for now; the seam for a vocab-parallel embedding later).

Unlike `nn.Embedding` it does not initialise its weight (loading or `init_dummy_weights` fills it), so building a
model costs no random-number generation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """weight [num_embeddings, embedding_dim] (uninitialised). forward(ids [T] int64) -> [T, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Optional[torch.dtype] = None,
                 device: "torch.device | str | None" = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
