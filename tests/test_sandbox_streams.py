"""LineBuffer: chunks in, lines out, stderr's tail, bounded memory for an overlong line."""

from __future__ import annotations

import pytest

from corral.sandboxes.base import SandboxError
from corral.sandboxes.streams import LineBuffer


async def test_lines_across_chunks_and_the_last_unterminated_line() -> None:
    out = LineBuffer(max_line=16)
    out.feed(b"ab")
    out.feed(b"c\nde\nf")
    out.close()
    assert [await out.readline() for _ in range(4)] == [b"abc\n", b"de\n", b"f", b""]


async def test_an_overlong_line_breaks_the_stream_and_frees_what_it_held() -> None:
    out = LineBuffer(max_line=8)
    out.feed(b"ok\n" + b"x" * 9)
    assert not out._buf  # dropped, not held: a flood cannot grow memory
    out.feed(b"\nlater\n")  # nothing after a broken line is trusted
    for _ in range(2):
        with pytest.raises(SandboxError, match="over 8 bytes"):
            await out.readline()


def test_the_stderr_tail_is_bounded() -> None:
    out = LineBuffer()
    for _ in range(100):
        out.add_stderr(b"e" * 1024)
    tail = out.stderr_tail()
    assert 0 < len(tail) <= 64 * 1024 and set(tail) == {"e"}
