"""Errors an engine client raises; each says what failed and where (gateway 502/503/504)."""

from __future__ import annotations


class EngineError(Exception):
    """Base class: the engine could not serve a request."""


class EngineUnavailable(EngineError):
    """The engine could not be reached (connection refused, reset, DNS), or was lost before
    it answered (its connection broke, or its health check marked it down meanwhile)."""


class EngineTimeout(EngineError):
    """The engine did not answer within the client's timeout."""


class EngineProtocolError(EngineError):
    """The engine answered, but not with SGLang's API (bad status, bad JSON, wrong shape)."""


class EngineStatusError(EngineProtocolError):
    """The engine answered with an error: a non-2xx status, or an error object mid-stream.

    ``status_code`` is the HTTP status (200 for an error object inside a 200 stream);
    ``engine_message`` is the engine's own message (SGLang's ``error.message``, FastAPI's
    ``detail``, or the body's text), so a gateway can pass a 400 on as a 400.
    """

    def __init__(self, message: str, *, status_code: int, engine_message: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.engine_message = engine_message


class EngineNoWorker(EngineUnavailable):
    """The engine URL is a router (sglang-router, smg) that has no healthy worker to send the
    request to: every worker is down, unhealthy or behind an open circuit breaker."""


def another_engine_may_retry(exc: EngineError) -> bool:
    """Whether a request that failed with ``exc`` before any of its output reached the caller
    may be sent to another engine: the engine could not be reached or was lost
    (``EngineUnavailable``), did not answer in time (``EngineTimeout``), or answered a 5xx
    (``EngineStatusError`` with a status >= 500). Not for a 4xx (the request itself was
    refused: another engine would refuse it too), an error object inside a started stream,
    nor an answer that is not the engine's API (a bug to see, not to hide)."""
    if isinstance(exc, EngineUnavailable | EngineTimeout):
        return True
    return isinstance(exc, EngineStatusError) and exc.status_code >= 500
