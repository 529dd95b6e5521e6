"""The gateway's errors and the one table that maps them to HTTP statuses and error bodies.

Everything below the HTTP layer raises :class:`GatewayError` with a *kind*; the table gives
each kind its status and its error type in each dialect's shape: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` and Anthropic's
``{"type": "error", "error": {"type", "message"}}``. Engine failures are mapped once, in
:func:`engine_error`; their messages never show the engine's address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from corral.engines.errors import EngineError, EngineNoWorker, EngineTimeout, EngineUnavailable

ErrorKind = Literal[
    "invalid_request",
    "authentication",
    "not_found",
    "method_not_allowed",
    "too_large",
    "unsupported_media_type",
    "rate_limit",
    "engine_error",
    "engine_unavailable",
    "engine_timeout",
    "worker_unavailable",
    "internal",
]


@dataclass(frozen=True, slots=True)
class _Row:
    status: int
    openai_type: str
    anthropic_type: str


ERROR_TABLE: dict[ErrorKind, _Row] = {
    "invalid_request": _Row(400, "invalid_request_error", "invalid_request_error"),
    "authentication": _Row(401, "authentication_error", "authentication_error"),
    "not_found": _Row(404, "not_found_error", "not_found_error"),
    "method_not_allowed": _Row(405, "invalid_request_error", "invalid_request_error"),
    "too_large": _Row(413, "invalid_request_error", "request_too_large"),
    "unsupported_media_type": _Row(415, "invalid_request_error", "invalid_request_error"),
    "rate_limit": _Row(429, "rate_limit_error", "rate_limit_error"),
    "engine_error": _Row(502, "engine_error", "api_error"),
    "engine_unavailable": _Row(503, "engine_unavailable", "overloaded_error"),
    "engine_timeout": _Row(504, "engine_timeout", "api_error"),
    # --workers: the worker holding the session is not running (being restarted).
    "worker_unavailable": _Row(503, "worker_unavailable", "overloaded_error"),
    "internal": _Row(500, "server_error", "api_error"),
}
_BY_STATUS = {row.status: kind for kind, row in ERROR_TABLE.items()}


class GatewayError(Exception):
    """An error the client gets: a kind from :data:`ERROR_TABLE`, a message, and optionally the
    request field it is about (``param``) and a machine-readable ``code``. ``detail`` goes to
    the gateway's log line for the request, never into the answer."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.param = param
        self.code = code
        # For the gateway's log only, never the client's answer (it may name the engine).
        self.detail = detail

    @property
    def status(self) -> int:
        return ERROR_TABLE[self.kind].status

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TABLE[self.kind].openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        return {
            "type": "error",
            "error": {"type": ERROR_TABLE[self.kind].anthropic_type, "message": self.message},
        }

    @classmethod
    def for_status(cls, status: int, message: str) -> GatewayError:
        """The error for an HTTP status Starlette raised itself (unknown route, method)."""
        return cls(_BY_STATUS.get(status, "internal"), message)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError("invalid_request", message, param=param, code=code)


def engine_error(exc: EngineError) -> GatewayError:
    """The answer to an engine failure: 503 down, 504 slow, 502 garbage.

    The engine client's messages name the engine's URL; clients hold only a session key and
    are not told where the engine lives: the full message is the error's ``detail``, for the
    gateway's log line.
    """
    detail = str(exc)
    if isinstance(exc, EngineNoWorker):
        return GatewayError(
            "engine_unavailable",
            "the engine is unavailable: its router has no healthy worker",
            detail=detail,
        )
    if isinstance(exc, EngineUnavailable):
        return GatewayError("engine_unavailable", "the engine is unavailable", detail=detail)
    if isinstance(exc, EngineTimeout):
        return GatewayError("engine_timeout", "the engine did not answer in time", detail=detail)
    status = getattr(exc, "status_code", None)
    said = getattr(exc, "engine_message", None)
    if status == 400 and isinstance(said, str):
        # The engine refused what was asked (e.g. a grammar it cannot compile): the client's.
        return GatewayError(
            "invalid_request", f"the engine refused the request: {said}", detail=detail
        )
    if isinstance(said, str) and said:
        return GatewayError("engine_error", f"the engine failed: {said}", detail=detail)
    return GatewayError("engine_error", "the engine failed to answer this request", detail=detail)
