"""Gateway settings: everything flows in as arguments, nothing is read at import time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GatewaySettings:
    model_name: str
    # The engine's context window; a session may lower it, never raise it.
    max_context_tokens: int
    tool_call_parser: str = "qwen25"
    reasoning_parser: str = "none"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    admin_token: str | None = None
    max_sessions: int = 10_000
    max_held_tokens: int = 200_000_000
    session_ttl_s: float = 3600.0
    max_body_bytes: int = 8 * 1024 * 1024
    engine_timeout_s: float = 600.0
