"""The session journal on its own: a store journalled to a folder, then a new store rebuilt from
it, compared field by field; compaction, torn and damaged records, segments, write failures,
group commit, and the value codec. Real files in a temporary folder; no gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from corral.gateway.dialects.openai_responses import KeptResponse
from corral.gateway.history import TurnConversation, message_key
from corral.gateway.journal import JournalCorrupt, SessionJournal
from corral.gateway.journal_codec import ValueDecodeError, decode_value, encode_value
from corral.gateway.recording import TurnRecord
from corral.gateway.sessions import Session, SessionNotFound, SessionOptions, SessionStore
from corral.gateway.turns import (
    ChoiceFinished,
    ChoiceResult,
    Finish,
    Message,
    StreamedAnswer,
    TextDelta,
    ThinkingDelta,
    TokenLogprob,
    Tool,
    ToolCall,
    TopToken,
    TurnFinished,
    TurnResult,
    TurnStarted,
    Usage,
)
from tests.test_recording import dec, make_turn, msg
from tests.test_sessions import FakeClock, make_store


def journalled(folder: Path, clock: FakeClock | None = None, **kw: Any) -> SessionStore:
    store = make_store(clock=clock or FakeClock())
    SessionJournal(folder, **kw).restore_into(store)
    return store


def result(text: str) -> TurnResult:
    return TurnResult(
        id="chatcmpl-1",
        created=7,
        model="m",
        choices=(
            ChoiceResult(
                index=0,
                content=text,
                reasoning=None,
                tool_calls=(ToolCall(id="c1", name="add", arguments='{"a": 1}'),),
                finish=Finish(reason="tool_calls"),
                logprobs=(TokenLogprob("x", -0.25, (TopToken("x", -0.25), TopToken("y", -2.0))),),
                output_tokens=3,
            ),
        ),
        usage=Usage(prompt_tokens=10, completion_tokens=3),
    )


def conversation(messages: list[dict[str, Any]], reply: str, prompt: int) -> TurnConversation:
    keys = tuple(message_key(Message(role=m["role"], content=m["content"])) for m in messages)
    return TurnConversation(
        keys=(*keys, message_key(Message(role="assistant", content=reply))),
        tools=(Tool(name="add", parameters={"type": "object", "properties": {}}),),
        kwargs="{}",
        label=None,
        prompt_length=prompt,
        output_length=len(reply),
        finish="stop",
    )


def with_lazy_starts(turn: TurnRecord) -> TurnRecord:
    """The turn as the pipeline makes it: message positions found only when asked."""
    starts = list(turn.message_starts)  # type: ignore[arg-type]

    def message_at(position: int) -> int:
        return max(i for i, s in enumerate(starts) if s <= position)

    return dataclasses.replace(turn, message_starts=message_at, history="tokens")


def play(session: Session) -> None:
    """Appends, a fork (lazy message starts), n=2 siblings, a regeneration; reward, failure,
    remembered answers, a kept response."""
    history = [msg("system", "be brief"), msg("user", "add 2 and 3")]
    for k, answer in enumerate(["call add(2,3)|", "it is 5|"]):
        turn = with_lazy_starts(make_turn(history, answer, weight_version=f"v{k}"))
        session.record(turn, conversation(history, answer, len(turn.prompt_ids)))
        history = [*history, msg("assistant", answer.removesuffix("|")), msg("tool", "5")]
    session.record(with_lazy_starts(make_turn([msg("system", "new"), *history[1:]], "fork|")))
    for text in ("A|", "B|"):
        session.record(make_turn([msg("user", "pick")], text, choice_group="g1"))
    session.record(make_turn(history, "again|", metadata={"history_fallback": "why"}))
    session.set_reward(0.75)
    session.mark_failed("the env died")
    session.remember("chat:abc", result("hello"))
    events = (
        TurnStarted(id="r", created=1, model="m", choices=1, prompt_tokens=3),
        TextDelta(0, "he"),
        ThinkingDelta(0, "he"),
        ChoiceFinished(0, Finish(reason="stop")),
        TurnFinished(result("hello")),
    )
    session.remember("messages:def", StreamedAnswer(result("hi"), events))
    session.keep_response("resp_1", KeptResponse(stored=True, input=({"type": "x"},)))


def state(session: Session) -> dict[str, Any]:
    view = session.view()
    for key in ("age_s", "idle_s", "expires_in_s"):
        view.pop(key)
    return {
        "samples": [s.model_dump() for s in session.samples()],
        "view": view,
        "key": session.api_key,
        "recall": [session.recall("chat:abc"), session.recall("messages:def")],
        "kept": session.kept_response("resp_1"),
        "conversations": [session.conversations.held(i) for i in range(8)],
    }


def test_a_store_rebuilt_from_its_journal_equals_the_original(tmp_path: Path) -> None:
    store = journalled(tmp_path)
    session = store.create(SessionOptions(metadata={"task": "t"}, group_index=3, ttl_s=30))
    play(session)
    other = store.create(SessionOptions())
    other.record(make_turn([msg("user", "q")], "A|"))
    before = {s.id: state(s) for s in (session, other)}
    held = store.held_tokens

    rebuilt = journalled(tmp_path)
    assert len(rebuilt) == 2 and rebuilt.held_tokens == held
    for session_id, expected in before.items():
        again = rebuilt.get(session_id)
        assert state(again) == expected
        assert rebuilt.by_api_key(expected["key"]) is again
        assert again.ttl_s == (30 if session_id == session.id else 60.0)
    # The replay is no new traffic; and the rebuilt store goes on journalling.
    assert rebuilt.stats().turns_total == 0
    again = rebuilt.get(other.id)
    again.record(make_turn([msg("user", "q"), msg("assistant", "A"), msg("user", "r")], "B|"))
    third = journalled(tmp_path)
    assert state(third.get(other.id)) == state(again)
    assert len(third.get(other.id).samples()) == 1


def test_token_history_continues_after_a_rebuild(tmp_path: Path) -> None:
    """The conversation index comes back, so a request continuing it finds its trajectory."""
    store = journalled(tmp_path)
    session = store.create(SessionOptions())
    history = [msg("user", "q")]
    turn = make_turn(history, "A|")
    session.record(turn, conversation(history, "A|", len(turn.prompt_ids)))
    rebuilt = journalled(tmp_path).get(session.id)
    keys = conversation(history, "A|", 0).keys
    match = rebuilt.conversations.find(
        [*keys, keys[0]], conversation(history, "", 0).tools, "{}", None
    )
    assert match is not None and match.held.trajectory == 0 and match.point.reply


def test_ended_sessions_are_compacted_away(tmp_path: Path) -> None:
    clock = FakeClock()
    store = journalled(tmp_path, clock)
    kept, deleted, expiring = (store.create(SessionOptions(ttl_s=t)) for t in (600, 600, 5))
    for s in (kept, deleted, expiring):
        s.record(make_turn([msg("user", "q" * 200)], "A|"))
    store.delete(deleted.id)
    clock.now += 10
    assert store.reap() == [expiring.id]
    with pytest.raises(SessionNotFound):
        store.get(deleted.id)

    size_before = sum(p.stat().st_size for p in tmp_path.iterdir())
    rebuilt = journalled(tmp_path)
    assert [s.id for s in rebuilt.page(limit=10).sessions] == [kept.id]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("segment-")
    assert (tmp_path / files[0]).stat().st_size < size_before / 2


def test_a_torn_last_record_is_dropped_not_trusted(tmp_path: Path, caplog: Any) -> None:
    store = journalled(tmp_path)
    session = store.create(SessionOptions())
    session.record(make_turn([msg("user", "q")], "A|"))
    session.set_reward(1.0)
    (segment,) = tmp_path.glob("segment-*.log")
    data = segment.read_bytes()
    # The reward's record, cut in the middle as a crash mid-write leaves it.
    segment.write_bytes(data[: len(data) - 12])
    journal = SessionJournal(tmp_path)
    rebuilt = make_store()
    restored = journal.restore_into(rebuilt)
    assert restored.torn == 1 and restored.sessions == 1 and restored.turns == 1
    assert rebuilt.get(session.id).reward is None
    assert "torn last record" in caplog.text
    # A whole line whose checksum fails at the very end is torn too.
    rebuilt.get(session.id).set_reward(0.5)
    (segment,) = tmp_path.glob("segment-*.log")
    data = segment.read_bytes()
    segment.write_bytes(data[:-3] + b"X" + data[-2:])
    assert SessionJournal(tmp_path).restore_into(make_store()).torn == 1


def test_a_damaged_record_before_the_end_refuses_the_journal(tmp_path: Path) -> None:
    store = journalled(tmp_path)
    session = store.create(SessionOptions())
    session.record(make_turn([msg("user", "q")], "A|"))
    session.set_reward(1.0)
    (segment,) = tmp_path.glob("segment-*.log")
    lines = segment.read_bytes().split(b"\n")
    assert b'"k":"turn"' in lines[2]
    lines[2] = lines[2].replace(b'"q"', b'"Q"', 1)  # the turn's record: its checksum now fails
    segment.write_bytes(b"\n".join(lines))
    with pytest.raises(JournalCorrupt, match="damaged record before the journal's end"):
        SessionJournal(tmp_path).restore_into(make_store())


def test_segments_roll_over_and_go_once_their_sessions_end(tmp_path: Path) -> None:
    store = journalled(tmp_path, segment_bytes=2_000)
    sessions = [store.create(SessionOptions()) for _ in range(6)]
    for s in sessions:
        s.record(make_turn([msg("user", "x" * 300)], "A|"))
    assert len(list(tmp_path.glob("segment-*.log"))) >= 3
    for s in sessions[:-1]:
        store.delete(s.id)
    # Only segments still holding the last session's records (or the one being written) remain.
    remaining = sorted(tmp_path.glob("segment-*.log"))
    last = sessions[-1].id.encode()
    assert all(last in p.read_bytes() for p in remaining[:-1]) and len(remaining) <= 3
    rebuilt = journalled(tmp_path)
    assert [s.id for s in rebuilt.page(limit=10).sessions] == [sessions[-1].id]


def test_a_crash_mid_compaction_replays_no_session_twice(tmp_path: Path) -> None:
    store = journalled(tmp_path)
    session = store.create(SessionOptions())
    session.record(make_turn([msg("user", "q")], "A|"))
    first = sorted(tmp_path.glob("segment-*.log"))
    saved = {p.name: p.read_bytes() for p in first}
    journalled(tmp_path)  # compacts into a new segment and deletes the old one
    for name, data in saved.items():  # as if the crash came before the deletion
        (tmp_path / name).write_bytes(data)
    (tmp_path / "compacting.tmp").write_bytes(b"half a compaction")
    rebuilt = journalled(tmp_path)
    assert len(rebuilt) == 1 and len(rebuilt.get(session.id).samples()) == 1
    assert not (tmp_path / "compacting.tmp").exists()


def test_a_failed_write_is_reported_and_stops_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    store = journalled(tmp_path)
    session = store.create(SessionOptions())

    def full_disk(fd: int, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    session.record(make_turn([msg("user", "q")], "A|"))  # the turn is not failed
    assert len(session.samples()) == 1
    monkeypatch.undo()
    session.set_reward(1.0)  # nothing more is written: the journal has a hole
    assert "No space left" in caplog.text and "stops here" in caplog.text
    rebuilt = journalled(tmp_path)
    assert rebuilt.get(session.id).samples() == [] and rebuilt.get(session.id).reward is None


def test_always_syncs_once_for_turns_waiting_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = SessionJournal(tmp_path, sync="always")
    store = make_store()
    journal.restore_into(store)
    syncs: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (syncs.append(fd), real_fsync(fd))[1])

    async def main() -> None:
        sessions = [store.create(SessionOptions()) for _ in range(8)]
        await asyncio.gather(*(journal.durable() for _ in sessions))
        assert 1 <= len(syncs) <= 2
        syncs.clear()
        await journal.durable()  # nothing new: no sync
        assert syncs == []

    asyncio.run(main())
    never = SessionJournal(tmp_path / "never", sync="never")
    never.restore_into(make_store())
    syncs.clear()
    asyncio.run(never.durable())
    assert syncs == []


def test_a_journal_replays_into_an_empty_store_only(tmp_path: Path) -> None:
    store = make_store()
    store.create(SessionOptions())
    with pytest.raises(Exception, match="empty session store"):
        SessionJournal(tmp_path).restore_into(store)


@pytest.mark.parametrize(
    "value",
    [
        result("x"),
        StreamedAnswer(result("x"), (TextDelta(0, "a"), ThinkingDelta(0, "a"))),
        KeptResponse(stored=False),
        {"$": "Usage", "$t": [1], 3: "int key"},
        ((1, [2, (3,)]), {"a": (None, True, -0.1)}),
        float("-inf"),
    ],
)
def test_the_codec_gives_back_equal_values_of_the_same_types(value: Any) -> None:
    back = decode_value(encode_value(value))
    assert back == value and type(back) is type(value)
    assert repr(back) == repr(value)  # tuples stay tuples, classes stay classes


def test_the_codec_builds_no_class_it_does_not_know() -> None:
    with pytest.raises(ValueDecodeError, match="unknown value type 'Popen'"):
        decode_value({"$": "Popen", "args": ["rm"]})
    with pytest.raises(TypeError, match="cannot keep"):
        encode_value(object())
    assert dec([104, 105]) == "hi"


def test_any_string_a_client_sends_survives_the_round_trip(tmp_path: Path) -> None:
    """A lone surrogate is valid JSON in a request body; the journal must keep it exactly."""
    store = journalled(tmp_path)
    session = store.create(SessionOptions(metadata={"note": "R \ud800 \u2028 \x00"}))
    turn = make_turn([msg("user", "q \udfff")], "A|")
    session.record(turn)
    rebuilt = journalled(tmp_path).get(session.id)
    assert state(rebuilt) == state(session)
    assert rebuilt.options.metadata["note"] == "R \ud800 \u2028 \x00"


def test_a_record_it_cannot_encode_stops_the_journal_and_says_so(
    tmp_path: Path, caplog: Any
) -> None:
    store = journalled(tmp_path)
    session = store.create(SessionOptions())
    session.record(make_turn([msg("user", "q")], "A|", metadata={"odd": {1, 2}}))
    assert len(session.samples()) == 1  # the turn is recorded in memory all the same
    assert "TypeError encoding a record" in caplog.text and "stops here" in caplog.text
    session.set_reward(1.0)  # after a hole nothing more is written
    rebuilt = journalled(tmp_path).get(session.id)
    assert rebuilt.samples() == [] and rebuilt.reward is None


def test_a_segment_is_synced_before_it_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = SessionJournal(tmp_path, sync="always", segment_bytes=300)
    store = make_store()
    journal.restore_into(store)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for _ in range(3):
        store.create(SessionOptions())  # each past 300 bytes: a new segment
    newest = max(int(p.name[8:14]) for p in tmp_path.glob("segment-*.log"))
    assert newest >= 3
    # Every segment left behind was synced before its fd closed (segment 1, the compaction's,
    # is deleted after that: nothing live was written there).
    for n in range(1, newest):
        assert any(path.endswith(f"segment-{n:06d}.log") for path in synced), (n, synced)
    synced.clear()
    asyncio.run(journal.durable())
    assert len(synced) == 1 and synced[0].endswith(f"segment-{newest:06d}.log")


def test_a_response_kept_after_the_session_closed_is_not_journalled(tmp_path: Path) -> None:
    store = journalled(tmp_path)
    session = store.create(SessionOptions())
    store.delete(session.id)
    before = sum(p.stat().st_size for p in tmp_path.glob("*.log"))
    session.keep_response("resp_late", KeptResponse(stored=True))
    assert sum(p.stat().st_size for p in tmp_path.glob("*.log")) == before
    assert session.kept_response("resp_late") is None
