"""The env server's defaults, each defined once: the server, its CLI, the rows that ask an env
server for episodes and the trainer's config take them from here; and :class:`ServeSettings`,
what ``corral serve`` is started with.

Light on purpose (no FastAPI, no sandboxes): a trainer config or a row writer imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Seconds one tool call may take on the env server before it answers with a timeout.
TOOL_TIMEOUT_S = 60.0
# Seconds a reset may take (building the task, starting its sandbox, waiting for capacity).
RESET_TIMEOUT_S = 600.0
# Seconds an episode may sit idle before the server reaps it.
IDLE_TIMEOUT_S = 600.0
# Seconds an authenticated WebSocket may wait before its first reset (a socket that plays
# nothing is closed).
FIRST_RESET_TIMEOUT_S = 120.0
# Where the agent CLIs are when no folder is given (what `corral serve` reads too).
AGENT_CLIS_VARIABLE = "CORRAL_AGENT_CLIS"


@dataclass(frozen=True)
class ServeSettings:
    """An env server for ``bundle`` (its folder): the keywords of
    :func:`~corral.envs.server.build_app` of the same names, and ``token_var``, the variable a
    child reads its bearer token from (a server in a thread is handed the token itself).

    ``max_concurrent_envs``, ``max_body_bytes`` and ``agent_max_timeout_s`` None: the server's
    own defaults (defined beside the code they bound, :mod:`corral.envs.episodes` and
    :mod:`corral.envs.server`, which this light module does not import). ``agent_clis`` None: no
    agent CLIs in a thread; a child then reads ``$CORRAL_AGENT_CLIS`` as ``corral serve``
    does. Each field is one ``corral serve`` flag (tests/test_service_settings.py parses
    :meth:`to_argv` with the real CLI)."""

    bundle: Path
    token_var: str | None = None
    max_concurrent_envs: int | None = None
    reset_timeout: float = RESET_TIMEOUT_S
    idle_timeout: float = IDLE_TIMEOUT_S
    tool_timeout: float = TOOL_TIMEOUT_S
    first_reset_timeout: float = FIRST_RESET_TIMEOUT_S
    sandbox: str | None = None
    sandbox_image: str | None = None
    warm_sandboxes: int = 0
    max_body_bytes: int | None = None
    agent_clis: Path | None = None
    agent_gateways: tuple[str, ...] = ()
    agent_max_timeout_s: float | None = None

    def app_options(self) -> dict[str, Any]:
        """The keywords of :func:`~corral.envs.server.build_app` after the bundle (the token is
        the caller's); a field left None is left out, so the server's default holds."""
        options: dict[str, Any] = {
            "reset_timeout": self.reset_timeout,
            "idle_timeout": self.idle_timeout,
            "tool_timeout": self.tool_timeout,
            "first_reset_timeout": self.first_reset_timeout,
            "sandbox": self.sandbox,
            "sandbox_image": self.sandbox_image,
            "warm_sandboxes": self.warm_sandboxes,
            "agent_clis": self.agent_clis,
            "agent_gateways": list(self.agent_gateways),
        }
        optional = {
            "max_concurrent_envs": self.max_concurrent_envs,
            "max_body_bytes": self.max_body_bytes,
            "agent_max_timeout_s": self.agent_max_timeout_s,
        }
        return options | {key: value for key, value in optional.items() if value is not None}

    def to_argv(self) -> list[str]:
        """``corral`` arguments that serve these settings: the subcommand and its flags, all
        but ``--host``/``--port`` (the launcher adds them)."""
        argv = ["serve", str(self.bundle)]

        def flag(name: str, value: object) -> None:
            if value is not None:
                argv.extend([name, str(value)])

        flag("--token-var", self.token_var)
        flag("--max-concurrent-envs", self.max_concurrent_envs)
        flag("--reset-timeout", self.reset_timeout)
        flag("--idle-timeout", self.idle_timeout)
        flag("--tool-timeout", self.tool_timeout)
        flag("--first-reset-timeout", self.first_reset_timeout)
        flag("--sandbox", self.sandbox)
        flag("--sandbox-image", self.sandbox_image)
        flag("--warm-sandboxes", self.warm_sandboxes)
        flag("--max-body-bytes", self.max_body_bytes)
        flag("--agent-clis", self.agent_clis)
        for origin in self.agent_gateways:
            flag("--agent-gateway", origin)
        flag("--agent-max-timeout", self.agent_max_timeout_s)
        return argv
