"""SwiGLU MLP (dense layers and the shared expert): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve.distributed import ParallelState
from kserve.layers.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """Tensor-parallel over the intermediate dimension; `reduce_results=False` leaves the sum to the caller."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelState,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        reduce_results: bool = True,
    ):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel, dtype=dtype, device=device)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, parallel, dtype=dtype, device=device, reduce_results=reduce_results
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
