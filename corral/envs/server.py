"""Serve a bundle's episodes over WebSocket, its tasks over HTTP (``build_app``).

The FastAPI layer is thin: it authenticates, parses messages (:mod:`corral.envs.protocol`) and
forwards them to an :class:`EpisodeManager` (capacity, idle reaping, timeouts) and
:class:`Episode` (one env's life: reset, tool calls, turns, grading), which are plain classes.

The server speaks plain HTTP and WebSocket: the bearer token crosses the wire in clear text.
Outside loopback, put a TLS-terminating proxy in front of it (e.g. Caddy ``reverse_proxy``
or nginx ``proxy_pass`` with ``proxy_set_header Upgrade $http_upgrade``) and bind the server
to 127.0.0.1.

Where env code runs (:mod:`corral.envs.hosting`): with ``sandbox=None`` a bundle whose
``[sandbox] needs = "none"`` runs in the server's process, in worker threads, so a slow tool
never blocks the event loop; a tool call past ``tool_timeout`` is answered with a
``TOOL_TIMEOUT`` error and ends its episode, but the thread cannot be killed and runs on until
the env code returns. With a sandbox backend (``sandbox="bwrap"``, ``"docker"``, ...) every
episode's env runs in a sandbox of its own; a call past its deadline kills the sandbox, and an
episode's sandbox is removed as soon as the episode is graded or closed. The verifier always
runs in the server's process.

Shutdown (SIGTERM): :func:`run_server` runs the app with uvicorn and, before uvicorn's own
graceful shutdown, calls :meth:`EpisodeManager.shutdown`: new resets are refused (resets waiting
for capacity too), every live socket is closed with 1001 "going away" and a reason, and every
episode is torn down; uvicorn then stops within ``timeout_graceful_shutdown``. Under a plain
``uvicorn.run`` the lifespan's shutdown does the same, but only after uvicorn has closed the
sockets itself (code 1012, no reason).

Keepalive: the server pings every socket (uvicorn's ``ws_ping_interval`` / ``ws_ping_timeout``,
20 s / 20 s, passed explicitly by :func:`run_server`) and drops a peer that stops answering,
which closes its episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from fastapi.websockets import WebSocketState
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from corral.envs.bundle import Bundle, RewardError, TaskNotFound, VerifierError, load_bundle
from corral.envs.episode import END_TURN_TOOL, Task
from corral.envs.hosting import (
    EnvFailure,
    EnvHandle,
    EnvHost,
    InProcessHost,
    SandboxHost,
)
from corral.envs.protocol import (
    CLIENT_MESSAGE,
    CLIENT_TYPES,
    CallTool,
    CloseMessage,
    EpisodeObservation,
    ErrorCode,
    ErrorMessage,
    ObservationData,
    ObservationMessage,
    RequestId,
    ResetData,
    ResetMessage,
    StateMessage,
    StateRequest,
    StepMessage,
    encode,
    error_message,
)
from corral.sandboxes.base import NetworkPolicy, SandboxProvider, SandboxSpec
from corral.sandboxes.providers import make_provider

END_TURN_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": END_TURN_TOOL,
        "description": "End your turn, with your answer for this turn.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "Your answer."}},
        },
    },
}
# WebSocket close code for a refused token (RFC 6455: policy violation).
POLICY_VIOLATION = 1008
# WebSocket close code on shutdown (RFC 6455: going away).
GOING_AWAY = 1001
SHUTDOWN_REASON = "the env server is shutting down; the episode is over"
# Keepalive pings (uvicorn) and the bound on uvicorn's graceful shutdown, used by run_server.
WS_PING_INTERVAL = 20.0
WS_PING_TIMEOUT = 20.0
GRACEFUL_SHUTDOWN_S = 10


# Episodes a server keeps alive at once unless told otherwise.
DEFAULT_MAX_CONCURRENT_ENVS = 64


class ServerError(Exception):
    """A request the server refuses: becomes an ``error`` reply with ``code`` and ``extra``."""

    def __init__(self, code: ErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra


# Combines the verifier's named scores into the episode's reward (``build_app(reward=...)``
# overrides the bundle's ``[reward]``); whatever it raises flags the episode, never a 0.
RewardFn = Callable[[dict[str, float]], float]


def task_tools(bundle: Bundle, task: Task) -> list[dict[str, Any]]:
    """The task's tools in OpenAI's schema, ``end_turn`` last (the server provides it)."""
    return [t.openai() for t in bundle.tools_for(task)] + [END_TURN_SCHEMA]


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
    """One env playing one task. Not thread-safe: one socket drives it, one message at a time.

    ``step`` never raises for the model's mistakes (bad arguments, an unknown tool): those are
    tool-error observations and the episode goes on. It raises :class:`ServerError` for a step
    after the end (``EPISODE_DONE``), an env that raised (``EXECUTION_ERROR``) or overran the
    tool timeout (``TOOL_TIMEOUT``); the last two end the episode.
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
        self.tools = task_tools(bundle, task)
        self._tool_names = {t["function"]["name"] for t in self.tools}
        self.turn = 0
        self.steps = 0
        self.done = False
        self.status = "running"
        self.last_active = time.monotonic()
        self.busy = False  # a step in flight: the reaper leaves the episode alone
        self.closed_as: str | None = None  # set by the manager: "reaped", "shutdown", ...
        self.final_state: dict[str, Any] | None = None  # read at the end, before the env goes
        self._release: asyncio.Future[None] | None = None

    def observation(self, content: str = "", **fields: Any) -> EpisodeObservation:
        return EpisodeObservation(
            content=content,
            task_id=self.task.id,
            turn=self.turn,
            step=self.steps,
            status=self.status,  # type: ignore[arg-type]  # always one of the literals
            **fields,
        )

    async def step(self, call: CallTool, tool_timeout: float) -> ObservationData:
        if self.done:
            raise ServerError(ErrorCode.EPISODE_DONE, "the episode is over; reset to play again")
        self.steps += 1
        arguments = _arguments(call.arguments)
        if isinstance(arguments, str):
            return ObservationData(observation=self.observation(arguments, tool_error=True))
        if call.name not in self._tool_names:
            names = sorted(self._tool_names)
            return ObservationData(
                observation=self.observation(
                    f"error: unknown tool {call.name!r}; the tools are {names}", tool_error=True
                )
            )
        if call.name == END_TURN_TOOL:
            return await self._end_turn(arguments, tool_timeout)
        outcome = await self._run(self.env.call_tool(call.name, arguments), limit_s=tool_timeout)
        if outcome.done:
            return await self.finish(
                outcome.content, tool_error=outcome.error, limit_s=tool_timeout
            )
        return ObservationData(
            observation=self.observation(outcome.content, tool_error=outcome.error)
        )

    async def _end_turn(self, arguments: dict[str, Any], tool_timeout: float) -> ObservationData:
        """End the turn. An env with an ``end_turn(arguments) -> ToolOutcome`` method gets the
        answer and returns the next turn's prompt; for any other env ending the turn ends the
        episode. ``max_turns`` ends it in any case."""
        self.turn += 1
        if not self.env.has_end_turn:
            return await self.finish("turn ended; the episode is over", limit_s=tool_timeout)
        outcome = await self._run(self.env.end_turn(arguments), limit_s=tool_timeout)
        if outcome.done or self.turn >= self.bundle.manifest.max_turns:
            return await self.finish(outcome.content, limit_s=tool_timeout)
        return ObservationData(observation=self.observation(outcome.content))

    async def finish(
        self, content: str, *, limit_s: float, tool_error: bool = False
    ) -> ObservationData:
        """End the episode and grade it: ``reward`` is the bundle's reward of the verifier's
        scores, or ``None`` with status ``error`` when the verifier (or reward) fails. The env
        is released (its sandbox removed) once its state is read."""
        self.done = True
        try:
            state = await self._run(self.env.state(), limit_s=limit_s)
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
            return ObservationData(
                observation=self.observation(content, tool_error=tool_error, error=str(exc)),
                reward=None,
                done=True,
            )
        self.status = "graded"
        return ObservationData(
            observation=self.observation(content, tool_error=tool_error, scores=scores),
            reward=reward,
            done=True,
        )

    async def _run(self, call: Awaitable[Any], *, limit_s: float) -> Any:
        """Await env code (or the verifier) within ``limit_s``. An overrun or a failure ends
        the episode (the env's state is no longer trustworthy), releases the env (a sandboxed
        one is killed, which stops the work) and raises ServerError."""
        try:
            return await asyncio.wait_for(call, limit_s)
        except (VerifierError, RewardError):
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                error = ServerError(
                    ErrorCode.TOOL_TIMEOUT, f"the env did not answer within {limit_s:g} s"
                )
            elif isinstance(exc, EnvFailure):
                error = ServerError(ErrorCode.EXECUTION_ERROR, str(exc))
            else:
                error = ServerError(
                    ErrorCode.EXECUTION_ERROR, f"the env raised {type(exc).__name__}: {exc}"
                )
            self.done, self.status = True, "error"
            await self.env.close()
            raise error from (None if isinstance(exc, TimeoutError) else exc)


def _arguments(raw: Any) -> dict[str, Any] | str:
    """Tool arguments as a dict, or the tool-error message the model reads when they are not
    a JSON object (a string is parsed first: OpenAI clients send arguments as JSON text)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            return f"error: the arguments are not valid JSON ({exc.msg}); send a JSON object"
    if not isinstance(raw, dict):
        kind = "an array" if isinstance(raw, list) else f"{json.dumps(raw)[:40]}"
        return f"error: the arguments must be a JSON object, got {kind}"
    return raw


class EpisodeManager:
    """Every live episode of one server: capacity, creation, closing and idle reaping.

    At most ``max_concurrent_envs`` episodes live at once. :meth:`open` waits for room up to
    ``reset_timeout`` seconds, then raises ``CAPACITY_REACHED`` with the ``active`` and ``max``
    counts. :meth:`reap_idle` closes episodes idle longer than ``idle_timeout``. Must be used
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
            raise ServerError(ErrorCode.TASK_NOT_FOUND, str(exc)) from None

    async def open(self, task: Task) -> tuple[Episode, str]:
        """A new episode on ``task`` and its first observation text (the env's reset)."""
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
            raise ServerError(ErrorCode.SESSION_ERROR, SHUTDOWN_REASON)
        episode = Episode(f"ep-{next(self._ids)}", self.bundle, task, env, self.reward)
        self._episodes[episode.id] = episode
        return episode, prompt

    async def close(self, episode: Episode, status: str | None = None) -> None:
        """Forget ``episode`` and free its slot (idempotent)."""
        if self._episodes.pop(episode.id, None) is None:
            return
        await episode.env.close()
        episode.done = True
        episode.closed_as = status or episode.status
        self.metrics.episodes.labels(status=status or episode.status).inc()
        await self._give_slot()

    async def close_all(self) -> None:
        for episode in list(self._episodes.values()):
            await self.close(episode, "shutdown")

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
            raise ServerError(ErrorCode.SESSION_ERROR, SHUTDOWN_REASON)

    def is_open(self, episode: Episode) -> bool:
        return episode.id in self._episodes

    async def reap_idle(self, now: float | None = None) -> int:
        """Close every episode idle for more than ``idle_timeout``; returns how many."""
        now = time.monotonic() if now is None else now
        stale = [
            e
            for e in self._episodes.values()
            if not e.busy and now - e.last_active > self.idle_timeout
        ]
        for episode in stale:
            await self.close(episode, "reaped")
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
                        active=self._slots,
                        max=self.max,
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


class Session:
    """One WebSocket's conversation: at most one episode at a time; turns messages into
    replies. Closing the session (or the socket) closes its episode."""

    def __init__(self, manager: EpisodeManager) -> None:
        self.manager = manager
        self.episode: Episode | None = None

    async def handle(self, text: str) -> tuple[str | None, bool]:
        """The reply frame to one client frame (None for none), and whether to hang up."""
        request_id: RequestId | None = None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            return encode(error_message(ErrorCode.INVALID_JSON, f"not JSON: {exc.msg}")), False
        if not isinstance(raw, dict):
            reply = error_message(ErrorCode.INVALID_JSON, "a message must be a JSON object")
            return encode(reply), False
        if isinstance(raw.get("request_id"), str | int):
            request_id = raw["request_id"]  # echoed even when the rest is malformed
        if raw.get("type") not in CLIENT_TYPES:
            message = f"unknown message type {raw.get('type')!r}; expected one of {CLIENT_TYPES}"
            return encode(error_message(ErrorCode.UNKNOWN_TYPE, message, request_id)), False
        try:
            msg = CLIENT_MESSAGE.validate_python(raw)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            reply = error_message(ErrorCode.VALIDATION_ERROR, problems, request_id)
            return encode(reply), False
        try:
            return await self._dispatch(msg)
        except ServerError as exc:
            reply = error_message(exc.code, str(exc), request_id, **exc.extra)
            return encode(reply), False

    async def _dispatch(
        self, msg: ResetMessage | StepMessage | StateRequest | CloseMessage
    ) -> tuple[str | None, bool]:
        rid = msg.request_id
        if isinstance(msg, CloseMessage):
            await self.close()
            return None, True
        if isinstance(msg, ResetMessage):
            task = self.manager.find_task(msg.data)
            await self.close()  # a reset replaces this socket's episode, as in OpenEnv
            self.episode, prompt = await self.manager.open(task)
            obs = self.episode.observation(prompt, tools=self.episode.tools)
            return encode(
                ObservationMessage(data=ObservationData(observation=obs), request_id=rid)
            ), False
        episode = self._live_episode()
        if isinstance(msg, StateRequest):
            state = episode.final_state
            if state is None:
                state = await episode._run(episode.env.state(), limit_s=self.manager.tool_timeout)
            data = {"episode_id": episode.id, "step_count": episode.steps, "done": episode.done}
            data.update(task_id=episode.task.id, turn=episode.turn, status=episode.status)
            data["env"] = state
            return encode(StateMessage(data=data, request_id=rid)), False
        if msg.data.list_tools is not None:
            obs = episode.observation(tools=episode.tools)
            return encode(
                ObservationMessage(data=ObservationData(observation=obs), request_id=rid)
            ), False
        assert msg.data.call_tool is not None  # StepAction holds exactly one action
        return await self._step(episode, msg.data.call_tool, rid), False

    async def _step(self, episode: Episode, call: CallTool, rid: RequestId | None) -> str:
        metrics = self.manager.metrics
        episode.busy = True
        started = time.perf_counter()
        try:
            data = await episode.step(call, self.manager.tool_timeout)
        except ServerError as exc:
            metrics.steps.labels(outcome=exc.code.value).inc()
            if episode.done:
                await self.manager.close(episode)
            raise
        finally:
            episode.busy = False
            episode.last_active = time.monotonic()
            metrics.step_seconds.observe(time.perf_counter() - started)
        metrics.steps.labels(outcome="tool_error" if data.observation.tool_error else "ok").inc()
        if data.done:
            # The slot is free once graded; the episode object stays so later steps get
            # EPISODE_DONE rather than NO_EPISODE.
            await self.manager.close(episode)
        return encode(ObservationMessage(data=data, request_id=rid))

    def _live_episode(self) -> Episode:
        episode = self.episode
        if episode is None:
            raise ServerError(ErrorCode.NO_EPISODE, "no episode on this socket; send reset first")
        if episode.closed_as == "shutdown":
            raise ServerError(ErrorCode.SESSION_ERROR, SHUTDOWN_REASON)
        if episode.closed_as == "reaped":
            raise ServerError(
                ErrorCode.SESSION_ERROR,
                f"the episode was closed after {self.manager.idle_timeout:g} s idle; reset again",
            )
        return episode

    async def close(self) -> None:
        if self.episode is not None:
            await self.manager.close(self.episode, "closed" if not self.episode.done else None)
            self.episode = None


def _bearer_ok(header: str | None, token: str) -> bool:
    scheme, _, value = (header or "").partition(" ")
    # compare_digest on bytes: constant time in the token's content, whatever the length.
    return scheme.lower() == "bearer" and hmac.compare_digest(value.encode(), token.encode())


def env_host(
    bundle: Bundle,
    sandbox: str | SandboxProvider | None,
    *,
    image: str | None = None,
    warm: int = 0,
) -> EnvHost:
    """Where ``bundle``'s envs run (see :func:`build_app`'s ``sandbox``)."""
    needs = bundle.manifest.sandbox
    if sandbox is None:
        if needs.needs != "none":
            raise ValueError(
                f"bundle {bundle.name!r} needs a sandbox ([sandbox] needs = {needs.needs!r}): "
                "serve it with --sandbox bwrap or docker (kubernetes and e2b where configured; "
                "local for development only, with no isolation)"
            )
        return InProcessHost(bundle)
    if isinstance(sandbox, str):
        sandbox = make_provider(sandbox, f"serve-{bundle.name}", image=image or needs.image)
    spec = SandboxSpec(
        workdir="/work",
        memory_mb=needs.memory_mb,
        cpus=needs.cpus,
        pids=needs.pids,
        disk_mb=needs.disk_mb,
        network=NetworkPolicy(mode=needs.network),
        labels={"corral.bundle": bundle.name},
    )
    return SandboxHost(bundle, sandbox, spec, warm=warm)


def build_app(
    bundle: Bundle | Path | str,
    *,
    max_concurrent_envs: int = DEFAULT_MAX_CONCURRENT_ENVS,
    token: str | None = None,
    reset_timeout: float = 600.0,
    idle_timeout: float = 600.0,
    tool_timeout: float = 60.0,
    reward: RewardFn | None = None,
    sandbox: str | SandboxProvider | None = None,
    sandbox_image: str | None = None,
    warm_sandboxes: int = 0,
) -> FastAPI:
    """A FastAPI app serving ``bundle`` (a loaded Bundle or its folder).

    Routes: ``GET /health`` (never needs the token), ``GET /splits``, ``GET /tasks/{split}``,
    ``GET /tasks/{split}/{index}``, ``GET /metrics`` and the WebSocket ``/ws`` (protocol in
    :mod:`corral.envs.protocol`). With a ``token``, every route but ``/health`` requires
    ``Authorization: Bearer <token>``: HTTP answers 401, the socket is closed with 1008
    before any env is created. The manager is at ``app.state.episodes``.

    ``sandbox``: where each episode's env runs (:mod:`corral.envs.hosting`): ``None`` runs a
    bundle that needs no sandbox in this process and refuses one that does (``ValueError``);
    a backend name (:data:`~corral.sandboxes.providers.BACKENDS`) or a provider runs every
    episode in a sandbox of its own, with the bundle's ``[sandbox]`` limits, ``sandbox_image``
    as the image or template, and ``warm_sandboxes`` started ahead. The server sweeps the
    backend's leftovers of dead servers when it starts.
    """
    loaded = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    host = env_host(loaded, sandbox, image=sandbox_image, warm=warm_sandboxes)
    metrics = Metrics()
    manager = EpisodeManager(
        loaded,
        max_concurrent_envs=max_concurrent_envs,
        reset_timeout=reset_timeout,
        idle_timeout=idle_timeout,
        tool_timeout=tool_timeout,
        metrics=metrics,
        reward=reward,
        host=host,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await host.open()
        reaper = asyncio.create_task(manager.reaper())
        try:
            yield
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await manager.shutdown()
            await host.aclose()

    def require_token(request: Request) -> None:
        if token is not None and not _bearer_ok(request.headers.get("authorization"), token):
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    app = FastAPI(title=f"corral env server: {loaded.name}", lifespan=lifespan)
    app.state.episodes = manager
    authed = [Depends(require_token)]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "healthy",
            "bundle": loaded.name,
            "version": loaded.manifest.version,
            "envs": host.description,
        }

    @app.get("/splits", dependencies=authed)
    async def splits() -> dict[str, Any]:
        return {
            "splits": [{"name": s, "tasks": len(loaded.tasks(s))} for s in loaded.splits],
            "group_by": loaded.manifest.eval.group_by,
        }

    @app.get("/tasks/{split}", dependencies=authed)
    async def tasks(split: str) -> dict[str, Any]:
        try:
            found = loaded.tasks(split)
        except TaskNotFound as exc:
            raise HTTPException(404, str(exc)) from None
        return {"split": split, "tasks": [{"index": t.index, "id": t.id} for t in found]}

    @app.get("/tasks/{split}/{index}", dependencies=authed)
    async def task(split: str, index: int) -> dict[str, Any]:
        try:
            found = loaded.task(split, index)
        except TaskNotFound as exc:
            raise HTTPException(404, str(exc)) from None
        return {
            "id": found.id,
            "split": found.split,
            "index": found.index,
            "system_prompt": loaded.manifest.system_prompt,
            "prompt": found.prompt,
            "max_turns": loaded.manifest.max_turns,
            "tools": task_tools(loaded, found),
            "data": found.data,
        }

    @app.get("/metrics", dependencies=authed)
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        if token is not None and not _bearer_ok(websocket.headers.get("authorization"), token):
            # Accept, then close with a reason: a close before accept reaches the client as a
            # bare HTTP 403 with no explanation.
            await websocket.accept()
            await websocket.close(POLICY_VIOLATION, "missing or wrong bearer token")
            return
        await websocket.accept()
        if manager.closing:
            await websocket.close(GOING_AWAY, SHUTDOWN_REASON)
            return
        session = Session(manager)

        async def hang_up_socket(code: int, reason: str) -> None:
            # Checked and sent with no await between: never a send after the close.
            if websocket.application_state == WebSocketState.CONNECTED:
                await websocket.close(code, reason)

        key = id(websocket)
        manager.add_socket(key, hang_up_socket)
        try:
            while True:
                frame = await websocket.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                text = frame.get("text")
                if text is None:
                    text = (frame.get("bytes") or b"").decode("utf-8", "replace")
                reply, hang_up = await session.handle(text)
                if websocket.application_state != WebSocketState.CONNECTED:
                    break  # hung up by shutdown while the message was handled
                if reply is not None:
                    await websocket.send_text(reply)
                if hang_up:
                    await websocket.close()
                    break
        except WebSocketDisconnect:
            pass
        finally:
            manager.remove_socket(key)
            await session.close()

    return app


def run_server(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 8200,
    log_level: str = "info",
    access_log: bool = False,
    timeout_graceful_shutdown: int = GRACEFUL_SHUTDOWN_S,
    ws_ping_interval: float = WS_PING_INTERVAL,
    ws_ping_timeout: float = WS_PING_TIMEOUT,
) -> None:
    """Run an app from :func:`build_app` with uvicorn until SIGINT / SIGTERM (blocks).

    On the signal, before uvicorn's own graceful shutdown, the app's manager shuts down: new
    episodes are refused, every socket is closed with 1001 and a reason, every episode is torn
    down. uvicorn then waits at most ``timeout_graceful_shutdown`` s for requests in flight
    (e.g. a tool call in a worker thread) before cancelling them. The server pings every
    socket each ``ws_ping_interval`` s and drops one that does not answer within
    ``ws_ping_timeout`` s.

    A SIGTERM shutdown is a clean exit: this returns normally (``corral serve`` exits 0),
    where a bare ``uvicorn.run`` re-raises the signal after shutting down (exit status -15).
    """
    import signal
    import threading

    import uvicorn

    from corral.serving import KEEP_ALIVE_S

    manager: EpisodeManager = app.state.episodes

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            await manager.shutdown()
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=timeout_graceful_shutdown,
        ws_ping_interval=ws_ping_interval,
        ws_ping_timeout=ws_ping_timeout,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    if threading.current_thread() is not threading.main_thread():
        _Server(config).run()
        return
    # uvicorn restores this handler after its shutdown and re-raises the SIGTERM it caught:
    # a no-op here makes the graceful shutdown the end of it.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        _Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = [
    "Episode",
    "EpisodeManager",
    "ErrorMessage",
    "Metrics",
    "ServerError",
    "build_app",
    "run_server",
]
