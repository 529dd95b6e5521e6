"""Traces: where each episode's time went, span by span, for ``corral view``.

A player fills an :class:`EpisodeTrace` as it plays (:meth:`EpisodeTrace.span` around a step,
:meth:`EpisodeTrace.add` for a span whose times it measured itself) and, when the episode ends,
hands its spans to a :class:`TraceSink`:

- :class:`TraceWriter` appends them to ``<folder>/traces.jsonl`` (:data:`TRACES_FILE`), one JSON
  object a line (the format :func:`corral.viewer.reader.spans_of` reads);
- :class:`TraceBuffer` keeps the lines in memory, for a caller that learns its folder only at
  the end (an eval: :func:`corral.rollouts.evals.write_eval` writes them).

Contracts:

- an episode's spans are written together, when it ends, in one write under a lock: a line is
  never half a span, the file never half an episode, whatever runs concurrently in the process
  (threads or tasks);
- bounded: a span's string attributes are cut to ``max_attr_chars``; once the next episode
  would take the file past ``max_bytes`` (default :data:`MAX_TRACE_BYTES`) nothing more is
  written but one final marker line (``{"truncated": true, ...}``, no ``name``/``start_s``,
  which the reader skips);
- a sink never raises into the episode: a write that fails is logged once and the sink stops.

Times are wall clock (``time.time()``, seconds since the epoch), so that spans recorded by
different processes (the env server's agent run, the player's calls) line up.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

TRACES_FILE = "traces.jsonl"
# The most bytes one traces.jsonl may take: past it a run keeps playing, unrecorded.
MAX_TRACE_BYTES = 256 * 1024 * 1024
# A string attribute (a failure reason, an error) is cut to this many characters.
MAX_ATTR_CHARS = 2000
EPISODE = "episode"

JsonScalar = str | int | float | bool | None

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Span:
    """One timed piece of an episode: ``name`` from ``start_s`` to ``end_s`` (wall clock),
    under ``parent`` (a span name; ``None`` for the episode itself), with scalar ``attrs``.
    The episode is named by ``session_id`` (its gateway session) and ``task_id`` +
    ``attempt``."""

    name: str
    start_s: float
    end_s: float
    parent: str | None = None
    attrs: Mapping[str, JsonScalar] = field(default_factory=dict)
    session_id: str | None = None
    task_id: str | None = None
    attempt: int | None = None

    def line(self, max_attr_chars: int = MAX_ATTR_CHARS) -> str:
        """This span as one ``traces.jsonl`` line (newline included), its attrs bounded."""
        data = asdict(self)
        data["attrs"] = {str(k): _bounded(v, max_attr_chars) for k, v in self.attrs.items()}
        return json.dumps(data, separators=(",", ":")) + "\n"


def _bounded(value: object, max_chars: int) -> JsonScalar:
    """``value`` as a JSON scalar: strings cut to ``max_chars``, a non-finite float and
    anything not scalar as its (cut) text."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


class TraceSink(Protocol):
    """Where an ended episode's spans go. ``write`` never raises."""

    def write(self, spans: Sequence[Span]) -> None: ...


class EpisodeTrace:
    """The spans of one episode, recorded as it plays. ``session_id`` may be set once the
    session is open; :meth:`spans` stamps every span with the episode's ids. Not thread-safe:
    one episode is played by one task."""

    def __init__(self, *, task_id: str | None, attempt: int | None = None) -> None:
        self.task_id = task_id
        self.attempt = attempt
        self.session_id: str | None = None
        self.started_s = time.time()
        self._spans: list[tuple[str, float, float, str | None, dict[str, JsonScalar]]] = []

    def add(
        self,
        name: str,
        start_s: float,
        end_s: float,
        attrs: Mapping[str, JsonScalar] | None = None,
        *,
        parent: str | None = EPISODE,
        **more: JsonScalar,
    ) -> dict[str, JsonScalar]:
        """Record a finished span with the given times and ``attrs`` (plus ``more``); its
        attrs, which the caller may still add to until :meth:`spans` (a model call's weight
        version, known at the end)."""
        kept = {**(attrs or {}), **more}
        self._spans.append((name, start_s, max(end_s, start_s), parent, kept))
        return kept

    @contextlib.contextmanager
    def span(
        self, name: str, *, parent: str | None = EPISODE, **attrs: JsonScalar
    ) -> Iterator[dict[str, JsonScalar]]:
        """Time the block as span ``name``; yields its attrs to add to. A block that raises
        is recorded with ``error`` (the exception, which goes on)."""
        kept = dict(attrs)
        start = time.time()
        try:
            yield kept
        except Exception as exc:
            kept.setdefault("error", f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._spans.append((name, start, time.time(), parent, kept))

    def spans(self, episode_attrs: Mapping[str, JsonScalar] | None = None) -> list[Span]:
        """Every span recorded, the ``episode`` span (from :attr:`started_s` to now, with
        ``episode_attrs``) first."""
        ids = (self.session_id, self.task_id, self.attempt)
        whole = Span(EPISODE, self.started_s, time.time(), None, dict(episode_attrs or {}), *ids)
        return [whole] + [Span(n, s, e, p, dict(a), *ids) for n, s, e, p, a in self._spans]


@dataclass
class _Bound:
    """The byte budget shared by the sinks: whole episodes while they fit, then one marker."""

    max_bytes: int
    used: int = 0
    full: bool = False

    def take(self, chunk: str) -> str:
        """What of ``chunk`` (an episode's lines) may be written: all of it, or (once, when it
        does not fit) the marker, or nothing."""
        if self.full:
            return ""
        size = len(chunk.encode())
        marker = self.marker()
        if self.used + size + len(marker.encode()) <= self.max_bytes:
            self.used += size
            return chunk
        self.full = True
        if self.used + len(marker.encode()) > self.max_bytes:
            return ""  # a cap smaller than the marker: not even that fits
        self.used += len(marker.encode())
        return marker

    def marker(self) -> str:
        return json.dumps({
            "truncated": True,
            "max_bytes": self.max_bytes,
            "note": f"{TRACES_FILE} reached its cap; later episodes were not traced",
        }) + "\n"  # fmt: skip


class TraceWriter:
    """Appends episodes' spans to ``folder/traces.jsonl`` (module docstring for the
    contracts). The file is started afresh when the writer is made (the folder's other files
    are rewritten by each run too); thread- and task-safe."""

    def __init__(
        self,
        folder: Path,
        *,
        max_bytes: int = MAX_TRACE_BYTES,
        max_attr_chars: int = MAX_ATTR_CHARS,
    ) -> None:
        self.path = folder / TRACES_FILE
        self.max_attr_chars = max_attr_chars
        self._bound = _Bound(max_bytes)
        self._lock = threading.Lock()
        self._failed = False
        with self._lock:
            self._guarded(self._start)

    def write(self, spans: Sequence[Span]) -> None:
        if not spans:
            return
        chunk = "".join(s.line(self.max_attr_chars) for s in spans)
        with self._lock:
            if self._failed or not (text := self._bound.take(chunk)):
                return
            self._guarded(functools.partial(self._append, text))

    def write_lines(self, lines: Sequence[str]) -> None:
        """Lines a :class:`TraceBuffer` kept (each whole episodes' lines, or its marker)."""
        with self._lock:
            for chunk in lines:
                if self._failed or not (text := self._bound.take(chunk)):
                    return
                self._guarded(functools.partial(self._append, text))

    def _start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"")

    def _append(self, text: str) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(text)

    def _guarded(self, write: Callable[[], object]) -> None:
        """Run ``write``; an OSError is logged (once) and stops the writer: tracing must
        never fail an episode."""
        try:
            write()
        except OSError as exc:
            if not self._failed:
                _log.warning("traces: cannot write %s (%s); tracing stops", self.path, exc)
            self._failed = True


class TraceBuffer:
    """Episodes' spans kept in memory as ``traces.jsonl`` text, bounded as a
    :class:`TraceWriter` is, for a caller that knows its folder only at the end:
    ``TraceWriter(folder).write_lines(buffer.chunks)`` writes them there."""

    def __init__(
        self, *, max_bytes: int = MAX_TRACE_BYTES, max_attr_chars: int = MAX_ATTR_CHARS
    ) -> None:
        self.max_attr_chars = max_attr_chars
        self.chunks: list[str] = []  # one per episode (the last may be the marker)
        self._bound = _Bound(max_bytes)
        self._lock = threading.Lock()

    def write(self, spans: Sequence[Span]) -> None:
        if not spans:
            return
        chunk = "".join(s.line(self.max_attr_chars) for s in spans)
        with self._lock:
            if text := self._bound.take(chunk):
                self.chunks.append(text)
