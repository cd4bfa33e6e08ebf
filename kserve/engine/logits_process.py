"""Research extension points: per-request logits processors and batch-level token constraints.

A `LogitsProcessor` in `SamplingParams.logits_processors` is called on its request's float32 row of logits, before
temperature and top-k/top-p/min-p, one Python call per row per step: for research, not the hot path (requests
without one pay nothing). `SamplingParams.guided.make_constraint()` gives one `TokenConstraint` per completion; it
fills a shared int32 bitmask (xgrammar's layout) each step and is told each accepted token. The protocols, an
example, preemption and rollback: docs/engine.md.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LogitsProcessor(Protocol):
    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Return the processed logits ([vocab] float32) for the next token."""
        ...


@runtime_checkable
class TokenConstraint(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 [B, ceil(V/32)], CPU)."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the token violates the constraint."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """True once the constraint is complete: the next token must be a stop token."""
        ...


@runtime_checkable
class GuidedDecoding(Protocol):
    def make_constraint(self) -> TokenConstraint: ...


class TypicalLogitsProcessor:
    """Locally typical sampling (Meister et al., 2022) as a logits processor.

    Keeps the smallest set of tokens whose surprisal is closest to the distribution's entropy and
    whose probability mass reaches `mass`; the rest get -inf.
    """

    def __init__(self, mass: float = 0.9, min_tokens_to_keep: int = 1) -> None:
        if not 0.0 < mass <= 1.0:
            raise ValueError(f"mass must be in (0, 1], got {mass}")
        self.mass = mass
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
        entropy = -(p * logp).nan_to_num().sum()
        deviation = (-logp - entropy).abs()
        order = deviation.argsort()
        sorted_p = p[order]
        # keep tokens until the kept mass first reaches `mass` (the token crossing it included)
        keep_sorted = (sorted_p.cumsum(0) - sorted_p) < self.mass
        keep_sorted[: self.min_tokens_to_keep] = True
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        return logits.masked_fill(~keep, float("-inf"))
