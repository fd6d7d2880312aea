"""Token embedding and LM head split over tensor-parallel ranks along the vocabulary.

Rank r holds the contiguous vocabulary rows [r*R, min((r+1)*R, V)) with R = ceil(V / tp_size); its table has R rows
(rows past V on the last rank are zero padding). Embedding: each rank looks up the ids it owns and writes zeros for
the others, so the sum over ranks (all-reduce) is the full lookup. LM head: each rank computes the logits of its
rows, so concatenating the ranks' logits (all-gather) and dropping the padding gives the full [T, V] logits.
The sum is `all_reduce_across_ranks` (linear.py), the concatenation `tensor_model_parallel_all_gather`
(ladle/distributed).

Like nn.Embedding without the random init: the weight is uninitialised until loading or dummy init fills it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ladle.distributed.parallel_state import tensor_model_parallel_all_gather
from ladle.layers.linear import UnquantizedLinearMethod, check_shape, all_reduce_across_ranks


class VocabParallelEmbedding(nn.Module):
    """weight [num_embeddings_per_partition, embedding_dim]. forward(ids [T] int64) -> [T, embedding_dim]:
    with reduce_results (default) the full lookup (summed over the ranks),
    else this rank's partial (zeros for ids it does not own)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Optional[torch.dtype] = None,
                 device: "torch.device | str | None" = None, tp_rank: int = 0, tp_size: int = 1,
                 reduce_results: bool = True, quant_method: Optional[UnquantizedLinearMethod] = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_rank, self.tp_size, self.reduce_results = tp_rank, tp_size, reduce_results
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start = min(tp_rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, embedding_dim, [self.num_embeddings_per_partition], dtype, device,
                                         self.weight_loader, shard_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> int:
        """Copy this rank's vocabulary rows of the full [num_embeddings, embedding_dim] table; zero the padding."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        check_shape("vocab table", loaded_weight.shape, [self.num_embeddings, self.embedding_dim])
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()
        return param.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce_across_ranks(out, self.tp_size) if self.reduce_results else out

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.tp_rank}/{self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary-split like the embedding (tie by assigning the embedding's weight).

    compute_logits(hidden [T, embedding_dim]) -> [T, num_embeddings] in the hidden dtype; `partial_logits` gives
    this rank's [T, num_embeddings_per_partition] (what the all-gather concatenates; every rank gets the full
    logits)."""

    def partial_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        partial = self.partial_logits(hidden_states)
        if self.tp_size == 1:
            return partial
        return tensor_model_parallel_all_gather(partial, -1, self.tp_size)[:, :self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is an output projection: call compute_logits(hidden_states)")
