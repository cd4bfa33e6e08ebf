"""Attention over the paged latent cache of MLA.

Cache layout per layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]; each token's
entry is its normalized c_kv followed by its roped k_pe. Slot s lives at block s // block_size,
offset s % block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def flash_attn_varlen():
    """flash-attn's varlen function when installed, else None (it is an optional CUDA extra)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


def write_latents(cache: torch.Tensor, slot_mapping: torch.Tensor, latents: torch.Tensor) -> None:
    """Store latents [T, D] at the given slots of one layer's cache."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, latents.to(cache.dtype))


def context_slots(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Slots of positions 0..context_len-1 for one sequence's block table row."""
    pos = torch.arange(context_len, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """The latents [context_len, D] of one sequence."""
    return cache.view(-1, cache.shape[-1])[context_slots(block_table, context_len, block_size)]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Q, H, D], k [S, H, D], v [S, H, Dv] where the Q queries are the last Q of the S positions."""
    num_q, num_k = q.shape[0], k.shape[0]
    qpos = torch.arange(num_k - num_q, num_k, device=q.device)
    mask = qpos[:, None] >= torch.arange(num_k, device=q.device)[None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def absorbed_decode_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """One query per sequence, attending over its cached latents as MQA with one 576-dim head.

    q_lat [B, H, C] (q_nope absorbed through W_UK), q_pe [B, H, R]; returns o_lat [B, H, C] in fp32.
    """
    num_seqs, max_blocks = block_tables.shape
    block_size = cache.shape[1]
    max_len = max_blocks * block_size
    pos = torch.arange(max_len, device=cache.device)
    tables = block_tables.long().clamp(min=0)
    slots = tables[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    latents = cache.view(-1, cache.shape[-1])[slots].float()  # [B, L, C+R]
    c_kv, k_pe = latents[..., :kv_lora_rank], latents[..., kv_lora_rank:]
    scores = torch.bmm(q_lat.float(), c_kv.transpose(1, 2)) + torch.bmm(q_pe.float(), k_pe.transpose(1, 2))
    valid = pos[None, :] < context_lens.long()[:, None]  # [B, L]
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.bmm(probs, c_kv)
