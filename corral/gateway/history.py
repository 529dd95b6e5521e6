"""Token history: a session's next prompt as the tokens it already holds plus only what is new.

A chat template re-renders the whole conversation on every turn, and many templates render
history differently from what the model produced (Qwen3 drops the think block of an earlier
answer; a model may also sample a tokenization of its text that re-encoding would not give).
Then the new prompt no longer extends the held tokens, and the session's turns split into
several samples, each repeating the context. With ``history = "tokens"`` the gateway instead
builds the prompt as

    the held trajectory's tokens (every prompt and output token, exactly as the engine saw and
    produced them) + the template's *suffix*: its glue after the model's last token, then the
    new messages (tool results, the next user message) and the generation prompt

so the model sees its own earlier tokens and every turn appends to one sample.

Finding the suffix is checked, never guessed (:meth:`TokenHistory.continuation`):

1. *isolated*: the new messages rendered after a small probe conversation (the request's system
   message, a probe question, maybe a probe reply) give a text that the whole request's
   rendering ends with, right after the template's close of an assistant message. Tried first:
   it costs one rendering of the whole conversation.
2. *prefix*: the held conversation rendered on its own is a prefix of the whole request's
   rendering; the suffix is the rest (templates whose new messages render differently after a
   probe than after the real conversation).
3. Otherwise the turn is rendered in full (``template`` history for that turn) and the reason
   is recorded (the drift report lists it).

Which held conversation a request continues is decided on messages (:class:`ConversationIndex`):
the request must resend a trajectory's last request and the reply it got, with the same tools and
template variables. The reply is compared on what the model's tokens carry (its text and its
calls' names and arguments as JSON values), not on call ids or reasoning, which clients drop or
rewrite; anything else (an edited, truncated or compacted history, a sub-agent) starts a new
trajectory, as under ``template`` history.

Pure: no I/O, no engine, no HTTP. Not thread-safe (the gateway calls it from one event loop, or
from one worker thread per request).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from corral.gateway.recording import Trajectory
from corral.gateway.rendering import ChatRenderer, TemplateError
from corral.gateway.turns import Message, Tool, ToolCall

Boundary = Literal["prefix", "isolated", "repeat"]

# Conversations remembered per session (the most recently continued ones): a client continues
# one of its latest; an old branch that comes back is rendered in full.
KEPT_CONVERSATIONS = 16

# Why a request of a session that holds conversations is rendered in full.
NO_HELD_CONVERSATION = (
    "the request resends no held conversation (its history was edited, truncated or compacted, "
    "or it is another conversation)"
)

# The probe conversation that tells where the template closes an assistant message, and after
# which new messages are rendered on their own. Distinctive text that no template rewrites.
_PROBE_QUESTION = "corral probe: the question"
_PROBE_REPLY = "corral probe: the reply"


def message_key(message: Message) -> Message:
    """What a message is compared on when deciding whether a request resends a held
    conversation: everything, except for an assistant message only its text and its calls'
    names and arguments (parsed JSON, so ``{"a": 1}`` and ``{"a":1}`` are one call)."""
    if message.role != "assistant":
        return message
    return Message(
        role="assistant",
        content=message.content,
        tool_calls=tuple(
            ToolCall(id="", name=c.name, arguments=_canonical_json(c.arguments))
            for c in message.tool_calls
        ),
    )


def _canonical_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (json.JSONDecodeError, RecursionError):
        return text


def kwargs_key(kwargs: dict[str, Any]) -> str:
    """Template variables as one comparable string."""
    return json.dumps(kwargs, sort_keys=True, default=repr)


@dataclass(frozen=True, slots=True)
class HeldPoint:
    """A place in a trajectory that a later request may continue from: after the first ``keys``
    messages of its conversation, which are its first ``tokens`` tokens. ``reply``: right after
    a model reply (``finish`` says how it ended), where new messages may follow; otherwise right
    after a request, which the same request again (a regeneration) gets as its prompt."""

    keys: int
    tokens: int
    reply: bool
    finish: str = "stop"


@dataclass(frozen=True, slots=True)
class TurnConversation:
    """What one recorded turn leaves: the :func:`message_key` s of its request followed by its
    reply, under which tools, template variables and label; its prompt and output lengths."""

    keys: tuple[Message, ...]
    tools: tuple[Tool, ...]
    kwargs: str
    label: str | None
    prompt_length: int
    output_length: int
    finish: str

    def points(self) -> tuple[HeldPoint, HeldPoint]:
        request = HeldPoint(len(self.keys) - 1, self.prompt_length, reply=False)
        end = self.prompt_length + self.output_length
        return request, HeldPoint(len(self.keys), end, reply=True, finish=self.finish)


@dataclass(frozen=True, slots=True)
class HeldConversation:
    """A trajectory's conversation (``keys``: its last turn's request and reply) and the points
    of it a request may continue from, in order."""

    trajectory: int
    keys: tuple[Message, ...]
    tools: tuple[Tool, ...]
    kwargs: str
    label: str | None
    points: tuple[HeldPoint, ...]


@dataclass(frozen=True, slots=True)
class HeldMatch:
    """A request resends ``held`` up to ``point`` and adds the messages from ``length`` on
    (``repeat``: it resends a turn's request exactly, without the reply)."""

    held: HeldConversation
    point: HeldPoint

    @property
    def length(self) -> int:
        return self.point.keys

    @property
    def repeat(self) -> bool:
        return not self.point.reply


class ConversationIndex:
    """A session's held conversations, one per trajectory, the most recently used first.

    Bounded to ``keep`` conversations; forgetting one only means a request continuing it is
    rendered in full.
    """

    def __init__(self, keep: int = KEPT_CONVERSATIONS) -> None:
        self.keep = keep
        self._held: OrderedDict[int, HeldConversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._held.clear()

    def held(self, trajectory: int) -> HeldConversation | None:
        """The conversation held for ``trajectory``, if any (not marked used)."""
        return self._held.get(trajectory)

    def record(self, trajectory: int, appended: bool, turn: TurnConversation) -> None:
        """Remember ``turn`` on ``trajectory``: added to its points when it was appended to it
        and resends its conversation, else as the trajectory's only turn."""
        old = self._held.get(trajectory)
        points: tuple[HeldPoint, ...] = turn.points()
        if (
            appended
            and old is not None
            and (old.tools, old.kwargs, old.label) == (turn.tools, turn.kwargs, turn.label)
            and turn.keys[: len(old.keys)] == old.keys
        ):
            points = (*old.points, *points)
        self._held[trajectory] = HeldConversation(
            trajectory, turn.keys, turn.tools, turn.kwargs, turn.label, points
        )
        self._held.move_to_end(trajectory, last=False)
        while len(self._held) > self.keep:
            self._held.popitem(last=True)

    def find(
        self,
        keys: Sequence[Message],
        tools: Sequence[Tool],
        kwargs: str,
        label: str | None,
    ) -> HeldMatch | None:
        """The furthest point of a held conversation that ``keys`` (a request's
        :func:`message_key` s) resends: a reply the request adds messages after, or a request
        it repeats exactly; on a tie a reply, then the most recently used conversation.
        ``None`` when the request continues none of them."""
        best: HeldMatch | None = None
        tools = tuple(tools)
        for held in self._held.values():
            if held.label != label or held.kwargs != kwargs or held.tools != tools:
                continue
            shared = _shared(keys, held.keys)
            for point in reversed(held.points):
                fits = point.keys <= shared and (point.reply or point.keys == len(keys))
                if not fits:
                    continue
                better = (
                    best is None
                    or point.keys > best.length
                    or (point.keys == best.length and point.reply and best.repeat)
                )
                if better:
                    best = HeldMatch(held, point)
                break  # points are in order: the first that fits is this one's furthest
        return best

    def shared(self, keys: Sequence[Message], label: str | None) -> int:
        """The most leading messages ``keys`` shares with a held conversation of ``label``."""
        return max(
            (_shared(keys, h.keys) for h in self._held.values() if h.label == label), default=0
        )


def _shared(a: Sequence[Message], b: Sequence[Message]) -> int:
    """How many leading messages two conversations share."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


@dataclass(frozen=True, slots=True)
class Continuation:
    """The next prompt under token history: ``held`` tokens of the trajectory, then
    ``suffix_ids`` (the encoding of ``suffix_text``). ``boundary`` says how the suffix was
    found."""

    trajectory: int
    held: int
    suffix_text: str
    suffix_ids: list[int]
    boundary: Boundary


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A prompt built under token history: its ids and how."""

    ids: list[int]
    continuation: Continuation


@dataclass(frozen=True, slots=True)
class Fallback:
    """No sound suffix: the turn is rendered in full, for this ``reason``."""

    reason: str


class TokenHistory:
    """Finds the suffix that continues held tokens, with one tokenizer's chat template."""

    def __init__(self, renderer: ChatRenderer) -> None:
        self.renderer = renderer
        decoder = getattr(renderer.tokenizer, "added_tokens_decoder", {}) or {}
        self._special = {i: t.content for i, t in decoder.items() if t.special}
        self._closes: dict[str, str | None] = {}

    def close(self, kwargs: dict[str, Any]) -> str | None:
        """The text the template writes after an assistant message's content (``<|im_end|>\\n``
        for ChatML), found by rendering a probe reply; ``None`` when the template refuses it."""
        key = kwargs_key(kwargs)
        if key not in self._closes:
            try:
                text = self.renderer.render_text(
                    [
                        {"role": "user", "content": _PROBE_QUESTION},
                        {"role": "assistant", "content": _PROBE_REPLY},
                    ],
                    None,
                    kwargs,
                    add_generation_prompt=False,
                )
            except TemplateError:
                self._closes[key] = None
            else:
                at = text.rfind(_PROBE_REPLY)
                self._closes[key] = None if at < 0 else text[at + len(_PROBE_REPLY) :]
        return self._closes[key]

    def glue(self, close: str, last_token: int, finish: str) -> str:
        """What follows the model's last token: the template's close, less the end token the
        model sampled itself (``<|im_end|>``) when it ended on it."""
        end = self._special.get(last_token)
        if finish == "stop" and end is not None and close.startswith(end):
            return close[len(end) :]
        return close

    def prompt(
        self,
        conversations: ConversationIndex,
        trajectories: Sequence[Trajectory],
        keys: tuple[Message, ...],
        messages: list[dict[str, Any]],
        tools: Sequence[Tool],
        kwargs: dict[str, Any],
        label: str | None,
    ) -> TokenPrompt | str | None:
        """The token-history prompt of a request in a session holding ``trajectories`` and
        ``conversations``: ``keys`` are its messages' :func:`message_key` s, ``messages`` the
        same in template form, ``tools`` and ``kwargs`` its tools and template variables. A
        reason (str) when the request shares messages with a held conversation of its
        ``label`` but continues none; ``None`` when it shares none (a first turn, or another
        conversation: rendered in full with nothing to explain)."""
        match = conversations.find(keys, tools, kwargs_key(kwargs), label)
        if match is None:
            # A request that shares not even its first message with what is held is another
            # conversation (a sub-agent, a side task), not a history that failed to match.
            return NO_HELD_CONVERSATION if conversations.shared(keys, label) > 0 else None
        t = trajectories[match.held.trajectory]
        template_tools = [tool.template() for tool in tools] or None
        outcome = self.continuation(match, t.tokens, messages, template_tools, kwargs)
        if isinstance(outcome, Fallback):
            return outcome.reason
        return TokenPrompt(t.tokens[: outcome.held].tolist() + outcome.suffix_ids, outcome)

    def continuation(
        self,
        match: HeldMatch,
        tokens: Sequence[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> Continuation | Fallback:
        """The suffix that continues the first ``match.point.tokens`` of ``tokens`` (the
        trajectory's) with ``messages`` (the whole request, template form), whose first
        ``match.length`` resend the held conversation. Never raises: a template that fails on a
        probe is a :class:`Fallback`."""
        trajectory, point = match.held.trajectory, match.point
        if match.repeat:
            return Continuation(trajectory, point.tokens, "", [], "repeat")
        close = self.close(kwargs)
        if close is None:
            return Fallback(
                "the template does not render a probe reply: where a reply ends is unknown"
            )
        held, new = messages[: match.length], messages[match.length :]
        try:
            full = self.renderer.render_text(messages, tools, kwargs)
        except TemplateError as exc:
            return Fallback(f"the template failed on the request: {exc}")
        # The isolated boundary first: it costs one rendering of the whole conversation (plus
        # small probes), the prefix boundary two.
        boundary: Boundary = "isolated"
        suffix = self._isolated(messages, new, tools, kwargs, full, close)
        if suffix is None:
            try:
                head = self.renderer.render_text(held, tools, kwargs, add_generation_prompt=False)
            except TemplateError as exc:
                return Fallback(f"the template failed on the held conversation: {exc}")
            if not (full.startswith(head) and head.endswith(close)):
                return Fallback(
                    "the template renders the new messages differently on their own, and the "
                    "held conversation differently once new messages follow it: no sound "
                    "boundary"
                )
            suffix, boundary = full[len(head) :], "prefix"
        text = self.glue(close, int(tokens[point.tokens - 1]), point.finish) + suffix
        return Continuation(trajectory, point.tokens, text, self.renderer.encode(text), boundary)

    def _isolated(
        self,
        messages: list[dict[str, Any]],
        new: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        full: str,
        close: str,
    ) -> str | None:
        """The new messages rendered after a probe conversation, if the whole request's
        rendering ends with exactly that text right after an assistant message's close."""
        base = [messages[0]] if messages and messages[0].get("role") == "system" else []
        question = {"role": "user", "content": _PROBE_QUESTION}
        reply = {"role": "assistant", "content": _PROBE_REPLY}
        # After a reply first (the new messages follow one); after a question when the
        # template rewrites a reply that is no longer last.
        for probe in ([*base, question, reply], [*base, question]):
            try:
                head = self.renderer.render_text(probe, tools, kwargs, add_generation_prompt=False)
                text = self.renderer.render_text([*probe, *new], tools, kwargs)
            except TemplateError:
                continue
            if not text.startswith(head):
                continue
            suffix = text[len(head) :]
            if full.endswith(suffix) and full[: len(full) - len(suffix)].endswith(close):
                return suffix
        return None
