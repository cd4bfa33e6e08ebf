"""Linear layers without bias, each holding its tensor-parallel shard of a [out, in] weight.

`quant_block=None` keeps the weight in the model dtype; `quant_block=(128, 128)` keeps the checkpoint's
float8_e4m3fn weight and fp32 `weight_scale_inv` and runs `kserve.kernels.fp8_gemm.fp8_block_linear`. Each
parameter's `checkpoint_slice` names the part of the checkpoint tensor it holds, so the loader reads only that. A
shard off the 128 boundary is zero-padded to the checkpoint's block grid, so its scales apply unchanged. Details,
and the `batch_invariant` mode: docs/model.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kserve.distributed import ParallelState
from kserve.kernels import dense_gemm
from kserve.kernels.batch_invariant import all_reduce_fixed_order, linear_rows
from kserve.kernels.fp8_dequant import dequantize_blocks, scale_shape
from kserve.kernels.fp8_gemm import (
    fp8_block_linear,
    w8a8_block_matmul_quantized,
)
from kserve.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, group_scales
from kserve.layers.weight_loading import copy_checked


def fill_zero(t: torch.Tensor) -> None:
    """Zero any tensor, float8 included (CPU has no float8 fill kernel; fp8 zero is the 0 byte)."""
    (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).zero_()


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
        self.in_features, self.out_features = in_features, out_features
        self.out_start, self.out_end = out_range
        self.in_start, self.in_end = in_range
        self.block = tuple(quant_block) if quant_block is not None else None
        self.quantized = self.block is not None
        self.compute_dtype = dtype
        self.batch_invariant = False
        b0, b1 = self.block if self.quantized else (1, 1)
        self.pad_out = self.out_start % b0
        self.pad_in = self.in_start % b1
        local = (self.out_end - self.out_start + self.pad_out, self.in_end - self.in_start + self.pad_in)
        weight_dtype = torch.float8_e4m3fn if self.quantized else dtype
        self.weight = nn.Parameter(torch.empty(local, dtype=weight_dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.checkpoint_slice = (slice(self.out_start, self.out_end), slice(self.in_start, self.in_end))
        if self.quantized:
            self.weight_scale_inv = nn.Parameter(
                torch.empty(scale_shape(local, self.block), dtype=torch.float32, device=device), requires_grad=False
            )
            self.weight_scale_inv.weight_loader = self.weight_loader
            self.weight_scale_inv.checkpoint_slice = (
                slice(self.out_start // b0, -(-self.out_end // b0)),
                slice(self.in_start // b1, -(-self.in_end // b1)),
            )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Store `loaded`, the checkpoint slice named by `param.checkpoint_slice`."""
        if param is self.weight and (self.pad_out or self.pad_in):
            fill_zero(param.data)
            target = param.data[self.pad_out :, self.pad_in :]
        else:
            target = param.data
        copy_checked(target, loaded, "weight_scale_inv" if param is not self.weight else "weight")

    def dense_weight(self) -> torch.Tensor:
        """The weight in the compute dtype (a dequantized copy for FP8 layers: for tests and offline use;
        forward never calls this on an FP8 layer)."""
        if not self.quantized:
            return self.weight
        full = dequantize_blocks(self.weight, self.weight_scale_inv, self.block, self.compute_dtype)
        return full[self.pad_out :, self.pad_in :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quantized:
            return linear_rows(x, self.weight) if self.batch_invariant else dense_gemm.linear(x, self.weight)
        if self.pad_in:
            x = F.pad(x, (self.pad_in, 0))
        y = fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block, batch_invariant=self.batch_invariant)
        return y[..., self.pad_out :].contiguous() if self.pad_out else y


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
        # An FP8 input shard that cuts an activation group: its ranks agree on the group's scale first.
        self.straddles_groups = self.quantized and (
            self.in_start % self.block[1] != 0 or (self.in_end % self.block[1] != 0 and self.in_end != in_features)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._straddling_forward(x) if self.straddles_groups else super().forward(x)
        if not self.reduce_results:
            return out
        return all_reduce_fixed_order(self.parallel, out) if self.batch_invariant else self.parallel.all_reduce(out)

    def _straddling_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block-FP8 GEMM with each activation group's scale taken over the whole group, across
        the ranks that share it (an all-reduce of the group maxima), so the quantized activation, and
        the result, are those of the unsplit layer. Only for shards not on 128 boundaries."""
        b1 = self.block[1]
        lead = x.shape[:-1]
        x2 = F.pad(x.reshape(-1, x.shape[-1]).float(), (self.pad_in, 0))
        groups = -(-x2.shape[1] // b1)
        tiles = F.pad(x2, (0, groups * b1 - x2.shape[1])).view(x2.shape[0], groups, b1)
        first = self.in_start // b1
        amax = x2.new_zeros(x2.shape[0], -(-self.in_features // b1))
        amax[:, first : first + groups] = tiles.abs().amax(dim=-1)
        amax = self.parallel.all_reduce_max(amax)[:, first : first + groups]
        scales = group_scales(amax)
        x_q = (tiles / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(x2.shape[0], groups * b1)[:, : x2.shape[1]]
        y = w8a8_block_matmul_quantized(x_q.to(FP8_DTYPE), scales, self.weight, self.weight_scale_inv, self.block,
                                        x.dtype, batch_invariant=self.batch_invariant)
        return y.view(*lead, self.weight.shape[0])


class LatentUpProjection(ColumnParallelLinear):
    """MLA's kv_b_proj: latent [T, C] -> this rank's heads' keys and values, stored K rows first.

    The checkpoint interleaves the rows per head (each head's nope key rows, then its v_head value rows).
    The loader regroups this rank's slice once into every head's key rows [H*nope, C] followed by every
    head's value rows [H*v, C], so W_UK [H, nope, C] and W_UV [H, v, C] are plain contiguous views for the
    absorbed decode's bmms (a strided per-head view made the CPU's bf16 bmm copy the weight on every call).
    forward returns [T, H*nope + H*v]: all keys, then all values.
    """

    def __init__(self, kv_lora_rank: int, heads: int, qk_nope: int, v_head: int, parallel: ParallelState, **kw):
        super().__init__(kv_lora_rank, heads * (qk_nope + v_head), parallel, **kw)
        if self.quantized:
            raise ValueError("kv_b_proj is kept dense (dequantized at load)")
        self.local_heads = (self.out_end - self.out_start) // (qk_nope + v_head)
        self.qk_nope, self.v_head = qk_nope, v_head

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        per_head = loaded.reshape(self.local_heads, self.qk_nope + self.v_head, loaded.shape[-1])
        keys, values = per_head.split([self.qk_nope, self.v_head], dim=1)
        super().weight_loader(param, torch.cat([keys.reshape(-1, loaded.shape[-1]), values.reshape(-1, loaded.shape[-1])]))

    def absorption_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, C] and W_UV [H, v, C], contiguous views of the weight."""
        keys = self.local_heads * self.qk_nope
        latent = self.weight.shape[1]
        return (self.weight[:keys].view(self.local_heads, self.qk_nope, latent),
                self.weight[keys:].view(self.local_heads, self.v_head, latent))
