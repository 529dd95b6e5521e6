"""The operator's agent CLIs (Claude Code, Codex) as the env server hands them to sandboxes.

An npm install of the two CLIs (``corral harness install DIR``) holds each one's native binary
somewhere under ``node_modules``; :func:`find_agent_clis` finds them as
:func:`corral.harnesses.clis.find_clis` does, relative to the install. :func:`write_links`
makes a folder of symlinks named after each CLI (``claude``, ``codex``) pointing at the
binary as a sandbox sees it: under :data:`~corral.envs.agent_bridge.AGENT_CLIS_ROOT` where
the install is bound read-only (bwrap, docker), or at its host path where the sandbox sees
the host's files (``local``). That folder goes first on the agent's ``PATH``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from corral.harnesses.clis import find_clis


@dataclass(frozen=True)
class AgentClis:
    """The native binaries found in an install (``None``: that CLI is not there), as paths
    relative to the install folder."""

    claude: Path | None
    codex: Path | None

    def named(self) -> dict[str, Path]:
        """The binaries found, by the command name they are linked as."""
        found = {"claude": self.claude, "codex": self.codex}
        return {name: path for name, path in found.items() if path is not None}


def find_agent_clis(root: Path) -> AgentClis:
    """The CLIs' native binaries in the npm install at ``root`` (either may be missing).
    Raises ``ValueError`` when ``root`` is not a folder."""
    if not root.is_dir():
        raise ValueError(
            f"the agent CLIs folder {root} is not a folder "
            f"(install them with: bash scripts/agent_clis.sh {root})"
        )
    root = root.resolve()
    found = find_clis(root)
    return AgentClis(
        claude=None if found.claude is None else found.claude.relative_to(root),
        codex=None if found.codex is None else found.codex.relative_to(root),
    )


def write_links(clis: AgentClis, into: Path, seen_at: str) -> Path:
    """A fresh folder ``into`` (0755, it must not exist) of one symlink per CLI found, each
    pointing at ``seen_at/<its path in the install>``: the install folder as the agent sees
    it. Returns ``into``."""
    into.mkdir(mode=0o755)
    os.chmod(into, 0o755)  # the umask may have taken bits off: the model's user reads it
    for name, rel in clis.named().items():
        (into / name).symlink_to(f"{seen_at.rstrip('/')}/{rel.as_posix()}")
    return into
