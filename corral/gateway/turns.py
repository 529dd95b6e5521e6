"""The turn pipeline's own types: what every wire dialect translates to and from.

A dialect (Chat Completions, Anthropic Messages, OpenAI Responses) parses its request body into
a :class:`TurnRequest`, hands it to :class:`~corral.gateway.pipeline.TurnPipeline`, and turns
what comes back (a :class:`TurnResult`, or the :data:`TurnEvent` stream of one) into its own
wire format. Nothing here knows any wire format; nothing in a dialect knows the engine, the
chat template or the recording.

Messages are kept in the form Hugging Face chat templates render (:meth:`Message.template`):
``system`` / ``user`` / ``assistant`` / ``tool`` roles, text content, assistant tool calls
with their arguments, and the assistant's reasoning where the template renders it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
FinishName = Literal["stop", "length", "tool_calls", "abort"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """An assistant's call of a tool. ``arguments`` is JSON text, as the model wrote it."""

    id: str
    name: str
    arguments: str

    def template(self) -> dict[str, Any]:
        # Templates serialise arguments with ``tojson``: an object renders as the model wrote
        # it; text that is not a JSON object stays a string and renders as written.
        try:
            args: Any = json.loads(self.arguments)
        except json.JSONDecodeError:
            args = self.arguments
        if not isinstance(args, dict):
            args = self.arguments
        function = {"name": self.name, "arguments": args}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class Message:
    """One message of the conversation, as the chat template sees it."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None

    def template(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None:
            d["reasoning_content"] = self.reasoning
        if self.tool_calls:
            d["tool_calls"] = [c.template() for c in self.tool_calls]
        return d

    def characters(self) -> int:
        """Characters this message puts into the prompt (a bound on its rendering work)."""
        n = len(self.content) + len(self.reasoning or "")
        return n + sum(len(c.name) + len(c.arguments) for c in self.tool_calls)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; ``parameters`` is its JSON Schema (checked valid)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def template(self) -> dict[str, Any]:
        # Key order matters: templates render the dict as JSON, in this order (OpenAI's).
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class NamedTool:
    """``tool_choice`` naming one function: the model must call exactly it."""

    name: str


ToolChoice = Literal["auto", "none", "required"] | NamedTool


@dataclass(frozen=True, slots=True)
class JsonOutput:
    """The reply must be JSON: any object (``schema`` None) or an instance of ``schema``
    (``strict``: OpenAI's strict mode, no undeclared properties). ``param`` names the
    request field that asked, for errors."""

    schema: dict[str, Any] | None = None
    strict: bool = False
    param: str = "response_format"


@dataclass(frozen=True, slots=True)
class Sampling:
    """What the client asked of sampling; ``None`` leaves the engine's default (or the
    session's override) in force."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = None


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One request for the model's next message, in no wire format.

    ``sent`` is the request's conversation as the client sent it (JSON form, recorded with the
    turn). ``template_kwargs`` are the client's template variables, already checked against
    the operator's allow-list; ``thinking`` is the dialect's thinking switch (``None``: the
    template's default). ``label`` marks requests that are not the agent's main conversation
    (e.g. Claude Code's title and summary requests: ``"side"``). ``wire`` is the dialect's own
    parsed request, for answering in kind; the pipeline never looks at it.
    """

    messages: tuple[Message, ...]
    sent: list[dict[str, Any]]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    sampling: Sampling = field(default_factory=Sampling)
    output: JsonOutput | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking: bool | None = None
    stream: bool = False
    label: str | None = None
    wire: Any = None
    # Characters of text the prompt will hold, before the template's own (a bound on the work
    # of rendering it); computed once, the pipeline reads it more than once a turn.
    characters: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = sum(m.characters() for m in self.messages)
        n += sum(len(json.dumps(t.parameters)) + len(t.description or "") for t in self.tools)
        object.__setattr__(self, "characters", n)


# ---- results ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TopToken:
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's text and logprob, with the requested alternatives."""

    token: str
    logprob: float
    top: tuple[TopToken, ...] = ()


@dataclass(frozen=True, slots=True)
class Finish:
    """Why a choice ended. ``stop_sequence`` is the client's stop string that ended it."""

    reason: FinishName
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """One finished choice as the client sees it."""

    index: int
    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    finish: Finish
    logprobs: tuple[TokenLogprob, ...] | None = None
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class TurnResult:
    """A finished turn: everything any dialect needs to write its answer (and to replay it)."""

    id: str
    created: int
    model: str
    choices: tuple[ChoiceResult, ...]
    usage: Usage


def new_turn_id() -> str:
    return secrets.token_hex(12)


def now_s() -> int:
    return int(time.time())


# ---- stream events ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextDelta:
    choice: int
    text: str


@dataclass(frozen=True, slots=True)
class ThinkingDelta:
    choice: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    """A tool call begins: ``call`` is its index within the choice."""

    choice: int
    call: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArguments:
    """More of a started call's arguments (JSON text fragments, in order)."""

    choice: int
    call: int
    text: str


@dataclass(frozen=True, slots=True)
class LogprobsDelta:
    choice: int
    tokens: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class ChoiceFinished:
    choice: int
    finish: Finish


@dataclass(frozen=True, slots=True)
class TurnStarted:
    """The first event of every stream: the ids a dialect puts in its opening frame."""

    id: str
    created: int
    model: str
    choices: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class TurnFinished:
    """The last event of a stream that ran to its end."""

    result: TurnResult


TurnEvent = (
    TurnStarted
    | TextDelta
    | ThinkingDelta
    | ToolCallStarted
    | ToolCallArguments
    | LogprobsDelta
    | ChoiceFinished
    | TurnFinished
)


def result_events(result: TurnResult) -> list[TurnEvent]:
    """A finished result as the stream that would have produced it (for replaying a retry);
    each event is a batch of its own when streamed."""
    events: list[TurnEvent] = [
        TurnStarted(
            id=result.id,
            created=result.created,
            model=result.model,
            choices=len(result.choices),
            prompt_tokens=result.usage.prompt_tokens,
        )
    ]
    for c in result.choices:
        if c.reasoning:
            events.append(ThinkingDelta(c.index, c.reasoning))
        if c.content:
            events.append(TextDelta(c.index, c.content))
        for k, call in enumerate(c.tool_calls):
            events.append(ToolCallStarted(c.index, k, call.id, call.name))
            events.append(ToolCallArguments(c.index, k, call.arguments))
        events.append(ChoiceFinished(c.index, c.finish))
    events.append(TurnFinished(result))
    return events


@dataclass(frozen=True, slots=True)
class StreamedAnswer:
    """A streamed turn as it went out, for replaying a retry in the same order: some dialects'
    answers depend on it (Anthropic's content blocks follow the model's text and calls as they
    came)."""

    result: TurnResult
    events: tuple[TurnEvent, ...]


def compact_events(events: Sequence[TurnEvent]) -> list[TurnEvent]:
    """``events`` with each run of deltas of one kind (same choice, same call) merged into one:
    the same stream, fewer and larger frames (what a replay keeps)."""
    out: list[TurnEvent] = []
    for event in events:
        last = out[-1] if out else None
        if (
            isinstance(event, TextDelta)
            and isinstance(last, TextDelta)
            and last.choice == event.choice
        ):
            out[-1] = TextDelta(event.choice, last.text + event.text)
        elif (
            isinstance(event, ThinkingDelta)
            and isinstance(last, ThinkingDelta)
            and last.choice == event.choice
        ):
            out[-1] = ThinkingDelta(event.choice, last.text + event.text)
        elif (
            isinstance(event, ToolCallArguments)
            and isinstance(last, ToolCallArguments)
            and (last.choice, last.call) == (event.choice, event.call)
        ):
            out[-1] = ToolCallArguments(event.choice, event.call, last.text + event.text)
        elif (
            isinstance(event, LogprobsDelta)
            and isinstance(last, LogprobsDelta)
            and last.choice == event.choice
        ):
            out[-1] = LogprobsDelta(event.choice, last.tokens + event.tokens)
        else:
            out.append(event)
    return out
