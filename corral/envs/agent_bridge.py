"""Run a black-box agent in an episode's sandbox: the env server's side (CONTRACT STUB).

:func:`run_agent` starts the sandbox side (:mod:`corral.envs.agent_launcher`, standard library
only, shipped in the payload beside the runner) with :meth:`Sandbox.spawn` and talks to it over
that process's stdin/stdout, one JSON object per line:

- the first line down is the launch (argv, env, files, budget; see the launcher);
- the launcher listens on ``127.0.0.1:<port>`` *inside* the sandbox (the sandbox's own
  loopback: bwrap's and docker's network namespaces have nothing else), writes the files,
  starts the agent through the model jail (``CORRAL_MODEL_JAIL``) in the workspace, and
  forwards every TCP connection the agent opens to that listener as ``open`` / ``data`` /
  ``eof`` frames; this side opens one TCP (TLS for ``https``) connection to the gateway per
  agent connection and pumps bytes both ways. So the agent reaches the gateway and nothing
  else, on every backend, also where the sandbox is remote (kubernetes, e2b): no network
  path from the sandbox to the gateway is needed at all;
- the agent's stdout and stderr come up as ``out`` / ``err`` frames, its exit as ``exit``.

The budget is enforced here: at ``timeout_s`` a ``term`` frame (the launcher sends SIGTERM to
the agent's process group), ``kill_grace_s`` later the launcher process is killed, which kills
everything it started (:meth:`SandboxProcess.kill`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from corral.envs.protocol import AgentLaunch, AgentRun
from corral.sandboxes.base import Sandbox

# In-sandbox paths the env server binds the operator's agent CLIs at (bwrap, docker): the
# npm install folder, and a folder of links named after each CLI (put first on PATH).
AGENT_CLIS_ROOT = "/opt/agents"
AGENT_BIN_ROOT = "/opt/agent-bin"
MAX_TRANSCRIPT_BYTES = 8 * 2**20
TAIL_BYTES = 4000
MAX_FILES_BYTES = 32 * 2**20  # all of a launch's files together, decoded


class AgentRefused(ValueError):
    """The launch cannot run as given (a gateway the server does not bridge to, a file path
    that climbs out, files too big, a budget over the server's cap); nothing was started."""


@dataclass(frozen=True)
class AgentPolicy:
    """What the env server allows agents. ``gateways``: origins (``scheme://host:port``) it
    bridges agent traffic to; empty: any loopback origin (127.0.0.0/8, ::1, localhost)
    and nothing else. ``max_timeout_s``: the cap on a launch's budget."""

    gateways: tuple[str, ...] = ()
    max_timeout_s: float = 3600.0
    path_dirs: tuple[str, ...] = field(default=())  # in-sandbox folders put first on PATH


async def run_agent(
    sandbox: Sandbox,
    launch: AgentLaunch,
    *,
    python: str,
    code_root: str,
    jail: Sequence[str],
    workdir: str,
    policy: AgentPolicy,
) -> AgentRun:
    """Run ``launch`` in ``sandbox`` (module docstring) and return how it ended.

    ``python``: the interpreter inside; ``code_root``: where the payload (holding
    ``corral/envs/agent_launcher.py``) is inside; ``jail``: the provider's model jail prefix;
    ``workdir``: the task's workspace (the agent's working folder).

    Raises :class:`AgentRefused` before starting anything when the launch breaks ``policy``,
    and :class:`~corral.sandboxes.base.SandboxError` when the launcher cannot be started or
    the sandbox dies under it. An agent that crashes, overruns or is killed is an
    :class:`AgentRun`, never an exception. Cancellation kills the launcher (and so the agent)
    before it propagates.
    """
    raise NotImplementedError
