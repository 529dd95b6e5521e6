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

This module imports nothing but the standard library: when a bundle runs in a sandbox, it is
copied in beside the bundle's env code (:mod:`corral.envs.runner`), where corral's
dependencies are not installed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

# The model's name for a turn-ending call; the server provides it, so no bundle may define it.
END_TURN_TOOL = "end_turn"


@dataclass(frozen=True)
class Task:
    """One task of a bundle: where it sits (split, index), what the model sees, the env's data.

    ``prompt`` is the first user message. ``data`` is the env's own, opaque to corral (the
    server's task API serves it, so it must not hold the answer). ``tools`` names the subset of
    the bundle's tools this task offers; ``None`` offers them all. Tasks are shared between
    episodes: an env copies what it wants to change in ``data`` instead of mutating it.
    """

    id: str
    split: str
    index: int
    prompt: str
    data: dict[str, Any] = field(default_factory=dict)
    tools: list[str] | None = None

    def __post_init__(self) -> None:
        # The bundle loader validates task lines; this catches hand-made tasks (tests, runners).
        if not self.id:
            raise ValueError("a task needs a non-empty id")
        if self.index < 0:
            raise ValueError(f"task index must be >= 0, got {self.index}")

    def to_json(self) -> dict[str, Any]:
        """The task as plain JSON data (what crosses into a sandbox)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Task:
        """The task :meth:`to_json` wrote; ``TypeError`` for unknown or missing fields."""
        return cls(**data)


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
