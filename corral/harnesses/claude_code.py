"""Claude Code, headless (``claude -p``), pointed at the session's Anthropic Messages URL.

What each setting is for, as measured with the pinned CLI (:mod:`corral.harnesses.clis`) off
the network:

- ``-p PROMPT --output-format stream-json --verbose``: one run, no terminal UI, every event
  (the init, each assistant message with its tool uses, each tool result, the final
  ``result``) as one JSON line on stdout: the transcript. ``--verbose`` is required by
  stream-json in print mode.
- ``--permission-mode bypassPermissions``: tools run without asking (nobody is there to
  answer); the episode's sandbox is what confines them. The CLI refuses this mode as root,
  which is why the agent runs as the sandbox's unprivileged user.
- ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``, ``DISABLE_AUTOUPDATER``,
  ``DISABLE_TELEMETRY``, ``DISABLE_ERROR_REPORTING``: nothing but the base URL is contacted
  (without the first it also sends ``HEAD $BASE/api/hello`` and looks up api.anthropic.com).
- Every model alias (the small/fast one it uses for side work included) is the session's
  model, so every request it makes goes to the session's model.
- ``.claude.json`` in HOME marks onboarding done. Version 2.1.328 runs ``-p`` unattended
  with an empty HOME too; the file keeps it so across versions that add a first-run step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from corral.envs.protocol import AgentLaunch
from corral.harnesses.base import (
    AgentTask,
    Harness,
    HarnessError,
    SessionAccess,
    TranscriptSummary,
    agent_file,
    json_events,
)

# Environment variables naming a model Claude Code may ask for: its main model, the
# small/fast one (old and new names) and the per-alias defaults, all set to the session's.
MODEL_VARS = (
    "ANTHROPIC_MODEL",
    "ANTHROPIC_SMALL_FAST_MODEL",
    "ANTHROPIC_DEFAULT_HAIKU_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL",
    "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "CLAUDE_CODE_SUBAGENT_MODEL",
)
QUIET_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
}
ONBOARDING = {"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True}


@dataclass(frozen=True)
class ClaudeCode(Harness):
    """Claude Code. ``max_turns``: ``--max-turns`` (None: the CLI's own limit);
    ``max_retries``: ``CLAUDE_CODE_MAX_RETRIES`` (None: the CLI's own; 0 also turns off its
    non-streaming retry of a failed stream, so one gateway error ends the run)."""

    name: ClassVar[str] = "claude-code"
    needs: ClassVar[str | None] = "claude"
    about: ClassVar[str] = "Claude Code (claude -p, stream-json) on the Anthropic Messages API"

    max_turns: int | None = None
    max_retries: int | None = None

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise HarnessError(f"claude-code: max_turns must be >= 1, not {self.max_turns}")
        if self.max_retries is not None and self.max_retries < 0:
            raise HarnessError(f"claude-code: max_retries must be >= 0, not {self.max_retries}")

    def launch(self, task: AgentTask, session: SessionAccess, *, timeout_s: float) -> AgentLaunch:
        argv = ["claude", "-p", task.prompt, "--output-format", "stream-json", "--verbose"]
        argv += ["--permission-mode", "bypassPermissions"]
        if task.instructions:
            argv += ["--append-system-prompt", task.instructions]
        if self.max_turns is not None:
            argv += ["--max-turns", str(self.max_turns)]
        env = {
            "ANTHROPIC_BASE_URL": session.anthropic_url(),
            "ANTHROPIC_AUTH_TOKEN": session.api_key,
            **{var: session.model for var in MODEL_VARS},
            **QUIET_ENV,
        }
        if self.max_retries is not None:
            env["CLAUDE_CODE_MAX_RETRIES"] = str(self.max_retries)
            if self.max_retries == 0:
                env["CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK"] = "1"
        files = [agent_file(".claude.json", json.dumps(ONBOARDING, indent=1) + "\n")]
        return self._launch(
            argv=argv, env=env, files=files, gateway=session.gateway, timeout_s=timeout_s
        )

    def summarize_transcript(self, text: str) -> TranscriptSummary:
        """stream-json: ``tool_use`` blocks of assistant messages are the tool uses; the
        ``result`` event's text is the final text (else the last assistant text); a result
        with ``is_error`` and ``error``-typed events count as errors."""
        events, bad = json_events(text)
        tool_uses = errors = 0
        final: str | None = None
        for event in events:
            kind = event.get("type")
            if kind == "assistant":
                message = event.get("message")
                blocks = message.get("content") if isinstance(message, dict) else None
                for block in blocks if isinstance(blocks, list) else []:
                    if not isinstance(block, dict):
                        continue
                    if block.get("type") == "tool_use":
                        tool_uses += 1
                    elif block.get("type") == "text" and isinstance(block.get("text"), str):
                        final = block["text"]
            elif kind == "result":
                if isinstance(event.get("result"), str):
                    final = event["result"]
                if event.get("is_error") is True:
                    errors += 1
            elif kind == "error":
                errors += 1
        return TranscriptSummary(
            events=len(events),
            tool_uses=tool_uses,
            final_text=final,
            errors=errors,
            unparsed_lines=bad,
        )
