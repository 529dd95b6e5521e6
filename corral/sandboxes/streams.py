"""Turn a process's output, arriving in chunks from wherever a backend gets it (a socket's
frames, an SDK's callbacks, a reader thread), into what :class:`~.base.SandboxProcess` offers:
whole stdout lines, and the tail of stderr."""

from __future__ import annotations

import asyncio

from corral.sandboxes.base import MAX_LINE, STDERR_TAIL, SandboxError


class LineBuffer:
    """Stdout chunks in, lines out; stderr chunks kept as a bounded tail.

    Producers call :meth:`feed`, :meth:`add_stderr` and, at end of stream, :meth:`close`, all
    on the event loop's thread (a thread producer goes through ``loop.call_soon_threadsafe``).
    One consumer awaits :meth:`readline`. Memory stays bounded: once an unfinished line grows
    past ``max_line`` bytes the stream is marked broken, what is held is dropped, and every
    later :meth:`readline` raises.
    """

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buf = bytearray()
        self._tail = bytearray()
        self._max_line = max_line
        self._more = asyncio.Event()
        self._overflow = False
        self.closed = False

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        self._buf += chunk
        if len(self._buf) - (self._buf.rfind(b"\n") + 1) > self._max_line:
            self._overflow = True
            self._buf.clear()
        self._more.set()

    def add_stderr(self, chunk: bytes) -> None:
        self._tail += chunk
        del self._tail[:-STDERR_TAIL]

    def close(self) -> None:
        """End of stream: :meth:`readline` returns what is left, then ``b""``."""
        self.closed = True
        self._more.set()

    async def readline(self) -> bytes:
        """The next line, newline included; a last unterminated line at end of stream; ``b""``
        after that. :class:`SandboxError` once a line went over ``max_line`` bytes."""
        while True:
            if self._overflow:
                raise SandboxError(f"a line of output is over {self._max_line} bytes")
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[: end + 1])
                del self._buf[: end + 1]
                return line
            if self.closed:
                line = bytes(self._buf)
                self._buf.clear()
                return line
            self._more.clear()
            await self._more.wait()

    def stderr_tail(self) -> str:
        return self._tail.decode(errors="replace")
