"""The server over the real engine (embedded tiny K2.6 model), on a real uvicorn, through the official client."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
from live_server import openai_client  # noqa: E402
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

from kserve.chat import ChatTemplate  # noqa: E402
from kserve.config import ModelConfig  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CONFORMANCE = SHARED / "conformance"

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colors."}]},
]


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def test_models_and_health(server, client, ctx):
    assert httpx.get(server.base_url + "/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [ctx.model_name]
    assert ctx.model_name == Path(ctx.engine.model_dir).name
    docs = httpx.get(server.base_url + "/openapi.json").json()
    assert "/v1/chat/completions" in docs["paths"] and "/v1/completions" in docs["paths"]
    assert "ChatCompletionRequest" in json.dumps(docs)
    assert httpx.get(server.base_url + "/docs").status_code == 200


def test_retrieve_model_by_id(client, ctx):
    card = client.models.retrieve(ctx.model_name)
    assert (card.id, card.object) == (ctx.model_name, "model")
    assert card.created == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as caught:  # a slash in the id is part of the id, not a route
        client.models.retrieve(f"org/{ctx.model_name}")
    assert caught.value.body["code"] == "model_not_found"


def test_chat_non_streaming_usage_matches_real_token_counts(client, ctx):
    resp = client.chat.completions.create(model=ctx.model_name, messages=MESSAGES, max_tokens=12, seed=7,
                                          logprobs=True, top_logprobs=2)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    # prompt tokens: what the chat layer encodes for this conversation, computed independently here
    template = ChatTemplate.load(ctx.engine.model_dir, dialect=ModelConfig.from_model_dir(ctx.engine.model_dir).chat_dialect)
    expected_prompt = template.encode(ctx.tokenizer, [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colors."},
    ])
    assert resp.usage.prompt_tokens == len(expected_prompt)
    # completion tokens: one logprob entry per generated token, whose bytes make up the content
    entries = choice.logprobs.content
    assert resp.usage.completion_tokens == len(entries) >= 1
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    if choice.finish_reason == "length":
        assert resp.usage.completion_tokens == 12
    specials = ctx.tokenizer.special_ids
    visible = [e for e in entries if not (e.token in specials and ctx.tokenizer.is_skippable(specials[e.token]))]
    # the embedded K2.6 model thinks first: the tokens spell its reasoning, then the content
    reasoning = (choice.message.model_extra or {}).get("reasoning_content") or ""
    assert bytes(b for e in visible for b in e.bytes).decode("utf-8", "replace") == reasoning + choice.message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)


def test_chat_streaming_wire_format(server, ctx):
    body = {"model": ctx.model_name, "messages": MESSAGES, "max_tokens": 8, "seed": 3, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    # asked for usage, every chunk before the usage chunk carries "usage": null, as OpenAI's do
    assert all("usage" in e and e["usage"] is None for e in events[:-1])
    finish_choice = next(c for e in events for c in e["choices"] if c["finish_reason"])
    assert finish_choice["usage"] == usage["usage"]  # Moonshot-style copy for the K2 vendor verifier
    entries = [t for e in events for c in e["choices"] for t in ((c.get("logprobs") or {}).get("content") or [])]
    assert len(entries) == usage["usage"]["completion_tokens"]
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"]


def test_stream_without_include_usage_sends_no_usage_key(server, ctx):
    body = {"model": ctx.model_name, "messages": MESSAGES, "max_tokens": 4, "seed": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line and line != "data: [DONE]"]
    assert events and all("usage" not in e for e in events)


NULLED_CHAT_FIELDS = ("n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "min_tokens",
                      "ignore_eos", "stop", "seed", "temperature", "top_p", "logit_bias", "tools", "tool_choice",
                      "response_format", "user", "max_completion_tokens", "parallel_tool_calls")


@pytest.mark.parametrize("stream", [False, True], ids=["nostream", "stream"])
def test_null_fields_mean_their_defaults(server, ctx, stream):
    """Clients that serialize unset fields as null (not the official SDK, which leaves them out) get the answer
    the same request without them gets: OpenAI's schemas type these fields "... or null"."""
    def post(body):
        body = {"model": ctx.model_name, "messages": MESSAGES, "max_tokens": 6, "seed": 9, "temperature": 0.0,
                **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}), **body}
        resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        if not stream:
            out = resp.json()
            return out["choices"][0]["message"].get("content"), out["usage"]["completion_tokens"]
        events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        return text, events[-1]["usage"]["completion_tokens"]

    nulled = {field: None for field in NULLED_CHAT_FIELDS if not (stream and field == "stream")}
    nulled["messages"] = [{**m, "name": None, "tool_calls": None} for m in MESSAGES]
    if stream:
        nulled["stream_options"] = {"include_usage": True}
    assert post(nulled) == post({})
    completion = {"model": ctx.model_name, "prompt": "hello", "max_tokens": 4, "seed": 9, "n": None, "echo": None,
                  "stream": None, "logprobs": None, "presence_penalty": None, "skip_special_tokens": None}
    resp = httpx.post(server.base_url + "/v1/completions", json=completion, timeout=120)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 1, resp.text


def test_null_for_a_required_field_is_still_a_400(server, ctx):
    resp = httpx.post(server.base_url + "/v1/chat/completions", json={"model": ctx.model_name, "messages": None},
                      timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stream_reassembles_to_non_streaming_answer(client, ctx, temperature):
    kw = {"model": ctx.model_name, "messages": MESSAGES, "max_tokens": 24, "seed": 1234, "temperature": temperature}
    plain = client.chat.completions.create(**kw)
    # The SDK's own accumulator (the one behind client.chat.completions.stream, whose get_final_completion
    # refuses finish_reason "length", which a random tiny model usually hits).
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        state.handle_chunk(chunk)
    final = state.current_completion_snapshot
    assert final.choices[0].message.content == plain.choices[0].message.content
    assert final.choices[0].finish_reason == plain.choices[0].finish_reason
    assert final.usage.completion_tokens == plain.usage.completion_tokens
    assert final.usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_n_choices(client, ctx):
    resp = client.chat.completions.create(model=ctx.model_name, messages=MESSAGES, max_tokens=6, n=2, seed=5)
    assert [c.index for c in resp.choices] == [0, 1]
    chunks = list(client.chat.completions.create(model=ctx.model_name, messages=MESSAGES, max_tokens=6, n=2,
                                                 seed=5, stream=True))
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == resp.choices[i].message.content


def test_completions_raw_prompt_n2_logprobs_echo(client, ctx):
    prompt = "<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|>"
    resp = client.completions.create(model=ctx.model_name, prompt=prompt, max_tokens=10, n=2, logprobs=3, seed=11)
    assert len(resp.choices) == 2 and [c.index for c in resp.choices] == [0, 1]
    ids = ctx.tokenizer.encode(prompt, allow_special_tokens=True)
    assert resp.usage.prompt_tokens == len(ids)  # the markers are single special tokens
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in resp.choices)
    for c in resp.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        # as in vLLM, a stop token the model sampled is scored (and counted) but not part of the text
        stop_token = c.finish_reason == "stop" and lp.tokens[-1] in ("<|im_end|>", "[EOS]")
        assert "".join(lp.tokens[: len(lp.tokens) - stop_token]) == c.text or "\ufffd" in c.text
        assert all(len(top) <= 3 for top in lp.top_logprobs)
    # streamed choices reassemble to the same texts (same seed)
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=ctx.model_name, prompt=prompt, max_tokens=10, n=2, logprobs=3,
                                           seed=11, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[0], streamed[1]] == [c.text for c in resp.choices]
    # the same prompt as token ids, and echo
    resp_ids = client.completions.create(model=ctx.model_name, prompt=ids, max_tokens=4, echo=True, seed=11)
    assert resp_ids.usage.prompt_tokens == len(ids)
    assert resp_ids.choices[0].text.startswith(prompt)


def test_completions_several_prompts(client, ctx):
    prompts = ["one two", "three four five"]
    resp = client.completions.create(model=ctx.model_name, prompt=prompts, max_tokens=3, n=2, seed=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == sum(len(ctx.tokenizer.encode(p)) for p in prompts)
    single = client.completions.create(model=ctx.model_name, prompt=prompts[1], max_tokens=3, n=2, seed=2)
    assert [c.text for c in resp.choices[2:]] == [c.text for c in single.choices]  # same seed, same texts


def test_completions_stop_string_cuts_output(client, ctx):
    prompt = "The quick brown fox"
    free = client.completions.create(model=ctx.model_name, prompt=prompt, max_tokens=40, temperature=0,
                                     seed=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    assert len(text) >= 10, text
    stop = text[5:8]
    cut = client.completions.create(model=ctx.model_name, prompt=prompt, max_tokens=40, temperature=0,
                                    seed=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=ctx.model_name, prompt=prompt, max_tokens=40, temperature=0, seed=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == cut.choices[0].text


def _kvv_requests() -> list[dict]:
    files = sorted(CONFORMANCE.glob("kvv_samples_*.jsonl"))
    if not files:
        pytest.skip("../shared/conformance/kvv_samples_*.jsonl is absent")
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_every_kvv_sample_is_accepted_streaming_and_not(server, ctx):
    requests = _kvv_requests()
    assert len(requests) >= 14
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        for i, raw in enumerate(requests):
            body = dict(raw, model=ctx.model_name, max_tokens=2)  # the K2VV client overrides model, too
            body["stream"] = False
            resp = http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, (i, resp.text)
            data = resp.json()
            assert data["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as s:
                assert s.status_code == 200, (i, s.read())
                lines = [line for line in s.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            events = [json.loads(line[6:]) for line in lines[:-1]]
            assert not any("error" in e for e in events), (i, events)
            assert events[-1]["usage"]["prompt_tokens"] == data["usage"]["prompt_tokens"]
            assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]


def test_client_disconnect_aborts_and_frees_cache_blocks(server, ctx):
    engine = ctx.engine
    body = {"model": ctx.model_name, "messages": MESSAGES, "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    http = httpx.Client(timeout=60)
    with http, http.stream("POST", server.base_url + "/v1/chat/completions", json=body) as resp:
        lines = resp.iter_lines()  # kept alive: dropping it would close the connection early
        seen = 0
        while seen < 4:
            seen += bool(next(lines))
        during = engine.stats()
        assert during.num_running == 1 and during.kv_blocks_used > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0:
            break
        time.sleep(0.05)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.generation_tokens_total < during.generation_tokens_total + 1000  # stopped well before 4000


def test_non_streaming_client_timeout_aborts(server, ctx):
    engine = ctx.engine
    body = {"model": ctx.model_name, "messages": MESSAGES, "max_tokens": 4000, "ignore_eos": True}
    before = engine.stats().generation_tokens_total
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.kv_blocks_used == 0:
            break
        time.sleep(0.05)
    stats = engine.stats()
    assert (stats.num_running, stats.kv_blocks_used) == (0, 0)
    assert stats.generation_tokens_total - before < 2000


def test_metrics_exposes_engine_stats(server, client, ctx):
    client.chat.completions.create(model=ctx.model_name, messages=MESSAGES, max_tokens=2)
    text = httpx.get(server.base_url + "/metrics").text
    assert "kserve_engine_kv_blocks_total" in text
    assert 'kserve_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "kserve_tool_call_problems_total" in text
    import re

    sample = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? -?[0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith(("# HELP ", "# TYPE ")) or sample.match(line), line
    ttft_count = re.search(r"^kserve_time_to_first_token_seconds_count (\d+)$", text, re.MULTILINE)
    assert ttft_count and int(ttft_count.group(1)) >= 1


def test_continue_final_message_continues_the_reply(client, ctx, engine_prompts):
    """vLLM's continue_final_message: the prompt is the conversation with its final assistant message rendered as
    history (thinking off) minus that turn's end token, and the reply is only what follows the given start."""
    history = [{"role": "user", "content": "Say hello to the team."},
               {"role": "assistant", "content": "Hello <|im_end|> t"}]
    dialect = ModelConfig.from_model_dir(ctx.engine.model_dir).chat_dialect
    template = ChatTemplate.load(ctx.engine.model_dir, dialect=dialect)
    as_history = template.encode(ctx.tokenizer, history, add_generation_prompt=False, thinking=False)
    assert as_history[-1] == ctx.tokenizer.special_ids["<|im_end|>"]
    common = {"model": ctx.model_name, "max_tokens": 8, "temperature": 0}
    resp = client.chat.completions.create(messages=history, extra_body={"continue_final_message": True,
                                                                        "add_generation_prompt": False}, **common)
    assert engine_prompts[-1] == as_history[:-1]  # the client's "<|im_end|>" stays text
    assert getattr(resp.choices[0].message, "reasoning_content", None) is None
    # the reply is the greedy continuation of exactly that prompt, without the start it was given
    plain = client.completions.create(prompt=as_history[:-1], **common)
    assert resp.choices[0].message.content == plain.choices[0].text
    assert resp.usage.prompt_tokens == len(as_history) - 1
    streamed = client.chat.completions.create(messages=history, stream=True,
                                              extra_body={"continue_final_message": True}, **common)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain.choices[0].text
    tokenized = httpx.post(str(client.base_url).removesuffix("v1/") + "tokenize", timeout=60,
                           json={"messages": history, "continue_final_message": True}).json()
    assert tokenized["tokens"] == as_history[:-1]
