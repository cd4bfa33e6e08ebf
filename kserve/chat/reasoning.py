"""K2-Thinking reasoning split: a leading ``<think>...</think>`` becomes ``reasoning_content`` (opt-in).

Leading whitespace before ``<think>`` is allowed. Reasoning ends at ``</think>`` (dropped) or at a tool-call section
start (which stays in the content, for the tool parser); an unterminated block is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from kserve.chat.markers import SECTION_BEGIN, THINK_BEGIN, THINK_END, PartialMarkerMatcher

_ENDS = (THINK_END, SECTION_BEGIN)
_PARTIAL_END = PartialMarkerMatcher(_ENDS)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class StreamingReasoningParser:
    def __init__(self) -> None:
        self._state = "start"  # start -> reasoning -> content, or start -> content
        self._pending = ""
        self.saw_reasoning = False

    def feed(self, text_delta: str) -> ReasoningDelta:
        out = ReasoningDelta()
        text = self._pending + text_delta
        self._pending = ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(THINK_BEGIN):
                self._state = "reasoning"
                self.saw_reasoning = True
                text = stripped[len(THINK_BEGIN):]
            elif THINK_BEGIN.startswith(stripped):
                self._pending = text  # not decidable yet
                return out
            else:
                self._state = "content"
        if self._state == "reasoning":
            end, marker = self._find_end(text)
            if end < 0:
                hold = _PARTIAL_END.suffix_len(text)
                out.reasoning = text[: len(text) - hold]
                self._pending = text[len(text) - hold:]
                return out
            out.reasoning = text[:end]
            self._state = "content"
            text = text[end + len(marker):] if marker == THINK_END else text[end:]
        out.content += text
        return out

    def finish(self) -> ReasoningDelta:
        text, self._pending = self._pending, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=text)
        return ReasoningDelta(content=text)

    @staticmethod
    def _find_end(text: str) -> tuple[int, str]:
        best, which = -1, ""
        for marker in _ENDS:
            i = text.find(marker)
            if i >= 0 and (best < 0 or i < best):
                best, which = i, marker
        return best, which


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) for a whole output; reasoning is None when the output has no leading ``<think>``."""
    parser = StreamingReasoningParser()
    first = parser.feed(text)
    last = parser.finish()
    if not parser.saw_reasoning:
        return None, first.content + last.content
    return first.reasoning + last.reasoning, first.content + last.content
