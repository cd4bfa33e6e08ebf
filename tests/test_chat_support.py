"""Shared helpers for the chat-layer tests (no tests here): locating ../shared and hypothesis strategies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import strategies as st

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
K2_DIR = SHARED / "kimi_k2"
TEMPLATES_DIR = K2_DIR / "templates"

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def require_shared(path: Path = K2_DIR) -> Path:
    if not path.exists():
        pytest.skip(f"shared reference files not available ({path})")
    return path


def real_tokenizer():
    from kserve.chat import load_tokenizer

    return load_tokenizer(require_shared())


# Short strings that mix plain text, whitespace, unicode and control-token look-alikes.
_fragments = st.sampled_from(
    ["", " ", "\n", "  x ", "héllo", "你好", "🤖", "<|im_end|>", "<|im_system|>", CB, "{", "}", '"', "\\", "<think>", "'"]
)
texts = st.lists(st.one_of(_fragments, st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)),
                 max_size=4).map("".join)
names = st.from_regex(r"[a-z][a-z0-9_.\-]{0,10}", fullmatch=True)

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(names, inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def tools_lists(draw):
    n = draw(st.integers(0, 2))
    out = []
    for _ in range(n):
        fn = {"name": draw(names), "description": draw(texts)}
        if draw(st.booleans()):
            fn["parameters"] = {
                "type": "object",
                "properties": draw(st.dictionaries(names, st.fixed_dictionaries({"type": st.just("string"), "description": texts}), max_size=2)),
            }
        out.append({"type": "function", "function": fn})
    return out or draw(st.sampled_from([None, []]))


@st.composite
def contents(draw, allow_none=False):
    kind = draw(st.sampled_from(["str", "empty", "parts", "none"] if allow_none else ["str", "empty", "parts"]))
    if kind == "str":
        return draw(texts)
    if kind == "empty":
        return ""
    if kind == "none":
        return None
    return draw(st.lists(texts.map(lambda t: {"type": "text", "text": t}), max_size=3))


@st.composite
def tool_calls(draw):
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(names)
        if draw(st.booleans()):
            args = json.dumps(draw(st.dictionaries(names, json_values, max_size=3)), ensure_ascii=draw(st.booleans()))
        else:
            args = draw(st.dictionaries(names, json_values, max_size=3))
        call_id = draw(st.one_of(st.just(f"functions.{name}:{len(calls)}"), texts))
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    return calls


@st.composite
def messages_strategy(draw):
    msgs = []
    for _ in range(draw(st.integers(1, 6))):
        role = draw(st.sampled_from(["system", "user", "assistant", "tool", "user", "assistant"]))
        msg: dict = {"role": role}
        if role == "assistant":
            msg["content"] = draw(contents(allow_none=True))
            if draw(st.booleans()):
                msg["tool_calls"] = draw(tool_calls())
            if draw(st.integers(0, 3)) == 0:
                msg["reasoning_content"] = draw(texts)
        elif role == "tool":
            msg["tool_call_id"] = draw(st.one_of(names.map(lambda n: f"functions.{n}:0"), texts))
            msg["content"] = draw(contents())
        else:
            msg["content"] = draw(contents())
        if draw(st.integers(0, 3)) == 0:
            msg["name"] = draw(st.one_of(st.just(""), names))
        msgs.append(msg)
    return msgs


conversations = st.tuples(messages_strategy(), tools_lists(), st.booleans())
