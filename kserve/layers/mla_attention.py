"""Attention over the paged latent cache of MLA.

Cache layout per layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]; each token's
entry is its normalized c_kv followed by its roped k_pe. Slot s lives at block s // block_size,
offset s % block_size.

FP8 latent cache (`kv_cache_dtype="fp8"`): the cache is float8_e4m3fn and holds latent / kv_scale,
with one global scale for every layer and value (the runner's `kv_scale`, 1.0 by default: the c_kv
half is RMS-normalized and the roped k_pe half is of the same order, far inside e4m3's +-448, and
e4m3's precision is relative, so an uncalibrated scale of 1 loses nothing to range). Writers divide
by the scale and saturate at +-448; readers multiply by it (the decode kernel takes it as
`kv_scale`, the prefill gather dequantizes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

FP8_MAX = 448.0


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
