"""Block-FP8 (w8a8) linear: y[M, N] = x[M, K] @ W[N, K]^T with FP8 weights and FP8 activations.

W is float8_e4m3fn with an fp32 `weight_scale_inv` per 128 x 128 block; x is quantized per token in 1 x 128 groups
as `fp8_quant.quantize_per_token_group_torch` does; each 128-wide slice of K gives one partial product, scaled once
and added to an fp32 accumulator. `fp8_block_linear` (op `torch.ops.kserve.fp8_block_linear`) is what callers use:
Triton on CUDA from sm89, the torch reference otherwise. Paths, launch choices and the batch-invariant mode:
docs/kernels.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kserve.kernels.batch_invariant import addmm_rows_, row_tile
from kserve.kernels.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    SCALE_FLOOR,
    dequantize_per_token_group_torch,
    num_groups,
    quantize_per_token_group_torch,
)
from kserve.kernels.triton_support import cuda_sm_count, fp8_triton_runs

SUPPORTED_BLOCK = (128, 128)
# Split-K never gives a program fewer K groups than this.
MIN_GROUPS_PER_SPLIT = 4
# The torch path widens at most this many weight elements to fp32 at a time (64 MiB).
CHUNK_ELEMENTS = 1 << 24
# Containers a weight or a quantized activation may arrive in: real fp8, or (for the interpreter and
# the torch path) wider floats that hold fp8-representable values.
_WEIGHT_DTYPES = (FP8_DTYPE, torch.float32, torch.float16, torch.bfloat16)


def check_fp8_linear_args(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int]
) -> None:
    """Shape/dtype checks shared by every entry point; reads shapes only (safe under FakeTensorMode)."""
    block = tuple(int(b) for b in block)
    if block != SUPPORTED_BLOCK:
        raise ValueError(f"block {block} is not supported: the block-FP8 linear needs {SUPPORTED_BLOCK}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if weight.dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight.dtype} is not float8_e4m3fn (or a float container of fp8 values)")
    if weight_scale_inv.dim() != 2:
        raise ValueError(f"weight_scale_inv must be 2-D, got shape {tuple(weight_scale_inv.shape)}")
    if not weight_scale_inv.is_floating_point() or weight_scale_inv.dtype == FP8_DTYPE:
        raise ValueError(f"weight_scale_inv dtype {weight_scale_inv.dtype} must be fp32")
    if x.dim() < 1 or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"x must be a float tensor [..., K], got {x.dtype} of shape {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]} (shape {tuple(x.shape)}) but weight {tuple(weight.shape)} has K={k}")
    expected = (-(-n // block[0]), -(-k // block[1]))
    got = tuple(weight_scale_inv.shape)
    if got != expected:
        implied = ""
        if got[0] > 0 and got[1] > 0:
            implied = f" (that scale implies blocks of about ({-(-n // got[0])}, {-(-k // got[1])}))"
        raise ValueError(
            f"weight_scale_inv shape {got} does not match weight {tuple(weight.shape)} with block {block}: "
            f"expected {expected}{implied}"
        )


def _resolve_out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    return x.dtype if out_dtype is None else out_dtype


# --- torch reference ---------------------------------------------------------------------------------


def w8a8_block_matmul_quantized_torch(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = SUPPORTED_BLOCK,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The GEMM on an already-quantized activation: x_q [M, K] (fp8 values), x_scale [M, ceil(K/128)].

    Runs over chunks of whole K groups, widening at most CHUNK_ELEMENTS of the weight to fp32 at a time;
    within a chunk the scaled values are multiplied in one fp32 matmul (same products as scaling each
    group's partial sum, up to fp32 rounding order)."""
    m, k = x_q.shape
    n = weight.shape[0]
    x = dequantize_per_token_group_torch(x_q, x_scale, block[1])
    # Row n of the weight uses scale row n // 128; expanded once to [N, G] (small).
    w_scale_rows = weight_scale_inv.float().repeat_interleave(block[0], dim=0)[:n]
    groups = num_groups(k, block[1])
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, n * block[1]))
    out = torch.zeros(m, n, dtype=torch.float32, device=x_q.device)
    for g0 in range(0, groups, per_chunk):
        g1 = min(groups, g0 + per_chunk)
        c0, c1 = g0 * block[1], min(g1 * block[1], k)
        w = weight[:, c0:c1].float() * w_scale_rows[:, g0:g1].repeat_interleave(block[1], dim=1)[:, : c1 - c0]
        out.addmm_(x[:, c0:c1], w.t())
    return out.to(out_dtype)


def w8a8_block_matmul_quantized_invariant_torch(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = SUPPORTED_BLOCK,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`w8a8_block_matmul_quantized_torch` with every GEMM over a fixed number of rows (the batch-invariant
    mode): the same K chunks (their count comes from N only), each applied to row tiles of
    `row_tile` rows, the last one zero-padded, so a row's result does not depend on M."""
    m, k = x_q.shape
    n = weight.shape[0]
    tile = row_tile(x_q.device)
    padded = -(-m // tile) * tile
    x = x_q.new_zeros(padded, k, dtype=torch.float32)
    x[:m] = dequantize_per_token_group_torch(x_q, x_scale, block[1])
    w_scale_rows = weight_scale_inv.float().repeat_interleave(block[0], dim=0)[:n]
    groups = num_groups(k, block[1])
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, n * block[1]))
    out = torch.zeros(padded, n, dtype=torch.float32, device=x_q.device)
    for g0 in range(0, groups, per_chunk):
        g1 = min(groups, g0 + per_chunk)
        c0, c1 = g0 * block[1], min(g1 * block[1], k)
        w = weight[:, c0:c1].float() * w_scale_rows[:, g0:g1].repeat_interleave(block[1], dim=1)[:, : c1 - c0]
        addmm_rows_(out, x[:, c0:c1], w.t())
    return out[:m].to(out_dtype)


def w8a8_block_matmul_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = SUPPORTED_BLOCK,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N]: per-token-group FP8 quantization of x, then the block-scaled GEMM in fp32."""
    check_fp8_linear_args(x, weight, weight_scale_inv, block)
    out_dtype = _resolve_out_dtype(x, out_dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_per_token_group_torch(x2, block[1])
    out = w8a8_block_matmul_quantized_torch(x_q, x_scale, weight, weight_scale_inv, block, out_dtype)
    return out.view(*lead, weight.shape[0])


# --- Triton ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def quant_kernel(
        x_ptr, q_ptr, s_ptr, K, G,
        GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr, FLOOR: tl.constexpr,
    ):
        row = tl.program_id(0)
        g = tl.program_id(1)
        offs = g * GROUP + tl.arange(0, GROUP)
        mask = offs < K
        x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR)
        scale = tl.math.div_rn(amax, FP8_MAX_C)
        q = tl.math.div_rn(x, scale)
        q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
        # Round to the nearest float8_e4m3fn value (ties to even) in integer/fp32 arithmetic, so the
        # interpreter (whose fp8 cast is not exact) and the GPU round identically.
        # Normal range (|q| >= 2^-6): keep 3 of fp32's 23 mantissa bits; -1048576 is ~0xFFFFF.
        bits = q.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # Subnormal range: multiples of 2^-9; adding 1.5 * 2^14 makes fp32's own rounding do it.
        subnormal = (q + 24576.0) - 24576.0
        q = tl.where(tl.abs(q) < 0.015625, subnormal, normal)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * G + g, scale)

    @triton.jit
    def gemm_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, G, GROUPS_PER_SPLIT,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)  # split-K: this program's share of the K groups
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        scale_rows_n = offs_n // SCALE_BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        g_start = pid_k * GROUPS_PER_SPLIT
        g_end = tl.minimum(g_start + GROUPS_PER_SPLIT, G)
        for g in range(g_start, g_end):
            offs_k = g * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            # W is [N, K]; load the [BLOCK_K, BLOCK_N] tile of W^T.
            b = tl.load(b_ptr + offs_n[None, :] * K + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            a_s = tl.load(as_ptr + offs_m * G + g, mask=mask_m, other=0.0)
            b_s = tl.load(bs_ptr + scale_rows_n * G + g, mask=mask_n, other=0.0)
            # One 128-wide group per step: the fp8 partial product is promoted to fp32 and scaled here,
            # never accumulated across groups inside the tensor-core instruction.
            partial = tl.dot(a, b, input_precision=DOT_PRECISION)
            acc += partial * a_s[:, None] * b_s[None, :]
        c_mask = mask_m[:, None] & mask_n[None, :]
        c_offs = pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

    return quant_kernel, gemm_kernel


def quantize_per_token_group_triton(
    x: torch.Tensor, group: int = 128, out_dtype: torch.dtype = FP8_DTYPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `quantize_per_token_group_torch`; `out_dtype` may be a float container (interpreter)."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D activation, got shape {tuple(x.shape)}")
    x = x.contiguous()
    m, k = x.shape
    g = num_groups(k, group)
    q = torch.empty(m, k, dtype=out_dtype, device=x.device)
    scales = torch.empty(m, g, dtype=torch.float32, device=x.device)
    if m and k:
        quant_kernel, _ = _kernels()
        quant_kernel[(m, g)](x, q, scales, k, g, GROUP=group, FP8_MAX_C=FP8_MAX, FLOOR=SCALE_FLOOR)
    return q, scales


@dataclass(frozen=True)
class GemmTiles:
    """How the GEMM kernel is launched for a batch size."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _gemm_tiles(m: int, interpret: bool) -> GemmTiles:
    if interpret:
        return GemmTiles(16, 64, 4, 1)
    if m <= 16:
        return GemmTiles(16, 64, 4, 4)
    if m <= 32:
        return GemmTiles(32, 64, 4, 4)
    if m <= 64:
        return GemmTiles(64, 128, 4, 3)
    return GemmTiles(128, 128, 8, 3)


def _split_k(m: int, k: int, tiles: int, groups: int, device: torch.device, interpret: bool) -> int:
    """How many programs share one output tile's K groups, from shapes only (fixed under a CUDA graph).

    Decode-sized GEMMs with few output tiles (K2's kv_a_proj_with_mqa at M=1: 9 tiles of 64 columns,
    K = 56 groups) would leave most SMs idle while a handful stream the weight; splitting K gives about
    two waves of programs, each with at least MIN_GROUPS_PER_SPLIT groups, and only while the fp32
    partials (written and read back: splits * M * N * 8 bytes) stay under a quarter of the weight's
    N * K bytes, so larger batches, which fill the GPU anyway, are not split."""
    if interpret or device.type != "cuda":
        return 1
    target = 2 * cuda_sm_count(device)
    return max(1, min(-(-target // tiles), groups // MIN_GROUPS_PER_SPLIT, k // (32 * max(1, m))))


def w8a8_block_matmul_quantized_triton(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = SUPPORTED_BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int | None = None,
    block_n: int | None = None,
    split_k: int | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """Triton GEMM on an already-quantized activation (x_q [M, K], x_scale [M, ceil(K/128)]).

    `block_m`, `block_n` and `split_k` override the shape heuristics (tests); `tiles` replaces the
    launch chosen from M (the batch-invariant mode passes one launch for every M). With split_k > 1
    each split writes fp32 partial sums to a workspace that is summed in a fixed order (deterministic)."""
    import os

    import triton

    m, k = x_q.shape
    n = weight.shape[0]
    if tuple(x_scale.shape) != (m, num_groups(k, block[1])):
        raise ValueError(f"x_scale shape {tuple(x_scale.shape)} does not match x_q {tuple(x_q.shape)} in groups of {block[1]}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    launch = tiles if tiles is not None else _gemm_tiles(m, interpret)
    bm, bn = block_m or launch.block_m, block_n or launch.block_n
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    _, gemm_kernel = _kernels()
    precision = "ieee" if x_q.dtype == torch.float32 else None
    groups = num_groups(k, block[1])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    splits = split_k or _split_k(m, k, tiles, groups, x_q.device, interpret)
    per_split = -(-groups // max(1, min(splits, groups)))
    splits = -(-groups // per_split)  # no empty splits
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x_q.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits)
    gemm_kernel[grid](
        x_q.contiguous(), x_scale.float().contiguous(), weight.contiguous(), weight_scale_inv.float().contiguous(), target,
        m, n, k, groups, per_split,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block[1], SCALE_BLOCK_N=block[0], DOT_PRECISION=precision,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    if splits > 1:
        out.copy_(target.sum(dim=0))
    return out


def w8a8_block_matmul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = SUPPORTED_BLOCK,
    out_dtype: torch.dtype | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    split_k: int | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N]: Triton activation quantization then the Triton block-scaled GEMM.

    Quantized activations go into the weight's container dtype (fp8 on the GPU)."""
    check_fp8_linear_args(x, weight, weight_scale_inv, block)
    out_dtype = _resolve_out_dtype(x, out_dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_per_token_group_triton(x2, block[1], out_dtype=weight.dtype)
    out = w8a8_block_matmul_quantized_triton(
        x_q, x_scale, weight, weight_scale_inv, block, out_dtype, block_m, block_n, split_k, tiles
    )
    return out.view(*lead, weight.shape[0])


# --- the op callers use ------------------------------------------------------------------------------


def _use_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return weight.dtype == FP8_DTYPE and fp8_triton_runs(x.device)


def w8a8_block_matmul_quantized(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = SUPPORTED_BLOCK,
    out_dtype: torch.dtype = torch.float32,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The GEMM on an activation the caller quantized itself (x_q float8 [M, K], x_scale [M, groups]):
    Triton where it runs, the torch reference otherwise. `batch_invariant`: rows do not depend on each
    other's presence (one fixed Triton launch, or fixed row tiles)."""
    if batch_invariant:
        if _use_triton(x_q, weight):
            return w8a8_block_matmul_quantized_triton(
                x_q.contiguous(), x_scale, weight, weight_scale_inv, block, out_dtype, split_k=1,
                tiles=batch_invariant_tiles(),
            )
        return w8a8_block_matmul_quantized_invariant_torch(x_q, x_scale, weight, weight_scale_inv, block, out_dtype)
    if _use_triton(x_q, weight):
        return w8a8_block_matmul_quantized_triton(x_q.contiguous(), x_scale, weight, weight_scale_inv, block, out_dtype)
    return w8a8_block_matmul_quantized_torch(x_q, x_scale, weight, weight_scale_inv, block, out_dtype)


@torch.library.custom_op("kserve::fp8_block_linear", mutates_args=())
def _fp8_block_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    block = (block_n, block_k)
    if _use_triton(x, weight):
        return w8a8_block_matmul_triton(x, weight, weight_scale_inv, block, out_dtype)
    return w8a8_block_matmul_torch(x, weight, weight_scale_inv, block, out_dtype)


@_fp8_block_linear_op.register_fake
def _fp8_block_linear_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_n: int,
                           block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
    check_fp8_linear_args(x, weight, weight_scale_inv, (block_n, block_k))
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = SUPPORTED_BLOCK,
    out_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """y = x @ dequant(weight)^T with x quantized per token in 1 x 128 groups; x may have leading dims.

    `out_dtype` defaults to x's dtype. Triton on CUDA sm89+, the torch reference otherwise.
    `batch_invariant`: each row's result is what it would be alone (the activation quantization is per row
    already; the GEMM runs one fixed launch / row tiling)."""
    check_fp8_linear_args(x, weight, weight_scale_inv, block)
    if batch_invariant:
        out_dtype = _resolve_out_dtype(x, out_dtype)
        if _use_triton(x, weight):
            return w8a8_block_matmul_triton(
                x, weight, weight_scale_inv, block, out_dtype, split_k=1, tiles=batch_invariant_tiles()
            )
        lead = x.shape[:-1]
        x_q, x_scale = quantize_per_token_group_torch(x.reshape(-1, x.shape[-1]), block[1])
        out = w8a8_block_matmul_quantized_invariant_torch(x_q, x_scale, weight, weight_scale_inv, block, out_dtype)
        return out.view(*lead, weight.shape[0])
    return torch.ops.kserve.fp8_block_linear(
        x, weight, weight_scale_inv, int(block[0]), int(block[1]), _resolve_out_dtype(x, out_dtype)
    )


# --- batch-invariant mode ----------------------------------------------------------------------------

# One Triton launch for every M: the tiles of _gemm_tiles's largest bucket, no split-K, so each output
# tile sums its K groups in one program, in order, whatever the batch (the interpreter keeps its own).
BATCH_INVARIANT_TILES = GemmTiles(64, 128, 4, 3)
_INTERPRET_TILES = GemmTiles(16, 64, 4, 1)


def batch_invariant_tiles() -> GemmTiles:
    import os

    return _INTERPRET_TILES if os.environ.get("TRITON_INTERPRET") == "1" else BATCH_INVARIANT_TILES
