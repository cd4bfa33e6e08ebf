"""A real uvicorn over the embedded tiny K2 engine, shared by the tests that talk to the server through an SDK."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import httpx
import openai
import pytest

from kserve.config import EngineConfig
from kserve.server.chat_turn import FinishedTurn, TurnDelta, TurnEvent
from kserve.server.context import ServerSettings
from kserve.server.launch import BackgroundServer


@contextmanager
def running_server(engine: EngineConfig | None = None, **settings: Any) -> Iterator[BackgroundServer]:
    """A started server on a free local port, stopped on exit; `settings` are further ServerSettings fields."""
    engine = engine or EngineConfig(max_num_batched_tokens=4096)
    server = BackgroundServer(ServerSettings(port=0, engine=engine, **settings)).start()
    try:
        yield server
    finally:
        server.stop()


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
