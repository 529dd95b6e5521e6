"""Harnesses: how to run one black-box agent (Claude Code, Codex CLI, any command) headless
in an episode's sandbox, pointed at its own gateway session.

:data:`HARNESSES` maps each name to its class; :func:`harness` makes one with its settings.
A harness only builds an :class:`~corral.envs.protocol.AgentLaunch`; the env server runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from corral.harnesses.base import (
    AgentTask,
    Harness,
    HarnessError,
    SessionAccess,
    TranscriptSummary,
)
from corral.harnesses.claude_code import ClaudeCode
from corral.harnesses.codex import Codex
from corral.harnesses.command import Command

__all__ = [
    "HARNESSES",
    "AgentTask",
    "ClaudeCode",
    "Codex",
    "Command",
    "Harness",
    "HarnessError",
    "SessionAccess",
    "TranscriptSummary",
    "harness",
    "settings_of",
]

HARNESSES: dict[str, type[Harness]] = {cls.name: cls for cls in (ClaudeCode, Codex, Command)}


def settings_of(cls: type[Harness]) -> list[str]:
    """The names of ``cls``'s settings (its dataclass fields a caller may set)."""
    if not dataclasses.is_dataclass(cls):
        return []
    return [f.name for f in dataclasses.fields(cls) if f.init]


def harness(name: str, **options: Any) -> Harness:
    """The harness ``name`` with ``options`` as its settings. Raises :class:`HarnessError`
    for an unknown name (the message lists the known ones), an unknown or missing setting (it
    lists the harness's settings) or a bad value."""
    cls = HARNESSES.get(name)
    if cls is None:
        raise HarnessError(f"no harness {name!r}; the harnesses are {', '.join(sorted(HARNESSES))}")
    known = settings_of(cls)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise HarnessError(
            f"{name}: unknown setting(s) {', '.join(unknown)}; "
            f"its settings are {', '.join(known) or '(none)'}"
        )
    try:
        return cls(**options)
    except TypeError as exc:  # a required setting left out
        raise HarnessError(f"{name}: {exc}; its settings are {', '.join(known)}") from exc
