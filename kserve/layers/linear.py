"""Linear layers without bias; each parameter's `weight_loader` copies its own tensor-parallel shard.

Checkpoint FP8 weights are dequantized by the loader before they reach a weight_loader, so
these layers hold plain weights in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve.distributed import ParallelState


def _check_shape(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shard shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _check_shape(param, loaded)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(nn.Module):
    """Output features split over ranks; each rank returns its slice of the output."""

    def __init__(
        self, in_features: int, out_features: int, parallel: ParallelState, *, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__()
        self.parallel = parallel
        self.in_features = in_features
        self.out_start, self.out_end = parallel.shard_range(out_features)
        local = self.out_end - self.out_start
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.out_start : self.out_end]
        _check_shape(param, shard)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Input features split over ranks; partial outputs are summed over the group.

    With `reduce_results=False` the caller sums (e.g. once for the routed + shared experts).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.parallel = parallel
        self.reduce_results = reduce_results
        self.in_start, self.in_end = parallel.shard_range(in_features)
        local = self.in_end - self.in_start
        self.weight = nn.Parameter(torch.empty(out_features, local, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[:, self.in_start : self.in_end]
        _check_shape(param, shard)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        return self.parallel.all_reduce(out) if self.reduce_results else out
