"""Gateway sessions: what a session holds, and the store that caps, expires and finds them.

A session is one episode's conversation with the model: its options (``POST /sessions``), the
merger that folds its turns into trajectories, its reward, and a small replay cache so an SDK's
retry of a request it never saw answered gets the same answer instead of a second turn.

Lifecycle: ``SessionStore.create`` -> turns are ``record``ed -> reward set -> ``samples`` taken
-> ``delete`` (or expiry ``ttl_s`` after last use). A deleted or expired session is gone: it is
never found again and never recreated, and a turn that finishes after the delete raises
:class:`SessionClosed` instead of resurrecting it.

With a :class:`SessionLog` attached (the gateway's journal, :mod:`corral.gateway.journal`),
every change above is handed to it as it happens, so that a restarted gateway can rebuild the
session exactly: :meth:`SessionStore.restore` and the same calls, replayed.

Not thread-safe: the gateway runs on one event loop and calls all of this from it, never from
worker threads; nothing here awaits, so each call is atomic with respect to that loop.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from corral.gateway.client import SessionPage, SessionSummary
from corral.gateway.history import ConversationIndex, HeldConversation, TurnConversation
from corral.gateway.options import SessionOptions
from corral.gateway.recording import (
    Decode,
    MergeDecision,
    Trajectory,
    TrajectoryMerger,
    TurnRecord,
)
from corral.samples import Sample, SampleStatus, status_for_finish

REPLAY_CACHE_SIZE = 32
# Responses kept for ``previous_response_id`` (OpenAI Responses with ``store: true``).
KEPT_RESPONSES = 64


class SessionError(Exception):
    """Base class of session errors."""


class SessionNotFound(SessionError):
    """No such session: never created, deleted, or expired (the gateway answers 404)."""


class SessionClosed(SessionError):
    """The session was deleted or expired while a request on it was in flight."""


class StoreFull(SessionError):
    """The store is at its session or token cap (the gateway answers 429)."""


# Called by a session after each recorded turn with the decision and the tokens it added.
RecordListener = Callable[[MergeDecision, int], None]


@dataclass(frozen=True, slots=True)
class RecordedTurn:
    """One recorded turn as a :class:`SessionLog` gets it: the turn, what the merger did with
    it, the message positions the merger asked for (``starts``: token position -> message
    index, when the turn's ``message_starts`` is a callable), the conversation the turn left
    for token history and the one held for its trajectory before it (``previous``)."""

    turn: TurnRecord
    decision: MergeDecision
    starts: dict[int, int] | None
    conversation: TurnConversation | None
    previous: HeldConversation | None


class SessionLog(Protocol):
    """What a session store tells its log (the journal), each call as the change happens.

    Contract: a log never raises into the gateway's request path for its own failures (it
    reports them); what it was handed before a call returned is on its way to storage."""

    def opened(self, session: Session) -> None: ...

    def recorded(self, session: Session, recorded: RecordedTurn) -> None: ...

    def rewarded(self, session: Session) -> None: ...

    def failed(self, session: Session) -> None: ...

    def remembered(self, session: Session, key: str, value: Any) -> None: ...

    def kept(self, session: Session, response_id: str, value: Any) -> None: ...

    def closed(self, session_id: str) -> None: ...


class _AskedStarts:
    """A turn's ``message_starts`` callable that remembers what it was asked (for the log)."""

    __slots__ = ("asked", "find")

    def __init__(self, find: Callable[[int], int]) -> None:
        self.find = find
        self.asked: dict[int, int] = {}

    def __call__(self, position: int) -> int:
        if position not in self.asked:
            self.asked[position] = self.find(position)
        return self.asked[position]


class Session:
    """One gateway session. Create it through :meth:`SessionStore.create`.

    ``clock`` is the store's clock (seconds, monotonic); ``ttl_s`` ``None`` means no expiry.
    """

    def __init__(
        self,
        session_id: str,
        options: SessionOptions,
        *,
        ttl_s: float | None,
        clock: Callable[[], float],
        decode: Decode | None = None,
        on_record: RecordListener | None = None,
        replay_cache_size: int = REPLAY_CACHE_SIZE,
        api_key: str | None = None,
    ) -> None:
        self.id = session_id
        self.api_key = api_key if api_key is not None else secrets.token_urlsafe(32)
        self.options = options
        self.ttl_s = ttl_s
        self._clock = clock
        self.created_at = clock()
        self.last_used = self.created_at
        self._merger = TrajectoryMerger(decode)
        self._on_record = on_record
        self._replay: OrderedDict[str, Any] = OrderedDict()
        self._kept: OrderedDict[str, Any] = OrderedDict()
        # The pipeline's encoded prompts of this session (rendering.HeldPrompt), reused to
        # encode only what a new prompt adds.
        self.held_prompts: list[Any] = []
        # Which trajectory a request continues, for token history.
        self.conversations = ConversationIndex()
        self._replay_cache_size = replay_cache_size
        self._closed = False
        self._reward: float | None = None
        self._failure: str | None = None
        # The store's log, once the session is created or restored (None: no journal).
        self.log: SessionLog | None = None

    # -- state ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def expires_at(self) -> float | None:
        return None if self.ttl_s is None else self.last_used + self.ttl_s

    def is_expired(self, now: float) -> bool:
        expires = self.expires_at
        return expires is not None and now >= expires

    def touch(self) -> None:
        """Mark the session used now (its TTL counts from here)."""
        self.last_used = self._clock()

    def close(self) -> None:
        """Close for good (the store calls this on delete and expiry). Idempotent."""
        self._closed = True
        self._replay.clear()
        self._kept.clear()
        self.held_prompts.clear()
        self.conversations.clear()

    @property
    def merger(self) -> TrajectoryMerger:
        return self._merger

    @property
    def held_tokens(self) -> int:
        return self._merger.held_tokens

    @property
    def reward(self) -> float | None:
        return self._reward

    @property
    def failure(self) -> str | None:
        return self._failure

    # -- turns ---------------------------------------------------------------------------

    def record(
        self, turn: TurnRecord, conversation: TurnConversation | None = None
    ) -> MergeDecision:
        """Merge a served turn into the session's trajectories, and remember the conversation
        it leaves (token history's :class:`ConversationIndex`) when one is given.

        Raises :class:`SessionClosed` if the session was deleted or expired meanwhile (nothing
        is recorded then). The store's token cap is not enforced here: the gateway checks it
        with :meth:`SessionStore.check_capacity` before generating, since tokens already
        generated are worth keeping.
        """
        self._ensure_open()
        asked: _AskedStarts | None = None
        if self.log is not None and callable(turn.message_starts):
            asked = _AskedStarts(turn.message_starts)
            turn = replace(turn, message_starts=asked)
        before = self._merger.held_tokens
        decision = self._merger.add(turn)
        previous = None
        if conversation is not None:
            previous = self.conversations.held(decision.trajectory)
            appended = decision.action == "append"
            self.conversations.record(decision.trajectory, appended, conversation)
        self.touch()
        if self._on_record is not None:
            self._on_record(decision, self._merger.held_tokens - before)
        if self.log is not None:
            starts = None if asked is None else asked.asked
            self.log.recorded(self, RecordedTurn(turn, decision, starts, conversation, previous))
        return decision

    def set_reward(self, reward: float) -> None:
        """Set the episode's reward (on every sample). Must be finite; may be set again."""
        self._ensure_open()
        if not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        self._reward = float(reward)
        self.touch()
        if self.log is not None:
            self.log.rewarded(self)

    def mark_failed(self, reason: str) -> None:
        """Flag the episode as failed: every sample gets status ``failed`` and the reason, so
        the trainer drops its group instead of training on a silent 0."""
        self._ensure_open()
        self._failure = reason
        self.touch()
        if self.log is not None:
            self.log.failed(self)

    # -- replay cache --------------------------------------------------------------------

    def remember(self, key: str, response: Any) -> None:
        """Keep ``response`` as the answer to request ``key`` (the last few keys are kept)."""
        self._replay[key] = response
        self._replay.move_to_end(key)
        while len(self._replay) > self._replay_cache_size:
            self._replay.popitem(last=False)
        if self.log is not None:
            self.log.remembered(self, key, response)

    def recall(self, key: str) -> Any | None:
        """The remembered answer to request ``key``, or ``None``."""
        return self._replay.get(key)

    def keep_response(self, response_id: str, value: Any) -> None:
        """Keep a dialect's stored response (the last :data:`KEPT_RESPONSES` are kept); a
        closed session keeps nothing (its turn finished after it was deleted)."""
        if self._closed:
            return
        self._kept[response_id] = value
        self._kept.move_to_end(response_id)
        while len(self._kept) > KEPT_RESPONSES:
            self._kept.popitem(last=False)
        if self.log is not None:
            self.log.kept(self, response_id, value)

    def kept_response(self, response_id: str) -> Any | None:
        return self._kept.get(response_id)

    # -- outputs -------------------------------------------------------------------------

    def samples(self) -> list[Sample]:
        """One sample per trajectory, in the order they started.

        ``rollout_id`` is the session id; ``index`` is the session option's ``index`` when set,
        else the sample's position (the position is always in ``metadata["sample_index"]``).
        """
        trajectories = [
            t
            for t in self._merger.trajectories
            if self.options.side_requests == "include" or t.label != "side"
        ]
        return [
            self._sample(t, position, len(trajectories)) for position, t in enumerate(trajectories)
        ]

    def _sample(self, t: Trajectory, position: int, count: int) -> Sample:
        turns = self._merger.turns
        first = turns[t.turns[0]]
        status: SampleStatus = (
            "failed" if self._failure is not None else status_for_finish(t.last_finish_reason)
        )
        metadata: dict[str, Any] = dict(self.options.metadata)
        metadata.update(
            session_id=self.id,
            sample_index=position,
            num_samples=count,
            trajectory=t.index,
            num_turns=len(t.turns),
            turns=list(t.turns),
            weight_versions=list(t.weight_versions),
            finish_reasons=list(t.finish_reasons),
            history_modes=list(t.history_modes),
            origin=t.origin,
            label=t.label,
            drift=None if first.drift is None else first.drift.to_dict(),
            turn_metadata=[{"turn": i, **turns[i].metadata} for i in t.turns if turns[i].metadata],
        )
        if self._failure is not None:
            metadata["failure"] = self._failure
        return Sample(
            tokens=t.tokens.tolist(),
            response_length=t.response_length,
            loss_mask=t.loss_mask.tolist(),
            rollout_log_probs=t.log_probs.tolist(),
            reward=self._reward,
            status=status,
            metadata=metadata,
            group_index=self.options.group_index,
            index=self.options.index if self.options.index is not None else position,
            rollout_id=self.id,
        )

    def drift_report(self) -> dict[str, Any]:
        """Merge counts and every fork's explanation, JSON-ready."""
        counts = self._merger.counts()
        return {
            "turns": counts.turns,
            "merges": counts.merges,
            "forks": counts.forks,
            "by_reason": counts.by_reason,
            "events": [e.to_dict() for e in self._merger.drift_events()],
            # Turns of a token-history session rendered in full instead, and why.
            "history_fallbacks": [
                {"turn": t.index, "reason": t.metadata["history_fallback"]}
                for t in self._merger.turns
                if "history_fallback" in t.metadata
            ],
        }

    def view(self) -> dict[str, Any]:
        """JSON-ready state for ``GET /sessions/{id}`` (never the api key)."""
        now = self._clock()
        expires = self.expires_at
        return {
            "id": self.id,
            "closed": self._closed,
            "age_s": now - self.created_at,
            "idle_s": now - self.last_used,
            "expires_in_s": None if expires is None else max(0.0, expires - now),
            "options": self.options.model_dump(),
            "reward": self._reward,
            "failure": self._failure,
            "held_tokens": self._merger.held_tokens,
            "trajectories": [t.summary() for t in self._merger.trajectories],
            "turns": [e.summary() for e in self._merger.turns],
            "drift": self.drift_report(),
        }

    def summary(self) -> SessionSummary:
        """Where the session stands, for ``GET /sessions`` (never the api key)."""
        now = self._clock()
        return SessionSummary(
            id=self.id,
            closed=self._closed,
            age_s=now - self.created_at,
            idle_s=now - self.last_used,
            turns=len(self._merger.turns),
            trajectories=len(self._merger.trajectories),
            held_tokens=self._merger.held_tokens,
            reward=self._reward,
            failure=self._failure,
            group_index=self.options.group_index,
            metadata=self.options.metadata,
        )

    def _ensure_open(self) -> None:
        if self._closed:
            raise SessionClosed(f"session {self.id!r} was closed")


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Gauges (``sessions``, ``held_tokens``) and counters since the store started."""

    sessions: int
    held_tokens: int
    turns_total: int
    merges_total: int
    forks_total: int
    created_total: int
    deleted_total: int
    expired_total: int
    decisions_by_reason: dict[str, int] = field(default_factory=dict)


class SessionStore:
    """All open sessions, with a session cap, a held-token cap and expiry after last use.

    ``default_ttl_s`` applies to sessions whose options give none (``None``: no expiry).
    ``clock`` is injectable for tests. ``decode`` (ids -> text) is used for drift snippets.
    ``id_prefix`` starts every session id and api key made here (a gateway worker's mark).
    Not thread-safe: call it from the gateway's event loop only.
    """

    def __init__(
        self,
        max_sessions: int,
        max_held_tokens: int,
        default_ttl_s: float | None,
        clock: Callable[[], float] = time.monotonic,
        decode: Decode | None = None,
        id_prefix: str = "",
    ) -> None:
        self.max_sessions = max_sessions
        self.id_prefix = id_prefix
        self.max_held_tokens = max_held_tokens
        self.default_ttl_s = default_ttl_s
        self._clock = clock
        self._decode = decode
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}
        self._log: SessionLog | None = None
        self._held_tokens = 0
        self._reasons: Counter[str] = Counter()
        self._turns = 0
        self._merges = 0
        self._forks = 0
        self._created = 0
        self._deleted = 0
        self._expired = 0

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def held_tokens(self) -> int:
        return self._held_tokens

    def create(self, options: SessionOptions, *, decode: Decode | None = None) -> Session:
        """Open a session. At a cap, expired sessions are reaped first so they do not count.

        Raises :class:`StoreFull` at the session cap or when the token cap is already reached.
        """
        # Reaping scans every session: only worth it when a cap is in the way (the gateway
        # also reaps on a timer).
        if len(self._sessions) >= self.max_sessions or self._held_tokens >= self.max_held_tokens:
            self.reap()
        if len(self._sessions) >= self.max_sessions:
            raise StoreFull(
                f"session store is full: {len(self._sessions)} open sessions "
                f"(max_sessions={self.max_sessions}); retry after some sessions end"
            )
        if self._held_tokens >= self.max_held_tokens:
            raise StoreFull(
                f"session store is full: holding {self._held_tokens} tokens "
                f"(max_held_tokens={self.max_held_tokens}); retry after some sessions end"
            )
        session_id = self.id_prefix + secrets.token_hex(12)
        ttl = options.ttl_s if options.ttl_s is not None else self.default_ttl_s
        session = Session(
            session_id,
            options,
            ttl_s=ttl,
            clock=self._clock,
            decode=decode or self._decode,
            on_record=self._on_record,
            api_key=self.id_prefix + secrets.token_urlsafe(32),
        )
        self._add(session)
        self._created += 1
        if self._log is not None:
            self._log.opened(session)
        return session

    def restore(
        self, session_id: str, api_key: str, options: SessionOptions, ttl_s: float | None
    ) -> Session:
        """Open a session again under its old id and key (a journal's replay): not counted,
        not logged, not refused at a cap (it was admitted once); its TTL counts from now.
        ``ValueError`` when the id or the key is taken."""
        if session_id in self._sessions or api_key in self._by_key:
            raise ValueError(f"session {session_id!r} (or its key) is already open")
        session = Session(
            session_id,
            options,
            ttl_s=ttl_s,
            clock=self._clock,
            decode=self._decode,
            on_record=self._on_record,
            api_key=api_key,
        )
        self._add(session)
        return session

    def attach_log(self, log: SessionLog | None) -> None:
        """Hand every change from now on to ``log`` (every open session's, and new ones')."""
        self._log = log
        for session in self._sessions.values():
            session.log = log

    def reset_counters(self) -> None:
        """Zero the counters (not the gauges): a replay's turns are no new traffic."""
        self._reasons.clear()
        self._turns = self._merges = self._forks = 0
        self._created = self._deleted = self._expired = 0

    def _add(self, session: Session) -> None:
        session.log = self._log
        self._sessions[session.id] = session
        self._by_key[session.api_key] = session.id

    def get(self, session_id: str) -> Session:
        """The open session ``session_id``, marked used. Raises :class:`SessionNotFound` if it
        does not exist, was deleted, or has expired (an expired one is removed here)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return self._live(session)

    def page(self, *, limit: int, after: str | None = None) -> SessionPage:
        """Up to ``limit`` open sessions, oldest first, after session ``after`` (a page's
        ``next``). SessionNotFound when ``after`` is no open session (it expired or was deleted
        between pages: start again without it)."""
        ids = list(self._sessions)
        start = 0
        if after is not None:
            if after not in self._sessions:
                raise SessionNotFound(f"no session {after!r} to list after")
            start = ids.index(after) + 1
        chosen = ids[start : start + limit]
        more = start + limit < len(ids)
        return SessionPage(
            sessions=[self._sessions[i].summary() for i in chosen],
            total=len(ids),
            next=chosen[-1] if more and chosen else None,
        )

    def by_api_key(self, api_key: str) -> Session:
        """The open session whose key is ``api_key``, marked used (as :meth:`get`)."""
        session_id = self._by_key.get(api_key)
        if session_id is None:
            raise SessionNotFound("no session for this api key")
        return self._live(self._sessions[session_id])

    def delete(self, session_id: str) -> None:
        """Close and forget a session. Raises :class:`SessionNotFound` if it is not open."""
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        self._remove(session)
        self._deleted += 1

    def reap(self) -> list[str]:
        """Remove every session idle longer than its TTL; return their ids."""
        now = self._clock()
        expired = [s for s in self._sessions.values() if s.is_expired(now)]
        for session in expired:
            self._remove(session)
        self._expired += len(expired)
        return [s.id for s in expired]

    def check_capacity(self, extra_tokens: int) -> None:
        """Raise :class:`StoreFull` if holding ``extra_tokens`` more would pass the token cap."""
        if self._held_tokens + extra_tokens > self.max_held_tokens:
            raise StoreFull(
                f"session store is full: holding {self._held_tokens} tokens, a turn of up to "
                f"{extra_tokens} more would pass max_held_tokens={self.max_held_tokens}; "
                "retry after some sessions end"
            )

    def stats(self) -> StoreStats:
        return StoreStats(
            sessions=len(self._sessions),
            held_tokens=self._held_tokens,
            turns_total=self._turns,
            merges_total=self._merges,
            forks_total=self._forks,
            created_total=self._created,
            deleted_total=self._deleted,
            expired_total=self._expired,
            decisions_by_reason=dict(self._reasons),
        )

    def _live(self, session: Session) -> Session:
        if session.is_expired(self._clock()):
            self._remove(session)
            self._expired += 1
            raise SessionNotFound(f"session {session.id!r} not found (expired)")
        session.touch()
        return session

    def _remove(self, session: Session) -> None:
        session.close()
        del self._sessions[session.id]
        del self._by_key[session.api_key]
        self._held_tokens -= session.held_tokens
        if self._log is not None:
            self._log.closed(session.id)

    def _on_record(self, decision: MergeDecision, added_tokens: int) -> None:
        self._held_tokens += added_tokens
        self._turns += 1
        self._reasons[decision.reason] += 1
        if decision.action == "append":
            self._merges += 1
        elif decision.reason != "first_turn":
            self._forks += 1
