"""What ``corral gateway`` is started with, as one frozen object (:class:`GatewayLaunch`).

:class:`~corral.gateway.settings.GatewaySettings` is the gateway's resolved settings: its
model name and context window come from the model folder once it is loaded. A launch is what
comes before: the engine, the model folder and the choices ``corral gateway`` has flags for.
It starts the gateway in a thread (:meth:`GatewayLaunch.gateway_options`, the keywords of
:func:`~corral.gateway.server.create_gateway`) or as a child process
(:meth:`GatewayLaunch.to_argv`). Light on purpose: no transformers, no Starlette.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.engines.client import EngineApi
from corral.gateway.settings import (
    DEFAULT_CLIENT_TEMPLATE_KWARGS,
    GatewaySettings,
    HistoryMode,
    JournalSync,
)


@dataclass(frozen=True)
class GatewayLaunch:
    """A gateway in front of ``engine_url`` (one engine, or several comma-separated), which
    speaks ``engine_api``, rendering with ``model``'s tokenizer and template.

    ``admin_token_var`` names the variable a child reads its admin token from (the token itself
    never appears in an argv); a gateway in a thread is handed the token instead;
    ``engine_token_var`` likewise names the variable holding the engines' bearer token. The other
    fields are the :class:`~corral.gateway.settings.GatewaySettings` fields of the same meaning,
    with its defaults; ``served_model_name`` None: the model folder's name. Each field is one
    ``corral gateway`` flag (tests/test_service_settings.py parses :meth:`to_argv` with the
    real CLI)."""

    engine_url: str
    model: Path
    engine_api: EngineApi = "sglang"
    admin_token_var: str | None = None
    engine_token_var: str | None = None
    tool_call_parser: str = GatewaySettings.tool_call_parser
    reasoning_parser: str = GatewaySettings.reasoning_parser
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    client_template_kwargs: frozenset[str] = DEFAULT_CLIENT_TEMPLATE_KWARGS
    history: HistoryMode = GatewaySettings.history
    max_sessions: int = GatewaySettings.max_sessions
    max_held_tokens: int = GatewaySettings.max_held_tokens
    session_ttl_s: float = GatewaySettings.session_ttl_s
    engine_timeout_s: float = GatewaySettings.engine_timeout_s
    journal_dir: Path | None = None
    journal_sync: JournalSync = GatewaySettings.journal_sync
    workers: int = 1
    served_model_name: str | None = None

    def gateway_options(self) -> dict[str, Any]:
        """The keywords of :func:`~corral.gateway.server.create_gateway` (after the engine URL
        and the model) that these settings ask for; the admin and engine tokens are the
        caller's."""
        options: dict[str, Any] = {
            "engine_api": self.engine_api,
            "tool_call_parser": self.tool_call_parser,
            "reasoning_parser": self.reasoning_parser,
            "chat_template_kwargs": dict(self.chat_template_kwargs),
            "client_template_kwargs": frozenset(self.client_template_kwargs),
            "history": self.history,
            "max_sessions": self.max_sessions,
            "max_held_tokens": self.max_held_tokens,
            "session_ttl_s": self.session_ttl_s,
            "engine_timeout_s": self.engine_timeout_s,
            "journal_dir": self.journal_dir,
            "journal_sync": self.journal_sync,
        }
        if self.served_model_name is not None:
            options["model_name"] = self.served_model_name
        return options

    def to_argv(self) -> list[str]:
        """``corral`` arguments that serve these settings: the subcommand and its flags, all
        but ``--host``/``--port`` (the launcher adds them)."""
        argv = ["gateway", "--engine-url", self.engine_url, "--engine-api", self.engine_api]
        argv += ["--model", str(self.model)]
        if self.admin_token_var is not None:
            argv += ["--admin-token-var", self.admin_token_var]
        if self.engine_token_var is not None:
            argv += ["--engine-token-var", self.engine_token_var]
        argv += [
            *("--tool-call-parser", self.tool_call_parser),
            *("--reasoning-parser", self.reasoning_parser),
            *("--chat-template-kwargs", json.dumps(self.chat_template_kwargs)),
            *("--chat-template-kwargs-allow", ",".join(sorted(self.client_template_kwargs))),
            *("--history", self.history),
            *("--max-sessions", str(self.max_sessions)),
            *("--max-held-tokens", str(self.max_held_tokens)),
            *("--session-ttl", str(self.session_ttl_s)),
            *("--engine-timeout", str(self.engine_timeout_s)),
            *("--journal-sync", self.journal_sync),
            *("--workers", str(self.workers)),
        ]
        if self.journal_dir is not None:
            argv += ["--journal", str(self.journal_dir)]
        if self.served_model_name is not None:
            argv += ["--served-model-name", self.served_model_name]
        return argv
