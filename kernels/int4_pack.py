"""INT4 weights in compressed-tensors' `pack-quantized` layout (K2-Thinking, K2.5, K2.6 routed experts).

A weight [out, in] is stored as `weight_packed` int32 [out, in / 8] (eight signed 4-bit values per word
along the input dimension, each offset by 8, value i in bits 4i..4i+3) and `weight_scale` [out, in / G]
(bf16, one per group of G inputs): w = q * scale, q in [-8, 7]. Symmetric, no zero points.
"""

from __future__ import annotations

import torch

INT4_PER_WORD = 8
INT4_MIN, INT4_MAX = -8, 7


def packed_shape(out_features: int, in_features: int) -> tuple[int, int]:
    if in_features % INT4_PER_WORD:
        raise ValueError(f"input size {in_features} is not a multiple of {INT4_PER_WORD} (INT4 values per int32)")
    return out_features, in_features // INT4_PER_WORD


def group_scale_shape(out_features: int, in_features: int, group_size: int) -> tuple[int, int]:
    if in_features % group_size:
        raise ValueError(f"input size {in_features} is not a multiple of the INT4 group size {group_size}")
    return out_features, in_features // group_size


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], shape [..., in] -> int32 [..., in / 8]."""
    if q.dtype != torch.int8:
        raise ValueError(f"pack_int4 takes int8 values, got {q.dtype}")
    *lead, cols = q.shape
    nibbles = (q.to(torch.int32) + 8).reshape(*lead, cols // INT4_PER_WORD, INT4_PER_WORD)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    # Nibbles occupy disjoint bits, so a sum is their bitwise or; int32 wraps for the top nibble.
    return (nibbles << shifts).sum(-1, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., in / 8] -> int8 values in [-8, 7], shape [..., in]."""
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_int4 takes int32 words, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - 8).to(torch.int8).flatten(-2)


def quantize_int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group INT4 as compressed-tensors computes it (scale = max|w| / 7.5, round, clamp to
    [-8, 7]): returns (int8 values [out, in], bf16 scales [out, in / G])."""
    out_features, in_features = weight.shape
    group_scale_shape(out_features, in_features, group_size)
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    scale = (groups.abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(INT4_MIN, INT4_MAX).to(torch.int8)
    return q.reshape(out_features, in_features), scale


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """int32 [..., out, in / 8] words and [..., out, in / G] scales -> [..., out, in] weights in `dtype`."""
    values = unpack_int4(packed).float()
    groups = values.unflatten(-1, (-1, group_size)) * scale.float().unsqueeze(-1)
    return groups.flatten(-2).to(dtype)
