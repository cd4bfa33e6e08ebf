"""The engine for the server: an `LLMEngine` stepping in a background thread, asyncio streams out.

All engine state is touched only by the loop thread. `generate` and `abort` post commands to it
through a queue; after each step the thread hands each changed request's snapshot to the request's
asyncio queue with `call_soon_threadsafe`, so the event loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kserve.config import EngineConfig, ModelConfig
from kserve.engine.llm_engine import EngineStats, LLMEngine
from kserve.engine.outputs import RequestOutput
from kserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: _Stream


@dataclass
class _Abort:
    request_id: str


class _Stream:
    """Where the loop thread delivers one request's snapshots (or its error)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is gone
            pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_config: ModelConfig = engine.model_config
        self.model_dir: Path | None = engine.model_dir
        self.max_model_len: int = engine.max_model_len
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # owned by the loop thread
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine.from_config(config))

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="kserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            self.engine.shutdown()
            return
        self._commands.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None
        self.engine.shutdown()

    # ------------------------------------------------------------------ requests
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative snapshots of the request; the last has `finished=True`.

        Raises PromptRejected (a ValueError) for a prompt the engine cannot take. Leaving the
        iteration early (a client disconnect) aborts the request.
        """
        if self._thread is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been called")
        self.validate_prompt(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop())
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine holds nothing for this request any more
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raise PromptRejected if the engine would refuse this request; safe on the event loop."""
        self.engine.validate_prompt(prompt_token_ids, params)

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    # ------------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished()
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                command = False  # no command; keep stepping
            while command is not False:
                if command is None:
                    self._abort_all()
                    return
                self._handle(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = False
            if engine.has_unfinished():
                try:
                    changed = engine.step()
                except Exception as exc:  # the engine itself broke; fail what it held, keep serving
                    logger.exception("engine step failed")
                    changed = engine.fail_requests(set(engine.requests), exc)
                for request in changed:
                    self._deliver(request)
            self._stats = engine.stats()

    def _handle(self, command: _Add | _Abort) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            try:
                engine.add_request(command.request_id, command.prompt_token_ids, command.params)
            except Exception as exc:  # noqa: BLE001 -- reported to the request's stream
                command.stream.put(exc)
                return
            self._streams[command.request_id] = command.stream
        else:
            request = engine.abort_request(command.request_id)
            if request is not None:
                self._deliver(request)

    def _deliver(self, request: Any) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        if request.error is not None:
            stream.put(request.error)
        else:
            stream.put(request.output())
        if request.finished:
            del self._streams[request.request_id]

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            request = self.engine.abort_request(request_id)
            if request is not None:
                self._deliver(request)
