"""Per-request sampling parameters (the OpenAI / vLLM set)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are greedy (vLLM's threshold): dividing logits by a tiny positive temperature
# overflows to inf, and softmax over infinities is NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0 = only the chosen)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Research extension point: objects implementing kserve.engine.logits_process.LogitsProcessor.
    logits_processors: list[Any] = field(default_factory=list)
    # Structured output request (filled by the server from response_format / tools); opaque here.
    guided: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.seed is not None and not _is_int(self.seed):
            bad(f"seed must be an integer, got {self.seed!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                bad(f"logit_bias must map integer token ids to finite numbers, got {token!r}: {bias!r}")
        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            bad(f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            bad(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
