"""Gateway settings: everything flows in as arguments, nothing is read at import time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# How a turn's prompt is built (corral.gateway.history); here, light, for the CLI's choices.
HistoryMode = Literal["tokens", "template"]
HISTORY_MODES: tuple[HistoryMode, ...] = ("tokens", "template")

# When the session journal (corral.gateway.journal) makes its writes durable: ``always`` before
# each turn's answer goes out (survives a machine crash), ``interval`` within
# ``JOURNAL_SYNC_INTERVAL_S`` (a process crash loses nothing; a machine crash at most that
# much), ``never`` when the OS decides (a process crash still loses nothing).
JournalSync = Literal["always", "interval", "never"]
JOURNAL_SYNCS: tuple[JournalSync, ...] = ("always", "interval", "never")
JOURNAL_SYNC_INTERVAL_S = 1.0

# The template variables clients may set unless the operator says otherwise.
DEFAULT_CLIENT_TEMPLATE_KWARGS = frozenset({"enable_thinking"})


@dataclass(frozen=True)
class GatewaySettings:
    model_name: str
    # The engine's context window; a session may lower it, never raise it.
    max_context_tokens: int
    tool_call_parser: str = "qwen25"
    reasoning_parser: str = "none"
    # The operator's template variables, for every render.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The template variables a client may set per request (``chat_template_kwargs``); the
    # template itself is never the client's.
    client_template_kwargs: frozenset[str] = DEFAULT_CLIENT_TEMPLATE_KWARGS
    # How a turn's prompt is built unless its session says (corral.gateway.history): the held
    # tokens plus the new messages, so an episode is one sample whatever the template does to
    # history; ``template`` renders the whole conversation each turn.
    history: HistoryMode = "tokens"
    admin_token: str | None = None
    max_sessions: int = 10_000
    max_held_tokens: int = 200_000_000
    session_ttl_s: float = 3600.0
    max_body_bytes: int = 8 * 1024 * 1024
    # Seconds an engine request may take before the turn fails (a streamed turn: between
    # outputs).
    engine_timeout_s: float = 600.0
    # JSON bodies nested deeper than this are refused before they are parsed into models.
    max_json_depth: int = 64
    # The session journal's folder (None: no journal; a restart loses every session).
    journal_dir: Path | None = None
    journal_sync: JournalSync = "interval"
    # Starts every session id and api key this gateway makes: a worker's mark, so requests
    # for its sessions can be told apart from other workers' (corral.gateway.workers).
    session_id_prefix: str = ""

    def __post_init__(self) -> None:
        if "chat_template" in self.client_template_kwargs:
            raise ValueError("clients can never replace the chat template (chat_template)")
