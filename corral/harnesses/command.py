"""Any program as the agent: a shell command run in the task's workspace, told where its
session is through the environment.

The command runs as ``bash -c COMMAND`` in the workspace. Its environment
(:data:`corral.envs.protocol.AgentLaunch` adds ``HOME``, ``TMPDIR``, ``PATH`` and
``CORRAL_AGENT_DIR``):

- ``OPENAI_BASE_URL`` (``.../v1``) and ``OPENAI_API_KEY``; ``ANTHROPIC_BASE_URL`` and
  ``ANTHROPIC_AUTH_TOKEN``: the session, in the names the official SDKs read;
- ``CORRAL_MODEL``: the model to ask for; ``CORRAL_TASK_PROMPT``, ``CORRAL_INSTRUCTIONS``
  (empty when the bundle has none) and ``CORRAL_TASK_ID``: the task.

``agent_dir``, when set, is a host folder whose files are shipped with every launch and
appear, read-only, under ``CORRAL_AGENT_DIR`` (the agent's own code: ``command =
"python3 $CORRAL_AGENT_DIR/agent.py"``). It is read once, when the harness is made, and
bounded: at most :data:`~corral.envs.agent_bridge.MAX_FILES_BYTES` in all, regular files
only, a symlink only to a file inside the folder (shipped as a copy); empty folders are not
shipped. Anything else is a :class:`~corral.harnesses.base.HarnessError`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from corral.envs.agent_bridge import MAX_FILES_BYTES
from corral.envs.protocol import AgentFile, AgentLaunch
from corral.harnesses.base import AgentTask, Harness, HarnessError, SessionAccess, agent_file

MAX_PATH_CHARS = 1024  # AgentFile.path's bound


@dataclass(frozen=True)
class Command(Harness):
    """A shell command (module docstring). ``command``: what ``bash -c`` runs;
    ``agent_dir``: a host folder shipped to ``CORRAL_AGENT_DIR`` (None: nothing shipped)."""

    name: ClassVar[str] = "command"
    about: ClassVar[str] = (
        "any program (bash -c COMMAND) given the session's OpenAI and Anthropic URLs"
    )

    command: str
    agent_dir: Path | None = None
    _files: tuple[AgentFile, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if not isinstance(self.command, str) or not self.command.strip():
            raise HarnessError("command: `command` must be a non-empty shell command")
        if self.agent_dir is not None:
            # Frozen dataclass: the files read now are part of the harness from here on.
            object.__setattr__(self, "_files", read_agent_dir(Path(self.agent_dir)))

    @property
    def files(self) -> tuple[AgentFile, ...]:
        """The ``agent_dir`` files every launch ships (empty without an ``agent_dir``)."""
        return self._files

    def launch(self, task: AgentTask, session: SessionAccess, *, timeout_s: float) -> AgentLaunch:
        env = {
            "OPENAI_BASE_URL": session.openai_url(),
            "OPENAI_API_KEY": session.api_key,
            "ANTHROPIC_BASE_URL": session.anthropic_url(),
            "ANTHROPIC_AUTH_TOKEN": session.api_key,
            "CORRAL_MODEL": session.model,
            "CORRAL_TASK_PROMPT": task.prompt,
            "CORRAL_INSTRUCTIONS": task.instructions,
            "CORRAL_TASK_ID": task.task_id,
        }
        return self._launch(
            argv=["bash", "-c", self.command],
            env=env,
            files=list(self._files),
            gateway=session.gateway,
            timeout_s=timeout_s,
        )


def read_agent_dir(root: Path, *, max_bytes: int = MAX_FILES_BYTES) -> tuple[AgentFile, ...]:
    """Every file under ``root`` as an ``agent_dir`` :class:`AgentFile` (paths relative to
    ``root``, sorted; the owner's execute bit kept). Raises :class:`HarnessError` when
    ``root`` is not a folder, when a symlink leads out of it or to a folder, when an entry is
    not a regular file (a socket, a device), or when the files hold more than ``max_bytes``."""
    if not root.is_dir():
        raise HarnessError(f"command: agent_dir {root} is not a folder")
    base = root.resolve()
    found: list[tuple[str, Path, bool]] = []
    total = 0
    for folder, dirs, names in os.walk(base, followlinks=False):
        dirs.sort()
        for name in sorted(dirs):
            if (Path(folder) / name).is_symlink():
                raise HarnessError(
                    f"command: agent_dir holds a symlink to a folder "
                    f"({_rel(Path(folder) / name, base)}); copy the folder in instead"
                )
        for name in sorted(names):
            path = Path(folder) / name
            rel = _rel(path, base)
            target = path.resolve()
            if path.is_symlink() and not target.is_relative_to(base):
                raise HarnessError(
                    f"command: agent_dir's symlink {rel} leads out of the folder; "
                    "copy its target in instead"
                )
            try:
                info = target.stat()
            except OSError as exc:
                raise HarnessError(f"command: agent_dir's {rel} cannot be read: {exc}") from exc
            if not stat.S_ISREG(info.st_mode):
                raise HarnessError(f"command: agent_dir's {rel} is not a regular file")
            if len(rel) > MAX_PATH_CHARS:
                raise HarnessError(f"command: agent_dir's path {rel[:80]}... is too long")
            total += info.st_size
            if total > max_bytes:
                raise HarnessError(
                    f"command: agent_dir holds more than {max_bytes // 2**20} MiB of files "
                    f"(reached at {rel}); ship less, or install the rest in the image"
                )
            found.append((rel, target, bool(info.st_mode & stat.S_IXUSR)))
    return tuple(
        agent_file(rel, target.read_bytes(), area="agent_dir", executable=executable)
        for rel, target, executable in found
    )


def _rel(path: Path, base: Path) -> str:
    return path.relative_to(base).as_posix()
