"""`/v1/messages` over the real engine (embedded tiny K2.6) on a real uvicorn, through the official `anthropic` SDK.

The tiny model has random weights: tests that need a tool call force it (`tool_choice` any/tool, which is
grammar-constrained exactly like chat's required/named), and compare prompts the engine actually received.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from live_server import check_disconnect_aborts, openai_client, script_turns  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from kserve.chat import ToolCall as ParsedToolCall  # noqa: E402
from kserve.server import anthropic_messages  # noqa: E402
from kserve.server.anthropic_errors import check_api_key  # noqa: E402
from kserve.server.anthropic_messages import chat_messages  # noqa: E402
from kserve.server.anthropic_protocol import MessagesRequest  # noqa: E402
from kserve.server.app import BodyLimitMiddleware, build_app  # noqa: E402
from kserve.server.chat_turn import FinishedTurn, TurnDelta, TurnUsage  # noqa: E402
from kserve.server.context import ServerSettings  # noqa: E402
from kserve.server.errors import APIError  # noqa: E402
from kserve.server.protocol import FunctionCallDelta, ToolCallDeltaOut  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}
WEATHER_CHAT = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}
QUESTION = "What is the weather in Rome?"
GREEDY = {"temperature": 0}  # sampling fields are left out of this SDK's signatures; the API still takes them


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chat_client(server):
    return openai_client(server)


def _forced_call(client, ctx, **kw):
    return client.messages.create(model=ctx.model_name, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                                  tool_choice={"type": "tool", "name": "get_weather"},
                                  messages=[{"role": "user", "content": QUESTION}], **kw)


def test_create_text_reply_and_usage(client, ctx):
    msg = client.messages.create(model=ctx.model_name, max_tokens=8, system="Be terse.",
                                 messages=[{"role": "user", "content": "Name three colors."}])
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == ctx.model_name
    assert msg.stop_reason in ("end_turn", "max_tokens")
    # the embedded K2.6 model thinks first: a thinking block, then text once the thought ends
    assert {block.type for block in msg.content} <= {"thinking", "text"} and msg.content
    assert 1 <= msg.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model=ctx.model_name, system="Be terse.",
                                           messages=[{"role": "user", "content": "Name three colors."}])
    # Anthropic's usage: input_tokens excludes prefix-cache reads, which are reported apart
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted.input_tokens


def test_stream_accumulates_to_the_non_streamed_message(client, ctx):
    kw = {"model": ctx.model_name, "max_tokens": 24, "extra_body": GREEDY,
          "messages": [{"role": "user", "content": "Hello"}]}
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == plain.usage.input_tokens + plain.usage.cache_read_input_tokens)


def test_forced_tool_use_streamed_and_not(client, ctx):
    plain = _forced_call(client, ctx)
    with client.messages.stream(model=ctx.model_name, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds
    for msg in (plain, final):
        assert msg.stop_reason == "tool_use"
        calls = [b for b in msg.content if b.type == "tool_use"]
        assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].input["city"] in ("Paris", "Rome")
        assert re.fullmatch(r"toolu_[A-Za-z0-9_-]+", calls[0].id)  # ids Anthropic itself would accept
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]


def test_any_with_disable_parallel_gives_one_call(client, ctx):
    msg = client.messages.create(model=ctx.model_name, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 messages=[{"role": "user", "content": QUESTION}])
    assert [b.type for b in msg.content if b.type == "tool_use"] == ["tool_use"]
    assert msg.stop_reason == "tool_use"


def test_stop_sequence_is_reported(client, ctx):
    msg = client.messages.create(model=ctx.model_name, max_tokens=64, extra_body=GREEDY, stop_sequences=[" ", "e", "a"],
                                 messages=[{"role": "user", "content": "Write a long sentence."}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence in (" ", "e", "a")
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert not any(s in text for s in (" ", "e", "a"))


def test_tool_round_trip_prompt_is_the_chat_completions_prompt(server, client, chat_client, ctx, engine_prompts):
    first = _forced_call(client, ctx)
    call = next(b for b in first.content if b.type == "tool_use")
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": "x"},
                                          *[b.model_dump(exclude_none=True) for b in first.content
                                            if b.type != "thinking"]]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "21C"}]},
                                     {"type": "text", "text": "Thanks!"}]},
    ]
    second = client.messages.create(model=ctx.model_name, max_tokens=8, system="sys", tools=[WEATHER],
                                    messages=history)
    counted = client.messages.count_tokens(model=ctx.model_name, system="sys", tools=[WEATHER], messages=history)
    # the same conversation through chat completions
    chat_messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21C"},
        {"role": "user", "content": "Thanks!"},
    ]
    chat = chat_client.chat.completions.create(model=ctx.model_name, max_tokens=8, tools=[WEATHER_CHAT],
                                               messages=chat_messages)
    tokenized = httpx.post(server.base_url + "/tokenize", json={"model": ctx.model_name, "messages": chat_messages,
                                                                "tools": [WEATHER_CHAT]}).json()
    anthropic_prompt, chat_prompt = engine_prompts[1], engine_prompts[2]
    assert anthropic_prompt == chat_prompt == tokenized["tokens"]
    text = ctx.tokenizer.decode(anthropic_prompt)
    assert "## Return of functions.get_weather:0\nSunny, 21C" in text and "tool_declare" in text
    assert counted.input_tokens == len(anthropic_prompt) == chat.usage.prompt_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == len(anthropic_prompt)
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prefix was cached


def _anthropic_error(server, body, status=400):
    resp = httpx.post(server.base_url + "/v1/messages", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    data = resp.json()
    assert data["type"] == "error" and set(data["error"]) == {"type", "message"}
    return data["error"]


def test_bad_input_gets_anthropic_errors_and_the_server_keeps_serving(server, client, ctx):
    model = ctx.model_name
    user = {"role": "user", "content": "hi"}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, messages=[user], max_tokens=None)  # type: ignore[arg-type]
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in _anthropic_error(server, {"model": model, "messages": [user]})["message"]
    orphan = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}
    err = _anthropic_error(server, {"model": model, "max_tokens": 4, "messages": [user, orphan]})
    assert "toolu_nope" in err["message"] and err["type"] == "invalid_request_error"
    unknown = {"role": "user", "content": [{"type": "hologram", "data": "x"}]}
    assert "'hologram'" in _anthropic_error(server, {"model": model, "max_tokens": 4, "messages": [unknown]})["message"]
    image = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}
    # the embedded K2.6 model takes images, so the block itself is checked: its source names no media type
    err = _anthropic_error(server, {"model": model, "max_tokens": 4, "messages": [image]})
    assert "media_type" in err["message"] and err["type"] == "invalid_request_error"
    bad_tool = {**WEATHER, "input_schema": {"type": "object", "properties": {"city": {"type": 12}}}}
    err = _anthropic_error(server, {"model": model, "max_tokens": 4, "messages": [user], "tools": [bad_tool]})
    assert "tools.0.input_schema" in err["message"]
    # prefill: under thinking (Anthropic refuses it too), or holding a tool_use, it cannot be continued
    prefill = {"model": model, "max_tokens": 4, "messages": [user, {"role": "assistant", "content": "Sure"}],
               "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert "thinking off" in _anthropic_error(server, prefill)["message"]
    called = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Rome"}}]}
    err = _anthropic_error(server, {"model": model, "max_tokens": 4, "messages": [user, called], "tools": [WEATHER]})
    assert "messages.1" in err["message"] and "text blocks only" in err["message"]
    prefilled = {"model": model, "max_tokens": 4, "messages": [user, {"role": "assistant", "content": "{"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    structured = {"format": {"type": "json_schema", "schema": schema}}
    err = _anthropic_error(server, {**prefilled, "output_config": structured})
    assert "structured output format" in err["message"] and "response_format" not in err["message"]
    err = _anthropic_error(server, {**prefilled, "tools": [WEATHER], "tool_choice": {"type": "any"}})
    assert "tool_choice 'any'" in err["message"]
    for spaced in ("Sure ", [{"type": "text", "text": "The answer is\n"}]):
        err = _anthropic_error(server, {**prefilled, "messages": [user, {"role": "assistant", "content": spaced}]})
        assert "trailing whitespace" in err["message"] and err["type"] == "invalid_request_error"
    err = _anthropic_error(server, {"model": "claude-nope", "max_tokens": 4, "messages": [user]}, status=404)
    assert err["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=[user])
    resp = httpx.post(server.base_url + "/v1/messages?beta=true", content=b"{not json", timeout=60,
                      headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x",
                               "content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    # still serving, with the beta query and headers accepted
    ok = httpx.post(server.base_url + "/v1/messages?beta=true", timeout=120,
                    headers={"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"},
                    json={"model": model, "max_tokens": 2, "messages": [user]})
    assert ok.status_code == 200 and ok.json()["type"] == "message"


def test_prefill_continues_the_reply_as_chat_completions_does(client, chat_client, ctx, engine_prompts):
    """A final assistant message is the reply's start: thinking is off unless asked for (Anthropic's default), the
    prompt is chat completions' continue_final_message prompt, and the reply holds only what follows."""
    start = "The answer is"
    msg = client.messages.create(model=ctx.model_name, max_tokens=6, extra_body=GREEDY, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": [{"type": "text", "text": start}]}])
    assert [b.type for b in msg.content] == ["text"]
    chat = chat_client.chat.completions.create(
        model=ctx.model_name, max_tokens=6, temperature=0, extra_body={"continue_final_message": True},
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": start}])
    assert engine_prompts[0] == engine_prompts[1]
    assert ctx.tokenizer.decode(engine_prompts[0]).endswith("<think></think>" + start)
    assert msg.content[0].text == chat.choices[0].message.content and not msg.content[0].text.startswith(start)
    counted = client.messages.count_tokens(model=ctx.model_name, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": start}])
    assert counted.input_tokens == len(engine_prompts[0]) == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    with client.messages.stream(model=ctx.model_name, max_tokens=6, extra_body=GREEDY, messages=[
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": start}]) as stream:
        assert stream.get_final_text() == msg.content[0].text


def _request(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]})


def test_api_key_by_x_api_key_or_bearer():
    check_api_key(_request({}), None)  # no key configured: anything goes
    check_api_key(_request({"x-api-key": "sekrit"}), "sekrit")
    check_api_key(_request({"authorization": "Bearer sekrit"}), "sekrit")
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
        with pytest.raises(APIError) as info:
            check_api_key(_request(headers), "sekrit")
        assert info.value.status == 401


def _scripted_turn():
    """A K2-Thinking style turn: reasoning, text, then one call, as the chat path's stream parsers emit it."""
    header = ToolCallDeltaOut(index=0, id="functions.get_weather:0", type="function",
                              function=FunctionCallDelta(name="get_weather", arguments=""))
    deltas = [TurnDelta(reasoning="Let me "), TurnDelta(reasoning="think.", content="It is"),
              TurnDelta(content=" sunny.", calls=[header]),
              TurnDelta(calls=[ToolCallDeltaOut(index=0, function=FunctionCallDelta(arguments='{"city": '))]),
              TurnDelta(calls=[ToolCallDeltaOut(index=0, function=FunctionCallDelta(arguments='"Rome"}'))])]
    call = ParsedToolCall(id="functions.get_weather:0", name="get_weather", arguments='{"city": "Rome"}', index=0,
                          valid_json=True, known_tool=True)
    finished = FinishedTurn("Let me think.", "It is sunny.", [call], "tool_calls", None, TurnUsage(40, 12, 16))
    return deltas, finished


@pytest.fixture
def scripted_turn(monkeypatch):
    """The engine driver replaced by a scripted reasoning + text + call turn (the wire writer is under test)."""
    deltas, finished = _scripted_turn()
    script_turns(monkeypatch, anthropic_messages, deltas, finished)


def test_thinking_text_and_tool_use_blocks_stream_as_the_sdk_expects(client, ctx, scripted_turn):
    kw = {"model": ctx.model_name, "max_tokens": 64, "tools": [WEATHER],
          "messages": [{"role": "user", "content": QUESTION}]}
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert set(deltas) == {"thinking_delta", "text_delta", "input_json_delta"}
    assert [b.type for b in plain.content] == ["thinking", "text", "tool_use"]
    assert plain.content[0].thinking == "Let me think." and plain.content[1].text == "It is sunny."
    assert plain.content[2].input == {"city": "Rome"} and plain.stop_reason == "tool_use"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
    assert final.usage.model_dump() == plain.usage.model_dump()
    assert (plain.usage.input_tokens, plain.usage.cache_read_input_tokens, plain.usage.output_tokens) == (24, 16, 12)


def test_history_blocks_translate_to_chat_turns():
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "a"},
                                                                                   {"type": "text", "text": "b"}],
                                          "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "opaque"},
                                          {"type": "text", "text": "calling"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": "é"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "done",
                                      "is_error": True}, {"type": "text", "text": "next"}]},
    ]})
    assert chat_messages(req) == [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "calling", "reasoning_content": "hmm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x": "é"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "done"},
        {"role": "user", "content": "next"},
    ]


def test_client_disconnect_mid_stream_aborts_the_generation(server, ctx):
    body = {"model": ctx.model_name, "max_tokens": 4000, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    check_disconnect_aborts(server, "/v1/messages", body, "content_block_delta")


@pytest.mark.parametrize("path, anthropic_shape", [("/v1/messages", True), ("/v1/chat/completions", False)])
def test_oversized_body_is_413_in_the_endpoints_own_shape(path, anthropic_shape):
    sent: list[dict] = []

    async def never_called(scope, receive, send):
        raise AssertionError("the app must not see an oversized body")

    async def receive():
        return {"type": "http.request", "body": b"x" * 100, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", b"100")]}
    asyncio.run(BodyLimitMiddleware(never_called, max_bytes=10)(scope, receive, send))
    assert sent[0]["status"] == 413
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    if anthropic_shape:
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
    else:
        assert body["error"]["code"] == "request_too_large"


def test_output_config_format_constrains_the_reply_to_the_schema(client, ctx):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    msg = client.messages.create(model=ctx.model_name, max_tokens=48, extra_body=GREEDY,
                                 output_config={"format": {"type": "json_schema", "schema": schema}},
                                 messages=[{"role": "user", "content": "Pick one."}])
    assert msg.stop_reason == "end_turn"
    value = json.loads(next(block for block in msg.content if block.type == "text").text)
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green") and set(value) == {"ok", "color"}


def test_auth_and_readiness_errors_through_the_app_are_anthropic_shaped():
    async def never_loads(settings, metrics):
        await asyncio.Event().wait()

    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(build_app(ServerSettings(api_key="sekrit"), loader=never_loads)) as http:
        denied = http.post("/v1/messages", json=body)
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        for headers in ({"x-api-key": "sekrit"}, {"authorization": "Bearer sekrit"}):
            loading = http.post("/v1/messages/count_tokens", json=body, headers=headers)
            assert loading.status_code == 503 and loading.json()["type"] == "error"
            assert loading.json()["error"]["type"] == "overloaded_error"
        # the OpenAI endpoints keep their own shape (and bearer auth)
        openai_denied = http.post("/v1/chat/completions", json=body, headers={"x-api-key": "sekrit"})
        assert openai_denied.status_code == 401 and openai_denied.json()["error"]["code"] == "invalid_api_key"


def test_a_coding_agent_shaped_request_streams(server, ctx):
    """The shape Claude Code sends: system blocks with cache_control, draft-07 tool schemas, metadata, thinking,
    temperature 1, beta headers and query, streaming."""
    tool = {"name": "Read", "description": "Read a file",
            "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                             "properties": {"file_path": {"type": "string"}}, "required": ["file_path"],
                             "additionalProperties": False}}
    body = {"model": ctx.model_name, "max_tokens": 6, "stream": True, "temperature": 1,
            "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Read main.py",
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "tools": [tool], "metadata": {"user_id": "user_abc"}, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    with httpx.stream("POST", server.base_url + "/v1/messages?beta=true", json=body, headers=headers,
                      timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        names = [line[7:] for line in resp.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop")
