"""Dynamic FP8 activation quantization in 1 x GROUP groups along the last dimension (per token).

`quantize_per_token_group_torch` is the reference that every block-FP8 kernel must reproduce exactly.
Details: docs/kernels.md, 'FP8 activation quantization'.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# Keeps an all-zero group's scale finite; any scale this small quantizes zeros to zeros.
SCALE_FLOOR = 1e-10


def num_groups(k: int, group: int = 128) -> int:
    return -(-k // group)


def group_scales(amax: torch.Tensor) -> torch.Tensor:
    """Each group's scale, amax / 448 correctly rounded on every device. CUDA's torch computes a tensor
    divided by a Python float as a product with its rounded reciprocal, one ulp off in about half the
    groups; the Triton kernels and the CPU divide, so the divisor here is a tensor."""
    return amax.clamp(min=SCALE_FLOOR) / torch.full_like(amax, FP8_MAX)


def quantize_per_token_group_torch(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (x_q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] fp32)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D activation, got shape {tuple(x.shape)}")
    m, k = x.shape
    g = num_groups(k, group)
    padded = x.float()
    if k % group:
        padded = torch.nn.functional.pad(padded, (0, g * group - k))
    tiles = padded.view(m, g, group)
    scales = group_scales(tiles.abs().amax(dim=-1))
    q = (tiles / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(m, g * group)[:, :k]
    return q.to(FP8_DTYPE).contiguous(), scales.contiguous()


def dequantize_per_token_group_torch(x_q: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """The fp32 values a quantized activation stands for."""
    k = x_q.shape[-1]
    return x_q.float() * scales.repeat_interleave(group, dim=-1)[..., :k]
