"""Reasoning parsers: split ``<think>...</think>`` off model output (Qwen3, DeepSeek-R1).

Qwen3 renders a thinking turn as ``<think>\\n{reasoning}\\n</think>\\n\\n{content}``; the parser
inverts that: one newline on each side of the reasoning and the newlines that open the content
are dropped. Cases:

- the output opens with ``<think>`` (after optional whitespace): reasoning up to ``</think>``;
- ``starts_in_reasoning=True``: the generation prompt already opened ``<think>`` (DeepSeek-R1,
  Qwen3 thinking models), so the output starts inside the reasoning and only has ``</think>``;
  a redundant leading ``<think>`` is dropped;
- no think block: everything is content, unchanged, and reasoning is None;
- an unclosed think (e.g. truncated by ``max_tokens``): everything is reasoning, content is "".

Empty reasoning is reported as None. ``parse`` is one streaming pass over the whole text, so the
streamer's deltas concatenate to ``parse``'s result however the text is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "NoReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStreamer",
    "ThinkReasoningParser",
    "get_reasoning_parser",
    "reasoning_parser_names",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningDelta:
    """What one delta made safe to show: reasoning text and content text (either may be "")."""

    reasoning: str = ""
    content: str = ""


class ReasoningStreamer(Protocol):
    """Streams one output: ``feed`` each text delta, then ``finish`` once."""

    def feed(self, text_delta: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...


class ReasoningParser(Protocol):
    """Splits reasoning from content. Stateless: one instance serves every request."""

    name: str

    def parse(self, text: str, *, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
        """``(reasoning or None, content)`` of a whole output."""
        ...

    def streamer(self, *, starts_in_reasoning: bool = False) -> ReasoningStreamer:
        """A fresh streaming parser for one output."""
        ...


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest proper suffix of ``buf`` that is a prefix of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


class _ThinkStreamer:
    """State machine: start -> (reasoning_open -> reasoning -> content_open ->) content.

    Held back at any time: leading whitespace and a partial ``<think>`` at the start, a partial
    ``</think>`` plus the one newline before it inside reasoning, leading newlines of content.
    """

    def __init__(self, *, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._state = "start"
        self._buf = ""
        self._finished = False

    def feed(self, text_delta: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text_delta
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        if self._finished:
            return ReasoningDelta()
        self._finished = True
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._state == "start":
                body = buf.lstrip()
                if body.startswith(THINK_OPEN):
                    self._buf = body[len(THINK_OPEN) :]
                    self._state = "reasoning_open"
                    continue
                if not final and THINK_OPEN.startswith(body):
                    break  # still could be "<think>"
                self._state = "reasoning_open" if self._starts_in_reasoning else "content"
                continue
            if self._state == "reasoning_open":
                if not buf and not final:
                    break
                if buf.startswith("\n"):
                    self._buf = buf[1:]
                self._state = "reasoning"
                continue
            if self._state == "reasoning":
                i = buf.find(THINK_CLOSE)
                if i >= 0:
                    text = buf[:i]
                    reasoning.append(text[:-1] if text.endswith("\n") else text)
                    self._buf = buf[i + len(THINK_CLOSE) :]
                    self._state = "content_open"
                    continue
                if final:
                    reasoning.append(buf)
                    self._buf = ""
                    break
                cut = len(buf) - _partial_suffix(buf, THINK_CLOSE)
                if cut and buf[cut - 1] == "\n":
                    cut -= 1  # the newline the template puts before </think>
                reasoning.append(buf[:cut])
                self._buf = buf[cut:]
                break
            if self._state == "content_open":
                body = buf.lstrip("\n")
                self._buf = body
                if not body and not final:
                    break
                self._state = "content"
                continue
            content.append(buf)
            self._buf = ""
            break
        return ReasoningDelta(reasoning="".join(reasoning), content="".join(content))


class _PassThroughStreamer:
    """Everything is content."""

    def feed(self, text_delta: str) -> ReasoningDelta:
        return ReasoningDelta(content=text_delta)

    def finish(self) -> ReasoningDelta:
        return ReasoningDelta()


def _run(streamer: ReasoningStreamer, text: str) -> tuple[str | None, str]:
    first, last = streamer.feed(text), streamer.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning or None), first.content + last.content


class ThinkReasoningParser:
    """``<think>...</think>`` reasoning (Qwen3, DeepSeek-R1)."""

    name = "qwen3"

    def parse(self, text: str, *, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
        return _run(self.streamer(starts_in_reasoning=starts_in_reasoning), text)

    def streamer(self, *, starts_in_reasoning: bool = False) -> ReasoningStreamer:
        return _ThinkStreamer(starts_in_reasoning=starts_in_reasoning)


class NoReasoningParser:
    """No reasoning format: the whole output is content, reasoning is always None."""

    name = "none"

    def parse(self, text: str, *, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
        return None, text

    def streamer(self, *, starts_in_reasoning: bool = False) -> ReasoningStreamer:
        return _PassThroughStreamer()


_PARSERS: dict[str, type[ThinkReasoningParser] | type[NoReasoningParser]] = {
    "qwen3": ThinkReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
    "none": NoReasoningParser,
}


def reasoning_parser_names() -> list[str]:
    """Every name :func:`get_reasoning_parser` accepts, sorted."""
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; ValueError naming the known parsers otherwise."""
    factory = _PARSERS.get(name)
    if factory is None:
        known = ", ".join(reasoning_parser_names())
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}")
    return factory()
