"""What a request handler needs: the loaded engine, tokenizer, template and server settings."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from kserve.config import EngineConfig
from kserve.engine.errors import PromptRejected
from kserve.server.errors import APIError, bad_request
from kserve.server.metrics import ServerMetrics
from kserve.server.request_log import bind_request_id

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024


@dataclass
class ServerSettings:
    """Server-level knobs (the engine's are in `engine`)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    chat_template: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_concurrent_requests: int | None = None  # beyond this many in flight, answer 429
    guided_decoding: bool = True
    tool_grammar: bool = True
    skip_self_check: bool = False
    enable_reasoning: bool = False
    legacy_prompt_encoding: bool = False
    force_include_usage: bool = False  # every stream ends with usage, as if stream_options asked for it
    log_level: str = "info"
    exit_on_engine_death: bool = True  # `kserve serve` exits non-zero once the engine is dead
    responses_store_size: int = 1000  # finished /v1/responses kept for previous_response_id and GET; 0 = off
    drain_timeout_s: float = 30.0  # on SIGTERM, requests in flight may finish for this long before being cut
    # An idle connection stays open this long: longer than clients keep idle pooled connections (httpx, and so
    # the openai and anthropic SDKs: 5 s), or a request sent as the server closes one fails with a disconnect.
    keep_alive_timeout_s: float = 75.0
    # Hosts whose http(s) image URLs may be fetched (exact host match, case-insensitive); None or empty: none.
    allowed_media_domains: list[str] | None = None
    max_images_per_request: int = 32  # images in one request, the whole conversation counted
    media_fetch_timeout_s: float = 10.0  # per remote image: connect, redirects and body together
    media_fetch_max_bytes: int = 20 * 1024 * 1024  # per remote image


@dataclass
class ServingContext:
    """The loaded model and everything derived from it; built once the engine is up."""

    engine: Any  # kserve.engine.async_engine.AsyncLLMEngine
    tokenizer: Any  # kserve.chat.tokenizer.KimiTokenizer
    template: Any  # kserve.chat.template.ChatTemplate
    model_name: str
    max_model_len: int
    vocab_size: int
    settings: ServerSettings
    metrics: ServerMetrics
    grammar: Any = None  # kserve.chat.grammar.GrammarCompiler; None under --guided-decoding off
    in_flight: int = 0

    @contextlib.contextmanager
    def admitted(self) -> Iterator[Admission]:
        """Count a request in flight for the `with` block (or, via `hand_off`, for a stream's lifetime).

        Past `--max-concurrent-requests` in flight the request is refused with 429.
        """
        limit = self.settings.max_concurrent_requests
        if limit is not None and self.in_flight >= limit:
            raise APIError(429, f"server is at its limit of {limit} concurrent requests; retry shortly",
                           code="too_many_requests")
        self.in_flight += 1
        admission = Admission(self)
        try:
            yield admission
        finally:
            if not admission.handed_off:
                admission.release()

    def check_model(self, requested: str) -> None:
        if requested != self.model_name:
            raise APIError(404, f"model {requested!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def engine_failure(self) -> str | None:
        """Why the engine can serve no more (its step loop died), or None while it is healthy."""
        healthy = getattr(self.engine, "healthy", None)  # engine stand-ins in tests may lack it
        if healthy is None or healthy():
            return None
        error = getattr(self.engine, "fatal_error", None)
        return f"{type(error).__name__}: {error}" if error is not None else "the engine's step loop has stopped"

    def validate_prompt(self, prompt_ids: list[int], params: Any, param: str, images: list | None = None) -> None:
        """A 400 naming `param` now, before any streaming starts, for a prompt the engine would refuse."""
        validate = getattr(self.engine, "validate_prompt", None)  # engine stand-ins in tests may lack it
        if validate is None:
            return
        validate_images = getattr(self.llm_engine, "validate_images", None)
        try:
            validate(prompt_ids, params)
            if validate_images is not None:  # every image has its run of placeholders (none without images)
                validate_images(prompt_ids, images)
        except PromptRejected as exc:
            raise engine_refused(exc, param) from None

    @property
    def llm_engine(self) -> Any:
        """The synchronous engine (kserve.engine.llm_engine.LLMEngine) behind the async one, for its fixed
        properties (image support, the media placeholder id, image preprocessing rules)."""
        return getattr(self.engine, "engine", self.engine)

    async def abort(self, request_id: str) -> None:
        """Abort an unfinished engine request; shielded, since it usually runs inside a cancelled stream."""
        self.metrics.count_abort()
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await self.engine.abort(request_id)


def engine_refused(exc: PromptRejected, param: str | None = None) -> APIError:
    return bad_request(f"the engine refused the request: {exc}", param, "prompt_rejected")


def new_request_id(prefix: str) -> str:
    """A fresh response id, bound for logging: every later log line of this request carries it."""
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    bind_request_id(request_id)
    return request_id


class DisconnectWatch:
    """Polls whether the HTTP client has gone, at most every `interval` seconds (non-streaming requests)."""

    def __init__(self, request: Any, interval: float = 0.25) -> None:
        self.request = request
        self.interval = interval
        self._next = time.monotonic() + interval

    async def gone(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval
        try:
            return await asyncio.wait_for(self.request.is_disconnected(), timeout=0.05)
        except (asyncio.TimeoutError, RuntimeError):
            return False


class Admission:
    """One admitted request. A streamed response takes over the release (`hand_off`) and calls it when it ends."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.handed_off = False
        self.released = False

    def hand_off(self) -> Callable[[], None]:
        self.handed_off = True
        return self.release

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.ctx.in_flight -= 1
