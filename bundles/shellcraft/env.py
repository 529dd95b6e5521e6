"""shellcraft's env: a work folder with the task's files, a ``bash`` tool, a ``submit`` tool.

The work folder is the process's current working folder when :meth:`ShellEnv.reset` runs (the
sandbox's writable folder; a temporary folder in tests). ``reset`` writes the task's input files
there and refuses a folder that already holds any of the names the task uses. The task's data
is the env's view (:func:`workspace.view_of`, made by the bundle's ``[env] task_data`` in the
server: ``Bundle.env_task``): the files to write and the answer's names, never the seed they
come from, whose generator (``files.py``) stays outside the sandbox with the answer code.

Tools:

- ``bash`` ``{"command": str}``: ``bash -c`` in the work folder (see :mod:`shell`: a fresh
  shell per call, its own process group, killed as a whole after ``command_timeout_s``,
  background jobs killed when it exits, each output stream cut at ``output_limit_bytes``). The
  environment is fixed (``PATH``, ``HOME`` = the work folder, ``LC_ALL=C``, ``TERM=dumb``):
  nothing of the runner's environment leaks into the model's shell. The reply is text: the exit
  code, then stdout and stderr.
- ``submit`` ``{"note"?: str}``: ends the episode.

The episode also ends when the server's turn limit is reached; a turn that ends without
``submit`` (:meth:`ShellEnv.end_turn`) gets a reminder and the episode goes on. Unknown tools,
arguments of the wrong shape and calls after ``submit`` are answered with ``error=True``; the
episode goes on.

``state()`` reads the work folder back (:mod:`snapshot`): the answer files (bounded) and the
digest of every input's current content; the verifier compares those digests with the ones it
computes itself from the task's data, so it relies on nothing the env recorded at reset.

Imports only the standard library, ``corral.envs.episode`` and this bundle's env-side modules.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from corral.envs.episode import Task, ToolOutcome

from . import shell, snapshot
from .workspace import Workspace, from_view

BASH = "bash"
SUBMIT = "submit"
# Commands longer than this are refused (a heredoc of a small script fits easily).
MAX_COMMAND_CHARS = 20_000
MAX_NOTE_CHARS = 2_000
# Where bash looks for programs when the runner's environment has no PATH.
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


class ShellEnv:
    """One shellcraft episode (see the module docstring); call ``reset`` before any tool.

    ``command_timeout_s`` and ``output_limit_bytes`` are per instance so tests can shrink them.
    """

    command_timeout_s: float = 10.0
    output_limit_bytes: int = 8192

    def __init__(self) -> None:
        self._task: Task | None = None
        self._root: Path | None = None
        self._workspace: Workspace | None = None
        self._submitted = False
        self._note: str | None = None
        self._commands = 0
        self._timeouts = 0
        self._tool_errors = 0
        self._groups: list[int] = []  # process groups of earlier commands (see shell.reap_group)

    def reset(self, task: Task) -> str:
        """Write the task's inputs into the current working folder; return the task's prompt.

        Raises KeyError / ValueError / TypeError for data that is not a shellcraft view, and
        RuntimeError when the folder already holds a name the task uses (a reused sandbox).
        """
        workspace = from_view(task.data)
        root = Path.cwd()
        taken = [name for name in workspace.top_level_names() if os.path.lexists(root / name)]
        if taken:
            raise RuntimeError(f"the work folder {root} already holds {taken}: not a fresh one")
        for spec in workspace.inputs:
            path = root / spec.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(spec.stored_bytes())
        self._task, self._root, self._workspace = task, root, workspace
        self._submitted, self._note = False, None
        self._commands = self._timeouts = self._tool_errors = 0
        return task.prompt

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Run a tool; RuntimeError only if ``reset`` was never called (a server bug)."""
        if self._root is None:
            raise RuntimeError("call_tool before reset")
        if name not in (BASH, SUBMIT):
            return self._error(f"unknown tool {name!r}; the tools are {BASH} and {SUBMIT}")
        if self._submitted:
            return self._error("the work was already submitted; the episode is over")
        if not isinstance(arguments, dict):
            return self._error(f"{name}: arguments must be a JSON object")
        if name == BASH:
            return self._bash(arguments)
        return self._submit(arguments)

    def end_turn(self, arguments: dict[str, Any]) -> ToolOutcome:
        """A turn ended without ``submit``: remind the model and go on (the server ends the
        episode at the bundle's ``max_turns``)."""
        if self._submitted:
            return ToolOutcome("The work was submitted; the episode is over.", done=True)
        return ToolOutcome(
            "The episode goes on: keep working with the bash tool, and call submit once the "
            "answer files are written (the files in the working folder are what is graded)."
        )

    def state(self) -> dict[str, Any]:
        """JSON data: the answer files, the inputs' digests, counters (see the README)."""
        outputs: dict[str, dict[str, Any]] = {}
        inputs: dict[str, str | None] = {}
        omitted = 0
        self._reap()
        if self._root is not None and self._workspace is not None:
            outputs, omitted = snapshot.read_outputs(self._root, self._workspace)
            inputs = {f.path: snapshot.input_digest(self._root, f) for f in self._workspace.inputs}
        return {
            "task_id": self._task.id if self._task else None,
            "family": self._workspace.family if self._workspace else None,
            "submitted": self._submitted,
            "note": self._note,
            "outputs": outputs,
            "outputs_omitted": omitted,
            "inputs": inputs,
            "commands": self._commands,
            "timeouts": self._timeouts,
            "tool_errors": self._tool_errors,
        }

    def _bash(self, arguments: dict[str, Any]) -> ToolOutcome:
        extra = sorted(set(arguments) - {"command"})
        if extra:
            return self._error(f'bash: unknown argument(s) {extra}; the only one is "command"')
        if "command" not in arguments:
            return self._error('bash: missing argument "command" (the shell command, a string)')
        command = arguments["command"]
        if not isinstance(command, str):
            kind = _json_kind(command)
            return self._error(f'bash: "command" must be a string (the shell command), not {kind}')
        if not command.strip():
            return self._error('bash: "command" is empty')
        if len(command) > MAX_COMMAND_CHARS:
            return self._error(f"bash: the command is longer than {MAX_COMMAND_CHARS} characters")
        assert self._root is not None
        if not (self._root.is_dir() and os.access(self._root, os.R_OK | os.X_OK)):
            # The model removed (or locked) its own work folder: its mistake, not the env's.
            return self._error(f"bash: the working folder {self._root} is gone or unusable")
        self._reap()
        result = shell.run_command(
            command,
            cwd=self._root,
            env=self._bash_environment(),
            timeout_s=self.command_timeout_s,
            limit_bytes=self.output_limit_bytes,
        )
        self._commands += 1
        self._timeouts += result.timed_out
        self._groups.append(result.group)
        return ToolOutcome(render_result(result, self.command_timeout_s))

    def _submit(self, arguments: dict[str, Any]) -> ToolOutcome:
        extra = sorted(set(arguments) - {"note"})
        if extra:
            return self._error(f'submit: unknown argument(s) {extra}; the only one is "note"')
        note = arguments.get("note")
        if note is not None and not isinstance(note, str):
            return self._error('submit: "note" must be a string')
        self._submitted, self._note = True, note[:MAX_NOTE_CHARS] if note else None
        return ToolOutcome("Submitted; the files in the working folder are graded now.", done=True)

    def _bash_environment(self) -> dict[str, str]:
        """The model's shell environment: fixed, so runs are reproducible and the runner's
        variables (tokens, paths) never reach the model. ``LC_ALL=C``: byte-order sorting."""
        assert self._root is not None
        return {
            "PATH": os.environ.get("PATH") or DEFAULT_PATH,
            "HOME": str(self._root),
            "LC_ALL": "C",
            "TERM": "dumb",
        }

    def _reap(self) -> None:
        """Reap what earlier commands left behind and was re-parented to this process late."""
        for group in self._groups:
            shell.reap_group(group)

    def _error(self, message: str) -> ToolOutcome:
        self._tool_errors += 1
        return ToolOutcome(f"error: {message}", error=True)


def _json_kind(value: Any) -> str:
    """How the model wrote ``value``, in JSON's words (it never sees Python's type names)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "an object"


def render_result(result: shell.CommandResult, timeout_s: float) -> str:
    """The tool message: how the command ended, then its stdout and stderr (each noted when it
    was cut short)."""
    if result.timed_out:
        head = (
            f"timed out after {timeout_s:g} s: the command and every process it started were killed"
        )
    elif result.exit_code is not None and result.exit_code < 0:
        head = f"killed by signal {-result.exit_code}"
    else:
        head = f"exit code: {result.exit_code}"
    parts = [head]
    for label, captured in (("stdout", result.stdout), ("stderr", result.stderr)):
        if not captured.total:
            continue
        text = captured.data.decode("utf-8", errors="replace")
        parts.append(f"{label}:\n{text}")
        if captured.truncated:
            shown = len(captured.data)
            parts.append(f"[{label} cut: showing the first {shown:,} of {captured.total:,} bytes]")
    if not result.stdout.total and not result.stderr.total:
        parts.append("(no output)")
    return "\n".join(p.rstrip("\n") for p in parts)
