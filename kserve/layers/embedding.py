"""Vocabulary-parallel token embedding and LM head: each rank holds ceil(vocab / tp_size) rows.

Rank r holds rows [r * per, (r + 1) * per); rows past the vocabulary (the last rank, when the
vocabulary does not divide) are zero padding. The embedding looks up the ids in its shard, zeroes
the others and sums over ranks (exactly one rank contributes each row, so the sum is exact). The
LM head computes its shard of the logits and all-gathers them (no sum: exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve.distributed import ParallelState
from kserve.kernels import dense_gemm
from kserve.kernels.batch_invariant import linear_rows
from kserve.layers.weight_loading import copy_checked


class _VocabShard(nn.Module):
    def __init__(
        self, vocab_size: int, hidden_size: int, parallel: ParallelState, *, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.parallel = parallel
        self.vocab_start, self.vocab_end = parallel.padded_shard_range(vocab_size)
        self.num_real_rows = max(0, min(self.vocab_end, vocab_size) - self.vocab_start)
        rows = self.vocab_end - self.vocab_start
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.checkpoint_slice = (slice(self.vocab_start, self.vocab_start + self.num_real_rows), slice(None))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data[self.num_real_rows :].zero_()
        copy_checked(param.data[: self.num_real_rows], loaded, "vocabulary shard")


class VocabEmbedding(_VocabShard):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.is_parallel:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_shard[:, None].to(self.weight.dtype)
        return self.parallel.all_reduce(out)


class LMHead(_VocabShard):
    """Returns float32 logits [T, vocab_size], gathered over ranks. With `batch_invariant` a row's logits
    do not depend on the other rows (GEMMs over fixed row tiles, kserve.kernels.batch_invariant)."""

    batch_invariant: bool = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            logits = linear_rows(hidden, self.weight).float()
        else:
            logits = dense_gemm.linear(hidden, self.weight).float()
        if not self.parallel.is_parallel:
            return logits
        return self.parallel.all_gather_last_dim(logits)[:, : self.vocab_size]
