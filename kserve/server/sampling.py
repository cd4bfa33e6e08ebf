"""Turn an OpenAI request's sampling fields into the engine's `SamplingParams`, fitting the context."""

from __future__ import annotations

from typing import Any

from kserve.engine.sampling_params import SamplingParams
from kserve.server.errors import APIError, bad_request
from kserve.server.protocol import SamplingFields


def fit_max_tokens(prompt_len: int, requested: int | None, max_model_len: int) -> int:
    """Generation budget: the request's, clamped to what the context leaves (never a 400 for max_tokens)."""
    room = max_model_len - prompt_len
    if room < 1:
        over = prompt_len + 1 - max_model_len
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens; with at least one generated token that exceeds the model's "
            f"context of {max_model_len} tokens by {over} token{'s' if over != 1 else ''}; shorten the prompt",
            param="messages", code="context_length_exceeded",
        )
    return room if requested is None else min(requested, room)


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise bad_request(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"'logit_bias' values must be in [-100, 100], got {value} for {key}", "logit_bias")
        out[int(key)] = float(value)
    return out


# Integers the engine turns into tensors must fit their int32/int64 slots; the door says so, not the sampler.
MAX_TOP_K = 2**31 - 1


def check_ranges(req: SamplingFields) -> None:
    """400 for numbers the protocol types admit but the engine cannot hold (each named)."""
    if req.top_k is not None and req.top_k > MAX_TOP_K:
        raise bad_request(f"'top_k' must be -1 (off) or at most {MAX_TOP_K}, got {req.top_k}", "top_k")


def build_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int,
    stop: list[str],
    logprobs: int | None,
    skip_special_tokens: bool,
    vocab_size: int,
    guided: Any = None,
) -> SamplingParams:
    check_ranges(req)
    if req.min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({req.min_tokens}) exceeds the generation budget ({max_tokens})",
                          "min_tokens")
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k in (None, 0) else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias, vocab_size),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=skip_special_tokens,
            guided=guided,
        )
    except ValueError as exc:  # SamplingParams names the field and the bound
        raise bad_request(str(exc)) from None
