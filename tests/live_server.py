"""A real uvicorn over the embedded tiny K2.6 engine, shared by the tests that talk to the server through an SDK."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest

from kserve.config import EngineConfig
from kserve.engine.faults import STEP_FAULTS_KEY, StepFaults
from kserve.server.chat_turn import FinishedTurn, TurnDelta, TurnEvent
from kserve.server.context import ServerSettings
from kserve.server.launch import BackgroundServer


@contextmanager
def running_server(engine: EngineConfig | None = None, **settings: Any) -> Iterator[BackgroundServer]:
    """A started server on a free local port, stopped on exit; `settings` are further ServerSettings fields.
    Without `engine`, the engine has the defaults a user of `kserve serve` gets."""
    engine = engine or EngineConfig()
    server = BackgroundServer(ServerSettings(port=0, engine=engine, **settings)).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def server_with_step_faults(trigger: Path) -> Iterator[BackgroundServer]:
    """A started server whose every model step fails once `trigger` exists (the engine's step-fault test hook)."""
    with running_server(EngineConfig(extra={STEP_FAULTS_KEY: StepFaults(trigger_file=str(trigger))})) as server:
        yield server


def stream_until_engine_death(url: str, body: dict[str, Any], trigger: Path) -> list[str]:
    """The SSE data lines of a stream to `url`; `trigger` is touched once three have arrived."""
    events: list[str] = []
    with httpx.stream("POST", url, json=body, timeout=60) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 3:
                    trigger.touch()
    return events


def openai_client(server: BackgroundServer, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def check_disconnect_aborts(server: BackgroundServer, path: str, body: dict[str, Any], delta_event: str) -> None:
    """Stream `body` to `path`, hang up a few `delta_event` lines in, and check the engine drops the request."""
    engine = server.app.state.server.context.engine
    http = httpx.Client(timeout=60)
    with http, http.stream("POST", server.base_url + path, json=body) as resp:
        lines = resp.iter_lines()  # kept alive: dropping it would close the connection early
        deltas = 0
        while deltas < 4:  # a few tokens in: the request is decoding
            deltas += delta_event in next(lines)
        during = engine.stats()
        assert during.num_running == 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and engine.stats().num_running + engine.stats().num_waiting:
        time.sleep(0.05)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.generation_tokens_total < during.generation_tokens_total + 1000  # stopped well before the limit


def script_turns(monkeypatch: pytest.MonkeyPatch, endpoint_module: ModuleType, deltas: list[TurnDelta],
                 finished: FinishedTurn) -> None:
    """Replace the engine driver an endpoint module calls (`run_turn`, `stream_turn`) by one scripted turn."""
    async def stream(ctx: Any, prep: Any) -> AsyncIterator[TurnEvent]:
        for delta in deltas:
            yield delta
        yield finished

    async def run(ctx: Any, prep: Any, request: Any) -> FinishedTurn:
        return finished

    monkeypatch.setattr(endpoint_module, "stream_turn", stream)
    monkeypatch.setattr(endpoint_module, "run_turn", run)
