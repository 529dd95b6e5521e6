"""Which of several engines are fit to serve: health checks, and weights checked on revival.

:class:`HealthMonitor` probes every engine (``probe``: for the gateway, one ``GET /health``
with a short timeout, no retry) every ``interval_s``. An engine whose probe fails
``failures_to_down`` times in a row is **down**: a refused connection fails at once, a hung
process (SIGSTOPped: the kernel still accepts the connection, nothing ever answers) fails by
timing out, so with the defaults (2 s apart, 2.5 s timeout, 2 failures) a hang is seen within
about 7 s of the last answer. One log line per change of state.

An engine that answers again is not served to at once: its weight version
(``model_info(i).weight_version``) must equal the one the engines that are **up** serve
(they must agree: during a weight push they may not, and the check waits for the next round).
Equal: it is up again. Not equal: it is **stale**, held out of routing, and, when a
``catch_up`` is given, that is called once per reference version (in the background) to load
the current weights into it; either way the next rounds check again, so an engine brought
current by anyone (the trainer's weight sync, an operator) comes back. When no engine is up
there is nothing to compare with: the answering engines' most common version is taken as
current (ties: the first listed).

The monitor holds no HTTP of its own: ``probe``, ``model_info`` and ``catch_up`` are given
(testable with fakes), as are ``clock`` and ``sleep``. It runs in the event loop of whoever
uses it (:meth:`run` until cancelled); :meth:`down_signal` is an ``asyncio.Event`` set while
an engine is down, so that a request waiting on it can give up and go elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from corral.engines.protocol import ModelInfo

__all__ = ["EngineState", "HealthMonitor"]

log = logging.getLogger(__name__)

# probe(i): None when engine i is healthy, else what went wrong, in words.
Probe = Callable[[int], Awaitable[str | None]]
InfoFetch = Callable[[int], Awaitable[ModelInfo]]
# catch_up(i, reference): load the reference's weights into engine i (raises on failure).
CatchUp = Callable[[int, ModelInfo], Awaitable[None]]


class EngineState(StrEnum):
    UNKNOWN = "unknown"  # not checked yet (served to, optimistically)
    UP = "up"
    DOWN = "down"
    STALE = "stale"  # answers, but serves other weights than the engines that are up


@dataclass
class _Engine:
    name: str
    state: EngineState = EngineState.UNKNOWN
    detail: str = "not checked yet"
    since: float = 0.0
    failures: int = 0
    weight_version: str | None = None
    # The reference version a catch-up was last started for (one try per version).
    caught_up_to: str | None = None
    catching_up: asyncio.Task[None] | None = None
    down: asyncio.Event | None = None


class HealthMonitor:
    """The health of the engines named ``names`` (the module says how it is judged).

    ``model_info`` None: no weight check (an engine that answers is up). ``catch_up`` None:
    a stale engine is only held out. ``probe_timeout_s`` bounds each probe and each
    ``model_info`` call; ``catch_up_timeout_s`` each catch-up (loading weights is slow)."""

    def __init__(
        self,
        names: Sequence[str],
        probe: Probe,
        *,
        model_info: InfoFetch | None = None,
        catch_up: CatchUp | None = None,
        interval_s: float = 2.0,
        probe_timeout_s: float = 2.5,
        failures_to_down: int = 2,
        catch_up_timeout_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not names:
            raise ValueError("a health monitor needs an engine")
        if interval_s <= 0 or probe_timeout_s <= 0 or failures_to_down < 1:
            raise ValueError("interval_s and probe_timeout_s must be > 0, failures_to_down >= 1")
        self.names = list(names)
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.failures_to_down = failures_to_down
        self.catch_up_timeout_s = catch_up_timeout_s
        self.rounds = 0  # probe rounds completed
        self._probe = probe
        self._model_info = model_info
        self._catch_up = catch_up
        self._clock = clock
        self._sleep = sleep
        now = clock()
        self._engines = [_Engine(name, since=now) for name in self.names]

    # --- what routing asks ---------------------------------------------------------------

    def state(self, index: int) -> EngineState:
        return self._engines[index].state

    def routable(self, index: int) -> bool:
        """Whether engine ``index`` may be sent requests: up, or not checked yet."""
        return self._engines[index].state in (EngineState.UP, EngineState.UNKNOWN)

    def up(self) -> list[int]:
        """The indices of the engines that are up."""
        return [i for i, e in enumerate(self._engines) if e.state is EngineState.UP]

    def down_signal(self, index: int) -> asyncio.Event:
        """Set while engine ``index`` is down (cleared when it is routable again). Call from
        within the event loop the monitor runs in."""
        engine = self._engines[index]
        if engine.down is None:
            engine.down = asyncio.Event()
            if engine.state is EngineState.DOWN:
                engine.down.set()
        return engine.down

    def snapshot(self) -> list[dict[str, Any]]:
        """Each engine's state, for a health answer or a log: ``name``, ``state``,
        ``detail`` (why, in words), ``weight_version`` (last seen), ``since_s`` (seconds
        in that state)."""
        now = self._clock()
        return [
            {
                "name": e.name,
                "state": str(e.state),
                "detail": e.detail,
                "weight_version": e.weight_version,
                "since_s": round(now - e.since, 3),
            }
            for e in self._engines
        ]

    # --- probing -------------------------------------------------------------------------

    async def run(self) -> None:
        """Probe every ``interval_s`` until cancelled (never raises otherwise)."""
        try:
            next_round = self._clock()
            while True:
                try:
                    await self.check()
                except Exception:  # a bug in a probe must not stop the monitoring
                    log.exception("engine health round failed")
                next_round += self.interval_s
                delay = next_round - self._clock()
                if delay < 0:  # the round took longer than the interval: start afresh
                    next_round, delay = self._clock(), 0.0
                await self._sleep(delay)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Cancel catch-ups under way."""
        tasks = [e.catching_up for e in self._engines if e.catching_up is not None]
        for task in tasks:
            task.cancel()
        if tasks:  # their failures were logged by _load
            await asyncio.wait(tasks)

    async def check(self) -> None:
        """One round: probe every engine at once, then judge the ones that came back."""
        problems = await asyncio.gather(*(self._probe_one(i) for i in range(len(self.names))))
        back: list[int] = []
        for i, problem in enumerate(problems):
            engine = self._engines[i]
            if problem is None:
                engine.failures = 0
                if engine.state is not EngineState.UP:
                    back.append(i)
                continue
            engine.failures += 1
            if engine.state is not EngineState.DOWN and engine.failures >= self.failures_to_down:
                self._set(i, EngineState.DOWN, problem)
            elif engine.state is EngineState.DOWN:
                engine.detail = problem
        if back:
            await self._judge(back)
        self.rounds += 1

    async def _probe_one(self, index: int) -> str | None:
        try:
            return await asyncio.wait_for(self._probe(index), self.probe_timeout_s)
        except TimeoutError:
            return f"no answer within {self.probe_timeout_s:g} s"
        except Exception as exc:  # a probe should not raise; if it does, the engine is not fit
            return f"health check failed: {type(exc).__name__}: {exc}"

    async def _info(self, index: int) -> ModelInfo | str:
        assert self._model_info is not None
        try:
            return await asyncio.wait_for(self._model_info(index), self.probe_timeout_s)
        except TimeoutError:
            return f"no model info within {self.probe_timeout_s:g} s"
        except Exception as exc:
            return f"model info failed: {exc}"

    async def _judge(self, back: list[int]) -> None:
        """Up again, or held out: the weight versions of ``back`` against the up engines'."""
        if self._model_info is None:
            for i in back:
                self._set(i, EngineState.UP, "answers its health check")
            return
        up = self.up()
        asked = [*back, *up]
        infos = await asyncio.gather(*(self._info(i) for i in asked))
        answers = dict(zip(asked, infos, strict=True))
        for i, info in answers.items():
            if isinstance(info, ModelInfo):
                self._engines[i].weight_version = info.weight_version
        reference = self._reference(up, back, answers)
        for i in back:
            info = answers[i]
            if not isinstance(info, ModelInfo):
                self._note(i, info)
            elif isinstance(reference, str):
                self._note(i, reference)
            elif info.weight_version == reference.weight_version:
                self._set(i, EngineState.UP, f"answers, weights {info.weight_version!r}")
            else:
                self._stale(i, info, reference)

    def _reference(
        self, up: list[int], back: list[int], answers: dict[int, ModelInfo | str]
    ) -> ModelInfo | str:
        """The model info whose weights are current, or why none can be told now."""
        if up:
            infos = [info for i in up if isinstance(info := answers[i], ModelInfo)]
            if not infos:
                return "waiting: the engines that are up did not tell their weight version"
            versions = {info.weight_version for info in infos}
            if len(versions) > 1:
                return (
                    f"waiting: the engines that are up serve different weights "
                    f"({sorted(map(str, versions))}: a weight push under way?)"
                )
            return infos[0]
        infos = [info for i in back if isinstance(info := answers[i], ModelInfo)]
        if not infos:
            return "waiting for its model info"
        counts = Counter(info.weight_version for info in infos)
        best = max(counts.values())
        return next(info for info in infos if counts[info.weight_version] == best)

    def _stale(self, index: int, info: ModelInfo, reference: ModelInfo) -> None:
        engine = self._engines[index]
        current = reference.weight_version
        if engine.catching_up is not None and not engine.catching_up.done():
            return  # a catch-up is loading; the round after it checks again
        said = f"serves weights {info.weight_version!r}, the engines up serve {current!r}"
        if self._catch_up is not None and current is not None and engine.caught_up_to != current:
            engine.caught_up_to = current
            engine.catching_up = asyncio.create_task(self._load(index, reference))
            self._set(index, EngineState.STALE, f"{said}; loading {reference.model_path!r}")
            return
        if self._catch_up is None:
            hint = "held out until it is sent the current weights (update_weights_from_disk)"
        elif current is None:
            hint = "held out: the current weights have no version to load by"
        else:
            hint = "held out: loading the current weights into it failed"
        self._set(index, EngineState.STALE, f"{said}; {hint}")

    async def _load(self, index: int, reference: ModelInfo) -> None:
        assert self._catch_up is not None
        name = self.names[index]
        try:
            await asyncio.wait_for(self._catch_up(index, reference), self.catch_up_timeout_s)
        except Exception as exc:
            log.warning(
                "engine %s: loading the current weights %r (%s) failed: %s",
                name,
                reference.weight_version,
                reference.model_path,
                exc,
            )
        else:
            log.info(
                "engine %s: loaded the current weights %r from %s",
                name,
                reference.weight_version,
                reference.model_path,
            )

    def _note(self, index: int, detail: str) -> None:
        """A detail for an engine whose state stays as it is."""
        self._engines[index].detail = detail

    def _set(self, index: int, state: EngineState, detail: str) -> None:
        engine = self._engines[index]
        engine.detail = detail
        if state is engine.state:
            return
        was, engine.state, engine.since = engine.state, state, self._clock()
        if engine.down is not None:
            if state is EngineState.DOWN:
                engine.down.set()
            elif state is EngineState.UP:
                engine.down.clear()
        if state is EngineState.UP:
            log.info("engine %s is up (was %s): %s", engine.name, was, detail)
        else:
            log.warning("engine %s is %s (was %s): %s", engine.name, state, was, detail)
