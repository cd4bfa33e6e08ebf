"""Engine death on the Anthropic and Responses endpoints: 503 in each API's own shape, in-band on streams.

Real uvicorn over the real engine (embedded tiny model) with the step-fault test hook, which is what
the test is about; every model step fails once the trigger file exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openai")  # live_server needs the openai SDK (a test extra)

from live_server import server_with_step_faults, stream_until_engine_death

HI = [{"role": "user", "content": "hi"}]


def test_engine_death_is_503_engine_dead_in_the_anthropic_and_responses_shapes(tmp_path: Path):
    trigger = tmp_path / "fail-now"
    with server_with_step_faults(trigger) as srv:
        model = srv.app.state.server.context.model_name
        events = stream_until_engine_death(srv.base_url + "/v1/messages",
                                           {"model": model, "messages": HI, "max_tokens": 100_000, "stream": True,
                                            "ignore_eos": True}, trigger)
        last = json.loads(events[-1])
        assert last["type"] == "error" and last["error"]["type"] == "overloaded_error", last
        assert "engine" in last["error"]["message"]

        resp = httpx.post(srv.base_url + "/v1/messages", json={"model": model, "messages": HI, "max_tokens": 4}, timeout=30)
        assert resp.status_code == 503, resp.text
        assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "overloaded_error"

        resp = httpx.post(srv.base_url + "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 4},
                          timeout=30)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "engine_dead"


def test_engine_death_mid_stream_ends_a_responses_stream_with_engine_dead(tmp_path: Path):
    trigger = tmp_path / "fail-now"
    with server_with_step_faults(trigger) as srv:
        model = srv.app.state.server.context.model_name
        events = [json.loads(e) for e in stream_until_engine_death(
            srv.base_url + "/v1/responses",
            {"model": model, "input": "hi", "max_output_tokens": 100_000, "stream": True, "ignore_eos": True}, trigger)]
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["error", "response.failed"], kinds
        assert events[-2]["code"] == "engine_dead", events[-2]
        assert events[-1]["response"]["error"]["code"] == "engine_dead"
