"""What a harness is.

A :class:`Harness` turns one task and one gateway session into an
:class:`~corral.envs.protocol.AgentLaunch`: the argv, environment and files that run the
agent headless, unattended and off every network but its session's. It runs nothing itself:
the env server runs the launch in the episode's sandbox (:mod:`corral.envs.agent_bridge`).

A harness is a frozen dataclass: its fields are its settings, checked when it is made
(:class:`HarnessError` on a bad one), so that a launch never fails for a setting. A launch
holds no host path and no host secret: only the session's key, the gateway reached through
:data:`~corral.envs.protocol.GATEWAY_PLACEHOLDER`, and paths inside the agent's sandbox
(:data:`~corral.envs.protocol.AGENT_HOME` and its siblings).
"""

from __future__ import annotations

import abc
import base64
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from corral.envs.protocol import GATEWAY_PLACEHOLDER, AgentFile, AgentFileArea, AgentLaunch


class HarnessError(ValueError):
    """A harness cannot be made or cannot build its launch as asked: an unknown harness or
    setting, a bad setting's value, agent files that break the bounds. The message says what
    and how to fix it; nothing was started."""


@dataclass(frozen=True)
class AgentTask:
    """What the agent is asked: the task's prompt, the bundle's ``[agent] instructions``
    (empty when it has none) and the task's id."""

    prompt: str
    instructions: str
    task_id: str


@dataclass(frozen=True)
class SessionAccess:
    """The agent's gateway session. ``gateway``: the gateway's origin as the env server
    reaches it; ``session_path``: ``/sessions/<id>`` (OpenAI at ``+/v1``, Anthropic at the
    path itself); ``api_key``: the session's key; ``model``: the model name to ask for."""

    gateway: str
    session_path: str
    api_key: str
    model: str

    def __post_init__(self) -> None:
        # The path is glued to the placeholder origin: it must be an absolute path without a
        # trailing "/", else the agent's base URL points somewhere else.
        if not self.session_path.startswith("/") or self.session_path.endswith("/"):
            raise HarnessError(
                f"session_path {self.session_path!r} must start with '/' and not end with '/' "
                "(e.g. /sessions/<id>)"
            )

    def anthropic_url(self) -> str:
        """The Anthropic Messages base URL as the agent reaches it (through the placeholder)."""
        return GATEWAY_PLACEHOLDER + self.session_path

    def openai_url(self) -> str:
        """The OpenAI (Chat Completions and Responses) base URL as the agent reaches it."""
        return GATEWAY_PLACEHOLDER + self.session_path + "/v1"


@dataclass(frozen=True)
class TranscriptSummary:
    """What a transcript shows, cheaply: ``events`` the agent's JSON events (lines, for a
    plain-text transcript), ``tool_uses`` the tool calls it made, ``final_text`` its last
    answer (None: none seen), ``errors`` error events it reported, ``unparsed_lines``
    non-empty lines that were not the JSON a JSON transcript should hold."""

    events: int = 0
    tool_uses: int = 0
    final_text: str | None = None
    errors: int = 0
    unparsed_lines: int = 0


class Harness(abc.ABC):
    """One way of running an agent. Subclasses are frozen dataclasses (their settings), set
    ``name``, ``needs`` (the agent CLI the launch runs, ``"claude"``/``"codex"``, or None) and
    ``about`` (one line for ``corral harness list``), and implement :meth:`launch`."""

    name: ClassVar[str]
    needs: ClassVar[str | None] = None
    about: ClassVar[str] = ""

    @abc.abstractmethod
    def launch(self, task: AgentTask, session: SessionAccess, *, timeout_s: float) -> AgentLaunch:
        """The launch for ``task`` on ``session`` with budget ``timeout_s`` (seconds, > 0).
        Raises :class:`HarnessError` when it cannot be built (nothing else)."""

    def summarize_transcript(self, text: str) -> TranscriptSummary:
        """A summary of the transcript the launch's agent wrote (:attr:`AgentRun.transcript`).
        Never raises: garbage gives counts of what could be read. The default reads plain
        text: one event per non-empty line, the last one as the final text."""
        lines = [line for line in text.splitlines() if line.strip()]
        return TranscriptSummary(events=len(lines), final_text=lines[-1] if lines else None)

    def _launch(
        self,
        *,
        argv: list[str],
        env: dict[str, str],
        files: list[AgentFile],
        gateway: str,
        timeout_s: float,
    ) -> AgentLaunch:
        """The :class:`AgentLaunch` of this harness (a bad budget is a :class:`HarnessError`)."""
        if not timeout_s > 0:
            raise HarnessError(f"timeout_s must be > 0 seconds, not {timeout_s!r}")
        return AgentLaunch(
            harness=self.name,
            argv=argv,
            env=env,
            files=files,
            gateway=gateway,
            timeout_s=timeout_s,
            transcript="stdout",
        )


def agent_file(
    path: str, content: bytes | str, *, area: AgentFileArea = "home", executable: bool = False
) -> AgentFile:
    """An :class:`AgentFile` at ``path`` (relative, "/"-separated) holding ``content``."""
    data = content.encode() if isinstance(content, str) else content
    return AgentFile(
        area=area,
        path=path,
        content_b64=base64.b64encode(data).decode("ascii"),
        executable=executable,
    )


def json_events(text: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSON-lines transcript, and how many non-empty lines were not
    one (a truncated last line, text another part of the agent printed)."""
    events: list[dict[str, Any]] = []
    bad = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(value, dict):
            events.append(value)
        else:
            bad += 1
    return events, bad
