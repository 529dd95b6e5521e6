"""Several engines behind one gateway, each session on one of them.

``--engine-url A,B,...`` without a router in front: :class:`SessionAffineEngines` is one
:class:`~corral.engines.client.EngineClient` over a client per engine. A request goes to the
engine its routing key (the gateway's session id) ranks first by rendezvous hashing, so every
turn of a session reaches the engine holding its prefix in cache, sessions spread evenly, and
adding or losing an engine moves only the sessions that ranked it first. With a
:class:`~corral.engines.health.HealthMonitor` (the gateway runs one), engines it holds down or
stale are left out of every ranking: their sessions move to their next engine, and come back
when it is up again (rendezvous hashing gives them the same first choice). A request that
fails on an engine before any of its output reached the caller is sent to the next engine of
its ranking (see :class:`SessionAffineEngines`). A router (smg with ``consistent_hashing``)
does the same job for engines it knows; this is for when there is none.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import suppress
from typing import Any, TypeVar

from corral.engines.client import EngineClient
from corral.engines.errors import EngineError, EngineUnavailable, another_engine_may_retry
from corral.engines.health import HealthMonitor
from corral.engines.protocol import GenerateRequest, GenerateResponse, ModelInfo
from corral.engines.stream import StreamDelta

# Which engine each recent request went to, so that an abort reaches it (an abort for an
# older request goes to every engine).
_RIDS_KEPT = 4096
# How long the abort of a request given up on an engine may take (the engine may be hung).
_ABORT_TIMEOUT_S = 5.0
# Aborts under way in the background, referenced until they finish.
_ABORTING: set[asyncio.Task[None]] = set()

_T = TypeVar("_T")

log = logging.getLogger(__name__)


def rendezvous_order(key: str, names: Sequence[str]) -> list[int]:
    """The indices of ``names`` from the one ``key`` prefers most to the one it prefers least
    (highest random weight hashing: stable, and the same on every gateway)."""

    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{names[i]}\0{key}".encode(), digest_size=8).digest()

    return sorted(range(len(names)), key=weight, reverse=True)


class SessionAffineEngines:
    """One EngineClient over ``engines`` (named by ``names``, their URLs); see the module.

    Routing: a request tries the engines of its key's ranking in order, each at most once;
    with a ``monitor``, only those it holds routable (up, or not checked yet), or all of them
    when it holds none so.

    Failures: a request that fails before any of its output reached the caller is sent to
    the next engine when the failure says nothing against the request itself
    (:func:`~corral.engines.errors.another_engine_may_retry`: the engine could not be
    reached, broke the connection, did not answer in time, answered a 5xx), and, with a
    ``monitor``, when the monitor marks the engine down while the request waits for its
    first output (a hung engine gives up its requests within the monitor's detection time,
    not the client's timeout). The request is aborted on the engine it left, best-effort, in
    the background. For ``generate`` the output is the whole answer, so that covers any
    failure; a ``stream`` that has yielded a delta is the chosen engine's to the end, and its
    failure is raised as is (the caller has seen tokens). When every engine failed, the last
    engine's error is raised; a failure that another engine may not retry (a 4xx, an answer
    that is not the engine's API) is raised at once."""

    def __init__(
        self,
        engines: Sequence[EngineClient],
        names: Sequence[str],
        *,
        monitor: HealthMonitor | None = None,
    ) -> None:
        if not engines or len(engines) != len(names):
            raise ValueError("SessionAffineEngines needs one name per engine, and an engine")
        self.engines = list(engines)
        self.names = list(names)
        # Settable after construction (the gateway builds the monitor over these clients).
        self.monitor = monitor
        self._sent_to: OrderedDict[str, int] = OrderedDict()

    def _ranking(self, req: GenerateRequest) -> list[int]:
        ranking = rendezvous_order(req.routing_key or req.rid or "", self.names)
        monitor = self.monitor
        if monitor is None:
            return ranking
        return [i for i in ranking if monitor.routable(i)] or ranking

    def _remember(self, rid: str | None, index: int) -> None:
        if rid is None:
            return
        self._sent_to[rid] = index
        self._sent_to.move_to_end(rid)
        while len(self._sent_to) > _RIDS_KEPT:
            self._sent_to.popitem(last=False)

    async def _unless_down(self, index: int, work: Awaitable[_T]) -> _T:
        """``work``'s result, or ``EngineUnavailable`` if the monitor marks engine ``index``
        down first (``work`` is then cancelled)."""
        monitor = self.monitor
        if monitor is None or not monitor.routable(index):
            return await work
        down = monitor.down_signal(index)
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
            raise EngineUnavailable(
                f"the engine at {self.names[index]} was marked down by its health check "
                "before it answered"
            )
        return task.result()

    def _abort_left(self, index: int, rid: str | None, error: EngineError) -> None:
        """Abort ``rid`` on engine ``index``, which it left after ``error``, in the
        background; one INFO line (the caller saw nothing, the gateway logs nothing)."""
        log.info("request %s leaves the engine at %s: %s", rid, self.names[index], error)
        if rid is None:
            return
        task = asyncio.ensure_future(self._abort_quietly(self.engines[index], rid))
        _ABORTING.add(task)
        task.add_done_callback(_ABORTING.discard)

    @staticmethod
    async def _abort_quietly(engine: EngineClient, rid: str) -> None:
        with suppress(EngineError, TimeoutError):
            await asyncio.wait_for(engine.abort(rid), _ABORT_TIMEOUT_S)

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        error: EngineError | None = None
        for index in self._ranking(req):
            self._remember(req.rid, index)
            try:
                return await self._unless_down(index, self.engines[index].generate(req))
            except EngineError as exc:
                if not another_engine_may_retry(exc):
                    raise
                error = exc
                self._abort_left(index, req.rid, exc)
        assert error is not None
        raise error

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamDelta]:
        error: EngineError | None = None
        for index in self._ranking(req):
            self._remember(req.rid, index)
            deltas = aiter(self.engines[index].stream(req))
            try:
                try:
                    first = await self._unless_down(index, _next(deltas))
                except StopAsyncIteration:
                    return
                except EngineError as exc:
                    if not another_engine_may_retry(exc):
                        raise
                    error = exc
                    self._abort_left(index, req.rid, exc)
                    continue
                # From here on the caller has output: this engine's to the end.
                yield first
                async for delta in deltas:
                    yield delta
                return
            finally:
                close: Any = getattr(deltas, "aclose", None)
                # Still running (a cancelled first read winding down): it closes itself.
                if close is not None:
                    with suppress(RuntimeError):
                        await close()
        assert error is not None
        raise error

    async def abort(self, rid: str) -> None:
        index = self._sent_to.get(rid)
        targets = self.engines if index is None else [self.engines[index]]
        for engine in targets:
            await engine.abort(rid)

    async def health(self) -> bool:
        """Healthy while any engine is: sessions on a dead one move to the next. With a
        monitor that has finished a round: whether it holds any engine up (no request)."""
        monitor = self.monitor
        if monitor is not None and monitor.rounds > 0:
            return bool(monitor.up())
        for engine in self.engines:
            if await engine.health():
                return True
        return False

    def engine_states(self) -> list[dict[str, Any]] | None:
        """Each engine's state as the monitor holds it, for the gateway's unauthenticated
        ``/health``: by position in ``--engine-url``, never its URL or the words of its last
        error (those can name hosts; the log has them); None without a monitor."""
        if self.monitor is None:
            return None
        return [
            {
                "engine": i,
                "state": e["state"],
                "weight_version": e["weight_version"],
                "since_s": e["since_s"],
            }
            for i, e in enumerate(self.monitor.snapshot())
        ]

    async def get_model_info(self) -> ModelInfo:
        """The first reachable engine's (they serve one model), the monitor's up ones first."""
        order = list(range(len(self.engines)))
        if self.monitor is not None:
            up = self.monitor.up()
            order = up + [i for i in order if i not in up]
        error: EngineUnavailable | None = None
        for index in order:
            try:
                return await self.engines[index].get_model_info()
            except EngineUnavailable as exc:
                error = exc
        assert error is not None
        raise error

    async def aclose(self) -> None:
        for engine in self.engines:
            await engine.aclose()


async def _next(deltas: AsyncIterator[StreamDelta]) -> StreamDelta:
    return await anext(deltas)
