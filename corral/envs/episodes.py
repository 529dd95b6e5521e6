"""Episodes and their manager: the env server's logic, apart from HTTP and WebSocket.

:class:`Episode` is one env's life (reset, tool calls, turns, grading); :class:`EpisodeManager`
holds every live episode of a server (capacity, idle reaping, shutdown). Both are plain classes
that tests drive directly; :mod:`corral.envs.websocket` turns socket messages into their calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from corral.envs.agent_bridge import AgentRefused
from corral.envs.bundle import Bundle, RewardError, TaskNotFound, VerifierError
from corral.envs.episode import END_TURN_TOOL, Task
from corral.envs.hosting import (
    AgentUnsupported,
    EnvFailure,
    EnvHandle,
    EnvHost,
    InProcessHost,
)
from corral.envs.protocol import (
    EPISODE_ENDING_TOOL_ERRORS,
    AgentLaunch,
    AgentResult,
    AgentRun,
    CallToolAction,
    CallToolObservation,
    EpisodeState,
    ErrorCode,
    ListToolsObservation,
    McpTool,
    Reason,
    ResetData,
    ResetObservation,
    StepResult,
    ToolError,
    ToolErrorType,
    ToolResult,
)

END_TURN_MCP = McpTool(
    name=END_TURN_TOOL,
    description="End your turn, with your answer for this turn.",
    input_schema={
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "Your answer."}},
    },
)
# WebSocket close code on shutdown (RFC 6455: going away).
GOING_AWAY = 1001
SHUTDOWN_REASON = "the env server is shutting down; the episode is over"


# Episodes a server keeps alive at once unless told otherwise.
DEFAULT_MAX_CONCURRENT_ENVS = 64
# Beyond its calls' deadlines, what a step may spend releasing a failed env (a container's
# removal): how much longer a client's close waits for it.
RELEASE_ALLOWANCE_S = 10.0
# Beyond an agent's budget and kill grace, what its run may take to start (the launcher, its
# files) and wind down before the server gives up on it and fails the episode.
AGENT_RUN_SLACK_S = 60.0


class ServerError(Exception):
    """A request the server refuses: becomes an ``error`` reply with ``code``, ``reason`` and
    ``extra`` (ErrorData's optional fields)."""

    def __init__(
        self, code: ErrorCode, message: str, reason: Reason | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        if code == ErrorCode.VALIDATION_ERROR and "errors" not in extra:
            # OpenEnv's VALIDATION_ERROR always lists what was wrong.
            extra["errors"] = [{"loc": [], "msg": message, "type": reason or "invalid"}]
        self.extra = extra


class _EnvBroke(Exception):
    """The env overran its deadline, raised or died: the episode is over (internal)."""

    def __init__(self, error_type: ToolErrorType, message: str) -> None:
        super().__init__(message)
        self.error_type = error_type


# Combines the verifier's named scores into the episode's reward (``build_app(reward=...)``
# overrides the bundle's ``[reward]``); whatever it raises flags the episode, never a 0.
RewardFn = Callable[[dict[str, float]], float]


def bundle_tools(bundle: Bundle, task: Task | None = None) -> list[McpTool]:
    """The tools (``task``'s, or every tool of the bundle) in MCP's shape, ``end_turn`` last
    (the server provides it)."""
    specs = bundle.tools_for(task) if task is not None else bundle.manifest.tools
    return [t.mcp() for t in specs] + [END_TURN_MCP]


def task_tools(bundle: Bundle, task: Task) -> list[dict[str, Any]]:
    """The task's tools in OpenAI's schema, ``end_turn`` last (the task API serves these)."""
    return [t.openai() for t in bundle_tools(bundle, task)]


def json_size(value: Any) -> int | None:
    """``value``'s size in bytes as compact JSON text in UTF-8 (non-ASCII characters as
    themselves, not ``\\u`` escapes: what ``max_call_bytes`` and ``max_state_bytes`` count), or
    None when it is not JSON data."""
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return None
    # A lone surrogate has no UTF-8 form; counted as the 3 bytes it would take, not refused.
    return len(text.encode("utf-8", "surrogatepass"))


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (one per app, no globals)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.active = Gauge("corral_env_active_episodes", "Live episodes", registry=self.registry)
        self.waiting = Gauge(
            "corral_env_waiting_resets", "Resets waiting for capacity", registry=self.registry
        )
        self.episodes = Counter(
            "corral_env_episodes", "Episodes ended, by how", ["status"], registry=self.registry
        )
        self.steps = Counter("corral_env_steps", "Tool calls", ["outcome"], registry=self.registry)
        self.step_seconds = Histogram(
            "corral_env_step_seconds", "Tool call latency in the server", registry=self.registry
        )


class Episode:
    """One env playing one task. Not thread-safe: one caller drives it, one call at a time
    (``lock`` serialises callers that share it, e.g. HTTP requests naming the episode).

    ``step`` answers every tool failure as an observation: the model's mistakes (an unknown
    tool, bad or oversized arguments) and the env's refusals go on; an env past the tool
    timeout, or one that raised or died, ends the episode (done, reward null, status
    ``error``). It raises :class:`ServerError` only for a step after the end.
    """

    def __init__(
        self,
        episode_id: str,
        bundle: Bundle,
        task: Task,
        env: EnvHandle,
        reward: RewardFn | None = None,
    ) -> None:
        self.reward_fn: RewardFn = reward or bundle.reward
        self.id = episode_id
        self.bundle = bundle
        self.task = task
        self.env = env
        self.tools = bundle_tools(bundle, task)
        self._tool_names = {t.name for t in self.tools}
        self.limits = bundle.manifest.limits
        self.turn = 0
        self.steps = 0
        self.done = False
        self.status = "running"
        self.last_active = time.monotonic()
        self.busy = False  # a step in flight: the reaper leaves the episode alone
        self.agent_running = False  # a black-box agent plays the episode (EpisodeManager)
        # Set by the manager when it forgets the episode: "reaped", "shutdown", "closed", or
        # "ended-<status>" for one that ended itself.
        self.closed_as: str | None = None
        self.final_state: dict[str, Any] | None = None  # read at the end, before the env goes
        self.error: str | None = None  # why the env failed, when it ended the episode
        self.lock = asyncio.Lock()
        self._release: asyncio.Future[None] | None = None

    def reset_observation(self, prompt: str) -> StepResult[ResetObservation]:
        agent = self.bundle.manifest.agent
        obs = ResetObservation(
            prompt=prompt,
            system_prompt=self.bundle.manifest.system_prompt,
            tools=self.tools,
            task_id=self.task.id,
            episode_id=self.id,
            agent_instructions=agent.instructions if agent is not None else None,
        )
        return StepResult[ResetObservation](observation=obs)

    def list_tools(self) -> StepResult[ListToolsObservation]:
        obs = ListToolsObservation(tools=self.tools, **self._fields())
        return StepResult[ListToolsObservation](observation=obs, done=self.done)

    def _fields(self) -> dict[str, Any]:
        return {
            "task_id": self.task.id,
            "turn": self.turn,
            "step": self.steps,
            "status": self.status,
        }

    def _answer(
        self,
        name: str,
        text: str,
        *,
        is_error: bool = False,
        reward: float | None = None,
        **fields: Any,
    ) -> StepResult[CallToolObservation]:
        obs = CallToolObservation(
            tool_name=name,
            result=ToolResult.of(text, is_error=is_error),
            **self._fields(),
            **fields,
        )
        return StepResult[CallToolObservation](observation=obs, reward=reward, done=self.done)

    def _refusal(
        self, name: str, error_type: ToolErrorType, message: str
    ) -> StepResult[CallToolObservation]:
        obs = CallToolObservation(
            tool_name=name,
            error=ToolError(error_type=error_type, message=message),
            **self._fields(),
        )
        return StepResult[CallToolObservation](observation=obs, done=self.done)

    async def step(
        self, call: CallToolAction, tool_timeout: float
    ) -> StepResult[CallToolObservation]:
        if self.done:
            raise ServerError(
                ErrorCode.EXECUTION_ERROR,
                "the episode is over; reset to play again",
                Reason.EPISODE_DONE,
            )
        self.steps += 1
        name = call.tool_name
        arguments = _arguments(call.arguments)
        if isinstance(arguments, str):
            return self._refusal(name, ToolErrorType.INVALID_ARGS, arguments)
        size = json_size(arguments)
        if size is None or size > self.limits.max_call_bytes:
            return self._refusal(
                name,
                ToolErrorType.INVALID_ARGS,
                f"error: the arguments are {size if size is not None else 'too many'} bytes as "
                f"JSON, over this env's limit of {self.limits.max_call_bytes} (max_call_bytes)",
            )
        if name not in self._tool_names:
            names = sorted(self._tool_names)
            return self._refusal(
                name,
                ToolErrorType.TOOL_NOT_FOUND,
                f"error: unknown tool {name!r}; the tools are {names}",
            )
        try:
            if name == END_TURN_TOOL:
                return await self._end_turn(arguments, tool_timeout)
            outcome = await self._run(self.env.call_tool(name, arguments), limit_s=tool_timeout)
            if outcome.done:
                return await self.finish(
                    name, outcome.content, is_error=outcome.error, limit_s=tool_timeout
                )
            return self._answer(name, outcome.content, is_error=outcome.error)
        except _EnvBroke as broke:
            assert broke.error_type in EPISODE_ENDING_TOOL_ERRORS
            return self._refusal(name, broke.error_type, str(broke))

    async def _end_turn(
        self, arguments: dict[str, Any], tool_timeout: float
    ) -> StepResult[CallToolObservation]:
        """End the turn. An env with an ``end_turn(arguments) -> ToolOutcome`` method gets the
        answer and returns the next turn's prompt; for any other env ending the turn ends the
        episode. ``max_turns`` ends it in any case."""
        self.turn += 1
        if not self.env.has_end_turn:
            return await self.finish(
                END_TURN_TOOL, "turn ended; the episode is over", limit_s=tool_timeout
            )
        outcome = await self._run(self.env.end_turn(arguments), limit_s=tool_timeout)
        if outcome.done or self.turn >= self.bundle.manifest.max_turns:
            return await self.finish(END_TURN_TOOL, outcome.content, limit_s=tool_timeout)
        return self._answer(END_TURN_TOOL, outcome.content)

    async def read_state(self, limit_s: float) -> dict[str, Any] | None:
        """The env's state, within ``limit_s`` and ``max_state_bytes``. A failure, an overrun
        or an oversized state ends the episode and raises ServerError. Once the episode is
        over: the state read at grading, or None when none was (the env failed; ``error``
        says how). An ended env is never asked again: it is released and, after an overrun,
        its abandoned call may still be changing it."""
        if self.final_state is not None or self.done:
            return self.final_state
        try:
            return await self._state(limit_s)
        except _EnvBroke as broke:
            reason = Reason.STATE_TOO_LARGE if "max_state_bytes" in str(broke) else None
            raise ServerError(ErrorCode.EXECUTION_ERROR, str(broke), reason) from None

    async def _state(self, limit_s: float) -> dict[str, Any]:
        state = await self._run(self.env.state(), limit_s=limit_s)
        size = json_size(state)
        if size is None or size > self.limits.max_state_bytes:
            what = f"{size} bytes as JSON" if size is not None else "not JSON data"
            self.done, self.status = True, "error"
            self.error = (
                f"the env's state is {what}, over this env's limit of "
                f"{self.limits.max_state_bytes} bytes (max_state_bytes)"
            )
            await self.env.close()
            raise _EnvBroke(ToolErrorType.EXECUTION_ERROR, self.error)
        return dict(state)

    async def finish(
        self, name: str, text: str, *, limit_s: float, is_error: bool = False
    ) -> StepResult[CallToolObservation]:
        """End the episode and grade it: ``reward`` is the bundle's reward of the verifier's
        scores, or ``None`` with status ``error`` (and ``grade_error``) when the state cannot
        be read or the verifier (or reward) fails. The env is released (its sandbox removed)
        once its state is read."""
        self.done = True
        try:
            state = await self._state(limit_s)
            self.final_state = state
            # Released now, not awaited: the reply need not wait for a container's removal
            # (the handle keeps the teardown; the manager's close awaits it).
            self._release = asyncio.ensure_future(self.env.close())
            scores = await self._run(
                asyncio.to_thread(self.bundle.grade, self.task, state), limit_s=limit_s
            )
            reward = float(self.reward_fn(scores))
            if not math.isfinite(reward):
                raise RewardError(f"the reward is not a finite number: {reward!r}")
        except Exception as exc:  # a custom reward function may raise anything: flag it
            self.status = "error"
            await self.env.close()
            return self._answer(name, text, is_error=is_error, grade_error=str(exc))
        self.status = "graded"
        return self._answer(name, text, is_error=is_error, reward=reward, scores=scores)

    async def _run(self, call: Awaitable[Any], *, limit_s: float) -> Any:
        """Await env code (or the verifier) within ``limit_s``. An overrun or a failure ends
        the episode (the env's state is no longer trustworthy), releases the env (a sandboxed
        one is killed, which stops the work) and raises _EnvBroke."""
        try:
            return await asyncio.wait_for(call, limit_s)
        except (VerifierError, RewardError):
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                error = _EnvBroke(
                    ToolErrorType.TIMEOUT, f"the env did not answer within {limit_s:g} s"
                )
            elif isinstance(exc, EnvFailure):
                error = _EnvBroke(ToolErrorType.EXECUTION_ERROR, str(exc))
            else:
                error = _EnvBroke(
                    ToolErrorType.EXECUTION_ERROR, f"the env raised {type(exc).__name__}: {exc}"
                )
            self.done, self.status, self.error = True, "error", str(error)
            await self.env.close()
            raise error from (None if isinstance(exc, TimeoutError) else exc)


def _agent_running() -> ServerError:
    return ServerError(
        ErrorCode.EXECUTION_ERROR,
        "a black-box agent plays this episode now: wait for its agent reply (or close)",
        Reason.AGENT_RUNNING,
    )


def _arguments(raw: Any) -> dict[str, Any] | str:
    """Tool arguments as a dict, or the tool-error message the model reads when they are not
    a JSON object (a string is parsed first: OpenAI clients send arguments as JSON text)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            return f"error: the arguments are not valid JSON ({exc.msg}); send a JSON object"
        except RecursionError:
            return "error: the arguments nest too deeply; send a flat JSON object"
        except ValueError as exc:  # e.g. an integer past the interpreter's digit limit
            why = str(exc).split(";")[0]
            return f"error: the arguments cannot be read as JSON ({why}); send a JSON object"
    if not isinstance(raw, dict):
        kind = "an array" if isinstance(raw, list) else f"{json.dumps(raw)[:40]}"
        return f"error: the arguments must be a JSON object, got {kind}"
    return raw


class EpisodeManager:
    """Every live episode of one server: capacity, creation, closing and idle reaping.

    At most ``max_concurrent_envs`` episodes live at once (socket and HTTP episodes alike).
    :meth:`open` waits for room up to ``reset_timeout`` seconds, then raises
    ``CAPACITY_REACHED`` with the ``active_sessions`` and ``max_sessions`` counts.
    :meth:`reap_idle` closes episodes idle longer than ``idle_timeout``. Must be used
    from one event loop. ``on_capacity_wait`` (if set) is called each time a reset starts
    waiting for room, ``on_reap`` (if set) with each episode the reaper closes: hooks for tests
    and logs (called on the event loop; keep them short). :meth:`shutdown` refuses new
    episodes, hangs up every registered socket and closes every episode.
    """

    def __init__(
        self,
        bundle: Bundle,
        *,
        max_concurrent_envs: int,
        reset_timeout: float,
        idle_timeout: float,
        tool_timeout: float,
        metrics: Metrics,
        reward: RewardFn | None = None,
        host: EnvHost | None = None,
    ) -> None:
        if max_concurrent_envs < 1:
            raise ValueError("max_concurrent_envs must be at least 1")
        self.bundle = bundle
        self.host: EnvHost = host or InProcessHost(bundle)
        self.reward = reward
        self.max = max_concurrent_envs
        self.reset_timeout = reset_timeout
        self.idle_timeout = idle_timeout
        self.tool_timeout = tool_timeout
        # The longest a step may hold its episode: the tool call, then at the end the state
        # read and the grading, each within tool_timeout (and the env's release).
        self.step_limit_s = 3 * tool_timeout + RELEASE_ALLOWANCE_S

        self.metrics = metrics
        self.on_capacity_wait: Callable[[], None] | None = None
        self.on_reap: Callable[[Episode], None] | None = None
        self.closing = False
        self._hang_ups: dict[int, Callable[[int, str], Awaitable[None]]] = {}
        self._episodes: dict[str, Episode] = {}
        self._slots = 0  # episodes live or being created; <= max
        self._room = asyncio.Condition()
        self._ids = itertools.count(1)
        self._next_task = itertools.count()

    @property
    def active(self) -> int:
        return self._slots

    def find_task(self, data: ResetData) -> Task:
        try:
            if data.task_id is not None:
                return self.bundle.task_by_id(data.task_id)
            if data.split is not None and data.index is not None:
                return self.bundle.task(data.split, data.index)
            # An OpenEnv-style reset names no task: the default split, by seed or in turn.
            split = "train" if "train" in self.bundle.splits else self.bundle.splits[0]
            count = len(self.bundle.tasks(split))
            index = data.seed % count if data.seed is not None else next(self._next_task) % count
            return self.bundle.task(split, index)
        except TaskNotFound as exc:
            raise ServerError(ErrorCode.VALIDATION_ERROR, str(exc), Reason.TASK_NOT_FOUND) from None

    async def open(self, task: Task, episode_id: str | None = None) -> tuple[Episode, str]:
        """A new episode on ``task`` and its first observation text (the env's reset). The
        episode's id is ``episode_id`` when given and no live episode has it, else the
        server's own."""
        await self._take_slot()
        env: EnvHandle | None = None
        try:
            env = await asyncio.wait_for(self.host.start(), self.reset_timeout)
            prompt = await asyncio.wait_for(env.reset(task), self.reset_timeout)
        except BaseException as exc:
            if env is not None:
                await env.close()
            await self._give_slot()
            if not isinstance(exc, Exception):
                raise
            why = str(exc) if isinstance(exc, EnvFailure) else f"{type(exc).__name__}: {exc}"
            if isinstance(exc, TimeoutError):
                why = f"it did not start within {self.reset_timeout:g} s (reset_timeout)"
            raise ServerError(ErrorCode.FACTORY_ERROR, f"the env could not start: {why}") from exc
        if self.closing:  # shut down while the env was starting
            await env.close()
            await self._give_slot()
            raise ServerError(ErrorCode.SESSION_ERROR, SHUTDOWN_REASON, Reason.SHUTDOWN)
        if episode_id is None or episode_id in self._episodes:
            episode_id = f"ep-{next(self._ids)}"
            while episode_id in self._episodes:  # a client took this id for its own
                episode_id = f"ep-{next(self._ids)}"
        episode = Episode(episode_id, self.bundle, task, env, self.reward)
        self._episodes[episode.id] = episode
        return episode, prompt

    async def start(self, data: ResetData) -> tuple[Episode, StepResult[ResetObservation]]:
        """Find ``data``'s task and open an episode on it: the episode and its observation."""
        task = self.find_task(data)
        episode, prompt = await self.open(task, data.episode_id)
        return episode, episode.reset_observation(prompt)

    async def step(self, episode: Episode, call: CallToolAction) -> StepResult[CallToolObservation]:
        """One tool call on a live episode (serialised on its lock), counted in the metrics;
        an episode that ends frees its slot (the object stays, so later steps get
        ``episode_done`` rather than ``no_episode``). Refused (``agent_running``) while a
        black-box agent plays the episode."""
        if episode.agent_running:
            raise _agent_running()
        return await self._step(episode, call)

    async def _step(
        self, episode: Episode, call: CallToolAction
    ) -> StepResult[CallToolObservation]:
        async with episode.lock:
            self.check_live(episode)
            episode.busy = True
            started = time.perf_counter()
            try:
                out = await episode.step(call, self.tool_timeout)
            except ServerError as exc:
                self.metrics.steps.labels(outcome=(exc.reason or exc.code).value).inc()
                raise
            finally:
                episode.busy = False
                episode.last_active = time.monotonic()
                self.metrics.step_seconds.observe(time.perf_counter() - started)
            obs = out.observation
            # "tool_error": the model's mistakes and the env's refusals (the episode goes on);
            # "timeout" / "execution_error": the env failed and the episode ended.
            outcome = "tool_error" if obs.is_error else "ok"
            if obs.error is not None and obs.error.error_type in EPISODE_ENDING_TOOL_ERRORS:
                outcome = obs.error.error_type.value
            self.metrics.steps.labels(outcome=outcome).inc()
            if episode.closed_as is not None and not episode.closed_as.startswith("ended"):
                # Closed under the call (shutdown, or a close that waited past its bound): the
                # env was released mid-call, so its answer is not the episode's.
                self.check_live(episode)
            if out.done:
                await self._forget(episode)
            return out

    def check_agent(self, episode: Episode) -> None:
        """Raise the ServerError for an ``agent`` frame that cannot run on ``episode``: closed
        under its client, over, no ``[agent]`` in the bundle, or an agent already on it."""
        self.check_live(episode)
        if self.bundle.manifest.agent is None:
            raise ServerError(
                ErrorCode.EXECUTION_ERROR,
                f"bundle {self.bundle.name!r} has no [agent] section: its tasks are not "
                "playable by black-box agents",
                Reason.NO_AGENT_SUPPORT,
            )
        if episode.agent_running:
            raise _agent_running()
        if episode.done:
            raise ServerError(
                ErrorCode.EXECUTION_ERROR,
                "the episode is over; reset to play again",
                Reason.EPISODE_DONE,
            )

    async def run_agent(self, episode: Episode, launch: AgentLaunch) -> AgentResult:
        """Run a black-box agent on ``episode``, then end the episode and grade it as any end
        does: the bundle's ``[agent] finish_tool`` called with ``{}`` (when the task offers
        it), then ``end_turn`` until the episode ends (at most ``max_turns`` times; the
        result's ``step`` and ``turn`` count these calls). The episode is busy throughout:
        the idle reaper leaves it alone, and tool calls on it are refused (``agent_running``).

        Refusals, with the episode untouched and still playable: :meth:`check_agent`'s, a
        host that runs no agents (``no_agent_support``), a launch that breaks the server's
        policy (VALIDATION_ERROR ``agent_refused``). A sandbox that fails under the agent (or
        a run past its budget by :data:`AGENT_RUN_SLACK_S`) ends the episode with status
        ``error`` and raises EXECUTION_ERROR ``agent_failed``. An env that fails while the
        episode is ended gives a result with status ``error`` and ``grade_error``. A close
        or shutdown under the run raises its SESSION_ERROR. Cancellation stops the agent
        (the bridge kills it) and leaves the episode to its closer."""
        self.check_agent(episode)
        episode.agent_running = episode.busy = True
        try:
            run = await self._agent_run(episode, launch)
            self.check_live(episode)
            return await self._finish_agent(episode, run)
        finally:
            episode.agent_running = episode.busy = False
            episode.last_active = time.monotonic()

    async def _agent_run(self, episode: Episode, launch: AgentLaunch) -> AgentRun:
        limit_s = launch.timeout_s + launch.kill_grace_s + AGENT_RUN_SLACK_S
        try:
            return await asyncio.wait_for(episode.env.run_agent(launch), limit_s)
        except AgentUnsupported as exc:
            raise ServerError(
                ErrorCode.EXECUTION_ERROR, str(exc), Reason.NO_AGENT_SUPPORT
            ) from None
        except AgentRefused as exc:
            raise ServerError(
                ErrorCode.VALIDATION_ERROR,
                f"the agent launch is refused: {exc}",
                Reason.AGENT_REFUSED,
            ) from None
        except (EnvFailure, TimeoutError) as exc:
            self.check_live(episode)  # closed under the run: that is why it failed
            why = str(exc)
            if isinstance(exc, TimeoutError):
                why = f"its run did not end within {limit_s:g} s"
            async with episode.lock:
                episode.done, episode.status = True, "error"
                episode.error = f"the agent could not run: {why}"
                await self._forget(episode)
            raise ServerError(
                ErrorCode.EXECUTION_ERROR, episode.error, Reason.AGENT_FAILED
            ) from exc

    async def _finish_agent(self, episode: Episode, run: AgentRun) -> AgentResult:
        """End the episode after its agent exited (see :meth:`run_agent`) and say how."""
        spec = self.bundle.manifest.agent
        assert spec is not None  # check_agent refused the run otherwise
        last: StepResult[CallToolObservation] | None = None
        offered = {t.name for t in episode.tools}
        if spec.finish_tool is not None and spec.finish_tool in offered and not episode.done:
            last = await self._step(episode, CallToolAction(tool_name=spec.finish_tool))
        for _ in range(self.bundle.manifest.max_turns):
            if episode.done:
                break
            last = await self._step(episode, CallToolAction(tool_name=END_TURN_TOOL))
        if not episode.done:  # turns that never end it (max_turns counts from before)
            async with episode.lock:
                self.check_live(episode)
                last = await episode.finish(
                    END_TURN_TOOL, "the agent's episode is over", limit_s=self.tool_timeout
                )
                await self._forget(episode)
        obs = last.observation if last is not None else None
        return AgentResult(
            run=run,
            status=episode.status,  # type: ignore[arg-type]  # always one of the literals
            reward=last.reward if last is not None else None,
            scores=obs.scores if obs is not None else None,
            grade_error=(obs.grade_error if obs is not None else None) or episode.error,
            turn=episode.turn,
            step=episode.steps,
        )

    async def state(self, episode: Episode) -> EpisodeState:
        """The episode's state (the env's under ``env``); one over ``max_state_bytes`` ends
        the episode and raises ServerError naming the limit. After the end: the state read at
        grading, or an empty ``env`` when the env failed (never a released env's state)."""
        async with episode.lock:
            self.check_live(episode)
            episode.last_active = time.monotonic()
            try:
                env_state = await episode.read_state(self.tool_timeout)
            except ServerError:
                self.check_live(episode)  # closed under the read: that is why it failed
                raise
            finally:
                if episode.done and episode.status == "error":
                    await self._forget(episode)
            self.check_live(episode)

            return EpisodeState(
                episode_id=episode.id,
                step_count=episode.steps,
                done=episode.done,
                task_id=episode.task.id,
                turn=episode.turn,
                status=episode.status,  # type: ignore[arg-type]  # always one of the literals
                env=env_state,
                error=episode.error,
            )

    async def close(self, episode: Episode, status: str | None = None) -> None:
        """Close ``episode`` for a client (``status`` for the metrics; idempotent). A call in
        flight finishes first, so its answer is the episode's: close waits for it as long as
        a step may take (:attr:`step_limit_s`); past that the env is released under it and
        the call answers SESSION_ERROR."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.step_limit_s):
                async with episode.lock:
                    await self._forget(episode, status)
                    return
        await self._forget(episode, status)

    async def _forget(self, episode: Episode, status: str | None = None) -> None:
        """Forget ``episode``, release its env and free its slot (idempotent; no waiting for
        a call in flight: the caller holds the lock or means to cut the call short).
        ``closed_as`` is ``status``, or ``ended-<status>`` for an episode that ended itself."""
        if self._episodes.pop(episode.id, None) is None:
            return
        label = status or episode.status
        episode.closed_as = status or f"ended-{episode.status}"
        episode.done = True
        await episode.env.close()
        self.metrics.episodes.labels(status=label).inc()
        await self._give_slot()

    async def close_all(self) -> None:
        """Close every episode now, cutting calls in flight short (they answer SHUTDOWN)."""
        for episode in list(self._episodes.values()):
            await self._forget(episode, "shutdown")

    def add_socket(self, key: int, hang_up: Callable[[int, str], Awaitable[None]]) -> None:
        """Register a live socket's ``hang_up(code, reason)`` for :meth:`shutdown`."""
        self._hang_ups[key] = hang_up

    def remove_socket(self, key: int) -> None:
        self._hang_ups.pop(key, None)

    async def shutdown(self) -> None:
        """Stop for good (idempotent): refuse new episodes and wake resets waiting for room
        (they get ``SESSION_ERROR``), close every socket with 1001 and a reason, then close
        every episode."""
        self.closing = True
        async with self._room:
            self._room.notify_all()
        for hang_up in list(self._hang_ups.values()):
            with contextlib.suppress(Exception):  # a socket already gone is fine
                await hang_up(GOING_AWAY, SHUTDOWN_REASON)
        self._hang_ups.clear()
        await self.close_all()

    def _refuse_if_closing(self) -> None:
        if self.closing:
            raise ServerError(ErrorCode.SESSION_ERROR, SHUTDOWN_REASON, Reason.SHUTDOWN)

    def check_live(self, episode: Episode) -> None:
        """Raise the SESSION_ERROR for an episode closed before its end (reaped, shut down,
        closed by a client); one that ended itself (graded, failed) stays readable."""
        if episode.closed_as == "shutdown":
            raise ServerError(ErrorCode.SESSION_ERROR, SHUTDOWN_REASON, Reason.SHUTDOWN)
        if episode.closed_as == "reaped":
            raise ServerError(
                ErrorCode.SESSION_ERROR,
                f"the episode was closed after {self.idle_timeout:g} s idle; reset again",
                Reason.REAPED,
            )
        if episode.closed_as is not None and not episode.closed_as.startswith("ended"):
            raise ServerError(
                ErrorCode.SESSION_ERROR,
                "the episode was closed before its end; reset to play again",
                Reason.CLOSED,
            )

    def is_open(self, episode: Episode) -> bool:
        return episode.id in self._episodes

    async def reap_idle(self, now: float | None = None) -> int:
        """Close every episode idle for more than ``idle_timeout``; returns how many."""
        now = time.monotonic() if now is None else now
        # An episode whose lock is held (a call or state read in flight) is not idle.
        stale = [
            e
            for e in self._episodes.values()
            if not e.busy and not e.lock.locked() and now - e.last_active > self.idle_timeout
        ]
        for episode in stale:
            if episode.busy or episode.lock.locked():  # a call began while others closed
                continue
            await self._forget(episode, "reaped")
            if self.on_reap is not None:
                self.on_reap(episode)
        return len(stale)

    async def reaper(self) -> None:
        """Run :meth:`reap_idle` forever, often enough to reap within ~1.5x ``idle_timeout``."""
        interval = max(0.05, min(self.idle_timeout / 2, 30.0))
        while True:
            await asyncio.sleep(interval)
            await self.reap_idle()

    async def _take_slot(self) -> None:
        self._refuse_if_closing()
        async with self._room:
            if self._slots >= self.max:
                if self.on_capacity_wait is not None:
                    self.on_capacity_wait()
                self.metrics.waiting.inc()
                try:
                    await asyncio.wait_for(
                        self._room.wait_for(lambda: self._slots < self.max or self.closing),
                        self.reset_timeout,
                    )
                except TimeoutError:
                    raise ServerError(
                        ErrorCode.CAPACITY_REACHED,
                        f"the server is full ({self._slots} of {self.max} episodes live) and no "
                        f"room freed within {self.reset_timeout:g} s",
                        active_sessions=self._slots,
                        max_sessions=self.max,
                    ) from None
                finally:
                    self.metrics.waiting.dec()
            self._refuse_if_closing()
            self._slots += 1
            self.metrics.active.set(self._slots)

    async def _give_slot(self) -> None:
        async with self._room:
            self._slots -= 1
            self.metrics.active.set(self._slots)
            self._room.notify()
