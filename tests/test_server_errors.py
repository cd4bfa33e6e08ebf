"""Bad input gets an OpenAI-shaped 4xx with a clear message, and the server keeps serving.

A real uvicorn over the real engine (embedded tiny model) with an API key, a small context window and a
small body limit, so every limit can be hit cheaply.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from live_server import running_server

from kserve.config import EngineConfig  # noqa: E402
from kserve.server.context import ServerSettings  # noqa: E402
from kserve.server.launch import BackgroundServer  # noqa: E402

KEY = "sekret-key"
MAX_MODEL_LEN = 256
BODY_LIMIT = 64 * 1024
MODEL = "tiny"
OK_MESSAGES = [{"role": "user", "content": "hi"}]
PREFILLED = [*OK_MESSAGES, {"role": "assistant", "content": "Hel"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    with running_server(EngineConfig(max_model_len=MAX_MODEL_LEN), api_key=KEY, served_model_name=MODEL,
                        max_request_bytes=BODY_LIMIT, max_concurrent_requests=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def chat(**over):
    body = {"model": MODEL, "messages": OK_MESSAGES, "max_tokens": 2}
    body.update(over)
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()


def completion(**over):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    body.update(over)
    return body


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# (case id, path, body (dict, or raw bytes), expected status, expected param or None, words the message must hold)
BAD_INPUTS = [
    ("malformed-json", CHAT, b'{"model": "tiny", "messages": [', 400, None, ["JSON"]),
    ("body-is-array", CHAT, b"[1, 2]", 400, None, ["object"]),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages", ["messages", "required"]),
    ("messages-wrong-type", CHAT, chat(messages="hi"), 400, "messages", ["messages"]),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages", ["at least one"]),
    ("bad-role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", ["robot"]),
    ("content-wrong-type", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400, "messages[0].content",
     ["content"]),
    ("user-null-content", CHAT, chat(messages=[{"role": "user", "content": None}]), 400, "messages[0].content",
     ["content"]),
    # the embedded K2.6 model sees images, but fetches no URL unless --allowed-media-domains names its host
    ("image-url", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages[0].content[0]",
     ["not fetched", "data: URL"]),
    ("tool-msg-no-id", CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].tool_call_id",
     ["tool_call_id"]),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature", ["temperature", "number"]),
    ("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature", ["temperature", "0"]),
    ("temperature-huge", CHAT, chat(temperature=5), 400, "temperature", ["temperature", "2"]),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p", ["top_p"]),
    ("top-p-big", CHAT, chat(top_p=1.5), 400, "top_p", ["top_p"]),
    ("max-tokens-negative", CHAT, chat(max_tokens=-5), 400, "max_tokens", ["max_tokens"]),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", ["max_tokens"]),
    ("max-tokens-string", CHAT, chat(max_tokens="10"), 400, "max_tokens", ["max_tokens", "integer"]),
    ("n-zero", CHAT, chat(n=0), 400, "n", ["n"]),
    ("n-huge", CHAT, chat(n=1000), 400, "n", ["16"]),
    ("top-logprobs-huge", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", ["20"]),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", ["logprobs"]),
    ("presence-penalty-huge", CHAT, chat(presence_penalty=3), 400, "presence_penalty", ["presence_penalty"]),
    ("seed-too-big", CHAT, chat(seed=2**70), 400, "seed", ["seed"]),
    ("too-many-stops", CHAT, chat(stop=[f"s{i}" for i in range(20)]), 400, "stop", ["stop", "16"]),
    ("stream-wrong-type", CHAT, chat(stream="yes"), 400, "stream", ["stream", "boolean"]),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options",
     ["stream"]),
    ("logit-bias-bad-key", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias", ["token ids"]),
    ("unknown-model", CHAT, chat(model="gpt-9"), 404, "model", ["gpt-9", MODEL]),
    ("invalid-tool-schema", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "strng"}}}]), 400, "tools[0].function.parameters", ["JSON schema"]),
    ("tool-remote-ref", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "lookup", "parameters": {"$ref": "https://example.invalid/x.json"}}}]), 400,
     "tools[0].function.parameters", ["lookup", "https://example.invalid/x.json"]),
    ("tool-missing-local-ref", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}],
        stream=True), 400, "tools[0].function.parameters", ["lookup", "#/definitions/missing"]),
    ("response-format-remote-ref", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "https://example.invalid/x.json"}}}), 400,
     "response_format.json_schema.schema", ["https://example.invalid/x.json"]),
    ("response-format-missing-local-ref", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/definitions/missing"}}}, stream=True), 400,
     "response_format.json_schema.schema", ["#/definitions/missing"]),
    ("tool-bad-type", CHAT, chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400, "tools[0].type",
     ["function"]),
    ("tool-bad-name", CHAT, chat(tools=[{"type": "function", "function": {"name": "get weather!"}}]), 400,
     "tools[0].function.name", ["get weather!"]),
    ("tool-duplicate-name", CHAT, chat(tools=[TOOL, TOOL]), 400, "tools[1].function.name", ["duplicate"]),
    ("tool-choice-absent-tool", CHAT, chat(tools=[TOOL], tool_choice={"type": "function",
                                                                     "function": {"name": "send_email"}}),
     400, "tool_choice.function.name", ["send_email", "get_weather"]),
    ("tool-choice-bad-string", CHAT, chat(tools=[TOOL], tool_choice="sometimes"), 400, "tool_choice",
     ["sometimes"]),
    ("tool-choice-required-no-tools", CHAT, chat(tool_choice="required"), 400, "tool_choice", ["tools"]),
    ("legacy-functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", ["functions", "tools"]),
    # vLLM's extensions, which an ignoring server would answer unconstrained with a 200
    ("vllm-guided-json", CHAT, chat(guided_json={"type": "object"}), 400, "guided_json", ["response_format"]),
    ("vllm-structured-outputs", CHAT, chat(structured_outputs={"choice": ["a", "b"]}), 400, "structured_outputs",
     ["response_format"]),
    # continuing a final assistant message (vLLM's continue_final_message): what cannot be continued
    ("continue-after-a-user-message", CHAT, chat(continue_final_message=True), 400, "continue_final_message",
     ["final assistant message", "user"]),
    ("continue-with-a-generation-prompt", CHAT, chat(continue_final_message=True, add_generation_prompt=True,
                                                     messages=PREFILLED), 400, "add_generation_prompt", ["both"]),
    ("no-generation-prompt-without-continuing", CHAT, chat(add_generation_prompt=False), 400,
     "add_generation_prompt", ["continue_final_message"]),
    ("continue-a-tool-call", CHAT, chat(continue_final_message=True, messages=[
        *OK_MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]),
     400, "messages[1].tool_calls", ["tool calls"]),
    ("continue-under-thinking", CHAT, chat(continue_final_message=True, messages=PREFILLED,
                                           chat_template_kwargs={"thinking": True}), 400, "thinking", ["thinking off"]),
    ("continue-with-a-forced-call", CHAT, chat(continue_final_message=True, messages=PREFILLED, tools=[TOOL],
                                               tool_choice="required"), 400, "tool_choice", ["forced"]),
    ("continue-with-a-response-format", CHAT, chat(continue_final_message=True, messages=PREFILLED,
                                                   response_format={"type": "json_object"}), 400, "response_format",
     ["continuing"]),
    ("response-format-bad-type", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type",
     ["response_format"]),
    ("response-format-missing-schema", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema", ["json_schema"]),
    ("prompt-exceeds-context", CHAT, chat(messages=[{"role": "user", "content": "word " * 400}]), 400, "messages",
     ["exceeds", "by"]),
    ("completion-empty-prompt-list", COMPLETIONS, completion(prompt=[]), 400, "prompt", ["empty"]),
    ("completion-token-out-of-vocab", COMPLETIONS, completion(prompt=[1, 2, 10**7]), 400, "prompt",
     ["10000000"]),
    ("completion-suffix", COMPLETIONS, completion(suffix="x"), 400, "suffix", ["suffix"]),
    ("completion-echo-logprobs", COMPLETIONS, completion(echo=True, logprobs=1), 400, "echo", ["echo"]),
    ("completion-logprobs-huge", COMPLETIONS, completion(logprobs=50), 400, "logprobs", ["logprobs"]),
    ("completion-best-of", COMPLETIONS, completion(best_of=3), 400, "best_of", ["best_of"]),
    ("completion-empty-string-in-list", COMPLETIONS, completion(prompt=["ok", ""]), 400, "prompt[1]", ["empty"]),
    ("completion-too-many-prompts", COMPLETIONS, completion(prompt=["a"] * 40, n=2), 400, "prompt", ["64"]),
    ("completion-prompt-wrong-type", COMPLETIONS, completion(prompt={"text": "x"}), 400, "prompt", ["prompt"]),
]


def test_table_is_large_enough():
    assert len(BAD_INPUTS) >= 25


@pytest.mark.parametrize("case,path,body,status,param,words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_openai_error(http, case, path, body, status, param, words):
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word.lower() in error["message"].lower(), error["message"]


def test_unresolvable_ref_at_validation_time_is_a_counted_tool_problem():
    """Backstop behind the request checks: a schema whose $ref cannot be followed is counted, not raised."""
    from types import SimpleNamespace

    from kserve.chat import ToolCall as ParsedToolCall
    from kserve.server.metrics import ServerMetrics
    from kserve.server.serving_chat import check_tool_calls

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"$ref": "#/definitions/missing"}}},
             {"type": "function", "function": {"name": "fetch", "parameters": {"$ref": "https://example.invalid/x"}}}]
    calls = [ParsedToolCall(id=f"functions.{name}:{i}", name=name, arguments='{"a": 1}', index=i, valid_json=True,
                            known_tool=True) for i, name in enumerate(["lookup", "fetch"])]
    ctx = SimpleNamespace(metrics=ServerMetrics())
    check_tool_calls(ctx, "req-1", calls, True, tools)
    assert ctx.metrics.tool_call_problems["schema_unresolvable"] == 2


def test_context_overflow_message_says_by_how_much(http, server):
    from kserve.chat import ChatTemplate, load_tokenizer
    from kserve.config import ModelConfig

    messages = [{"role": "user", "content": "word " * 400}]
    # The prompt's length, counted apart from the server: the model's own template rendered to text, and
    # that text tokenized whole (the plain text holds no control-token look-alikes, so the two routes agree).
    model_dir = server.app.state.server.context.engine.model_dir
    dialect = ModelConfig.from_model_dir(model_dir).chat_dialect  # the family's, as the engine decides it at load
    text = ChatTemplate.load(model_dir, dialect=dialect).render(messages, None, add_generation_prompt=True)
    prompt_len = len(load_tokenizer(model_dir).encode(text, allow_special_tokens=True))
    assert prompt_len > MAX_MODEL_LEN
    message = http.post(CHAT, json=chat(messages=messages)).json()["error"]["message"]
    assert f"the prompt is {prompt_len} tokens" in message, message
    assert f"by {prompt_len + 1 - MAX_MODEL_LEN} tokens" in message, message


def test_max_tokens_beyond_context_is_clamped(http):
    resp = http.post(CHAT, json=chat(max_tokens=10**9, ignore_eos=True, temperature=0))
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    assert resp.json()["choices"][0]["finish_reason"] == "length"


def test_auth_required(server):
    body = chat()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        resp = httpx.post(server.base_url + CHAT, json=body, headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["type"] == "authentication_error"
        assert "API key" in resp.json()["error"]["message"]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    ok = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in ok.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200  # ops endpoints stay open


def test_body_too_large(http):
    big = chat(messages=[{"role": "user", "content": "x" * (BODY_LIMIT + 10)}])
    resp = http.post(CHAT, json=big)
    assert resp.status_code == 413
    assert str(BODY_LIMIT) in resp.json()["error"]["message"]


def test_body_too_large_without_content_length(http):
    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}]}'

    resp = http.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method(http):
    resp = http.get("/v1/nothing-here")
    assert resp.status_code == 404 and "error" in resp.json()
    resp = http.get(CHAT)
    assert resp.status_code == 405 and "error" in resp.json()


class _HeldEngine:
    """Engine stand-in whose requests stay in flight until released (admission control is under test)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def generate(self, request_id, prompt_token_ids, params):
        from kserve.engine.outputs import CompletionOutput, RequestOutput

        self.started += 1
        await self.release.wait()
        yield RequestOutput(request_id, None, prompt_token_ids,
                            [CompletionOutput(0, "ok", [1], None, "stop")], finished=True)

    async def abort(self, request_id):
        pass

    def stats(self):
        return {}

    async def shutdown(self):
        pass


def test_too_many_concurrent_requests_get_429():
    from kserve.chat import ChatTemplate, load_tokenizer
    from kserve.server.context import ServingContext
    from kserve.tiny import embedded_model_dir

    model_dir = embedded_model_dir()
    engine = _HeldEngine()

    async def loader(settings, metrics):
        engine.release = asyncio.Event()  # bound to the server's loop
        return ServingContext(engine=engine, tokenizer=load_tokenizer(model_dir), template=ChatTemplate.load(model_dir),
                              model_name=MODEL, max_model_len=1024, vocab_size=2048, settings=settings,
                              metrics=metrics)

    with BackgroundServer(ServerSettings(port=0, max_concurrent_requests=2), loader) as srv:
        results: list[int] = []

        def held_request():
            results.append(httpx.post(srv.base_url + CHAT, json=chat(), timeout=30).status_code)

        threads = [threading.Thread(target=held_request) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while engine.started < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        resp = httpx.post(srv.base_url + CHAT, json=chat())
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["type"] == "rate_limit_error"
        assert "2 concurrent" in resp.json()["error"]["message"]
        # Admission comes before any preparation: a request that preparing would refuse is not even read.
        for path, body in ((CHAT, chat(messages=[{"role": "tool", "content": "x"}])),
                           (COMPLETIONS, completion(prompt=[1, 2, 10**7]))):
            assert httpx.post(srv.base_url + path, json=body).status_code == 429
        srv.call_in_loop(engine.release.set)
        for t in threads:
            t.join(timeout=10)
        assert results == [200, 200]
        assert httpx.post(srv.base_url + CHAT, json=chat()).status_code == 200
        # streams that the client abandons while the engine holds them give their slot back
        srv.call_in_loop(engine.release.clear)
        while engine.release.is_set():
            time.sleep(0.01)
        for _ in range(3):
            with httpx.stream("POST", srv.base_url + CHAT, json=chat(stream=True), timeout=10) as s:
                assert s.status_code == 200
                lines = s.iter_lines()  # kept: dropping the iterator closes the connection
                next(lines)  # the role chunk; the engine is still holding the request
                assert srv.app.state.server.context.in_flight == 1
                del lines
            deadline = time.monotonic() + 10
            while srv.app.state.server.context.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            assert srv.app.state.server.context.in_flight == 0
        srv.call_in_loop(engine.release.set)
        assert httpx.post(srv.base_url + CHAT, json=chat()).status_code == 200


class _EndingEngine:
    """Engine stand-in: `finish` is the engine's finish_reason for every request ("abort" as on shutdown or a
    grammar rejection); with `finish=None` it trickles unfinished snapshots until the request is abandoned."""

    def __init__(self) -> None:
        self.finish: str | None = "abort"
        self.aborted: list[str] = []
        self.refuse = False  # validate_prompt (and generate, as the real engine does) refuse every prompt
        self.fail: Exception | None = None  # generate raises this (an engine bug, not a client error)
        self.fatal_error: Exception | None = None  # set: the step loop has died

    def healthy(self):
        return self.fatal_error is None

    def validate_prompt(self, prompt_token_ids, params=None):
        from kserve.engine.errors import PromptRejected

        if self.refuse:
            raise PromptRejected("this engine refuses every prompt today")

    async def generate(self, request_id, prompt_token_ids, params):
        from kserve.engine.outputs import CompletionOutput, RequestOutput

        self.validate_prompt(prompt_token_ids, params)
        if self.fail is not None:
            raise self.fail
        for step in range(1, 500):
            await asyncio.sleep(0.02)
            done = self.finish is not None and step == 2
            yield RequestOutput(request_id, None, prompt_token_ids,
                                [CompletionOutput(i, "ok" * step, [1] * step, None, self.finish if done else None)
                                 for i in range(params.n)], finished=done)
            if done:
                return

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return {}

    async def shutdown(self):
        pass


@pytest.fixture(scope="module")
def ending():
    from kserve.chat import ChatTemplate, load_tokenizer
    from kserve.server.context import ServingContext
    from kserve.tiny import embedded_model_dir

    model_dir = embedded_model_dir()
    engine = _EndingEngine()

    async def loader(settings, metrics):
        return ServingContext(engine=engine, tokenizer=load_tokenizer(model_dir), template=ChatTemplate.load(model_dir),
                              model_name=MODEL, max_model_len=1024, vocab_size=2048, settings=settings,
                              metrics=metrics)

    with BackgroundServer(ServerSettings(port=0), loader) as srv:
        yield srv, engine


@pytest.mark.parametrize("path,body", [(CHAT, chat()), (COMPLETIONS, completion())], ids=["chat", "completions"])
def test_aborted_generation_is_an_error_never_a_stop(ending, path, body):
    srv, engine = ending
    engine.finish = "abort"
    resp = httpx.post(srv.base_url + path, json=body, timeout=30)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "generation_aborted"
    with httpx.stream("POST", srv.base_url + path, json=dict(body, stream=True), timeout=30) as s:
        assert s.status_code == 200
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[-1]["error"]["code"] == "generation_aborted", payloads[-1]
    assert not [c for p in payloads for c in p.get("choices", []) if c.get("finish_reason")]
    engine.finish = "length"  # control: a normal end still reports its reason
    assert httpx.post(srv.base_url + path, json=body, timeout=30).json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body,param", [(CHAT, chat(), "messages"), (COMPLETIONS, completion(), "prompt")],
                         ids=["chat", "completions"])
def test_engine_refusal_is_a_400_before_streaming_and_other_engine_errors_are_500(ending, path, body, param):
    srv, engine = ending
    engine.finish, engine.refuse = "stop", True
    try:
        for stream in (False, True):
            resp = httpx.post(srv.base_url + path, json=dict(body, stream=stream), timeout=30)
            assert resp.status_code == 400, resp.text  # a status line, not an in-band error in a 200 stream
            error = resp.json()["error"]
            assert error["code"] == "prompt_rejected" and error["param"] == param
            assert "refuses every prompt today" in error["message"]
    finally:
        engine.refuse = False
    engine.fail = ValueError("an engine bug that happens to be a ValueError")
    try:
        resp = httpx.post(srv.base_url + path, json=body, timeout=30)
        assert resp.status_code == 500, resp.text
    finally:
        engine.fail = None
    assert httpx.post(srv.base_url + path, json=body, timeout=30).status_code == 200


def test_health_fails_once_the_engine_loop_has_died(ending):
    srv, engine = ending
    assert httpx.get(srv.base_url + "/health").status_code == 200
    engine.fatal_error = RuntimeError("CUDA error: an illegal memory access")
    try:
        resp = httpx.get(srv.base_url + "/health")
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "engine_dead"
        assert "illegal memory access" in resp.json()["error"]["message"]
        assert httpx.post(srv.base_url + CHAT, json=chat()).status_code == 503
    finally:
        engine.fatal_error = None
    assert httpx.get(srv.base_url + "/health").status_code == 200


def test_client_disconnect_is_499_on_both_endpoints(ending):
    srv, engine = ending
    engine.finish = None  # never finishes by itself
    for path, body in ((CHAT, chat()), (COMPLETIONS, completion())):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.base_url + path, json=body, timeout=0.5)
    endpoint_status: dict = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        endpoint_status = dict(srv.app.state.server.metrics.requests)
        if endpoint_status.get((CHAT, 499)) and endpoint_status.get((COMPLETIONS, 499)):
            break
        time.sleep(0.05)
    assert endpoint_status.get((CHAT, 499)) == 1, endpoint_status
    assert endpoint_status.get((COMPLETIONS, 499)) == 1, endpoint_status
    assert len(engine.aborted) >= 2


def test_vllm_switches_at_their_defaults_are_accepted(http):
    resp = http.post(CHAT, json=chat(continue_final_message=False, guided_json=None, structured_outputs=None))
    assert resp.status_code == 200, resp.text
    resp = http.post(CHAT, json=chat(continue_final_message=True, add_generation_prompt=False, messages=PREFILLED))
    assert resp.status_code == 200, resp.text


def test_server_still_serving_after_bad_inputs(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    resp = client.chat.completions.create(model=MODEL, messages=OK_MESSAGES, max_tokens=3)
    assert resp.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=MODEL, messages=OK_MESSAGES, max_tokens=3, stream=True)
    assert [c for c in stream if c.choices and c.choices[0].finish_reason]


def test_health_is_503_until_the_model_loads():
    """Readiness: /health answers 503 (OpenAI-shaped) while loading, and reports a failed load."""
    release = threading.Event()

    async def slow_failing_loader(settings, metrics):
        while not release.is_set():
            await asyncio.sleep(0.01)
        raise RuntimeError("weights missing")

    srv = BackgroundServer(ServerSettings(port=0), slow_failing_loader)
    srv.thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        resp = httpx.get(srv.base_url + "/health")
        assert resp.status_code == 503 and "loading" in resp.json()["error"]["message"]
        assert httpx.post(srv.base_url + CHAT, json=chat()).status_code == 503
        release.set()
        while time.monotonic() < deadline and srv.app.state.server.load_error is None:
            time.sleep(0.01)
        resp = httpx.get(srv.base_url + "/health")
        assert resp.status_code == 503 and "weights missing" in resp.json()["error"]["message"]
    finally:
        srv.stop()


@pytest.mark.parametrize("schema", [
    {"$id": "#user", "type": "object"},
    {"$id": "https://example.com/schemas/user#/$defs/name", "type": "object"},
])
def test_draft7_schemas_that_2020_12_rejects_are_accepted(schema):
    # The vendor verifier's TestID cases: valid draft-07 `$id`s that 2020-12's meta-schema refuses.
    from kserve.server.validation import schema_error

    assert schema_error(schema) is None
    assert schema_error({"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}) is not None
    assert schema_error({"type": "objekt"}) is not None


def test_a_tool_schema_nested_too_deeply_to_render_is_a_400(http):
    """A `default` nested 700 arrays deep passes the schema checks but no renderer can walk it."""
    deep: object = 1
    for _ in range(700):
        deep = [deep]
    tool = {"type": "function", "function": {"name": "deep", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "default": deep}}}}}
    body = {"model": MODEL, "messages": OK_MESSAGES, "tools": [tool], "max_tokens": 1}
    resp = http.post("/v1/chat/completions", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages"
    assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": OK_MESSAGES, "max_tokens": 1}
                     ).status_code == 200
