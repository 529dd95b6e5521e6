"""Play a bundle, not only read it: the checks behind ``corral bundle validate --play``.

:func:`play_check` plays policies against a bundle through a real
:class:`~corral.envs.hosting.EnvHost` (in the process, or one sandbox per episode), grades
each episode as the server does (``Bundle.grade`` on the env's final state, then
``Bundle.reward``), and judges these checks, each a :class:`Check` with a reason:

Bundle-wide:

- ``tool schemas``: every declared tool's ``parameters`` is valid JSON Schema under the draft
  it names with ``$schema`` (Draft 2020-12 when it names none), by jsonschema's
  ``check_schema``.
- ``payload``: what enters a sandbox holds no verifier, solver or baseline module and no task
  file, and none of the sampled tasks' hidden data or answers (below; bare words, letters and
  underscores only, are not searched for there: code names its vocabulary).

Per split, on a seeded sample of ``tasks`` tasks (:func:`sample_tasks`):

- ``solver at max``: the ``[solver]`` reaches the maximum reward on every sampled task. The
  maximum is read off ``[reward]`` with every score taken to lie in [0, 1]
  (:func:`max_reward`): 1 for ``score = ...``, the sum of the positive weights for
  ``weights``. As the server would, an episode fails whose call arguments or final state are
  larger, as compact JSON, than ``[limits]`` allows.
- ``do-nothing below solver``: the do-nothing policy (reset, then the env's ``end_turn`` once
  if it has one, then the state) scores on average at least ``margin`` below the solver's mean.
- ``deterministic grades``: the solver's episode played a second time, in a fresh env, gives
  exactly the same scores on every task.
- ``no leaks``: no hidden value and no answer value (below) appears in an observation the
  model gets before it acted: every episode's reset prompt, the do-nothing episode's
  ``end_turn`` reply and every reply to the malformed calls; and no hidden value appears in
  any tool result of the solver's and baselines' episodes either (the env never gets hidden
  data, so no call may show it). Their tool results are not searched for answers: a policy
  that wrote the answer may read it back, and the solver's replies are its work towards it.
- ``malformed calls``: every declared tool answers each call its schema rejects (not an
  object, a required argument missing, an argument of the wrong type, an unknown argument where
  ``additionalProperties`` forbids it; a tool whose schema is invalid is not probed) with
  a tool error (``ToolOutcome.error``) that does not end the episode, and the episode still
  answers the solver's first call afterwards without an error.
- ``baselines between``: each ``[[baselines]]`` policy's mean reward lies between the
  do-nothing mean and the solver's mean (reported even when none is declared).

What is hidden, what is the answer (the values the leak checks search for, as text):

- *hidden*: every value of the task's ``data`` that the env's view (``Bundle.env_task``)
  drops or changes, unless the task's prompt states it (e.g. shellcraft's seed).
- *answer*: every value of the solver episode's final state that the do-nothing episode's final
  state does not hold and the task's prompt does not state, e.g. gridsim's submitted schedule,
  shellcraft's answer file contents.

A value is searched for as its text (a string as it is, a number as JSON writes it, an array of
numbers and strings as its JSON text, spaced and compact); values shorter than
:data:`MIN_NEEDLE_CHARS` characters and booleans are not searched for (they occur everywhere).

Nothing here prints: the result is a :class:`PlayReport`; progress goes to a callback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import re
import statistics
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from corral.envs.bundle import Bundle, EntryPoint, LimitsSpec, RewardSpec, ToolSpec
from corral.envs.episode import Task, ToolOutcome
from corral.envs.hosting import EnvFailure, EnvHost
from corral.envs.settings import TOOL_TIMEOUT_S

DEFAULT_TASKS = 8
DEFAULT_MARGIN = 0.1
DEFAULT_SEED = 0
DEFAULT_CALL_TIMEOUT_S = TOOL_TIMEOUT_S
# Shorter texts (a "0", a "true", an "ok") occur in any observation: searching for them would
# only find noise.
MIN_NEEDLE_CHARS = 4
# Rewards are sums of floats: a solver this close to the maximum has reached it.
REWARD_TOLERANCE = 1e-6
# An argument name no tool declares, for the "unknown argument" probe.
UNKNOWN_ARGUMENT = "corral_unknown_argument"
_BARE_WORD = re.compile(r"^[A-Za-z_]+$")

SOLVER = "solver"
DO_NOTHING = "do-nothing"

CHECK_SCHEMAS = "tool schemas"
CHECK_PAYLOAD = "payload"
CHECK_SOLVER = "solver at max"
CHECK_DO_NOTHING = "do-nothing below solver"
CHECK_DETERMINISTIC = "deterministic grades"
CHECK_LEAKS = "no leaks"
CHECK_MALFORMED = "malformed calls"
CHECK_BASELINES = "baselines between"

Policy = Callable[[Task], Any]
T = TypeVar("T")


class PolicyError(ValueError):
    """A policy returned something other than a list of ``{"name", "arguments"}`` calls."""


@dataclass(frozen=True)
class PlaySettings:
    """How much to play and how to judge it. ``tasks``: sampled per split; ``margin``: how far
    (in reward) the do-nothing mean must stay below the solver's; ``seed``: the sample;
    ``splits``: which to play (``None``: all); ``call_timeout_s``: per env operation."""

    tasks: int = DEFAULT_TASKS
    margin: float = DEFAULT_MARGIN
    seed: int = DEFAULT_SEED
    splits: tuple[str, ...] | None = None
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.tasks < 1:
            raise ValueError(f"tasks must be at least 1, got {self.tasks}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {self.margin}")
        if not self.call_timeout_s > 0:
            raise ValueError(f"call_timeout_s must be > 0, got {self.call_timeout_s}")


@dataclass(frozen=True)
class ToolCall:
    """One call a policy makes. ``arguments`` is normally an object; probes send others."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class Episode:
    """One played episode: its scores and reward, or ``error`` (why it has none).

    ``observations``: the reset prompt, then each tool result in order. ``tool_errors``: how
    many of the policy's calls the env refused.
    """

    policy: str
    task_id: str
    observations: tuple[str, ...] = ()
    state: dict[str, Any] | None = None
    scores: dict[str, float] | None = None
    reward: float | None = None
    tool_errors: int = 0
    error: str | None = None


@dataclass(frozen=True)
class PolicyResult:
    """One policy's episodes on a split's sample."""

    name: str
    episodes: tuple[Episode, ...]

    @property
    def rewards(self) -> list[float]:
        return [e.reward for e in self.episodes if e.reward is not None]

    @property
    def failed(self) -> list[Episode]:
        return [e for e in self.episodes if e.reward is None]

    @property
    def mean(self) -> float | None:
        """The mean reward over the episodes that have one; None when none has."""
        rewards = self.rewards
        return statistics.fmean(rewards) if rewards else None


@dataclass(frozen=True)
class Check:
    """One judged check: ``detail`` gives the numbers when it passed, the reason when not."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Probe:
    """One call of a probe episode and what the env did with it: ``problem`` is None when it
    answered as it must (a malformed call: a tool error that lets the episode go on; the good
    call after them: no error). ``content``: the reply, when there was one."""

    kind: str
    call: ToolCall
    problem: str | None
    content: str | None = None


@dataclass(frozen=True)
class ProbeEpisode:
    """One episode of malformed calls to ``tool``, then a good call. ``failure``: why the
    episode did not get through its calls (no env, a failed reset, an env that died)."""

    tool: str
    prompt: str | None
    probes: tuple[Probe, ...]
    failure: str | None = None

    @property
    def problems(self) -> list[str]:
        found = [f"{self.tool}: {p.kind}: {p.problem}" for p in self.probes if p.problem]
        return found + ([f"{self.tool}: {self.failure}"] if self.failure else [])


@dataclass(frozen=True)
class SplitReport:
    """A split's sample, each policy's episodes and the split's checks."""

    split: str
    task_ids: tuple[str, ...]
    max_reward: float
    solver: PolicyResult
    do_nothing: PolicyResult
    baselines: tuple[PolicyResult, ...]
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class PlayReport:
    """Everything :func:`play_check` found: the bundle-wide checks and one report per split."""

    bundle: str
    host: str
    settings: PlaySettings
    checks: tuple[Check, ...]
    splits: tuple[SplitReport, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.all_checks())

    def all_checks(self) -> Iterator[Check]:
        yield from self.checks
        for split in self.splits:
            yield from split.checks

    def failures(self) -> list[str]:
        """One line per failed check: ``[split: ]check: reason``."""
        lines = [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]
        for split in self.splits:
            lines += [f"{split.split}: {c.name}: {c.detail}" for c in split.checks if not c.passed]
        return lines


def max_reward(reward: RewardSpec) -> float:
    """The most ``reward`` can give when every score lies in [0, 1] (the module docstring)."""
    if reward.score is not None:
        return 1.0
    return sum(w for w in (reward.weights or {}).values() if w > 0)


def sample_tasks(bundle: Bundle, split: str, count: int, seed: int) -> list[Task]:
    """``count`` tasks of ``split`` (all of them when it has fewer), in file order; the same
    ``(split, count, seed)`` picks the same tasks in every process."""
    tasks = bundle.tasks(split)
    if count >= len(tasks):
        return tasks
    rng = random.Random(f"corral-playcheck:{seed}:{split}")  # str seeds hash stably
    return [tasks[i] for i in sorted(rng.sample(range(len(tasks)), count))]


def planned_episodes(bundle: Bundle, settings: PlaySettings) -> int:
    """How many episodes :func:`play_check` plays (for a progress bar's total)."""
    per_task = 3 + len(bundle.manifest.baselines)  # solver twice, do-nothing, each baseline
    total = 0
    for split in _splits(bundle, settings):
        total += min(settings.tasks, len(bundle.tasks(split))) * per_task
        # one probe episode per tool with a valid schema
        total += sum(schema_problem(t) is None for t in bundle.manifest.tools)
    return total


def env_view(bundle: Bundle, task: Task) -> Task | str:
    """The task as the env sees it (``Bundle.env_task``), or why there is none (a message).
    Only for finding the hidden values: the env handles apply the view in their ``reset``."""
    try:
        return bundle.env_task(task)
    except Exception as exc:  # TaskDataError, or a bug in it: the episode cannot start
        return f"the env's view of the task failed: {exc}"


# --- policies ------------------------------------------------------------------------------


def tool_calls(raw: Any) -> list[ToolCall]:
    """A policy's answer as calls; :class:`PolicyError` saying what is wrong otherwise."""
    if not isinstance(raw, list):
        raise PolicyError(f"returned {type(raw).__name__}, not a list of tool calls")
    calls = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping) or set(item) != {"name", "arguments"}:
            raise PolicyError(f'call {i} is not {{"name": ..., "arguments": {{...}}}}: {item!r}')
        if not isinstance(item["name"], str) or not isinstance(item["arguments"], Mapping):
            raise PolicyError(f"call {i}: name must be a string and arguments an object")
        calls.append(ToolCall(item["name"], dict(item["arguments"])))
    return calls


def _plan(policy: Policy, task: Task) -> list[ToolCall] | str:
    """The calls ``policy`` makes on ``task``, or why it made none (a message)."""
    try:
        return tool_calls(policy(task))
    except PolicyError as exc:
        return f"the policy {exc}"
    except Exception as exc:
        return f"the policy raised {type(exc).__name__}: {exc}"


# --- playing -------------------------------------------------------------------------------


@dataclass
class _Player:
    bundle: Bundle
    host: EnvHost
    settings: PlaySettings
    on_episode: Callable[[str], None] | None = None

    async def _timed(self, what: str, op: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(op, self.settings.call_timeout_s)
        except TimeoutError:
            raise EnvFailure(
                f"{what} took longer than {self.settings.call_timeout_s:g} s"
            ) from None

    def _done(self, label: str) -> None:
        if self.on_episode is not None:
            self.on_episode(label)

    async def episode(self, policy: str, task: Task, calls: list[ToolCall] | str | None) -> Episode:
        """Play one episode: ``calls`` in order until one ends it (``None``: do nothing; a
        string: the policy failed, so nothing is played)."""
        try:
            if isinstance(calls, str):
                return Episode(policy, task.id, error=calls)
            return await self._episode(policy, task, calls)
        finally:
            self._done(f"{policy} on {task.split}/{task.id}")

    async def _episode(self, policy: str, task: Task, calls: list[ToolCall] | None) -> Episode:
        observations: list[str] = []
        errors = 0
        limits = self.bundle.manifest.limits
        try:
            env = await self._timed("starting the env", self.host.start())
        except EnvFailure as exc:
            return Episode(policy, task.id, error=f"the env did not start: {exc}")
        try:
            observations.append(await self._timed("reset", env.reset(task)))
            if calls is None:
                if env.has_end_turn:
                    outcome = await self._timed("end_turn", env.end_turn({}))
                    observations.append(outcome.content)
            else:
                for call in calls:
                    what = f"the {call.name} call's arguments"
                    too_big = _over_limit(what, call.arguments, "max_call_bytes", limits)
                    if too_big is not None:
                        raise EnvFailure(f"{too_big}: the server refuses the call")
                    outcome = await self._timed(call.name, env.call_tool(call.name, call.arguments))
                    observations.append(outcome.content)
                    errors += outcome.error
                    if outcome.done:
                        break
            state = await self._timed("state", env.state())
            too_big = _over_limit("the env's state", state, "max_state_bytes", limits)
            if too_big is not None:
                raise EnvFailure(f"{too_big}: the server fails the episode")
        except EnvFailure as exc:
            return Episode(policy, task.id, tuple(observations), tool_errors=errors, error=str(exc))
        finally:
            await env.close()
        base = Episode(policy, task.id, tuple(observations), state, tool_errors=errors)
        try:
            scores = self.bundle.grade(task, state)
            reward = self.bundle.reward(scores)
        except Exception as exc:  # VerifierError, RewardError: the bundle's bug, reported
            return _replace(base, error=f"grading failed: {exc}")
        return _replace(base, scores=scores, reward=reward)

    async def probes(self, tool: ToolSpec, task: Task, good: ToolCall | None) -> ProbeEpisode:
        """One episode on ``task``: every malformed call of ``tool``, then ``good``."""
        try:
            return await self._probes(tool, task, good)
        finally:
            self._done(f"malformed calls of {tool.name} on {task.split}/{task.id}")

    async def _probes(self, tool: ToolSpec, task: Task, good: ToolCall | None) -> ProbeEpisode:
        try:
            env = await self._timed("starting the env", self.host.start())
        except EnvFailure as exc:
            return ProbeEpisode(tool.name, None, (), f"the env did not start: {exc}")
        prompt: str | None = None
        probes: list[Probe] = []
        calls = malformed_calls(tool) + ([("good call", good)] if good is not None else [])
        try:
            prompt = await self._timed("reset", env.reset(task))
            for kind, call in calls:
                outcome = await self._timed(call.name, env.call_tool(call.name, call.arguments))
                if kind == "good call":
                    problem = f"answered a tool error: {outcome.content[:200]!r}"
                    probes.append(Probe(kind, call, problem if outcome.error else None))
                else:
                    probes.append(Probe(kind, call, _probe_problem(outcome), outcome.content))
        except EnvFailure as exc:
            # A dead env answers nothing more; the call it died on is named.
            where = f"{calls[len(probes)][0]}: " if prompt is not None else "reset: "
            return ProbeEpisode(tool.name, prompt, tuple(probes), f"{where}the env failed: {exc}")
        finally:
            await env.close()
        return ProbeEpisode(tool.name, prompt, tuple(probes))


def _over_limit(what: str, value: Any, key: str, limits: LimitsSpec) -> str | None:
    """Why ``value``, as compact JSON, is larger than the ``[limits]`` entry ``key``; None
    when it is not."""
    limit: int = getattr(limits, key)
    size = len(json.dumps(value, separators=(",", ":")).encode())
    if size <= limit:
        return None
    return f"{what} take {size:,} bytes as JSON, over [limits] {key} = {limit:,}"


def _replace(episode: Episode, **changes: Any) -> Episode:
    return dataclasses.replace(episode, **changes)


def _probe_problem(outcome: ToolOutcome) -> str | None:
    if not outcome.error:
        return f"was accepted (no tool error): {outcome.content[:200]!r}"
    if outcome.done:
        return "ended the episode (a tool error must let it go on)"
    return None


# --- malformed calls -------------------------------------------------------------------------


def schema_validator(schema: Any) -> type[Any]:
    """The jsonschema validator class for ``schema``'s ``$schema`` (Draft 2020-12 if none)."""
    # Imported here: the CLI imports this module for its defaults, before any command runs.
    import jsonschema.validators

    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def schema_problem(tool: ToolSpec) -> str | None:
    """Why ``tool.parameters`` is not a valid JSON Schema, or None."""
    from jsonschema import SchemaError

    try:
        schema_validator(tool.parameters).check_schema(tool.parameters)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        return f"{tool.name}: parameters at {where}: {exc.message}"
    return None


def example_value(schema: Any) -> Any:
    """A value ``schema`` (probably) accepts: the probes' starting point. Best effort: only the
    structural keywords are read; :func:`malformed_calls` keeps only what the schema rejects."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object" or (kind is None and "properties" in schema):
        props = _properties(schema)
        required = [r for r in schema.get("required", []) if r in props]
        return {name: example_value(props[name]) for name in required}
    if kind == "array":
        count = schema.get("minItems", 0) if isinstance(schema.get("minItems"), int) else 0
        return [example_value(schema.get("items", {})) for _ in range(count)]
    if kind == "string":
        size = schema.get("minLength", 1) if isinstance(schema.get("minLength"), int) else 1
        return "x" * max(size, 1)
    if kind in ("integer", "number"):
        low = schema.get("minimum", 0)
        return low if isinstance(low, int | float) and not isinstance(low, bool) else 0
    if kind == "boolean":
        return False
    return None


def _properties(schema: dict[str, Any]) -> dict[str, Any]:
    props = schema.get("properties")
    return props if isinstance(props, dict) else {}


def _wrong_type(schema: Any) -> Any:
    """A value of a JSON type ``schema`` does not name (a string, unless it takes strings)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kinds if isinstance(kinds, list) else [kinds])
    return {"not": "this"} if "string" in kinds else "corral: not the right type"


def malformed_calls(tool: ToolSpec) -> list[tuple[str, ToolCall]]:
    """The probes for ``tool``: ``(kind, call)``, each a call its schema rejects: arguments
    that are not an object, each required argument missing, each declared argument of a wrong
    type, an unknown argument. A candidate the schema accepts is dropped (an "unknown
    argument" is no mistake where ``additionalProperties`` allows it)."""
    schema = tool.parameters
    validator = schema_validator(schema)(schema)
    base = example_value(schema)
    base = base if isinstance(base, dict) else {}
    props = _properties(schema)
    candidates: list[tuple[str, Any]] = [("not an object", ["corral", "not an object"])]
    for name in schema.get("required", []) if isinstance(schema.get("required"), list) else []:
        candidates.append((f"missing {name!r}", {k: v for k, v in base.items() if k != name}))
    for name, sub in props.items():
        candidates.append((f"{name!r} of a wrong type", {**base, name: _wrong_type(sub)}))
    candidates.append(("an unknown argument", {**base, UNKNOWN_ARGUMENT: 1}))
    return [
        (kind, ToolCall(tool.name, args))
        for kind, args in candidates
        if not validator.is_valid(args)
    ]


# --- needles: hidden values and answers ---------------------------------------------------------


def _texts(value: Any) -> Iterator[str]:
    """The texts a value is searched for as (see the module docstring)."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, str):
        yield value
    elif isinstance(value, int | float):
        yield json.dumps(value)
    elif isinstance(value, list) and value and all(_scalar(v) for v in value):
        yield json.dumps(value)
        yield json.dumps(value, separators=(",", ":"))


def _scalar(value: Any) -> bool:
    return isinstance(value, int | float | str) and not isinstance(value, bool)


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(path, value)`` for every node that is searched for: scalars, and scalar arrays
    (which are not descended into: a schedule is one value, not 24)."""
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _leaves(sub, (*path, key))
    elif isinstance(value, list) and not list(_texts(value)):
        for i, sub in enumerate(value):
            yield from _leaves(sub, (*path, i))
    else:
        yield path, value


def _needles(values: Sequence[Any]) -> set[str]:
    return {t for v in values for t in _texts(v) if len(t) >= MIN_NEEDLE_CHARS}


def hidden_values(task: Task, view: Task) -> set[str]:
    """The texts of the task's data that the env's view drops or changes, less those the
    task's prompt states (what the prompt says is no secret)."""
    seen = dict(_leaves(view.data))
    hidden = _needles([v for p, v in _leaves(task.data) if p not in seen or seen[p] != v])
    return {t for t in hidden if t not in task.prompt}


def answer_values(solved: Mapping[str, Any], idle: Mapping[str, Any], prompt: str) -> set[str]:
    """The texts of the solver's final state that the do-nothing state lacks and the prompt
    does not state."""
    idle_texts = _needles([v for _, v in _leaves(dict(idle))])
    found = _needles([v for _, v in _leaves(dict(solved))])
    return {t for t in found if t not in idle_texts and t not in prompt}


def _short(text: str, limit: int = 60) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- judging ---------------------------------------------------------------------------------


def _splits(bundle: Bundle, settings: PlaySettings) -> list[str]:
    if settings.splits is None:
        return bundle.splits
    unknown = [s for s in settings.splits if s not in bundle.splits]
    if unknown:
        raise ValueError(
            f"no split(s) {unknown} in bundle {bundle.name!r} (splits: {bundle.splits})"
        )
    return list(settings.splits)


def _policies(bundle: Bundle) -> tuple[Policy | str, list[tuple[str, Policy | str]]]:
    """The solver and the baselines, each a function or why it could not be loaded."""

    def load(spec: EntryPoint) -> Policy | str:
        try:
            fn: Policy = bundle.entry_point(spec)
            return fn
        except Exception as exc:
            return f"{spec.module}:{spec.function} does not load: {type(exc).__name__}: {exc}"

    manifest = bundle.manifest
    solver: Policy | str = (
        load(manifest.solver)
        if manifest.solver is not None
        else "the bundle declares no [solver] (module, function) in bundle.toml"
    )
    return solver, [(b.name, load(b)) for b in manifest.baselines]


def _plan_with(policy: Policy | str, task: Task) -> list[ToolCall] | str:
    return policy if isinstance(policy, str) else _plan(policy, task)


def _list(items: Sequence[str], limit: int = 3) -> str:
    shown = "; ".join(items[:limit])
    return shown + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _check_solver(solver: PolicyResult, best: float) -> Check:
    bad = []
    for e in solver.episodes:
        if e.reward is None:
            bad.append(f"{e.task_id}: {e.error}")
        elif e.reward < best - REWARD_TOLERANCE:
            errors = f" ({e.tool_errors} of its calls got tool errors)" if e.tool_errors else ""
            bad.append(f"{e.task_id}: reward {e.reward:.3f} < {best:.3f}{errors}")
    n = len(solver.episodes)
    if bad:
        return Check(
            CHECK_SOLVER, False, f"{len(bad)}/{n} tasks short of the maximum: " + _list(bad)
        )
    low = min(solver.rewards)
    return Check(CHECK_SOLVER, True, f"{n}/{n} at max {best:.3f} (min {low:.3f})")


def _check_do_nothing(idle: PolicyResult, solver: PolicyResult, margin: float) -> Check:
    if idle.failed:
        reasons = [f"{e.task_id}: {e.error}" for e in idle.failed]
        return Check(CHECK_DO_NOTHING, False, "do-nothing episodes failed: " + _list(reasons))
    if solver.mean is None:
        return Check(CHECK_DO_NOTHING, False, "no solver reward to compare with")
    limit = solver.mean - margin
    numbers = f"do-nothing {idle.mean:.3f}, solver {solver.mean:.3f}, margin {margin:g}"
    if idle.mean is not None and idle.mean <= limit + REWARD_TOLERANCE:
        return Check(CHECK_DO_NOTHING, True, numbers)
    return Check(
        CHECK_DO_NOTHING, False, f"doing nothing scores too close to the solver: {numbers}"
    )


def _check_deterministic(first: PolicyResult, second: PolicyResult) -> Check:
    bad = []
    for a, b in zip(first.episodes, second.episodes, strict=True):
        if a.scores is None or b.scores is None:
            if (a.error is None) != (b.error is None):
                bad.append(f"{a.task_id}: one run failed ({a.error or b.error}), the other not")
            continue
        if a.scores != b.scores:
            keys = sorted(
                k for k in set(a.scores) | set(b.scores) if a.scores.get(k) != b.scores.get(k)
            )
            diffs = ", ".join(f"{k} {a.scores.get(k)} vs {b.scores.get(k)}" for k in keys)
            bad.append(f"{a.task_id}: scores differ between two runs ({diffs})")
    n = len(first.episodes)
    if bad:
        return Check(CHECK_DETERMINISTIC, False, _list(bad))
    graded = sum(e.scores is not None for e in first.episodes)
    return Check(CHECK_DETERMINISTIC, True, f"{graded}/{n} solver runs graded identically twice")


def _check_baselines(
    baselines: Sequence[PolicyResult], idle: PolicyResult, solver: PolicyResult
) -> Check:
    if not baselines:
        return Check(CHECK_BASELINES, True, "none declared")
    low, high = idle.mean, solver.mean
    bad, shown = [], []
    for b in baselines:
        shown.append(f"{b.name} {_fmt(b.mean)}")
        if b.failed:
            bad.append(f"{b.name}: " + _list([f"{e.task_id}: {e.error}" for e in b.failed], 2))
        elif low is None or high is None or b.mean is None:
            bad.append(f"{b.name}: nothing to compare with")
        elif not low - REWARD_TOLERANCE <= b.mean <= high + REWARD_TOLERANCE:
            bad.append(
                f"{b.name}: mean {b.mean:.3f} is not between do-nothing {low:.3f} "
                f"and solver {high:.3f}"
            )
    if bad:
        return Check(CHECK_BASELINES, False, _list(bad))
    return Check(
        CHECK_BASELINES, True, ", ".join(shown) + f" (between {_fmt(low)} and {_fmt(high)})"
    )


def _check_malformed(episodes: Sequence[ProbeEpisode], skipped: Sequence[str]) -> Check:
    bad = [problem for e in episodes for problem in e.problems]
    if bad:
        return Check(CHECK_MALFORMED, False, _list(bad))
    sent = sum(p.kind != "good call" for e in episodes for p in e.probes)
    tools = len(episodes)
    detail = f"{sent} malformed calls to {tools} tool(s) answered with tool errors"
    if skipped:
        detail += f" (not probed, invalid schema: {', '.join(skipped)})"
    return Check(CHECK_MALFORMED, True, detail)


def _find(needles: set[str], texts: Sequence[tuple[str, str]]) -> list[str]:
    """``"<needle> in <where>"`` for each needle found in a ``(where, text)``."""
    found = []
    for needle in sorted(needles):
        for where, text in texts:
            if needle in text:
                found.append(f"{_short(needle)!r} in {where}")
                break
    return found


@dataclass(frozen=True)
class _Secrets:
    """A split's hidden values and answers, per task, for the payload check too."""

    hidden: dict[str, set[str]]
    answers: dict[str, set[str]]


def _check_leaks(
    tasks: Sequence[Task],
    views: Mapping[str, Task | str],
    runs: Sequence[PolicyResult],
    idle: PolicyResult,
    solver: PolicyResult,
    probes: Mapping[str, Sequence[ProbeEpisode]],
) -> tuple[Check, _Secrets]:
    idle_by = {e.task_id: e for e in idle.episodes}
    solver_by = {e.task_id: e for e in solver.episodes}
    secrets = _Secrets({}, {})
    bad: list[str] = []
    searched = 0
    for task in tasks:
        view = views[task.id]
        hidden = hidden_values(task, view) if isinstance(view, Task) else set()
        solved, nothing = solver_by[task.id].state, idle_by[task.id].state
        answers = (
            answer_values(solved, nothing, task.prompt)
            if solved is not None and nothing is not None
            else set()
        )
        secrets.hidden[task.id], secrets.answers[task.id] = hidden, answers
        texts: list[tuple[str, str]] = []
        for run in runs:
            for e in run.episodes:
                if e.task_id == task.id and e.observations:
                    texts.append((f"the {run.name} episode's reset prompt", e.observations[0]))
        texts += [
            ("the do-nothing episode's end_turn reply", t)
            for t in idle_by[task.id].observations[1:]
        ]
        for probed in probes.get(task.id, ()):
            if probed.prompt is not None:
                texts.append((f"the {probed.tool} probe episode's reset prompt", probed.prompt))
            texts += [
                (f"the reply to {probed.tool} ({p.kind})", p.content)
                for p in probed.probes
                if p.content is not None
            ]
        # The tool results of the policies that act (the solver, the baselines): searched for
        # hidden values only. The env never gets those (its view drops them), so no tool
        # result may show one, whatever the call; an answer it may show (a policy that wrote
        # it reads it back, and the solver's results are its work towards it).
        results = [
            (f"the {run.name} episode's reply to call {i}", text)
            for run in runs
            if run is not idle
            for e in run.episodes
            if e.task_id == task.id
            for i, text in enumerate(e.observations[1:], 1)
        ]
        searched += len(texts) + len(results)
        bad += [f"{task.id}: hidden value {f}" for f in _find(hidden, texts + results)]
        bad += [f"{task.id}: answer {f}" for f in _find(answers, texts)]
    if bad:
        return Check(CHECK_LEAKS, False, _list(bad)), secrets
    counts = sum(map(len, secrets.hidden.values())), sum(map(len, secrets.answers.values()))
    detail = (
        f"{counts[0]} hidden and {counts[1]} answer value(s) absent from {searched} observations"
    )
    return Check(CHECK_LEAKS, True, detail), secrets


def _check_schemas(bundle: Bundle) -> Check:
    problems = [p for t in bundle.manifest.tools if (p := schema_problem(t)) is not None]
    if problems:
        return Check(CHECK_SCHEMAS, False, _list(problems))
    tools = bundle.manifest.tools
    return Check(CHECK_SCHEMAS, True, f"{len(tools)} tool schema(s) valid")


def _check_payload(bundle: Bundle, secrets: Sequence[_Secrets]) -> Check:
    manifest = bundle.manifest
    paths = bundle.payload_files()
    forbidden: dict[str, str] = {manifest.verifier.module: "the verifier"}
    for rel in manifest.verifier.modules or ():
        forbidden.setdefault(rel, "grading code")
    if manifest.solver is not None:
        forbidden[manifest.solver.module] = "the solver"
    for b in manifest.baselines:
        forbidden.setdefault(b.module, f"baseline {b.name}")
    for split, rel in manifest.splits.items():
        forbidden[Path(rel).as_posix()] = f"split {split}'s tasks"
    bad = [f"{p} ({forbidden[p]})" for p in paths if p in forbidden]
    needles: dict[str, str] = {}
    for s in secrets:
        for task_id, values in s.hidden.items():
            needles.update({v: f"{task_id}'s hidden value" for v in values})
        for task_id, values in s.answers.items():
            needles.update({v: f"{task_id}'s answer" for v in values})
    # Code names its vocabulary (a mode "literal", a family name): a bare word found there is
    # no leak, so only values with a digit, a space or a sign in them are searched for.
    needles = {n: what for n, what in needles.items() if not _BARE_WORD.match(n)}
    for rel in paths:
        try:
            text = (bundle.root / rel).read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        for needle, what in needles.items():
            if needle in text:
                bad.append(f"{rel} holds {what} {_short(needle)!r}")
    if bad:
        return Check(CHECK_PAYLOAD, False, "the sandbox payload holds " + _list(bad))
    return Check(
        CHECK_PAYLOAD,
        True,
        f"{len(paths)} file(s), none of them a verifier, solver, "
        "baseline or task file, nor holding hidden data or answers",
    )


async def play_check(
    bundle: Bundle,
    host: EnvHost,
    settings: PlaySettings | None = None,
    on_episode: Callable[[str], None] | None = None,
) -> PlayReport:
    """Play ``bundle`` through ``host`` (opened by the caller) and judge every check.

    ``on_episode`` is called after each episode with a label (for progress;
    :func:`planned_episodes` gives the total). Raises ``ValueError`` for a split ``settings``
    names that the bundle lacks or a split without tasks, and what ``Bundle.tasks`` raises for
    a bad tasks file; everything the bundle's code does wrong while playing is a failed check,
    not an exception.
    """
    settings = settings or PlaySettings()
    splits = _splits(bundle, settings)
    player = _Player(bundle, host, settings, on_episode)
    solver_fn, baseline_fns = _policies(bundle)
    best = max_reward(bundle.manifest.reward)
    schemas = _check_schemas(bundle)
    probe_tools = [t for t in bundle.manifest.tools if schema_problem(t) is None]
    skipped = [t.name for t in bundle.manifest.tools if schema_problem(t) is not None]
    reports: list[SplitReport] = []
    secrets: list[_Secrets] = []
    for split in splits:
        tasks = sample_tasks(bundle, split, settings.tasks, settings.seed)
        if not tasks:
            raise ValueError(f"split {split!r} of bundle {bundle.name!r} has no tasks")
        views = {t.id: env_view(bundle, t) for t in tasks}
        plans = {t.id: _plan_with(solver_fn, t) for t in tasks}
        solver = PolicyResult(
            SOLVER, tuple([await player.episode(SOLVER, t, plans[t.id]) for t in tasks])
        )
        again = PolicyResult(
            SOLVER, tuple([await player.episode(SOLVER, t, plans[t.id]) for t in tasks])
        )
        idle = PolicyResult(
            DO_NOTHING, tuple([await player.episode(DO_NOTHING, t, None) for t in tasks])
        )
        baselines = []
        for name, fn in baseline_fns:
            episodes = [await player.episode(name, t, _plan_with(fn, t)) for t in tasks]
            baselines.append(PolicyResult(name, tuple(episodes)))
        first = tasks[0]
        plan = plans[first.id]
        good = plan[0] if isinstance(plan, list) and plan else None
        probes = [await player.probes(tool, first, good) for tool in probe_tools]
        leaks, found = _check_leaks(
            tasks, views, [solver, idle, *baselines], idle, solver, {first.id: probes}
        )
        secrets.append(found)
        checks = (
            _check_solver(solver, best),
            _check_do_nothing(idle, solver, settings.margin),
            _check_deterministic(solver, again),
            leaks,
            _check_malformed(probes, skipped),
            _check_baselines(baselines, idle, solver),
        )
        reports.append(
            SplitReport(
                split, tuple(t.id for t in tasks), best, solver, idle, tuple(baselines), checks
            )
        )
    payload = _check_payload(bundle, secrets)
    return PlayReport(bundle.name, host.description, settings, (schemas, payload), tuple(reports))


async def play_check_hosted(
    bundle: Bundle,
    host: EnvHost,
    settings: PlaySettings | None = None,
    on_episode: Callable[[str], None] | None = None,
) -> PlayReport:
    """:func:`play_check` with ``host`` opened first and closed after, whatever happens."""
    await host.open()
    try:
        return await play_check(bundle, host, settings, on_episode)
    finally:
        await host.aclose()
