"""Research extension points: per-request logits processors and batch-level token constraints.

Logits processors
-----------------
Put any object implementing `LogitsProcessor` in `SamplingParams.logits_processors`. For each
generated token, the sampler calls it on that request's row of logits (float32, on the logits'
device, before temperature, top-k/top-p/min-p, after nothing else) and uses the returned tensor:

    class BanToken:
        def __init__(self, token_id): self.token_id = token_id
        def __call__(self, output_token_ids, logits):
            logits[self.token_id] = float("-inf")
            return logits

    llm.generate(prompt, SamplingParams(logits_processors=[BanToken(42)]))

`output_token_ids` are the tokens generated so far for that completion. Processors run in list order
and may modify `logits` in place or return a new tensor of the same shape. They are the place for a
new decoding strategy (see `TypicalLogitsProcessor`), needing no engine change. They cost one Python
call per row per step, so they are for research, not the hot path; requests without them pay nothing.

Token constraints
-----------------
For grammar-constrained decoding, `SamplingParams.guided` is an object with
`make_constraint() -> TokenConstraint`. The engine makes one constraint per completion. Each step
the sampler asks every constrained row to `fill_bitmask` into one shared int32 bitmask
(xgrammar's packed layout, see `token_bitmask.py`) and applies it to all constrained rows in one op
on the logits' device. After sampling, the engine calls `accept_token`. A terminated constraint
forces a stop token. Preemption keeps the constraint's state: recompute re-feeds the same tokens to
the model only, never to the constraint. `rollback` is for callers that un-accept tokens
(speculative decoding).
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
