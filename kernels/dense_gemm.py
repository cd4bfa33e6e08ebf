"""Dense GEMMs on 16-bit weights, widened to fp32 on CPUs that have no 16-bit matmul instructions.

Without AVX512-BF16 / AMX (bf16) or AMX-FP16 (fp16), oneDNN emulates a bf16 GEMM at a fifth to a seventh
of fp32's speed on the same core. Widening both operands to fp32 is exact (every bf16 and fp16 value is an
fp32 value) and the GEMM accumulates in fp32 either way, so the result differs from the 16-bit GEMM's only
in summation order before it is rounded back to the input dtype. Below `WIDEN_MIN_ROWS` rows converting the
weight costs more than the GEMM saves. CUDA and CPUs with the instructions never widen. Measurements:
docs/cpu_bf16.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows (tokens) from which the widened GEMM wins on a CPU without 16-bit matmul instructions (crossover at
# 2-4 rows on K2's attention shapes, one core).
WIDEN_MIN_ROWS = 4
# Most weight elements widened at once (64 MiB of fp32).
WIDEN_CHUNK_ELEMENTS = 1 << 24


def _cpu_has_native(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.cpu._is_amx_fp16_supported()


# Fixed for the process: which 16-bit dtypes this CPU multiplies natively.
CPU_NATIVE_16BIT = frozenset(d for d in (torch.bfloat16, torch.float16) if _cpu_has_native(d))


def widens(x: torch.Tensor, rows: int) -> bool:
    """Whether a GEMM with `rows` rows of activations `x` runs in fp32 (see the module docstring)."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
            and x.dtype not in CPU_NATIVE_16BIT and rows >= WIDEN_MIN_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) without bias; x [..., K], weight [N, K] -> [..., N] in x's dtype. A widened weight
    is converted `WIDEN_CHUNK_ELEMENTS` at a time (a 163,840-row LM head is not copied to fp32 whole)."""
    if not widens(x, x.numel() // max(1, x.shape[-1])):
        return F.linear(x, weight)
    wide = x.float()
    rows = max(1, WIDEN_CHUNK_ELEMENTS // max(1, weight.shape[1]))
    if rows >= weight.shape[0]:
        return F.linear(wide, weight.float()).to(x.dtype)
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for first in range(0, weight.shape[0], rows):
        out[..., first : first + rows] = F.linear(wide, weight[first : first + rows].float())
    return out


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b) for a [B, M, K], b [B, K, N] -> [B, M, N] in a's dtype (M is the row count)."""
    if widens(a, a.shape[1]):
        return torch.bmm(a.float(), b.float()).to(a.dtype)
    return torch.bmm(a, b)
