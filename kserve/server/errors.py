"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` and the handlers that emit them."""

from __future__ import annotations

import json
import logging
import re
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kserve.server")

_TYPE_BY_STATUS = MappingProxyType({
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
})


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_error(exc: BaseException) -> APIError | None:
    """The client-facing error for an engine failure: 503 `engine_dead` once the engine is dead (the
    server will not recover; /health says so), 500 `request_failed` for a request the model step kept failing
    on (the engine goes on without it); None for anything else."""
    from kserve.engine.errors import EngineDeadError, RequestFailedError

    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine has stopped and cannot serve: {exc}", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="request_failed")
    return None


def stream_failure(exc: BaseException) -> APIError:
    """What a stream whose status line is already sent reports in-band for `exc`."""
    if isinstance(exc, APIError):
        return exc
    known = engine_error(exc)
    if known is not None:
        return known
    return APIError(500, f"internal error while streaming: {type(exc).__name__}", code="internal_error")


def logged_stream_failure(exc: Exception, request_id: str) -> APIError:
    """`stream_failure(exc)`, logged: with the traceback when it is an internal error, as one line otherwise."""
    error = stream_failure(exc)
    if error.code == "internal_error":
        logger.exception("request %s: error while streaming", request_id)
    else:
        logger.error("request %s: %s", request_id, error.message)
    return error


# pydantic puts union branch tags in error locations ("str", "list[ContentPart]", "NamedToolChoice",
# "function-after[...]"); field names here are lower_snake_case, so anything else is a tag.
_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item == "body" and not parts:
            continue
        elif isinstance(item, str) and _FIELD_NAME.match(item) and item not in _TYPE_TAGS:
            parts.append(f".{item}" if parts else item)
    return "".join(parts)


def _describe(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """One 400 naming the first offending field; a union's per-branch errors are merged into one message."""
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first.get("loc", ())[-1] if first.get("loc") else None
        reason = (first.get("ctx") or {}).get("error", "malformed JSON")
        at = f" at character {where}" if isinstance(where, int) else ""
        return APIError(400, f"request body is not valid JSON: {reason}{at}", code="invalid_json")
    param = _loc_to_param(tuple(first.get("loc", ()))) or None
    same = [e for e in errors if (_loc_to_param(tuple(e.get("loc", ()))) or None) == param]
    others = len(errors) - len(same)
    msgs: list[str] = []
    for e in same:
        msg = e.get("msg", "invalid value")
        msg = msg[len("Input should be "):] if msgs and msg.startswith("Input should be ") else msg
        if msg not in msgs:
            msgs.append(msg)
    msg = " or ".join(msgs)
    if "input" in first and first.get("type") != "missing":
        msg = f"{msg} (got {_describe(first['input'])})"
    if param is None and first.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        message = f"request body must be a JSON object (got {_describe(first.get('input'))})"
    else:
        message = f"invalid request: '{param}': {msg}" if param else f"invalid request: {msg}"
    if others:
        message += f" (and {others} more problem{'s' if others > 1 else ''})"
    kind = first.get("type", "")
    code = "missing_required_parameter" if kind == "missing" else "invalid_type"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than", "literal_error"):
        code = "invalid_value"
    return APIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = "no such endpoint; see /docs for the available routes"
        elif exc.status_code == 405:
            message = f"method not allowed: {message}"
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        known = engine_error(exc)
        if known is not None:
            logger.error("%s %s: %s", request.method, request.url.path, known.message)
            return known.response()
        logger.exception("internal error handling %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").response()
