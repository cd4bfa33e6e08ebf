"""Hand-written token constraints for the constraint-hook tests (no tests here)."""

from __future__ import annotations

import torch

from kserve.engine.token_bitmask import set_allowed


class EvenOnly:
    """Allows only even token ids; terminates after `limit` accepted tokens."""

    def __init__(self, vocab: int, limit: int = 100) -> None:
        self.vocab, self.limit, self.accepted = vocab, limit, []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        set_allowed(bitmask, row, list(range(0, min(self.vocab, bitmask.shape[1] * 32), 2)))

    def accept_token(self, token_id: int) -> bool:
        if token_id % 2:
            return False
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.limit


class EvenOnlyGuide:
    """A `SamplingParams.guided` object: makes one EvenOnly constraint per completion."""

    def __init__(self, limit: int, vocab: int = 1 << 20) -> None:
        self.limit, self.vocab, self.made = limit, vocab, []

    def make_constraint(self) -> EvenOnly:
        self.made.append(EvenOnly(self.vocab, self.limit))
        return self.made[-1]
