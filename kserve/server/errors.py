"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` and the handlers that emit them."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kserve.server")

_TYPE_BY_STATUS = {
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
}


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


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if item in ("body",) and not parts:
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif parts:
            parts.append(f".{item}")
        else:
            parts.append(str(item))
    return "".join(parts)


def _describe(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic's error list into one 400 that names the first offending field."""
    first = errors[0] if errors else {}
    loc = tuple(x for x in first.get("loc", ()) if not (isinstance(x, str) and ("[" in x or x in _UNION_TAGS)))
    param = _loc_to_param(loc) or None
    msg = first.get("msg", "invalid value")
    if "input" in first and first.get("type") != "missing":
        msg = f"{msg} (got {_describe(first['input'])})"
    message = f"invalid request: '{param}': {msg}" if param else f"invalid request: {msg}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_type"
    if first.get("type", "").endswith(("greater_than_equal", "less_than_equal", "greater_than", "less_than")):
        code = "invalid_value"
    return APIError(400, message, param=param, code=code)


# pydantic tags union branches in the location with the branch's type name; they mean nothing to a client.
_UNION_TAGS = {"str", "list", "int", "float", "bool", "dict", "function-after", "function-before",
               "list[str]", "list[int]", "list[list[int]]", "list[ContentPart]", "NamedToolChoice",
               "ChatToolChoiceFunction", "ResponseFormat"}


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
        logger.exception("internal error handling %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").response()
