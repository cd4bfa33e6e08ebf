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

# The five markers K2's tokenizer defines as single tokens; the parser also accepts the aliases as text.
TOOL_MARKER_TOKENS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
TOOL_MARKERS = TOOL_MARKER_TOKENS + (SECTION_BEGIN_ALIAS, SECTION_END_ALIAS)

THINK_BEGIN = "<think>"
THINK_END = "</think>"

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."


class PartialMarkerMatcher:
    """Finds the longest suffix of a text that is a proper prefix of one of ``markers`` (a marker still arriving).

    Only the last ``max(len(marker)) - 1`` characters are examined, and only at characters that can start a marker,
    so the cost does not grow with the text.
    """

    def __init__(self, markers: tuple[str, ...]):
        self._prefixes = frozenset(m[:k] for m in markers for k in range(1, len(m)))
        self._first_chars = "".join(sorted({m[0] for m in markers}))
        self._window = max(len(m) for m in markers) - 1

    def suffix_len(self, text: str, start: int = 0) -> int:
        first = max(start, len(text) - self._window)
        best = -1
        for ch in self._first_chars:
            i = text.find(ch, first)
            while i != -1 and (best == -1 or i < best):
                if text[i:] in self._prefixes:
                    best = i
                    break
                i = text.find(ch, i + 1)
        return 0 if best == -1 else len(text) - best
