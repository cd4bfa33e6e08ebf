"""The HTTP surface's tool-call handling, driven by a scripted engine that emits chosen K2 output tokens.

The tiny random model never emits a tool call by itself, so this module replaces only the engine: a
`ScriptedEngine` streams a fixed token sequence (the real K2 tokenizer's ids for a tool-call turn, marker
tokens included) the way the real engine does (cumulative snapshots, incremental detokenization, stop
tokens, max_tokens). Everything above it is real: uvicorn on 127.0.0.1, the server, the chat layer's
template, tokenizer and parser, and the official `openai` client. The real engine is exercised in
test_server_openai.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
K2_DIR = SHARED / "kimi_k2"
if not (K2_DIR / "tiktoken.model").exists():
    pytest.skip("../shared/kimi_k2 (the real K2 tokenizer) is absent", allow_module_level=True)

openai = pytest.importorskip("openai")

from kserve.chat import ChatTemplate, load_tokenizer  # noqa: E402
from kserve.config import ModelConfig  # noqa: E402
from kserve.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from kserve.engine.sampling_params import SamplingParams  # noqa: E402
from kserve.server.context import ServerSettings, ServingContext  # noqa: E402
from kserve.server.launch import BackgroundServer  # noqa: E402
from kserve.server.metrics import ServerMetrics  # noqa: E402

MODEL = "k2-scripted"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather information",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@dataclass
class EngineStatsLike:
    num_running: int = 0
    num_waiting: int = 0


class ScriptedEngine:
    """Streams `script(prompt_text)` token by token as cumulative `RequestOutput`s."""

    def __init__(self, tokenizer: Any, script: Callable[[str], str]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.stop_ids = {tokenizer.id_of("<|im_end|>"), tokenizer.id_of("[EOS]")}
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self.seconds_per_token = 0.0  # > 0 paces a stream like a real engine

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        prompt = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        ids = self.tokenizer.encode(self.script(prompt), allow_special_tokens=True)
        outs = [CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)]
        detoks = [self.tokenizer.detokenizer(params.skip_special_tokens) for _ in range(params.n)]
        self.running.add(request_id)
        try:
            for step, tok in enumerate(ids):
                await asyncio.sleep(self.seconds_per_token)
                for out, detok in zip(outs, detoks):
                    if tok in self.stop_ids:
                        out.finish_reason = "stop"
                        continue
                    out.token_ids.append(tok)
                    out.text += detok.add(tok)
                    if len(out.token_ids) >= (params.max_tokens or 1 << 30):
                        out.finish_reason = "length"
                done = all(o.finish_reason for o in outs) or step == len(ids) - 1
                for out, detok in zip(outs, detoks):
                    if done:
                        out.text += detok.flush()
                        out.finish_reason = out.finish_reason or "stop"
                yield RequestOutput(request_id, None, prompt_token_ids,
                                    [CompletionOutput(o.index, o.text, list(o.token_ids), None, o.finish_reason)
                                     for o in outs], finished=done)
                if done:
                    return
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStatsLike:
        return EngineStatsLike(num_running=len(self.running))

    async def shutdown(self) -> None:
        pass


def tool_call_text(name: str, args: str, idx: int = 0) -> str:
    return (f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{args}<|tool_call_end|>")


def section(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|><|im_end|>"


def default_script(prompt: str) -> str:
    """Answers after a tool result; otherwise picks a tool-call turn by a keyword in the last user message."""
    last = prompt.rsplit("<|im_user|>", 1)[-1]
    if "## Return of" in prompt.rsplit("<|im_user|>", 1)[-1]:
        return "It is sunny in Beijing today.<|im_end|>"
    if "two cities" in last:
        return section(tool_call_text("get_weather", '{"city": "Beijing"}'),
                       tool_call_text("get_weather", '{"city": "Shanghai"}', 1))
    if "weather" in last:
        return "Let me check." + section(tool_call_text("get_weather", '{"city": "Beijing"}'))
    if "clock" in last:
        return section(tool_call_text("get_time", ""))
    if "bad schema" in last:
        return section(tool_call_text("get_weather", '{"town": 3}'))
    if "undeclared" in last:
        return section(tool_call_text("img_gen", '{"prompt": "cat"}'))
    if "empty section" in last:
        return "<|tool_calls_section_begin|><|tool_calls_section_end|><|im_end|>"
    return "Hello there, friend.<|im_end|>"


@pytest.fixture(scope="module")
def scripted():
    tokenizer = load_tokenizer(K2_DIR)
    engine = ScriptedEngine(tokenizer, default_script)

    async def loader(settings: ServerSettings, metrics: ServerMetrics) -> ServingContext:
        template = ChatTemplate.load(None, None)
        config = ModelConfig.from_model_dir(K2_DIR)
        return ServingContext(engine=engine, tokenizer=tokenizer, template=template, model_name=MODEL,
                              max_model_len=8192, vocab_size=config.vocab_size, settings=settings,
                              metrics=metrics)

    server = BackgroundServer(ServerSettings(port=0), loader).start()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    yield server, client, engine, tokenizer
    server.stop()


def _chat(client, content: str, tools=None, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          tools=tools or [WEATHER_TOOL, CLOCK_TOOL], **kw)


def _stream_collect(client, content: str, **kw):
    chunks = list(_chat(client, content, stream=True, **kw))
    return chunks


def _problems(server) -> dict[str, int]:
    import httpx

    text = httpx.get(server.base_url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("kserve_tool_call_problems_total{"):
            problem = line.split('problem="')[1].split('"')[0]
            out[problem] = int(line.rsplit(" ", 1)[1])
    return out


def test_tool_call_non_streaming(scripted):
    _, client, _, _ = scripted
    resp = _chat(client, "What is the weather in Beijing?")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.id == "functions.get_weather:0" and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Beijing"}


def test_tool_call_streaming_deltas_are_openai_shaped(scripted):
    _, client, _, _ = scripted
    chunks = _stream_collect(client, "weather in two cities please")
    first = chunks[0].choices[0].delta
    assert first.role == "assistant"
    deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    headers = [d for d in deltas if d.id is not None]
    # id, type and the complete name come once per call, in its first delta
    assert [(d.index, d.id, d.type, d.function.name) for d in headers] == [
        (0, "functions.get_weather:0", "function", "get_weather"),
        (1, "functions.get_weather:1", "function", "get_weather"),
    ]
    assert all(d.function.name is None for d in deltas if d.id is None)
    args = {i: "".join(d.function.arguments or "" for d in deltas if d.index == i) for i in (0, 1)}
    assert json.loads(args[0]) == {"city": "Beijing"} and json.loads(args[1]) == {"city": "Shanghai"}
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["tool_calls"]
    # no marker text leaks into content
    content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert "<|" not in content


def test_stream_reassembles_to_non_streaming_with_sdk_helper(scripted):
    _, client, _, _ = scripted
    messages = [{"role": "user", "content": "What is the weather in Beijing?"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER_TOOL]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    a, b = plain.choices[0], final.choices[0]
    assert b.finish_reason == a.finish_reason == "tool_calls"
    assert b.message.content == a.message.content
    assert [(t.id, t.function.name, t.function.arguments) for t in b.message.tool_calls] == \
           [(t.id, t.function.name, t.function.arguments) for t in a.message.tool_calls]


def test_no_argument_call_gets_empty_object(scripted):
    _, client, _, _ = scripted
    resp = _chat(client, "what does the clock say")
    assert resp.choices[0].message.tool_calls[0].function.arguments == "{}"
    chunks = _stream_collect(client, "what does the clock say")
    args = "".join(tc.function.arguments or "" for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or []))
    assert args == "{}"


def test_tool_choice_none_returns_no_calls(scripted):
    _, client, _, _ = scripted
    resp = _chat(client, "What is the weather in Beijing?", tool_choice="none")
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.tool_calls is None


@pytest.mark.parametrize("prompt,problem", [
    ("bad schema please", "schema_invalid"),
    ("call something undeclared", "undeclared_tool"),
    ("an empty section", "empty_tool_calls"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_problems_are_counted(scripted, prompt, problem, stream):
    server, client, _, _ = scripted
    before = _problems(server)
    if stream:
        chunks = _stream_collect(client, prompt)
        finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason][-1]
    else:
        finish = _chat(client, prompt).choices[0].finish_reason
    after = _problems(server)
    assert after[problem] == before[problem] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    assert finish == ("stop" if problem == "empty_tool_calls" else "tool_calls")


def test_two_turn_tool_round_trip_renders_byte_exact(scripted):
    """Turn 1 returns a call; the call and a tool result go back; turn 2's prompt is the K2 format exactly."""
    _, client, _, tokenizer = scripted
    system = {"role": "system", "content": "You are Kimi, an AI assistant created by Moonshot AI."}
    user = {"role": "user", "content": "What's the weather like in Beijing today? Use the tool to check."}
    first = client.chat.completions.create(model=MODEL, messages=[system, user], tools=[WEATHER_TOOL])
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    history = [
        system, user,
        {"role": "assistant", "content": first.choices[0].message.content,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": '{"weather": "Sunny"}'},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL], logprobs=True)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It is sunny in Beijing today."
    # The prompt the engine saw, rebuilt from the usage count and the reference rendering (seed file format).
    tools_json = json.dumps([WEATHER_TOOL], separators=(",", ":"), ensure_ascii=False)
    expected = (
        f"<|im_system|>tool_declare<|im_middle|>{tools_json}<|im_end|>"
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>What's the weather like in Beijing today? Use the tool to check.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n"
        '{"weather": "Sunny"}<|im_end|><|im_assistant|>assistant<|im_middle|>'
    )
    seen = PROMPTS_SEEN[-1]
    assert seen == expected
    assert second.usage.prompt_tokens == len(tokenizer.encode(expected, allow_special_tokens=True))


PROMPTS_SEEN: list[str] = []
_original_script = default_script


def _recording_script(prompt: str) -> str:
    PROMPTS_SEEN.append(prompt)
    return _original_script(prompt)


@pytest.fixture(autouse=True)
def _record_prompts(scripted):
    engine = scripted[2]
    engine.script = _recording_script
    yield
    engine.script = default_script
    engine.seconds_per_token = 0.0


def test_disconnect_mid_stream_aborts(scripted):
    import httpx

    server, _, engine, _ = scripted
    engine.script = lambda prompt: "word " * 2000 + "<|im_end|>"
    # Paced (2000 tokens take 10 s) so the stream cannot finish, and need no abort, before the client leaves.
    engine.seconds_per_token = 0.005
    body = {"model": MODEL, "messages": [{"role": "user", "content": "talk"}], "stream": True}
    http = httpx.Client(timeout=30)
    with http, http.stream("POST", server.base_url + "/v1/chat/completions", json=body) as resp:
        for i, _line in enumerate(resp.iter_lines()):
            if i > 5:
                break
    for _ in range(200):
        if engine.aborted and not engine.running:
            break
        import time

        time.sleep(0.02)
    assert engine.aborted, "the engine request was not aborted after the client went away"
    assert not engine.running


def test_historical_tool_call_ids_are_normalized(scripted):
    """K2VV history uses bare `search:0` ids; the prompt carries `functions.search:0` on both sides."""
    _, client, _, _ = scripted
    search = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}}}}
    history = [
        {"role": "user", "content": "find cats"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "search:0", "type": "function", "function": {"name": "search", "arguments": '{"query": "cats"}'}}]},
        {"role": "tool", "tool_call_id": "search:0", "name": "search", "content": "many cats"},
        {"role": "_input", "content": "resource text"},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=history, tools=[search])
    assert resp.choices[0].finish_reason == "stop"
    prompt = PROMPTS_SEEN[-1]
    assert "<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>" in prompt
    assert "## Return of functions.search:0\nmany cats" in prompt
    assert "search:0" not in prompt.replace("functions.search:0", "")
    # the vendor verifier's `_input` role is a system message named "resource"
    assert "<|im_system|>resource<|im_middle|>resource text<|im_end|>" in prompt


def test_unknown_extra_fields_are_ignored(scripted):
    server, _, _, _ = scripted
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "x_note": 1}], "foo_bar": {"a": 1},
            "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "Hello there, friend."


def test_max_tokens_clamped_to_context(scripted):
    server, client, engine, _ = scripted
    seen = []
    original = engine.generate

    async def spy(request_id, prompt_token_ids, params):
        seen.append((len(prompt_token_ids), params.max_tokens))
        async for out in original(request_id, prompt_token_ids, params):
            yield out

    engine.generate = spy
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16000)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    finally:
        del engine.generate
    max_len = server.app.state.server.context.max_model_len
    (p1, m1), (_, m2), (p3, m3) = seen
    assert m1 == max_len - p1 and m2 == 5 and m3 == max_len - p3


def test_reasoning_split_when_enabled(scripted):
    server, client, engine, _ = scripted
    settings = server.app.state.server.settings
    engine.script = lambda prompt: "<think>User wants weather.</think>Checking." + section(
        tool_call_text("get_weather", '{"city": "Paris"}'))
    settings.enable_reasoning = True
    try:
        resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              tools=[WEATHER_TOOL])
        msg = resp.choices[0].message
        assert msg.reasoning_content == "User wants weather."
        assert msg.content == "Checking."
        assert msg.tool_calls[0].function.arguments == '{"city": "Paris"}'
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                     tools=[WEATHER_TOOL], stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "User wants weather."
        assert "".join(d.content or "" for d in deltas) == "Checking."
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            ["tool_calls"]
    finally:
        settings.enable_reasoning = False


def test_tools_reach_the_prompt_exactly_as_sent(scripted):
    """The vendor verifier's tools list `function` before `type`; the tool_declare turn keeps the client's JSON."""
    server, _, _, _ = scripted
    import httpx

    path = SHARED / "conformance" / "kvv_samples_subset.jsonl"
    if not path.exists():
        pytest.skip("../shared/conformance/kvv_samples_subset.jsonl is absent")
    raw = json.loads(path.read_text().splitlines()[0])
    assert list(raw["tools"][0]) == ["function", "type"]
    body = dict(raw, model=MODEL, stream=False, max_tokens=4)
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    tools_json = json.dumps(raw["tools"], separators=(",", ":"), ensure_ascii=False)
    assert PROMPTS_SEEN[-1].startswith(f"<|im_system|>tool_declare<|im_middle|>{tools_json}<|im_end|>")


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_returns_one_call(scripted, stream):
    _, client, _, _ = scripted
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "weather in two cities please"}],
              "tools": [WEATHER_TOOL], "parallel_tool_calls": False}
    if not stream:
        resp = client.chat.completions.create(**kw)
        calls = [(c.id, c.function.arguments) for c in resp.choices[0].message.tool_calls]
        finish = resp.choices[0].finish_reason
    else:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
        assert {d.index for d in deltas} == {0}
        calls = [(next(d.id for d in deltas if d.id), "".join(d.function.arguments or "" for d in deltas))]
        finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason][-1]
    assert calls == [("functions.get_weather:0", '{"city": "Beijing"}')]
    assert finish == "tool_calls"


def test_startup_self_check_catches_a_template_parser_mismatch(scripted):
    from kserve.server.self_check import SelfCheckError, run_self_check

    server, _, _, _ = scripted
    ctx = server.app.state.server.context
    run_self_check(ctx)  # the built-in K2 format agrees with the parser
    # A template that writes tool calls as plain JSON (a fine-tune's format, say) must refuse to serve.
    drifted = ChatTemplate(source=(
        "{% for m in messages %}<|im_{{ 'user' if m.role == 'user' else 'assistant' }}|>{{ m.role }}<|im_middle|>"
        "{{ m.content or '' }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"), origin="drifted")
    bad = ServingContext(engine=ctx.engine, tokenizer=ctx.tokenizer, template=drifted, model_name=MODEL,
                         max_model_len=ctx.max_model_len, vocab_size=ctx.vocab_size, settings=ctx.settings,
                         metrics=ServerMetrics())
    with pytest.raises(SelfCheckError, match="tool parser"):
        run_self_check(bad)


class _UnconstrainedCompiler:
    """A grammar compiler that hands back no constraint: the live self-check must notice."""

    def compile(self, spec):
        return None


def test_live_self_check_names_the_failing_stage(scripted):
    from kserve.server.self_check import SelfCheckError, run_live_self_check

    server, _, _, _ = scripted
    ctx = server.app.state.server.context
    broken = ServingContext(engine=ctx.engine, tokenizer=ctx.tokenizer, template=ctx.template, model_name=MODEL,
                            max_model_len=ctx.max_model_len, vocab_size=ctx.vocab_size, settings=ctx.settings,
                            metrics=ServerMetrics(), grammar=_UnconstrainedCompiler())
    with pytest.raises(SelfCheckError, match="grammar stage"):
        asyncio.run(run_live_self_check(broken))
