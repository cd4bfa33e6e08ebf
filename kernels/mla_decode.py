"""Paged MLA decode attention in the absorbed form: one query token per sequence.

With W_UK absorbed into the query, MLA decode is multi-query attention over one shared latent head of width
kv_lora_rank + qk_rope_head_dim (576 for K2), read from paged [num_blocks, block_size, 576] caches (bf16/fp16
or FP8 with a kv_scale). `mla_decode` is the custom op model code calls: Triton on CUDA, `mla_decode_torch`
elsewhere, traceable through its fake. Kernel design, split-KV choices and the batch-invariant mode:
docs/kernels.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kserve.kernels.triton_support import cuda_sm_count, triton_runs

_FP8_DTYPES = (torch.float8_e4m3fn,)
_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16) + _FP8_DTYPES
_QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

# Elements of gathered latents the torch path holds at once (fp32: 16 MiB). Measured on the CPU at
# batch 16-64, contexts 208-2048, K2 widths: chunks of 32 MiB and more ran 1.5-2.5x slower than
# 8-16 MiB ones (glibc serves allocations of 32 MiB and up with fresh mmaps, page faults included).
TORCH_CHUNK_ELEMENTS = 1 << 22


def check_decode_inputs(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: float,
) -> None:
    """Raise ValueError naming the offending tensor or number. Reads shapes and dtypes only."""
    if q_lat.dim() != 3:
        raise ValueError(f"q_lat must be [batch, heads, kv_lora_rank], got shape {tuple(q_lat.shape)}")
    batch, heads, latent_dim = q_lat.shape
    if q_pe.dim() != 3 or q_pe.shape[:2] != q_lat.shape[:2]:
        raise ValueError(
            f"q_pe must be [batch, heads, rope_dim] with batch, heads = {batch}, {heads}; got {tuple(q_pe.shape)}"
        )
    rope_dim = q_pe.shape[2]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != latent_dim + rope_dim:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, {latent_dim} + {rope_dim}], got {tuple(kv_cache.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}")
    if context_lens.dim() != 1 or context_lens.shape[0] != batch:
        raise ValueError(f"context_lens must be [{batch}], got {tuple(context_lens.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be int32 or int64, got {block_tables.dtype}")
    if context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"context_lens must be int32 or int64, got {context_lens.dtype}")
    if q_lat.dtype not in _QUERY_DTYPES or q_pe.dtype not in _QUERY_DTYPES:
        raise ValueError(f"q_lat/q_pe must be fp32, fp16 or bf16, got {q_lat.dtype} and {q_pe.dtype}")
    if kv_cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not one of {_CACHE_DTYPES}")
    devices = {t.device for t in (q_lat, q_pe, kv_cache, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"q_lat, q_pe, kv_cache, block_tables and context_lens must share a device, got {devices}")
    if kv_cache.shape[0] > 0 and kv_cache.stride(2) != 1:
        raise ValueError("kv_cache's last dimension must be contiguous")
    for name, value in (("scale", scale), ("kv_scale", kv_scale)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite float, got {value!r}")


def _select_blocks(kv_cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if kv_cache.dtype in _FP8_DTYPES:  # same bytes through uint8, whatever float8 kernels a device has
        return kv_cache.view(torch.uint8).index_select(0, ids).view(kv_cache.dtype)
    return kv_cache.index_select(0, ids)


def mla_decode_torch(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    chunk_elements: int = TORCH_CHUNK_ELEMENTS,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference and CPU path. Returns o_lat [B, H, C] fp32; zeros for rows with context 0. With
    `return_lse`, also the natural log-sum-exp of each row's scaled scores [B, H] fp32 (-inf when empty)."""
    batch, heads, latent_dim = q_lat.shape
    width = kv_cache.shape[-1]
    block_size = kv_cache.shape[1]
    max_blocks = block_tables.shape[1]
    out = torch.zeros(batch, heads, latent_dim, dtype=torch.float32, device=q_lat.device)
    if batch == 0 or heads == 0 or max_blocks == 0:
        empty_lse = torch.full((batch, heads), float("-inf"), device=q_lat.device)
        return (out, empty_lse) if return_lse else out
    # One fused query over the 576-wide latent row: scores are q . row, and the output is p . row
    # (its first C columns), which avoids copying the c_kv slice of the gathered rows.
    query = torch.cat([q_lat.float(), q_pe.float()], dim=-1)  # [B, H, D]
    tables = block_tables.long().clamp(min=0)
    lens = context_lens.long()[:, None, None]
    blocks_per_chunk = max(1, min(max_blocks, chunk_elements // max(1, batch * block_size * width)))
    offsets = torch.arange(blocks_per_chunk * block_size, device=q_lat.device)
    qk_scale = scale * kv_scale
    lowest = torch.finfo(torch.float32).min

    running_max = running_sum = None
    for first in range(0, max_blocks, blocks_per_chunk):
        count = min(blocks_per_chunk, max_blocks - first)
        # whole blocks at a time: one index_select of contiguous block_size x D tiles
        ids = tables[:, first : first + count].reshape(-1)
        rows = _select_blocks(kv_cache, ids).view(batch, count * block_size, width).float()  # [B, N, D]
        scores = torch.bmm(query, rows.transpose(1, 2)).mul_(qk_scale)  # [B, H, N]
        invalid = (first * block_size + offsets[: count * block_size])[None, None, :] >= lens  # [B, 1, N]
        scores.masked_fill_(invalid, float("-inf"))
        new_max = scores.amax(dim=-1, keepdim=True)
        if running_max is not None:
            new_max = torch.maximum(running_max, new_max)
        # rows with no valid token so far keep a -inf maximum; clamping it to the lowest finite
        # float leaves real maxima unchanged and turns their weights into exp(-inf) = 0, not NaN
        new_max = new_max.clamp(min=lowest)
        probs = torch.exp(scores.sub_(new_max))
        chunk_out = torch.bmm(probs, rows)[..., :latent_dim]
        if running_max is None:
            out, running_sum = chunk_out, probs.sum(dim=-1, keepdim=True)
        else:
            rescale = torch.exp(running_max - new_max)
            out = out * rescale + chunk_out
            running_sum = running_sum * rescale + probs.sum(dim=-1, keepdim=True)
        running_max = new_max
    # a row with any valid token has a sum >= 1 (its maximum contributes exp(0)); an empty row has
    # a zero sum and a zero numerator, so clamping the sum to 1 returns its zeros
    out = out * (kv_scale / running_sum.clamp(min=1.0))
    if not return_lse:
        return out
    lse = (running_max + running_sum.log()).squeeze(-1)  # log(0) = -inf for an empty row
    return out, lse


@dataclass(frozen=True)
class DecodeLaunch:
    """How the Triton kernel is launched for one shape."""

    block_h: int  # heads per program
    block_n: int  # tokens per inner step
    num_splits: int  # KV pieces per sequence
    num_warps: int
    num_stages: int
    transposed_k: bool  # load K as [C, N] and V as [N, C] separately instead of one [N, C] tile


BLOCK_H = 16
PROGRAMS_PER_SM = 4  # two resident CTAs per SM with the tiles below, two waves of them
MIN_SPLIT_TOKENS = 128
SPLIT_TOKENS_PER_HEAD = 32  # keeps partial-output traffic under ~11% of the latent reads
MAX_SPLITS = 64
DEFAULT_NUM_SMS = 132  # H200; used when no CUDA device is queried (the interpreter)


def choose_launch(
    batch: int,
    heads: int,
    max_context: int,
    cache_dtype: torch.dtype = torch.bfloat16,
    query_dtype: torch.dtype = torch.bfloat16,
    num_sms: int = DEFAULT_NUM_SMS,
    num_splits: int | None = None,
) -> DecodeLaunch:
    """Pick tiles and the KV split count from shapes and dtypes only (fixed for a CUDA graph)."""
    head_tiles = -(-heads // BLOCK_H)
    if num_splits is None:
        programs = max(1, batch * head_tiles)
        wanted = -(-PROGRAMS_PER_SM * num_sms // programs)
        min_tokens = max(MIN_SPLIT_TOKENS, SPLIT_TOKENS_PER_HEAD * heads)
        by_length = max(1, -(-max_context // min_tokens))
        num_splits = max(1, min(wanted, by_length, MAX_SPLITS))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if query_dtype == torch.float32:
        # fp32 tiles are twice as wide; 16 tokens keep them in registers (a CPU-parity path on GPU)
        return DecodeLaunch(BLOCK_H, 16, num_splits, num_warps=8, num_stages=3, transposed_k=False)
    # FP8 latents go through the async-copy pipeline only when each dot reads its own tile
    transposed_k = cache_dtype in _FP8_DTYPES
    return DecodeLaunch(BLOCK_H, 32, num_splits, num_warps=8, num_stages=3, transposed_k=transposed_k)


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    # the block-table width changes from step to step outside CUDA graphs: one compiled variant for all
    @triton.jit(do_not_specialize=["max_blocks", "stride_table_b"])
    def mla_decode_split_kernel(
        q_lat_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr,
        num_heads, max_blocks, qk_scale_log2, value_scale,
        stride_qlat_b, stride_qlat_h, stride_qpe_b, stride_qpe_h,
        stride_cache_block, stride_cache_slot, stride_table_b,
        stride_out_b, stride_out_h, stride_out_s, stride_lse_b, stride_lse_h,
        LATENT_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, STORE_LSE: tl.constexpr, IEEE_DOT: tl.constexpr, TRANSPOSED_K: tl.constexpr,
    ):
        # head tiles vary fastest, so the tiles of one sequence run together and share its KV in L2
        head_tile = tl.program_id(0)
        seq = tl.program_id(1)
        split = tl.program_id(2)

        offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < num_heads
        offs_c = tl.arange(0, BLOCK_C)
        mask_c = offs_c < LATENT_DIM
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < ROPE_DIM

        q_lat = tl.load(
            q_lat_ptr + seq * stride_qlat_b + offs_h[:, None] * stride_qlat_h + offs_c[None, :],
            mask=mask_h[:, None] & mask_c[None, :], other=0.0,
        )
        q_pe = tl.load(
            q_pe_ptr + seq * stride_qpe_b + offs_h[:, None] * stride_qpe_h + offs_r[None, :],
            mask=mask_h[:, None] & mask_r[None, :], other=0.0,
        ).to(q_lat.dtype)

        context = tl.minimum(tl.load(context_lens_ptr + seq).to(tl.int32), max_blocks * PAGE_SIZE)
        per_split = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, context)

        row_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        # The block ids of each tile are loaded one iteration ahead: a data load whose address comes
        # from a load in the same iteration gets a single buffer from Triton's pipeliner; a
        # loop-carried address lets it multi-buffer the latent tiles (2 buffers at 3 stages).
        table_row = block_tables_ptr + seq * stride_table_b
        offs_next = start + tl.arange(0, BLOCK_N)
        next_blocks = tl.load(table_row + offs_next // PAGE_SIZE, mask=offs_next < end, other=0)
        for tile in range(start, end, BLOCK_N):
            offs_n = tile + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            block = tl.maximum(next_blocks, 0).to(tl.int64)  # a -1 pad inside the context must not fault
            offs_next = offs_n + BLOCK_N
            next_blocks = tl.load(table_row + offs_next // PAGE_SIZE, mask=offs_next < end, other=0)
            rows = cache_ptr + block * stride_cache_block + (offs_n % PAGE_SIZE) * stride_cache_slot
            if TRANSPOSED_K:
                keys = tl.load(
                    rows[None, :] + offs_c[:, None], mask=mask_c[:, None] & mask_n[None, :], other=0.0
                ).to(q_lat.dtype)
                keys_pe = tl.load(
                    rows[None, :] + LATENT_DIM + offs_r[:, None], mask=mask_r[:, None] & mask_n[None, :], other=0.0
                ).to(q_lat.dtype)
            else:
                latent = tl.load(
                    rows[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0
                ).to(q_lat.dtype)
                keys = tl.trans(latent)
                keys_pe = tl.trans(tl.load(
                    rows[:, None] + LATENT_DIM + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0
                ).to(q_lat.dtype))
            if IEEE_DOT:
                qk = tl.dot(q_lat, keys, input_precision="ieee")
                qk += tl.dot(q_pe, keys_pe, input_precision="ieee")
            else:
                qk = tl.dot(q_lat, keys)
                qk += tl.dot(q_pe, keys_pe)
            qk = tl.where(mask_n[None, :], qk * qk_scale_log2, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(qk, axis=1))
            rescale = tl.exp2(row_max - new_max)
            probs = tl.exp2(qk - new_max[:, None])
            row_sum = row_sum * rescale + tl.sum(probs, axis=1)
            if TRANSPOSED_K:  # the second read of these rows is served from L1/L2, not HBM
                latent = tl.load(
                    rows[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0
                ).to(q_lat.dtype)
            if IEEE_DOT:
                acc = acc * rescale[:, None] + tl.dot(probs, latent, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(probs.to(latent.dtype), latent)
            row_max = new_max

        has_tokens = row_sum > 0
        out = acc / tl.where(has_tokens, row_sum, 1.0)[:, None] * value_scale
        tl.store(
            out_ptr + seq * stride_out_b + offs_h[:, None] * stride_out_h + split * stride_out_s + offs_c[None, :],
            out, mask=mask_h[:, None] & mask_c[None, :],
        )
        if STORE_LSE:
            lse = tl.where(has_tokens, row_max + tl.log2(tl.where(has_tokens, row_sum, 1.0)), float("-inf"))
            tl.store(lse_ptr + seq * stride_lse_b + offs_h * stride_lse_h + split, lse, mask=mask_h)

    @triton.jit
    def mla_decode_merge_kernel(
        part_ptr, lse_ptr, out_ptr, out_lse_ptr,
        stride_part_b, stride_part_h, stride_part_s, stride_lse_b, stride_lse_h, stride_out_b, stride_out_h,
        stride_out_lse_b,
        LATENT_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
        STORE_OUT_LSE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < NUM_SPLITS
        lse = tl.load(lse_ptr + seq * stride_lse_b + head * stride_lse_h + offs_s, mask=mask_s, other=float("-inf"))
        top = tl.max(lse, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        weights = tl.exp2(lse - top)
        total = tl.sum(weights, axis=0)
        weights = weights / tl.where(total > 0, total, 1.0)
        if STORE_OUT_LSE:  # base 2; the caller converts
            merged_lse = tl.where(total > 0, top + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
            tl.store(out_lse_ptr + seq * stride_out_lse_b + head, merged_lse)
        for first in range(0, LATENT_DIM, BLOCK_C):
            offs_c = first + tl.arange(0, BLOCK_C)
            mask_c = offs_c < LATENT_DIM
            part = tl.load(
                part_ptr + seq * stride_part_b + head * stride_part_h + offs_s[:, None] * stride_part_s + offs_c[None, :],
                mask=mask_s[:, None] & mask_c[None, :], other=0.0,
            )
            merged = tl.sum(part * weights[:, None], axis=0)
            tl.store(out_ptr + seq * stride_out_b + head * stride_out_h + offs_c, merged, mask=mask_c)

    return mla_decode_split_kernel, mla_decode_merge_kernel


def mla_decode_triton(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    num_splits: int | None = None,
    launch: DecodeLaunch | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; o_lat [B, H, C] fp32 (and with `return_lse` the natural log-sum-exp [B, H]).
    `num_splits` / `launch` override the heuristics (tests)."""
    import triton

    batch, heads, latent_dim = q_lat.shape
    rope_dim = q_pe.shape[2]
    block_size = kv_cache.shape[1]
    max_blocks = block_tables.shape[1]
    out = torch.empty(batch, heads, latent_dim, dtype=torch.float32, device=q_lat.device)
    out_lse = torch.full((batch, heads), float("-inf"), dtype=torch.float32, device=q_lat.device)
    if batch == 0 or heads == 0 or max_blocks == 0:
        out.zero_()
        return (out, out_lse) if return_lse else out
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    context_lens = context_lens.contiguous()
    num_sms = cuda_sm_count(q_lat.device) if q_lat.is_cuda else DEFAULT_NUM_SMS
    if launch is None:
        launch = choose_launch(
            batch, heads, max_blocks * block_size, kv_cache.dtype, q_lat.dtype, num_sms, num_splits
        )
    splits = launch.num_splits
    if splits == 1:
        partial = out.unsqueeze(2)
        # with one split the kernel's own log-sum-exp (base 2) is the answer; stored only when asked for
        lse = torch.empty(batch, heads, 1, dtype=torch.float32, device=q_lat.device) if return_lse else out
    else:
        partial = torch.empty(batch, heads, splits, latent_dim, dtype=torch.float32, device=q_lat.device)
        lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q_lat.device)
    split_kernel, merge_kernel = _kernels()
    grid = (triton.cdiv(heads, launch.block_h), batch, splits)
    split_kernel[grid](
        q_lat, q_pe, kv_cache, block_tables, context_lens, partial, lse,
        heads, max_blocks, float(scale * kv_scale * _LOG2E), float(kv_scale),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        LATENT_DIM=latent_dim, ROPE_DIM=rope_dim, PAGE_SIZE=block_size,
        BLOCK_C=triton.next_power_of_2(latent_dim), BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_H=launch.block_h, BLOCK_N=launch.block_n,
        NUM_SPLITS=splits, STORE_LSE=splits > 1 or return_lse, IEEE_DOT=q_lat.dtype == torch.float32,
        TRANSPOSED_K=launch.transposed_k,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    if splits > 1:
        block_s = max(2, triton.next_power_of_2(splits))
        merge_kernel[(batch, heads)](
            partial, lse, out, out_lse,
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), out_lse.stride(0),
            LATENT_DIM=latent_dim, NUM_SPLITS=splits, BLOCK_S=block_s,
            # at most 8K partial values a step (64 registers a thread at 4 warps)
            BLOCK_C=min(triton.next_power_of_2(latent_dim), max(16, 8192 // block_s)),
            STORE_OUT_LSE=return_lse,
            num_warps=4,
        )
        out_lse = out_lse * _LN2
    elif return_lse:
        out_lse = lse[:, :, 0] * _LN2
    return (out, out_lse) if return_lse else out


@torch.library.custom_op("kserve::mla_decode", mutates_args=())
def _mla_decode_op(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: float,
) -> torch.Tensor:
    if triton_runs(kv_cache.device, fp8=kv_cache.dtype in _FP8_DTYPES):
        return mla_decode_triton(q_lat, q_pe, kv_cache, block_tables, context_lens, scale, kv_scale)
    return mla_decode_torch(q_lat, q_pe, kv_cache, block_tables, context_lens, scale, kv_scale)


@_mla_decode_op.register_fake
def _mla_decode_fake(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, kv_scale: float) -> torch.Tensor:
    return q_lat.new_empty(q_lat.shape, dtype=torch.float32)


@torch.library.custom_op("kserve::mla_decode_lse", mutates_args=())
def _mla_decode_lse_op(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_runs(kv_cache.device, fp8=kv_cache.dtype in _FP8_DTYPES):
        return mla_decode_triton(q_lat, q_pe, kv_cache, block_tables, context_lens, scale, kv_scale, return_lse=True)
    return mla_decode_torch(q_lat, q_pe, kv_cache, block_tables, context_lens, scale, kv_scale, return_lse=True)


@_mla_decode_lse_op.register_fake
def _mla_decode_lse_fake(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, kv_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return q_lat.new_empty(q_lat.shape, dtype=torch.float32), q_lat.new_empty(q_lat.shape[:2], dtype=torch.float32)


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over the paged latent cache; o_lat [B, H, C] fp32 (see the module doc).
    `return_lse` adds each row's natural log-sum-exp [B, H] (-inf for an empty context): what decode
    context parallelism needs to merge the partial results of several ranks."""
    check_decode_inputs(q_lat, q_pe, kv_cache, block_tables, context_lens, scale, kv_scale)
    if return_lse:
        return torch.ops.kserve.mla_decode_lse(
            q_lat, q_pe, kv_cache, block_tables, context_lens, float(scale), float(kv_scale)
        )
    return torch.ops.kserve.mla_decode(
        q_lat, q_pe, kv_cache, block_tables, context_lens, float(scale), float(kv_scale)
    )


# --- batch-invariant mode ---------------------------------------------------------------------------------

# torch path: context positions per tile (rounded up to whole blocks) and rows per bmm item. Smaller tiles
# waste less on the masked end of a context (prefill rows mostly end inside their last tile); 128 ran the
# tiny model's offline benchmark about 20% faster than 256, and 64 no faster than 128.
BATCH_INVARIANT_TILE_TOKENS = 128
BATCH_INVARIANT_GROUP = 16
# Triton: KV splits of every row, whatever the batch (each split covers ceil(context / splits) tokens).
BATCH_INVARIANT_NUM_SPLITS = 16


def mla_decode_batch_invariant_torch(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row_table: list[int],
    row_context: list[int],
    scale: float,
    kv_scale: float = 1.0,
    return_lse: bool = False,
    tile_tokens: int = BATCH_INVARIANT_TILE_TOKENS,
    group: int = BATCH_INVARIANT_GROUP,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rows [N, H, C] / [N, H, R]: row i attends positions 0 .. row_context[i] - 1 of the sequence whose
    block table is block_tables[row_table[i]] (host ints: several rows may share one table, the query
    tokens of one prefill). Returns o_lat [N, H, C] fp32 (zeros for a row with context 0) and, with
    `return_lse`, the natural log-sum-exp [N, H].

    Per context tile t (positions t * tile ..), the rows that reach it are cut into items of `group` rows
    (the last padded with a dummy row whose context is 0); each item's scores and P.V are one
    torch.bmm of [group, H, D] x [group, D, tile] / [group, H, tile] x [group, tile, D] (an item whose rows
    share a table uses that table's tile expanded, others a per-row gathered copy). The online-softmax
    update then runs over all items at once: exp, max and sum are the same per row wherever it sits, so
    nothing a row computes depends on the other rows (see the module docstring)."""
    rows, heads, latent_dim = q_lat.shape
    width = kv_cache.shape[-1]
    block_size = kv_cache.shape[1]
    device = q_lat.device
    tile_blocks = max(1, -(-tile_tokens // block_size))
    tile = tile_blocks * block_size
    dummy = rows  # state row of the padding items (context 0: contributes nothing, is never read back)
    query = torch.cat([q_lat.float(), q_pe.float()], dim=-1)  # [N, H, D]
    query = torch.cat([query, query.new_zeros(1, heads, width)])
    run_max = torch.full((rows + 1, heads, 1), float("-inf"), device=device)
    run_sum = torch.zeros(rows + 1, heads, 1, device=device)
    acc = torch.zeros(rows + 1, heads, width, device=device)
    contexts = torch.tensor([*row_context, 0], device=device)
    tables = block_tables.long().clamp(min=0)
    table_width = tables.shape[1]
    lowest = torch.finfo(torch.float32).min
    qk_scale = scale * kv_scale
    offsets = torch.arange(tile, device=device)
    num_tiles = max((-(-c // tile) for c in row_context), default=0)
    items_per_pass = 64  # bounds the pass's scores / P.V buffers (64 x group rows)

    def gather(table_rows: list[int], t: int) -> torch.Tensor:
        """Tile t of these table rows as [len, tile, D] fp32 (past a table's end: block 0, masked anyway)."""
        first, last = t * tile_blocks, min((t + 1) * tile_blocks, table_width)
        ids = tables.new_zeros(len(table_rows), tile_blocks)
        if last > first:
            ids[:, : last - first] = tables[torch.tensor(table_rows, device=device), first:last]
        return _select_blocks(kv_cache, ids.reshape(-1)).view(len(table_rows), tile, width).float()

    for t in range(num_tiles):
        active = [i for i in range(rows) if row_context[i] > t * tile]
        items = [active[i : i + group] for i in range(0, len(active), group)]
        for first_item in range(0, len(items), items_per_pass):
            chunk = items[first_item : first_item + items_per_pass]
            padded: list[int] = []
            shared: dict[int, int] = {}  # table row -> slot in shared_keys
            mixed: list[int] = []  # per-row tables of the items whose rows span several tables
            plan: list[tuple[bool, int]] = []  # (shared?, slot or first mixed row)
            for members in chunk:
                padded.extend(members + [dummy] * (group - len(members)))
                owners = {row_table[i] for i in members}
                if len(owners) == 1:
                    plan.append((True, shared.setdefault(owners.pop(), len(shared))))
                else:
                    plan.append((False, len(mixed)))
                    mixed.extend(row_table[i] for i in members)
                    mixed.extend([row_table[members[0]]] * (group - len(members)))
            shared_keys = gather(list(shared), t) if shared else None
            mixed_keys = gather(mixed, t) if mixed else None
            keys = [
                shared_keys[at].expand(group, tile, width) if is_shared else mixed_keys[at : at + group]
                for is_shared, at in plan
            ]
            index = torch.tensor(padded, device=device)
            q = query[index]
            scores = q.new_empty(len(padded), heads, tile)
            for k, key in enumerate(keys):
                torch.bmm(q[k * group : (k + 1) * group], key.transpose(1, 2), out=scores[k * group : (k + 1) * group])
            scores.mul_(qk_scale)
            invalid = (t * tile + offsets)[None, None, :] >= contexts[index][:, None, None]
            scores.masked_fill_(invalid, float("-inf"))
            old_max = run_max[index]
            new_max = torch.maximum(old_max, scores.amax(dim=-1, keepdim=True)).clamp(min=lowest)
            probs = torch.exp(scores.sub_(new_max))
            rescale = torch.exp(old_max - new_max)
            pv = q.new_empty(len(padded), heads, width)
            for k, key in enumerate(keys):
                torch.bmm(probs[k * group : (k + 1) * group], key, out=pv[k * group : (k + 1) * group])
            acc[index] = acc[index] * rescale + pv
            run_sum[index] = run_sum[index] * rescale + probs.sum(dim=-1, keepdim=True)
            run_max[index] = new_max
    out = acc[:rows, :, :latent_dim] * (kv_scale / run_sum[:rows].clamp(min=1.0))
    if not return_lse:
        return out
    lse = (run_max[:rows] + run_sum[:rows].log()).squeeze(-1)  # -inf for a row with no context
    return out, lse


def mla_decode_batch_invariant(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    return_lse: bool = False,
    row_table: list[int] | None = None,
    row_context: list[int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode` in the batch-invariant mode. Row i uses block table `block_tables[row_table[i]]` (default:
    row i) and context `context_lens[i]`; `row_context`, the same lengths as host ints, saves the torch
    path a device read. Triton (one launch, BATCH_INVARIANT_NUM_SPLITS splits) where `mla_decode` would run
    it, `mla_decode_batch_invariant_torch` otherwise."""
    rows = q_lat.shape[0]
    if row_table is None:
        row_table = list(range(rows))
    if triton_runs(kv_cache.device, fp8=kv_cache.dtype in _FP8_DTYPES):
        tables = block_tables
        if row_table != list(range(block_tables.shape[0])):
            tables = block_tables.index_select(0, torch.tensor(row_table, device=block_tables.device))
        check_decode_inputs(q_lat, q_pe, kv_cache, tables, context_lens, scale, kv_scale)
        return mla_decode_triton(
            q_lat, q_pe, kv_cache, tables, context_lens, scale, kv_scale,
            num_splits=BATCH_INVARIANT_NUM_SPLITS, return_lse=return_lse,
        )
    if row_context is None:
        row_context = context_lens.tolist()
    return mla_decode_batch_invariant_torch(
        q_lat, q_pe, kv_cache, block_tables, row_table, row_context, scale, kv_scale, return_lse
    )
