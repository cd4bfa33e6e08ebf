"""The FastAPI application: routes, auth, body-size limit, readiness, and model loading in the background."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import BaseRoute, Match

from kserve.server.anthropic_errors import (
    AnthropicErrorRoute,
    check_api_key,
    error_response_for_path,
)
from kserve.server.anthropic_messages import (
    count_tokens,
    prepare_messages,
    run_messages,
    stream_messages,
)
from kserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kserve.server.context import ServerSettings, ServingContext
from kserve.server.errors import APIError, bad_request, install_error_handlers
from kserve.server.metrics import ServerMetrics
from kserve.server.openai_responses import (
    delete_response,
    get_response,
    list_input_items,
    prepare_response,
    run_response,
    stream_response,
)
from kserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from kserve.server.request_log import RequestIdMiddleware, bind_request_id
from kserve.server.responses_protocol import ResponsesRequest
from kserve.server.responses_store import ResponseStore
from kserve.server.serving_chat import prepare_chat, run_chat, stream_chat
from kserve.server.serving_completion import (
    prepare_completion,
    run_completion,
    stream_completion,
)
from kserve.server.sse import openai_json
from kserve.server.tokenize_api import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)

logger = logging.getLogger("kserve.server")

EngineLoader = Callable[[ServerSettings, ServerMetrics], Awaitable[ServingContext]]
LoadFailureHandler = Callable[[str], None]
EngineDeathHandler = Callable[[str], None]
ENGINE_WATCH_INTERVAL_S = 0.2  # how often the server looks at the engine's health (a 503 is immediate)


class StartupError(RuntimeError):
    """Loading failed; `stage` names the step (engine, chat template, grammar compiler, self-check...)."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"startup failed at the {stage} stage: {type(cause).__name__}: {cause}")
        self.stage = stage

SSE_HEADERS = MappingProxyType({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class ClosingStreamingResponse(StreamingResponse):
    """SSE response that, however it ends (done, client gone, never started), closes its event generator
    (running the engine abort in the generator's cleanup now rather than at garbage collection) and then
    calls `on_close`."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = content
        self._on_close = on_close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
            self._on_close()


class ServerState:
    """Readiness and the serving context of one app instance."""

    def __init__(self, settings: ServerSettings, loader: EngineLoader,
                 on_load_failure: LoadFailureHandler | None = None,
                 on_engine_death: EngineDeathHandler | None = None) -> None:
        self.settings = settings
        self.metrics = ServerMetrics()
        self.loader = loader
        self.on_load_failure = on_load_failure
        self.on_engine_death = on_engine_death
        self.context: ServingContext | None = None
        self.load_error: str | None = None
        self.loaded_at: float | None = None

    def ready(self) -> ServingContext:
        """The serving context, or a 503 while loading, after a failed load, or once the engine has died."""
        if self.context is not None:
            failure = self.context.engine_failure()
            if failure is not None:
                raise APIError(503, f"the engine has stopped and cannot serve: {failure}", code="engine_dead")
            return self.context
        if self.load_error is not None:
            raise APIError(503, f"model failed to load: {self.load_error}", code="model_load_failed")
        raise APIError(503, "model is still loading; retry shortly", code="model_loading")

    async def load(self) -> None:
        started = time.monotonic()
        try:
            self.context = await self.loader(self.settings, self.metrics)
        except Exception as exc:
            bind_request_id("-")  # the startup self-check's request is over
            self.load_error = str(exc) if isinstance(exc, StartupError) else f"{type(exc).__name__}: {exc}"
            logger.exception("model failed to load: %s", self.load_error)
            if self.on_load_failure is not None:
                self.on_load_failure(self.load_error)  # `kserve serve` stops; otherwise /health reports it
            return
        bind_request_id("-")  # the startup self-check's request is over
        self.loaded_at = time.time()
        logger.info("model %r ready in %.1fs (max_model_len %d); OpenAI API at http://%s:%d/v1",
                    self.context.model_name, time.monotonic() - started, self.context.max_model_len,
                    self.settings.host, self.settings.port)
        await self.watch_engine()

    async def watch_engine(self) -> None:
        """Wait for the engine to die; then log it once and call `on_engine_death` (`kserve serve` exits
        non-zero under --exit-on-engine-death). /health and requests answer 503 from the moment it dies."""
        ctx = self.context
        assert ctx is not None
        while True:
            failure = ctx.engine_failure()
            if failure is not None:
                break
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        logger.critical("the engine is dead; /health and every request now answer 503: %s", failure)
        if self.on_engine_death is not None:
            self.on_engine_death(failure)

    async def shutdown(self) -> None:
        if self.context is not None:
            with contextlib.suppress(Exception):
                await self.context.engine.shutdown()
            # FastAPI's dependency cache keeps the route closures (and so this state) alive after the app stops;
            # dropping the context lets the model's weights go with the server.
            self.context = None


class BodyLimitMiddleware:
    """413 for bodies over the limit: checked from Content-Length, then while reading the body in.

    The body is read here, in full, before the app sees it (FastAPI buffers it anyway), so an oversized
    chunked upload is refused with 413 rather than surfacing as a body-parsing error.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_big = APIError(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                           code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await error_response_for_path(scope.get("path", ""), too_big)(scope, receive, send)
            return
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client gone before the body arrived
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await error_response_for_path(scope.get("path", ""), too_big)(scope, receive, send)
                return
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body: bytes | None = b"".join(parts)

        async def replay() -> dict:
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()

        await self.app(scope, replay, send)


class RequestCountMiddleware:
    """Counts responses by route template and status for /metrics (pure ASGI, so streaming is untouched).

    Labels are route templates ("/v1/responses/{response_id}"), never raw paths, so they stay a bounded set.
    """

    def __init__(self, app: Any, metrics: ServerMetrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def endpoint(self, scope: dict) -> str:
        route = scope.get("route")
        if route is None:  # answered before routing (a 413 from the body limit)
            route = next((r for r in self.routes if r.matches(scope)[0] == Match.FULL), None)
        return getattr(route, "path", None) or "unmatched"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(self.endpoint(scope), message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


class JsonBodyMiddleware:
    """POST bodies are JSON whatever their Content-Type says: `curl -d '{...}'` sends
    application/x-www-form-urlencoded, and OpenAI's and vLLM's servers read such a body as JSON too."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = scope.get("headers") or []
            content_type = dict(headers).get(b"content-type", b"").lower()
            if b"json" not in content_type:
                headers = [(k, v) for k, v in headers if k.lower() != b"content-type"]
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def build_app(settings: ServerSettings, loader: EngineLoader | None = None,
              on_load_failure: LoadFailureHandler | None = None,
              on_engine_death: EngineDeathHandler | None = None) -> FastAPI:
    """The app; `on_load_failure(message)` is called if loading fails (without it, the app answers 503),
    `on_engine_death(message)` once the engine dies (without it, the app keeps answering 503)."""
    state = ServerState(settings, loader or load_serving_context, on_load_failure, on_engine_death)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(state.load())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await state.shutdown()

    app = FastAPI(title="kserve", description="OpenAI-compatible API for Kimi K2", version="0.1.0",
                  lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(RequestCountMiddleware, metrics=state.metrics, routes=app.router.routes)
    app.add_middleware(RequestIdMiddleware)  # outermost: every line of a request, 413s included, has its id

    async def require_auth(request: Request) -> None:
        key = settings.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or invalid API key; send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def context() -> ServingContext:
        return state.ready()

    @app.get("/health", tags=["ops"])
    async def health() -> JSONResponse:
        ctx = state.ready()
        return JSONResponse({"status": "ok", "model": ctx.model_name})

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        ctx = state.context
        stats = None
        if ctx is not None:
            with contextlib.suppress(Exception):
                stats = ctx.engine.stats()
        name = ctx.model_name if ctx is not None else (settings.served_model_name or "")
        return PlainTextResponse(state.metrics.render(stats, name, ctx is not None),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(ctx: ServingContext) -> ModelCard:
        return ModelCard(id=ctx.model_name, max_model_len=ctx.max_model_len,
                         created=int(state.loaded_at or time.time()))

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(require_auth)])
    async def models(ctx: ServingContext = Depends(context)) -> ModelList:
        return ModelList(data=[model_card(ctx)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, dependencies=[Depends(require_auth)])
    async def retrieve_model(model_id: str, ctx: ServingContext = Depends(context)) -> ModelCard:
        ctx.check_model(model_id)  # 404 model_not_found, as OpenAI answers an unknown id
        return model_card(ctx)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              dependencies=[Depends(require_auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               ctx: ServingContext = Depends(context)) -> Any:
        # FastAPI validated `body` against the protocol model; the raw JSON keeps what the model ignores.
        with ctx.admitted() as admission:  # before any work (tokenizing, grammar compiling): 429 comes first
            prep = await prepare_chat(ctx, body, await request.json())
            if prep.req.stream:
                return ClosingStreamingResponse(stream_chat(ctx, prep), admission.hand_off())
            return JSONResponse(openai_json(await run_chat(ctx, prep, request)))

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=[Depends(require_auth)])
    async def completions(body: CompletionRequest, request: Request,
                          ctx: ServingContext = Depends(context)) -> Any:
        with ctx.admitted() as admission:
            prep = prepare_completion(ctx, body, await request.json())
            if prep.req.stream:
                return ClosingStreamingResponse(stream_completion(ctx, prep), admission.hand_off())
            return JSONResponse(openai_json(await run_completion(ctx, prep, request)))

    # Anthropic Messages: x-api-key (or bearer) auth, and every error in Anthropic's shape.
    async def require_anthropic_auth(request: Request) -> None:
        check_api_key(request, settings.api_key)

    anthropic = APIRouter(route_class=AnthropicErrorRoute, dependencies=[Depends(require_anthropic_auth)])

    @anthropic.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request, ctx: ServingContext = Depends(context)) -> Any:
        with ctx.admitted() as admission:
            prep = await prepare_messages(ctx, body, await request.json())
            if body.stream:
                return ClosingStreamingResponse(stream_messages(ctx, prep), admission.hand_off())
            return JSONResponse(await run_messages(ctx, prep, request))

    @anthropic.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest, request: Request,
                                    ctx: ServingContext = Depends(context)) -> Any:
        return JSONResponse(await count_tokens(ctx, body, await request.json()))

    app.include_router(anthropic)
    responses_store = ResponseStore(settings.responses_store_size)

    @app.post("/v1/responses", dependencies=[Depends(require_auth)])
    async def responses(body: ResponsesRequest, request: Request, ctx: ServingContext = Depends(context)) -> Any:
        with ctx.admitted() as admission:
            prep = await prepare_response(ctx, responses_store, body, await request.json())
            if body.stream:
                return ClosingStreamingResponse(stream_response(ctx, responses_store, prep), admission.hand_off())
            return JSONResponse(await run_response(ctx, responses_store, prep, request))

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(require_auth)])
    async def responses_get(response_id: str, stream: bool = False) -> Any:
        if stream:  # the SDK would wait for events that never come
            raise bad_request("streaming a stored response again is not supported; retrieve it without 'stream'",
                              "stream")
        return JSONResponse(get_response(responses_store, response_id))

    @app.get("/v1/responses/{response_id}/input_items", dependencies=[Depends(require_auth)])
    async def responses_input_items(response_id: str, limit: int = 20, order: str = "desc",
                                    after: str | None = None) -> Any:
        return JSONResponse(list_input_items(responses_store, response_id, limit=limit, order=order, after=after))

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(require_auth)])
    async def responses_delete(response_id: str) -> Any:
        return JSONResponse(delete_response(responses_store, response_id))

    @app.post("/tokenize", dependencies=[Depends(require_auth)])
    async def tokenize_route(body: TokenizeRequest, request: Request, ctx: ServingContext = Depends(context)) -> Any:
        return JSONResponse(await tokenize(ctx, body, await request.json()))

    @app.post("/detokenize", dependencies=[Depends(require_auth)])
    async def detokenize_route(body: DetokenizeRequest, ctx: ServingContext = Depends(context)) -> Any:
        return JSONResponse(detokenize(ctx, body))

    return app


async def load_serving_context(settings: ServerSettings, metrics: ServerMetrics) -> ServingContext:
    """Build the engine (in a worker thread: loading weights blocks) and the chat template."""
    from kserve.chat import ChatTemplate
    from kserve.chat.grammar import GrammarCompiler
    from kserve.engine.async_engine import AsyncLLMEngine
    from kserve.server.self_check import run_live_self_check, run_self_check

    try:
        engine = await asyncio.to_thread(AsyncLLMEngine.from_config, settings.engine)
    except Exception as exc:
        raise StartupError("engine load", exc) from exc
    stage = "engine start"
    try:
        await engine.start()
        stage = "chat template"
        template = await asyncio.to_thread(ChatTemplate.load, engine.model_dir, settings.chat_template,
                                           dialect=engine.model_config.chat_dialect)
        name = settings.served_model_name or Path(engine.model_dir).name
        grammar = None
        if settings.guided_decoding:
            stage = "grammar compiler"
            grammar = await asyncio.to_thread(GrammarCompiler, engine.tokenizer, engine.model_config.vocab_size)
        ctx = ServingContext(engine=engine, tokenizer=engine.tokenizer, template=template, model_name=name,
                             max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size,
                             settings=settings, metrics=metrics, grammar=grammar)
        if not settings.skip_self_check:
            stage = "self-check"
            run_self_check(ctx)
            stage = "live self-check"
            await run_live_self_check(ctx)
    except BaseException as exc:
        await engine.shutdown()  # not serving: stop the engine's step thread
        if isinstance(exc, Exception):
            raise StartupError(stage, exc) from exc
        raise
    return ctx
