"""The internal chat request every chat-shaped endpoint goes through: checks, normalization and prompt ids.

Chat completions, Anthropic Messages, OpenAI Responses and `/tokenize` all translate their wire format into a
`ChatCompletionRequest` (plus the raw dict it was built from) and render it here, so one conversation gives one
prompt whichever API carried it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kserve.chat import normalize_tool_call_ids
from kserve.server.context import ServingContext
from kserve.server.errors import bad_request
from kserve.server.protocol import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest
from kserve.server.validation import (
    check_chat_request,
    normalize_messages,
    normalize_tools,
    reject_unsupported,
    resolve_tool_choice,
)


@dataclass
class RenderedChat:
    """A checked conversation and the prompt ids the chat template encodes it to."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any]  # 'none' | 'auto' | 'required' | {"type": "function", "function": {...}}
    prompt_ids: list[int]


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None,
                  strict: bool | None) -> dict[str, Any]:
    """A chat-completions function tool, leaving out the fields not given (the prompt shows each key)."""
    function = {"name": name, "description": description, "parameters": parameters, "strict": strict}
    return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


def render_chat(ctx: ServingContext, req: ChatCompletionRequest, raw: dict[str, Any], *,
                add_generation_prompt: bool = True) -> RenderedChat:
    """Check `req` (`raw` is the body as sent, for fields the model drops) and encode its prompt."""
    reject_unsupported(raw, UNSUPPORTED_CHAT_FIELDS)
    ctx.check_model(req.model)
    check_chat_request(req)
    messages = normalize_tool_call_ids(normalize_messages(req.messages))
    tools = normalize_tools(req.tools, raw.get("tools"))
    tool_choice = resolve_tool_choice(req.tool_choice, tools)
    try:
        prompt_ids = ctx.template.encode(ctx.tokenizer, messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         legacy=ctx.settings.legacy_prompt_encoding)
    except (ValueError, TypeError, KeyError) as exc:
        raise bad_request(f"could not render the conversation with the chat template: {exc}", "messages") from None
    return RenderedChat(messages, tools, tool_choice, prompt_ids)
