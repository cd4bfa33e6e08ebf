"""Attention over the paged latent cache of MLA.

Cache layout per layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], each token's normalized c_kv
followed by its roped k_pe; slot s lives at block s // block_size, offset s % block_size. An FP8 cache holds
latent / kv_scale. Details: docs/model.md, 'MLA attention'; batch-invariant mode: docs/batch_invariance.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kserve.distributed import ContextParallelGroup
from kserve.kernels.batch_invariant import bmm_rows
from kserve.kernels.mla_decode import mla_decode_batch_invariant

FP8_MAX = 448.0
# Query rows of one score tile in the plain-torch attention-with-LSE (scores are [heads, rows, keys] fp32).
LSE_QUERY_TILE = 256


def flash_attn_varlen():
    """flash-attn's varlen function when installed, else None (it is an optional CUDA extra)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def write_latents(cache: torch.Tensor, slot_mapping: torch.Tensor, latents: torch.Tensor, kv_scale: float = 1.0) -> None:
    """Store latents [T, D] at the given slots of one layer's cache (scaled and saturated for an FP8 cache)."""
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == torch.float8_e4m3fn:
        quantized = (latents.float() / kv_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        # index_copy_ has no float8 kernel on the CPU; the bytes are the same through uint8
        flat.view(torch.uint8).index_copy_(0, slot_mapping, quantized.view(torch.uint8))
    else:
        flat.index_copy_(0, slot_mapping, latents.to(cache.dtype))


def as_cached(latents: torch.Tensor, cache_dtype: torch.dtype, kv_scale: float = 1.0) -> torch.Tensor:
    """`latents` as a read from a `cache_dtype` cache would return them (rounded through FP8 for an FP8 cache)."""
    if cache_dtype != torch.float8_e4m3fn:
        return latents.to(cache_dtype).to(latents.dtype)
    stored = (latents.float() / kv_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (stored.float() * kv_scale).to(latents.dtype)


def read_latents(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, kv_scale: float = 1.0) -> torch.Tensor:
    """The latents [N, D] at the given slots of one layer's cache, dequantized to `dtype`."""
    rows = cache.view(-1, cache.shape[-1]).index_select(0, slots)
    if cache.dtype == torch.float8_e4m3fn:
        return (rows.float() * kv_scale).to(dtype)
    return rows.to(dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D], k [S, H, D], v [S, H, Dv] where the Q queries are the last Q of the S positions."""
    num_q, num_k = q.shape[0], k.shape[0]
    qpos = torch.arange(num_k - num_q, num_k, device=q.device)
    mask = qpos[:, None] >= torch.arange(num_k, device=q.device)[None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    dense_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for all prefill sequences of a step: q [Tq, H, D] (their new tokens, flat),
    k [Tk, H, D] and v [Tk, H, Dv] (their whole contexts, flat). Sequence i has query_lens[i] queries,
    the last of its context_lens[i] positions; the host lengths and their device cumulative sums
    (cu_seqlens_*, int32 [P + 1]) describe the same split.

    One flash-attn varlen call on CUDA in fp16/bf16 when flash-attn is installed; otherwise one SDPA call
    with `dense_mask` (the block-diagonal causal mask, when the runner built one) or SDPA over
    per-sequence views cut at offsets the runner computed on the host (no device reads).
    """
    flash = flash_attn_varlen() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
    if flash is not None:
        head_dim, v_head = q.shape[-1], v.shape[-1]
        # flash-attn wants equal qk and v head dims: pad v, then slice. causal aligns bottom-right.
        v_pad = F.pad(v, (0, head_dim - v_head)) if v_head < head_dim else v
        out = flash(
            q, k, v_pad, cu_seqlens_q, cu_seqlens_k, max(query_lens), max(context_lens),
            softmax_scale=scale, causal=True,
        )
        return out[..., :v_head]
    if len(query_lens) == 1:
        return causal_attention(q, k, v, scale)
    if dense_mask is not None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=dense_mask, scale=scale
        )
        return out.transpose(0, 1)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    q_start = k_start = 0
    for q_len, k_len in zip(query_lens, context_lens):
        out[q_start : q_start + q_len] = causal_attention(
            q[q_start : q_start + q_len], k[k_start : k_start + k_len], v[k_start : k_start + k_len], scale
        )
        q_start += q_len
        k_start += k_len
    return out


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, H, D], k [S, H, D], v [S, H, Dv] -> (out [Q, H, Dv] in q's dtype, natural log-sum-exp [Q, H] fp32).

    `causal` needs Q == S (a sequence's new tokens attending each other). flash-attn on CUDA in fp16/bf16,
    torch's CPU flash kernel on the CPU, else plain torch in query tiles; none holds all Q x S scores.
    """
    num_q, num_k, v_head = q.shape[0], k.shape[0], v.shape[-1]
    if causal and num_q != num_k:
        raise ValueError(f"causal attention with LSE needs as many queries as keys, got {num_q} and {num_k}")
    v_pad = F.pad(v, (0, q.shape[-1] - v_head)) if v_head < q.shape[-1] else v
    flash = flash_attn_varlen() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
    if flash is not None:
        cu_q = torch.tensor([0, num_q], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, num_k], dtype=torch.int32, device=q.device)
        out, lse, _ = flash(q, k, v_pad, cu_q, cu_k, num_q, num_k, softmax_scale=scale, causal=causal,
                            return_attn_probs=True)
        return out[..., :v_head], lse.transpose(0, 1).float()
    if q.device.type == "cpu" and q.dtype == k.dtype == v.dtype:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v_pad.transpose(0, 1)[None], 0.0, causal, scale=scale
        )
        return out[0, :, :, :v_head].transpose(0, 1), lse[0].transpose(0, 1).float()
    out = q.new_empty(num_q, q.shape[1], v_head)
    lse = torch.empty(num_q, q.shape[1], dtype=torch.float32, device=q.device)
    keys, values = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [H, S, D]
    for first in range(0, num_q, LSE_QUERY_TILE):
        last = min(num_q, first + LSE_QUERY_TILE)
        scores = torch.matmul(q[first:last].float().transpose(0, 1), keys.transpose(1, 2)) * scale  # [H, q, S]
        if causal:
            rows = torch.arange(first, last, device=q.device)[:, None]
            scores.masked_fill_(torch.arange(num_k, device=q.device)[None, :] > rows, float("-inf"))
        tile_lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - tile_lse[..., None])
        out[first:last] = torch.matmul(probs, values).transpose(0, 1).to(out.dtype)
        lse[first:last] = tile_lse.transpose(0, 1)
    return out, lse


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from each one's output [..., Dv] and natural
    log-sum-exp [...]. A set with no keys has LSE -inf and weighs nothing. Returns fp32 (out, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weight_a = torch.exp(lse_a - base)[..., None]
    weight_b = torch.exp(lse_b - base)[..., None]
    return out_a.float() * weight_a + out_b.float() * weight_b, lse


def gather_heads(x: torch.Tensor, dcp: ContextParallelGroup) -> torch.Tensor:
    """[T, H_local, W] on each group rank -> [T, dcp * H_local, W]: the group's heads in group-rank order."""
    gathered = dcp.all_gather(x)  # [dcp, T, H_local, W]
    return gathered.transpose(0, 1).reshape(x.shape[0], dcp.size * x.shape[1], x.shape[2])


def merge_context_parallel(out: torch.Tensor, lse: torch.Tensor, dcp: ContextParallelGroup) -> torch.Tensor:
    """Each group rank attended the group's heads over its own tokens: out [T, dcp * H_local, C] and natural
    LSE [T, dcp * H_local]. Returns this rank's heads [T, H_local, C] over all tokens, exactly: the LSEs are
    all-gathered, each rank rescales its part, and a reduce-scatter sums the parts head-shard by head-shard."""
    total = torch.logsumexp(dcp.all_gather(lse), dim=0)
    base = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    weighted = out.float() * torch.exp(lse - base)[..., None]
    tokens, heads, width = out.shape
    parts = weighted.view(tokens, dcp.size, heads // dcp.size, width).transpose(0, 1)
    return dcp.reduce_scatter(parts)


def prefill_rows(query_lens: Sequence[int], context_lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per query token of a step's prefill sequences: (its sequence's index, its context length), host ints.
    Query j of sequence i sits at position context_lens[i] - query_lens[i] + j and sees that many + 1."""
    row_table: list[int] = []
    row_context: list[int] = []
    for seq, (q_len, c_len) in enumerate(zip(query_lens, context_lens)):
        row_table.extend([seq] * q_len)
        row_context.extend(range(c_len - q_len + 1, c_len + 1))
    return row_table, row_context


def absorbed_attention_batch_invariant(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scale: float = 1.0,
    row_table: list[int] | None = None,
    row_context: list[int] | None = None,
) -> torch.Tensor:
    """MLA attention in the absorbed form for query rows q_nope [N, H, nope], q_pe [N, H, rope] -> [N, H, v_head],
    batch-invariant: W_UK [H, nope, C] absorbed into the query and W_UV [H, v_head, C] applied to the output
    by `bmm_rows` (fixed row tiles), the attention by `mla_decode_batch_invariant`. Row i uses block table
    block_tables[row_table[i]] (default row i) and context context_lens[i] (device; `row_context` is the same
    as host ints when the caller has them). The cache must already hold every row's context."""
    q_lat = bmm_rows(q_nope, w_uk)  # [N, H, C]
    o_lat = mla_decode_batch_invariant(
        q_lat, q_pe, cache, block_tables, context_lens, scale, kv_scale, row_table=row_table, row_context=row_context
    )
    return bmm_rows(o_lat.to(w_uv.dtype), w_uv.transpose(1, 2))
