"""YaRN rotary embedding with DeepSeek's interleaved pair layout: pairs are (x[2i], x[2i+1]).

The YaRN frequency correction and the cos/sin mscale are always applied (as transformers and vLLM
do), not only beyond the original context length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kserve.config import RopeScaling, yarn_mscale


def yarn_inv_freq(dim: int, base: float, rope: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp = 0: keep the original frequency (extrapolate); ramp = 1: divide it by the factor.
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


class YarnRotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float, rope: RopeScaling | None, *, device: torch.device | str):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", yarn_inv_freq(dim, base, rope).to(device), persistent=False)
        self.mscale = (
            yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
            if rope is not None
            else 1.0
        )

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        """cos and sin (mscale applied) of `positions` [T], in `dtype`: once per forward, for every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dim/2]
        return RopeAngles((freqs.cos() * self.mscale).to(dtype), (freqs.sin() * self.mscale).to(dtype))


@dataclass(frozen=True)
class RopeAngles:
    """cos and sin [T, dim/2] of one step's positions."""

    cos: torch.Tensor
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate `x` [T, ..., dim] (its interleaved pairs) by these angles."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.cos.shape[-1],)
        cos, sin = self.cos.view(shape), self.sin.view(shape)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
