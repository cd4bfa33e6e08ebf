"""Server reliability (issue 13): numbers checked at the door, cached-token usage on completions, curl-style
bodies, schema-only-stop with min_tokens, request ids in logs, and engine death reported as 503.

Real uvicorn over the real engine (embedded tiny model): the shared live server (conftest's `server`); the
death test starts its own with the step-fault test hook, which is what it is about.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openai")  # live_server needs the openai SDK (a test extra)

from live_server import server_with_step_faults, stream_until_engine_death

from kserve.server.request_log import RequestIdFilter

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.app.state.server.context.model_name


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("top_k", [2**63, 2**31])
def test_out_of_range_top_k_is_a_400(server, model, path, top_k):
    body = {"model": model, "max_tokens": 2, "top_k": top_k, "temperature": 1.0}
    body.update({"messages": HI} if path == CHAT else {"prompt": "hi"})
    error = assert_openai_error(httpx.post(server.base_url + path, json=body, timeout=60), 400, "top_k")
    assert "top_k" in error["message"] and error["type"] == "invalid_request_error"


def test_completions_usage_reports_cached_tokens(server, model):
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several full KV blocks
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    first = httpx.post(server.base_url + COMPLETIONS, json=body, timeout=60).json()["usage"]
    again = httpx.post(server.base_url + COMPLETIONS, json=body, timeout=60).json()["usage"]
    assert "cached_tokens" in first["prompt_tokens_details"]
    assert again["prompt_tokens_details"]["cached_tokens"] >= 16, again
    with httpx.stream("POST", server.base_url + COMPLETIONS, timeout=60,
                      json=dict(body, stream=True, stream_options={"include_usage": True})) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_json_body_without_json_content_type_is_accepted(server, model, content_type):
    # What `curl -d '{...}'` sends: the JSON body, labelled form-encoded (or with no Content-Type at all).
    raw = json.dumps({"model": model, "messages": HI, "max_tokens": 2}).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    request = httpx.Request("POST", server.base_url + CHAT, content=raw, headers=headers)
    assert request.headers.get("Content-Type") == content_type
    resp = httpx.Client(timeout=60).send(request)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    assert_openai_error(httpx.post(server.base_url + CHAT, content=b"model=x&messages=y", headers={
        "Content-Type": "application/x-www-form-urlencoded"}, timeout=60), 400)


@pytest.mark.parametrize("stream", [False, True])
def test_schema_that_allows_only_empty_object_with_min_tokens_is_not_a_server_error(server, model, stream):
    body = {"model": model, "messages": HI, "max_tokens": 40, "min_tokens": 20, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "empty", "schema": {
                "type": "object", "properties": {}, "additionalProperties": False}}}}
    if not stream:
        resp = httpx.post(server.base_url + CHAT, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        text = choice["message"]["content"]
    else:
        with httpx.stream("POST", server.base_url + CHAT, json=body, timeout=120) as s:
            assert s.status_code == 200
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert not [e for e in events if "error" in e], events
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        choice = next(e["choices"][0] for e in events if e["choices"] and e["choices"][0].get("finish_reason"))
    assert json.loads(text) == {} and choice["finish_reason"] == "stop"


def test_response_carries_its_request_id(server, model):
    resp = httpx.post(server.base_url + CHAT, json={"model": model, "messages": HI, "max_tokens": 2}, timeout=60)
    assert resp.headers["x-request-id"] == resp.json()["id"]
    resp = httpx.get(server.base_url + "/health", headers={"X-Request-Id": "probe-1"})
    assert resp.headers["x-request-id"] == "probe-1"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(RequestIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kserve_log() -> Iterator[_Lines]:
    lines = _Lines()
    logging.getLogger("kserve").addHandler(lines)
    yield lines
    logging.getLogger("kserve").removeHandler(lines)


def test_engine_death_mid_stream_is_503_in_band_health_503_and_logged_with_the_request_id(tmp_path: Path,
                                                                                          kserve_log: _Lines):
    trigger = tmp_path / "fail-now"
    with server_with_step_faults(trigger) as srv:
        model = srv.app.state.server.context.model_name
        body = {"model": model, "messages": HI, "max_tokens": 100_000, "ignore_eos": True, "stream": True}
        events = stream_until_engine_death(srv.base_url + CHAT, body, trigger)  # every step fails after three
        died_at = time.monotonic()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and error["type"] == "service_unavailable", error
        assert "3 failed steps in a row" in error["message"]
        rid = json.loads(events[0])["id"]
        health = httpx.get(srv.base_url + "/health")
        assert time.monotonic() - died_at < 5
        assert_openai_error(health, 503)
        assert health.json()["error"]["code"] == "engine_dead"
        for path, extra in ((CHAT, {"messages": HI}), (COMPLETIONS, {"prompt": "hi"})):
            resp = httpx.post(srv.base_url + path, json={"model": model, "max_tokens": 2, **extra}, timeout=30)
            assert assert_openai_error(resp, 503)["code"] == "engine_dead"
        mine = [r for r in kserve_log.records if r.request_id == rid]
        assert any("engine" in r.getMessage() for r in mine), [(r.request_id, r.getMessage())
                                                               for r in kserve_log.records]


def test_completions_merge_keeps_only_the_latest_snapshot_for_a_slow_reader():
    import asyncio
    from types import SimpleNamespace

    from kserve.engine.outputs import CompletionOutput, RequestOutput
    from kserve.server.serving_completion import (
        PreparedCompletion,
        PreparedPrompt,
        _merged,
    )

    steps = 200

    class FastEngine:
        async def generate(self, request_id, prompt_ids, params):
            for step in range(1, steps + 1):
                await asyncio.sleep(0)
                done = step == steps
                yield RequestOutput(request_id, None, prompt_ids,
                                    [CompletionOutput(0, "x" * step, [1] * step, None, "length" if done else None)],
                                    finished=done)

        async def abort(self, request_id):
            raise AssertionError("nothing is left unfinished")

    ctx = SimpleNamespace(engine=FastEngine(), abort=FastEngine().abort)
    prep = PreparedCompletion("cmpl-x", None, [PreparedPrompt(f"cmpl-x-{i}", [5], "p", None) for i in range(2)])

    async def slow_reader():
        got = []
        async for i, out in _merged(ctx, prep):
            got.append((i, out))
            await asyncio.sleep(0.01)  # a slow client
        return got

    got = asyncio.run(slow_reader())
    assert len(got) < steps // 4, len(got)  # not one queued snapshot per engine step
    finals = {i: out for i, out in got if out.finished}
    assert set(finals) == {0, 1} and all(out.outputs[0].text == "x" * steps for out in finals.values())


def test_idle_connection_outlives_the_clients_pool_expiry(server):
    """httpx (so the openai and anthropic SDKs) reuses an idle pooled connection for up to 5 s; a server that
    closed idle connections at 5 s (uvicorn's default) raced it, and a request sent as it closed failed with a
    disconnect. One connection, idle 6 s between two requests, must still answer."""
    from http.client import HTTPConnection
    from urllib.parse import urlsplit

    url = urlsplit(server.base_url)
    conn = HTTPConnection(url.hostname, url.port, timeout=10)  # one socket; it does not reconnect on its own
    try:
        for attempt in range(2):
            if attempt:
                time.sleep(6)
            conn.request("GET", "/health")
            resp = conn.getresponse()  # after a server-side close: RemoteDisconnected
            assert resp.status == 200, (attempt, resp.status)
            resp.read()
    finally:
        conn.close()
