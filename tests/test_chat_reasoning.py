"""K2-Thinking reasoning split (opt-in): whole and streaming agree for every chunking."""

from __future__ import annotations

import pytest
from test_chat_support import SB

from kserve.chat import StreamingReasoningParser, split_reasoning

CASES = [
    ("<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("\n <think>a</think>\nb", "a", "\nb"),
    ("<think>unterminated reasoning", "unterminated reasoning", ""),
    ("No reasoning here.", None, "No reasoning here."),
    ("Text then <think>x</think>", None, "Text then <think>x</think>"),
    ("<think></think>", "", ""),
    ("<think>plan" + SB + "<|tool_call_begin|>functions.f:0", "plan", SB + "<|tool_call_begin|>functions.f:0"),
    ("<thin", None, "<thin"),
    ("", None, ""),
    ("<think>a</thi", "a</thi", ""),
]


@pytest.mark.parametrize("text,reasoning,content", CASES)
def test_split_reasoning(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("text,reasoning,content", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_streaming_reasoning_matches_whole(text, reasoning, content, size):
    parser = StreamingReasoningParser()
    deltas = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    assert "".join(d.reasoning for d in deltas) == (reasoning or "")
    assert "".join(d.content for d in deltas) == content
    assert all("</think>" not in d.reasoning for d in deltas)
