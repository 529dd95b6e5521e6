"""Sessions and the session store: options, caps, expiry on an injected clock, closing, samples."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from corral.gateway.sessions import (
    REPLAY_CACHE_SIZE,
    SessionClosed,
    SessionNotFound,
    SessionOptions,
    SessionStore,
    StoreFull,
)
from tests.test_recording import dec, make_turn, msg


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(
    *,
    max_sessions: int = 10,
    max_held_tokens: int = 100_000,
    default_ttl_s: float | None = 60.0,
    clock: FakeClock | None = None,
) -> SessionStore:
    return SessionStore(
        max_sessions=max_sessions,
        max_held_tokens=max_held_tokens,
        default_ttl_s=default_ttl_s,
        clock=clock or FakeClock(),
        decode=dec,
    )


def test_options_validate_sampling() -> None:
    options = SessionOptions.model_validate(
        {"sampling": {"temperature": 0.5, "stop": "END", "seed": 3}, "ttl_s": 5}
    )
    assert options.sampling == {"temperature": 0.5, "stop": ["END"], "seed": 3}
    with pytest.raises(ValidationError, match="unknown sampling override"):
        SessionOptions.model_validate({"sampling": {"temprature": 0.5}})
    with pytest.raises(ValidationError, match="top_p"):
        SessionOptions.model_validate({"sampling": {"top_p": 2.0}})
    with pytest.raises(ValidationError, match="top_k"):
        SessionOptions.model_validate({"sampling": {"top_k": 0}})
    with pytest.raises(ValidationError, match="Extra inputs"):
        SessionOptions.model_validate({"samplng": {}})


def test_session_records_and_samples() -> None:
    store = make_store()
    options = SessionOptions(metadata={"task": "t1"}, group_index=7)
    session = store.create(options)
    history = [msg("user", "q")]
    first = make_turn(history, "A|", weight_version="w1", metadata={"parser_error": "x"})
    second_history = [*history, msg("assistant", "A"), msg("tool", "r")]
    second = make_turn(second_history, "B|", weight_version="w2", finish="length")
    assert session.record(first).action == "start"
    assert session.record(second).action == "append"
    session.record(make_turn([msg("system", "new")], "C|"))  # a fork
    session.set_reward(0.75)

    samples = session.samples()
    assert len(samples) == 2
    main, fork = samples
    assert main.tokens == list(second.prompt_ids) + list(second.output_ids)
    assert main.status == "truncated" and fork.status == "completed"
    assert [s.reward for s in samples] == [0.75, 0.75]
    assert [s.rollout_id for s in samples] == [session.id, session.id]
    assert [s.index for s in samples] == [0, 1]
    assert [s.group_index for s in samples] == [7, 7]
    assert main.metadata["task"] == "t1"
    assert main.metadata["weight_versions"] == ["w1", "w2"]
    assert main.metadata["turn_metadata"] == [{"turn": 0, "parser_error": "x"}]
    assert main.metadata["drift"] is None
    assert fork.metadata["drift"]["reason"] == "diverged"
    assert fork.metadata["origin"] == "diverged"

    report = session.drift_report()
    assert (report["turns"], report["merges"], report["forks"]) == (3, 1, 1)
    assert len(report["events"]) == 1

    view = session.view()
    assert [t["action"] for t in view["turns"]] == ["start", "append", "start"]
    assert view["reward"] == 0.75 and view["held_tokens"] == session.held_tokens
    assert session.api_key not in repr(view)


def test_index_option_and_failure() -> None:
    session = make_store().create(SessionOptions(index=42))
    session.record(make_turn([msg("user", "q")], "A|", finish="abort"))
    (sample,) = session.samples()
    assert sample.index == 42 and sample.status == "aborted"
    assert sample.reward is None
    session.mark_failed("env crashed")
    (sample,) = session.samples()
    assert sample.status == "failed" and sample.metadata["failure"] == "env crashed"
    with pytest.raises(ValueError, match="finite"):
        session.set_reward(float("nan"))


def test_session_cap() -> None:
    store = make_store(max_sessions=2)
    store.create(SessionOptions())
    second = store.create(SessionOptions())
    with pytest.raises(StoreFull, match="max_sessions=2"):
        store.create(SessionOptions())
    store.delete(second.id)
    store.create(SessionOptions())


def test_token_cap() -> None:
    store = make_store(max_held_tokens=100)
    session = store.create(SessionOptions())
    store.check_capacity(100)
    with pytest.raises(StoreFull, match="max_held_tokens=100"):
        store.check_capacity(101)
    turn = make_turn([msg("user", "x" * 90)], "A|")
    session.record(turn)  # recording is not refused: the tokens were already generated
    assert store.held_tokens == len(turn.prompt_ids) + 2 > 100
    with pytest.raises(StoreFull, match="tokens"):
        store.check_capacity(1)
    with pytest.raises(StoreFull, match="max_held_tokens"):
        store.create(SessionOptions())
    store.delete(session.id)
    assert store.held_tokens == 0
    store.create(SessionOptions())


def test_ttl_counts_from_last_use() -> None:
    clock = FakeClock()
    store = make_store(clock=clock, default_ttl_s=10.0)
    session = store.create(SessionOptions())
    short = store.create(SessionOptions(ttl_s=3.0))
    forever = SessionStore(10, 1000, None, clock=clock).create(SessionOptions())
    clock.now += 5
    assert store.get(session.id) is session  # a use: the TTL restarts
    with pytest.raises(SessionNotFound, match="expired"):
        store.get(short.id)
    assert short.closed
    clock.now += 8  # 13 s after creation, 8 s after last use
    assert store.by_api_key(session.api_key) is session
    clock.now += 10
    assert store.reap() == [session.id]
    assert session.closed and len(store) == 0
    with pytest.raises(SessionNotFound):
        store.get(session.id)
    with pytest.raises(SessionNotFound):
        store.by_api_key(session.api_key)
    assert store.stats().expired_total == 2
    assert not forever.is_expired(clock.now + 1e9)


def test_recording_counts_as_use() -> None:
    clock = FakeClock()
    store = make_store(clock=clock, default_ttl_s=10.0)
    session = store.create(SessionOptions())
    clock.now += 9
    session.record(make_turn([msg("user", "q")], "A|"))
    clock.now += 9
    assert store.reap() == []


def test_delete_then_late_record() -> None:
    store = make_store()
    session = store.create(SessionOptions())
    session.record(make_turn([msg("user", "q")], "A|"))
    store.delete(session.id)
    late = make_turn([msg("user", "q"), msg("assistant", "A"), msg("user", "r")], "B|")
    with pytest.raises(SessionClosed):
        session.record(late)
    with pytest.raises(SessionClosed):
        session.set_reward(1.0)
    with pytest.raises(SessionNotFound):
        store.get(session.id)
    with pytest.raises(SessionNotFound):
        store.by_api_key(session.api_key)
    with pytest.raises(SessionNotFound):
        store.delete(session.id)
    stats = store.stats()
    assert (stats.sessions, stats.held_tokens, stats.turns_total) == (0, 0, 1)
    assert stats.deleted_total == 1


def test_replay_cache_is_bounded() -> None:
    session = make_store().create(SessionOptions())
    for i in range(REPLAY_CACHE_SIZE + 8):
        session.remember(f"k{i}", {"n": i})
    assert all(session.recall(f"k{i}") is None for i in range(8))
    assert all(session.recall(f"k{i}") == {"n": i} for i in range(8, REPLAY_CACHE_SIZE + 8))
    session.remember("k8", {"n": "again"})  # refreshed: now the newest
    session.remember("new", {})
    assert session.recall("k8") == {"n": "again"} and session.recall("k9") is None


def test_stats_count_decisions() -> None:
    store = make_store()
    a = store.create(SessionOptions())
    b = store.create(SessionOptions())
    history = [msg("user", "q")]
    a.record(make_turn(history, "A|"))
    a.record(make_turn([*history, msg("assistant", "A"), msg("user", "r")], "B|"))
    b.record(make_turn(history, "X|", choice_group="g"))
    b.record(make_turn(history, "Y|", choice_group="g"))
    stats = store.stats()
    assert (stats.sessions, stats.turns_total, stats.merges_total, stats.forks_total) == (
        2,
        4,
        1,
        1,
    )
    assert stats.decisions_by_reason == {"first_turn": 2, "extends": 1, "sibling_choice": 1}
    assert stats.held_tokens == a.held_tokens + b.held_tokens
    assert stats.created_total == 2


def test_pages_list_every_open_session_oldest_first_and_never_a_key() -> None:
    clock = FakeClock()
    store = make_store(clock=clock)
    made = [
        store.create(SessionOptions(metadata={"task_id": f"t{i}"}, group_index=i)) for i in range(5)
    ]
    store.delete(made[1].id)
    made[2].record(make_turn([msg("user", "q")], "A|"))
    made[3].mark_failed("env: it died")
    clock.now += 7.0
    first = store.page(limit=2)
    assert [s.id for s in first.sessions] == [made[0].id, made[2].id]
    assert first.total == 4 and first.next == made[2].id
    rest = store.page(limit=2, after=first.next)
    assert [s.id for s in rest.sessions] == [made[3].id, made[4].id] and rest.next is None
    two = first.sessions[1]
    assert (two.turns, two.trajectories, two.metadata, two.group_index) == (
        1,
        1,
        {"task_id": "t2"},
        2,
    )
    assert two.age_s == 7.0 and rest.sessions[0].failure == "env: it died"
    listed = store.page(limit=10).model_dump_json()
    assert all(s.api_key not in listed for s in made)
    with pytest.raises(SessionNotFound, match="to list after"):
        store.page(limit=2, after=made[1].id)  # deleted between pages
