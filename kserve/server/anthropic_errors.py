"""Anthropic's error shape and API-key check for `/v1/messages*` routes (and middleware that answers first)."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kserve.server.errors import APIError, engine_error, from_validation_errors

logger = logging.getLogger("kserve.server")

MESSAGES_PATH_PREFIX = "/v1/messages"

_ERROR_TYPE_BY_STATUS: Mapping[int, str] = MappingProxyType({
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
})


def error_body(exc: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPE_BY_STATUS.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


def error_response_for_path(path: str, exc: APIError) -> JSONResponse:
    """The error in the shape the endpoint at `path` speaks (for middleware that answers before routing)."""
    return error_response(exc) if path.startswith(MESSAGES_PATH_PREFIX) else exc.response()


def invalid(message: str) -> APIError:
    return APIError(400, message, code="invalid_request_error")


class AnthropicErrorRoute(APIRoute):
    """A route whose every error (body validation, auth, readiness, handler) is in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as exc:
                return error_response(exc)
            except (RequestValidationError, ValidationError) as exc:
                return error_response(from_validation_errors(list(exc.errors())))
            except StarletteHTTPException as exc:
                return error_response(APIError(exc.status_code, str(exc.detail)))
            except Exception as exc:
                known = engine_error(exc)
                if known is not None:
                    logger.error("%s %s: %s", request.method, request.url.path, known.message)
                    return error_response(known)
                logger.exception("internal error handling %s %s", request.method, request.url.path)
                return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))

        return route


def api_key_ok(request: Request, key: str) -> bool:
    """Anthropic clients send `x-api-key`; a bearer token is accepted as well."""
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip()
    return hmac.compare_digest(given.encode(), key.encode())


def check_api_key(request: Request, key: str | None) -> None:
    if key and not api_key_ok(request, key):
        raise APIError(401, "missing or invalid API key; send 'x-api-key: <key>' (or 'Authorization: Bearer <key>')",
                       code="invalid_api_key")
