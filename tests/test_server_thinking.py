"""Thinking through the server: a tiny random K2.6-layout model (dialect k2.6: the prompt ends with `<think>`)
served on 127.0.0.1 and driven by the official `openai` and `anthropic` SDKs.

A random model almost never writes `</think>` by itself, so tests that need the reasoning to end steer it with a
logit bias on `</think>` (chat completions' own `logit_bias`; for the Anthropic and Responses APIs, which have no
such field, the engine call is tapped to add the same bias). Which bias ends the reasoning after a few tokens
depends on the random weights, so a test tries a short list and checks what it claims on every attempt.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from live_server import openai_client, running_server

from kserve.chat import DIALECTS
from kserve.chat.markers import IM_END, THINK_BEGIN, THINK_END, TOOL_MARKERS
from kserve.config import EngineConfig
from kserve.server.errors import APIError
from kserve.server.thinking import ThinkingSwitch, continuing_thinking, has_thinking_switch

T = TypeVar("T")
UNIT_SCHEMA = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in Paris",
                                            "parameters": UNIT_SCHEMA}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# Biases on `</think>` tried in turn: small ones let some reasoning through first, 100 ends it at once.
THINK_END_BIASES = (6, 8, 10, 12, 4, 14, 100)


@pytest.fixture(scope="module")
def server(tiny_k25_dir):
    with running_server(EngineConfig(model=str(tiny_k25_dir))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def ids(ctx) -> dict[str, int]:
    return {token: ctx.tokenizer.special_ids[token] for token in (THINK_BEGIN, THINK_END, IM_END, "[EOS]")}


@contextlib.contextmanager
def steered(ctx: Any, bias: dict[int, float]) -> Iterator[None]:
    """Every engine request made inside gets `bias` added to its logit bias (for APIs without `logit_bias`)."""
    engine = ctx.engine
    previous = engine.__dict__.get("generate")
    generate = engine.generate

    def tap(request_id, prompt_ids, params):
        params.logit_bias = {**(params.logit_bias or {}), **bias}
        return generate(request_id, prompt_ids, params)

    engine.generate = tap
    try:
        yield
    finally:
        if previous is None:
            del engine.generate
        else:
            engine.generate = previous


def first_attempt(attempt: Callable[[float], T], good: Callable[[T], bool]) -> tuple[float, T]:
    """The first `</think>` bias whose attempt is `good` (each attempt's own checks run inside `attempt`)."""
    tried = []
    for bias in THINK_END_BIASES:
        result = attempt(bias)
        if good(result):
            return bias, result
        tried.append(bias)
    raise AssertionError(f"no `</think>` bias in {tried} gave the output this test needs")


def chat(client, **fields):
    return client.chat.completions.create(model="k25", **{"messages": ASK, "temperature": 0, "max_tokens": 24,
                                                           **fields})


def stream_deltas(client, **fields) -> tuple[list[Any], list[str | None]]:
    chunks = list(chat(client, stream=True, **fields))
    return [c.choices[0].delta for c in chunks if c.choices], [c.choices[0].finish_reason for c in chunks if c.choices]


def reasoning_of(item: Any) -> tuple[str | None, str | None]:
    """(reasoning_content, reasoning) of a message or delta: extra fields of the SDK's models."""
    extra = item.model_extra or {}
    return extra.get("reasoning_content"), extra.get("reasoning")


@pytest.fixture(scope="module", autouse=True)
def model_name(ctx):
    assert ctx.model_name == "k25" and ctx.template.dialect.name == "k2.6"


# ----------------------------------------------------------------------------- chat completions


def test_thinking_is_on_by_default_and_reasoning_comes_first_in_both_fields(client, ctx, ids, engine_prompts):
    def attempt(bias):
        return chat(client, logit_bias={str(ids[THINK_END]): bias})

    bias, whole = first_attempt(attempt, lambda r: bool(r.choices[0].message.content and
                                                        reasoning_of(r.choices[0].message)[0]))
    message = whole.choices[0].message
    reasoning, alias = reasoning_of(message)
    assert reasoning == alias and THINK_END not in reasoning and THINK_END not in message.content.split(THINK_END)[0]
    assert engine_prompts[-1][-1] == ids[THINK_BEGIN]  # the prompt opened the reasoning block
    deltas, finishes = stream_deltas(client, logit_bias={str(ids[THINK_END]): bias})
    kinds = ["reasoning" if reasoning_of(d)[0] else "content" for d in deltas if reasoning_of(d)[0] or d.content]
    assert kinds == sorted(kinds, key=["reasoning", "content"].index) and kinds[0] == "reasoning"
    assert all(reasoning_of(d)[0] == reasoning_of(d)[1] for d in deltas)
    assert "".join(reasoning_of(d)[0] or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    assert finishes[-1] == whole.choices[0].finish_reason


@pytest.mark.parametrize("switch", [{"chat_template_kwargs": {"thinking": False}},
                                    {"thinking": {"type": "disabled"}}, {"reasoning_effort": "none"}])
def test_thinking_off_gives_no_reasoning_field_and_an_empty_think_block(server, client, ids, engine_prompts, switch):
    body = {"model": "k25", "messages": ASK, "temperature": 0, "max_tokens": 8, **switch}
    raw = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    message = raw["choices"][0]["message"]
    assert "reasoning_content" not in message and "reasoning" not in message and message["content"]
    assert engine_prompts[-1][-2:] == [ids[THINK_BEGIN], ids[THINK_END]]
    deltas, _ = stream_deltas(client, max_tokens=8, extra_body=switch)
    assert not any(reasoning_of(d) != (None, None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == message["content"]
    tokenized = httpx.post(server.base_url + "/tokenize", json={"messages": ASK, **switch}).json()["tokens"]
    assert tokenized == engine_prompts[-1]


def test_tokenize_takes_the_thinking_switch_and_add_generation_prompt(server, ids):
    def tokens(**fields) -> list[int]:
        resp = httpx.post(server.base_url + "/tokenize", json={"messages": history, **fields})
        assert resp.status_code == 200, resp.text
        return resp.json()["tokens"]

    def text(**fields) -> str:
        return httpx.post(server.base_url + "/detokenize", json={"tokens": tokens(**fields)}).json()["prompt"]

    history = [*ASK, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Recall the forecast."},
               {"role": "user", "content": "And tomorrow?"}]
    on, off = tokens(), tokens(chat_template_kwargs={"thinking": False})
    assert on[-1] == ids[THINK_BEGIN] and off == [*on, ids[THINK_END]]
    # OpenAI's reasoning_effort: "none" is off, any other effort on, as in the Responses API
    assert tokens(reasoning_effort="none") == off and tokens(reasoning_effort="minimal") == on
    assert tokens(reasoning_effort="low", chat_template_kwargs={"thinking": True}) == on
    assert "Recall the forecast." not in text() and "Recall the forecast." in text(
        chat_template_kwargs={"preserve_thinking": True})
    assert not text(add_generation_prompt=False).endswith(THINK_BEGIN)
    assert text(add_generation_prompt=False).endswith("And tomorrow?<|im_end|>")


@pytest.mark.parametrize(("fields", "param"), [
    ({"chat_template_kwargs": {"thinking": "no"}}, "chat_template_kwargs.thinking"),
    ({"chat_template_kwargs": {"preserve_thinking": 0}}, "chat_template_kwargs.preserve_thinking"),
    ({"chat_template_kwargs": ["thinking"]}, "chat_template_kwargs"),
    ({"thinking": {"type": "on"}}, "thinking.type"),
    ({"thinking": True}, "thinking"),
    ({"thinking": {"type": "enabled"}, "chat_template_kwargs": {"thinking": False}}, "thinking"),
    ({"reasoning_effort": "maximal"}, "reasoning_effort"),
    ({"reasoning_effort": "none", "thinking": {"type": "enabled"}}, "reasoning_effort"),
    ({"reasoning_effort": "high", "chat_template_kwargs": {"thinking": False}}, "reasoning_effort"),
])
def test_bad_thinking_knobs_are_400s_in_openais_shape(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, max_tokens=1, extra_body=fields)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert err.value.body["type"] == "invalid_request_error"


def test_unknown_template_kwargs_are_ignored(client):
    assert chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": "x", "foo": 1}}).choices


def _valid_call(call: Any) -> None:
    assert call.function.name == "get_weather" and call.id.startswith("functions.get_weather:")
    jsonschema.validate(json.loads(call.function.arguments), UNIT_SCHEMA)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_follows_free_reasoning_and_is_schema_valid(client, ids, tool_choice):
    attempts = []

    def attempt(bias):
        resp = chat(client, tools=[WEATHER], tool_choice=tool_choice, max_tokens=48,
                    logit_bias={str(ids[THINK_END]): bias})
        choice = resp.choices[0]
        reasoning, alias = reasoning_of(choice.message)
        assert reasoning == alias and not any(marker in reasoning for marker in TOOL_MARKERS)
        if choice.finish_reason != "length":  # whenever the output finished, the call is there and valid
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 1
            assert not choice.message.content
            for call in choice.message.tool_calls:
                _valid_call(call)
        attempts.append((bias, reasoning, choice.finish_reason))
        return resp

    bias, whole = first_attempt(attempt, lambda r: r.choices[0].finish_reason == "tool_calls"
                                and bool(reasoning_of(r.choices[0].message)[0]))
    deltas, finishes = stream_deltas(client, tools=[WEATHER], tool_choice=tool_choice, max_tokens=48,
                                     logit_bias={str(ids[THINK_END]): bias})
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    reasoning_at = [i for i, d in enumerate(deltas) if reasoning_of(d)[0]]
    assert reasoning_at and max(reasoning_at) < first_call
    assert "".join(reasoning_of(d)[0] or "" for d in deltas) == reasoning_of(whole.choices[0].message)[0]
    arguments = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls or [] if tc.index == 0)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    assert finishes[-1] == "tool_calls"


def test_reasoning_that_never_ends_is_cut_by_max_tokens(client, ids):
    resp = chat(client, tools=[WEATHER], tool_choice="required", max_tokens=10,
                logit_bias={str(ids[THINK_END]): -100})
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 10
    assert reasoning_of(choice.message)[0] and not choice.message.tool_calls and not choice.message.content


def test_response_format_constrains_the_answer_after_the_reasoning(client, ids):
    fmt = {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT_SCHEMA, "strict": True}}

    def attempt(bias):
        resp = chat(client, response_format=fmt, max_tokens=40, logit_bias={str(ids[THINK_END]): bias})
        choice = resp.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), UNIT_SCHEMA)
        return resp

    _, resp = first_attempt(attempt, lambda r: r.choices[0].finish_reason == "stop")
    assert reasoning_of(resp.choices[0].message)[0] is not None


@pytest.mark.parametrize("stop_token", [IM_END, "[EOS]"])
@pytest.mark.parametrize("thinking", [True, False])
def test_both_end_of_turn_tokens_stop_generation(client, ids, stop_token, thinking):
    resp = chat(client, max_tokens=8, logit_bias={str(ids[stop_token]): 100},
                extra_body={"chat_template_kwargs": {"thinking": thinking}})
    assert resp.choices[0].finish_reason == "stop" and resp.usage.completion_tokens == 1
    assert not resp.choices[0].message.content and stop_token not in (reasoning_of(resp.choices[0].message)[0] or "")


# ----------------------------------------------------------------------------- Anthropic Messages


# This SDK's signatures leave the sampling fields out; the API still takes them.
GREEDY = {"temperature": 0}


def _claude(claude, **fields):
    return claude.messages.create(model="k25", **{"max_tokens": 24, "extra_body": GREEDY, "messages": ASK, **fields})


def test_anthropic_thinking_blocks_come_before_text(claude, ctx, ids, engine_prompts):
    def attempt(bias):
        with steered(ctx, {ids[THINK_END]: bias}):
            return _claude(claude, thinking={"type": "enabled", "budget_tokens": 1024})

    bias, message = first_attempt(attempt, lambda m: [b.type for b in m.content] == ["thinking", "text"])
    thinking = message.content[0]
    assert thinking.thinking and thinking.signature == "" and engine_prompts[-1][-1] == ids[THINK_BEGIN]
    with steered(ctx, {ids[THINK_END]: bias}), claude.messages.stream(
            model="k25", max_tokens=24, extra_body=GREEDY, messages=ASK,
            thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, key=["thinking_delta", "text_delta"].index) and deltas[0] == "thinking_delta"
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]


def test_anthropic_thinking_before_tool_use(claude, ctx, ids):
    tool = {"name": "get_weather", "description": "Weather in Paris", "input_schema": UNIT_SCHEMA}

    def attempt(bias):
        with steered(ctx, {ids[THINK_END]: bias}):
            message = _claude(claude, max_tokens=48, tools=[tool], tool_choice={"type": "any"})
        if message.stop_reason == "tool_use":
            jsonschema.validate(message.content[-1].input, UNIT_SCHEMA)
        return message

    _, message = first_attempt(attempt, lambda m: m.stop_reason == "tool_use" and m.content[0].thinking != "")
    assert [b.type for b in message.content] == ["thinking", "tool_use"]


def test_anthropic_thinking_disabled_gives_no_thinking_block(claude, ids, engine_prompts):
    message = _claude(claude, max_tokens=8, thinking={"type": "disabled"})
    assert [b.type for b in message.content] == ["text"]
    assert engine_prompts[-1][-2:] == [ids[THINK_BEGIN], ids[THINK_END]]
    enabled = claude.messages.count_tokens(model="k25", messages=ASK, thinking={"type": "enabled",
                                                                               "budget_tokens": 1024})
    disabled = claude.messages.count_tokens(model="k25", messages=ASK, thinking={"type": "disabled"})
    assert disabled.input_tokens == enabled.input_tokens + 1 == len(engine_prompts[-1])


def test_anthropic_bad_thinking_is_a_400_in_anthropics_shape(server):
    body = {"model": "k25", "max_tokens": 4, "messages": ASK, "thinking": {"type": "sometimes"}}
    resp = httpx.post(server.base_url + "/v1/messages", json=body)
    assert resp.status_code == 400 and resp.json()["type"] == "error"
    assert resp.json()["error"]["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------- Responses


def test_responses_reasoning_items_come_first_and_effort_none_turns_thinking_off(client, ctx, ids, engine_prompts):
    def attempt(bias):
        with steered(ctx, {ids[THINK_END]: bias}):
            return client.responses.create(model="k25", input="Weather in Paris?", temperature=0,
                                           max_output_tokens=24, reasoning={"effort": "low"})

    bias, resp = first_attempt(attempt, lambda r: [i.type for i in r.output] == ["reasoning", "message"])
    assert resp.output[0].content[0].type == "reasoning_text" and resp.output[0].content[0].text
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    with steered(ctx, {ids[THINK_END]: bias}):
        events = [e.type for e in client.responses.create(
            model="k25", input="Weather in Paris?", temperature=0, max_output_tokens=24, stream=True)]
    assert events.index("response.reasoning_text.delta") < events.index("response.output_text.delta")
    off = client.responses.create(model="k25", input="Weather in Paris?", temperature=0, max_output_tokens=8,
                                  reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"]
    assert engine_prompts[-1][-2:] == [ids[THINK_BEGIN], ids[THINK_END]]


def test_responses_reasoning_before_function_call(client, ctx, ids):
    tool = {"type": "function", "name": "get_weather", "parameters": UNIT_SCHEMA}

    def attempt(bias):
        with steered(ctx, {ids[THINK_END]: bias}):
            return client.responses.create(model="k25", input="Weather in Paris?", temperature=0,
                                           max_output_tokens=48, tools=[tool], tool_choice="required")

    _, resp = first_attempt(attempt, lambda r: [i.type for i in r.output] == ["reasoning", "function_call"])
    jsonschema.validate(json.loads(resp.output[1].arguments), UNIT_SCHEMA)


@pytest.mark.parametrize("dialect", DIALECTS, ids=[d.name for d in DIALECTS])
def test_a_continued_message_never_opens_reasoning(dialect):
    """Continuing a final assistant message: where the template honours the switch, unset turns thinking off and
    on is a 400; where it has none (K2-Instruct) nothing changes; a model that always thinks refuses it."""
    if dialect.always_thinks:
        with pytest.raises(APIError, match="always reasons"):
            continuing_thinking(dialect, ThinkingSwitch())
        return
    for asked in (None, False, True):
        switch = ThinkingSwitch(thinking=asked, preserve_thinking=True)
        if asked and has_thinking_switch(dialect):
            with pytest.raises(APIError, match="thinking off") as caught:
                continuing_thinking(dialect, switch)
            assert caught.value.param == "thinking"
            continue
        continued = continuing_thinking(dialect, switch)
        assert not dialect.starts_in_reasoning(continued.thinking)  # the given start is read as answer text
        assert continued.preserve_thinking is True
