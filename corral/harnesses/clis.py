"""The agent CLIs the built-in harnesses run: pinned versions, where they are, installing them.

Both come from npm into one folder (``npm install --prefix DIR``); neither needs Node to *run*:
Claude Code's package ships a glibc executable, Codex's per-platform dependency a static musl
one. :func:`find_clis` finds those native binaries as ``scripts/agent_clis.sh`` does (CI's
installer; the versions here and there are the same, a test checks it). The env server binds
the folder into each sandbox and puts links named ``claude`` and ``codex`` first on the
agent's ``PATH``.

The folder is ``$CORRAL_AGENT_CLIS``, else ``~/.cache/corral/agent-clis``
(:func:`default_clis_dir`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.328"
CODEX_PACKAGE = "@openai/codex"
CODEX_VERSION = "0.169.0"
CLIS_DIR_VAR = "CORRAL_AGENT_CLIS"
DEFAULT_CLIS_DIR = Path("~/.cache/corral/agent-clis")

# Where each native binary may be, relative to the folder, newest layout first (older Claude
# Code versions had cli.js plus a per-platform package; Codex's per-platform package is an
# npm alias, @openai/codex@<v>-linux-x64, carrying vendor/<target>/bin/codex).
CLAUDE_PATTERNS = (
    "node_modules/@anthropic-ai/claude-code/bin/claude.exe",
    "node_modules/@anthropic-ai/claude-code/bin/claude",
    "node_modules/@anthropic-ai/claude-code-linux-*/claude",
    "node_modules/@anthropic-ai/claude-code/node_modules/@anthropic-ai/claude-code-linux-*/claude",
)
CODEX_PATTERNS = (
    "node_modules/@openai/codex-linux-*/vendor/*/bin/codex",
    "node_modules/@openai/codex/node_modules/@openai/codex-linux-*/vendor/*/bin/codex",
    "node_modules/@openai/codex/vendor/*/bin/codex",
)


class CliInstallError(RuntimeError):
    """The CLIs could not be installed: no npm, npm failed (its exit code and the folder are
    in the message), or the install left no native binary."""


@dataclass(frozen=True)
class AgentClis:
    """The native binaries found in one install folder (None: not there)."""

    claude: Path | None
    codex: Path | None

    def get(self, cli: str) -> Path | None:
        """The binary named ``cli`` (``"claude"`` or ``"codex"``); None for any other name."""
        return {"claude": self.claude, "codex": self.codex}.get(cli)


def default_clis_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$CORRAL_AGENT_CLIS`` when set and non-empty, else ``~/.cache/corral/agent-clis``."""
    env = os.environ if environ is None else environ
    value = env.get(CLIS_DIR_VAR, "")
    return Path(value).expanduser() if value else DEFAULT_CLIS_DIR.expanduser()


def is_native(path: Path) -> bool:
    """An ELF executable (not a ``#!`` wrapper); False for anything unreadable."""
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _first_native(folder: Path, patterns: tuple[str, ...]) -> Path | None:
    for pattern in patterns:
        for candidate in sorted(folder.glob(pattern)):
            if candidate.is_file() and os.access(candidate, os.X_OK) and is_native(candidate):
                return candidate
    return None


def find_clis(folder: Path) -> AgentClis:
    """The native ``claude`` and ``codex`` binaries of the npm install in ``folder`` (a
    missing folder finds neither). Never raises."""
    return AgentClis(
        claude=_first_native(folder, CLAUDE_PATTERNS), codex=_first_native(folder, CODEX_PATTERNS)
    )


def installed_version(folder: Path, package: str) -> str | None:
    """The version ``package``'s package.json in ``folder``'s node_modules declares (None:
    not installed or unreadable)."""
    try:
        data = json.loads((folder / "node_modules" / package / "package.json").read_text())
    except (OSError, ValueError):
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return version if isinstance(version, str) else None


def up_to_date(folder: Path) -> bool:
    """Both packages at the pinned versions and both native binaries there."""
    clis = find_clis(folder)
    return (
        installed_version(folder, CLAUDE_CODE_PACKAGE) == CLAUDE_CODE_VERSION
        and installed_version(folder, CODEX_PACKAGE) == CODEX_VERSION
        and clis.claude is not None
        and clis.codex is not None
    )


def install_clis(
    folder: Path,
    *,
    force: bool = False,
    npm: str = "npm",
    progress: Callable[[str], None] | None = None,
) -> AgentClis:
    """Install the pinned CLIs into ``folder`` (made if missing) with ``npm install --prefix``,
    no audit, no funding notices; npm's own output goes to this process's stderr. Skipped when
    they are already there at the pinned versions, unless ``force``. ``progress`` gets a line
    before and after. Returns what is then found; raises :class:`CliInstallError` when npm is
    missing or fails, or the install leaves a binary missing."""
    say = progress or (lambda _line: None)
    folder = folder.expanduser()
    if not force and up_to_date(folder):
        say(f"agent CLIs already installed in {folder}")
        return find_clis(folder)
    exe = shutil.which(npm)
    if exe is None:
        raise CliInstallError(
            f"npm ({npm}) is not on PATH: install Node.js and npm (only the install needs them)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    specs = [f"{CLAUDE_CODE_PACKAGE}@{CLAUDE_CODE_VERSION}", f"{CODEX_PACKAGE}@{CODEX_VERSION}"]
    say(f"installing {' '.join(specs)} into {folder} (about 760 MB; 1-2 minutes cold) ...")
    start = time.monotonic()
    argv = [exe, "install", "--prefix", str(folder), "--no-audit", "--no-fund", *specs]
    # stdout to stderr: the caller's stdout stays for what it prints (e.g. the found paths).
    code = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=2, check=False).returncode
    if code != 0:
        raise CliInstallError(f"npm install into {folder} failed (exit {code}); see its output")
    if not up_to_date(folder):
        raise CliInstallError(f"the npm install left no native claude/codex binary in {folder}")
    say(f"agent CLIs installed in {folder} in {time.monotonic() - start:.0f} s")
    return find_clis(folder)
