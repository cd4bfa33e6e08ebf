"""FP8 128x128 block dequantization: W[i, j] = W_q[i, j] * scale_inv[i // B0, j // B1].

`dequantize_blocks_torch` is the reference; `dequantize_blocks_triton` is the Triton kernel.
`dequantize_blocks` picks Triton on CUDA when it is installed, torch otherwise. The Triton kernel
also accepts fp32/fp16 inputs holding fp8 values, which is how it is tested under
TRITON_INTERPRET=1 on CPU.
"""

from __future__ import annotations

import functools

import torch

from kserve.kernels.triton_support import fp8_triton_runs


def scale_shape(shape: tuple[int, int], block: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _check_scale_shape(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    if tuple(scale_inv.shape) != scale_shape(tuple(weight.shape), block):
        raise ValueError(
            f"scale shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
            f"with blocks {block}"
        )


def dequantize_blocks_torch(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    rows, cols = weight.shape
    _check_scale_shape(weight, scale_inv, block)
    if rows % block[0] == 0 and cols % block[1] == 0:  # no edge blocks: broadcast the scale over tiles
        tiles = weight.float().view(rows // block[0], block[0], cols // block[1], block[1])
        return (tiles * scale_inv.float()[:, None, :, None]).view(rows, cols).to(out_dtype)
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(out_dtype)


@functools.lru_cache(maxsize=1)
def _triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant_kernel(
        w_ptr, s_ptr, out_ptr, rows, cols, s_cols,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (offs_r[:, None] < rows) & (offs_c[None, :] < cols)
        offs = offs_r[:, None] * cols + offs_c[None, :]
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + pid_r * s_cols + pid_c)
        tl.store(out_ptr + offs, (w * s).to(out_ptr.dtype.element_ty), mask=mask)

    return dequant_kernel


def dequantize_blocks_triton(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    rows, cols = weight.shape
    _check_scale_shape(weight, scale_inv, block)
    weight = weight.contiguous()
    scale_inv = scale_inv.float().contiguous()
    out = torch.empty(rows, cols, dtype=out_dtype, device=weight.device)
    grid = (scale_inv.shape[0], scale_inv.shape[1])
    _triton_kernel()[grid](
        weight, scale_inv, out, rows, cols, scale_inv.shape[1], BLOCK_R=block[0], BLOCK_C=block[1]
    )
    return out


def dequantize_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    if fp8_triton_runs(weight.device):
        return dequantize_blocks_triton(weight, scale_inv, block, out_dtype)
    return dequantize_blocks_torch(weight, scale_inv, block, out_dtype)


def quantize_blocks_torch(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to float8_e4m3fn with one fp32 scale per block (edge blocks padded with zeros)."""
    rows, cols = weight.shape
    sr, sc = scale_shape((rows, cols), block)
    padded = torch.zeros(sr * block[0], sc * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(sr, block[0], sc, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (tiles / scale[:, None, :, None]).view(sr * block[0], sc * block[1])[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float().contiguous()
