"""Engine death on the Anthropic and Responses endpoints: 503 in each API's own shape, in-band on streams.

Real uvicorn over the real engine (embedded tiny model) with the step-fault test hook, which is what
the test is about; every model step fails once the trigger file exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from kserve.config import EngineConfig
from kserve.engine.faults import STEP_FAULTS_KEY, StepFaults
from kserve.server.context import ServerSettings
from kserve.server.launch import BackgroundServer

HI = [{"role": "user", "content": "hi"}]


def _stream_events(url: str, body: dict, trigger: Path) -> list[str]:
    """The SSE data lines of a stream; the trigger is touched once three have arrived."""
    events: list[str] = []
    with httpx.stream("POST", url, json=body, timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    trigger.touch()
    return events


def test_engine_death_is_503_engine_dead_in_the_anthropic_and_responses_shapes(tmp_path: Path):
    trigger = tmp_path / "fail-now"
    engine = EngineConfig(extra={STEP_FAULTS_KEY: StepFaults(trigger_file=str(trigger))})
    srv = BackgroundServer(ServerSettings(port=0, engine=engine)).start()
    try:
        model = srv.app.state.server.context.model_name
        events = _stream_events(srv.base_url + "/v1/messages",
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
    finally:
        srv.stop()


def test_engine_death_mid_stream_ends_a_responses_stream_with_engine_dead(tmp_path: Path):
    trigger = tmp_path / "fail-now"
    engine = EngineConfig(extra={STEP_FAULTS_KEY: StepFaults(trigger_file=str(trigger))})
    srv = BackgroundServer(ServerSettings(port=0, engine=engine)).start()
    try:
        model = srv.app.state.server.context.model_name
        events = [json.loads(e) for e in _stream_events(
            srv.base_url + "/v1/responses",
            {"model": model, "input": "hi", "max_output_tokens": 100_000, "stream": True, "ignore_eos": True}, trigger)]
        kinds = [e["type"] for e in events]
        assert kinds[-2:] == ["error", "response.failed"], kinds
        assert events[-2]["code"] == "engine_dead", events[-2]
        assert events[-1]["response"]["error"]["code"] == "engine_dead"
    finally:
        srv.stop()
