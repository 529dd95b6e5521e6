"""Template check: whether a model's chat template lets the gateway record its sessions as one
sample each, and whether the parsers read back what the template makes the model write.

A battery of synthetic conversations (:func:`shapes`: plain chat with and without a system
prompt, a tool-call loop, parallel calls, a tool error, reasoning on and off, a long history) is
played without an engine. The model is simulated by the template itself: the model's output for
an assistant message is what the template renders for that message when it is the last one,
after the request's generation prompt, up to the end token (the special token the template's
close of an assistant message starts with, ``<|im_end|>`` for ChatML), encoded, plus that end
token's id. Then, per shape:

- ``template`` history: every turn's prompt is the whole request rendered; the turns go
  through a real :class:`~corral.gateway.recording.TrajectoryMerger`, which says which turns
  extend the held tokens and explains each fork exactly as the gateway's drift report does;
- ``tokens`` history: every prompt is built as the pipeline builds it (the held tokens plus
  :meth:`~corral.gateway.history.TokenHistory.continuation`'s suffix), merged the same way,
  and its held part is checked token for token against the model's own earlier tokens;
- the tool-call and reasoning parsers are run on each model output, which must give back the
  conversation's calls (names and arguments as JSON values) and reasoning.

A *break* under a history mode is a shape with more than one sample, a turn rendered in full
(a fallback), a held part that is not the model's own tokens, a parser mismatch, or a template
that does not render the model's reply as the continuation of its own generation prompt.

Pure logic, no CLI; only :func:`check_model_dir` reads files (the tokenizer, offline).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from corral.gateway.history import (
    Continuation,
    ConversationIndex,
    TokenHistory,
    TokenPrompt,
    TurnConversation,
    kwargs_key,
    message_key,
)
from corral.gateway.parsers.reasoning import THINK_OPEN, ReasoningParser, get_reasoning_parser
from corral.gateway.parsers.tool_calls import ToolCallParser, ToolSpec, get_tool_call_parser
from corral.gateway.recording import TrajectoryMerger, TurnRecord
from corral.gateway.rendering import ChatRenderer, TemplateError
from corral.gateway.settings import HISTORY_MODES, HistoryMode
from corral.gateway.turns import Message, Tool, ToolCall

__all__ = [
    "Break",
    "HistoryCheck",
    "ParserMiss",
    "Shape",
    "ShapeCheck",
    "TemplateReport",
    "TurnCheck",
    "check_model_dir",
    "check_template",
    "shapes",
]

# Turns of the long-history shape (model turns: half tool calls, half answers).
LONG_TURNS = 40
# Characters of rendered text quoted around a place where two renderings part.
_QUOTE = 40
# What a request that resends no held conversation falls back to (as the pipeline says it).

# ---- the battery --------------------------------------------------------------------------

_SYSTEM = "You are a careful assistant. Answer in one sentence."
_WEATHER = Tool(
    "get_weather",
    "Get the current weather in a city.",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
_ADD = Tool(
    "add",
    "Add two integers.",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
)
_CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Rome")


@dataclass(frozen=True)
class Shape:
    """One synthetic conversation. ``kwargs`` are the requests' template variables (on top of
    the operator's); ``skip`` says why the shape does not apply to this template (None: it
    does)."""

    name: str
    about: str
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    skip: str | None = None


def _user(text: str) -> Message:
    return Message("user", text)


def _answer(text: str, reasoning: str | None = None) -> Message:
    return Message("assistant", text, reasoning=reasoning)


def _calls(*calls: tuple[str, str, dict[str, Any]], reasoning: str | None = None) -> Message:
    """An assistant message of ``(id, name, arguments)`` calls and no text."""
    made = tuple(ToolCall(i, name, json.dumps(args)) for i, name, args in calls)
    return Message("assistant", "", tool_calls=made, reasoning=reasoning)


def _result(call_id: str, text: str) -> Message:
    return Message("tool", text, tool_call_id=call_id)


def _weather_round(n: int, city: str) -> tuple[Message, ...]:
    """A question, a call of get_weather, its result and the answer."""
    call = f"call_{n}"
    return (
        _user(f"What is the weather in {city}?"),
        _calls((call, "get_weather", {"city": city})),
        _result(call, json.dumps({"city": city, "condition": "sunny", "celsius": 20 + n % 9})),
        _answer(f"It is sunny in {city}."),
    )


def _chat(system: bool) -> tuple[Message, ...]:
    head = (Message("system", _SYSTEM),) if system else ()
    return (
        *head,
        _user("Hello! Who are you?"),
        _answer("I am an assistant."),
        _user("What is two plus two?"),
        _answer("Four."),
        _user("Thanks, bye."),
        _answer("Goodbye!"),
    )


def _reasoning_chat(reasoning: bool) -> tuple[Message, ...]:
    def why(text: str) -> str | None:
        return text if reasoning else None

    return (
        _user("What is 2 + 3?"),
        _calls(("call_1", "add", {"a": 2, "b": 3}), reasoning=why("The add tool does sums.")),
        _result("call_1", "5"),
        _answer("2 + 3 = 5.", why("The tool said 5.")),
        _user("And doubled?"),
        _answer("Ten.", why("Twice 5 is 10.")),
    )


def _long() -> tuple[Message, ...]:
    rounds = [_weather_round(n, _CITIES[n % len(_CITIES)]) for n in range(LONG_TURNS // 2)]
    return (Message("system", _SYSTEM), *(m for r in rounds for m in r))


def shapes(thinking_switch: bool, renders_reasoning: bool) -> tuple[Shape, ...]:
    """The battery, for a template with (or without) the ``enable_thinking`` switch and that
    renders (or drops) an assistant message's reasoning."""
    on: dict[str, Any] = {"enable_thinking": True} if thinking_switch else {}
    return (
        Shape("chat", "three user turns, no system prompt", _chat(system=False)),
        Shape("chat_system", "three user turns after a system prompt", _chat(system=True)),
        Shape(
            "tool_loop",
            "a call, its result, the answer, then another question",
            (*_weather_round(1, "Paris"), _user("Is that warm?"), _answer("Yes, mild.")),
            (_WEATHER,),
        ),
        Shape(
            "parallel_tools",
            "two calls in one reply, two results, after a system prompt",
            (
                Message("system", _SYSTEM),
                _user("Weather in Oslo and Lima?"),
                _calls(
                    ("call_1", "get_weather", {"city": "Oslo"}),
                    ("call_2", "get_weather", {"city": "Lima"}),
                ),
                _result("call_1", "Oslo: snowy, -3 C"),
                _result("call_2", "Lima: cloudy, 18 C"),
                _answer("Oslo is snowy, Lima is cloudy."),
            ),
            (_WEATHER, _ADD),
        ),
        Shape(
            "tool_error",
            "a call that fails, the corrected call, the answer",
            (
                _user("Add 2 and three."),
                _calls(("call_1", "add", {"a": 2, "b": "three"})),
                _result("call_1", 'error: argument "b" must be an integer, got "three"'),
                _calls(("call_2", "add", {"a": 2, "b": 3})),
                _result("call_2", "5"),
                _answer("2 + 3 = 5."),
            ),
            (_ADD,),
        ),
        Shape(
            "reasoning_on",
            "every reply reasons first (enable_thinking true where the template has it)",
            _reasoning_chat(reasoning=True),
            (_ADD,),
            on,
            None if renders_reasoning else "the template does not render an assistant's reasoning",
        ),
        Shape(
            "reasoning_off",
            "no reasoning, enable_thinking false",
            _reasoning_chat(reasoning=False),
            (_ADD,),
            {"enable_thinking": False},
            None if thinking_switch else "the template has no enable_thinking switch",
        ),
        Shape(
            "long_history",
            f"{LONG_TURNS} model turns of calls and answers after a system prompt",
            _long(),
            (_WEATHER,),
        ),
    )


# ---- the report ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnCheck:
    """One model turn of a shape under one history mode. ``message`` is the index of the
    assistant message it produced; ``merge`` the merger's reason (``first_turn``, ``extends``,
    ``diverged``, ``prompt_shorter``); ``drift`` the fork's explanation; ``boundary`` (tokens
    history) how the suffix was found, None when the prompt was rendered in full, and
    ``fallback`` why; ``held_mismatch`` where the held part is not the model's own tokens."""

    turn: int
    message: int
    merge: str
    trajectory: int
    drift: str | None = None
    boundary: str | None = None
    fallback: str | None = None
    held_mismatch: str | None = None

    @property
    def forks(self) -> bool:
        return self.merge not in ("first_turn", "extends")


@dataclass(frozen=True)
class HistoryCheck:
    """A shape's turns under one history mode, and the samples they merged into."""

    history: HistoryMode
    samples: int
    turns: tuple[TurnCheck, ...]

    def problems(self) -> tuple[str, ...]:
        """One line per kind of break: forks (the first one explained), each fallback reason,
        held parts that are not the model's own tokens."""
        out: list[str] = []
        forks = [t for t in self.turns if t.forks]
        if forks:
            first = forks[0]
            out.append(
                f"{self.history} history: {self.samples} samples, forks at {_runs(forks)}; "
                f"turn {first.turn}: {first.drift}"
            )
        reasons = dict.fromkeys(t.fallback for t in self.turns if t.fallback is not None)
        for reason in reasons:
            turns = [t for t in self.turns if t.fallback == reason]
            out.append(f"{self.history} history: {_runs(turns)} rendered in full: {reason}")
        out.extend(
            f"{self.history} history: turn {t.turn}: {t.held_mismatch}"
            for t in self.turns
            if t.held_mismatch is not None
        )
        return tuple(out)


def _runs(turns: Sequence[TurnCheck | ParserMiss]) -> str:
    """The turns' numbers as runs: ``turn 2``, ``turns 1, 3-5``."""
    runs: list[list[int]] = []
    for t in turns:
        if runs and runs[-1][-1] == t.turn - 1:
            runs[-1].append(t.turn)
        else:
            runs.append([t.turn])
    listed = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"turn {listed}" if len(turns) == 1 else f"turns {listed}"


@dataclass(frozen=True)
class ParserMiss:
    """A model turn whose output the parsers do not read back as the conversation has it."""

    turn: int
    message: int
    problem: str


@dataclass(frozen=True)
class ShapeCheck:
    """One shape's outcome. ``skipped``: why it was not played; ``unrenderable``: why the
    template cannot act as the model (then nothing else was checked); ``parser_misses``: the
    model turns whose output the parsers read wrongly."""

    name: str
    about: str
    turns: int
    skipped: str | None = None
    unrenderable: str | None = None
    template: HistoryCheck | None = None
    tokens: HistoryCheck | None = None
    parser_misses: tuple[ParserMiss, ...] = ()

    def under(self, history: HistoryMode) -> HistoryCheck | None:
        return self.template if history == "template" else self.tokens

    def breaks(self, history: HistoryMode) -> tuple[str, ...]:
        """Why this shape breaks under ``history`` (empty: it does not)."""
        if self.skipped is not None:
            return ()
        if self.unrenderable is not None:
            return (self.unrenderable,)
        check = self.under(history)
        out = list(check.problems() if check is not None else ())
        if self.parser_misses:
            first = self.parser_misses[0]
            out.append(
                f"parsers misread {_runs(self.parser_misses)}; turn {first.turn} "
                f"(message {first.message}): {first.problem}"
            )
        return tuple(out)


@dataclass(frozen=True)
class Break:
    shape: str
    reason: str


@dataclass(frozen=True)
class TemplateReport:
    """The whole check; :attr:`ok` and :meth:`breaks` judge it under ``history``."""

    model: str
    history: HistoryMode
    tool_call_parser: str
    reasoning_parser: str
    chat_template_kwargs: dict[str, Any]
    end_token: str | None
    shapes: tuple[ShapeCheck, ...]

    def breaks(self) -> tuple[Break, ...]:
        return tuple(Break(s.name, r) for s in self.shapes for r in s.breaks(self.history))

    @property
    def ok(self) -> bool:
        return not self.breaks()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, plus ``ok`` and ``breaks``."""
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        out["breaks"] = [dataclasses.asdict(b) for b in self.breaks()]
        return out


# ---- playing the battery ------------------------------------------------------------------


@dataclass(frozen=True)
class _ModelTurn:
    """An assistant message as the simulated model writes it: ``prompt_text`` is the
    template's rendering of the request before it (with the generation prompt)."""

    index: int
    prompt_text: str
    output_ids: tuple[int, ...]


class _Unrenderable(Exception):
    """The template cannot act as the model for a shape (the message says why)."""


@dataclass(frozen=True)
class _Checker:
    """What every shape is played with: one tokenizer's template, parsers, history."""

    tokenizer: PreTrainedTokenizerBase
    renderer: ChatRenderer
    history: TokenHistory
    tool_parser: ToolCallParser
    reasoning_parser: ReasoningParser

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def end_token(self, kwargs: dict[str, Any]) -> tuple[str, int]:
        """The special token the template's close of an assistant message starts with."""
        close = self.history.close(kwargs)
        if close is None:
            raise _Unrenderable(
                "the template does not render a reply: where a reply ends is unknown"
            )
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        found = [
            (t.content, i) for i, t in decoder.items() if t.special and close.startswith(t.content)
        ]
        if not found:
            raise _Unrenderable(
                f"the template closes a reply with {close!r}, which starts with no special token: "
                "the model has no end token to stop on"
            )
        return max(found, key=lambda pair: len(pair[0]))

    def model_turns(self, shape: Shape) -> tuple[_ModelTurn, ...]:
        end, end_id = self.end_token(shape.kwargs)
        return tuple(
            self._model_turn(shape, i, end, end_id)
            for i, m in enumerate(shape.messages)
            if m.role == "assistant"
        )

    def _model_turn(self, shape: Shape, i: int, end: str, end_id: int) -> _ModelTurn:
        before = self._render(shape, shape.messages[:i], generation=True)
        after = self._render(shape, shape.messages[: i + 1], generation=False)
        if not after.startswith(before):
            at = _parting(before, after)
            raise _Unrenderable(
                f"message {i} (assistant), rendered last, does not continue its generation "
                f"prompt: from character {at} the prompt has {before[at : at + _QUOTE]!r}, the "
                f"reply's rendering {after[at : at + _QUOTE]!r}"
            )
        written = after[len(before) :]
        stop = written.find(end)
        if stop < 0:
            raise _Unrenderable(
                f"message {i} (assistant) renders with no {end!r} after it: {written[-_QUOTE:]!r}"
            )
        ids = (*self.renderer.encode(written[:stop]), end_id)
        return _ModelTurn(i, before, ids)

    def _render(self, shape: Shape, messages: Sequence[Message], *, generation: bool) -> str:
        try:
            return self.renderer.render_text(
                [m.template() for m in messages],
                _tools(shape),
                shape.kwargs,
                add_generation_prompt=generation,
            )
        except TemplateError as exc:
            raise _Unrenderable(f"rendering the first {len(messages)} messages: {exc}") from None

    # -- history modes --

    def under_template(self, shape: Shape, turns: Sequence[_ModelTurn]) -> HistoryCheck:
        """Every prompt the whole request rendered, as ``template`` history does."""
        merger = TrajectoryMerger(self.decode)
        checks = []
        for n, turn in enumerate(turns):
            prompt = self.renderer.encode(turn.prompt_text)
            decision = merger.add(self._record(shape, turn, prompt, "template", None))
            drift = None if decision.drift is None else decision.drift.explanation
            checks.append(TurnCheck(n, turn.index, decision.reason, decision.trajectory, drift))
        return HistoryCheck("template", len(merger.trajectories), tuple(checks))

    def under_tokens(self, shape: Shape, turns: Sequence[_ModelTurn]) -> HistoryCheck:
        """Every prompt built as the pipeline builds it under ``tokens`` history."""
        merger = TrajectoryMerger(self.decode)
        held = ConversationIndex()
        checks = []
        previous: list[int] = []  # the last turn's prompt and output: what must be held
        for n, turn in enumerate(turns):
            prompt, continued, fallback = self._token_prompt(shape, turn, merger, held)
            mismatch = None if continued is None else _held_mismatch(prompt, previous)
            decision = merger.add(self._record(shape, turn, prompt, "tokens", fallback))
            keys = _keys(shape.messages[: turn.index + 1])
            turn_conversation = TurnConversation(
                keys,
                shape.tools,
                kwargs_key(shape.kwargs),
                None,
                len(prompt),
                len(turn.output_ids),
                "stop",
            )
            held.record(decision.trajectory, decision.action == "append", turn_conversation)
            previous = [*prompt, *turn.output_ids]
            drift = None if decision.drift is None else decision.drift.explanation
            boundary = None if continued is None else continued.boundary
            checks.append(
                TurnCheck(
                    n,
                    turn.index,
                    decision.reason,
                    decision.trajectory,
                    drift,
                    boundary,
                    fallback,
                    mismatch,
                )
            )
        return HistoryCheck("tokens", len(merger.trajectories), tuple(checks))

    def _token_prompt(
        self,
        shape: Shape,
        turn: _ModelTurn,
        merger: TrajectoryMerger,
        held: ConversationIndex,
    ) -> tuple[list[int], Continuation | None, str | None]:
        """The prompt, the continuation it was built with (None: rendered in full) and the
        fallback reason, as :meth:`TurnPipeline.render` decides them."""
        full = self.renderer.encode(turn.prompt_text)
        request = shape.messages[: turn.index]
        built = self.history.prompt(
            held,
            merger.trajectories,
            _keys(request),
            [m.template() for m in request],
            shape.tools,
            shape.kwargs,
            None,
        )
        if isinstance(built, TokenPrompt):
            return built.ids, built.continuation, None
        return full, None, built

    def _record(
        self,
        shape: Shape,
        turn: _ModelTurn,
        prompt: Sequence[int],
        history: HistoryMode,
        fallback: str | None,
    ) -> TurnRecord:
        messages = [m.template() for m in shape.messages[: turn.index]]
        tools = _tools(shape)

        def message_at(position: int) -> int:
            return self.renderer.message_at(messages, tools, shape.kwargs, position)

        return TurnRecord(
            prompt_ids=prompt,
            output_ids=turn.output_ids,
            output_logprobs=[0.0] * len(turn.output_ids),
            finish_reason="stop",
            weight_version="template-check",
            messages=messages,
            message_starts=message_at,
            response=shape.messages[turn.index].template(),
            metadata={} if fallback is None else {"history_fallback": fallback},
            history=history,
        )

    # -- parsers --

    def parser_miss(self, shape: Shape, n: int, turn: _ModelTurn) -> ParserMiss | None:
        """What the parsers get wrong in model turn ``n``'s output (None: they read it back),
        decoded and parsed as the pipeline parses an engine's output."""
        text = str(self.tokenizer.decode(list(turn.output_ids), skip_special_tokens=True))
        starts_in_reasoning = turn.prompt_text.rstrip().endswith(THINK_OPEN)
        reasoning, content = self.reasoning_parser.parse(
            text, starts_in_reasoning=starts_in_reasoning
        )
        wanted = shape.messages[turn.index]
        problems = []
        if (reasoning or None) != (wanted.reasoning or None):
            problems.append(
                f"reasoning parser {self.reasoning_parser.name} reads reasoning {reasoning!r}, "
                f"the conversation's is {wanted.reasoning!r}"
            )
        if shape.tools:
            specs = [ToolSpec(t.name, t.parameters) for t in shape.tools]
            parsed = self.tool_parser.parse(content, specs)
            got = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
            want = [(c.name, json.loads(c.arguments)) for c in wanted.tool_calls]
            if got != want:
                errors = f" ({'; '.join(parsed.errors)})" if parsed.errors else ""
                problems.append(
                    f"tool-call parser {self.tool_parser.name} reads calls {_show(got)}, the "
                    f"conversation's are {_show(want)}{errors}"
                )
        if not problems:
            return None
        return ParserMiss(n, turn.index, "; ".join(problems))

    def check(self, shape: Shape) -> ShapeCheck:
        model_turns = sum(1 for m in shape.messages if m.role == "assistant")
        base = ShapeCheck(shape.name, shape.about, model_turns, skipped=shape.skip)
        if shape.skip is not None:
            return base
        try:
            turns = self.model_turns(shape)
        except _Unrenderable as exc:
            return dataclasses.replace(base, unrenderable=str(exc))
        misses = (self.parser_miss(shape, n, t) for n, t in enumerate(turns))
        return dataclasses.replace(
            base,
            template=self.under_template(shape, turns),
            tokens=self.under_tokens(shape, turns),
            parser_misses=tuple(m for m in misses if m is not None),
        )


def _tools(shape: Shape) -> list[dict[str, Any]] | None:
    return [t.template() for t in shape.tools] or None


def _keys(messages: Sequence[Message]) -> tuple[Message, ...]:
    return tuple(message_key(m) for m in messages)


def _held_mismatch(prompt: Sequence[int], expected: Sequence[int]) -> str | None:
    """Where ``prompt`` does not start with ``expected`` (the last turn's prompt and output)."""
    n = len(expected)
    if list(prompt[:n]) == list(expected):
        return None
    at = next((i for i, (a, b) in enumerate(zip(prompt, expected, strict=False)) if a != b), n)
    return f"the held part differs from the model's own tokens at token {at} (of {n})"


def _parting(a: str, b: str) -> int:
    """The first character index where ``a`` and ``b`` differ."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _show(calls: list[tuple[str, Any]]) -> str:
    if not calls:
        return "none"
    return ", ".join(f"{name}({json.dumps(args, sort_keys=True)})" for name, args in calls)


def _renders_reasoning(renderer: ChatRenderer, kwargs: dict[str, Any]) -> bool:
    """Whether the template writes an assistant message's reasoning (as the last message)."""
    probe = "corral check: a line of reasoning"
    messages = [
        {"role": "user", "content": "corral check: a question"},
        {"role": "assistant", "content": "corral check: an answer", "reasoning_content": probe},
    ]
    try:
        return probe in renderer.render_text(messages, None, kwargs, add_generation_prompt=False)
    except TemplateError:
        return False


def check_template(
    tokenizer: PreTrainedTokenizerBase,
    *,
    model: str,
    history: HistoryMode,
    tool_call_parser: str,
    reasoning_parser: str,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> TemplateReport:
    """Play the battery with ``tokenizer``'s chat template; ``chat_template_kwargs`` are the
    operator's template variables (every render), as the gateway's. ValueError for an unknown
    parser or history mode; :class:`~corral.gateway.rendering.TemplateError` when the tokenizer
    has no chat template."""
    if history not in HISTORY_MODES:
        raise ValueError(f"unknown history mode {history!r}; known: {', '.join(HISTORY_MODES)}")
    operator = dict(chat_template_kwargs or {})
    renderer = ChatRenderer(tokenizer, operator)
    checker = _Checker(
        tokenizer,
        renderer,
        TokenHistory(renderer),
        get_tool_call_parser(tool_call_parser),
        get_reasoning_parser(reasoning_parser),
    )
    switch = "enable_thinking" in str(getattr(tokenizer, "chat_template", "") or "")
    on = {"enable_thinking": True} if switch else {}
    battery = shapes(switch, _renders_reasoning(renderer, on))
    try:
        end: str | None = checker.end_token({})[0]
    except _Unrenderable:
        end = None
    return TemplateReport(
        model=model,
        history=history,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        chat_template_kwargs=operator,
        end_token=end,
        shapes=tuple(checker.check(s) for s in battery),
    )


def check_model_dir(
    model_dir: str | Path,
    *,
    history: HistoryMode,
    tool_call_parser: str,
    reasoning_parser: str,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> TemplateReport:
    """:func:`check_template` with the tokenizer of a local model folder (loaded offline)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return check_template(
        tokenizer,
        model=str(model_dir),
        history=history,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        chat_template_kwargs=chat_template_kwargs,
    )
