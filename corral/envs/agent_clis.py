"""The operator's agent CLIs (Claude Code, Codex) as the env server hands them to sandboxes.

An npm install of the two CLIs (``scripts/agent_clis.sh DIR``) holds each one's native binary
somewhere under ``node_modules``; :func:`find_agent_clis` finds them the way that script does
(the first native ELF executable among the known layouts). :func:`write_links` makes a folder
of symlinks named after each CLI (``claude``, ``codex``) pointing at the binary as a sandbox
sees it: under :data:`~corral.envs.agent_bridge.AGENT_CLIS_ROOT` where the install is bound
read-only (bwrap, docker), or at its host path where the sandbox sees the host's files
(``local``). That folder goes first on the agent's ``PATH``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Where each CLI's native binary may sit in an npm install, relative to the install folder:
# as scripts/agent_clis.sh looks for them, first match wins.
CLAUDE_LAYOUTS = (
    "node_modules/@anthropic-ai/claude-code/bin/claude.exe",
    "node_modules/@anthropic-ai/claude-code/bin/claude",
    "node_modules/@anthropic-ai/claude-code-linux-*/claude",
    "node_modules/@anthropic-ai/claude-code/node_modules/@anthropic-ai/claude-code-linux-*/claude",
)
CODEX_LAYOUTS = (
    "node_modules/@openai/codex-linux-*/vendor/*/bin/codex",
    "node_modules/@openai/codex/node_modules/@openai/codex-linux-*/vendor/*/bin/codex",
    "node_modules/@openai/codex/vendor/*/bin/codex",
)


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


def _native(path: Path) -> bool:
    """An executable ELF file (not a node wrapper or a ``#!`` script)."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"\x7fELF" and path.is_file() and os.access(path, os.X_OK)


def _first(root: Path, layouts: tuple[str, ...]) -> Path | None:
    for pattern in layouts:
        for candidate in sorted(root.glob(pattern)):
            if _native(candidate):
                return candidate.relative_to(root)
    return None


def find_agent_clis(root: Path) -> AgentClis:
    """The CLIs' native binaries in the npm install at ``root`` (either may be missing).
    Raises ``ValueError`` when ``root`` is not a folder."""
    if not root.is_dir():
        raise ValueError(
            f"the agent CLIs folder {root} is not a folder "
            f"(install them with: bash scripts/agent_clis.sh {root})"
        )
    return AgentClis(claude=_first(root, CLAUDE_LAYOUTS), codex=_first(root, CODEX_LAYOUTS))


def write_links(clis: AgentClis, into: Path, seen_at: str) -> Path:
    """A fresh folder ``into`` (0755, it must not exist) of one symlink per CLI found, each
    pointing at ``seen_at/<its path in the install>``: the install folder as the agent sees
    it. Returns ``into``."""
    into.mkdir(mode=0o755)
    os.chmod(into, 0o755)  # the umask may have taken bits off: the model's user reads it
    for name, rel in clis.named().items():
        (into / name).symlink_to(f"{seen_at.rstrip('/')}/{rel.as_posix()}")
    return into
