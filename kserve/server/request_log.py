"""Every log line written while handling a request carries that request's id.

The id lives in a context variable: set to the client's `X-Request-Id` (or a fresh one) when the HTTP
request arrives, then to the response id (`chatcmpl-...`, `cmpl-...`) as soon as the handler makes it,
so the logs and the response body name the same id. Tasks spawned for a streamed response copy the
context, so their lines carry it too; lines from outside any request (the engine's thread, startup)
show "-".
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

REQUEST_ID: ContextVar[str] = ContextVar("kserve_request_id", default="-")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
HEADER = b"x-request-id"
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")  # what a client may choose; anything else is replaced


def bind_request_id(request_id: str) -> None:
    """This request's id from here on (in this task and the tasks it starts)."""
    REQUEST_ID.set(request_id)


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id` (the current request's id, or "-") for LOG_FORMAT."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


def install_request_id_logging(level: str) -> None:
    """Root logging with LOG_FORMAT on every handler (each handler gets the filter, so records from any
    logger, uvicorn's included, carry the field)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    root = logging.getLogger()
    for handler in root.handlers:
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger("kserve").setLevel(level.upper())


class RequestIdMiddleware:
    """Binds a request id for each HTTP request and returns the final one as `X-Request-Id`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(HEADER, b"").decode("latin-1")
        bind_request_id(given if _CLIENT_ID.match(given) else f"req-{uuid.uuid4().hex}")

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                headers.append((HEADER, REQUEST_ID.get().encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
