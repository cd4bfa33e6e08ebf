"""`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`: OpenAI's Responses API over the chat path.

The instructions and input items (plus, with `previous_response_id`, the stored conversation before it) become a
chat-completions body prepared by `prepare_chat`: same template, grammar, sampling and tool parser. Only the wire
format differs: output items, status, usage, typed events with `sequence_number`s. Details: docs/server.md, 'Responses'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from kserve.engine.outputs import TokenLogprob
from kserve.server.chat_request import function_tool
from kserve.server.chat_turn import FinishedTurn, TurnDelta, run_turn, stream_turn
from kserve.server.context import ServingContext
from kserve.server.errors import APIError, bad_request, stream_failure
from kserve.server.logprobs import chat_logprobs
from kserve.server.media import image_part, require_image_support
from kserve.server.protocol import ChatCompletionRequest
from kserve.server.responses_protocol import (
    INCLUDE_OUTPUT_LOGPROBS,
    UNSUPPORTED_RESPONSES_FIELDS,
    NamedFunctionChoice,
    ResponsesRequest,
)
from kserve.server.responses_store import ResponseStore, StoredResponse
from kserve.server.serving_chat import PreparedChat, prepare_chat
from kserve.server.sse import sse_typed_event
from kserve.server.thinking import effort_thinking, thinking_body
from kserve.server.validation import reject_unsupported, schema_problem

logger = logging.getLogger("kserve.server")

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_MEDIA_PARTS: Mapping[str, str] = MappingProxyType({
    "input_file": "file input is not supported (this model takes text only)",
    "input_audio": "audio input is not supported (this model takes text only)",
})


# An input item stored without an id gets one, prefixed as OpenAI prefixes that kind of item.
_ITEM_ID_PREFIXES = MappingProxyType({"message": "msg", "function_call": "fc", "function_call_output": "fco",
                                      "reasoning": "rs"})


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def store_disabled(what: str) -> APIError:
    return APIError(400, f"{what} needs the response store, which this server has turned off "
                         "(--responses-store-size 0)", param=what.strip("'"), code="response_store_disabled")


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"response {response_id!r} not found (never stored, or dropped from the bounded store)",
                    param=param, code="response_not_found")


# ----------------------------------------------------------------------------- request translation


def _input_image(part: dict[str, Any], at: str) -> dict[str, Any]:
    """An input_image part as a chat image part (`image_url`: a data: URL, or an http(s) URL fetched only from
    --allowed-media-domains; kserve.server.media checks it). `detail` is accepted and changes nothing."""
    if part.get("file_id") is not None:
        raise bad_request(f"'{at}.file_id': file ids are not supported (there is no Files API); send the image "
                          "in 'image_url' as a data: URL", f"{at}.file_id", "unsupported_parameter")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise bad_request(f"'{at}': an input_image part needs a string 'image_url'", f"{at}.image_url",
                          "missing_required_parameter")
    return image_part(url, at, part.get("detail"))


def _message_text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or (with images) text and image chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or a list of content parts", f"{where}.content")
    pieces: list[str | dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            pieces.append(_input_image(part, at))
            continue
        if kind in _MEDIA_PARTS:
            raise bad_request(f"'{at}': {_MEDIA_PARTS[kind]}", f"{at}.type", "unsupported_content")
        field = "refusal" if kind == "refusal" else "text"
        if kind not in (*_TEXT_PARTS, "refusal"):
            raise bad_request(f"'{at}': unknown content part type {kind!r} (supported: input_text, output_text, "
                              "input_image, refusal)", f"{at}.type")
        if not isinstance(part.get(field), str):
            raise bad_request(f"'{at}': a {kind} part needs a string {field!r}", f"{at}.{field}",
                              "missing_required_parameter")
        if pieces and isinstance(pieces[-1], str):
            pieces[-1] += part[field]
        else:
            pieces.append(part[field])
    if all(isinstance(piece, str) for piece in pieces):
        return "".join(pieces)  # type: ignore[arg-type]
    return [{"type": "text", "text": piece} if isinstance(piece, str) else piece for piece in pieces]


def _image_parts(conversation: list[tuple[str, dict[str, Any]]]) -> Iterator[str]:
    """Where each input_image of the conversation is."""
    for where, item in conversation:
        # as chat_messages names them: a function_call_output's parts are '<where>.output.content[j]'
        for key, at in (("content", where), ("output", f"{where}.output")):
            parts = item.get(key)
            if isinstance(parts, list):
                for j, part in enumerate(parts):
                    if isinstance(part, dict) and part.get("type") == "input_image":
                        yield f"{at}.content[{j}]"


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"'{where}.{key}' is required and must be a string", f"{where}.{key}",
                          "missing_required_parameter")
    return value


def normalize_items(request_input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items with their `type` filled in (a bare string is one user message)."""
    if isinstance(request_input, str):
        return [{"type": "message", "role": "user", "content": request_input}]
    if not request_input:
        raise bad_request("'input' must hold at least one item", "input")
    items: list[dict[str, Any]] = []
    for item in request_input:
        if "type" not in item and "role" in item:
            item = {"type": "message", **item}
        items.append(item)
    return items


def chat_messages(instructions: str | None, items: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Chat turns for (where, item) pairs; `where` names the item in errors."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
    assistant: dict[str, Any] | None = None  # the assistant turn that further assistant-side items join
    call_ids: set[str] = set()

    def assistant_turn(fresh: bool) -> dict[str, Any]:
        nonlocal assistant
        if assistant is None or fresh:
            assistant = {"role": "assistant", "content": None}
            out.append(assistant)
        return assistant

    for where, item in items:
        kind = item.get("type")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise bad_request(f"'{where}.role' must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r}",
                                  f"{where}.role", "invalid_role")
            text = _message_text(item.get("content"), where)
            if role == "assistant":
                turn = assistant_turn(assistant is not None and (assistant["content"] is not None
                                                                  or "tool_calls" in assistant))
                turn["content"] = text
            else:
                assistant = None
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            arguments = _string(item, "arguments", where)
            turn = assistant_turn(False)
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
            call_ids.add(call_id)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in call_ids:
                raise bad_request(f"'{where}': no function_call with call_id {call_id!r} precedes this "
                                  "function_call_output", f"{where}.call_id", "unknown_call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _message_text(output, f"{where}.output")
            assistant = None
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            turn = assistant_turn(assistant is not None and (assistant["content"] is not None
                                                              or "tool_calls" in assistant))
            turn["reasoning_content"] = _reasoning_text(item)
        elif kind == "item_reference":
            raise bad_request(f"'{where}': item references are not supported; send the items themselves or use "
                              "'previous_response_id'", f"{where}.type", "unsupported_parameter")
        else:
            raise bad_request(f"'{where}': unknown or unsupported input item type {kind!r} (supported: message, "
                              "function_call, function_call_output, reasoning)", f"{where}.type")
    return out


def _check_schema(schema: Any, param: str) -> None:
    problem = schema_problem(schema, f"'{param}'")
    if problem is not None:
        raise bad_request(problem, param, "invalid_schema")


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(req.tools):
        if tool.type != "function":
            raise bad_request(f"'tools[{i}].type' {tool.type!r} is not supported; only function tools are",
                              f"tools[{i}].type", "unsupported_parameter")
        if tool.name is None:
            raise bad_request(f"'tools[{i}].name' is required", f"tools[{i}].name", "missing_required_parameter")
        if tool.parameters is not None:
            _check_schema(tool.parameters, f"tools[{i}].parameters")
        tools.append(function_tool(tool.name, tool.description, tool.parameters, tool.strict))
    return tools


def _echoed_tools(raw: dict[str, Any]) -> list[Any]:
    """The request's tools as the response lists them: a function's `strict` as applied."""
    tools = raw.get("tools") or []
    return [{**tool, "strict": tool.get("strict") is not False}
            if isinstance(tool, dict) and tool.get("type") == "function" else tool for tool in tools]


def _chat_tool_choice(choice: str | NamedFunctionChoice) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        raise bad_request(f"'tool_choice' of type {choice.type!r} is not supported; use 'auto', 'none', 'required' "
                          "or {\"type\": \"function\", \"name\": ...}", "tool_choice", "unsupported_parameter")
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        raise bad_request("'text.format' of type 'json_schema' needs 'name' and 'schema'", "text.format",
                          "missing_required_parameter")
    _check_schema(fmt.schema_, "text.format.schema")
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.description is not None:
        schema["description"] = fmt.description
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def chat_body(req: ResponsesRequest, conversation: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.instructions, conversation)}
    body.update(thinking_body(effort_thinking(req.reasoning.effort if req.reasoning is not None else None,
                                              "reasoning.effort")))
    tools = chat_tools(req)
    if tools is not None:
        body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    response_format = _response_format(req)
    if response_format is not None:
        body["response_format"] = response_format
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "user"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if INCLUDE_OUTPUT_LOGPROBS in (req.include or []):  # as OpenAI: `top_logprobs` alone returns none
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    return body


@dataclass
class PreparedResponse:
    chat: PreparedChat
    req: ResponsesRequest
    raw: dict[str, Any]
    created_at: int
    items: list[dict[str, Any]]  # the conversation so far (stored ones first), without instructions
    store: bool

    @property
    def response_id(self) -> str:
        return self.chat.request_id


async def _prepare_chat(ctx: ServingContext, req: ResponsesRequest,
                        conversation: list[tuple[str, dict[str, Any]]]) -> PreparedChat:
    body = chat_body(req, conversation)
    try:
        # Responses, unlike chat completions, holds a function to its schema unless it says `strict: false`
        return await prepare_chat(ctx, ChatCompletionRequest.model_validate(body), body, strict_by_default=True)
    except APIError as exc:  # the conversation as a whole (too long, unrenderable) is this API's `input`
        if exc.param == "messages":
            exc.param = "input"
        raise


def _is_instruction(item: dict[str, Any]) -> bool:
    return item.get("type") == "message" and item.get("role") in ("system", "developer")


async def _truncated(ctx: ServingContext, req: ResponsesRequest, conversation: list[tuple[str, dict[str, Any]]],
                     too_long: APIError) -> PreparedChat:
    """`truncation: "auto"`: the conversation less its oldest turns, as few dropped as fit the context. A turn starts
    at a user message, so a call is never kept without its output; system and developer messages stay."""
    starts = [i for i, (_, item) in enumerate(conversation)
              if i > 0 and item.get("type") == "message" and item.get("role") == "user"]

    def kept(cut: int) -> list[tuple[str, dict[str, Any]]]:
        return [pair for i, pair in enumerate(conversation) if i >= cut or _is_instruction(pair[1])]

    best: PreparedChat | None = None  # the tail from the earliest turn start that fits (fitting is monotone)
    lo, hi = 0, len(starts) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            best, hi = await _prepare_chat(ctx, req, kept(starts[mid])), mid - 1
        except APIError as exc:
            if exc.code != "context_length_exceeded":
                raise
            lo = mid + 1
    if best is None:  # even the last turn alone is too long
        raise too_long
    return best


async def prepare_response(ctx: ServingContext, store: ResponseStore, req: ResponsesRequest,
                           raw: dict[str, Any]) -> PreparedResponse:
    reject_unsupported(raw, UNSUPPORTED_RESPONSES_FIELDS)
    if req.store is True and not store.enabled:
        raise store_disabled("'store'")
    previous: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if not store.enabled:
            raise store_disabled("'previous_response_id'")
        entry = store.get(req.previous_response_id)
        if entry is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        previous = entry.items
    new_items = normalize_items(req.input)
    single = isinstance(req.input, str)
    conversation = [("previous_response", item) for item in previous]
    conversation += [("input" if single else f"input[{i}]", item) for i, item in enumerate(new_items)]
    image_at = next(_image_parts(conversation), None)
    if image_at is not None:  # a model without a vision tower: one 400 saying so
        require_image_support(ctx, f"'{image_at}'", "input_image", f"{image_at}.type")
    try:
        prep = await _prepare_chat(ctx, req, conversation)
    except APIError as exc:
        if req.truncation != "auto" or exc.code != "context_length_exceeded":
            raise
        prep = await _truncated(ctx, req, conversation, exc)
    limits = [n for n in (prep.max_calls, req.max_tool_calls) if n is not None]
    prep = dataclasses.replace(prep, request_id=_new_id("resp"), max_calls=min(limits) if limits else None)
    return PreparedResponse(prep, req, raw, int(time.time()), previous + new_items,
                            store.enabled and req.store is not False)


# ----------------------------------------------------------------------------- response objects


def _usage(ctx: ServingContext, turn: FinishedTurn) -> dict[str, Any]:
    reasoning_tokens = len(ctx.tokenizer.encode(turn.reasoning, allow_special_tokens=False)) if turn.reasoning else 0
    return {"input_tokens": turn.usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": turn.usage.cached_tokens},
            "output_tokens": turn.usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, turn.usage.completion_tokens)},
            "total_tokens": turn.usage.prompt_tokens + turn.usage.completion_tokens}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [_reasoning_part(text)]}


def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(item_id: str, text: str | None, status: str,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _logprobs(ctx: ServingContext, prep: PreparedResponse, entries: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """Engine logprobs in the `output_text.logprobs` shape (the chat one: token, logprob, bytes, top_logprobs)."""
    if not entries:
        return []
    return [entry.model_dump() for entry in chat_logprobs(ctx.tokenizer, entries, prep.chat.top_logprobs)]


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _item_status(turn: FinishedTurn) -> str:
    return "incomplete" if turn.finish_reason == "length" else "completed"


def output_items(turn: FinishedTurn, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Reasoning, message, calls; the last item is `incomplete` when max_output_tokens cut the turn."""
    items: list[dict[str, Any]] = []
    if turn.reasoning:
        items.append(_reasoning_item(_new_id("rs"), turn.reasoning))
    if turn.content or not turn.calls:
        items.append(_message_item(_new_id("msg"), turn.content, "completed", logprobs))
    for call in turn.calls:
        items.append(_call_item(_new_id("fc"), call.id, call.name, turn.arguments(call), "completed"))
    if "status" in items[-1]:
        items[-1]["status"] = _item_status(turn)
    return items


def response_object(ctx: ServingContext, prep: PreparedResponse, *, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    req, raw = prep.req, prep.raw
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    reasoning = req.reasoning.model_dump() if req.reasoning is not None else {"effort": None, "summary": None}
    return {
        "id": prep.response_id, "object": "response", "created_at": prep.created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error, "incomplete_details": incomplete, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls,
        "model": ctx.model_name, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": reasoning, "store": prep.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": raw.get("text") or {"format": {"type": "text"}},
        "tool_choice": raw.get("tool_choice") or "auto", "tools": _echoed_tools(raw),
        "top_p": 1.0 if req.top_p is None else req.top_p, "top_logprobs": req.top_logprobs,
        "truncation": req.truncation or "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }


def _finished(ctx: ServingContext, store: ResponseStore, prep: PreparedResponse, turn: FinishedTurn,
              output: list[dict[str, Any]]) -> dict[str, Any]:
    status = "incomplete" if turn.finish_reason == "length" else "completed"
    response = response_object(ctx, prep, status=status, output=output, usage=_usage(ctx, turn))
    if prep.store:
        inputs = [item if "id" in item else {"id": _new_id(_ITEM_ID_PREFIXES.get(item.get("type"), "item")), **item}
                  for item in prep.items]
        store.put(prep.response_id, StoredResponse(response, inputs + output, len(inputs)))
    return response


async def run_response(ctx: ServingContext, store: ResponseStore, prep: PreparedResponse,
                       request: Any) -> dict[str, Any]:
    turn = await run_turn(ctx, prep.chat, request)
    return _finished(ctx, store, prep, turn, output_items(turn, _logprobs(ctx, prep, turn.logprobs)))


def get_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    if not store.enabled:
        raise store_disabled("retrieving a response")
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    return entry.response


def _listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """An item as OpenAI lists it: a message's string content becomes one text part."""
    if item.get("type") != "message" or not isinstance(item.get("content"), str):
        return item
    part = "output_text" if item.get("role") == "assistant" else "input_text"
    return {**item, "content": [{"type": part, "text": item["content"]}]}


def list_input_items(store: ResponseStore, response_id: str, *, limit: int, order: str,
                     after: str | None) -> dict[str, Any]:
    """One page of the items a stored response was generated from (OpenAI's list shape; newest first by default)."""
    if not store.enabled:
        raise store_disabled("listing a response's input items")
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    if not 1 <= limit <= 100:
        raise bad_request(f"'limit' must be between 1 and 100, got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise bad_request(f"'order' must be 'asc' or 'desc', got {order!r}", "order")
    items = entry.items[: entry.input_count]
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise bad_request(f"'after' names no input item of response {response_id!r}: {after!r}", "after")
        items = items[ids.index(after) + 1:]
    page = [_listed_item(item) for item in items[:limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def delete_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    if not store.enabled:
        raise store_disabled("deleting a response")
    if not store.delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


# ----------------------------------------------------------------------------- streaming


class _EventWriter:
    """Typed SSE events with increasing sequence numbers, and the output items as they open and close."""

    def __init__(self) -> None:
        self.sequence = itertools.count()
        self.output: list[dict[str, Any]] = []  # finished items, in output order
        self.item: dict[str, Any] | None = None  # the open item
        self.text = ""  # the open item's text (message/reasoning) or arguments (function_call)
        self.logprobs: list[dict[str, Any]] = []  # the open message's, when the request asked for them
        self.call_index: int | None = None

    def event(self, kind: str, **fields: Any) -> str:
        return sse_typed_event({"type": kind, **fields, "sequence_number": next(self.sequence)})

    @property
    def index(self) -> int:
        return len(self.output)

    def _open(self, item: dict[str, Any]) -> list[str]:
        events = self.close("completed")
        self.item, self.text, self.logprobs = item, "", []
        events.append(self.event("response.output_item.added", output_index=self.index, item=item))
        part = {"message": _output_text(""), "reasoning": _reasoning_part("")}.get(item["type"])
        if part is not None:
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                     content_index=0, part=part))
        return events

    def close(self, status: str) -> list[str]:
        item = self.item
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.index}
        events: list[str] = []
        if item["type"] == "message":
            done = _message_item(item["id"], self.text, status, self.logprobs)
            events.append(self.event("response.output_text.done", **where, content_index=0, text=self.text,
                                     logprobs=self.logprobs))
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=_output_text(self.text, self.logprobs)))
        elif item["type"] == "reasoning":
            done = _reasoning_item(item["id"], self.text)
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self.text))
            events.append(self.event("response.content_part.done", **where, content_index=0,
                                     part=_reasoning_part(self.text)))
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], self.text, status)
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=self.text))
        events.append(self.event("response.output_item.done", output_index=self.index, item=done))
        self.output.append(done)
        self.item = None
        return events

    def feed(self, delta: TurnDelta, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        """Events for one delta; `logprobs` are its text's, in the wire shape."""
        logprobs = logprobs or []
        events: list[str] = []
        if delta.reasoning:
            if self.item is None or self.item["type"] != "reasoning":
                events += self._open({"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []})
            events.append(self.event("response.reasoning_text.delta", item_id=self.item["id"],
                                     output_index=self.index, content_index=0, delta=delta.reasoning))
            self.text += delta.reasoning
        if delta.content:
            if self.item is None or self.item["type"] != "message":
                events += self._open(_message_item(_new_id("msg"), None, "in_progress"))
            events.append(self.event("response.output_text.delta", item_id=self.item["id"], output_index=self.index,
                                     content_index=0, delta=delta.content, logprobs=logprobs))
            self.text += delta.content
            self.logprobs += logprobs
        for call in delta.calls:
            if call.id is not None:
                events += self._open(_call_item(_new_id("fc"), call.id, call.function.name, "", "in_progress"))
                self.call_index = call.index
            arguments = call.function.arguments
            is_open = self.item is not None and self.item["type"] == "function_call"
            if arguments and is_open and call.index == self.call_index:
                events.append(self.event("response.function_call_arguments.delta", item_id=self.item["id"],
                                         output_index=self.index, delta=arguments))
                self.text += arguments
        return events

    def finish(self, turn: FinishedTurn) -> list[str]:
        """Close the open item; a turn with neither text nor calls still gets its (empty) message item."""
        events = self.close(_item_status(turn))
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            events += self._open(_message_item(_new_id("msg"), None, "in_progress"))
            events += self.close(_item_status(turn))
        return events


async def stream_response(ctx: ServingContext, store: ResponseStore, prep: PreparedResponse) -> AsyncIterator[str]:
    writer = _EventWriter()
    started = response_object(ctx, prep, status="in_progress", output=[])
    yield writer.event("response.created", response=started)
    yield writer.event("response.in_progress", response=started)
    try:
        async with contextlib.aclosing(stream_turn(ctx, prep.chat)) as events:  # closing aborts the engine request
            async for event in events:
                if isinstance(event, TurnDelta):
                    for text in writer.feed(event, _logprobs(ctx, prep, event.logprobs)):
                        yield text
                    continue
                for text in writer.finish(event):
                    yield text
                response = _finished(ctx, store, prep, event, writer.output)
                kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                yield writer.event(kind, response=response)
    except Exception as exc:
        if isinstance(exc, APIError):
            logger.warning("request %s: %s", prep.response_id, exc.message)
            error = exc
        else:
            logger.exception("request %s: error while streaming", prep.response_id)
            error = stream_failure(exc)
        yield writer.event("error", code=error.code, message=error.message, param=error.param)
        failed = response_object(ctx, prep, status="failed", output=writer.output,
                                 error={"code": error.code or "server_error", "message": error.message})
        yield writer.event("response.failed", response=failed)
