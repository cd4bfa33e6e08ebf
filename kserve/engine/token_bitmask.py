"""Packed allowed-token bitmasks (xgrammar's layout) applied to logits on their own device.

Bit j of word w in a row allows token 32 * w + j. A row of all ones (-1) allows everything.
"""

from __future__ import annotations

import torch


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask allowing every token (constraints clear the bits they forbid)."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 -> [B, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set disallowed logits of `logits[rows]` to -inf, in place, in one masked op.

    `bitmask` is [len(rows), W] (any device; moved to the logits' device once).
    """
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)


def set_allowed(bitmask: torch.Tensor, row: int, token_ids: list[int] | torch.Tensor) -> None:
    """Make row `row` allow exactly `token_ids` (a helper for hand-written constraints)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).unique()
    bitmask[row].zero_()
    words = torch.zeros(bitmask.shape[1], dtype=torch.int64)
    words.index_add_(0, ids // 32, torch.ones_like(ids) << (ids % 32))
    # int64 -> int32 keeping the bit pattern (bit 31 becomes the sign bit)
    words = torch.where(words >= 2**31, words - 2**32, words)
    bitmask[row] = words.to(torch.int32)
