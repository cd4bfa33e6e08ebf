"""Errors the engine raises to its callers (the server maps them to HTTP statuses)."""

from __future__ import annotations


class PromptRejected(ValueError):
    """The engine refuses this request as given (prompt too long, token ids outside the vocabulary,
    an unsupported parameter): a client error, raised before any token is generated."""


class EngineDeadError(RuntimeError):
    """The engine's step loop has stopped for good; no request can be served any more."""
