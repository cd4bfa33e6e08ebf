"""The built-in Kimi K2 prompt renderer (no jinja), byte-exact to the seed's documented format.

Follows the current template (V4 ``render_content`` style) with one deliberate deviation, where the seed wins: the
injected default system turn is not followed by the ``\\n`` that the reconstructed V4 template's ``{% endif %}``
leaves behind (the seed: "turns are otherwise contiguous").
"""

from __future__ import annotations

import json
from typing import Any

from kserve.chat.markers import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    DEFAULT_SYSTEM_PROMPT,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    SECTION_BEGIN,
    SECTION_END,
)

MEDIA_PLACEHOLDER = "<|media_start|>image<|media_content|><|media_pad|><|media_end|>\n"


def _text(value: Any) -> str:
    """How the template prints a field; a null field prints nothing (as when HF drops None-valued keys)."""
    return "" if value is None else str(value)


def _is_image_part(part: dict) -> bool:
    return part.get("type") == "image" or "image" in part or "image_url" in part


def render_content(message: dict) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        pieces = []
        for part in content:
            if not isinstance(part, dict):
                raise ValueError(f"content parts must be objects, got {type(part).__name__}")
            pieces.append(MEDIA_PLACEHOLDER if _is_image_part(part) else _text(part.get("text")))
        return "".join(pieces)
    raise ValueError(f"message content must be a string, a list of parts or null, got {type(content).__name__}")


def _tool_calls_section(tool_calls: list) -> str:
    parts = [SECTION_BEGIN]
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)  # HF tojson: default separators
        parts.append(f"{CALL_BEGIN}{_text(call.get('id'))}{ARGUMENT_BEGIN}{arguments}{CALL_END}")
    parts.append(SECTION_END)
    return "".join(parts)


def _header(message: dict) -> str:
    role = message.get("role")
    name = message.get("name") or role
    marker = IM_USER if role == "user" else IM_ASSISTANT if role == "assistant" else IM_SYSTEM
    return f"{marker}{_text(name)}{IM_MIDDLE}"


def render_message(message: dict) -> str:
    role = message.get("role")
    if role == "assistant" and message.get("tool_calls"):
        body = render_content(message) + _tool_calls_section(message["tool_calls"])
    elif role == "tool":
        body = f"## Return of {_text(message.get('tool_call_id'))}\n{render_content(message)}"
    else:
        body = render_content(message)
    return f"{_header(message)}{body}{IM_END}"


def render_builtin(messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
    out: list[str] = []
    if tools:
        out.append(f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{json.dumps(tools, ensure_ascii=False, separators=(',', ':'))}{IM_END}")
    if messages and messages[0].get("role") != "system":
        out.append(f"{IM_SYSTEM}system{IM_MIDDLE}{DEFAULT_SYSTEM_PROMPT}{IM_END}")
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError(f"messages must be objects, got {type(message).__name__}")
        out.append(render_message(message))
    if add_generation_prompt:
        out.append(f"{IM_ASSISTANT}assistant{IM_MIDDLE}")
    return "".join(out)
