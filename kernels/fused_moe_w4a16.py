"""W4A16 fused routed-expert MoE: INT4 `pack-quantized` experts (kserve.kernels.int4_pack), float activations.

Same contract as kserve.kernels.fused_moe's dense path, on the exact weights q * scale.
Numerics, strategies, kernels and tiles: docs/w4a16_moe.md; `batch_invariant=True`: docs/batch_invariance.md.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kserve.kernels import batch_invariant as _bi
from kserve.kernels.fused_moe import (
    MoeShape,
    _grouped_mm_fits,
    align_pairs_to_experts,
    check_activations,
    check_routing_args,
    combine_top_k,
    combine_top_k_fixed_order,
    expert_segments,
    hit_experts,
    local_expert_ids,
    run_expert_segments,
    sort_pairs_by_expert,
    take_experts,
)
from kserve.kernels.int4_pack import INT4_PER_WORD
from kserve.kernels.triton_support import triton_runs

# --- argument checks (shapes and dtypes only: safe under FakeTensorMode) --------------------------------


def _check_scale(name: str, scale: torch.Tensor, want: tuple[int, int, int]) -> None:
    if tuple(scale.shape) != want:
        raise ValueError(f"{name} shape {tuple(scale.shape)} != {want} = [E_local, out, in / group_size]")
    if not scale.is_floating_point() or scale.dtype == torch.float8_e4m3fn:
        raise ValueError(f"{name} dtype {scale.dtype} must be bf16 (as stored), fp16 or fp32")


def check_w4a16_moe_args(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
) -> MoeShape:
    tokens, hidden = check_activations(x)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    for name, packed in (("w13_packed", w13_packed), ("w2_packed", w2_packed)):
        if packed.dtype != torch.int32 or packed.dim() != 3:
            raise ValueError(
                f"{name} must be a 3-D int32 tensor of packed INT4 words, got {packed.dtype} of shape "
                f"{tuple(packed.shape)}"
            )
    if hidden % INT4_PER_WORD:
        raise ValueError(f"x hidden size {hidden} is not a multiple of {INT4_PER_WORD} (INT4 values per int32)")
    experts, two_inter, words = w13_packed.shape
    if experts < 1:
        raise ValueError(f"w13_packed has no experts (shape {tuple(w13_packed.shape)})")
    if words * INT4_PER_WORD != hidden or two_inter % 2:
        raise ValueError(
            f"w13_packed shape {tuple(w13_packed.shape)} must be [E_local, 2I, H / 8] with H = {hidden} "
            f"(gate rows then up rows)"
        )
    inter = two_inter // 2
    want_w2 = (experts, hidden, inter // INT4_PER_WORD)
    if inter % INT4_PER_WORD or tuple(w2_packed.shape) != want_w2:
        raise ValueError(f"w2_packed shape {tuple(w2_packed.shape)} != [E_local, H, I / 8] = {want_w2}")
    if hidden % group_size or inter % group_size:
        raise ValueError(f"group_size {group_size} must divide H = {hidden} and I = {inter}")
    _check_scale("w13_scale", w13_scale, (experts, two_inter, hidden // group_size))
    _check_scale("w2_scale", w2_scale, (experts, hidden, inter // group_size))
    top_k = check_routing_args(tokens, topk_weights, topk_ids, first_expert)
    return MoeShape(tokens, hidden, inter, experts, top_k)


# --- torch reference / CPU path ---------------------------------------------------------------------------

_NIBBLE_SHIFTS = tuple(range(0, 32, 4))


def _unpack_chunk_elements(device: torch.device) -> int:
    """Weights unpacked per band. CPU: 1 MiB of fp32 out (a quarter of that of temporaries), so the passes
    over a band (split nibbles, convert, offset, scale) stay in cache; elsewhere few, large launches."""
    return 1 << 18 if device.type == "cpu" else 1 << 26


def _gather_chunk_elements(device: torch.device) -> int:
    """Dequantized weights the gather strategy holds at once (16 MiB of fp32 on CPU, 1 GiB elsewhere)."""
    return 1 << 22 if device.type == "cpu" else 1 << 28


def _unpack_band(words: torch.Tensor, out: torch.Tensor) -> None:
    """int32 words [rows, in / 8] -> their unsigned nibbles (q + 8) as floats in out [rows, in]."""
    if sys.byteorder == "little":  # bytes of a word in order: value 2j in byte j's low nibble, 2j + 1 high
        octets = words.view(torch.uint8)
        pairs = out.view(out.shape[0], -1, 2)
        pairs[..., 0].copy_(octets & 0xF)
        pairs[..., 1].copy_(octets >> 4)
    else:
        shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int32, device=words.device)
        out.copy_(((words.unsqueeze(-1) >> shifts) & 0xF).flatten(-2))


def dequantize_int4_experts(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """int32 [N, rows, in / 8] words and [N, rows, in / G] scales -> fp32 weights [N, rows, in], exactly
    q * scale, in bands of rows across all experts (a trip count from shapes only)."""
    n, rows, words = packed.shape
    cols = words * INT4_PER_WORD
    bands = n * rows
    out = torch.empty(bands, cols, dtype=torch.float32, device=packed.device)
    flat_words = packed.reshape(bands, words)
    flat_scales = scale.reshape(bands, cols // group_size)
    step = max(1, _unpack_chunk_elements(packed.device) // cols)
    for start in range(0, bands, step):
        part = slice(start, start + step)
        band = out[part]
        _unpack_band(flat_words[part], band)
        band.view(band.shape[0], -1, group_size).sub_(8.0).mul_(flat_scales[part].unsqueeze(-1))
    return out.view(n, rows, cols)


def _use_gather_strategy(shape: MoeShape) -> bool:
    """The grouped path unpacks all E_local experts, gathering one expert per pair (as for FP8)."""
    return 2 * shape.num_pairs <= shape.num_experts


def fused_moe_w4a16_torch(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
    strategy: str | None = None,
) -> torch.Tensor:
    """Loop-free torch W4A16 MoE. GEMMs run in fp32 on the exact weights (what the kernels compute);
    `strategy` ("gather" / "grouped") overrides the shape-based choice, for tests and benchmarks."""
    shape = check_w4a16_moe_args(
        x, w13_packed, w2_packed, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, group_size
    )
    fits = _grouped_mm_fits(shape, torch.float32, x.device)
    if strategy is None:
        strategy = "gather" if not fits or _use_gather_strategy(shape) else "grouped"
    if strategy not in ("gather", "grouped"):
        raise ValueError(f"unknown strategy {strategy!r}; expected 'gather' or 'grouped'")
    if strategy == "grouped" and not fits:
        raise ValueError("the grouped strategy needs CPU tensors (torch._grouped_mm in fp32); use 'gather'")
    tokens, hidden, inter, experts, top_k = (
        shape.tokens, shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
    )
    pairs = shape.num_pairs
    if pairs == 0:
        return x.new_zeros(tokens, hidden)
    local, is_local = local_expert_ids(topk_ids, first_expert, experts)
    a = x.float()

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) * up).to(x.dtype).float()  # h is rounded to x.dtype, as the kernel stores it

    if strategy == "gather":
        expert = local.clamp(0, experts - 1)
        a_pairs = a.repeat_interleave(top_k, dim=0)
        y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
        step = max(1, _gather_chunk_elements(x.device) // (3 * inter * hidden))
        for start in range(0, pairs, step):  # bounded memory; the trip count comes from T * k only
            part = slice(start, start + step)
            chosen = expert[part]
            w13_p = dequantize_int4_experts(w13_packed[chosen], w13_scale[chosen], group_size)
            h = silu_mul(torch.bmm(w13_p, a_pairs[part].unsqueeze(-1)).squeeze(-1))
            del w13_p
            w2_p = dequantize_int4_experts(w2_packed[chosen], w2_scale[chosen], group_size)
            y[part] = torch.bmm(w2_p, h.unsqueeze(-1)).squeeze(-1)
    else:
        order, offsets = sort_pairs_by_expert(local, is_local, experts)
        w13_all = dequantize_int4_experts(w13_packed, w13_scale, group_size)
        h = silu_mul(torch._grouped_mm(a[order // top_k], w13_all.transpose(1, 2), offs=offsets))
        del w13_all
        w2_all = dequantize_int4_experts(w2_packed, w2_scale, group_size)
        y_sorted = torch._grouped_mm(h, w2_all.transpose(1, 2), offs=offsets)
        # Rows of remote pairs (past the last offset) are uninitialized; combine_top_k drops them.
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    return combine_top_k(y, is_local, topk_weights, x.dtype)


def fused_moe_w4a16_invariant_torch(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """The batch-invariant torch W4A16 MoE: each hit expert unpacked on its own and its segment of pairs run
    through fp32 GEMMs over fixed row tiles; same numerics contract as `fused_moe_w4a16_torch`."""
    shape = check_w4a16_moe_args(
        x, w13_packed, w2_packed, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, group_size
    )
    if shape.num_pairs == 0:
        return x.new_zeros(shape.tokens, shape.hidden)
    _, is_local, order, ends = expert_segments(topk_ids, first_expert, shape.num_experts)
    a_sorted = x.float()[order // shape.top_k]

    hit = hit_experts(ends)
    slot = {e: i for i, e in enumerate(hit)}
    w13_hit = dequantize_int4_experts(take_experts(w13_packed, hit), take_experts(w13_scale, hit), group_size)
    w2_hit = dequantize_int4_experts(take_experts(w2_packed, hit), take_experts(w2_scale, hit), group_size)

    def expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return w13_hit[slot[e]], w2_hit[slot[e]]

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return (_bi.silu(gate) * up).to(x.dtype).float()  # h rounded to x.dtype, as the kernel stores it

    y_sorted = run_expert_segments(a_sorted, ends, shape.hidden, expert_weights, silu_mul)
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    return combine_top_k_fixed_order(y, is_local, topk_weights, x.dtype)


# --- Triton -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class W4A16TileConfig:
    block_m: int
    gate_up_block_n: int
    down_block_n: int
    block_k: int = 64  # the most inputs per K step; the step is a divisor of K made of SUB_K-wide dots
    num_warps: int = 4
    num_stages: int = 3


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_group_supported(group_size: int) -> bool:
    """tl.dot needs K >= 16, and each dot must stay inside one scale group."""
    return group_size % 16 == 0


def _sub_k(group_size: int, block_k: int) -> int:
    """Inputs per dot: the largest power of two dividing the group, at most block_k."""
    sub = group_size & -group_size
    while sub > block_k:
        sub //= 2
    return sub


def _k_step(k: int, sub_k: int, block_k: int) -> int:
    """The largest multiple of sub_k that divides k and is at most max(block_k, sub_k)."""
    dots = max(1, block_k // sub_k)
    while (k // sub_k) % dots:
        dots -= 1
    return dots * sub_k


def choose_w4a16_tile_config(shape: MoeShape, interpret: bool = False) -> W4A16TileConfig:
    """Tiles from shapes only (reasoning in docs/w4a16_moe.md). Each of these compiles for sm90 without
    register spills (ptxas, checked offline); larger K steps or 4 warps at BLOCK_M 64 spill."""
    if interpret:  # fewer, larger programs: the interpreter pays per program and per op, not per FLOP
        return W4A16TileConfig(block_m=16, gate_up_block_n=64, down_block_n=64, block_k=128, num_stages=1)
    rows_per_expert = shape.num_pairs / shape.num_experts
    if rows_per_expert <= 2:  # decode at small T: few hit experts, so spread each over more programs
        return W4A16TileConfig(block_m=16, gate_up_block_n=32, down_block_n=32, num_stages=4)
    if rows_per_expert <= 16:
        return W4A16TileConfig(block_m=16, gate_up_block_n=64, down_block_n=64)
    if rows_per_expert <= 32:
        return W4A16TileConfig(block_m=32, gate_up_block_n=64, down_block_n=64, num_warps=8)
    return W4A16TileConfig(block_m=64, gate_up_block_n=64, down_block_n=128, num_warps=8)


def batch_invariant_w4a16_tile_config(interpret: bool = False) -> W4A16TileConfig:
    """The one tile config of the batch-invariant mode (the interpreter's own is fixed already)."""
    if interpret:
        return choose_w4a16_tile_config(MoeShape(1, 1, 1, 1, 1), interpret=True)
    return W4A16TileConfig(block_m=32, gate_up_block_n=64, down_block_n=64, num_warps=8)


def fused_moe_w4a16_triton(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
    config: W4A16TileConfig | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The Triton W4A16 MoE (CUDA, or CPU tensors under TRITON_INTERPRET=1); same contract as the torch path.
    `batch_invariant`: one tile config for every batch (unless `config` is given), top-k summed in slot order."""
    import triton

    shape = check_w4a16_moe_args(
        x, w13_packed, w2_packed, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, group_size
    )
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the Triton W4A16 MoE takes bf16/fp16/fp32 activations, got {x.dtype}")
    if not triton_group_supported(group_size):
        raise ValueError(f"the Triton W4A16 MoE needs a group_size that is a multiple of 16, got {group_size}")
    if config is None:
        config = (batch_invariant_w4a16_tile_config(_interpreting()) if batch_invariant
                  else choose_w4a16_tile_config(shape, _interpreting()))
    tokens, hidden, inter, experts, top_k = (
        shape.tokens, shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
    )
    pairs = shape.num_pairs
    if pairs == 0:
        return x.new_zeros(tokens, hidden)
    from kserve.kernels.fused_moe_w4a16_triton_kernels import w4a16_down_kernel, w4a16_gate_up_kernel

    sorted_pair_ids, block_expert = align_pairs_to_experts(topk_ids, first_expert, experts, config.block_m)
    num_blocks = block_expert.shape[0]
    sub_k = _sub_k(group_size, config.block_k)
    common = {
        "BLOCK_M": config.block_m, "SUB_K": sub_k, "GROUP": group_size,
        "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else None,
        "num_warps": config.num_warps, "num_stages": config.num_stages,
    }
    # .contiguous() is free for weights as loaded; scales stay in their dtype (the kernel widens them).
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    w4a16_gate_up_kernel[(triton.cdiv(inter, config.gate_up_block_n), num_blocks)](
        x.contiguous(), w13_packed.contiguous(), w13_scale.contiguous(), h, sorted_pair_ids, block_expert,
        pairs, top_k, hidden, inter, hidden // group_size,
        BLOCK_N=config.gate_up_block_n, BLOCK_K=_k_step(hidden, sub_k, config.block_k), **common,
    )
    weighted = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)  # remote pairs stay zero
    w4a16_down_kernel[(triton.cdiv(hidden, config.down_block_n), num_blocks)](
        h, w2_packed.contiguous(), w2_scale.contiguous(), weighted, sorted_pair_ids, block_expert,
        topk_weights.float().contiguous(), pairs, hidden, inter, inter // group_size,
        BLOCK_N=config.down_block_n, BLOCK_K=_k_step(inter, sub_k, config.block_k), **common,
    )
    if batch_invariant:
        return _bi.sum_fixed_order(weighted.view(tokens, top_k, hidden), 1).to(x.dtype)
    return weighted.view(tokens, top_k, hidden).sum(1).to(x.dtype)


# --- the op callers use -----------------------------------------------------------------------------------


def _use_triton(x: torch.Tensor, group_size: int) -> bool:
    return triton_runs(x.device) and triton_group_supported(group_size)


@torch.library.custom_op("kserve::fused_moe_w4a16", mutates_args=())
def _fused_moe_w4a16_op(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    args = (x, w13_packed, w2_packed, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, group_size)
    if _use_triton(x, group_size):
        return fused_moe_w4a16_triton(*args)
    return fused_moe_w4a16_torch(*args)


@_fused_moe_w4a16_op.register_fake
def _(x, w13_packed, w2_packed, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, group_size):
    check_w4a16_moe_args(x, w13_packed, w2_packed, topk_weights, topk_ids, first_expert, w13_scale, w2_scale,
                         group_size)
    return x.new_empty(x.shape)


def fused_moe_w4a16(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w2_packed: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    group_size: int,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype. Triton on CUDA, the torch path otherwise (kserve::fused_moe_w4a16).
    `batch_invariant`: Triton with one tile config, or the fixed-row-tile torch path (one host read of the
    expert segments)."""
    args = (x, w13_packed, w2_packed, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, group_size)
    check_w4a16_moe_args(*args)
    if batch_invariant:
        if _use_triton(x, group_size):
            return fused_moe_w4a16_triton(*args, batch_invariant=True)
        return fused_moe_w4a16_invariant_torch(*args)
    return torch.ops.kserve.fused_moe_w4a16(
        x, w13_packed, w2_packed, topk_weights, topk_ids, int(first_expert), w13_scale, w2_scale, int(group_size)
    )
