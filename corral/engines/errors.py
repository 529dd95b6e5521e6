"""Errors an engine client raises; each says what failed and where (gateway 502/503/504)."""

from __future__ import annotations


class EngineError(Exception):
    """Base class: the engine could not serve a request."""


class EngineUnavailable(EngineError):
    """The engine could not be reached (connection refused, reset, DNS)."""


class EngineTimeout(EngineError):
    """The engine did not answer within the client's timeout."""


class EngineProtocolError(EngineError):
    """The engine answered, but not with SGLang's API (bad status, bad JSON, wrong shape)."""


class EngineNoWorker(EngineUnavailable):
    """The engine URL is a router (sglang-router, smg) that has no healthy worker to send the
    request to: every worker is down, unhealthy or behind an open circuit breaker."""
