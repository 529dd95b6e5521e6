"""The episode protocol: what a bundle's env code and verifier implement.

One env instance plays one episode. The server (never the env) owns the turn structure: it
shows the task's prompt, offers the task's tools plus ``end_turn``, routes tool calls to
:meth:`Env.call_tool`, and when the episode ends hands :meth:`Env.state` to the bundle's
verifier, whose named scores the bundle's ``[reward]`` table combines into one reward.

Contracts the server relies on:

- The env class is constructed with no arguments, once per episode, and :meth:`Env.reset` is
  called exactly once, before any tool call.
- :meth:`Env.call_tool` never raises for the model's mistakes (an unknown tool, arguments of the
  wrong shape): it answers a :class:`ToolOutcome` with ``error=True`` and a message the model can
  act on, and the episode goes on. An exception out of it is a bug in the env, which the server
  reports as a failed episode.
- :meth:`Env.state` returns plain JSON data (dicts, lists, str, int, float, bool, None): it may
  cross a process boundary when the bundle runs in a sandbox.
- The verifier is a pure function of the task and that state; it returns finite floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

# The model's name for a turn-ending call; the server provides it, so no bundle may define it.
END_TURN_TOOL = "end_turn"


class Task(BaseModel):
    """One task of a bundle: where it sits (split, index), what the model sees, the env's data.

    ``prompt`` is the first user message. ``data`` is the env's own, opaque to corral (the
    server's task API serves it, so it must not hold the answer). ``tools`` names the subset of
    the bundle's tools this task offers; ``None`` offers them all. Tasks are shared between
    episodes: an env copies what it wants to change in ``data`` instead of mutating it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    split: str
    index: int = Field(ge=0)
    prompt: str
    data: dict[str, Any] = Field(default_factory=dict)
    tools: list[str] | None = None


@dataclass(frozen=True)
class ToolOutcome:
    """The answer to one tool call.

    ``content`` is the tool message the model reads. ``done`` ends the episode (the server
    grades it then). ``error`` marks a call the env refused (bad tool, bad arguments): the
    episode goes on and the server may count it, but it is still shown to the model.
    """

    content: str
    done: bool = False
    error: bool = False


@runtime_checkable
class Env(Protocol):
    """One episode of a bundle's environment (see the module docstring for the contracts)."""

    def reset(self, task: Task) -> str:
        """Start the episode on ``task``; return the first observation (usually its prompt)."""
        ...

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Run one tool call; never raise for the model's mistakes (answer ``error=True``)."""
        ...

    def state(self) -> dict[str, Any]:
        """The episode's state as plain JSON data: what the verifier grades."""
        ...


class Verifier(Protocol):
    """A bundle's grading function: named scores of an episode, each a finite float."""

    def __call__(self, task: Task, state: dict[str, Any]) -> dict[str, float]: ...
