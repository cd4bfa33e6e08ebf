"""Kimi K2 control-token strings used by the renderer and the output parsers."""

from __future__ import annotations

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
# Singular spellings some engines accept "if the tokenizer has them"; treated as aliases when they show up as text.
SECTION_BEGIN_ALIAS = "<|tool_call_section_begin|>"
SECTION_END_ALIAS = "<|tool_call_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"

TOOL_MARKERS = (SECTION_BEGIN, SECTION_END, SECTION_BEGIN_ALIAS, SECTION_END_ALIAS, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

THINK_BEGIN = "<think>"
THINK_END = "</think>"

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."


def partial_marker_suffix(text: str, markers: tuple[str, ...], start: int = 0) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of one of ``markers``.

    Only the last ``max(len(marker)) - 1`` characters are examined, so the cost does not grow with ``text``.
    """
    longest = max(len(m) for m in markers) - 1
    first = max(start, len(text) - longest)
    for i in range(first, len(text)):
        tail = text[i:]
        if any(m.startswith(tail) for m in markers):
            return len(text) - i
    return 0
