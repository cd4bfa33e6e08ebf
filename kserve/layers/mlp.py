"""SwiGLU MLP (dense layers and the shared expert): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve.distributed import ParallelState
from kserve.kernels import batch_invariant
from kserve.layers.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """Tensor-parallel over the intermediate dimension; `reduce_results=False` leaves the sum to the caller.
    With `batch_invariant` the activation is kserve.kernels.batch_invariant.silu (torch's CPU silu computes
    a vector body and a scalar tail differently, so a value depends on where it sits in the tensor); the
    projections switch on their own attribute."""

    batch_invariant: bool = False

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
        act = batch_invariant.silu if self.batch_invariant else F.silu
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
