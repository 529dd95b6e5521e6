"""Several engines behind one gateway, each session on one of them.

``--engine-url A,B,...`` without a router in front: :class:`SessionAffineEngines` is one
:class:`~corral.engines.client.EngineClient` over a client per engine. A request goes to the
engine its routing key (the gateway's session id) ranks first by rendezvous hashing, so every
turn of a session reaches the engine holding its prefix in cache, sessions spread evenly, and
adding or losing an engine moves only the sessions that ranked it first. An engine that cannot
be reached (a connection refused, before it produced anything) is skipped for the next one in
the key's ranking: the session moves, the turn still happens. A router (smg with
``consistent_hashing``) does the same job for engines it knows; this is for when there is none.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

from corral.engines.client import EngineClient
from corral.engines.errors import EngineUnavailable
from corral.engines.protocol import GenerateRequest, GenerateResponse, ModelInfo
from corral.engines.stream import StreamDelta

# Which engine each recent request went to, so that an abort reaches it (an abort for an
# older request goes to every engine).
_RIDS_KEPT = 4096


def rendezvous_order(key: str, names: Sequence[str]) -> list[int]:
    """The indices of ``names`` from the one ``key`` prefers most to the one it prefers least
    (highest random weight hashing: stable, and the same on every gateway)."""

    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{names[i]}\0{key}".encode(), digest_size=8).digest()

    return sorted(range(len(names)), key=weight, reverse=True)


class SessionAffineEngines:
    """One EngineClient over ``engines`` (named by ``names``, their URLs); see the module.

    Failures: an engine that is unreachable before its first output is skipped; when every
    engine is, the last :class:`EngineUnavailable` is raised. Any other failure (a timeout,
    garbage, a stream that breaks midway) is the chosen engine's and is raised as is: the
    work may have started there, and trying again elsewhere could double it."""

    def __init__(self, engines: Sequence[EngineClient], names: Sequence[str]) -> None:
        if not engines or len(engines) != len(names):
            raise ValueError("SessionAffineEngines needs one name per engine, and an engine")
        self.engines = list(engines)
        self.names = list(names)
        self._sent_to: OrderedDict[str, int] = OrderedDict()

    def _ranking(self, req: GenerateRequest) -> list[int]:
        return rendezvous_order(req.routing_key or req.rid or "", self.names)

    def _remember(self, rid: str | None, index: int) -> None:
        if rid is None:
            return
        self._sent_to[rid] = index
        self._sent_to.move_to_end(rid)
        while len(self._sent_to) > _RIDS_KEPT:
            self._sent_to.popitem(last=False)

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        error: EngineUnavailable | None = None
        for index in self._ranking(req):
            self._remember(req.rid, index)
            try:
                return await self.engines[index].generate(req)
            except EngineUnavailable as exc:
                error = exc
        assert error is not None
        raise error

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamDelta]:
        error: EngineUnavailable | None = None
        for index in self._ranking(req):
            self._remember(req.rid, index)
            started = False
            try:
                async for delta in self.engines[index].stream(req):
                    started = True
                    yield delta
                return
            except EngineUnavailable as exc:
                if started:
                    raise
                error = exc
        assert error is not None
        raise error

    async def abort(self, rid: str) -> None:
        index = self._sent_to.get(rid)
        targets = self.engines if index is None else [self.engines[index]]
        for engine in targets:
            await engine.abort(rid)

    async def health(self) -> bool:
        """Healthy while any engine is: sessions on a dead one move to the next."""
        for engine in self.engines:
            if await engine.health():
                return True
        return False

    async def get_model_info(self) -> ModelInfo:
        """The first reachable engine's (they serve one model)."""
        error: EngineUnavailable | None = None
        for engine in self.engines:
            try:
                return await engine.get_model_info()
            except EngineUnavailable as exc:
                error = exc
        assert error is not None
        raise error

    async def aclose(self) -> None:
        for engine in self.engines:
            await engine.aclose()
