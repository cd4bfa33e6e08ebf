"""How a generation ended, as both endpoints report it: finish_reason, errors for unfinished work, usage."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kserve.server.errors import APIError
from kserve.server.protocol import UsageInfo

CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request"; nobody reads it but logs and /metrics


def finish_reason(engine_reason: str | None, has_calls: bool = False) -> str:
    """The OpenAI finish_reason of a finished choice; an aborted one is an error, never a normal stop."""
    if engine_reason == "abort":
        raise generation_aborted()
    # A reply cut by max_tokens says so even if a call had begun: its arguments may be incomplete.
    if engine_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def generation_aborted() -> APIError:
    # The engine aborts on shutdown and when a grammar refuses a sampled token; the text is incomplete either way.
    return APIError(503, "the engine aborted the generation before it completed (server shutting down or a "
                         "grammar violation); the output is incomplete, retry the request", code="generation_aborted")


def client_gone() -> APIError:
    return APIError(CLIENT_CLOSED_STATUS, "client disconnected before the request finished", code="client_disconnected")


def unfinished() -> APIError:
    return APIError(500, "the engine ended the request without finishing it", code="aborted")


def usage_info(prompt_tokens: int, outputs: Iterable[Any], cached_tokens: int | None = None) -> UsageInfo:
    """Usage over the given `CompletionOutput`s; `cached_tokens` (prefix-cache hits) when known."""
    completion = sum(len(o.token_ids) for o in outputs)
    details = {"cached_tokens": cached_tokens} if cached_tokens is not None else None
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion, prompt_tokens_details=details)
