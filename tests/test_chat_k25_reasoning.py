"""Reasoning parser for prompts that already opened <think> (K2.5 / K2.6 thinking, K2.7-Code): one state machine,
ends at </think> or an unclosed tool-call section, markers split at every position, empty blocks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kserve.chat import StreamingReasoningParser, split_reasoning
from kserve.chat.dialect import K2, K2_5, K2_6, K2_7_CODE, K2_THINKING
from kserve.chat.markers import SECTION_BEGIN, SECTION_BEGIN_ALIAS

CALL = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"

# (output after a prompt ending in <think>, reasoning, content)
PREFILLED = [
    ("Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("</think>", "", ""),
    ("</think>Just the answer.", "", "Just the answer."),
    ("still thinking", "still thinking", ""),
    ("", "", ""),
    ("plan" + SECTION_BEGIN + CALL, "plan", SECTION_BEGIN + CALL),
    ("plan" + SECTION_BEGIN_ALIAS + CALL, "plan", SECTION_BEGIN_ALIAS + CALL),
    ("plan</think>" + SECTION_BEGIN + CALL, "plan", SECTION_BEGIN + CALL),
    ("a</think>b</think>c", "a", "b</think>c"),
    ("a < b </thin", "a < b </thin", ""),
    ("<think>nested?</think>x", "<think>nested?", "x"),
]
# (output after a prompt without <think>, reasoning or None, content)
OPENING = [
    ("<think></think>", "", ""),
    ("<think></think>Answer.", "", "Answer."),
    ("  <think>r</think>c", "r", "c"),
    ("<think>r" + SECTION_BEGIN + CALL, "r", SECTION_BEGIN + CALL),
    ("plain", None, "plain"),
    ("   ", None, "   "),
]


def _stream(text: str, cuts: list[int], starts_in_reasoning: bool) -> tuple[str, str, bool]:
    parser = StreamingReasoningParser(starts_in_reasoning=starts_in_reasoning)
    bounds = [0, *cuts, len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [parser.finish()]
    assert all("</think>" not in d.reasoning for d in deltas)
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), parser.saw_reasoning


@pytest.mark.parametrize("text,reasoning,content", PREFILLED)
def test_prefilled_whole(text, reasoning, content):
    assert split_reasoning(text, starts_in_reasoning=True) == (reasoning, content)


@pytest.mark.parametrize("text,reasoning,content", PREFILLED)
def test_prefilled_split_at_every_position(text, reasoning, content):
    for cut in range(len(text) + 1):
        assert _stream(text, [cut], True)[:2] == (reasoning, content), cut
    assert _stream(text, list(range(1, len(text))), True)[:2] == (reasoning, content)  # one character at a time


@pytest.mark.parametrize("text,reasoning,content", OPENING)
def test_opening_split_at_every_pair_of_positions(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            got_reasoning, got_content, saw = _stream(text, [a, b], False)
            assert (got_reasoning if saw else None, got_content) == (reasoning, content), (a, b)


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(["a", " ", "<", "</", "think>", "</think>", "<think>", SECTION_BEGIN[:9],
                                        SECTION_BEGIN[9:], "é", "\n"]), max_size=10),
       sizes=st.lists(st.integers(1, 7), min_size=1, max_size=5), prefilled=st.booleans())
def test_any_chunking_agrees_with_the_whole(pieces, sizes, prefilled):
    text = "".join(pieces)
    cuts, pos, i = [], 0, 0
    while True:
        pos += sizes[i % len(sizes)]
        i += 1
        if pos >= len(text):
            break
        cuts.append(pos)
    reasoning, content = split_reasoning(text, starts_in_reasoning=prefilled)
    got_reasoning, got_content, saw = _stream(text, cuts, prefilled)
    assert (got_reasoning if saw else None, got_content) == (reasoning, content)
    if reasoning is not None:
        # nothing is lost: the whole output is the reasoning, then its end marker (if any), then the content
        assert text.startswith(("" if prefilled else text[: len(text) - len(text.lstrip())] + "<think>") + reasoning)


def test_parser_start_state_comes_from_the_dialect():
    assert [d.starts_in_reasoning() for d in (K2, K2_THINKING, K2_5, K2_6, K2_7_CODE)] == [
        False, False, True, True, True]
    assert [d.starts_in_reasoning(thinking=False) for d in (K2_5, K2_6, K2_7_CODE)] == [False, False, True]
    parser = StreamingReasoningParser(starts_in_reasoning=K2_6.starts_in_reasoning())
    assert parser.saw_reasoning and parser.state.value == "reasoning"
    assert StreamingReasoningParser().state.value == "opening"  # the old constructor still works
