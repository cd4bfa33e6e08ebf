"""The internal chat request every chat-shaped endpoint goes through: checks, normalization and prompt ids.

Chat completions, Anthropic Messages, OpenAI Responses and `/tokenize` all translate their wire format into a
`ChatCompletionRequest` (plus the raw dict it was built from) and render it here, so one conversation gives one
prompt whichever API carried it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kserve.chat import normalize_tool_call_ids
from kserve.server.context import ServingContext
from kserve.server.errors import bad_request
from kserve.server.media import ImageRef, check_rendered, collect_images, prompt_with_images
from kserve.server.protocol import UNSUPPORTED_CHAT_FIELDS, ChatCompletionRequest
from kserve.server.thinking import (
    ReasoningMode,
    ThinkingSwitch,
    continuing_thinking,
    reasoning_mode,
    requested_thinking,
)
from kserve.server.tool_contract import callable_tools
from kserve.server.validation import (
    ROLE_ALIASES,
    ROLE_ALIASES_KEEPING_DEVELOPER,
    check_chat_request,
    check_continued,
    normalize_messages,
    normalize_tools,
    reject_unsupported,
    resolve_tool_choice,
)


@dataclass
class RenderedChat:
    """A checked conversation and the prompt ids the chat template encodes it to."""

    messages: list[dict[str, Any]]
    # Every tool the model may call: the request's `tools`, then the system messages' dynamic tools, in order.
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any]  # 'none' | 'auto' | 'required' | {"type": "function", "function": {...}}
    prompt_ids: list[int]  # one <|media_pad|> per image (kserve.server.media expands them once images are loaded)
    thinking: ThinkingSwitch = field(default_factory=ThinkingSwitch)  # as the request set it (None: default)
    reasoning: ReasoningMode = field(default_factory=ReasoningMode)  # how the output is split
    images: list[ImageRef] = field(default_factory=list)  # in prompt order


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None,
                  strict: bool | None) -> dict[str, Any]:
    """A chat-completions function tool, leaving out the fields not given (the prompt shows each key)."""
    function = {"name": name, "description": description, "parameters": parameters, "strict": strict}
    return {"type": "function", "function": {key: value for key, value in function.items() if value is not None}}


def render_chat(ctx: ServingContext, req: ChatCompletionRequest, raw: dict[str, Any], *,
                generating: bool = True) -> RenderedChat:
    """Check `req` (`raw` is the body as sent, for fields the model drops) and encode its prompt; `generating`
    is False for `/tokenize`, which may leave the generation prompt out."""
    reject_unsupported(raw, UNSUPPORTED_CHAT_FIELDS)
    ctx.check_model(req.model)
    check_chat_request(req)
    thinking = requested_thinking(req)
    dialect = ctx.template.dialect
    # kserve's K2 format maps `developer` to system; the thinking generations get roles as sent (Moonshot's wrapper).
    aliases = ROLE_ALIASES if dialect.aliases_reasoning_fields else ROLE_ALIASES_KEEPING_DEVELOPER
    messages = normalize_tool_call_ids(normalize_messages(req.messages, role_aliases=aliases))
    messages, images = collect_images(ctx, messages)
    tools = normalize_tools(req.tools, raw.get("tools"))
    all_tools = callable_tools(messages, tools)  # dynamic tools count for tool_choice, grammar and parsing
    tool_choice = resolve_tool_choice(req.tool_choice, all_tools)
    add_generation_prompt = _generation_prompt(req, messages, tool_choice, generating)
    if req.continue_final_message:
        thinking = continuing_thinking(dialect, thinking)
    try:
        prompt_ids = ctx.template.encode(ctx.tokenizer, messages, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         legacy=ctx.settings.legacy_prompt_encoding,
                                         continue_final=req.continue_final_message, **thinking.template_kwargs())
    except RecursionError:  # tools or messages nested deeper than any renderer can walk
        raise bad_request("could not render the conversation: it is nested too deeply", "messages") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise bad_request(f"could not render the conversation with the chat template: {exc}", "messages") from None
    check_rendered(ctx, prompt_ids, images)
    return RenderedChat(messages, all_tools, tool_choice, prompt_ids, thinking,
                        reasoning_mode(dialect, thinking, ctx.settings.enable_reasoning), images)


def _generation_prompt(req: ChatCompletionRequest, messages: list[dict[str, Any]], tool_choice: str | dict[str, Any],
                       generating: bool) -> bool:
    """Whether the prompt ends with a new assistant header, as vLLM reads add_generation_prompt and
    continue_final_message; what a continued reply cannot be given is a 400 here."""
    if not req.continue_final_message:
        if req.add_generation_prompt is False and generating:
            raise bad_request("'add_generation_prompt': false is only supported with 'continue_final_message': "
                              "true (the reply would start without an assistant header)", "add_generation_prompt")
        return req.add_generation_prompt is not False
    if req.add_generation_prompt:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true: the reply "
                          "continues the final assistant message instead of starting a new one",
                          "add_generation_prompt")
    # Both would constrain the reply from its first token, which the given text has already passed.
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request("'response_format' cannot be combined with continuing a final assistant message: the "
                          "format constrains a whole answer, and its start is already written", "response_format")
    if tool_choice not in ("auto", "none"):
        raise bad_request("a forced 'tool_choice' cannot be combined with continuing a final assistant message: "
                          "the reply would have to open a tool call instead of continuing the text", "tool_choice")
    check_continued(messages)
    return False


async def rendered_prompt(ctx: ServingContext, rendered: RenderedChat) -> list[int]:
    """The prompt ids with every image's placeholders counted in (images decoded, not preprocessed): what
    `/tokenize` and `count_tokens` report, equal to the generation's `usage.prompt_tokens`."""
    prompt_ids, _ = await prompt_with_images(ctx, rendered.prompt_ids, rendered.images, preprocess=False)
    return prompt_ids
