"""Errors the engine raises to its callers (the server maps them to HTTP statuses)."""

from __future__ import annotations


class PromptRejected(ValueError):
    """The engine refuses this request as given (prompt too long, token ids outside the vocabulary,
    an unsupported parameter): a client error, raised before any token is generated."""


class EngineDeadError(RuntimeError):
    """The engine's step loop has stopped for good; no request can be served any more."""


class RequestFailedError(RuntimeError):
    """The model step failed whenever it ran this request and worked without it: the request fails,
    the engine goes on."""


class FatalEngineError(RuntimeError):
    """An error after which the engine cannot run another step (a sticky device error, a lost worker)."""


# Device errors that poison the CUDA context: every later kernel launch fails too, so retrying is futile.
_STICKY_DEVICE_ERRORS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction",
    "uncorrectable ECC error",
)


def is_fatal(exc: BaseException) -> bool:
    """Whether `exc`, raised by a model step, means the engine is dead (no retry can succeed)."""
    if isinstance(exc, FatalEngineError):
        return True
    text = str(exc)
    return any(marker in text for marker in _STICKY_DEVICE_ERRORS)
