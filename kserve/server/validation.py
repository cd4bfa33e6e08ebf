"""Request checks that go beyond field types: roles, tools, tool_choice, response_format, stops.

Each check raises `APIError` (400) with a message that names the offending field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema

from kserve.server.errors import APIError, bad_request
from kserve.server.media import IMAGE_PART_TYPE, WHERE_KEY
from kserve.server.protocol import (
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    ResponseFormat,
    ToolDefinition,
)

# `_input` is the K2 vendor verifier's resource role; its client rewrites it to system/"resource".
ROLE_ALIASES = MappingProxyType({"developer": ("system", None), "_input": ("system", "resource")})
# Moonshot's wrapper hands K2-Thinking-on templates the roles as sent: `developer` renders under its own name.
ROLE_ALIASES_KEEPING_DEVELOPER = MappingProxyType({"_input": ROLE_ALIASES["_input"]})
ROLES = ("system", "user", "assistant", "tool")
# Letters and digits of any script (Kimi's own tool names may be Chinese), '_', '.', '-'.
TOOL_NAME_RE = re.compile(r"[\w.\-]{1,64}")
# Reasoning keys of an assistant message; one sent as null is kept (Moonshot's templates print it as "None").
REASONING_FIELDS = ("reasoning_content", "reasoning")
TOOL_CHOICE_MODES = ("none", "auto", "required")


def reject_unsupported(raw: dict[str, Any], unsupported: Mapping[str, str]) -> None:
    present = [k for k in unsupported if raw.get(k) is not None]
    if present:
        reasons = "; ".join(unsupported[k] for k in present)
        raise APIError(400, f"unsupported parameter{'s' if len(present) > 1 else ''} "
                            f"{', '.join(repr(k) for k in present)}: {reasons}",
                       param=present[0], code="unsupported_parameter")


def check_continued(messages: list[dict[str, Any]]) -> None:
    """A 400 unless the final message is one a reply can continue (vLLM's continue_final_message, Anthropic's
    prefill): an assistant's, with text only, since neither a tool call nor reasoning resumes as answer text."""
    where = f"messages[{len(messages) - 1}]"
    last = messages[-1]
    if last["role"] != "assistant":
        raise bad_request(f"'continue_final_message' needs a final assistant message to continue; {where} is a "
                          f"{last['role']} message", "continue_final_message")
    if last.get("tool_calls"):
        raise bad_request(f"{where}: a final assistant message with tool calls cannot be continued",
                          f"{where}.tool_calls")
    for key in REASONING_FIELDS:
        if last.get(key):
            raise bad_request(f"{where}: a continued assistant message cannot carry reasoning (the reply does not "
                              "think)", f"{where}.{key}")
    if last.get("content") is not None and not isinstance(last["content"], str):
        raise bad_request(f"{where}: a continued assistant message needs text content", f"{where}.content")


def normalize_stop(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad_request("'stop' sequences must be non-empty strings", "stop")
    return stops


def normalize_messages(messages: list[ChatMessage], *,
                       role_aliases: Mapping[str, tuple[str, str | None]] = ROLE_ALIASES) -> list[dict[str, Any]]:
    """Validated messages as plain dicts for the chat template (aliases resolved, None fields dropped but for
    reasoning keys sent as null)."""
    if not messages:
        raise bad_request("'messages' must contain at least one message", "messages", "empty_messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role, default_name = msg.role, None
        if role in role_aliases:
            role, default_name = role_aliases[role]
        if role not in ROLES and role not in ROLE_ALIASES:  # an alias left as sent keeps its name
            allowed = ", ".join(ROLES + tuple(ROLE_ALIASES))
            raise bad_request(f"{where}.role {msg.role!r} is not one of: {allowed}", f"{where}.role", "invalid_role")
        item: dict[str, Any] = {"role": role}
        name = msg.name or default_name
        if name is not None:
            item["name"] = name
        item["content"] = _content(msg, where, role)
        if msg.tools is not None:  # dynamic tools: checked with the request's tools (kserve.server.tool_contract)
            item["tools"] = msg.tools
        if msg.tool_calls:
            if role != "assistant":
                raise bad_request(f"{where}: only assistant messages may carry 'tool_calls'", f"{where}.tool_calls")
            item["tool_calls"] = [_history_call(tc, f"{where}.tool_calls[{j}]") for j, tc in enumerate(msg.tool_calls)]
        if role == "tool":
            if msg.tool_call_id is None:
                raise bad_request(f"{where}: a tool message needs 'tool_call_id'", f"{where}.tool_call_id",
                                  "missing_required_parameter")
            item["tool_call_id"] = msg.tool_call_id
        if role == "assistant":
            for key in REASONING_FIELDS:
                if key in msg.model_fields_set:
                    item[key] = getattr(msg, key)
        if role == "user" and item["content"] is None:
            raise bad_request(f"{where}: a user message needs 'content'", f"{where}.content",
                              "missing_required_parameter")
        out.append(item)
    return out


def _content(msg: ChatMessage, where: str, role: str) -> str | list[dict[str, Any]] | None:
    content = msg.content
    if content is None:
        return "" if role == "tool" else None
    if isinstance(content, str):
        return content
    # Text parts are joined with nothing between them, as K2's template concatenates them; a string
    # also keeps tool and assistant turns from rendering a Python list literal (vLLM's K2 bug). With images the
    # content stays a list: text runs joined, each image part kept (checked by kserve.server.media).
    pieces: list[str | dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if part.type == IMAGE_PART_TYPE:
            extra = part.model_extra or {}
            pieces.append({"type": IMAGE_PART_TYPE, "image_url": extra.get("image_url"),
                           WHERE_KEY: extra.get(WHERE_KEY) or at})
            continue
        if part.type != "text":
            raise bad_request(f"{at}: content part type {part.type!r} is not supported (supported: text, and "
                              f"{IMAGE_PART_TYPE} on a model with a vision tower)", f"{at}.type", "unsupported_content")
        if part.text is None:
            raise bad_request(f"{at}: a text part needs 'text'", f"{at}.text", "missing_required_parameter")
        if pieces and isinstance(pieces[-1], str):
            pieces[-1] += part.text
        else:
            pieces.append(part.text)
    if all(isinstance(piece, str) for piece in pieces):
        return "".join(pieces)  # type: ignore[arg-type]
    return [{"type": "text", "text": piece} if isinstance(piece, str) else piece for piece in pieces]


def _history_call(tc: Any, where: str) -> dict[str, Any]:
    if tc.type != "function":
        raise bad_request(f"{where}.type must be 'function', got {tc.type!r}", f"{where}.type")
    args = tc.function.arguments
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    call: dict[str, Any] = {"type": "function", "function": {"name": tc.function.name, "arguments": args}}
    if tc.id is not None:
        call["id"] = tc.id
    return call


def tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema a call's arguments must satisfy (no `parameters` means no arguments constraint)."""
    params = tool["function"].get("parameters")
    return params if params is not None else {"type": "object"}


# Keywords whose values are data, not subschemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_SCHEMA_ROOT_URI = "urn:kserve:request-schema"


def _refs(node: Any) -> list[str]:
    if isinstance(node, list):
        return [r for item in node for r in _refs(item)]
    if not isinstance(node, dict):
        return []
    found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    for key, value in node.items():
        if key not in _DATA_KEYWORDS:
            found.extend(_refs(value))
    return found


def schema_dialect(schema: Any) -> type:
    """The validator class for `schema`, or SchemaError when it is not a JSON schema.

    Its declared dialect (2020-12 when it names none); a schema that fails there but is valid draft-07,
    the dialect most client schemas are written in (`"$id": "#user"`, say), is taken as draft-07.
    """
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
        return cls
    except jsonschema.SchemaError:
        if not (isinstance(schema, dict) and "$schema" not in schema):
            raise
        try:
            jsonschema.Draft7Validator.check_schema(schema)
        except jsonschema.SchemaError:
            pass
        else:
            return jsonschema.Draft7Validator
        raise


def schema_error(schema: Any) -> jsonschema.SchemaError | None:
    """Why `schema` is not a JSON schema (see `schema_dialect`), or None."""
    try:
        schema_dialect(schema)
    except jsonschema.SchemaError as exc:
        return exc
    return None


def unresolvable_ref(schema: Any) -> str | None:
    """Why a `$ref` in `schema` cannot be followed, or None when all resolve within the schema itself.

    `check_schema` accepts any URI in `$ref`; validating against one that points elsewhere (a remote document,
    a missing `#/definitions/...`) fails only at use time. Nothing is fetched: every reference must be local.
    """
    refs = _refs(schema)
    if not refs:
        return None
    dialect = schema.get("$schema", "") if isinstance(schema, dict) else ""
    spec = referencing.jsonschema.specification_with(dialect, default=referencing.jsonschema.DRAFT202012)
    resolver = referencing.Registry().with_resource(_SCHEMA_ROOT_URI, spec.create_resource(schema)).resolver(
        _SCHEMA_ROOT_URI)
    for ref in refs:
        if not ref.startswith("#"):
            return f"$ref {ref!r} points outside the schema (only local '#...' references are supported)"
        try:
            resolver.lookup(ref)
        except referencing.exceptions.Unresolvable:
            return f"$ref {ref!r} does not resolve within the schema"
    return None


def schema_problem(schema: Any, label: str) -> str | None:
    """Why `schema`, the request field `label`, cannot constrain output (not a JSON schema, or a `$ref` that
    does not resolve within it), as a sentence naming `label`; None when it can."""
    exc = schema_error(schema)
    if exc is not None:
        path = "/".join(str(p) for p in exc.path) or "(root)"
        return f"{label} is not a valid JSON schema at {path}: {exc.message}"
    problem = unresolvable_ref(schema)
    if problem is not None:
        return f"{label}: {problem}"
    return None


def normalize_tools(tools: list[ToolDefinition] | None, raw_tools: Any) -> list[dict[str, Any]] | None:
    """The client's tool dicts, unchanged (the prompt shows them key for key), once each is checked."""
    if tools is None:
        return None
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise bad_request(f"{where}.type must be 'function', got {tool.type!r}", f"{where}.type")
        name = tool.function.name
        if not TOOL_NAME_RE.fullmatch(name):
            raise bad_request(f"{where}.function.name {name!r} must be 1-64 characters of letters, digits, "
                              "'_', '-' or '.'", f"{where}.function.name", "invalid_tool_name")
        if name in seen:
            raise bad_request(f"{where}: duplicate tool name {name!r}", f"{where}.function.name", "duplicate_tool")
        seen.add(name)
        params = tool.function.parameters
        if params is not None:
            problem = schema_problem(params, f"{where}.function.parameters of tool {name!r}")
            if problem is not None:
                raise bad_request(problem, f"{where}.function.parameters", "invalid_tool_schema")
        out.append(raw_tools[i])
    return out


def resolve_tool_choice(choice: str | NamedToolChoice | None, tools: list[dict[str, Any]] | None) -> str | dict:
    """'none' | 'auto' | 'required' | {"type": "function", "function": {"name": ...}}; checked against tools."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise bad_request(f"'tool_choice' must be one of {', '.join(TOOL_CHOICE_MODES)} or a named function, "
                              f"got {choice!r}", "tool_choice")
        if choice == "required" and not tools:
            raise bad_request("'tool_choice' is 'required' but no 'tools' were given", "tool_choice")
        return choice
    if choice.type != "function":
        raise bad_request(f"'tool_choice.type' must be 'function', got {choice.type!r}", "tool_choice.type")
    names = [t["function"]["name"] for t in tools or []]
    if choice.function.name not in names:
        raise bad_request(f"'tool_choice' names function {choice.function.name!r}, which is not in 'tools' "
                          f"(declared: {', '.join(names) or 'none'})", "tool_choice.function.name",
                          "unknown_tool")
    return {"type": "function", "function": {"name": choice.function.name}}


def check_response_format(fmt: ResponseFormat | None) -> None:
    if fmt is None or fmt.type != "json_schema":
        return
    if fmt.json_schema is None:
        raise bad_request("'response_format' of type 'json_schema' needs a 'json_schema' object",
                          "response_format.json_schema", "missing_required_parameter")
    problem = schema_problem(fmt.json_schema.schema_, "'response_format.json_schema.schema'")
    if problem is not None:
        raise bad_request(problem, "response_format.json_schema.schema", "invalid_schema")


def check_chat_request(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    check_response_format(req.response_format)
