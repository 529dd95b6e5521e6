"""Env bundles: the folder format, its typed manifest, loading and validation.

A bundle is a folder::

    bundle.toml            the manifest (:class:`BundleManifest`)
    tasks/<split>.jsonl    one task per line: {"id", "prompt", "data"?, "tools"?}
    env.py                 the env class ([env] module + class), see corral.envs.episode
    verifier.py            the grading function ([verifier] module + function)

Two sides: the *env side* (the env module and the bundle modules it imports, or the declared
``[env] modules``) is all that enters a sandbox; everything else (the verifier and the
``[verifier] modules``, the ``[solver]`` and ``[[baselines]]``, the ``[env] task_data``
function, generators, task files) stays in the server's process. :func:`load_bundle` follows
the env side's imports statically (``ast``: relative imports, and absolute imports of the
bundle's own modules) and refuses a bundle whose env side reaches grading code or a module
outside its declared ``[env] modules``, naming the import chain. Imports it cannot see (an
``importlib`` call on a computed name) fail in the sandbox, where the module is absent.

The bundle folder is imported as a package of its own (a unique name per folder), so its
modules may import each other relatively (``from .market import simulate``); relative imports
resolve against the bundle folder. Importing a bundle runs its code in this process: load only
bundles you trust, or serve them in a sandbox.

:func:`load_bundle` checks the manifest, the files it names, the tool schemas and that the env
class and verifier import, and raises :class:`BundleError` listing every problem; it reads a
split's tasks lazily, on first use. :func:`validate_bundle` runs the same checks plus every task
line of every split and returns the problems as a list (empty when the bundle is sound). Every
problem names the file it is about, relative to the bundle folder, with a line where there is one.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import posixpath
import re
import sys
import threading
import tomllib
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from corral.envs.episode import END_TURN_TOOL, Env, Task
from corral.envs.importing import bundle_package, import_file, package_name
from corral.envs.protocol import McpTool

MANIFEST = "bundle.toml"
# OpenAI's function-name rule, so every tool can be offered to any OpenAI-style client.
_TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
_SIMPLE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})


class BundleError(Exception):
    """A bundle that cannot be used; ``problems`` lists every reason found, each naming a file."""

    def __init__(self, root: Path | str, problems: Sequence[str]) -> None:
        self.root = str(root)
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"bundle {self.root}: {len(self.problems)} problem(s):\n{lines}")


class TaskNotFound(LookupError):
    """No task at that split / index / id (the server answers it as a client error)."""


class VerifierError(Exception):
    """The verifier raised, or returned something other than named finite scores."""


class TaskDataError(Exception):
    """The ``[env] task_data`` function raised, or returned something other than a JSON object."""


class RewardError(ValueError):
    """The scores lack a name the ``[reward]`` table combines, or hold a non-finite value."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolSpec(_Model):
    """One tool the env offers: ``parameters`` is the JSON schema of its argument object."""

    name: str = Field(pattern=_TOOL_NAME)
    description: str
    parameters: dict[str, Any]

    def mcp(self) -> McpTool:
        """The tool as the env server lists it (MCP's shape; ``.openai()`` gives OpenAI's)."""
        return McpTool(name=self.name, description=self.description, input_schema=self.parameters)


class SandboxNeeds(_Model):
    """``[sandbox]``: what the env code needs from where it runs.

    ``needs = "none"``: plain Python, safe to run in the server's own process (it may still be
    served in a sandbox). ``needs = "process"``: the env runs commands or touches files on the
    model's behalf, so it must be served in a sandbox (``corral serve --sandbox ...``). The
    limits apply to each episode's sandbox; ``None`` leaves the backend's default.
    """

    needs: Literal["none", "process"] = "none"
    network: Literal["none", "loopback"] = "none"
    memory_mb: int | None = Field(default=None, ge=16)
    cpus: float | None = Field(default=None, gt=0)
    pids: int | None = Field(default=None, ge=8)
    disk_mb: int | None = Field(default=None, ge=1)
    image: str | None = None  # the container image / template the env needs


_ENTRY_POINT = r"^[^:]+\.py:[A-Za-z_]\w*$"


class EnvSpec(_Model):
    """``[env]``: the env class, what ships with it into a sandbox, and what data it sees.

    ``modules``: the bundle paths (files or folders) the env needs at run time, the env module
    among them; only these enter a sandbox. ``None``: the env module and the bundle modules it
    imports, transitively. ``task_data``: ``"module.py:function"``, a function run in the
    server's process that maps a :class:`~corral.envs.episode.Task` to the ``data`` the env's
    ``reset`` receives (so hidden task data, such as a seed the answers derive from, stays
    out of the sandbox); ``None``: the task's own ``data``. Its module is server side, so the
    env may not import it, unless ``modules`` lists it (then it ships, and may not import
    grading code itself).
    """

    module: str = "env.py"
    class_name: str = Field(alias="class", pattern=r"^[A-Za-z_]\w*$")
    modules: tuple[str, ...] | None = None
    task_data: str | None = Field(default=None, pattern=_ENTRY_POINT)


class EntryPoint(_Model):
    """A function of the bundle: ``module`` (a ``.py`` path in the bundle) and ``function``."""

    module: str
    function: str = Field(pattern=r"^[A-Za-z_]\w*$")


class BaselineSpec(EntryPoint):
    """``[[baselines]]``: a named policy of the solver's shape, reported beside it."""

    name: str = Field(pattern=_SIMPLE_NAME)


class LimitsSpec(_Model):
    """``[limits]``: bounds the server enforces per episode. ``max_call_bytes``: one tool
    call's arguments; ``max_state_bytes``: the env's state; both as compact JSON, counted in
    UTF-8 bytes (non-ASCII characters unescaped)."""

    max_call_bytes: int = Field(default=64 * 1024, ge=256)
    max_state_bytes: int = Field(default=4 * 2**20, ge=1024)


class VerifierSpec(_Model):
    """``[verifier]``: the grading function (``module`` + ``function``) and ``modules``, the
    grading-only bundle modules (``None``: the verifier module alone). The env side may import
    none of them: they never enter a sandbox."""

    module: str = "verifier.py"
    function: str = Field(default="grade", pattern=r"^[A-Za-z_]\w*$")
    modules: tuple[str, ...] | None = None

    def grading_modules(self) -> tuple[str, ...]:
        """The verifier module, then the ``modules`` entries (each once)."""
        extra = [m for m in self.modules or () if _norm(m) != _norm(self.module)]
        return (self.module, *dict.fromkeys(extra))


class RewardSpec(_Model):
    """How named scores become one reward: take one (``score``) or a weighted sum (``weights``)."""

    score: str | None = None
    weights: dict[str, float] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> RewardSpec:
        if (self.score is None) == (self.weights is None):
            raise ValueError('set exactly one of "score" (a score name) or "weights" (a table)')
        if self.weights is not None:
            if not self.weights:
                raise ValueError('"weights" is empty')
            if not all(math.isfinite(w) for w in self.weights.values()):
                raise ValueError('"weights" must be finite numbers')
        return self

    def combine(self, scores: Mapping[str, float]) -> float:
        """The reward for ``scores``; raises :class:`RewardError` for a missing or bad score."""
        names = [self.score] if self.score is not None else list(self.weights or {})
        missing = [n for n in names if n not in scores]
        if missing:
            raise RewardError(
                f"[reward] needs score(s) {missing}, the verifier returned {sorted(scores)}"
            )
        if self.score is not None:
            value = float(scores[self.score])
        else:
            value = sum(w * float(scores[n]) for n, w in (self.weights or {}).items())
        if not math.isfinite(value):
            raise RewardError(f"reward is not finite ({value}) for scores {dict(scores)}")
        return value


class EvalSpec(_Model):
    """``[eval]``: how evals break a split's mean down. ``group_by``: a dotted path into each
    task's ``data`` (e.g. ``"battery.capacity_mwh"``) whose value names the task's group."""

    group_by: str | None = Field(default=None, pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class AgentSpec(_Model):
    """``[agent]``: what a black-box agent (a harness: Claude Code, Codex, any command) needs to
    play the bundle's tasks in the episode's sandbox, in the task's working folder. A bundle
    without it is not playable by harness agents (the server refuses the ``agent`` frame).

    ``instructions``: text the agent gets besides the task's prompt (the system prompt speaks
    of the bundle's tools, which a harness agent does not have): where the task's files are,
    where to write, that it ends by exiting. ``finish_tool``: a tool of the bundle called with
    ``{}`` to end the episode after the agent exits (``None``: ``end_turn`` until it ends).
    """

    instructions: str = Field(min_length=1)
    finish_tool: str | None = Field(default=None, pattern=_TOOL_NAME)


class BundleManifest(_Model):
    """``bundle.toml``, validated. Paths in it are relative to the bundle folder."""

    name: str = Field(pattern=_SIMPLE_NAME)
    version: str = Field(min_length=1)
    description: str = ""
    system_prompt: str
    max_turns: int = Field(ge=1)
    splits: dict[str, str] = Field(min_length=1)
    sandbox: SandboxNeeds = SandboxNeeds()
    env: EnvSpec
    verifier: VerifierSpec = VerifierSpec()
    reward: RewardSpec
    tools: list[ToolSpec] = Field(default_factory=list)
    eval: EvalSpec = EvalSpec()
    # ``[solver]``: the reference solver, ``(task) -> [{"name", "arguments"}, ...]``, the tool
    # calls that solve the task (``corral bundle validate --play`` checks it reaches the
    # maximum reward); ``[[baselines]]``: more policies of that shape, reported beside it.
    solver: EntryPoint | None = None
    baselines: tuple[BaselineSpec, ...] = ()
    limits: LimitsSpec = LimitsSpec()
    agent: AgentSpec | None = None


class _TaskLine(_Model):
    """One line of a tasks file: split and index come from where the line sits."""

    id: str = Field(min_length=1)
    prompt: str
    data: dict[str, Any] = Field(default_factory=dict)
    tools: list[str] | None = None


@dataclass(frozen=True)
class _Checked:
    """What the shallow checks produced: all fields set only when ``problems`` is empty."""

    problems: list[str]
    manifest: BundleManifest | None = None
    env_class: type | None = None
    verifier: Callable[..., Any] | None = None
    payload: tuple[str, ...] = ()
    task_data: Callable[..., Any] | None = None


class Bundle:
    """A loaded bundle: its manifest, tasks (read per split on first use), env and verifier.

    Thread-safe: task files are read under a lock, and everything else is immutable.
    """

    def __init__(
        self,
        root: Path,
        manifest: BundleManifest,
        env_class: type,
        verifier: Callable[..., Any],
        *,
        payload: Sequence[str] = (),
        task_data: Callable[..., Any] | None = None,
    ) -> None:
        self.root = root
        self.manifest = manifest
        self.env_class = env_class
        self._verifier = verifier
        self._payload = tuple(payload)
        self._task_data = task_data
        self._tasks: dict[str, list[Task]] = {}
        self._by_id: dict[str, Task] | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def splits(self) -> list[str]:
        return list(self.manifest.splits)

    def tasks(self, split: str) -> list[Task]:
        """Every task of ``split``, in file order (a copy of the list).

        Raises :class:`TaskNotFound` for an unknown split and :class:`BundleError` when the
        split's file has a bad line (all of that file's problems listed).
        """
        return list(self._split(split))

    def task(self, split: str, index: int) -> Task:
        """The task at ``index`` of ``split``; :class:`TaskNotFound` when there is none."""
        tasks = self._split(split)
        if not 0 <= index < len(tasks):
            raise TaskNotFound(f"split {split!r} has {len(tasks)} tasks, no index {index}")
        return tasks[index]

    def task_by_id(self, task_id: str) -> Task:
        """The task with this id in any split (reads every split once); else TaskNotFound."""
        if self._by_id is None:
            by_id: dict[str, Task] = {}
            for split in self.splits:
                for task in self._split(split):
                    if task.id in by_id:
                        raise BundleError(self.root, [f"duplicate task id {task.id!r}"])
                    by_id[task.id] = task
            self._by_id = by_id
        try:
            return self._by_id[task_id]
        except KeyError:
            raise TaskNotFound(f"no task with id {task_id!r}") from None

    def tools_for(self, task: Task) -> list[ToolSpec]:
        """The tools ``task`` offers, in manifest order (``end_turn`` is the server's to add)."""
        if task.tools is None:
            return list(self.manifest.tools)
        wanted = set(task.tools)
        return [t for t in self.manifest.tools if t.name in wanted]

    def payload_files(self) -> list[str]:
        """The bundle-relative paths of the files that enter a sandbox ("/"-separated, sorted):
        the declared ``[env] modules`` (folders expanded), else the env module and the bundle
        modules it imports, transitively. Never a task file or grading code (load refuses)."""
        return list(self._payload)

    def env_task(self, task: Task) -> Task:
        """The task as the env's ``reset`` receives it: ``data`` replaced by what the
        ``[env] task_data`` function returns for ``task`` (run here, in the server's process),
        or ``task`` itself when the bundle declares none.

        Raises :class:`TaskDataError` when the function raises or returns anything but a JSON
        object: the episode cannot start, and the message says why.
        """
        if self._task_data is None:
            return task
        where = self.manifest.env.task_data
        try:
            data = self._task_data(task)
        except Exception as exc:
            raise TaskDataError(
                f"[env] task_data {where} raised {type(exc).__name__}: {exc} (task {task.id!r})"
            ) from exc
        if not isinstance(data, dict):
            raise TaskDataError(
                f"[env] task_data {where} returned {type(data).__name__}, not a JSON object"
            )
        try:
            json.dumps(data, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TaskDataError(
                f"[env] task_data {where} returned data that is not JSON: {exc}"
            ) from exc
        return dataclasses.replace(task, data=data)

    def entry_point(self, spec: EntryPoint) -> Callable[..., Any]:
        """The bundle function ``spec`` names (the solver, a baseline), imported in this
        process. Raises :class:`BundleError` naming the file when the module is missing, does
        not import, or defines no such callable."""
        problems: list[str] = []
        module = _import_module(self.root, self._package(), spec.module, spec.module, problems)
        if module is None:
            raise BundleError(self.root, problems)
        fn = getattr(module, spec.function, None)
        if not callable(fn):
            raise BundleError(self.root, [f"{spec.module}: defines no callable {spec.function!r}"])
        return fn

    def _package(self) -> str:
        """The bundle's package, created on first need (loading made it; a test may not)."""
        name = package_name(self.root, self.manifest.name)
        return name if name in sys.modules else bundle_package(self.root, self.manifest.name)

    def make_env(self) -> Env:
        """A fresh env for one episode (the env class called with no arguments).

        Whatever the env's constructor raises propagates: that is a bug in the bundle.
        """
        env: Env = self.env_class()
        return env

    def grade(self, task: Task, state: dict[str, Any]) -> dict[str, float]:
        """Run the verifier on an episode's final state.

        Returns the named scores as floats. Raises :class:`VerifierError` when the verifier
        raises or returns anything but a mapping of names to finite numbers: a crashing
        verifier must surface as a failed episode, never as a silent 0.
        """
        try:
            raw = self._verifier(task, state)
        except Exception as exc:
            raise VerifierError(f"verifier raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(raw, Mapping):
            raise VerifierError(f"verifier returned {type(raw).__name__}, not a dict of scores")
        scores: dict[str, float] = {}
        for key, value in raw.items():
            if not isinstance(key, str) or not isinstance(value, int | float):
                raise VerifierError(f"verifier returned a bad score {key!r}: {value!r}")
            if not math.isfinite(value):
                raise VerifierError(f"verifier returned a non-finite score {key!r}: {value}")
            scores[key] = float(value)
        return scores

    def reward(self, scores: Mapping[str, float]) -> float:
        """Combine named scores per ``[reward]``; :class:`RewardError` if one is missing."""
        return self.manifest.reward.combine(scores)

    def _split(self, split: str) -> list[Task]:
        """The split's cached tasks (read on first use); shared: callers must not mutate it."""
        if split not in self.manifest.splits:
            raise TaskNotFound(f"no split {split!r} (splits: {self.splits})")
        with self._lock:
            if split not in self._tasks:
                rel = self.manifest.splits[split]
                lines, problems = _read_tasks(self.root, split, rel, self._tool_names())
                if problems:
                    raise BundleError(self.root, problems)
                self._tasks[split] = [task for _, task in lines]
            return self._tasks[split]

    def _tool_names(self) -> set[str]:
        return {t.name for t in self.manifest.tools}


def load_bundle(path: Path | str) -> Bundle:
    """Load the bundle at ``path`` (tasks are read lazily, per split, on first use).

    Raises :class:`BundleError` listing every problem the shallow checks find: the manifest,
    the files it names, tool schemas, the env class and verifier imports. Task lines are not
    read here: :func:`validate_bundle` checks them, and :meth:`Bundle.tasks` raises on them.
    """
    root = Path(path)
    checked = _check(root)
    if checked.problems:
        raise BundleError(root, checked.problems)
    assert checked.manifest and checked.env_class and checked.verifier  # set when no problems
    return Bundle(
        root.resolve(),
        checked.manifest,
        checked.env_class,
        checked.verifier,
        payload=checked.payload,
        task_data=checked.task_data,
    )


def validate_bundle(path: Path | str) -> list[str]:
    """Every problem with the bundle at ``path``, each explained and naming its file.

    Runs :func:`load_bundle`'s checks plus every line of every split's tasks file (JSON, the
    fields, unknown tools, duplicate ids across splits). An empty list means the bundle loads
    and every task is well-formed. Never raises for a broken bundle; imports its code.
    """
    root = Path(path)
    checked = _check(root)
    problems = list(checked.problems)
    manifest = checked.manifest
    if manifest is None:
        return problems
    # The solver and baselines import lazily (the play validator runs them); their files must
    # exist, though, for a bundle that names them.
    lazy = [("solver", manifest.solver)] if manifest.solver else []
    lazy += [(f"baselines.{b.name}", b) for b in manifest.baselines]
    for key, spec in lazy:
        problems.extend(_file_problems(root, spec.module, f"{key}.module"))
    tool_names = {t.name for t in manifest.tools}
    first_seen: dict[str, str] = {}
    for split, rel in manifest.splits.items():
        if not _inside(root, rel) or not (root / rel).is_file():
            continue  # already reported by _check
        lines, task_problems = _read_tasks(root, split, rel, tool_names)
        problems.extend(task_problems)
        for lineno, task in lines:
            where = f"{rel}:{lineno}"
            if task.id in first_seen:
                problems.append(
                    f"{where}: duplicate task id {task.id!r} (first at {first_seen[task.id]})"
                )
            else:
                first_seen[task.id] = where
        if not lines and not task_problems:
            problems.append(f"{rel}: split {split!r} has no tasks")
    return problems


def parameters_problems(schema: Any) -> list[str]:
    """What is wrong with a tool's ``parameters`` as a JSON schema of an argument object.

    Checks the top level is ``{"type": "object", "properties": {...}}`` and, recursively, the
    structural keywords (``type``, ``properties``, ``items``, ``required``, ``enum``,
    ``anyOf``/``oneOf``/``allOf``). Not a full meta-schema check: unknown keywords pass.
    """
    if not isinstance(schema, dict):
        return [f"must be a JSON schema object (a table), not {type(schema).__name__}"]
    problems: list[str] = []
    if schema.get("type") != "object":
        got = schema.get("type")
        problems.append(f'"type" must be "object" (tool arguments are a JSON object), got {got!r}')
    if not isinstance(schema.get("properties"), dict):
        problems.append('"properties" must be a table mapping each argument to its schema')
    problems.extend(_subschema_problems(schema, "parameters"))
    return problems


def _subschema_problems(schema: Any, where: str) -> list[str]:
    if isinstance(schema, bool):
        return []  # true / false are valid schemas
    if not isinstance(schema, dict):
        return [f"{where}: a schema must be an object, not {type(schema).__name__}"]
    problems: list[str] = []
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        bad = [k for k in kinds if k not in _JSON_TYPES]
        if bad or not kinds:
            problems.append(f"{where}.type: {kind!r} is not a JSON type ({sorted(_JSON_TYPES)})")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            problems.append(f"{where}.properties: must be an object")
        else:
            for name, sub in props.items():
                problems.extend(_subschema_problems(sub, f"{where}.properties.{name}"))
    required = schema.get("required")
    if required is not None:
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            problems.append(f"{where}.required: must be a list of property names")
        elif isinstance(props, dict):
            unknown = [r for r in required if r not in props]
            if unknown:
                problems.append(f"{where}.required: names no property {unknown}")
    if "items" in schema:
        problems.extend(_subschema_problems(schema["items"], f"{where}.items"))
    enum = schema.get("enum")
    if enum is not None and (not isinstance(enum, list) or not enum):
        problems.append(f"{where}.enum: must be a non-empty list")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            subs = schema[key]
            if not isinstance(subs, list) or not subs:
                problems.append(f"{where}.{key}: must be a non-empty list of schemas")
            else:
                for i, sub in enumerate(subs):
                    problems.extend(_subschema_problems(sub, f"{where}.{key}[{i}]"))
    return problems


def _check(root: Path) -> _Checked:
    """The shallow checks: manifest, named files, tool schemas, env and verifier imports."""
    if not root.is_dir():
        return _Checked([f"{root}: not a directory (a bundle is a folder with {MANIFEST})"])
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        return _Checked([f"{MANIFEST}: missing (every bundle folder needs one)"])
    try:
        with manifest_path.open("rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        return _Checked([f"{MANIFEST}: not valid TOML: {exc}"])
    try:
        manifest = BundleManifest.model_validate(raw)
    except ValidationError as exc:
        return _Checked([f"{MANIFEST}: {m}" for m in _validation_messages(exc, raw)])

    problems: list[str] = []
    seen_tools: set[str] = set()
    for i, tool in enumerate(manifest.tools):
        where = f"{MANIFEST}: tools[{i}] ({tool.name})"
        if tool.name == END_TURN_TOOL:
            problems.append(f"{where}: {END_TURN_TOOL!r} is reserved (the server provides it)")
        if tool.name in seen_tools:
            problems.append(f"{where}: duplicate tool name")
        seen_tools.add(tool.name)
        problems.extend(f"{where}: parameters: {p}" for p in parameters_problems(tool.parameters))
    finish = manifest.agent.finish_tool if manifest.agent is not None else None
    if finish is not None and finish not in seen_tools:
        problems.append(
            f"{MANIFEST}: agent.finish_tool: {finish!r} is not one of the bundle's tools "
            f"{sorted(seen_tools)}"
        )
    for split, rel in manifest.splits.items():
        if not re.match(_SIMPLE_NAME, split):
            problems.append(f"{MANIFEST}: splits: bad split name {split!r}")
        problems.extend(_file_problems(root, rel, f"splits.{split}"))

    for i, rel in enumerate(manifest.verifier.modules or ()):
        problems.extend(_path_problems(root, rel, f"verifier.modules[{i}]"))
    payload = _env_side(root, manifest, problems)

    package = bundle_package(root, manifest.name)
    env_class = _load_env_class(root, package, manifest.env, problems)
    verifier = _load_verifier(root, package, manifest.verifier, problems)
    task_data = _load_task_data(root, package, manifest.env, problems)
    if problems:
        return _Checked(problems, manifest)
    return _Checked([], manifest, env_class, verifier, payload, task_data)


def _norm(rel: str) -> str:
    """A bundle-relative path in one spelling ("./a//b.py" and "a/b.py" are one module)."""
    return posixpath.normpath(rel.replace("\\", "/"))


def _path_problems(root: Path, rel: str, key: str) -> list[str]:
    """Like :func:`_file_problems`, but a folder is fine too."""
    if not _inside(root, rel):
        return [f"{MANIFEST}: {key}: {rel!r} must be a relative path inside the bundle folder"]
    if not (root / rel).exists():
        return [f"{rel}: missing (named by {MANIFEST} {key})"]
    return []


def _expand(root: Path, rel: str) -> list[str]:
    """The files a declared ``[env] modules`` entry stands for (a folder: every file in it,
    bytecode caches left out), bundle-relative."""
    path = root / rel
    if path.is_file():
        return [_norm(rel)]
    found = []
    for p in sorted(path.rglob("*")):
        if p.is_file() and "__pycache__" not in p.relative_to(root).parts:
            found.append(p.relative_to(root).as_posix())
    return found


def _grading_roles(manifest: BundleManifest, env_side: set[str]) -> dict[str, str]:
    """Bundle module -> what makes it grading code (the env side may not import it)."""
    roles: dict[str, str] = {}
    verifier = manifest.verifier
    roles[_norm(verifier.module)] = "the [verifier] module"
    for rel in verifier.grading_modules()[1:]:
        roles.setdefault(_norm(rel), "a [verifier] modules entry (grading only)")
    if manifest.solver is not None:
        roles.setdefault(_norm(manifest.solver.module), "the [solver] module")
    for b in manifest.baselines:
        roles.setdefault(_norm(b.module), f"the [[baselines]] {b.name!r} module")
    if manifest.env.task_data is not None:
        rel = _norm(manifest.env.task_data.split(":", 1)[0])
        if rel not in env_side:  # a server-side function: it may import grading code
            roles.setdefault(rel, "the [env] task_data module (server side)")
    return roles


def _env_side(root: Path, manifest: BundleManifest, problems: list[str]) -> tuple[str, ...]:
    """The payload files (see :meth:`Bundle.payload_files`); appends to ``problems`` every
    declared path that is missing, every grading or task file on the env side, and every
    import of the env side that reaches grading code or leaves the declared modules."""
    env = manifest.env
    declared: list[str] | None = None
    if env.modules is not None:
        declared = []
        for i, rel in enumerate(env.modules):
            found = _path_problems(root, rel, f"env.modules[{i}]")
            problems.extend(found)
            if not found:
                declared.extend(_expand(root, rel))
        declared = sorted(set(declared))
        if _norm(env.module) not in declared and _inside(root, env.module):
            problems.append(
                f"{MANIFEST}: env.modules: does not include the env module {env.module!r}"
            )
    env_module = _norm(env.module)
    starts = [env_module] + [p for p in declared or () if p.endswith(".py")]
    chains = _import_chains(root, starts)
    payload = set(declared) if declared is not None else set(chains)
    # The task_data module is env side only when declared so: undeclared, it is the server's
    # (it holds what builds the hidden data), and the env importing it is refused.
    roles = _grading_roles(manifest, set(declared or ()))
    splits = {_norm(rel) for rel in manifest.splits.values()}
    for rel in declared or ():
        if rel in roles:
            problems.append(
                f"{MANIFEST}: env.modules: {rel} is {roles[rel]}: grading code never enters "
                "the sandbox"
            )
        elif rel in splits:
            problems.append(f"{MANIFEST}: env.modules: {rel} is a task file: tasks stay outside")
    if env_module in roles and env_module not in (declared or ()):
        problems.append(
            f"{MANIFEST}: env.module: {env_module} is also {roles[env_module]}: grading code "
            "never enters the sandbox (keep the grading functions in a module of their own)"
        )
    for rel, chain in chains.items():
        path = " -> ".join(chain)
        if len(chain) == 1:
            continue  # a start: the env module or a declared module, checked above
        if rel in roles:
            problems.append(
                f"{chain[0]}: the env side imports grading code: {path} ({rel} is {roles[rel]}; "
                "the env must not reach it, it stays out of the sandbox)"
            )
        elif declared is not None and rel not in payload:
            problems.append(
                f"{chain[0]}: the env side imports a module outside [env] modules: {path} "
                f"(add {rel} to [env] modules, or the import fails in the sandbox)"
            )
    return tuple(sorted(payload))


def _import_chains(root: Path, starts: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Every bundle module reachable from ``starts`` by import -> the shortest import chain
    to it (breadth first), the starts included (their chain is themselves)."""
    chains: dict[str, tuple[str, ...]] = {}
    queue: list[str] = []
    for rel in starts:
        if rel not in chains and (root / rel).is_file():
            chains[rel] = (rel,)
            queue.append(rel)
    while queue:
        rel = queue.pop(0)
        for target in _bundle_imports(root, rel):
            if target not in chains:
                chains[target] = (*chains[rel], target)
                queue.append(target)
    return chains


def _bundle_imports(root: Path, rel: str) -> list[str]:
    """The bundle modules that the module file ``rel`` imports anywhere in its code (function
    bodies too): relative imports, and absolute ones whose first name is a bundle module.
    A file that does not parse imports nothing here (its import check reports it)."""
    try:
        tree = ast.parse((root / rel).read_bytes(), filename=rel)
    except (SyntaxError, ValueError, OSError):
        return []
    here = posixpath.dirname(rel)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.extend(_absolute(root, alias.name))
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names if a.name != "*"]
            if node.level == 0:
                if node.module:
                    found.extend(_absolute(root, node.module, names))
                continue
            base = here
            for _ in range(node.level - 1):
                if not base:
                    break  # above the bundle folder: not the bundle's (the import fails)
                base = posixpath.dirname(base)
            else:
                found.extend(_resolve(root, base, node.module, names))
    return list(dict.fromkeys(found))


def _absolute(root: Path, dotted: str, names: Sequence[str] = ()) -> list[str]:
    top = dotted.split(".", 1)[0]
    if not ((root / f"{top}.py").is_file() or (root / top / "__init__.py").is_file()):
        return []
    return _resolve(root, "", dotted, names)


def _resolve(root: Path, base: str, dotted: str | None, names: Sequence[str]) -> list[str]:
    """The module files ``from <base>.<dotted> import <names>`` runs: each package's
    ``__init__.py`` on the way, the module, and the names that are submodules."""
    parts = dotted.split(".") if dotted else []
    found: list[str] = []
    folder = base
    for i, part in enumerate(parts):
        path = posixpath.join(folder, part) if folder else part
        last = i == len(parts) - 1
        if last and (root / f"{path}.py").is_file():
            found.append(f"{path}.py")
            return found  # a plain module: the names are its attributes
        init = f"{path}/__init__.py"
        if not (root / init).is_file():
            return found
        found.append(init)
        folder = path
    for name in names:
        path = posixpath.join(folder, name) if folder else name
        if (root / f"{path}.py").is_file():
            found.append(f"{path}.py")
        elif (root / path / "__init__.py").is_file():
            found.append(f"{path}/__init__.py")
    return found


def _load_task_data(
    root: Path, package: str, spec: EnvSpec, problems: list[str]
) -> Callable[..., Any] | None:
    """The ``[env] task_data`` function (server side), checked to take one argument."""
    if spec.task_data is None:
        return None
    rel, function = spec.task_data.split(":", 1)
    module = _import_module(root, package, rel, "env.task_data", problems)
    if module is None:
        return None
    fn = getattr(module, function, None)
    if not callable(fn):
        problems.append(f"{rel}: defines no callable {function!r} ([env] task_data)")
        return None
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        problems.append(f"{rel}: {function} must take (task) ([env] task_data)")
    except ValueError:
        pass
    return fn


def _file_problems(root: Path, rel: str, key: str) -> list[str]:
    if not _inside(root, rel):
        return [f"{MANIFEST}: {key}: {rel!r} must be a relative path inside the bundle folder"]
    if not (root / rel).is_file():
        return [f"{rel}: missing (named by {MANIFEST} {key})"]
    return []


def _inside(root: Path, rel: str) -> bool:
    if Path(rel).is_absolute():
        return False
    return (root / rel).resolve().is_relative_to(root.resolve())


def _load_env_class(root: Path, package: str, spec: EnvSpec, problems: list[str]) -> type | None:
    module = _import_module(root, package, spec.module, "env.module", problems)
    if module is None:
        return None
    cls = getattr(module, spec.class_name, None)
    if not isinstance(cls, type):
        problems.append(f"{spec.module}: defines no class {spec.class_name!r} ([env] class)")
        return None
    missing = [m for m in ("reset", "call_tool", "state") if not callable(getattr(cls, m, None))]
    if missing:
        problems.append(
            f"{spec.module}: class {spec.class_name} lacks {missing} (the Env protocol: "
            "reset(task), call_tool(name, arguments), state())"
        )
    try:
        inspect.signature(cls).bind()
    except TypeError:
        problems.append(f"{spec.module}: class {spec.class_name} must take no constructor args")
    except ValueError:
        pass  # no signature to inspect (a builtin base); the server finds out at make_env
    return cls


def _load_verifier(
    root: Path, package: str, spec: VerifierSpec, problems: list[str]
) -> Callable[..., Any] | None:
    module = _import_module(root, package, spec.module, "verifier.module", problems)
    if module is None:
        return None
    fn = getattr(module, spec.function, None)
    if not callable(fn):
        problems.append(f"{spec.module}: defines no callable {spec.function!r} ([verifier])")
        return None
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        problems.append(f"{spec.module}: {spec.function} must take (task, state)")
    except ValueError:
        pass
    return fn


def _import_module(
    root: Path, package: str, rel: str, key: str, problems: list[str]
) -> ModuleType | None:
    """Import ``rel`` from the bundle as a submodule of ``package``; report why not."""
    file_problems = _file_problems(root, rel, key)
    if file_problems:
        problems.extend(file_problems)
        return None
    if not rel.endswith(".py"):
        problems.append(f"{MANIFEST}: {key}: {rel!r} must be a .py file")
        return None
    try:
        return import_file(root, package, rel)
    except ImportError as exc:
        if str(exc).startswith(f"{rel}: cannot be imported"):
            problems.append(str(exc))
        else:
            problems.append(f"{rel}: does not import: {_describe_exception(exc, root)}")
    except Exception as exc:
        problems.append(f"{rel}: does not import: {_describe_exception(exc, root)}")
    return None


def _describe_exception(exc: BaseException, root: Path) -> str:
    """``Type: message (file:line)``, the line being the last frame inside the bundle."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({Path(exc.filename or '?').name}:{exc.lineno})"
    where = ""
    base = str(root.resolve())
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith(base):
            where = f" ({Path(frame.filename).relative_to(base)}:{frame.lineno})"
    return f"{type(exc).__name__}: {exc}{where}"


def _read_tasks(
    root: Path, split: str, rel: str, tool_names: set[str]
) -> tuple[list[tuple[int, Task]], list[str]]:
    """Parse one tasks file: the good tasks with their line numbers, a problem per bad line."""
    tasks: list[tuple[int, Task]] = []
    problems: list[str] = []
    index = 0
    try:
        text = (root / rel).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [], [f"{rel}: cannot be read: {exc}"]
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{rel}:{lineno}"
        this_index, index = index, index + 1
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: not JSON ({exc.msg} at column {exc.colno})")
            continue
        if not isinstance(raw, dict):
            problems.append(f"{where}: a task line must be a JSON object")
            continue
        try:
            record = _TaskLine.model_validate(raw)
        except ValidationError as exc:
            problems.extend(f"{where}: {m}" for m in _validation_messages(exc, raw))
            continue
        unknown = [t for t in record.tools or [] if t not in tool_names]
        if unknown:
            problems.append(
                f"{where}: task {record.id!r} references unknown tool(s) {unknown} "
                f"(the bundle defines {sorted(tool_names)})"
            )
            continue
        tasks.append((lineno, Task(split=split, index=this_index, **record.model_dump())))
    return tasks, problems


def _validation_messages(exc: ValidationError, raw: Any) -> list[str]:
    """One message per pydantic error: the dotted location (tools named), what is wrong."""
    messages = []
    for error in exc.errors():
        parts: list[str] = []
        node = raw
        for key in error["loc"]:
            if isinstance(key, int):
                parts[-1:] = [f"{parts[-1] if parts else ''}[{key}]"]
            else:
                parts.append(str(key))
            node = _child(node, key)
            named = isinstance(node, dict) and isinstance(node.get("name"), str)
            if named and isinstance(key, int) and isinstance(node, dict):
                parts[-1] += f" ({node['name']})"  # "tools[1] (simulate)" beats "tools[1]"
        loc = ".".join(parts) or "(top level)"
        msg = error["msg"]
        if error["type"] == "extra_forbidden":
            msg = "unknown field (not part of the format)"
        elif error["type"] == "missing":
            msg = "required field missing"
        messages.append(f"{loc}: {msg}")
    return messages


def _child(node: Any, key: str | int) -> Any:
    """``node[key]`` when it exists, else None (error locations may point past the data)."""
    if isinstance(node, dict):
        return node.get(key)
    if isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
        return node[key]
    return None
