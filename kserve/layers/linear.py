"""Linear layers without bias; each parameter's `weight_loader` copies its own tensor-parallel shard.

By default the loader dequantizes FP8 checkpoint weights and these layers hold plain weights in
the model dtype. With `quant_block` set (load_model(..., keep_fp8=True)) a layer whose shard is
aligned to the quantization blocks keeps the float8_e4m3fn weight plus its fp32
`weight_scale_inv` and dequantizes on the fly in forward (Triton on CUDA), halving bf16 memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve.distributed import ParallelState
from kserve.kernels.fp8_dequant import dequantize_blocks, scale_shape


def _check_shape(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shard shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")


def _aligned(start: int, end: int, total: int, block: int) -> bool:
    return start % block == 0 and (end % block == 0 or end == total)


class ShardedLinear(nn.Module):
    """y = x @ W[out_start:out_end, in_start:in_end]^T for this rank's slice of a [out, in] weight."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        out_range: tuple[int, int],
        in_range: tuple[int, int],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        quant_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.out_start, self.out_end = out_range
        self.in_start, self.in_end = in_range
        local = (self.out_end - self.out_start, self.in_end - self.in_start)
        self.block = quant_block
        self.quantized = quant_block is not None and (
            _aligned(self.out_start, self.out_end, out_features, quant_block[0])
            and _aligned(self.in_start, self.in_end, in_features, quant_block[1])
        )
        self.compute_dtype = dtype
        weight_dtype = torch.float8_e4m3fn if self.quantized else dtype
        self.weight = nn.Parameter(torch.empty(local, dtype=weight_dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if self.quantized:
            self.weight_scale_inv = nn.Parameter(
                torch.empty(scale_shape(local, quant_block), dtype=torch.float32, device=device), requires_grad=False
            )
            self.weight_scale_inv.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is getattr(self, "weight_scale_inv", None):
            b0, b1 = self.block
            shard = loaded[self.out_start // b0 : -(-self.out_end // b0), self.in_start // b1 : -(-self.in_end // b1)]
        else:
            shard = loaded[self.out_start : self.out_end, self.in_start : self.in_end]
        _check_shape(param, shard)
        param.data.copy_(shard)

    def dense_weight(self) -> torch.Tensor:
        if not self.quantized:
            return self.weight
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight())


class ReplicatedLinear(ShardedLinear):
    def __init__(self, in_features: int, out_features: int, **kw):
        super().__init__(in_features, out_features, (0, out_features), (0, in_features), **kw)


class ColumnParallelLinear(ShardedLinear):
    """Output features split over ranks; each rank returns its slice of the output."""

    def __init__(self, in_features: int, out_features: int, parallel: ParallelState, **kw):
        super().__init__(in_features, out_features, parallel.shard_range(out_features), (0, in_features), **kw)


class RowParallelLinear(ShardedLinear):
    """Input features split over ranks; partial outputs are summed over the group.

    With `reduce_results=False` the caller sums (e.g. once for the routed + shared experts).
    """

    def __init__(
        self, in_features: int, out_features: int, parallel: ParallelState, *, reduce_results: bool = True, **kw
    ):
        super().__init__(in_features, out_features, (0, out_features), parallel.shard_range(in_features), **kw)
        self.parallel = parallel
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self.parallel.all_reduce(out) if self.reduce_results else out
