"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API over the chat path.

A Messages request is translated into a chat-completions body and prepared by `prepare_chat`, so the prompt, grammar,
sampling and tool parsing are those of `/v1/chat/completions`. Only the wire format is Anthropic's: content blocks,
`stop_reason`, usage, errors and the event stream. Details: docs/server.md, 'Anthropic Messages'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from kserve.server.anthropic_errors import error_body, invalid
from kserve.server.anthropic_protocol import (
    UNSUPPORTED_MESSAGES_FIELDS,
    AnthropicToolChoice,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
)
from kserve.server.chat_request import function_tool, render_chat, rendered_prompt
from kserve.server.chat_turn import FinishedTurn, TurnDelta, run_turn, stream_turn
from kserve.server.context import ServingContext
from kserve.server.errors import APIError, stream_failure
from kserve.server.media import image_part, require_image_support
from kserve.server.protocol import ChatCompletionRequest
from kserve.server.serving_chat import PreparedChat, prepare_chat
from kserve.server.sse import sse_typed_event
from kserve.server.thinking import thinking_body
from kserve.server.validation import reject_unsupported, schema_problem

logger = logging.getLogger("kserve.server")

_STOP_REASONS: Mapping[str, str] = MappingProxyType({"tool_calls": "tool_use", "length": "max_tokens"})
_UNSUPPORTED_BLOCKS: Mapping[str, str] = MappingProxyType({
    "document": "document blocks are not supported (this model takes text only)",
    "search_result": "search_result blocks are not supported",
    "container_upload": "container_upload blocks are not supported",
})
_SERVER_BLOCKS = ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                  "code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result")
_STRUCTURED_OUTPUT_NAME = "output"
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # what Anthropic's API takes
_THINKING_SWITCH: Mapping[str, bool | None] = MappingProxyType({"enabled": True, "disabled": False, "adaptive": None})
_NOT_ID_CHARS = re.compile(r"[^A-Za-z0-9_-]")


# ----------------------------------------------------------------------------- request translation


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text: a text block needs a string 'text'")
    return text


def _text_blocks(blocks: Any, where: str, what: str) -> str:
    """Text blocks joined with nothing between them (as chat content parts are)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise invalid(f"{where}: {what} must be a string or a list of text blocks")
    texts: list[str] = []
    for k, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise invalid(f"{where}.{k}: {what} may only hold text blocks, got {kind!r}")
        texts.append(_text(block, f"{where}.{k}"))
    return "".join(texts)


def _check_block_type(block: Any, where: str, allowed: tuple[str, ...], role: str) -> str:
    if not isinstance(block, dict):
        raise invalid(f"{where}: a content block must be an object, got {type(block).__name__}")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise invalid(f"{where}: a content block needs a string 'type'")
    if kind in allowed:
        return kind
    if kind in _UNSUPPORTED_BLOCKS:
        raise invalid(f"{where}: {_UNSUPPORTED_BLOCKS[kind]}")
    if kind in _SERVER_BLOCKS:
        raise invalid(f"{where}: {kind!r} blocks (Anthropic's server tools) are not supported")
    known = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
    if kind in known:
        raise invalid(f"{where}: a {role} message may not hold a {kind!r} block")
    raise invalid(f"{where}: unknown content block type {kind!r} (supported: {', '.join(allowed)})")


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as a chat image part: a base64 source becomes a data: URL, a url source stays a URL
    (fetched only from --allowed-media-domains; kserve.server.media checks it)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise invalid(f"{where}.source: an image block needs a 'source' object")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise invalid(f"{where}.source.media_type: must be one of {', '.join(IMAGE_MEDIA_TYPES)}, "
                          f"got {media_type!r}")
        if not isinstance(data, str) or not data:
            raise invalid(f"{where}.source.data: a base64 image source needs its base64 'data'")
        return image_part(f"data:{media_type};base64,{data}", where)
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise invalid(f"{where}.source.url: a url image source needs a string 'url'")
        return image_part(url, where)
    if kind == "file":
        raise invalid(f"{where}.source: file sources (the Files API) are not supported; send the image as a "
                      "base64 or url source")
    raise invalid(f"{where}.source.type: must be 'base64' or 'url', got {kind!r}")


def _turn_content(pieces: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text and image parts as a chat turn's content: a string without images, else text and image parts."""
    if all(isinstance(piece, str) for piece in pieces):
        return "".join(pieces)  # type: ignore[arg-type]
    return [{"type": "text", "text": piece} if isinstance(piece, str) else piece for piece in pieces]


def _tool_result_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A tool_result's content: a string, or text and image blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: tool_result content must be a string or a list of text and image blocks")
    pieces: list[str | dict[str, Any]] = []
    for k, block in enumerate(content):
        at = f"{where}.{k}"
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text":
            pieces.append(_text(block, at))
        elif kind == "image":
            pieces.append(_image(block, at))
        else:
            raise invalid(f"{at}: tool_result content may only hold text and image blocks, got {kind!r}")
    return _turn_content(pieces)


def _image_blocks(req: CountTokensRequest) -> Iterator[str]:
    """Where each image block of the request is (user messages and their tool results)."""
    for i, msg in enumerate(req.messages):
        if isinstance(msg.content, str):
            continue
        for j, block in enumerate(msg.content):
            if not isinstance(block, dict):
                continue
            if block.get("type") == "image":
                yield f"messages.{i}.content.{j}"
            elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
                for k, inner in enumerate(block["content"]):
                    if isinstance(inner, dict) and inner.get("type") == "image":
                        yield f"messages.{i}.content.{j}.content.{k}"


def _check_images_supported(ctx: ServingContext, req: CountTokensRequest) -> None:
    """Images to a model without a vision tower: one 400 saying so, before any block is looked at closely."""
    where = next(_image_blocks(req), None)
    if where is not None:
        require_image_support(ctx, where, "image blocks")


def _user_turns(msg: MessageParam, where: str, open_calls: set[str]) -> list[dict[str, Any]]:
    """A user message: runs of text and image blocks become user turns, each tool_result a tool turn."""
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    if not msg.content:
        raise invalid(f"{where}.content: must hold at least one content block")
    out: list[dict[str, Any]] = []
    texts: list[str | dict[str, Any]] = []
    for j, block in enumerate(msg.content):
        at = f"{where}.content.{j}"
        kind = _check_block_type(block, at, ("text", "image", "tool_result"), "user")
        if kind == "text":
            texts.append(_text(block, at))
            continue
        if kind == "image":
            texts.append(_image(block, at))
            continue
        if texts:
            out.append({"role": "user", "content": _turn_content(texts)})
            texts = []
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str):
            raise invalid(f"{at}.tool_use_id: a tool_result block needs a string 'tool_use_id'")
        if call_id not in open_calls:
            raise invalid(f"{at}: tool_result for tool_use_id {call_id!r}, but the preceding assistant message has no "
                          f"tool_use block with that id (its ids: {', '.join(sorted(open_calls)) or 'none'})")
        if "is_error" in block and not isinstance(block["is_error"], bool):
            raise invalid(f"{at}.is_error must be a boolean")
        content = _tool_result_content(block.get("content", ""), f"{at}.content")
        out.append({"role": "tool", "tool_call_id": call_id, "content": content})
    if texts:
        out.append({"role": "user", "content": _turn_content(texts)})
    return out


def _assistant_turn(msg: MessageParam, where: str) -> tuple[dict[str, Any], set[str]]:
    """An assistant message as one chat turn (text, reasoning, tool calls) and the tool_use ids it opened."""
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}, set()
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(msg.content):
        at = f"{where}.content.{j}"
        kind = _check_block_type(block, at, ("text", "tool_use", "thinking", "redacted_thinking"), "assistant")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            value = block.get("thinking")
            if not isinstance(value, str):
                raise invalid(f"{at}.thinking: a thinking block needs a string 'thinking'")
            thinking.append(value)
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise invalid(f"{at}: a tool_use block needs string 'id' and 'name'")
            if not isinstance(arguments, dict):
                raise invalid(f"{at}.input: a tool_use block's 'input' must be an object")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        # redacted_thinking is opaque (encrypted by another provider): nothing to render
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        turn["tool_calls"] = calls
    if thinking:
        turn["reasoning_content"] = "".join(thinking)
    return turn, {c["id"] for c in calls}


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text_blocks(req.system, "system", "'system'")})
    if not req.messages:
        raise invalid("messages: at least one message is required")
    open_calls: set[str] = set()
    for i, msg in enumerate(req.messages):
        where = f"messages.{i}"
        if msg.role == "user":
            out.extend(_user_turns(msg, where, open_calls))
            open_calls = set()
        else:
            turn, open_calls = _assistant_turn(msg, where)
            out.append(turn)
    if req.messages[-1].role == "assistant":  # prefill: the reply continues it (chat_body)
        last = out[-1]
        if last.get("tool_calls") or last.get("reasoning_content"):
            raise invalid(f"messages.{len(req.messages) - 1}: a final assistant message is continued as the reply's "
                          "text, so it may hold text blocks only (no tool_use or thinking)")
    return out


def _check_prefill(req: CountTokensRequest) -> None:
    """What cannot follow a prefilled reply, said in this API's terms (chat completions would name its own)."""
    final = req.messages[-1].content
    text = final if isinstance(final, str) else "".join(b.get("text", "") for b in final if isinstance(b, dict))
    if text != text.rstrip():  # Anthropic's rule: the tokenizer puts a space before the next word, not after this
        raise invalid("final assistant content cannot end with trailing whitespace")
    if req.output_format is not None or (req.output_config is not None and req.output_config.format is not None):
        raise invalid("a prefilled assistant message cannot be combined with a structured output format: the format "
                      "constrains the whole reply, whose start is already written")
    if req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        raise invalid(f"a prefilled assistant message cannot be combined with tool_choice {req.tool_choice.type!r}: "
                      "the reply would have to open a tool call instead of continuing the text")


def _check_schema(schema: Any, where: str) -> None:
    problem = schema_problem(schema, where)
    if problem is not None:
        raise invalid(problem)


def chat_tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise invalid(f"tools.{i}: tool type {tool.type!r} (an Anthropic server tool) is not supported; "
                          "declare custom tools with name, description and input_schema")
        _check_schema(tool.input_schema, f"tools.{i}.input_schema")
        tools.append(function_tool(tool.name, tool.description, tool.input_schema, tool.strict))
    return tools


def _chat_tool_choice(choice: AnthropicToolChoice, has_tools: bool) -> str | dict[str, Any]:
    if choice.type in ("any", "tool") and not has_tools:
        raise invalid(f"tool_choice.type {choice.type!r} needs 'tools'")
    if choice.type == "tool":
        if choice.name is None:
            raise invalid("tool_choice: type 'tool' needs the tool's 'name'")
        return {"type": "function", "function": {"name": choice.name}}
    return {"any": "required"}.get(choice.type, choice.type)


def chat_body(req: CountTokensRequest) -> dict[str, Any]:
    """The chat-completions body this request means (sampling fields only for a MessagesRequest)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.messages[-1].role == "assistant":
        _check_prefill(req)
        body["continue_final_message"] = True
    if req.thinking is not None:
        body.update(thinking_body(_THINKING_SWITCH[req.thinking.type]))
    tools = chat_tools(req)
    if tools is not None:
        body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice, bool(tools))
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    output_format = req.output_config.format if req.output_config is not None else None
    output_format = output_format or req.output_format
    if output_format is not None:
        where = "output_config.format.schema" if req.output_format is None else "output_format.schema"
        _check_schema(output_format.schema_, where)
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": _STRUCTURED_OUTPUT_NAME, "schema": output_format.schema_, "strict": True}}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(req, name)
            if value is not None:
                body[name] = value
        if req.stop_sequences is not None:
            body["stop"] = req.stop_sequences
        user = (req.metadata or {}).get("user_id")
        if isinstance(user, str):
            body["user"] = user
    return body


def _chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(body)


async def prepare_messages(ctx: ServingContext, req: MessagesRequest, raw: dict[str, Any]) -> PreparedChat:
    reject_unsupported(raw, UNSUPPORTED_MESSAGES_FIELDS)
    _check_images_supported(ctx, req)
    body = chat_body(req)
    prep = await prepare_chat(ctx, _chat_request(body), body)
    return dataclasses.replace(prep, request_id=f"msg_{uuid.uuid4().hex}")


async def count_tokens(ctx: ServingContext, req: CountTokensRequest, raw: dict[str, Any]) -> dict[str, Any]:
    """The prompt length the same request would have (no generation, no grammar); images count as their
    placeholder tokens."""
    reject_unsupported(raw, UNSUPPORTED_MESSAGES_FIELDS)
    _check_images_supported(ctx, req)
    body = chat_body(req)
    return {"input_tokens": len(await rendered_prompt(ctx, render_chat(ctx, _chat_request(body), body)))}


# ----------------------------------------------------------------------------- responses


def _stop_reason(turn: FinishedTurn) -> str:
    if turn.finish_reason in _STOP_REASONS:
        return _STOP_REASONS[turn.finish_reason]
    return "stop_sequence" if turn.stop_sequence is not None else "end_turn"


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_id(call_id: str) -> str:
    """K2's call id (`functions.NAME:IDX`) in the characters Anthropic allows in ids (history ids are renumbered
    when rendered, so the spelling only has to be stable and Anthropic-valid)."""
    return "toolu_" + _NOT_ID_CHARS.sub("_", call_id)


def _usage(turn: FinishedTurn) -> dict[str, int]:
    cached = min(turn.usage.cached_tokens, turn.usage.prompt_tokens)
    return {"input_tokens": turn.usage.prompt_tokens - cached, "output_tokens": turn.usage.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_body(request_id: str, model: str, turn: FinishedTurn) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if turn.reasoning:
        content.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content:
        content.append({"type": "text", "text": turn.content})
    for call in turn.calls:
        content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                        "input": _tool_input(turn.arguments(call))})
    return {"id": request_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(turn), "stop_sequence": turn.stop_sequence, "usage": _usage(turn)}


class _ContentBlocks:
    """Opens and closes content blocks as the deltas change kind: thinking, text, one tool_use per call."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.call_index: int | None = None

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = kind
        return [*events, sse_typed_event({"type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_typed_event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse_typed_event({"type": "content_block_stop", "index": self.index})]

    def feed(self, delta: TurnDelta) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            if self.kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.calls:
            if call.id is not None:
                events += self._open("tool_use", {"type": "tool_use", "id": tool_use_id(call.id),
                                                  "name": call.function.name, "input": {}})
                self.call_index = call.index
            arguments = call.function.arguments
            if arguments and self.kind == "tool_use" and call.index == self.call_index:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events


async def stream_messages(ctx: ServingContext, prep: PreparedChat) -> AsyncIterator[str]:
    """Anthropic's event stream; an error after the first event is an in-band `error` event."""
    start_usage = {"input_tokens": len(prep.prompt_ids), "output_tokens": 0, "cache_read_input_tokens": 0,
                   "cache_creation_input_tokens": 0}
    yield sse_typed_event({"type": "message_start", "message": {
        "id": prep.request_id, "type": "message", "role": "assistant", "model": ctx.model_name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
    yield sse_typed_event({"type": "ping"})
    blocks = _ContentBlocks()
    try:
        async with contextlib.aclosing(stream_turn(ctx, prep)) as events:  # closing aborts the engine request now
            async for event in events:
                if isinstance(event, TurnDelta):
                    for text in blocks.feed(event):
                        yield text
                    continue
                for text in blocks.close():
                    yield text
                yield sse_typed_event({"type": "message_delta",
                           "delta": {"stop_reason": _stop_reason(event), "stop_sequence": event.stop_sequence},
                           "usage": _usage(event)})
                yield sse_typed_event({"type": "message_stop"})
    except APIError as exc:
        logger.warning("request %s: %s", prep.request_id, exc.message)
        yield sse_typed_event(error_body(exc))
    except Exception as exc:
        logger.exception("request %s: error while streaming", prep.request_id)
        yield sse_typed_event(error_body(stream_failure(exc)))


async def run_messages(ctx: ServingContext, prep: PreparedChat, request: Any) -> dict[str, Any]:
    return message_body(prep.request_id, ctx.model_name, await run_turn(ctx, prep, request))
