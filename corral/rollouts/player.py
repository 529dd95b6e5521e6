"""The episode player: one row played through the gateway against its env server.

:meth:`Player.play` opens a gateway session and an episode on the row's env server, then runs
the turn loop through the session's own OpenAI endpoint with the official ``openai`` async
client, so a rollout takes exactly the path a black-box agent takes: the model's tool calls go
to the episode as steps, their observations come back as ``tool`` messages, and a reply with no
tool call ends the model's turn (``end_turn``). When the episode ends the env server's verifier
has scored it; the player sets that reward on the session and returns the session's samples.

Failure is explicit (:attr:`Rollout.failed`, :attr:`Rollout.reason`, and every sample's status
``failed``), never a reward of 0 as if the model had played badly:

- the env failed: it could not start, a call overran its deadline, it raised, the server went
  away (``env: ...``);
- the model missed ``model_timeout`` or the gateway refused the call (``model: ...``);
- the episode ended without a reward (the verifier or reward failed: ``no reward: ...``);
- the gateway could not reward the session or hand over its samples (``gateway: ...``): the
  rollout comes back with one aborted sample carrying the failure.

A model that runs out of ``max_turns`` is not a failure: the player ends the turn, the episode
is graded on what the model did. A server at its capacity, or one that is restarting, delays
the reset up to ``reset_timeout`` instead of failing it. A session that recorded no turn (the
model was never called) comes back as one aborted sample with ``remove_sample`` set.
Cancellation (a trainer with enough samples) closes the episode and deletes the session.

With a trace sink (:mod:`corral.rollouts.traces`, the player's ``trace`` or the call's) each
episode's spans go to it when the episode ends: ``episode`` (attrs: reward, failed, reason,
turns, ``score.<name>``), and under it ``session_open``, ``env_reset``, one ``model_call`` per
model turn (``turn``, token counts, ``finish_reason``, ``weight_version``), one ``tool_call``
per tool call (``tool``, ``ok``/``error``, ``done``) and ``grading`` (the step that ended the
episode and had it graded). Without one nothing is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from corral.env_secrets import SecretMissing, env_secret
from corral.envs.client import EnvClient, EnvClientError, EnvServerError
from corral.envs.protocol import CallToolObservation, ResetObservation, StepResult
from corral.gateway.client import GatewayAdmin, GatewayAdminError, SessionCreated
from corral.rollouts.rows import Row
from corral.rollouts.traces import EpisodeTrace, JsonScalar, TraceSink
from corral.samples import Sample

END_TURN = "end_turn"
# Errors worth waiting out within reset_timeout: the server is full or not up (yet).
_RETRY_RESET = frozenset({"CAPACITY_REACHED", "SESSION_ERROR"})
_RESET_RETRY_S = 0.5


class PlayerError(Exception):
    """The row cannot be played at all (a bad row, a token variable that is not set, a gateway
    that refuses sessions): a configuration problem, not a failed rollout."""


class RolloutFailed(Exception):
    """Internal: ends the turn loop with the reason the rollout is flagged with."""


@dataclass(frozen=True)
class RolloutTiming:
    """Wall time of one rollout: in the model (gateway + engine), in tools (the env server),
    and in all (the rest is corral's own: sessions, samples, bookkeeping)."""

    model_s: float
    tools_s: float
    total_s: float


@dataclass(frozen=True)
class Rollout:
    """One played row. ``reward`` is ``None`` exactly when ``failed``; ``samples`` are the
    session's (every one carries the reward, or status ``failed``)."""

    row: Row
    session_id: str
    samples: list[Sample]
    reward: float | None
    failed: bool
    reason: str | None
    scores: dict[str, float]
    turns: int
    messages: list[dict[str, Any]]
    timing: RolloutTiming


@dataclass
class _Episode:
    """What the turn loop learned (filled as it goes)."""

    messages: list[dict[str, Any]]
    reward: float | None = None
    scores: dict[str, float] = field(default_factory=dict)
    done: bool = False
    turns: int = 0
    model_s: float = 0.0
    tools_s: float = 0.0
    trace: EpisodeTrace | None = None  # None: the episode is not traced
    calls: list[dict[str, JsonScalar]] = field(default_factory=list)  # model_call spans' attrs

    def model_call(self, start_s: float, reply: Any = None, error: str | None = None) -> None:
        """Trace one model call (started at wall time ``start_s``): its ``reply``'s usage and
        finish reason, or the ``error`` that ended it."""
        if self.trace is None:
            return
        attrs: dict[str, JsonScalar] = {"turn": len(self.calls)}
        if error is not None:
            attrs["error"] = error
        if reply is not None:
            usage = getattr(reply, "usage", None)
            attrs["prompt_tokens"] = getattr(usage, "prompt_tokens", None)
            attrs["completion_tokens"] = getattr(usage, "completion_tokens", None)
            attrs["finish_reason"] = reply.choices[0].finish_reason
        self.calls.append(self.trace.add("model_call", start_s, time.time(), attrs))

    def tool_call(self, start_s: float, name: str, own: bool, error: str | None) -> None:
        """Trace one step: the model's tool call ``name`` (``tool_call``; also ``grading``
        when it ended the episode) or the player's own ``end_turn`` (``own``: ``grading``
        when it ended the episode, else a ``tool_call``)."""
        if self.trace is None:
            return
        end = time.time()
        ok: dict[str, JsonScalar] = {"ok": error is None, "error": error, "done": self.done}
        if not own or not self.done:
            self.trace.add("tool_call", start_s, end, ok, tool=name, by_model=not own)
        if self.done:
            self.trace.add("grading", start_s, end, ok, tool=name, reward=self.reward)


def row_token(row: Row, env: Mapping[str, str]) -> str | None:
    """The env server's token for ``row``, from the variable it names in ``env`` (``None``
    when it names none); :class:`PlayerError` when that variable is unset."""
    try:
        return env_secret(row.metadata.env.token_var, "the row's env server token", env)
    except SecretMissing as exc:
        raise PlayerError(str(exc)) from None


class Player:
    """Plays rows through the gateway behind ``gateway``. ``sampling``: overrides every
    session's sampling (temperature, top_p, top_k, max_tokens, seed, stop). ``env``: where a
    row's token variable is looked up (default ``os.environ``). ``trace``: where every
    episode's spans go (``None``: nowhere, nothing is recorded)."""

    def __init__(
        self,
        gateway: GatewayAdmin,
        *,
        sampling: dict[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        model: str = "corral",
        trace: TraceSink | None = None,
    ) -> None:
        self.gateway = gateway
        self.sampling = dict(sampling or {})
        self.env = env if env is not None else os.environ
        self.model = model
        self.trace = trace
        # One HTTP client for every rollout's OpenAI client: building one loads the TLS trust
        # store (about 30 ms here), which would otherwise be paid per rollout.
        self._http: Any = None

    def _http_client(self) -> Any:
        if self._http is None:
            self._http = _openai_http_client()
        return self._http

    async def aclose(self) -> None:
        """Close the shared HTTP client (the gateway admin client is the caller's)."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> Player:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _token(self, row: Row) -> str | None:
        return row_token(row, self.env)

    async def play(
        self,
        row: Row | dict[str, Any],
        *,
        group_index: int | None = None,
        index: int | None = None,
        metadata: dict[str, Any] | None = None,
        sampling: dict[str, Any] | None = None,
        trace: TraceSink | None = None,
    ) -> Rollout:
        """Play ``row`` once (see the module docstring for what fails and how). ``sampling``
        overrides the player's for this rollout (a per-rollout ``seed``, say); ``trace``, the
        player's sink for this episode's spans (its ``attempt`` is ``index``).
        :class:`PlayerError` for a row that cannot be played at all."""
        started = time.monotonic()
        try:
            row = row if isinstance(row, Row) else Row.model_validate(row)
        except ValueError as exc:
            raise PlayerError(f"not a corral row: {exc}") from exc
        token = self._token(row)
        meta = row.metadata
        sink = trace if trace is not None else self.trace
        spans = EpisodeTrace(task_id=meta.task_id, attempt=index) if sink is not None else None
        tags = {"task_id": meta.task_id, "split": meta.split, "index": meta.index}
        ref = meta.env
        client = EnvClient(
            ref.url, token, timeout=ref.tool_timeout + 5.0, reset_timeout=ref.reset_timeout + 5.0
        )
        # The episode starts while the session opens: two round trips at once, not in turn.
        reset = asyncio.ensure_future(self._reset(client, row, spans))
        try:
            opened = time.time()
            session = await self.gateway.open_session(
                metadata={**tags, **(metadata or {})},
                group_index=group_index,
                index=index,
                sampling={**self.sampling, **(sampling or {})},
            )
            if spans is not None:
                spans.session_id = session.id
                spans.add("session_open", opened, time.time())
        except BaseException as exc:
            reset.cancel()
            with contextlib.suppress(BaseException):
                await reset
            await asyncio.shield(client.close())
            if isinstance(exc, GatewayAdminError):
                raise PlayerError(f"the gateway opened no session: {exc}") from exc
            raise
        episode = _Episode(messages=[dict(m) for m in row.messages], trace=spans)
        reason: str | None = None
        try:
            try:
                await self._episode(row, session, client, reset, episode)
            except RolloutFailed as exc:
                reason = str(exc)
            if reason is None and episode.reward is None:
                reason = "no reward: the episode ended without one"
            samples, reason = await settle_session(
                self.gateway, session.id, episode.reward, reason, tags, group_index, index
            )
            _stamp_weight_versions(episode.calls, samples)
        except BaseException as exc:  # for the trace only: the error goes on
            if reason is None:
                cancelled = isinstance(exc, asyncio.CancelledError)
                reason = "cancelled" if cancelled else f"{type(exc).__name__}: {exc}"
            raise
        finally:
            # Shielded: a cancelled rollout still deletes its session (and never leaks it).
            with contextlib.suppress(GatewayAdminError):
                await asyncio.shield(self.gateway.close_session(session.id))
            if sink is not None and spans is not None:
                sink.write(spans.spans(_episode_attrs(episode, reason)))
        return Rollout(
            row=row,
            session_id=session.id,
            samples=samples,
            reward=None if reason else episode.reward,
            failed=reason is not None,
            reason=reason,
            scores=episode.scores,
            turns=episode.turns,
            messages=episode.messages,
            timing=RolloutTiming(episode.model_s, episode.tools_s, time.monotonic() - started),
        )

    async def _episode(
        self,
        row: Row,
        session: SessionCreated,
        client: EnvClient,
        reset: asyncio.Future[None],
        episode: _Episode,
    ) -> None:
        """The turn loop, once ``reset`` (the episode's start) is done; closes ``client``."""
        from openai import APIError, APITimeoutError, AsyncOpenAI

        ref = row.metadata.env
        model = AsyncOpenAI(
            base_url=session.base_url,
            api_key=session.api_key,
            timeout=ref.model_timeout,
            max_retries=0,  # the deadline is model_timeout; the gateway answers or says why
            http_client=self._http_client(),
        )
        try:
            await reset
            for _ in range(ref.max_turns):
                t0, wall = time.monotonic(), time.time()
                try:
                    reply = await asyncio.wait_for(
                        model.chat.completions.create(
                            model=self.model,
                            messages=episode.messages,  # type: ignore[arg-type]
                            tools=row.metadata.tools,  # type: ignore[arg-type]
                        ),
                        ref.model_timeout,
                    )
                except (TimeoutError, APITimeoutError):
                    episode.model_call(wall, error="timeout")
                    raise RolloutFailed(
                        f"model: no answer within model_timeout ({ref.model_timeout:g} s)"
                    ) from None
                except APIError as exc:
                    episode.model_call(wall, error=str(exc))
                    raise RolloutFailed(f"model: the gateway refused the call: {exc}") from exc
                finally:
                    episode.model_s += time.monotonic() - t0
                episode.model_call(wall, reply)
                episode.turns += 1
                message = reply.choices[0].message.model_dump(exclude_none=True)
                episode.messages.append(message)
                calls = message.get("tool_calls") or []
                if not calls:
                    await self._step(client, episode, END_TURN, "{}", own=True)
                for call in calls:
                    if episode.done:
                        break
                    fn = call.get("function") or {}
                    content = await self._step(
                        client, episode, str(fn.get("name")), fn.get("arguments") or "{}"
                    )
                    episode.messages.append(
                        {"role": "tool", "tool_call_id": call.get("id"), "content": content}
                    )
                if episode.done:
                    return
            # Out of turns: end the turn so the verifier grades what the model did.
            await self._step(client, episode, END_TURN, "{}", own=True)
        finally:
            if not reset.done():
                reset.cancel()
            with contextlib.suppress(Exception):
                await asyncio.shield(client.close())

    async def _reset(self, client: EnvClient, row: Row, spans: EpisodeTrace | None) -> None:
        if spans is None:
            await start_episode(client, row)
            return
        with spans.span("env_reset"):
            await start_episode(client, row)

    async def _step(
        self, client: EnvClient, episode: _Episode, name: str, arguments: str, own: bool = False
    ) -> str:
        """Send one tool call (``own``: the player's ``end_turn``, not the model's); the
        observation text the model reads. Records the reward and scores when the episode ends;
        :class:`RolloutFailed` when the env fails."""
        t0, wall = time.monotonic(), time.time()
        error: str | None = None
        try:
            out: StepResult[CallToolObservation] = await client.call_tool(name, arguments)
        except (EnvServerError, EnvClientError) as exc:
            error = f"env: {exc}"
            raise RolloutFailed(error) from exc
        finally:
            episode.tools_s += time.monotonic() - t0
            if error is not None:
                episode.tool_call(wall, name, own, error)
        obs = out.observation
        if out.done:
            episode.done = True
            episode.reward = out.reward
            episode.scores = dict(obs.scores or {})
        if obs.error is not None:
            error = f"{obs.error.error_type}: {obs.error.message}"
        episode.tool_call(wall, name, own, error)
        if out.done:
            if obs.error is not None:  # the env timed out, raised or died: the episode is over
                raise RolloutFailed(f"env: {obs.error.error_type}: {obs.error.message}")
            if out.reward is None:
                raise RolloutFailed(f"no reward: {obs.grade_error or 'the verifier gave none'}")
        return obs.text


def _episode_attrs(episode: _Episode, reason: str | None) -> dict[str, JsonScalar]:
    """The ``episode`` span's attrs: the outcome, the turn count and the scores."""
    attrs: dict[str, JsonScalar] = {
        "reward": None if reason else episode.reward,
        "failed": reason is not None,
        "reason": reason,
        "turns": episode.turns,
        "model_s": episode.model_s,
        "tools_s": episode.tools_s,
    }
    attrs.update({f"score.{k}": v for k, v in episode.scores.items()})
    return attrs


def _stamp_weight_versions(calls: list[dict[str, JsonScalar]], samples: list[Sample]) -> None:
    """Put each model call's ``weight_version`` on its span's attrs: the gateway records it
    per turn on the samples (``metadata["turns"]``, the session's turn indices, beside
    ``metadata["weight_versions"]``); the chat response does not carry it."""
    if not calls:
        return
    for sample in samples:
        meta = sample.metadata
        turns, versions = meta.get("turns") or [], meta.get("weight_versions") or []
        for turn, version in zip(turns, versions, strict=False):  # equal lengths, by the gateway
            if isinstance(turn, int) and 0 <= turn < len(calls):
                calls[turn]["weight_version"] = str(version)


def _openai_http_client() -> Any:
    """The transport for every rollout's OpenAI client: the SDK's aiohttp one where the
    installed ``openai`` has it (hundreds of rollouts in flight cost a third of the CPU in
    httpx's connection pool), else its httpx default."""
    import openai

    try:
        return openai.DefaultAioHttpClient()
    except (AttributeError, RuntimeError):  # openai < 1.86, or without aiohttp support
        return openai.DefaultAsyncHttpxClient()


async def start_episode(client: EnvClient, row: Row) -> ResetObservation:
    """Start the row's episode, waiting within ``reset_timeout`` for a full or restarting
    server; its first observation. :class:`RolloutFailed` (with the reason the rollout is
    flagged with) when it does not start."""
    ref, meta = row.metadata.env, row.metadata
    deadline = time.monotonic() + ref.reset_timeout
    while True:
        try:
            return (await client.reset(meta.split, meta.index)).observation
        except EnvServerError as exc:
            if exc.code not in _RETRY_RESET or time.monotonic() >= deadline:
                raise RolloutFailed(f"env: the episode did not start: {exc}") from exc
        except EnvClientError as exc:  # not reachable (yet): a restart
            if time.monotonic() >= deadline:
                raise RolloutFailed(f"env: the episode did not start: {exc}") from exc
        await asyncio.sleep(_RESET_RETRY_S)  # a retry interval, not synchronisation


async def settle_session(
    gateway: GatewayAdmin,
    session_id: str,
    reward: float | None,
    reason: str | None,
    tags: dict[str, Any],
    group_index: int | None,
    index: int | None,
) -> tuple[list[Sample], str | None]:
    """Set a played rollout's outcome on its session (the failure ``reason``, else the
    ``reward``) and take the session's samples: ``(samples, reason)``. A gateway that cannot
    take the outcome or hand over the samples makes the rollout failed (``gateway: ...``,
    one aborted sample): a rollout the group filter drops, not an error that stops a run."""
    try:
        if reason is not None:
            await gateway.fail(session_id, reason)
        else:
            assert reward is not None
            await gateway.set_reward(session_id, reward)
        why = reason or "no turn was recorded"
        samples = await gateway.samples(session_id) or [
            aborted_sample(session_id, {**tags, "failure": why}, group_index, index)
        ]
    except GatewayAdminError as exc:
        reason = f"gateway: {exc}"
        samples = [aborted_sample(session_id, {**tags, "failure": reason}, group_index, index)]
    return samples, reason


def aborted_sample(
    session_id: str, metadata: dict[str, Any], group_index: int | None, index: int | None
) -> Sample:
    """The one sample of a session that recorded no turn: nothing to train on."""
    return Sample(
        group_index=group_index,
        index=index,
        tokens=[],
        response_length=0,
        loss_mask=[],
        rollout_log_probs=[],
        status="aborted",
        metadata=metadata,
        rollout_id=session_id,
        remove_sample=True,
    )
