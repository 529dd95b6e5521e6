"""What a harness is (CONTRACT STUB: the helper owning corral/harnesses fills it in).

A :class:`Harness` turns one task and one gateway session into an
:class:`~corral.envs.protocol.AgentLaunch`: the argv, environment and files that run the
agent headless, unattended and off every network but its session's. It runs nothing itself:
the env server runs the launch in the episode's sandbox (:mod:`corral.envs.agent_bridge`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from corral.envs.protocol import AgentLaunch


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


class Harness(abc.ABC):
    """One way of running an agent. Subclasses set ``name`` and implement :meth:`launch`."""

    name: str

    @abc.abstractmethod
    def launch(self, task: AgentTask, session: SessionAccess, *, timeout_s: float) -> AgentLaunch:
        """The launch for ``task`` on ``session`` with budget ``timeout_s``."""
