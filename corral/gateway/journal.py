"""The session journal: an append-only log of every session's turns and events, from which a
restarted gateway rebuilds every live session exactly and goes on.

What is written (one record per change, :class:`~corral.gateway.sessions.SessionLog`): a
session opened (id, key, options), each recorded turn (what its trajectory gained: the prompt
tokens past what the trajectory held, the output tokens and logprobs, weight version, the new
messages, the reply, the conversation token history keeps, the merger's message lookups), a
reward, a failure, an answer remembered for a client's retry, a stored Responses response, and
the session's end (deleted or expired). Replaying the records through the same
:class:`~corral.gateway.sessions.Session` calls rebuilds the same trajectories token for
token, because merging is deterministic; what a turn's prompt shares with its trajectory is
taken from the trajectory on replay, so a long session's journal grows with what it adds,
not with its length times its turns.

When: a turn's records are written (``os.write`` to the segment, in the OS's hands: a killed
gateway loses nothing) before the client sees the answer's last byte. Durability against a
machine crash is ``sync``: ``always`` syncs before the answer goes out (one fsync covers every
turn waiting for it), ``interval`` every :data:`~corral.gateway.settings.JOURNAL_SYNC_INTERVAL_S`,
``never`` leaves it to the OS.

On disk: ``segment-NNNNNN.log`` files in the folder, each line ``<crc32 hex> <json>``. A new
segment starts past ``segment_bytes``; a closed segment is deleted once every session with
records in it has ended. Opening the journal replays every segment, drops a torn last record
(a crash mid-write: no newline, or a checksum that fails) with a warning, refuses a damaged
record anywhere else (:class:`JournalCorrupt`), and compacts: the live sessions' records go to
one fresh segment that starts with a marker superseding everything before it, so a crash in
the middle of compacting never replays a session twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.gateway.history import TurnConversation
from corral.gateway.journal_codec import ValueDecodeError, decode_value, encode_value
from corral.gateway.options import SessionOptions
from corral.gateway.recording import TurnRecord
from corral.gateway.sessions import RecordedTurn, Session, SessionNotFound, SessionStore
from corral.gateway.settings import JOURNAL_SYNC_INTERVAL_S, JournalSync

log = logging.getLogger(__name__)

SEGMENT_BYTES = 64 * 1024 * 1024
_SEGMENT = re.compile(r"segment-(\d{6,})\.log")
_COMPACTING = "compacting.tmp"


class JournalError(Exception):
    """The journal cannot be used: its folder, a write, or what it holds."""


class JournalCorrupt(JournalError):
    """A record before the journal's last one is damaged: the journal is not replayed (the
    message names the file and line), since going on would silently lose or alter sessions."""


@dataclass(frozen=True, slots=True)
class Restored:
    """What opening a journal found: live sessions rebuilt, their turns, and the records it
    dropped (``torn``: the last one, cut by a crash; ``orphans``: records of sessions whose
    start had been compacted away, which only a session's end can be)."""

    sessions: int
    turns: int
    torn: int
    orphans: int


def _line(record: dict[str, Any]) -> bytes:
    # ASCII escapes: any string a client sends (a lone surrogate included) survives the round
    # trip, where UTF-8 would refuse some.
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> dict[str, Any] | None:
    """The record of one line without its newline, or None when its checksum fails."""
    if len(line) < 10 or line[8:9] != b" ":
        return None
    body = line[9:]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


class SessionJournal:
    """The journal in ``folder`` (made if missing); a :class:`SessionLog` once
    :meth:`restore_into` has attached it to a store.

    Contract: a write that fails (a full disk) is logged, counted in ``write_errors`` and does
    not fail the turn; the journal then stops writing, since a journal with a hole would
    rebuild sessions wrongly, and says so once."""

    def __init__(
        self,
        folder: Path,
        *,
        sync: JournalSync = "interval",
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        self.folder = Path(folder)
        self.sync = sync
        self.segment_bytes = segment_bytes
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JournalError(f"cannot make the journal folder {self.folder}: {exc}") from None
        self.write_errors = 0
        # What the journal cost the gateway's loop (encoding and writing; syncs run in a
        # thread) and what it wrote since it opened: /metrics shows them.
        self.seconds = 0.0
        self.records = 0
        self._fd: int | None = None
        self._segment = 0
        self._size = 0
        self.bytes_written = 0  # since the journal opened (compaction not counted)
        self._synced = 0
        self._syncing: asyncio.Task[None] | None = None
        self._batch: list[tuple[str, bytes]] | None = None
        # Which sessions have records in each segment, and the reverse, so that a segment is
        # deleted once all of them ended.
        self._in_segment: dict[int, set[str]] = {}
        self._segments_of: dict[str, set[int]] = {}

    # -- opening: replay and compaction --------------------------------------------------------

    def restore_into(self, store: SessionStore) -> Restored:
        """Replay the journal into ``store`` (empty), compact it and attach it as the store's
        log. :class:`JournalCorrupt` when a record before the last is damaged,
        :class:`JournalError` when the folder cannot be read or written."""
        if len(store) != 0:
            raise JournalError("a journal replays into an empty session store only")
        (self.folder / _COMPACTING).unlink(missing_ok=True)
        segments = self._segments_on_disk()
        lines: dict[str, list[bytes]] = {}
        turns = orphans = torn = 0
        for segment, line, record, last in self._records(segments):
            if record is None:
                if not last:
                    raise JournalCorrupt(
                        f"{self._path(segment)}: a damaged record before the journal's end; "
                        "move the folder aside to start without it"
                    )
                torn += 1
                log.warning(
                    "journal %s: dropped a torn last record (%d bytes)", self.folder, len(line)
                )
                continue
            kind, session_id = record.get("k"), record.get("s")
            if kind == "compacted" or not isinstance(session_id, str):
                continue
            if kind != "open" and session_id not in lines:
                orphans += 1
                continue
            try:
                self._apply(store, kind, session_id, record)
            except SessionNotFound:  # its TTL ran out during the replay
                lines.pop(session_id, None)
                orphans += 1
                continue
            except (KeyError, TypeError, ValueError, ValueDecodeError) as exc:
                raise JournalCorrupt(
                    f"{self._path(segment)}: a {kind!r} record of session {session_id!r} "
                    f"does not replay ({type(exc).__name__}: {exc})"
                ) from None
            if kind == "close":
                lines.pop(session_id, None)
                continue
            lines.setdefault(session_id, []).append(line)
            turns += kind == "turn"
        store.reset_counters()
        self._compact(segments, lines)
        store.attach_log(self)
        return Restored(sessions=len(lines), turns=turns, torn=torn, orphans=orphans)

    def _segments_on_disk(self) -> list[int]:
        try:
            names = os.listdir(self.folder)
        except OSError as exc:
            raise JournalError(f"cannot read the journal folder {self.folder}: {exc}") from None
        found = sorted(int(m.group(1)) for n in names if (m := _SEGMENT.fullmatch(n)))
        # A compacted segment supersedes every one before it (those may remain if a crash
        # came between its rename and their deletion).
        for index in reversed(found):
            first = self._first_record(index)
            if first is not None and first.get("k") == "compacted":
                for old in found[: found.index(index)]:
                    self._path(old).unlink(missing_ok=True)
                return found[found.index(index) :]
        return found

    def _first_record(self, segment: int) -> dict[str, Any] | None:
        with self._path(segment).open("rb") as f:
            line = f.readline()
        return _parse(line[:-1]) if line.endswith(b"\n") else None

    def _records(
        self, segments: Sequence[int]
    ) -> Iterator[tuple[int, bytes, dict[str, Any] | None, bool]]:
        """Every line of the segments in order: (segment, line with its newline, record or
        None when damaged, whether it is the journal's last line)."""
        for position, segment in enumerate(segments):
            data = self._path(segment).read_bytes()
            lines = data.split(b"\n")
            complete, tail = lines[:-1], lines[-1]
            final_segment = position == len(segments) - 1
            for i, line in enumerate(complete):
                last = final_segment and not tail and i == len(complete) - 1
                yield segment, line + b"\n", _parse(line), last
            if tail:  # no newline: cut by a crash mid-write
                yield segment, tail, None, final_segment

    def _apply(
        self, store: SessionStore, kind: Any, session_id: str, record: dict[str, Any]
    ) -> None:
        if kind == "open":
            options = SessionOptions.model_validate(record["options"])
            store.restore(session_id, record["key"], options, record["ttl"])
            return
        session = store.get(session_id)
        if kind == "turn":
            turn, conversation = _decode_turn(session, record)
            session.record(turn, conversation)
        elif kind == "reward":
            session.set_reward(record["reward"])
        elif kind == "fail":
            session.mark_failed(record["reason"])
        elif kind == "remember":
            session.remember(record["key"], decode_value(record["value"]))
        elif kind == "kept":
            session.keep_response(record["id"], decode_value(record["value"]))
        elif kind == "close":
            store.delete(session_id)
        else:
            raise ValueError(f"unknown record kind {kind!r}")

    def _compact(self, segments: Sequence[int], lines: dict[str, list[bytes]]) -> None:
        """Write the live sessions' records to one new segment, then delete the old ones."""
        segment = (segments[-1] + 1) if segments else 1
        marker = _line({"k": "compacted", "below": segment})
        temporary = self.folder / _COMPACTING
        try:
            with temporary.open("wb") as f:
                f.write(marker)
                for session_lines in lines.values():
                    f.writelines(session_lines)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, self._path(segment))
            self._sync_folder()
            for old in segments:
                self._path(old).unlink(missing_ok=True)
            self._open_segment(segment)
        except OSError as exc:
            raise JournalError(f"cannot compact the journal in {self.folder}: {exc}") from None
        for session_id in lines:
            self._note(session_id)

    # -- writing ---------------------------------------------------------------------------------

    def _path(self, segment: int) -> Path:
        return self.folder / f"segment-{segment:06d}.log"

    def _open_segment(self, segment: int) -> None:
        if self._fd is not None:
            # Synced before it is left: later syncs cover only the segment being written.
            os.fsync(self._fd)
            os.close(self._fd)
            if not self._in_segment.get(self._segment):  # nothing live was written there
                self._in_segment.pop(self._segment, None)
                self._path(self._segment).unlink(missing_ok=True)
        path = self._path(segment)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._segment = segment
        self._size = os.fstat(self._fd).st_size
        self._in_segment.setdefault(segment, set())
        self._sync_folder()

    def _sync_folder(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _note(self, session_id: str) -> None:
        self._in_segment[self._segment].add(session_id)
        self._segments_of.setdefault(session_id, set()).add(self._segment)

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Write the records made inside the block with one ``write`` at its end, so that a
        kill lands before all of them or after all of them (a turn and the answer kept for its
        retry must not be split: a retry would find the turn and no answer, and record it
        twice)."""
        if self._batch is not None:  # nested: the outer block writes
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
            if batch:
                start = time.perf_counter()
                self._append(b"".join(line for _, line in batch), [s for s, _ in batch])
                self.seconds += time.perf_counter() - start

    def _write(self, session_id: str, record: Callable[[], dict[str, Any]]) -> None:
        """Write the record ``record()`` makes (made only when the journal writes at all)."""
        if self._fd is None or self.write_errors:
            return
        start = time.perf_counter()
        try:
            line = _line(record())
        except Exception as exc:  # a value it cannot keep: a hole, so the journal stops
            self._stop(f"a {type(exc).__name__} encoding a record: {exc}")
            return
        if self._batch is not None:
            self._batch.append((session_id, line))
        else:
            self._append(line, [session_id])
        self.records += 1
        self.seconds += time.perf_counter() - start

    def _append(self, line: bytes, session_ids: Sequence[str]) -> None:
        if self._fd is None or self.write_errors:
            return
        try:
            if self._size and self._size + len(line) > self.segment_bytes:
                self._open_segment(self._segment + 1)
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(f"a short write ({written} of {len(line)} bytes)")
        except OSError as exc:
            self._stop(f"a write failed ({exc})")
            return
        self._size += len(line)
        self.bytes_written += len(line)
        for session_id in session_ids:
            self._note(session_id)

    def _stop(self, why: str) -> None:
        self.write_errors += 1
        log.error(
            "journal %s: %s; the journal stops here, and sessions from now on will not "
            "survive a restart",
            self.folder,
            why,
        )

    # -- SessionLog --------------------------------------------------------------------------------

    def opened(self, session: Session) -> None:
        self._write(
            session.id,
            lambda: {
                "k": "open",
                "s": session.id,
                "key": session.api_key,
                "options": session.options.model_dump(mode="json"),
                "ttl": session.ttl_s,
            },
        )

    def recorded(self, session: Session, recorded: RecordedTurn) -> None:
        self._write(session.id, lambda: _encode_turn(session, recorded))

    def rewarded(self, session: Session) -> None:
        self._write(session.id, lambda: {"k": "reward", "s": session.id, "reward": session.reward})

    def failed(self, session: Session) -> None:
        self._write(session.id, lambda: {"k": "fail", "s": session.id, "reason": session.failure})

    def remembered(self, session: Session, key: str, value: Any) -> None:
        self._write(
            session.id,
            lambda: {"k": "remember", "s": session.id, "key": key, "value": encode_value(value)},
        )

    def kept(self, session: Session, response_id: str, value: Any) -> None:
        self._write(
            session.id,
            lambda: {"k": "kept", "s": session.id, "id": response_id, "value": encode_value(value)},
        )

    def closed(self, session_id: str) -> None:
        self._write(session_id, lambda: {"k": "close", "s": session_id})
        for segment in self._segments_of.pop(session_id, ()):
            holders = self._in_segment.get(segment)
            if holders is None:
                continue
            holders.discard(session_id)
            if not holders and segment != self._segment:
                del self._in_segment[segment]
                self._path(segment).unlink(missing_ok=True)

    # -- durability ------------------------------------------------------------------------------

    async def durable(self) -> None:
        """Return once everything written so far is synced, under ``always``; at once
        otherwise. Turns waiting together share one fsync (in a thread, off the loop)."""
        if self.sync != "always":
            return
        target = self.bytes_written
        while self._synced < target and self._fd is not None and not self.write_errors:
            if self._syncing is None:
                self._syncing = asyncio.ensure_future(self._sync_now())
            await asyncio.shield(self._syncing)

    async def _sync_now(self) -> None:
        try:
            upto = self.bytes_written
            if self._fd is not None:
                # A duplicate: the segment may roll over (closing its fd) while this runs.
                fd = os.dup(self._fd)
                try:
                    await asyncio.to_thread(os.fsync, fd)
                finally:
                    os.close(fd)
            self._synced = upto
        except OSError as exc:
            self._stop(f"a sync failed ({exc})")
        finally:
            self._syncing = None

    async def sync_every(self, interval_s: float = JOURNAL_SYNC_INTERVAL_S) -> None:
        """Sync whatever was written, every ``interval_s`` (``interval``: the app runs it)."""
        while True:
            await asyncio.sleep(interval_s)
            if self._synced < self.bytes_written and self._syncing is None:
                self._syncing = asyncio.ensure_future(self._sync_now())
                await asyncio.shield(self._syncing)

    def close(self) -> None:
        """Sync and close the segment (idempotent)."""
        if self._fd is None:
            return
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = None


# -- turns as records ------------------------------------------------------------------------------


def _encode_turn(session: Session, recorded: RecordedTurn) -> dict[str, Any]:
    turn, decision = recorded.turn, recorded.decision
    entry = session.merger.turns[decision.turn]
    prompt = turn.prompt_ids
    # An appended turn's prompt starts with everything its trajectory held: only the rest.
    held = len(prompt) - decision.observation_tokens if decision.action == "append" else 0
    record: dict[str, Any] = {
        "k": "turn",
        "s": session.id,
        "on": decision.trajectory if held else None,
        "held": held,
        "prompt": list(prompt[held:]),
        "output": list(turn.output_ids),
        "logprobs": list(turn.output_logprobs),
        "finish": turn.finish_reason,
        "weights": turn.weight_version,
        # The merger keeps (and reads) an appended turn's messages only from the trajectory's
        # earlier message count on; those before it are the trajectory's already.
        "messages_from": entry.message_offset,
        "messages": turn.messages[entry.message_offset :],
        "messages_count": len(turn.messages),
        "response": turn.response,
        "group": turn.choice_group,
        "metadata": turn.metadata,
        "label": turn.label,
        "history": turn.history,
    }
    if callable(turn.message_starts):
        record["starts"] = [[k, v] for k, v in (recorded.starts or {}).items()]
    else:
        record["message_starts"] = list(turn.message_starts)
    conversation = recorded.conversation
    if conversation is not None:
        record["conversation"] = _encode_conversation(conversation, recorded.previous)
    return record


def _encode_conversation(turn: TurnConversation, previous: Any) -> dict[str, Any]:
    keys_from = 0
    same_tools = False
    if previous is not None:
        same_tools = previous.tools == turn.tools
        if turn.keys[: len(previous.keys)] == previous.keys:
            keys_from = len(previous.keys)
    return {
        "keys_from": keys_from,
        "keys": encode_value(turn.keys[keys_from:]),
        "tools": None if same_tools else encode_value(turn.tools),
        "kwargs": turn.kwargs,
        "label": turn.label,
        "prompt_length": turn.prompt_length,
        "output_length": turn.output_length,
        "finish": turn.finish,
    }


class _AnsweredStarts:
    """A replayed turn's ``message_starts``: the merger's lookups, answered as they were."""

    __slots__ = ("asked",)

    def __init__(self, asked: dict[int, int]) -> None:
        self.asked = asked

    def __call__(self, position: int) -> int:
        if position not in self.asked:
            raise ValueError(f"the journal has no message position for token {position}")
        return self.asked[position]


def _decode_turn(
    session: Session, record: dict[str, Any]
) -> tuple[TurnRecord, TurnConversation | None]:
    held: int = record["held"]
    prompt: list[int] = record["prompt"]
    if held:
        tokens = session.merger.trajectories[record["on"]].tokens
        if len(tokens) != held:
            raise ValueError(
                f"the turn extends trajectory {record['on']} at token {held}, which holds "
                f"{len(tokens)}"
            )
        prompt = [*tokens, *prompt]
    offset: int = record["messages_from"]
    # Placeholders for the messages the trajectory holds already (never read: see encoding).
    messages = [{} for _ in range(offset)] + list(record["messages"])
    if len(messages) != record["messages_count"]:
        raise ValueError("the turn's message count does not add up")
    starts: Any
    if "message_starts" in record:
        starts = record["message_starts"]
    else:
        starts = _AnsweredStarts({int(k): int(v) for k, v in record["starts"]})
    turn = TurnRecord(
        prompt_ids=prompt,
        output_ids=record["output"],
        output_logprobs=record["logprobs"],
        finish_reason=record["finish"],
        weight_version=record["weights"],
        messages=messages,
        message_starts=starts,
        response=record["response"],
        choice_group=record["group"],
        metadata=record["metadata"],
        label=record["label"],
        history=record["history"],
    )
    conversation = None
    if "conversation" in record:
        conversation = _decode_conversation(session, record)
    return turn, conversation


def _decode_conversation(session: Session, record: dict[str, Any]) -> TurnConversation:
    data = record["conversation"]
    keys = decode_value(data["keys"])
    tools = decode_value(data["tools"]) if data["tools"] is not None else None
    keys_from = data["keys_from"]
    if keys_from or tools is None:
        # Which trajectory the turn went to is known only once it is merged: the one its
        # prompt extends, or a new one; the conversation index holds the previous one by it.
        trajectory = record["on"] if record["held"] else len(session.merger.trajectories)
        previous = session.conversations.held(trajectory)
        if previous is None:
            raise ValueError("the turn continues a conversation the journal does not hold")
        keys = (*previous.keys[:keys_from], *keys)
        if tools is None:
            tools = previous.tools
    return TurnConversation(
        keys=tuple(keys),
        tools=tuple(tools),
        kwargs=data["kwargs"],
        label=data["label"],
        prompt_length=data["prompt_length"],
        output_length=data["output_length"],
        finish=data["finish"],
    )
