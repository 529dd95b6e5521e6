"""Turn recording, trajectory merging and drift explanation.

The gateway records every turn it served as a :class:`TurnRecord`: the exact prompt token ids it
rendered and sent to the engine, the output ids and logprobs the engine returned, and the chat
messages. A :class:`TrajectoryMerger` folds the turns of one session, in order, into
trajectories (token sequences that become training samples):

- a turn whose prompt has a held trajectory's full tokens as a prefix is *appended* to it (the
  longest such trajectory wins): the new prompt tokens (tool results, the next user message,
  template glue) are observation tokens with loss mask 0 and logprob 0.0, the output tokens are
  model tokens with loss mask 1 and the engine's logprobs;
- any other turn *starts* a new trajectory, and a :class:`DriftEvent` says why: the trajectory
  it was compared against, the first divergent token, the message of the new request it falls
  in, decoded snippets of both sides, and a one-line explanation.

Memory: tokens are held in typed arrays (``array('i')`` ids, ``array('B')`` mask, ``array('f')``
logprobs, i.e. float32) and an appended turn stores only its new tokens and its new messages,
never a second copy of the context, so a session holds O(total tokens).

Nothing here is thread-safe; the gateway calls it from its single event loop.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
MergeAction = Literal["append", "start"]
# Why a turn was appended or started a trajectory:
#   extends        - the prompt extends a held trajectory (appended)
#   first_turn     - nothing was held yet
#   diverged       - the prompt differs from every held trajectory at some token
#   prompt_shorter - the prompt is a strict prefix of a held trajectory (a retry or a rollback)
#   sibling_choice - another choice of an n > 1 request whose first choice is already held
MergeReason = Literal["extends", "first_turn", "diverged", "prompt_shorter", "sibling_choice"]
Decode = Callable[[Sequence[int]], str]

_FINISH_REASONS = ("stop", "length", "abort")
# How many of the most recent trajectories a fork is explained against.
_EXPLAIN_AGAINST = 16
# Slices compared at C speed when looking for the first divergent token.
_COMPARE_BLOCK = 4096


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One turn as the gateway served it.

    Contract (checked on construction, ``ValueError`` otherwise): ``prompt_ids`` is not empty,
    ``output_logprobs`` has one entry per ``output_ids``, ``message_starts`` has one entry per
    message, non-decreasing, each within ``[0, len(prompt_ids)]``.
    """

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    output_logprobs: Sequence[float]
    finish_reason: FinishReason
    weight_version: str
    messages: list[dict[str, Any]]  # the request's messages (JSON form)
    # Token offset in prompt_ids where each message starts; or, since finding them costs
    # template renders and only a fork needs them, a callable mapping a token position to the
    # index of the message holding it, called only then.
    message_starts: Sequence[int] | Callable[[int], int]
    response: dict[str, Any]  # the assistant message returned to the client
    choice_group: str | None = None  # shared by the n choices of one request (n > 1)
    metadata: dict[str, Any] = field(default_factory=dict)  # e.g. parser errors
    # Marks a request outside the agent's main conversation (``"side"``: a title or summary
    # request); a labelled turn only ever extends a trajectory of the same label.
    label: str | None = None
    # How the prompt was built: ``tokens`` (the held tokens plus a rendered suffix) or
    # ``template`` (the whole conversation rendered); see corral.gateway.history.
    history: str = "template"

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("a turn needs at least one prompt token")
        if len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"{len(self.output_logprobs)} output logprobs for {len(self.output_ids)} "
                "output tokens"
            )
        if self.finish_reason not in _FINISH_REASONS:
            raise ValueError(f"unknown finish reason {self.finish_reason!r}")
        if callable(self.message_starts):
            return
        if len(self.message_starts) != len(self.messages):
            raise ValueError(
                f"{len(self.message_starts)} message starts for {len(self.messages)} messages"
            )
        previous = 0
        for start in self.message_starts:
            if start < previous or start > len(self.prompt_ids):
                raise ValueError(
                    f"message starts must be non-decreasing offsets into the prompt "
                    f"(0..{len(self.prompt_ids)}), got {self.message_starts}"
                )
            previous = start


@dataclass(frozen=True, slots=True)
class DriftEvent:
    """Why a turn started a new trajectory instead of extending a held one.

    ``position`` is the first token index (in both sequences) where the new turn's tokens and
    the compared trajectory's tokens differ; for ``prompt_shorter`` it is the new prompt's end.
    ``held_token``/``new_token`` are ``None`` where that side has ended. ``message_index`` and
    ``message_role`` locate ``position`` among the new request's messages (``None`` when it lies
    past the prompt). ``in_model_output`` tells whether the held token there was generated by
    the model (loss mask 1) rather than rendered by the gateway. Snippets are decoded text:
    ``context`` is the shared text just before ``position``, ``held_text``/``new_text`` the
    text of each side from ``position`` on.
    """

    turn: int
    reason: MergeReason
    compared_trajectory: int | None
    position: int | None
    held_token: int | None
    new_token: int | None
    held_length: int
    new_length: int
    message_index: int | None
    message_role: str | None
    in_model_output: bool
    context: str
    held_text: str
    new_text: str
    explanation: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class MergeDecision:
    """What :meth:`TrajectoryMerger.add` did with one turn.

    ``trajectory`` is the index of the trajectory the turn was appended to or started;
    ``observation_tokens`` the prompt tokens that were new to it (loss mask 0);
    ``drift`` is set for every started trajectory except the very first.
    """

    turn: int
    action: MergeAction
    reason: MergeReason
    trajectory: int
    observation_tokens: int
    output_tokens: int
    drift: DriftEvent | None = None


@dataclass(slots=True)
class TurnEntry:
    """What is kept of one turn after merging (no token ids: those live in the trajectory).

    ``messages`` holds only the request's messages from ``message_offset`` on: for an appended
    turn, those that are new relative to the trajectory's previous turn; for a started one, all.
    ``output_start`` is the index of the turn's first output token in the trajectory's tokens.
    """

    index: int
    trajectory: int
    action: MergeAction
    reason: MergeReason
    prompt_length: int
    observation_tokens: int
    output_start: int
    output_length: int
    finish_reason: FinishReason
    weight_version: str
    message_offset: int
    messages: list[dict[str, Any]]
    response: dict[str, Any]
    choice_group: str | None
    metadata: dict[str, Any]
    drift: DriftEvent | None
    history: str = "template"

    def summary(self) -> dict[str, Any]:
        """JSON-ready view of the turn (for ``GET /sessions/{id}``)."""
        return {
            "index": self.index,
            "trajectory": self.trajectory,
            "action": self.action,
            "reason": self.reason,
            "prompt_tokens": self.prompt_length,
            "observation_tokens": self.observation_tokens,
            "output_tokens": self.output_length,
            "finish_reason": self.finish_reason,
            "weight_version": self.weight_version,
            "message_offset": self.message_offset,
            "messages": self.messages,
            "response": self.response,
            "choice_group": self.choice_group,
            "history": self.history,
            "metadata": self.metadata,
            "drift": None if self.drift is None else self.drift.to_dict(),
        }


class Trajectory:
    """One token sequence: the first turn's prompt, then observation and model tokens.

    ``tokens`` holds prompt + response; ``loss_mask`` and ``log_probs`` cover the response part
    only (``tokens[prompt_length:]``), with logprob 0.0 wherever the mask is 0.
    """

    __slots__ = (
        "finish_reasons",
        "history_modes",
        "index",
        "label",
        "log_probs",
        "loss_mask",
        "message_count",
        "origin",
        "prompt_length",
        "tokens",
        "turns",
        "weight_versions",
    )

    def __init__(
        self, index: int, prompt: array[int], origin: MergeReason, label: str | None = None
    ) -> None:
        self.index = index
        self.label = label
        self.tokens: array[int] = array("i", prompt)
        self.prompt_length = len(prompt)
        self.loss_mask: array[int] = array("B")
        self.log_probs: array[float] = array("f")
        self.turns: list[int] = []  # indices of the merger's turns, in order
        self.weight_versions: list[str] = []  # per model turn
        self.finish_reasons: list[FinishReason] = []  # per model turn
        self.history_modes: list[str] = []  # per model turn: how its prompt was built
        self.message_count = 0  # messages in the last turn's request, to find the new ones
        self.origin = origin

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def last_finish_reason(self) -> FinishReason:
        return self.finish_reasons[-1]

    def extend_observation(self, ids: array[int]) -> None:
        self.tokens.extend(ids)
        self.loss_mask.frombytes(bytes(len(ids)))
        # All-zero bytes are 0.0 in IEEE float32.
        self.log_probs.frombytes(bytes(self.log_probs.itemsize * len(ids)))

    def extend_output(self, ids: array[int], logprobs: Sequence[float]) -> None:
        self.tokens.extend(ids)
        self.loss_mask.frombytes(b"\x01" * len(ids))
        self.log_probs.extend(array("f", logprobs))

    def is_model_token(self, position: int) -> bool:
        """Whether ``tokens[position]`` was generated by the model (loss mask 1)."""
        offset = position - self.prompt_length
        return 0 <= offset < len(self.loss_mask) and self.loss_mask[offset] == 1

    def summary(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "origin": self.origin,
            "label": self.label,
            "tokens": len(self.tokens),
            "prompt_length": self.prompt_length,
            "response_length": self.response_length,
            "model_tokens": self.loss_mask.count(1),
            "turns": list(self.turns),
            "history_modes": list(self.history_modes),
        }


@dataclass(frozen=True, slots=True)
class MergeCounts:
    turns: int
    merges: int
    forks: int  # new trajectories other than the first
    by_reason: dict[str, int]


def common_prefix_length(a: array[int], b: array[int]) -> int:
    """Length of the longest common prefix of two id arrays (compared a block at a time)."""
    n = min(len(a), len(b))
    start = 0
    while start < n:
        stop = min(start + _COMPARE_BLOCK, n)
        if a[start:stop] != b[start:stop]:
            for i in range(start, stop):
                if a[i] != b[i]:
                    return i
        start = stop
    return n


def _ids_as_text(ids: Sequence[int]) -> str:
    return "[" + " ".join(str(i) for i in ids) + "]"


class TrajectoryMerger:
    """Folds a session's turns, in order, into trajectories and explains every fork.

    ``decode`` turns ids into text for the drift snippets (the tokenizer's decode; without one,
    ids are shown as numbers). ``snippet_tokens`` bounds each snippet. ``max_choice_groups``
    bounds how many recent n > 1 requests are remembered to recognise their sibling choices.
    """

    def __init__(
        self,
        decode: Decode | None = None,
        *,
        snippet_tokens: int = 12,
        max_choice_groups: int = 64,
    ) -> None:
        self._decode = decode or _ids_as_text
        self._snippet_tokens = snippet_tokens
        self._max_choice_groups = max_choice_groups
        self._trajectories: list[Trajectory] = []
        self._turns: list[TurnEntry] = []
        self._choice_groups: OrderedDict[str, int] = OrderedDict()  # group -> first trajectory
        self._reasons: Counter[str] = Counter()
        self._merges = 0
        self._held_tokens = 0

    @property
    def trajectories(self) -> Sequence[Trajectory]:
        return self._trajectories

    @property
    def turns(self) -> Sequence[TurnEntry]:
        return self._turns

    @property
    def held_tokens(self) -> int:
        """Token ids held over all trajectories (what the store's token cap counts)."""
        return self._held_tokens

    def counts(self) -> MergeCounts:
        started = len(self._trajectories)
        return MergeCounts(
            turns=len(self._turns),
            merges=self._merges,
            forks=max(0, started - 1),
            by_reason=dict(self._reasons),
        )

    def drift_events(self) -> list[DriftEvent]:
        return [t.drift for t in self._turns if t.drift is not None]

    def add(self, turn: TurnRecord) -> MergeDecision:
        """Append ``turn`` to the trajectory it extends, or start a new one; say which and why."""
        prompt = _as_int_array(turn.prompt_ids)
        output = _as_int_array(turn.output_ids)
        sibling_of = self._sibling_of(turn.choice_group)
        target = None if sibling_of is not None else self._longest_extended(prompt, turn.label)
        if target is not None:
            decision = self._append(target, turn, prompt, output)
        else:
            decision = self._start(turn, prompt, output, sibling_of)
        if turn.choice_group is not None and sibling_of is None:
            self._remember_choice_group(turn.choice_group, decision.trajectory)
        self._reasons[decision.reason] += 1
        return decision

    # -- merging -------------------------------------------------------------------------

    def _sibling_of(self, group: str | None) -> int | None:
        if group is None:
            return None
        return self._choice_groups.get(group)

    def _remember_choice_group(self, group: str, trajectory: int) -> None:
        self._choice_groups[group] = trajectory
        while len(self._choice_groups) > self._max_choice_groups:
            self._choice_groups.popitem(last=False)

    def _longest_extended(self, prompt: array[int], label: str | None) -> Trajectory | None:
        best: Trajectory | None = None
        for t in self._trajectories:
            if t.label != label:
                continue
            n = len(t.tokens)
            if n > len(prompt) or (best is not None and n <= len(best.tokens)):
                continue
            if prompt[:n] == t.tokens:
                best = t
        return best

    def _append(
        self, t: Trajectory, turn: TurnRecord, prompt: array[int], output: array[int]
    ) -> MergeDecision:
        held = len(t.tokens)
        observation = prompt[held:]
        t.extend_observation(observation)
        output_start = len(t.tokens)
        t.extend_output(output, turn.output_logprobs)
        # Only the messages that are new since the trajectory's previous turn; a request that
        # somehow has fewer messages than before is kept whole rather than guessed at.
        offset = t.message_count if len(turn.messages) >= t.message_count else 0
        index = len(self._turns)
        self._turns.append(
            self._entry(index, t, "append", "extends", turn, len(observation), output_start, offset)
        )
        self._record_on(t, index, turn)
        self._held_tokens += len(observation) + len(output)
        self._merges += 1
        return MergeDecision(
            turn=index,
            action="append",
            reason="extends",
            trajectory=t.index,
            observation_tokens=len(observation),
            output_tokens=len(output),
        )

    def _start(
        self,
        turn: TurnRecord,
        prompt: array[int],
        output: array[int],
        sibling_of: int | None,
    ) -> MergeDecision:
        index = len(self._turns)
        drift: DriftEvent | None = None
        reason: MergeReason = "first_turn"
        if sibling_of is not None:
            drift = self._explain_sibling(
                index, self._trajectories[sibling_of], turn, prompt, output
            )
            reason = "sibling_choice"
        elif self._trajectories:
            drift = self._explain_divergence(index, turn, prompt)
            reason = drift.reason
        t = Trajectory(len(self._trajectories), prompt, reason, turn.label)
        self._trajectories.append(t)
        t.extend_output(output, turn.output_logprobs)
        self._turns.append(
            self._entry(index, t, "start", reason, turn, len(prompt), len(prompt), 0, drift)
        )
        self._record_on(t, index, turn)
        self._held_tokens += len(prompt) + len(output)
        return MergeDecision(
            turn=index,
            action="start",
            reason=reason,
            trajectory=t.index,
            observation_tokens=len(prompt),
            output_tokens=len(output),
            drift=drift,
        )

    @staticmethod
    def _record_on(t: Trajectory, index: int, turn: TurnRecord) -> None:
        t.turns.append(index)
        t.weight_versions.append(turn.weight_version)
        t.finish_reasons.append(turn.finish_reason)
        t.history_modes.append(turn.history)
        t.message_count = len(turn.messages)

    @staticmethod
    def _entry(
        index: int,
        t: Trajectory,
        action: MergeAction,
        reason: MergeReason,
        turn: TurnRecord,
        observation_tokens: int,
        output_start: int,
        message_offset: int,
        drift: DriftEvent | None = None,
    ) -> TurnEntry:
        return TurnEntry(
            index=index,
            trajectory=t.index,
            action=action,
            reason=reason,
            prompt_length=len(turn.prompt_ids),
            observation_tokens=observation_tokens,
            output_start=output_start,
            output_length=len(turn.output_ids),
            finish_reason=turn.finish_reason,
            weight_version=turn.weight_version,
            message_offset=message_offset,
            messages=turn.messages[message_offset:],
            response=turn.response,
            choice_group=turn.choice_group,
            metadata=turn.metadata,
            drift=drift,
            history=turn.history,
        )

    # -- drift ---------------------------------------------------------------------------

    def _explain_divergence(self, index: int, turn: TurnRecord, prompt: array[int]) -> DriftEvent:
        # Compare against the trajectory sharing the longest prefix (the latest on a tie, the
        # one the client most likely meant to continue). Only the most recent trajectories are
        # searched: a session that forks on every turn would otherwise pay O(forks) prefix
        # comparisons per turn for an explanation.
        recent = self._trajectories[-_EXPLAIN_AGAINST:]
        best = recent[0]
        best_common = -1
        for t in recent:
            common = common_prefix_length(t.tokens, prompt)
            if common >= best_common:
                best, best_common = t, common
        held = best.tokens
        position = best_common
        if position == len(prompt):
            # No differing token: the prompt stops inside the held tokens.
            return self._event(
                index,
                "prompt_shorter",
                best,
                prompt,
                position,
                turn,
                f"the prompt ({len(prompt)} tokens) is shorter than the held tokens of "
                f"trajectory {best.index} ({len(held)}) and a prefix of them: the client "
                "resent an earlier state (a retry, a rollback or a regenerated answer)",
            )
        # position < len(prompt) and position < len(held): the sequences differ there.
        return self._event(index, "diverged", best, prompt, position, turn, None)

    def _explain_sibling(
        self,
        index: int,
        first: Trajectory,
        turn: TurnRecord,
        prompt: array[int],
        output: array[int],
    ) -> DriftEvent:
        new = prompt + output
        position = common_prefix_length(first.tokens, new)
        return self._event(
            index,
            "sibling_choice",
            first,
            new,
            position,
            turn,
            f"sibling choice of an n>1 request (choice group {turn.choice_group!r}): it shares "
            f"its prompt with trajectory {first.index} and starts its own trajectory, the whole "
            "prompt outside the response (loss mask 0)",
        )

    def _event(
        self,
        index: int,
        reason: MergeReason,
        compared: Trajectory,
        new: array[int],
        position: int,
        turn: TurnRecord,
        explanation: str | None,
    ) -> DriftEvent:
        held = compared.tokens
        k = self._snippet_tokens
        held_token = held[position] if position < len(held) else None
        new_token = new[position] if position < len(new) else None
        message_index: int | None = None
        message_role: str | None = None
        starts = turn.message_starts
        i = -1
        if position < len(turn.prompt_ids):
            if callable(starts):
                try:
                    i = starts(position)
                except Exception:  # explaining drift must never lose the turn
                    i = -1
            elif starts:
                i = bisect_right(starts, position) - 1
            if 0 <= i < len(turn.messages):
                message_index = i
                role = turn.messages[i].get("role")
                message_role = role if isinstance(role, str) else None
        in_model_output = compared.is_model_token(position)
        context = self._safe_decode(held[max(0, position - k) : position])
        held_text = self._safe_decode(held[position : position + k])
        new_text = self._safe_decode(new[position : position + k])
        if explanation is None:
            where = (
                f"inside message {message_index} ({message_role})"
                if message_index is not None
                else "before the first message"
            )
            if position == 0:
                explanation = (
                    f"the prompt shares no tokens with any held trajectory "
                    f"(compared with trajectory {compared.index}): held {held_text!r} vs new "
                    f"{new_text!r}"
                )
            elif in_model_output:
                explanation = (
                    f"the re-rendered history differs from what the model generated {where} "
                    f"at token {position}: held {held_text!r} vs new {new_text!r} "
                    f"after {context!r}"
                )
                last = self._turns[compared.turns[-1]]
                if position >= last.output_start and last.finish_reason != "stop":
                    explanation += (
                        f" (the held turn ended with finish_reason={last.finish_reason!r}, "
                        "so its output was cut short)"
                    )
            elif message_index == 0 and message_role == "system":
                # Not drift: the client began another conversation on this session (a
                # sub-agent, a compacted context, a second task); it trains as its own sample.
                explanation = (
                    f"a new conversation: its system message differs from trajectory "
                    f"{compared.index}'s at token {position} (a sub-agent, a compacted context, "
                    f"or another conversation of the client): held {held_text!r} vs new "
                    f"{new_text!r} after {context!r}"
                )
            else:
                explanation = (
                    f"the re-rendered prompt differs from the held prompt tokens {where} "
                    f"at token {position}: held {held_text!r} vs new {new_text!r} "
                    f"after {context!r}"
                )
        fallback = turn.metadata.get("history_fallback")
        if isinstance(fallback, str):
            explanation += f" (token history was not used for this turn: {fallback})"
        return DriftEvent(
            turn=index,
            reason=reason,
            compared_trajectory=compared.index,
            position=position,
            held_token=held_token,
            new_token=new_token,
            held_length=len(held),
            new_length=len(new),
            message_index=message_index,
            message_role=message_role,
            in_model_output=in_model_output,
            context=context,
            held_text=held_text,
            new_text=new_text,
            explanation=explanation,
        )

    def _safe_decode(self, ids: array[int]) -> str:
        try:
            return self._decode(ids.tolist())
        except Exception as exc:  # a diagnostic must never fail the turn being recorded
            return f"{_ids_as_text(ids.tolist())} (decode failed: {exc})"


def _as_int_array(ids: Sequence[int]) -> array[int]:
    if isinstance(ids, array) and ids.typecode == "i":
        return ids
    return array("i", ids)
