"""The engine for the server: an `LLMEngine` stepping in a background thread, asyncio streams out.

Only the loop thread touches engine state; `generate` and `abort` post commands to it, and each step's deltas
reach their readers without the event loop waiting on the model. Once the loop gives up, `generate()` raises
EngineDeadError. Details: docs/engine.md, 'The async engine'.
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
from kserve.engine.errors import EngineDeadError
from kserve.engine.llm_engine import EngineStats, LLMEngine
from kserve.engine.outputs import OutputAccumulator, RequestDelta, RequestOutput
from kserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Loop iterations failing in a row (outside the model step, which LLMEngine.step counts itself)
# before the loop gives up: the engine is then broken for everyone.
MAX_CONSECUTIVE_FAILURES = 3


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: _Stream
    images: list | None = None  # kserve.engine.multimodal.ImageInput


@dataclass
class _Abort:
    request_id: str


class _Stream:
    """Where the loop thread delivers one request's deltas (or its error) to its reader.

    Deltas that arrive while the reader is busy merge into one pending delta, so a slow client costs
    at most its output's size in memory and one wake-up per read, never a queue of snapshots.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: RequestDelta | None = None
        self._error: BaseException | None = None
        self._wake_scheduled = False
        self._ready = asyncio.Event()

    def put(self, item: RequestDelta | BaseException) -> None:
        """Called by the loop thread."""
        with self._lock:
            if isinstance(item, BaseException):
                self._error = item
            elif self._pending is None:
                self._pending = item
            else:
                self._pending.merge(item)
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the consumer's event loop is gone
            pass

    async def take(self) -> RequestDelta | BaseException:
        """The merged news since the last take (an error wins over it)."""
        await self._ready.wait()
        with self._lock:
            self._ready.clear()
            self._wake_scheduled = False
            item: RequestDelta | BaseException | None = self._error or self._pending
            self._pending = None
        assert item is not None
        return item


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
        self._fatal_error: BaseException | None = None  # set by the loop thread when it gives up
        self._stopping = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine.from_config(config))

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            self.engine.shutdown()
            return
        self._stopping = True
        self._commands.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None
        self.engine.shutdown()

    # ------------------------------------------------------------------ requests
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, images: list | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative snapshots of the request; the last has `finished=True`.

        The engine sends only what is new each step and merges what a slow reader has not taken
        yet, so a snapshot may cover several steps. A snapshot's `token_ids` and `logprobs` lists
        are this request's own and grow in place until it finishes; its `text` is fixed.

        Raises PromptRejected (a ValueError) for a prompt the engine cannot take, EngineDeadError
        once the step loop has stopped for good (see `healthy()`), and the request's own error if
        it fails. Leaving the iteration early (a client disconnect) aborts the request.
        """
        if self._thread is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been called")
        self._raise_if_dead()
        self.validate_prompt(prompt_token_ids, params)
        self.engine.validate_images(prompt_token_ids, images)
        stream = _Stream(asyncio.get_running_loop())
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, stream, images))
        self._raise_if_dead()  # the loop may have died since the first check: no one would read it
        outputs = OutputAccumulator(request_id, None, list(prompt_token_ids), params.n,
                                    params.logprobs is not None)
        finished = False
        try:
            while True:
                item = await stream.take()
                if isinstance(item, BaseException):
                    finished = True  # the engine holds nothing for this request any more
                    raise item
                finished = item.finished
                yield outputs.apply(item)
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

    @property
    def fatal_error(self) -> BaseException | None:
        """The error that stopped the step loop for good, or None while it runs (or before start)."""
        thread = self._thread
        if self._fatal_error is None and thread is not None and not self._stopping and not thread.is_alive():
            return EngineDeadError("the engine loop thread is not running")
        lost_rank = getattr(self.engine.tp_workers, "failure", None)  # seen at once, even mid-collective
        if self._fatal_error is None and lost_rank is not None:
            return _dead_error(lost_rank)
        return self._fatal_error

    def healthy(self) -> bool:
        """False once the step loop has stopped for good; a server's /health should then fail."""
        return self.fatal_error is None

    def _raise_if_dead(self) -> None:
        error = self.fatal_error
        if error is not None:
            raise _dead_error(error)

    # ------------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        failures = 0
        try:
            while True:
                try:
                    if not self._iterate():
                        return
                    failures = 0
                except EngineDeadError:
                    raise  # the model steps keep failing, or failed fatally: no retry can help
                except Exception as exc:
                    failures += 1
                    logger.exception("engine loop iteration failed; failing the requests it held")
                    self._fail_held(exc)
                    if failures >= MAX_CONSECUTIVE_FAILURES:
                        raise EngineDeadError(
                            f"the engine loop failed {failures} times in a row; last error: {exc!r}"
                        ) from exc
        except BaseException as exc:  # noqa: BLE001 -- the loop cannot go on: say so, never hang
            self._die(exc)

    def _iterate(self) -> bool:
        """Take the pending commands, run one step, deliver its snapshots; False on shutdown."""
        engine = self.engine
        block = not engine.has_unfinished()
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            command = False  # no command; keep stepping
        while command is not False:
            if command is None:
                self._abort_all()
                return False
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = False
        if engine.has_unfinished():
            for request in engine.step():
                self._deliver(request)
        self._stats = engine.stats()
        return True

    def _fail_held(self, exc: Exception) -> None:
        """Fail every request the engine or a stream still holds with `exc` (raises if it cannot)."""
        self.engine.fail_requests(set(self.engine.requests), exc)  # if this raises, _die tells them
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(exc)

    def _die(self, exc: BaseException) -> None:
        self._fatal_error = exc  # first: a generate() that posts after this sees it and raises
        logger.critical("the engine loop stopped for good", exc_info=exc)
        error = _dead_error(exc)
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.stream.put(error)

    def _handle(self, command: _Add | _Abort) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            try:
                engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                   images=command.images)
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
            stream.put(request.take_delta())
        if request.finished:
            del self._streams[request.request_id]

    def _abort_all(self) -> None:
        for request_id in list(self.engine.requests):
            request = self.engine.abort_request(request_id)
            if request is not None:
                self._deliver(request)


def _dead_error(cause: BaseException) -> EngineDeadError:
    if isinstance(cause, EngineDeadError):
        return cause
    error = EngineDeadError(f"the engine stopped after an unrecoverable error: {cause!r}")
    error.__cause__ = cause
    return error
