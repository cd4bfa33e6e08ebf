"""Reasoning split: a leading ``<think>...</think>`` becomes ``reasoning_content`` (opt-in), whole or streamed.

One state machine: OPENING (only whitespace so far; a ``<think>`` opens reasoning, anything else is content),
REASONING, CONTENT. A parser made with ``starts_in_reasoning=True`` begins in REASONING, for prompts that already end
with ``<think>`` (K2.5 / K2.6 with thinking on, K2.7-Code: ``ChatDialect.starts_in_reasoning``). Reasoning ends at
``</think>`` (dropped) or, with none, at a tool-call section start (kept in the content, for the tool parser); an
unterminated block is all reasoning. A marker split across deltas is held back until it is decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kserve.chat.markers import SECTION_BEGIN, SECTION_BEGIN_ALIAS, THINK_BEGIN, THINK_END, PartialMarkerMatcher

# What ends a reasoning block: its closing tag, or a tool-call section the model opened without closing it.
_REASONING_ENDS = (THINK_END, SECTION_BEGIN, SECTION_BEGIN_ALIAS)
_PARTIAL_END = PartialMarkerMatcher(_REASONING_ENDS)


class ReasoningState(str, Enum):
    OPENING = "opening"
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class StreamingReasoningParser:
    """Feed text deltas, get reasoning / content deltas; ``finish()`` flushes what was held back."""

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self.state = ReasoningState.REASONING if starts_in_reasoning else ReasoningState.OPENING
        self._pending = ""  # text not yet decidable: leading whitespace / a partial <think>, or a partial end marker
        self.saw_reasoning = starts_in_reasoning

    def feed(self, text_delta: str) -> ReasoningDelta:
        out = ReasoningDelta()
        text = self._pending + text_delta
        self._pending = ""
        if self.state is ReasoningState.OPENING:
            stripped = text.lstrip()
            if stripped.startswith(THINK_BEGIN):
                self.state = ReasoningState.REASONING
                self.saw_reasoning = True
                text = stripped[len(THINK_BEGIN):]
            elif THINK_BEGIN.startswith(stripped):  # whitespace or a partial <think>: not decidable yet
                self._pending = text
                return out
            else:
                self.state = ReasoningState.CONTENT
        if self.state is ReasoningState.REASONING:
            end, marker = _first_end(text)
            if end < 0:
                hold = _PARTIAL_END.suffix_len(text)
                out.reasoning = text[: len(text) - hold]
                self._pending = text[len(text) - hold:]
                return out
            out.reasoning = text[:end]
            self.state = ReasoningState.CONTENT
            # </think> is dropped; a tool-call section start stays, for the tool parser.
            text = text[end + len(marker):] if marker == THINK_END else text[end:]
        out.content += text
        return out

    def finish(self) -> ReasoningDelta:
        text, self._pending = self._pending, ""
        if self.state is ReasoningState.REASONING:
            return ReasoningDelta(reasoning=text)
        return ReasoningDelta(content=text)


def _first_end(text: str) -> tuple[int, str]:
    """Position and text of the earliest reasoning end in ``text`` ((-1, "") when none)."""
    best, which = -1, ""
    for marker in _REASONING_ENDS:
        i = text.find(marker)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, marker
    return best, which


def split_reasoning(text: str, *, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) for a whole output; reasoning is None when the output has no reasoning block (never
    when ``starts_in_reasoning``: the prompt opened one)."""
    parser = StreamingReasoningParser(starts_in_reasoning=starts_in_reasoning)
    first = parser.feed(text)
    last = parser.finish()
    if not parser.saw_reasoning:
        return None, first.content + last.content
    return first.reasoning + last.reasoning, first.content + last.content
