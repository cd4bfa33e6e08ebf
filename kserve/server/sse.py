"""JSON bodies and server-sent events: OpenAI's `data:`-only events and typed `event:` + `data:` ones."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

# Keys OpenAI always sends (as null when empty); every other None is left out of the body.
_CHOICE_KEYS = ("logprobs", "finish_reason")


def openai_json(body: BaseModel | dict[str, Any]) -> dict[str, Any]:
    data = body.model_dump(exclude_none=True, by_alias=True) if isinstance(body, BaseModel) else body
    for choice in data.get("choices", ()) if isinstance(data.get("choices"), list) else ():
        for key in _CHOICE_KEYS:
            choice.setdefault(key, None)
        if "message" in choice:
            choice["message"].setdefault("content", None)
    return data


def _compact_json(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def sse_event(body: BaseModel | dict[str, Any], *, null_usage: bool = False) -> str:
    """`null_usage`: the stream was asked for usage, so, as OpenAI does, each chunk before the usage chunk
    carries `"usage": null`."""
    data = openai_json(body)
    if null_usage:
        data.setdefault("usage", None)
    return f"data: {_compact_json(data)}\n\n"


def sse_typed_event(data: dict[str, Any]) -> str:
    """An event named by its body's 'type' (`event: TYPE`, then the data line): Anthropic's and Responses' shape."""
    return f"event: {data['type']}\ndata: {_compact_json(data)}\n\n"


def sse_done() -> str:
    return "data: [DONE]\n\n"


def sse_error(body: dict[str, Any]) -> str:
    """An in-band error event, then [DONE]: for failures after the stream's status line was sent."""
    return sse_event(body) + sse_done()
