"""Fused routed-expert MoE: out[t] = sum_k w[t, k] * down(silu(gate(x_t)) * up(x_t)) for expert ids[t, k].

Dense or block-FP8 weights (w13 [E_local, 2I, H], gate rows first; w2 [E_local, H, I]); `topk_ids` are global
and pairs routed to other expert-parallel ranks add zero, decided on the device. `fused_moe` is the custom op
the model calls: Triton on CUDA, the loop-free torch reference elsewhere, traceable through its fake. Paths,
numerics, the batch-invariant mode and the H200 tile reasoning: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kserve.kernels import batch_invariant
from kserve.kernels.batch_invariant import sum_fixed_order as batch_invariant_sum
from kserve.kernels.dense_gemm import widens
from kserve.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, num_groups, quantize_per_token_group_torch
from kserve.kernels.triton_support import triton_runs

DEFAULT_BLOCK = (128, 128)


# --- argument checks (shapes and dtypes only: safe under FakeTensorMode) --------------------------------


@dataclass(frozen=True)
class MoeShape:
    tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int

    @property
    def num_pairs(self) -> int:
        return self.tokens * self.top_k


def check_activations(x: torch.Tensor) -> tuple[int, int]:
    """x must be a 2-D float tensor [T, H]; returns (T, H)."""
    if x.dim() != 2 or not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise ValueError(f"x must be a 2-D float tensor [T, H], got {x.dtype} of shape {tuple(x.shape)}")
    return int(x.shape[0]), int(x.shape[1])


def check_routing_args(tokens: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int) -> int:
    """topk_ids [T, k] integer GLOBAL ids, topk_weights [T, k] float, first_expert >= 0; returns k."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids shape {tuple(topk_ids.shape)} must be [T, k] with T = {tokens}, k >= 1")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_weights must be a float tensor shaped like topk_ids {tuple(topk_ids.shape)}, "
            f"got {topk_weights.dtype} of shape {tuple(topk_weights.shape)}"
        )
    if not isinstance(first_expert, int) or first_expert < 0:
        raise ValueError(f"first_expert must be a non-negative int, got {first_expert!r}")
    return int(topk_ids.shape[1])


def check_fused_moe_args(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block: tuple[int, int],
) -> MoeShape:
    tokens, hidden = check_activations(x)
    if w13.dim() != 3:
        raise ValueError(f"w13 must be [E_local, 2I, H], got shape {tuple(w13.shape)}")
    experts, two_inter, w13_hidden = w13.shape
    if experts < 1:
        raise ValueError(f"w13 has no experts (shape {tuple(w13.shape)})")
    if w13_hidden != hidden:
        raise ValueError(f"w13 hidden size {w13_hidden} (shape {tuple(w13.shape)}) != x hidden size {hidden}")
    if two_inter % 2:
        raise ValueError(f"w13 has an odd number of rows {two_inter}; expected 2I (gate rows then up rows)")
    inter = two_inter // 2
    if w2.dim() != 3 or tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(f"w2 shape {tuple(w2.shape)} != (E_local, H, I) = {(experts, hidden, inter)}")
    top_k = check_routing_args(tokens, topk_weights, topk_ids, first_expert)
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("pass both w13_scale and w2_scale (FP8 weights) or neither (dense weights)")
    if w13_scale is None:
        for name, w in (("w13", w13), ("w2", w2)):
            if not w.is_floating_point() or w.dtype == FP8_DTYPE:
                raise ValueError(f"{name} dtype {w.dtype} needs scales: dense weights must be fp32/fp16/bf16")
    else:
        b0, b1 = (int(b) for b in block)
        if b0 < 1 or b1 < 1:
            raise ValueError(f"block {tuple(block)} must be positive")
        if inter % b0:
            raise ValueError(
                f"intermediate size {inter} is not a multiple of the block rows {b0}: a scale block of w13 "
                f"would straddle the gate and up halves"
            )
        for name, scale, rows, cols in (
            ("w13_scale", w13_scale, two_inter, hidden),
            ("w2_scale", w2_scale, hidden, inter),
        ):
            want = (experts, -(-rows // b0), -(-cols // b1))
            if tuple(scale.shape) != want:
                raise ValueError(f"{name} shape {tuple(scale.shape)} != {want} for blocks {(b0, b1)}")
            if not scale.is_floating_point() or scale.dtype == FP8_DTYPE:
                raise ValueError(f"{name} dtype {scale.dtype} must be fp32")
        for name, w in (("w13", w13), ("w2", w2)):
            if w.dtype not in (FP8_DTYPE, torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"{name} dtype {w.dtype} is not float8_e4m3fn (or a float container of fp8 values)")
    return MoeShape(tokens, hidden, inter, experts, top_k)


# --- torch reference / CPU path ---------------------------------------------------------------------------


def _fp8_as_half_times_256(weight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn values as float16 values 256 times smaller, exactly, by moving bits.

    e4m3 (bias 7) exponent/mantissa bits shifted into float16's (bias 15) fields give value * 2^-8,
    subnormals included. Read as int8 and widened, the sign extends into bits 8-15; after the shift by 7
    bit 15 is the sign and only bit 14 (fp16's top exponent bit) needs clearing. This vectorizes on CPU,
    where torch's fp8 -> fp32 cast is a scalar loop (about 7x slower). NaN codes (absent from weights)
    are not kept."""
    bits = weight.view(torch.int8).to(torch.int16)
    return bits.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16)


# Dequantize this many weight elements at a time: a few MB of fp32, so the passes over a chunk (widen,
# shift, convert, scale) stay in cache instead of each streaming the whole stack through memory.
_DEQUANT_CHUNK_ELEMENTS = 1 << 20


def _dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N_e, rows, cols] block-FP8 values and [N_e, ceil(rows/B0), ceil(cols/B1)] scales -> fp32 weights."""
    n, rows, cols = weight.shape
    b0, b1 = block
    scale = scale.float()
    is_fp8 = weight.dtype == FP8_DTYPE
    if rows % b0 or cols % b1:  # edge blocks: one pass over the whole stack with expanded scales
        values = _fp8_as_half_times_256(weight).float() * 256.0 if is_fp8 else weight.float()
        return values * scale.repeat_interleave(b0, 1)[:, :rows].repeat_interleave(b1, 2)[:, :, :cols]
    # Bands of B0 rows across all experts, a fixed number of bands per step (sizes only, no data).
    bands = n * (rows // b0)
    out = torch.empty(bands, b0, cols, dtype=torch.float32, device=weight.device)
    w_bands = weight.reshape(bands, b0, cols)
    s_bands = scale.reshape(bands, cols // b1) * (256.0 if is_fp8 else 1.0)
    step = max(1, _DEQUANT_CHUNK_ELEMENTS // (b0 * cols))
    for start in range(0, bands, step):
        part = slice(start, start + step)
        out[part].copy_(_fp8_as_half_times_256(w_bands[part]) if is_fp8 else w_bands[part])
        out[part].view(-1, b0, cols // b1, b1).mul_(s_bands[part, None, :, None])
    return out.view(n, rows, cols)


def _quantized_activation(a: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 values a per-token-group FP8 quantization of `a` stands for."""
    q, scales = quantize_per_token_group_torch(a, group)
    cols = a.shape[1]
    return q.float() * scales.repeat_interleave(group, dim=1)[:, :cols]


def _grouped_mm_fits(shape: MoeShape, compute_dtype: torch.dtype, device: torch.device) -> bool:
    """torch._grouped_mm needs every row stride to be a multiple of 16 bytes (H and I here). Only its
    CPU kernel takes fp32; on CUDA (reached only by FP8 weights before sm89) the torch path gathers."""
    size = torch.empty((), dtype=compute_dtype).element_size()
    aligned = (shape.hidden * size) % 16 == 0 and (shape.intermediate * size) % 16 == 0
    return aligned and device.type == "cpu"


def _use_gather_strategy(shape: MoeShape, quantized: bool) -> bool:
    """Gather each pair's weights only when that widens fewer weights than the grouped path does.

    FP8: the grouped path dequantizes all E_local experts, gathering one expert per pair; at P = E/2
    gathering was still ahead on the tiny model, at P = E it was 2x behind. Dense: the grouped path copies
    no weights at all, and gathering (a weight copy per pair) measured 2x to 100x slower, even at T=1."""
    if quantized:
        return 2 * shape.num_pairs <= shape.num_experts
    return False


def local_expert_ids(topk_ids: torch.Tensor, first_expert: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, slot) pair p = t * k + j: (local expert id [P] int64, whether this rank owns it [P])."""
    local = topk_ids.reshape(-1).long() - first_expert
    return local, (local >= 0) & (local < num_experts)


def sort_pairs_by_expert(
    local: torch.Tensor, is_local: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [P], offsets [E] int32) for torch._grouped_mm: pairs sorted by local expert, stably, with
    remote pairs (key E) after every local segment, past the last offset; offsets[e] = end of expert e's
    segment = number of keys <= e."""
    key = torch.where(is_local, local, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    arange = torch.arange(num_experts, device=local.device)
    return order, torch.searchsorted(sorted_key, arange, right=True, out_int32=True)


def combine_top_k(
    y: torch.Tensor, is_local: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Per-pair outputs y [T*k, H] -> [T, H]: remote pairs exactly zero (whatever y holds there), the
    routing weight applied in fp32, the top-k summed in fp32, one cast to `dtype`."""
    tokens, top_k = topk_weights.shape
    weighted = torch.where(is_local[:, None], y.float(), 0.0) * topk_weights.reshape(-1, 1).float()
    return weighted.view(tokens, top_k, y.shape[-1]).sum(1).to(dtype)


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = DEFAULT_BLOCK,
    strategy: str | None = None,
) -> torch.Tensor:
    """Loop-free torch fused MoE (see the module docstring); `strategy` ("gather" / "grouped") overrides
    the shape-based choice, for tests and benchmarks."""
    shape = check_fused_moe_args(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, block)
    block = (int(block[0]), int(block[1]))
    quantized = w13_scale is not None
    # FP8: GEMMs run in fp32 on the dequantized values (fp32 accumulation, like the kernel); dense 16-bit
    # experts too on a CPU without 16-bit matmul instructions (kserve.kernels.dense_gemm).
    compute_dtype = torch.float32 if quantized or widens(x, x.shape[0]) else x.dtype
    fits = _grouped_mm_fits(shape, compute_dtype, x.device)
    if strategy is None:
        strategy = "gather" if not fits or _use_gather_strategy(shape, quantized) else "grouped"
    if strategy not in ("gather", "grouped"):
        raise ValueError(f"unknown strategy {strategy!r}; expected 'gather' or 'grouped'")
    if strategy == "grouped" and not fits:
        raise ValueError(
            f"the grouped strategy needs a CPU tensor and H={shape.hidden}, I={shape.intermediate} rows of a "
            f"multiple of 16 bytes in {compute_dtype}; use 'gather'"
        )
    tokens, hidden, experts, top_k = shape.tokens, shape.hidden, shape.num_experts, shape.top_k
    pairs = shape.num_pairs
    if pairs == 0:
        return x.new_zeros(tokens, hidden)
    local, is_local = local_expert_ids(topk_ids, first_expert, experts)
    a = _quantized_activation(x, block[1]) if quantized else x

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.float().chunk(2, dim=-1)
        h = (F.silu(gate) * up).to(x.dtype)
        return _quantized_activation(h, block[1]) if quantized else h

    if strategy == "gather":
        expert = local.clamp(0, experts - 1)
        w13_p, w2_p = w13[expert], w2[expert]
        if quantized:
            w13_p = _dequantize_experts(w13_p, w13_scale[expert], block)
            w2_p = _dequantize_experts(w2_p, w2_scale[expert], block)
        else:
            w13_p, w2_p = w13_p.to(compute_dtype), w2_p.to(compute_dtype)
        a_p = a.to(compute_dtype).repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [P, H, 1]
        h = silu_mul(torch.bmm(w13_p, a_p).squeeze(-1))
        y = torch.bmm(w2_p, h.to(compute_dtype).unsqueeze(-1)).squeeze(-1)  # [P, H]
    else:
        order, offsets = sort_pairs_by_expert(local, is_local, experts)
        if quantized:
            w13_all = _dequantize_experts(w13, w13_scale, block)
            w2_all = _dequantize_experts(w2, w2_scale, block)
        else:
            w13_all, w2_all = w13.to(compute_dtype).contiguous(), w2.to(compute_dtype).contiguous()
        a_sorted = a[order // top_k].to(compute_dtype)
        h = silu_mul(torch._grouped_mm(a_sorted, w13_all.transpose(1, 2), offs=offsets))
        y_sorted = torch._grouped_mm(h.to(compute_dtype), w2_all.transpose(1, 2), offs=offsets)
        y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    return combine_top_k(y, is_local, topk_weights, x.dtype)


def combine_top_k_fixed_order(
    y: torch.Tensor, is_local: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`combine_top_k` with the top-k slots added first to last (a reduction kernel's order may follow the
    number of tokens)."""
    tokens, top_k = topk_weights.shape
    weighted = torch.where(is_local[:, None], y.float(), 0.0) * topk_weights.reshape(-1, 1).float()
    return batch_invariant.sum_fixed_order(weighted.view(tokens, top_k, y.shape[-1]), 1).to(dtype)


def expert_segments(
    topk_ids: torch.Tensor, first_expert: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(local ids, is_local, order, segment ends as host ints): pairs sorted by local expert as
    `sort_pairs_by_expert` does; expert e's pairs are order[ends[e - 1]:ends[e]]. One host read."""
    local, is_local = local_expert_ids(topk_ids, first_expert, num_experts)
    order, offsets = sort_pairs_by_expert(local, is_local, num_experts)
    return local, is_local, order, offsets.tolist()


def hit_experts(ends: list[int]) -> list[int]:
    """Local experts with at least one pair, from `expert_segments`' ends."""
    return [e for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)) if end > start]


def take_experts(stack: torch.Tensor, hit: list[int]) -> torch.Tensor:
    """The hit experts' slices of a per-expert stack (the stack itself when every expert is hit)."""
    return stack if len(hit) == stack.shape[0] else stack[torch.tensor(hit, device=stack.device)]


def run_expert_segments(
    a_sorted: torch.Tensor, ends: list[int], hidden: int, expert_weights, silu_mul
) -> torch.Tensor:
    """y_sorted [P, hidden] for pairs sorted by expert: each hit expert's segment through
    down(silu_mul(gate_up(a))) with GEMMs over fixed row tiles; rows past the last segment (remote
    pairs) stay zero. `expert_weights(e)` gives (w13 [2I, H], w2 [H, I]) in a_sorted's dtype."""
    y = a_sorted.new_zeros(a_sorted.shape[0], hidden)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            w13_e, w2_e = expert_weights(e)
            h = silu_mul(batch_invariant.matmul_rows(a_sorted[start:end], w13_e.t()))
            y[start:end] = batch_invariant.matmul_rows(h.to(a_sorted.dtype), w2_e.t())
        start = end
    return y


def fused_moe_invariant_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:
    """The batch-invariant torch fused MoE (see the module docstring): same numerics contract as
    `fused_moe_torch` (FP8 activations quantized per token group, fp32 GEMMs on dequantized weights),
    but each token's rows meet the same GEMM shapes whatever the rest of the batch is."""
    shape = check_fused_moe_args(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, block)
    block = (int(block[0]), int(block[1]))
    quantized = w13_scale is not None
    compute_dtype = torch.float32 if quantized else x.dtype
    if shape.num_pairs == 0:
        return x.new_zeros(shape.tokens, shape.hidden)
    _, is_local, order, ends = expert_segments(topk_ids, first_expert, shape.num_experts)
    a = _quantized_activation(x, block[1]) if quantized else x
    a_sorted = a[order // shape.top_k].to(compute_dtype)

    hit = hit_experts(ends)
    slot = {e: i for i, e in enumerate(hit)}
    if quantized:  # the hit experts dequantized together (all of them: the grouped path's one pass)
        w13_hit = _dequantize_experts(take_experts(w13, hit), take_experts(w13_scale, hit), block)
        w2_hit = _dequantize_experts(take_experts(w2, hit), take_experts(w2_scale, hit), block)

    def expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if quantized:
            return w13_hit[slot[e]], w2_hit[slot[e]]
        return w13[e].to(compute_dtype), w2[e].to(compute_dtype)

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.float().chunk(2, dim=-1)
        h = (batch_invariant.silu(gate) * up).to(x.dtype)
        return _quantized_activation(h, block[1]) if quantized else h

    y_sorted = run_expert_segments(a_sorted, ends, shape.hidden, expert_weights, silu_mul)
    y = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
    return combine_top_k_fixed_order(y, is_local, topk_weights, x.dtype)


# --- device-side routing prep -----------------------------------------------------------------------------


def align_pairs_to_experts(
    topk_ids: torch.Tensor, first_expert: int, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by local expert and pad each expert's segment to a multiple of `block_m`.

    Returns (sorted_pair_ids [num_blocks * block_m] int32, block_expert [num_blocks] int32), where pair id
    p = token * k + slot, padding slots hold the sentinel T*k, and block b belongs to local expert
    block_expert[b] (-1 past the last segment). num_blocks = ceil((T*k + E*(block_m-1)) / block_m) is a
    static upper bound, so nothing here depends on device data."""
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    device = topk_ids.device
    num_blocks = -(-(pairs + num_experts * (block_m - 1)) // block_m)
    capacity = num_blocks * block_m
    local = topk_ids.reshape(pairs).long() - first_expert
    key = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = torch.cat([padded_end.new_zeros(1), padded_end])  # [E + 1]; entry E = total padded
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=device) - start[sorted_key]
    # Remote pairs go to one extra dump slot that is cut off below.
    dest = torch.where(sorted_key < num_experts, padded_start[sorted_key] + rank, capacity)
    sorted_pair_ids = torch.full((capacity + 1,), pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pair_ids[:capacity], block_expert


# --- Triton -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int
    block_n: int  # kernel 1 (the FP8 group when its quantization is fused)
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int | None = None  # kernel 2; None: block_n


def _tl_dtypes() -> dict:
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def choose_tile_config(shape: MoeShape, quant_group: int | None, interpret: bool = False) -> MoeTileConfig:
    """Tile sizes from shapes only (see the module docstring for the reasoning)."""
    if quant_group is not None and (quant_group < 16 or quant_group & (quant_group - 1)):
        raise ValueError(f"the Triton fused MoE needs a power-of-two FP8 group >= 16, got {quant_group}")
    if interpret:  # fewer, larger programs: the interpreter pays per program, not per FLOP
        group = quant_group or 128
        return MoeTileConfig(block_m=16, block_n=group if quant_group else 64, block_k=group, num_stages=1)
    rows_per_expert = shape.num_pairs / shape.num_experts
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64
    down_block_n = 128 if block_m == 64 else 64
    if quant_group is not None:  # kernel 1's N tile is one quantization group of h
        return MoeTileConfig(block_m=block_m, block_n=quant_group, block_k=quant_group, down_block_n=down_block_n)
    return MoeTileConfig(block_m=block_m, block_n=down_block_n, block_k=64)


def batch_invariant_tile_config(quant_group: int | None, interpret: bool = False) -> MoeTileConfig:
    """The one tile config of the batch-invariant mode, whatever the rows per expert (the interpreter
    keeps its own, which is fixed already)."""
    if interpret:
        return choose_tile_config(MoeShape(1, 1, 1, 1, 1), quant_group, interpret=True)
    if quant_group is not None:
        return MoeTileConfig(block_m=32, block_n=quant_group, block_k=quant_group, down_block_n=64)
    return MoeTileConfig(block_m=32, block_n=64, block_k=64)


def _kernels():
    """The jit functions live in their own module, imported only when a Triton path runs (importing
    triton is slow, and module-level @triton.jit helpers are what the interpreter can resolve)."""
    from kserve.kernels import fused_moe_triton_kernels as kernels

    return kernels.gate_up_kernel, kernels.down_kernel


def _quantize_for_kernel(a: torch.Tensor, group: int, container: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantization (the reference itself), delivered in the weights' container dtype."""
    q, scales = quantize_per_token_group_torch(a, group)
    return (q if container == FP8_DTYPE else q.to(container)), scales


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = DEFAULT_BLOCK,
    config: MoeTileConfig | None = None,
    fuse_quant: bool | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The Triton fused MoE (CUDA, or CPU tensors under TRITON_INTERPRET=1); same contract as fused_moe.

    `fuse_quant=False` (FP8 only) quantizes x and h with the torch reference between the kernels instead
    of inside kernel 1; the two must agree bit for bit, which is how the in-kernel rounding is tested.
    `batch_invariant`: one tile config for every batch (unless `config` is given) and the top-k sum as
    adds in slot order."""
    import triton

    shape = check_fused_moe_args(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, block)
    block = (int(block[0]), int(block[1]))
    quantized = w13_scale is not None
    if config is None and batch_invariant:
        config = batch_invariant_tile_config(block[1] if quantized else None, _interpreting())
    elif config is None:
        config = choose_tile_config(shape, block[1] if quantized else None, _interpreting())
    if quantized and config.block_k != block[1]:
        raise ValueError(f"tile block_k {config.block_k} must equal the FP8 group {block[1]}")
    tokens, hidden, inter, experts, top_k = (
        shape.tokens, shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
    )
    pairs = shape.num_pairs
    if pairs == 0:
        return x.new_zeros(tokens, hidden)
    sorted_pair_ids, block_expert = align_pairs_to_experts(topk_ids, first_expert, experts, config.block_m)
    num_blocks = block_expert.shape[0]
    gate_up_kernel, down_kernel = _kernels()
    w13, w2 = w13.contiguous(), w2.contiguous()
    if fuse_quant is None:
        fuse_quant = quantized
    fuse_quant = quantized and fuse_quant
    if fuse_quant and config.block_n != block[1]:
        config = dataclasses.replace(config, block_n=block[1])  # one tile of h = one quantization group
    # With fused quantization kernel 1 reads x itself; otherwise the reference quantizes x here.
    if quantized and not fuse_quant:
        a, a_scale = _quantize_for_kernel(x.contiguous(), block[1], w13.dtype)
    else:
        a, a_scale = x.contiguous(), x.new_zeros(1, dtype=torch.float32)
    if quantized:
        s13, s2 = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    else:
        s13 = s2 = a_scale  # never read
    container = w13.dtype if quantized else x.dtype
    precision = "ieee" if container == torch.float32 else None
    common = {
        "BLOCK_M": config.block_m, "BLOCK_K": config.block_k, "QUANT": quantized, "SCALE_BLOCK_N": block[0],
        "DOT_PRECISION": precision, "num_warps": config.num_warps, "num_stages": config.num_stages,
    }
    if fuse_quant:
        h = torch.empty(pairs, inter, dtype=w2.dtype, device=x.device)
        h_scale = torch.empty(pairs, num_groups(inter, block[1]), dtype=torch.float32, device=x.device)
    else:
        h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        h_scale = a_scale
    gate_up_kernel[(triton.cdiv(inter, config.block_n), num_blocks)](
        a, a_scale, w13, s13, h, h_scale, sorted_pair_ids, block_expert,
        pairs, top_k, hidden, inter, a_scale.shape[-1], s13.shape[-2] if quantized else 1,
        s13.shape[-1] if quantized else 1, BLOCK_N=config.block_n, FUSE_QUANT=fuse_quant,
        FP8_MAX_C=FP8_MAX, FLOOR=SCALE_FLOOR, OUT_DTYPE=_tl_dtypes()[x.dtype], **common,
    )
    if quantized and not fuse_quant:
        # Rows of remote pairs are never written; they are quantized too but never read.
        h, h_scale = _quantize_for_kernel(h, block[1], w2.dtype)
    weighted = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    down_block_n = config.down_block_n or config.block_n
    down_kernel[(triton.cdiv(hidden, down_block_n), num_blocks)](
        h, h_scale, w2, s2, weighted, sorted_pair_ids, block_expert, topk_weights.float().contiguous(),
        pairs, hidden, inter, h_scale.shape[-1], s2.shape[-2] if quantized else 1,
        s2.shape[-1] if quantized else 1, BLOCK_N=down_block_n, **common,
    )
    if batch_invariant:
        return batch_invariant_sum(weighted.view(tokens, top_k, hidden), 1).to(x.dtype)
    return weighted.view(tokens, top_k, hidden).sum(1).to(x.dtype)


# --- the op callers use -----------------------------------------------------------------------------------


def _use_triton(x: torch.Tensor, w13: torch.Tensor, quantized: bool) -> bool:
    return (not quantized or w13.dtype == FP8_DTYPE) and triton_runs(x.device, fp8=quantized)


@torch.library.custom_op("kserve::fused_moe", mutates_args=())
def _fused_moe_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    block = (block_n, block_k)
    args = (x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, block)
    if _use_triton(x, w13, w13_scale is not None):
        return fused_moe_triton(*args)
    return fused_moe_torch(*args)


@_fused_moe_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, block_n, block_k):
    check_fused_moe_args(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, (block_n, block_k))
    return x.new_empty(x.shape)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = DEFAULT_BLOCK,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype (see the module docstring). Triton on CUDA, the torch path otherwise.
    `batch_invariant`: Triton with one tile config, or the fixed-row-tile torch path (which reads the expert
    segment ends on the host), so a token's output does not depend on the others'."""
    check_fused_moe_args(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, block)
    if batch_invariant:
        if _use_triton(x, w13, w13_scale is not None):
            return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, block,
                                    batch_invariant=True)
        return fused_moe_invariant_torch(x, w13, w2, topk_weights, topk_ids, first_expert, w13_scale, w2_scale, block)
    return torch.ops.kserve.fused_moe(
        x, w13, w2, topk_weights, topk_ids, int(first_expert), w13_scale, w2_scale, int(block[0]), int(block[1])
    )
