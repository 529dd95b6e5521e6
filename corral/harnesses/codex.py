"""Codex CLI, headless (``codex exec --json``), pointed at the session's OpenAI Responses URL.

What each setting is for, as measured with the pinned CLI (:mod:`corral.harnesses.clis`) off
the network:

- ``$CODEX_HOME/config.toml`` (``CODEX_HOME`` = ``AGENT_HOME/.codex``): the session as the only
  model provider (``wire_api = "responses"``: 0.169 refuses ``"chat"``; it appends
  ``/responses`` to ``base_url``), its key read from :data:`KEY_VAR`, and everything that
  talks to anything else off: update checks, analytics (else ab.chatgpt.com), feedback,
  history, OpenTelemetry, plugins (else github.com and chatgpt.com), web search.
  ``--strict-config`` makes a key this version does not know an error, not a silent no-op.
  ``CODEX_HOME`` may not lie under the temporary folder (Codex then cannot make its helper
  links); the sandbox's ``TMPDIR`` is ``AGENT_TMP``, a sibling of ``AGENT_HOME``, which works.
- ``--dangerously-bypass-approvals-and-sandbox``: the episode's sandbox is the sandbox.
  Codex's own (bubblewrap in a new user namespace) can start nested on a bare bwrap, but not
  where user namespaces are denied (docker's default seccomp profile, most Kubernetes pods),
  and its default read-only policy would stop the agent from writing in the workspace.
- ``--skip-git-repo-check``: a task's workspace need not be a git repository.
- ``--json``: every event (thread, turn, each item: commands, messages, errors) as one JSON
  line on stdout: the transcript. The prompt is the last argument; ``exec`` also reads stdin
  to its end and appends it, so the agent's stdin must be empty (``/dev/null``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from corral.envs.protocol import AGENT_HOME, AgentLaunch
from corral.harnesses.base import (
    AgentTask,
    Harness,
    HarnessError,
    SessionAccess,
    TranscriptSummary,
    agent_file,
    json_events,
)

CODEX_HOME = f"{AGENT_HOME}/.codex"
KEY_VAR = "CORRAL_API_KEY"  # the variable Codex reads the session's key from (env_key)
PROVIDER = "corral"
# Item types of a tool the agent ran (``item.completed`` events).
TOOL_ITEMS = frozenset({"command_execution", "mcp_tool_call", "file_change", "web_search"})


def _toml_string(value: str) -> str:
    """``value`` as a TOML basic string. JSON's string escapes are TOML's (``json.dumps``
    never writes ``\\/``, the one JSON escape TOML lacks)."""
    return json.dumps(value)


def codex_config(*, model: str, base_url: str, max_retries: int | None) -> str:
    """The config.toml: ``base_url`` as the provider's, everything networked off."""
    lines = [
        f"model = {_toml_string(model)}",
        f'model_provider = "{PROVIDER}"',
        "check_for_update_on_startup = false",
        'web_search = "disabled"',
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[feedback]",
        "enabled = false",
        "",
        "[history]",
        'persistence = "none"',
        "",
        "[otel]",
        'exporter = "none"',
        "",
        "[features]",
        "plugins = false",
        "",
        f"[model_providers.{PROVIDER}]",
        f'name = "{PROVIDER}"',
        f"base_url = {_toml_string(base_url)}",
        f'env_key = "{KEY_VAR}"',
        'wire_api = "responses"',
    ]
    if max_retries is not None:
        lines += [f"request_max_retries = {max_retries}", f"stream_max_retries = {max_retries}"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Codex(Harness):
    """Codex CLI. ``max_retries``: its provider's ``request_max_retries`` and
    ``stream_max_retries`` (None: the CLI's own, 4 and 5)."""

    name: ClassVar[str] = "codex"
    needs: ClassVar[str | None] = "codex"
    about: ClassVar[str] = "Codex CLI (codex exec --json) on the OpenAI Responses API"

    max_retries: int | None = None

    def __post_init__(self) -> None:
        if self.max_retries is not None and self.max_retries < 0:
            raise HarnessError(f"codex: max_retries must be >= 0, not {self.max_retries}")

    def launch(self, task: AgentTask, session: SessionAccess, *, timeout_s: float) -> AgentLaunch:
        # exec has no system-prompt flag that adds to (rather than replaces) Codex's own
        # instructions, so the bundle's instructions lead the prompt.
        prompt = f"{task.instructions}\n\n{task.prompt}" if task.instructions else task.prompt
        argv = ["codex", "exec", "--skip-git-repo-check", "--strict-config", "--json"]
        argv += ["--dangerously-bypass-approvals-and-sandbox", prompt]
        config = codex_config(
            model=session.model, base_url=session.openai_url(), max_retries=self.max_retries
        )
        env = {"CODEX_HOME": CODEX_HOME, KEY_VAR: session.api_key}
        files = [agent_file(".codex/config.toml", config)]
        return self._launch(
            argv=argv, env=env, files=files, gateway=session.gateway, timeout_s=timeout_s
        )

    def summarize_transcript(self, text: str) -> TranscriptSummary:
        """``--json`` events: completed tool items are the tool uses, the last completed
        ``agent_message`` the final text; ``error`` and ``turn.failed`` events the errors
        (``error`` *items* are Codex's non-fatal notices, such as an unknown model's
        metadata, and are not counted)."""
        events, bad = json_events(text)
        tool_uses = errors = 0
        final: str | None = None
        for event in events:
            kind = event.get("type")
            if kind in ("error", "turn.failed"):
                errors += 1
            if kind != "item.completed" or not isinstance(event.get("item"), dict):
                continue
            item = event["item"]
            if item.get("type") in TOOL_ITEMS:
                tool_uses += 1
            elif item.get("type") == "agent_message" and isinstance(item.get("text"), str):
                final = item["text"]
        return TranscriptSummary(
            events=len(events),
            tool_uses=tool_uses,
            final_text=final,
            errors=errors,
            unparsed_lines=bad,
        )
