"""A warm pool: keeps ``size`` started sandboxes of one spec ready, so an episode's
:meth:`WarmPool.acquire` hands one over without waiting for a start.

Contract: ``acquire()`` returns a ready sandbox at once when one is queued and starts a
background refill; when the pool is empty (a burst) it creates one inline (the caller waits for
a start, never fails for the pool's sake). The caller owns what it acquired and closes it.
``aclose()`` stops refilling and closes the sandboxes still queued. Refill failures are logged
and retried after a pause; they never surface in ``acquire``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from corral.sandboxes.base import Sandbox, SandboxError, SandboxProvider, SandboxSpec

log = logging.getLogger(__name__)


class WarmPool:
    """``size`` ready sandboxes of ``spec`` from ``provider``."""

    def __init__(
        self, provider: SandboxProvider, spec: SandboxSpec, size: int, retry_s: float = 1.0
    ) -> None:
        self.provider = provider
        self.spec = spec
        self.size = size
        self.retry_s = retry_s
        self._ready: asyncio.Queue[Sandbox] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._full = asyncio.Event()  # set whenever the queue reaches ``size``
        self._filler: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self, wait: bool = True) -> None:
        """Start filling; with ``wait``, return once ``size`` sandboxes are ready."""
        if self._filler is None:
            self._filler = asyncio.create_task(self._fill())
            self._wake.set()
        if wait:
            await self._full.wait()

    async def _fill(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            self._full.clear()
            while not self._closed and self._ready.qsize() < self.size:
                try:
                    sb = await self.provider.create(self.spec)
                except SandboxError as e:
                    log.warning("warm pool: create failed (%s); retrying", e)
                    await asyncio.sleep(self.retry_s)
                    continue
                if self._closed:
                    await sb.close()
                    return
                self._ready.put_nowait(sb)
            self._full.set()

    async def acquire(self) -> Sandbox:
        """A ready sandbox (queued: no start awaited) or, when none is queued, a new one.
        Raises :class:`SandboxError` after :meth:`aclose` or if the inline create fails."""
        if self._closed:
            raise SandboxError("warm pool is closed")
        if self._filler is None:
            await self.start(wait=False)
        while not self._ready.empty():
            sb = self._ready.get_nowait()
            self._wake.set()
            if await sb.is_alive():
                return sb
            await sb.close()
        self._wake.set()
        return await self.provider.create(self.spec)

    def ready(self) -> int:
        """How many sandboxes are queued now."""
        return self._ready.qsize()

    async def aclose(self) -> None:
        """Stop refilling and close queued sandboxes. Idempotent."""
        self._closed = True
        if self._filler is not None:
            self._filler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._filler
        while not self._ready.empty():
            await self._ready.get_nowait().close()
