"""The built-in Kimi prompt renderer (no jinja): one code path for every generation, driven by a ``ChatDialect``.

For K2-Instruct (dialect ``k2``) it is byte-exact to the seed's documented format: it follows the current template (V4
``render_content`` style) with one deliberate deviation, where the seed wins: the injected default system turn is not
followed by the ``\\n`` that the reconstructed V4 template's ``{% endif %}`` leaves behind (the seed: "turns are
otherwise contiguous"). For K2-Thinking, K2.5, K2.6 and K2.7-Code it gives the bytes of Moonshot's own templates.
"""

from __future__ import annotations

import json
from typing import Any

from kserve.chat.dialect import K2, ChatDialect, HistoryReasoning, PreparedTools, ToolDeclarationFormat, prepare_tools
from kserve.chat.markers import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    IM_ASSISTANT,
    IM_END,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    SECTION_BEGIN,
    SECTION_END,
    THINK_BEGIN,
    THINK_END,
)


def _shown(value: Any, dialect: ChatDialect) -> str:
    """How the template prints a value that is present; null prints as the dialect's null_text."""
    return dialect.null_text if value is None else str(value)


def _shown_key(mapping: dict, key: str, dialect: ChatDialect) -> str:
    """How the template prints ``mapping[key]``: nothing when the key is absent (jinja's undefined)."""
    return _shown(mapping[key], dialect) if key in mapping else ""


def _is_image_part(part: dict, dialect: ChatDialect) -> bool:
    return part.get("type") in dialect.image_part_types or any(key in part for key in dialect.image_part_keys)


def render_content(message: dict, dialect: ChatDialect = K2) -> str:
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
            if _is_image_part(part, dialect):
                pieces.append(dialect.image_placeholder)
            elif part.get("type") in dialect.video_part_types:
                pieces.append(dialect.video_placeholder)
            else:
                pieces.append(_shown_key(part, "text", dialect))
        return "".join(pieces)
    raise ValueError(f"message content must be a string, a list of parts or null, got {type(content).__name__}")


def _tool_calls_section(tool_calls: list, dialect: ChatDialect) -> str:
    parts = [SECTION_BEGIN]
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)  # HF tojson: default separators
        parts.append(f"{CALL_BEGIN}{_shown_key(call, 'id', dialect)}{ARGUMENT_BEGIN}{arguments}{CALL_END}")
    parts.append(SECTION_END)
    return "".join(parts)


def _header(message: dict, dialect: ChatDialect) -> str:
    role = message.get("role")
    name = message.get("name") or _shown_key(message, "role", dialect)
    marker = IM_USER if role == "user" else IM_ASSISTANT if role == "assistant" else IM_SYSTEM
    return f"{marker}{_shown(name, dialect)}{IM_MIDDLE}"


def render_message(message: dict, dialect: ChatDialect = K2, reasoning: str | None = None) -> str:
    """One turn; ``reasoning`` (None: no block) is written as ``<think>...</think>`` before an assistant's content."""
    role = message.get("role")
    if role == "assistant":
        think = "" if reasoning is None else f"{THINK_BEGIN}{reasoning}{THINK_END}"
        body = think + render_content(message, dialect)
        if message.get("tool_calls"):
            body += _tool_calls_section(message["tool_calls"], dialect)
    elif role == "tool":
        body = f"## Return of {_shown_key(message, 'tool_call_id', dialect)}\n{render_content(message, dialect)}"
    else:
        body = render_content(message, dialect)
    return f"{_header(message, dialect)}{body}{IM_END}"


def _reasoning_of(message: dict, dialect: ChatDialect) -> str:
    for key in dialect.reasoning_fields:
        if key in message:  # a present null wins over a later field, as message.get(k, fallback) does
            return _shown(message[key], dialect)
    return ""


def _last_answer_index(messages: list[dict]) -> int:
    """Index of the last assistant message without tool calls (-1 if none): where history ends."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "assistant" and not messages[index].get("tool_calls"):
            return index
    return -1


def _reasoning_blocks(messages: list[dict], dialect: ChatDialect, thinking: Any, preserve_thinking: Any) -> list:
    """Per message, the reasoning its ``<think>`` block shows (None: no block). Follows the templates' tests exactly:
    ``thinking is false`` / ``preserve_thinking is false`` are identity tests, ``not preserve_thinking`` truthiness."""
    if dialect.history_reasoning is HistoryReasoning.NONE:
        return [None] * len(messages)
    if dialect.history_reasoning is HistoryReasoning.PRESERVE:
        return [_reasoning_of(m, dialect) for m in messages]
    preserving = dialect.honours_preserve_thinking and bool(preserve_thinking)
    history_end = -1 if preserving else _last_answer_index(messages)
    blank_current = (dialect.blanks_reasoning_without_thinking and thinking is False
                     and not (dialect.honours_preserve_thinking and preserve_thinking is not False))
    return ["" if index <= history_end or blank_current else _reasoning_of(message, dialect)
            for index, message in enumerate(messages)]


def tool_declaration_text(dialect: ChatDialect, prepared: PreparedTools) -> str | None:
    """The ``tool_declare`` turn's body, or None when there is no such turn."""
    tools = prepared.tools
    if not tools:
        return None
    fmt = dialect.tool_declaration
    if fmt is ToolDeclarationFormat.TYPESCRIPT and prepared.typescript:
        return prepared.typescript
    if fmt is ToolDeclarationFormat.JSON_SORTED_SPACED:
        return json.dumps(tools, ensure_ascii=False)
    return json.dumps(tools, ensure_ascii=False, separators=(",", ":"))


def render_prepared(dialect: ChatDialect, messages: list[dict], prepared: PreparedTools,
                    add_generation_prompt: bool = True, thinking: Any = None, preserve_thinking: Any = None) -> str:
    """Render with tools already prepared (``prepare_tools``); None kwargs take the dialect's defaults."""
    thinking = dialect.thinking_default if thinking is None else thinking
    preserve_thinking = dialect.preserve_thinking_default if preserve_thinking is None else preserve_thinking
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError(f"messages must be objects, got {type(message).__name__}")
    out: list[str] = []
    declaration = tool_declaration_text(dialect, prepared)
    if declaration is not None:
        out.append(f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{declaration}{IM_END}")
    wants_system = (messages[0].get("role") != "system") if messages else dialect.default_system_without_messages
    if dialect.default_system_prompt is not None and wants_system:
        out.append(f"{IM_SYSTEM}system{IM_MIDDLE}{dialect.default_system_prompt}{IM_END}")
    blocks = _reasoning_blocks(messages, dialect, thinking, preserve_thinking)
    for message, reasoning in zip(messages, blocks):
        out.append(render_message(message, dialect, reasoning))
    if add_generation_prompt:
        out.append(f"{IM_ASSISTANT}assistant{IM_MIDDLE}{dialect.prefill(thinking)}")
    return "".join(out)


def render_builtin(messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True, *,
                   dialect: ChatDialect = K2, thinking: bool | None = None,
                   preserve_thinking: bool | None = None) -> str:
    """The prompt for ``messages`` in ``dialect``'s format (K2-Instruct's by default)."""
    return render_prepared(dialect, messages, prepare_tools(dialect, tools), add_generation_prompt,
                           thinking, preserve_thinking)
