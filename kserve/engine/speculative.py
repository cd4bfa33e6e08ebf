"""Speculative decoding: draft proposers, their configuration (vLLM's `--speculative-config` keys) and counters.

Drafts are deterministic (n-gram lookup, or the EAGLE-3 draft's argmax), so verifying them with the request's
seeded noise gives exactly the tokens plain decoding gives. Details: docs/speculative.md, 'One step'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kserve.engine.sequence import Sequence

SPEC_METHODS = ("ngram", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # the EAGLE-3 draft's directory

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPEC_METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"speculative_config num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}"
            )
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.method == "eagle3" and not self.model:
            raise ValueError('speculative_config method "eagle3" needs "model": the draft\'s directory')

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the CLI's JSON string, a dict (`LLM(speculative_config=...)`) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError('speculative_config needs "method" and "num_speculative_tokens"')
        args = dict(value)
        if args["method"] == "ngram":  # vLLM: prompt_lookup_min defaults to prompt_lookup_max when only it is given
            if "prompt_lookup_max" in args and "prompt_lookup_min" not in args:
                args["prompt_lookup_min"] = args["prompt_lookup_max"]
            if "prompt_lookup_min" in args and "prompt_lookup_max" not in args:
                args["prompt_lookup_max"] = max(args["prompt_lookup_min"], 4)
        return cls(**args)


class Proposer(Protocol):
    """Suggests draft tokens for sequences about to decode; `observe` sees every step once it is sampled
    (`accepted`: drafts kept per sequence id). `aux_layers`: target layers whose input it reads."""

    aux_layers: tuple[int, ...]

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]: ...

    def observe(self, scheduled: list, accepted: dict[int, int]) -> None: ...

    def forget(self, seq_id: int) -> None:
        """Drop what is kept for a sequence that will not run again (aborted)."""


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        count = min(self.k, max_tokens)
        total = len(seq.token_ids)
        if count <= 0 or total < 2:
            return []
        tokens = np.asarray(seq.token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            tail = tokens[total - n :]
            # candidate starts: every earlier position whose token opens the tail, latest first
            # (recent text is the likeliest to repeat: tool arguments, quoted results)
            for start in np.flatnonzero(tokens[: total - n] == tail[0])[::-1]:
                if np.array_equal(tokens[start : start + n], tail):
                    return tokens[start + n : start + n + count].tolist()
        return []

    def observe(self, scheduled: list, accepted: dict[int, int]) -> None:
        """Prompt lookup keeps no state."""

    def forget(self, seq_id: int) -> None:
        """Prompt lookup keeps no state."""


@dataclass
class SpecDecodeStats:
    """Counters over the engine's life: drafted and accepted tokens, and verify steps (one per sequence per step)."""

    num_drafts: int = 0  # sequence-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_position) < drafted:
            self.accepted_per_position.append(0)
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step yields per sequence: the accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
