"""Fused RMSNorm: y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32.

`rms_norm_torch` is the reference (and the CPU path); `rms_norm_triton` is one program per row.
"""

from __future__ import annotations

import functools

import torch

from kserve.kernels.triton_support import triton_runs


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * cols + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / cols + eps)
        normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * cols + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)

    return rms_norm_kernel


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import triton

    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != input dtype {x.dtype}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        _kernel()[(x2.shape[0],)](x2, weight.contiguous(), out, shape[-1], eps, BLOCK=triton.next_power_of_2(shape[-1]))
    return out.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton on CUDA when available, torch otherwise."""
    if weight.dtype == x.dtype and triton_runs(x.device):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)
