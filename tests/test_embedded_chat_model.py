"""The embedded model really talks, thinks and calls tools: `kserve serve` with no arguments (a K2.6-format
model: thinking on by default, the reasoning parser, TypeScript tool declarations), the official `openai`
client, `tool_choice` auto and the default tool grammar, greedy, streamed and not."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from eval_tool_calls import FORCED_PROBE, forced_probe, score  # noqa: E402
from gen_tool_data import generate  # noqa: E402
from live_server import openai_client  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "description": "Temperature unit", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What's the weather like in Paris today?"}]
RESULT = json.dumps({"temperature": 18, "condition": "sunny"})


def _reasoning(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def _streamed(client: Any, model: str, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """One streamed turn folded into the shape of a non-streamed message."""
    reasoning, content, calls, finish = [], [], {}, None
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], temperature=0,
                                                stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            slot["name"] += call.function.name or ""
            slot["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"reasoning": "".join(reasoning) or None, "content": "".join(content), "finish": finish,
            "calls": [calls[i] for i in sorted(calls)]}


def _check_thought(reasoning: str | None) -> None:
    # one short sentence about what the user wants and what the turn does
    assert reasoning and reasoning.strip().endswith(".") and ", so I will " in reasoning and len(reasoning) < 300


def test_weather_question_gets_a_thought_then_get_weather_then_a_one_sentence_answer(server, ctx):
    client = openai_client(server)
    first = client.chat.completions.create(model=ctx.model_name, messages=QUESTION, tools=[WEATHER], temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    _check_thought(_reasoning(choice.message))
    assert "get_weather" in _reasoning(choice.message)
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert json.loads(call.function.arguments)["city"] == "Paris"  # copied from the question

    messages = QUESTION + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = client.chat.completions.create(model=ctx.model_name, messages=messages, tools=[WEATHER], temperature=0)
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    _check_thought(_reasoning(answer.message))
    text = answer.message.content.strip()
    assert "18" in text and text.endswith(".") and text.count(". ") == 0  # one sentence, read from the result


def test_the_same_turns_streamed(server, ctx):
    client = openai_client(server)
    first = _streamed(client, ctx.model_name, QUESTION)
    assert first["finish"] == "tool_calls", first
    _check_thought(first["reasoning"])
    assert [c["name"] for c in first["calls"]] == ["get_weather"]
    assert json.loads(first["calls"][0]["arguments"])["city"] == "Paris"
    assistant = {"role": "assistant", "content": first["content"], "reasoning_content": first["reasoning"],
                 "tool_calls": [{"id": c["id"], "type": "function",
                                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in first["calls"]]}
    messages = QUESTION + [assistant, {"role": "tool", "tool_call_id": first["calls"][0]["id"], "content": RESULT}]
    second = _streamed(client, ctx.model_name, messages)
    assert second["finish"] == "stop" and not second["calls"]
    _check_thought(second["reasoning"])
    assert "18" in second["content"]


def test_thinking_off_still_calls_the_tool_without_reasoning(server, ctx):
    client = openai_client(server)
    off = {"chat_template_kwargs": {"thinking": False}}
    first = client.chat.completions.create(model=ctx.model_name, messages=QUESTION, tools=[WEATHER], temperature=0,
                                           extra_body=off)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not _reasoning(choice.message)
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"
    chat = client.chat.completions.create(model=ctx.model_name, messages=[{"role": "user", "content": "Hi!"}],
                                          temperature=0, max_tokens=64, extra_body=off)
    assert chat.choices[0].finish_reason == "stop" and not _reasoning(chat.choices[0].message)


def test_held_out_conversations_call_the_right_tool_and_plain_chats_stop(server, ctx):
    """A small held-out sample (another seed, phrasings never trained on): the shipped model gets 88% right tool,
    80% exact arguments and 100% plain stops; a random model makes no tool call, and one that does not copy (an
    earlier model, 12%) fails the arguments floor. The README's figures come from
    `python scripts/eval_tool_calls.py --count 200 --seed 1`."""
    rows = generate(seed=7, count=40, split="heldout")
    result = score(openai_client(server), ctx.model_name, rows)
    assert result["tool_call_rate"] >= 0.5, result["failures"]
    assert result["exact_args_rate"] >= 0.3, result["failures"]
    assert result["plain_stop_rate"] >= 0.8, result["failures"]


def test_forced_calls_to_a_numbers_only_tool_end_before_the_cap_with_thinking_off(server, ctx):
    """`eval_tool_calls.py --forced`: with no thought before it, each forced call to a tool whose arguments hold
    only numbers is finite by the grammar (objects closed, each run of digits capped at 20; open objects and
    unbounded numbers ran the vendor suite's case to the cap), so only calling again and again could reach the
    cap; at these seeds none does. The other schemas are counted, not bounded (a free string can run on)."""
    probe = forced_probe(openai_client(server), ctx.model_name, 2, thinking=False)
    assert set(probe) == set(FORCED_PROBE)
    assert probe["nested numbers"] == "0 of 2 at the cap"
    assert all(v.endswith(" of 2 at the cap") for v in probe.values())
