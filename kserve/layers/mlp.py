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
        quant_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        kw = {"dtype": dtype, "device": device, "quant_block": quant_block}
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel, **kw)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, parallel, **kw)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel, reduce_results=reduce_results, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
