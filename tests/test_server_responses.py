"""`/v1/responses`, `/tokenize` and `/detokenize` over the real engine (embedded tiny K2.6) on a real uvicorn,
through the official `openai` SDK.

The tiny model thinks one sentence first and then rarely strays from its training chats: a test that needs a call
or a finished (not length-cut) answer forces the structure with `tool_choice` or `text.format`, which are
grammar-constrained like their chat twins.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import httpx
import pytest

openai = pytest.importorskip("openai")

from live_server import (  # noqa: E402
    check_disconnect_aborts,
    openai_client,
    running_server,
    script_turns,
)
from pydantic import BaseModel  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from kserve.chat import ToolCall as ParsedToolCall  # noqa: E402
from kserve.server import openai_responses  # noqa: E402
from kserve.server.app import build_app  # noqa: E402
from kserve.server.chat_turn import FinishedTurn, TurnDelta, TurnUsage  # noqa: E402
from kserve.server.context import ServerSettings  # noqa: E402
from kserve.server.errors import APIError  # noqa: E402
from kserve.server.openai_responses import chat_messages, prepare_response  # noqa: E402
from kserve.server.protocol import FunctionCallDelta, ToolCallDeltaOut  # noqa: E402
from kserve.server.responses_protocol import ResponsesRequest  # noqa: E402
from kserve.server.responses_store import ResponseStore, StoredResponse  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
WEATHER_CHAT = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": WEATHER["parameters"]}}
QUESTION = "What is the weather in Rome?"


class Verdict(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def server():
    with running_server(responses_store_size=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _items(response):
    """Output items without their ids (minted per response) and the SDK's parse-helper fields."""
    def clean(value):
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in ("id", "parsed", "parsed_arguments")}
        return [clean(v) for v in value] if isinstance(value, list) else value
    return clean([item.model_dump() for item in response.output])


def _forced_call(client, ctx, **kw):
    return client.responses.create(model=ctx.model_name, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                   parallel_tool_calls=False, temperature=0, max_output_tokens=64, **kw)


def test_create_text_response(client, ctx):
    resp = client.responses.create(model=ctx.model_name, input="Name three colors.", instructions="Be terse.",
                                   max_output_tokens=8)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == ctx.model_name
    assert resp.status in ("completed", "incomplete")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens" and resp.usage.output_tokens == 8
    else:
        assert resp.created_at <= resp.completed_at <= time.time()
    # the embedded K2.6 model thinks first: a reasoning item, then the message once the thought ends (an
    # 8-token budget may end inside the thought)
    kinds = [item.type for item in resp.output]
    assert kinds in (["reasoning"], ["reasoning", "message"]), kinds
    assert resp.output[0].content[0].type == "reasoning_text" and resp.output[0].content[0].text
    messages = [item for item in resp.output if item.type == "message"]
    for message in messages:
        assert message.content[0].type == "output_text"
    assert resp.output_text == "".join(m.content[0].text for m in messages)
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert client.responses.retrieve(resp.id).model_dump() == resp.model_dump()


def test_stream_accumulates_to_the_non_streamed_response(client, ctx):
    kw = {"model": ctx.model_name, "input": "Pick a color.", "temperature": 0, "max_output_tokens": 48,
          "text_format": Verdict}
    plain = client.responses.parse(**kw)
    with client.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.content_part.added" in kinds
    assert plain.status == final.status == "completed"
    assert isinstance(plain.output_parsed, Verdict) and final.output_parsed == plain.output_parsed
    assert final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_output_text_logprobs_are_the_message_tokens_only_streamed_and_not(client, ctx):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: one entry per token of the message text,
    none for the thought before it or the end-of-turn token; the stream's deltas carry the same tokens."""
    kw = {"model": ctx.model_name, "input": "Pick a color.", "temperature": 0, "max_output_tokens": 48,
          "text_format": Verdict, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    plain = client.responses.parse(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert plain.top_logprobs == 2 and plain.output[0].type == "reasoning"  # a thought whose tokens stay out
    part = next(item for item in plain.output if item.type == "message").content[0]
    assert part.logprobs and "".join(lp.token for lp in part.logprobs) == part.text
    for lp in part.logprobs:
        assert lp.logprob <= 0 and bytes(lp.bytes).decode() == lp.token and 1 <= len(lp.top_logprobs) <= 2
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    final_part = next(item for item in final.output if item.type == "message").content[0]
    tokens = [lp.token for lp in part.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs] == tokens
    assert [lp.token for lp in final_part.logprobs] == tokens
    without = client.responses.parse(**{k: v for k, v in kw.items() if k != "include"})
    assert not next(item for item in without.output if item.type == "message").content[0].logprobs
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=ctx.model_name, input="hi", top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"


def test_function_call_streamed_and_not(client, ctx):
    plain = _forced_call(client, ctx)
    with client.responses.stream(model=ctx.model_name, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0, max_output_tokens=64) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    for resp in (plain, final):
        calls = [item for item in resp.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    assert _items(final) == _items(plain)
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert plain.status == final.status == "completed" and plain.created_at <= plain.completed_at <= time.time()


def test_function_call_output_round_trip_and_previous_response_id(server, client, ctx, engine_prompts):
    first = _forced_call(client, ctx)
    call = next(item for item in first.output if item.type == "function_call")
    thought = next(item for item in first.output if item.type == "reasoning")  # the model thinks first
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}
    # the whole conversation sent again (the reasoning item too: a stored response keeps it)...
    resent = client.responses.create(model=ctx.model_name, max_output_tokens=4, tools=[WEATHER],
                                     input=[{"role": "user", "content": QUESTION}, thought.model_dump(exclude_none=True),
                                            call.model_dump(exclude_none=True), answer])
    # ...and the same continued from the stored response
    chained = client.responses.create(model=ctx.model_name, max_output_tokens=4, tools=[WEATHER],
                                      previous_response_id=first.id, input=[answer])
    assert chained.previous_response_id == first.id
    chat_messages = [{"role": "user", "content": QUESTION},
                     {"role": "assistant", "content": None, "reasoning_content": thought.content[0].text,
                      "tool_calls": [
                         {"id": call.call_id, "type": "function",
                          "function": {"name": call.name, "arguments": call.arguments}}]},
                     {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21C"}]
    tokenized = httpx.post(server.base_url + "/tokenize", json={"messages": chat_messages, "tools": [WEATHER_CHAT]})
    assert engine_prompts[1] == engine_prompts[2] == tokenized.json()["tokens"]
    assert "## Return of functions.get_weather:0\nSunny, 21C" in ctx.tokenizer.decode(engine_prompts[1])
    assert resent.usage.input_tokens == chained.usage.input_tokens == tokenized.json()["count"]
    # the SDK's input_items.list: the items the chained response was generated from, newest first by default
    listed = client.responses.input_items.list(chained.id)
    assert [item.type for item in listed.data] == ["function_call_output", "function_call", "reasoning", "message"]
    assert listed.data[0].call_id == call.call_id and listed.data[1].id == call.id and not listed.has_more
    assert listed.data[3].content[0].text == QUESTION and listed.data[3].id.startswith("msg_")
    page = client.responses.input_items.list(chained.id, order="asc", limit=2)
    assert [item.id for item in page.data] == [listed.data[3].id, listed.data[2].id] and page.has_more
    rest = client.responses.input_items.list(chained.id, order="asc", after=page.last_id)
    assert [item.id for item in rest.data] == [listed.data[1].id, listed.data[0].id]
    assert client.responses.input_items.list(first.id).data[0].id == listed.data[3].id  # ids stay put


def test_tokenize_and_detokenize(server, client, ctx):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi <|im_end|> there"}]
    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model=ctx.model_name, messages=messages, max_tokens=1)
    tok = httpx.post(server.base_url + "/tokenize", json={"model": ctx.model_name, "messages": messages}).json()
    assert tok["count"] == len(tok["tokens"]) == chat.usage.prompt_tokens and tok["max_model_len"] == ctx.max_model_len
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    # the embedded K2.6 model thinks by default: the generation prompt ends in the <think> prefill
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>") and "Hi <|im_end|> there" in text
    # client text that spells a control token is not that token (injection-safe encoding, as for chat)
    assert tok["tokens"].count(ctx.tokenizer.special_ids["<|im_end|>"]) == 2
    no_gen = httpx.post(server.base_url + "/tokenize", json={"messages": messages, "add_generation_prompt": False})
    assert no_gen.json()["tokens"] == tok["tokens"][: no_gen.json()["count"]] and no_gen.json()["count"] < tok["count"]
    prompt = httpx.post(server.base_url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert prompt["count"] == len(prompt["token_strs"]) and "".join(prompt["token_strs"]) == text
    for body, status in (({"prompt": "a", "messages": messages}, 400), ({}, 400), ({"prompt": "a", "model": "x"}, 404),
                         ({"messages": [{"role": "wizard", "content": "x"}]}, 400)):
        resp = httpx.post(server.base_url + "/tokenize", json=body)
        assert resp.status_code == status and "message" in resp.json()["error"]
    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [0, ctx.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(client, ctx):
    model = ctx.model_name
    orphan = [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_x", "output": "1"}]
    cases = [
        {"input": orphan},
        {"input": [{"type": "hologram"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 12}}}},
        {"input": "hi", "tools": [{"type": "web_search"}]},
        {"input": "hi", "background": True},
        {"input": "hi", "max_output_tokens": 0},
    ]
    for kw in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=model, **kw)
        assert info.value.body["type"] == "invalid_request_error" and info.value.body["message"], kw
    with pytest.raises(openai.BadRequestError) as info:  # the conversation as a whole is this API's `input`
        client.responses.create(model=model, input="word " * ctx.max_model_len)
    assert (info.value.body["param"], info.value.body["code"]) == ("input", "context_length_exceeded")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="hi", previous_response_id="resp_missing")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-nope", input="hi")
    cut = client.responses.create(model=model, input="still here?", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.completed_at is None


def test_store_is_bounded_and_store_false_is_not_kept(client, ctx):
    kept = client.responses.create(model=ctx.model_name, input="a", max_output_tokens=1)
    unkept = client.responses.create(model=ctx.model_name, input="b", max_output_tokens=1, store=False)
    assert kept.store is True and unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    store = ResponseStore(2)
    for name in ("r1", "r2", "r3"):
        store.put(name, StoredResponse({"id": name}, [], 0))
    assert store.get("r1") is None and store.get("r2") is not None and len(store) == 2


def test_store_off_refuses_store_and_previous_response_id():
    store = ResponseStore(0)
    for raw in ({"model": "m", "input": "hi", "store": True},
                {"model": "m", "input": "hi", "previous_response_id": "resp_1"}):
        with pytest.raises(APIError) as info:
            asyncio.run(prepare_response(None, store, ResponsesRequest.model_validate(raw), raw))
        assert info.value.status == 400 and info.value.code == "response_store_disabled"
        assert "--responses-store-size" in info.value.message


@pytest.fixture
def scripted_turn(monkeypatch):
    """The engine driver replaced by a scripted reasoning + text + call turn (the wire writer is under test)."""
    header = ToolCallDeltaOut(index=0, id="functions.get_weather:0", type="function",
                              function=FunctionCallDelta(name="get_weather", arguments=""))
    deltas = [TurnDelta(reasoning="Let me "), TurnDelta(reasoning="think.", content="It is"),
              TurnDelta(content=" sunny.", calls=[header]),
              TurnDelta(calls=[ToolCallDeltaOut(index=0, function=FunctionCallDelta(arguments='{"city": "Rome"}'))])]
    call = ParsedToolCall(id="functions.get_weather:0", name="get_weather", arguments='{"city": "Rome"}', index=0,
                          valid_json=True, known_tool=True)
    finished = FinishedTurn("Let me think.", "It is sunny.", [call], "tool_calls", None, TurnUsage(40, 12, 16))
    script_turns(monkeypatch, openai_responses, deltas, finished)


def test_reasoning_message_and_call_items_stream_as_the_sdk_expects(server, client, ctx, scripted_turn):
    kw = {"model": ctx.model_name, "input": QUESTION, "tools": [WEATHER]}
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert [item.type for item in plain.output] == ["reasoning", "message", "function_call"]
    assert plain.output[0].content[0].text == "Let me think." and plain.output_text == "It is sunny."
    assert plain.output[2].call_id == "functions.get_weather:0" and plain.output[2].arguments == '{"city": "Rome"}'
    assert plain.usage.input_tokens_details.cached_tokens == 16 and plain.usage.output_tokens_details.reasoning_tokens > 0
    assert _items(final) == _items(plain)
    assert final.usage.model_dump() == plain.usage.model_dump()
    events = [json.loads(line[6:]) for line in _raw_stream(server, kw)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # each text-bearing item's part is added before its deltas and done after them, reasoning as the message
    per_item = {}
    for e in events:
        if "output_index" in e:
            per_item.setdefault(e["output_index"], []).append((e["type"], (e.get("part") or {}).get("type")))
    kinds_of = [[kind.removeprefix("response.") for kind, _ in per_item[i]] for i in sorted(per_item)]
    for kinds, text in zip(kinds_of[:2], ("reasoning_text", "output_text")):
        assert kinds[:2] == ["output_item.added", "content_part.added"] and kinds[-3:] == [
            f"{text}.done", "content_part.done", "output_item.done"], kinds
        assert set(kinds[2:-3]) == {f"{text}.delta"}
    assert [part for _, part in per_item[0] if part] == ["reasoning_text", "reasoning_text"]


def test_max_tool_calls_caps_the_calls_kept_and_is_echoed(client, ctx):
    def cap(**fields):
        raw = {"model": ctx.model_name, "input": QUESTION, "tools": [WEATHER], **fields}
        prepared = asyncio.run(prepare_response(ctx, ResponseStore(0), ResponsesRequest.model_validate(raw), raw))
        return prepared.chat.max_calls

    assert (cap(), cap(max_tool_calls=2), cap(max_tool_calls=3, parallel_tool_calls=False)) == (None, 2, 1)
    resp = _forced_call(client, ctx, max_tool_calls=1)
    assert resp.max_tool_calls == 1 and len([i for i in resp.output if i.type == "function_call"]) == 1
    with pytest.raises(openai.BadRequestError):
        _forced_call(client, ctx, max_tool_calls=0)


def test_a_function_is_strict_unless_it_says_not_as_openai_responses_makes_it(client, ctx, monkeypatch):
    """Responses (unlike chat completions) holds a function without `strict` to its schema: under `auto` its
    grammar binds the call even with `--tool-grammar off`, the prompt shows the tool as sent, the response lists
    it strict. `strict: false` opts out."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    def prepared(**fields):
        raw = {"model": ctx.model_name, "input": QUESTION,
               "tools": [{"type": "function", "name": "get_weather", "parameters": schema, **fields}]}
        return asyncio.run(prepare_response(ctx, ResponseStore(0), ResponsesRequest.model_validate(raw), raw)).chat

    monkeypatch.setattr(ctx.settings, "tool_grammar", False)
    default, opted_out = prepared(), prepared(strict=False)
    assert default.params.guided is not None and opted_out.params.guided is None
    assert "strict" not in default.tools[0]["function"]  # what the prompt is rendered from
    monkeypatch.undo()
    resp = client.responses.create(model=ctx.model_name, input=QUESTION, tool_choice="required", max_output_tokens=64,
                                   tools=[{"type": "function", "name": "get_weather", "parameters": schema}],
                                   temperature=0)
    assert resp.tools[0].strict is True
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and all(set(json.loads(call.arguments)) <= {"city"} for call in calls)


def test_a_stored_response_cannot_be_streamed_again(client, ctx):
    stored = client.responses.create(model=ctx.model_name, input=QUESTION, max_output_tokens=4)
    assert client.responses.retrieve(stored.id).id == stored.id
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.retrieve(stored.id, stream=True)
    assert caught.value.body["param"] == "stream"


def _raw_stream(server, kw):
    body = {**kw, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines
    return lines


def test_input_items_translate_to_chat_turns():
    items = [("a", {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]}),
             ("b", {"type": "message", "role": "user", "content": "q"}),
             ("c", {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hmm"}]}),
             ("d", {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]}),
             ("e", {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}),
             ("f", {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"}),
             ("g", {"type": "function_call_output", "call_id": "c2", "output": "two"}),
             ("h", {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "1"}]}),
             ("i", {"type": "message", "role": "assistant", "content": "end"})]
    assert chat_messages("sys", items) == [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "calling", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "assistant", "content": "end"},
    ]


def test_client_disconnect_mid_stream_aborts_the_generation(server, ctx):
    body = {"model": ctx.model_name, "max_output_tokens": 4000, "stream": True, "input": "go"}
    check_disconnect_aborts(server, "/v1/responses", body, "response.output_text.delta")


def test_length_cut_stream_ends_with_response_incomplete_like_the_plain_response(server, client, ctx):
    body = {"model": ctx.model_name, "input": "Tell me a story.", "temperature": 0, "max_output_tokens": 6}
    plain = client.responses.create(**body)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.output[-1].status == "incomplete"
    events = [json.loads(line[6:]) for line in _raw_stream(server, body)]
    assert [e["type"] for e in events][-1] == "response.incomplete"
    last = events[-1]["response"]
    assert last["status"] == "incomplete"
    assert (last["usage"]["input_tokens"], last["usage"]["output_tokens"]) == (plain.usage.input_tokens, 6)
    def strip(items):
        return [{k: v for k, v in item.items() if k != "id"} for item in items]
    assert strip(last["output"]) == strip(plain.model_dump(exclude_none=True)["output"])


def test_request_counts_are_labelled_by_route_template_not_by_raw_path():
    """Each stored response has its own path; a label per path would grow /metrics without bound."""
    async def never_loads(settings, metrics):
        await asyncio.Event().wait()

    app = build_app(ServerSettings(max_request_bytes=64), loader=never_loads)
    with TestClient(app) as http:
        for i in range(3):
            http.get(f"/v1/responses/resp_{i}")
            http.delete(f"/v1/responses/resp_{i}")
        assert http.post("/v1/chat/completions", content=b"x" * 100).status_code == 413  # refused before routing
        http.get("/no/such/path")
    counts = app.state.server.metrics.requests
    assert {endpoint for endpoint, _ in counts} == {"/v1/responses/{response_id}", "/v1/chat/completions", "unmatched"}
    assert sum(n for (endpoint, _), n in counts.items() if endpoint == "/v1/responses/{response_id}") == 6


def test_an_unknown_reasoning_effort_is_a_400(server, ctx):
    resp = httpx.post(server.base_url + "/v1/responses",
                      json={"model": ctx.model_name, "input": "hi", "reasoning": {"effort": "hgih"}})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "reasoning.effort"


def test_truncation_auto_drops_the_oldest_turns_that_do_not_fit(server, client, ctx, engine_prompts):
    """`truncation: "auto"` drops whole turns from the start, fewest first, keeping instructions and developer
    messages; `disabled` (the default) and a last turn too long alone stay 400s."""
    long = "word " * ctx.max_model_len
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'}
    conversation = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": long},
                    call, {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
                    {"role": "user", "content": "Thanks. And in Paris?"}]
    kw = {"model": ctx.model_name, "max_output_tokens": 2, "tools": [WEATHER], "instructions": "Answer briefly."}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(input=conversation, **kw)
    assert info.value.body["code"] == "context_length_exceeded"
    cut = client.responses.create(input=conversation, truncation="auto", **kw)
    assert cut.truncation == "auto" and cut.status in ("completed", "incomplete")
    kept = [{"role": "system", "content": "Answer briefly."}, {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": "Thanks. And in Paris?"}]
    tokenized = httpx.post(server.base_url + "/tokenize", json={"messages": kept, "tools": [WEATHER_CHAT]})
    assert engine_prompts == [tokenized.json()["tokens"]]
    assert cut.usage.input_tokens == tokenized.json()["count"]
    # a middle turn too long: only the turns before the first that fits go, the call and its output kept
    middle = [{"role": "user", "content": "hi"}, {"role": "user", "content": long}, conversation[-1],
              {**call, "call_id": "call_2"}, {"type": "function_call_output", "call_id": "call_2", "output": "Rain"}]
    client.responses.create(input=middle, truncation="auto", **kw)
    prompt = ctx.tokenizer.decode(engine_prompts[-1])
    assert "Paris?" in prompt and "Rain" in prompt and "word word" not in prompt and "|>hi<|" not in prompt
    with pytest.raises(openai.BadRequestError) as info:  # nothing to drop: the last turn alone is too long
        client.responses.create(input=[{"role": "user", "content": "hi"}, {"role": "user", "content": long}],
                                truncation="auto", **kw)
    assert (info.value.body["param"], info.value.body["code"]) == ("input", "context_length_exceeded")
