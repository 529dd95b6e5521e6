"""Anthropic Messages over the turn pipeline.

Requests are ``POST /v1/messages`` bodies as the ``anthropic`` SDK and Claude Code send them;
answers are ``message`` bodies or Anthropic's server-sent events. The same parsing serves
``/v1/messages/count_tokens`` (:meth:`AnthropicMessages.parse_count_tokens`).

Requests are strict. A field the gateway does not know is a 400 naming it; a field Anthropic
defines that the gateway cannot honour (MCP servers, containers, server-side compaction,
Anthropic's own tools, images) is a 400 saying why; fields that change nothing for a
self-hosted text model are accepted and ignored, listed in ``anthropic_types.IGNORED_FIELDS``
(the wire models live there too). Every error takes Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``).

How a request becomes the pipeline's conversation (what the chat template renders):

- ``system`` (a string or text blocks) is the first message, role ``system``; ``system``
  messages inside ``messages`` stay where they are.
- The text blocks of one turn are joined with :data:`TEXT_JOINER`.
- Consecutive messages of one role are one turn, as Anthropic combines them.
- An assistant turn is ONE assistant message: its thinking blocks are the reasoning, its text
  blocks the content, its ``tool_use`` blocks the tool calls (arguments: ``input`` as JSON).
  ``redacted_thinking`` blocks hold nothing readable and are dropped. A conversation that
  ends with an assistant turn (Anthropic's prefill) is refused: the gateway cannot continue a
  message, only answer one.
- A user turn becomes, in order, one ``tool`` message per ``tool_result`` block (its text;
  ``is_error`` is recorded but not rendered: templates have no place for it, and Claude Code
  already says so in the text) and one ``user`` message per run of text blocks.
- Tool ids are used as they are: the ``tool_use`` ids of an answer are the pipeline's, and they
  come back in ``tool_use``/``tool_result`` blocks unchanged, so the next turn's render is the
  one the recorded tokens came from.

The recorded conversation (``TurnRequest.sent``) is the template's messages in chat form, one
entry per message the template renders (drift reports locate a fork by that index); block
markers that render nothing (``cache_control``, which Claude Code moves every turn) are gone.

Side requests. Claude Code sends small requests outside the agent's conversation (titles,
topics, summaries); they are labelled ``"side"`` (sessions may exclude them from samples). The
rule: the request offers no tools and comes from Claude Code (``User-Agent: claude-cli/...``
or an ``X-Claude-Code-Session-Id`` header). Claude Code's own turns always offer its tools.

Answers. ``content`` holds a thinking block (the model's reasoning, in full: the gateway never
omits it, whatever ``thinking.display`` asks, so that it comes back and renders as generated;
its ``signature`` is :data:`THINKING_SIGNATURE`: nothing is signed), a text block, and one
``tool_use`` block per call, in that order. ``stop_reason``: ``tool_use`` when calls were made,
``stop_sequence`` when a stop string ended the answer, ``max_tokens`` when the length limit
did, or when the engine cut the output short (an abort: the message is truncated all the same),
``end_turn`` otherwise. Prompt caching does not exist here: the cache counts are 0.

Streams follow Anthropic's order: ``message_start`` and a ``ping``, then each block's
``content_block_start`` / ``content_block_delta`` s / ``content_block_stop`` (a block opens
when the kind of output switches: reasoning, text, a tool call; a thinking block gets its
``signature_delta`` just before it stops), then ``message_delta`` (stop reason, usage) and
``message_stop``. A failure after the headers went out is an ``error`` event, and the stream
ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from types import MappingProxyType
from typing import Any

from starlette.datastructures import Headers

from corral.gateway.dialects.anthropic_types import (
    BlockDeltaEvent,
    BlockOut,
    BlockStartEvent,
    BlockStopEvent,
    InputJsonDeltaOut,
    MessageDeltaEvent,
    MessageDeltaOut,
    MessageIn,
    MessageOut,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    RedactedThinkingBlockIn,
    SignatureDeltaOut,
    StreamEvent,
    TextBlockIn,
    TextBlockOut,
    TextDeltaOut,
    ThinkingBlockIn,
    ThinkingBlockOut,
    ThinkingDeltaOut,
    ToolChoiceIn,
    ToolIn,
    ToolResultBlockIn,
    ToolUseBlockIn,
    ToolUseBlockOut,
    UsageOut,
)
from corral.gateway.dialects.base import EventBatches, RequestContext, sse, validate
from corral.gateway.dialects.schemas import check_tool_schema
from corral.gateway.errors import GatewayError, bad_request
from corral.gateway.turns import (
    ChoiceFinished,
    Finish,
    JsonOutput,
    Message,
    NamedTool,
    Sampling,
    TextDelta,
    ThinkingDelta,
    Tool,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
    ToolChoice,
    TurnFinished,
    TurnRequest,
    TurnResult,
    TurnStarted,
)

# Joins the text blocks of one turn (and of a tool result). Clients put their own spacing
# inside blocks (Claude Code's reminders end with a newline); a newline keeps blocks that do
# not from running together.
TEXT_JOINER = "\n"
# The signature of every thinking block the gateway returns: SDKs require a string, Claude
# Code sends it back unchanged; nothing is signed or checked.
THINKING_SIGNATURE = "corral-unsigned"
# Claude Code's user agent (``claude-cli/2.1.328 (external, sdk-cli)``) and session header.
CLAUDE_CODE_AGENT = "claude-cli/"
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"
SIDE_LABEL = "side"

_TEXT_ONLY = "this gateway serves a text model: {kind} blocks are not supported"
_SERVER_BLOCK = "'{kind}' blocks belong to Anthropic's server tools, which this gateway cannot run"
_UNSUPPORTED_BLOCKS = MappingProxyType(
    {
        "image": _TEXT_ONLY,
        "document": _TEXT_ONLY,
        "search_result": "search_result blocks are not supported (the gateway has no citations)",
        "tool_reference": "tool_reference blocks are not supported (every tool is offered "
        "up front: the gateway has no deferred tool loading)",
        "container_upload": "container_upload blocks are not supported (no containers here)",
    }
)


# ---- the dialect ------------------------------------------------------------------------------


class AnthropicMessages:
    """Anthropic's Messages API: the module docstring gives the contract."""

    name = "anthropic_messages"

    # -- requests ----------------------------------------------------------------------------

    def parse(self, data: dict[str, Any], ctx: RequestContext) -> TurnRequest:
        """A ``/v1/messages`` body as a turn; a 400 naming what is wrong or refused."""
        return _parse(data, ctx, count_only=False)

    def parse_count_tokens(self, data: dict[str, Any], ctx: RequestContext) -> TurnRequest:
        """A ``/v1/messages/count_tokens`` body: as :meth:`parse`, but ``max_tokens`` is not
        required (fields that only steer sampling are accepted: they change no count)."""
        return _parse(data, ctx, count_only=True)

    # -- answers -----------------------------------------------------------------------------

    def render(self, result: TurnResult, request: TurnRequest, ctx: RequestContext) -> bytes:
        choice = result.choices[0]  # Anthropic has no n: one choice, always
        blocks: list[BlockOut] = []
        if choice.reasoning:
            blocks.append(ThinkingBlockOut(thinking=choice.reasoning, signature=THINKING_SIGNATURE))
        if choice.content:
            blocks.append(TextBlockOut(text=choice.content))
        blocks += [
            ToolUseBlockOut(id=c.id, name=c.name, input=_tool_input(c.arguments))
            for c in choice.tool_calls
        ]
        reason, sequence = stop_reason(choice.finish)
        body = MessageOut(
            id=_message_id(result.id),
            model=result.model,
            content=blocks,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=UsageOut(
                input_tokens=result.usage.prompt_tokens,
                output_tokens=result.usage.completion_tokens,
            ),
        )
        return body.model_dump_json().encode()

    async def frame(
        self, batches: EventBatches, request: TurnRequest, ctx: RequestContext
    ) -> AsyncGenerator[str, None]:
        blocks = _Blocks()
        try:
            async for batch in batches:
                out: list[StreamEvent] = []
                for event in batch:
                    if isinstance(event, TurnStarted):
                        out.append(_message_start(event))
                        out.append(PingEvent())
                    elif isinstance(event, TurnFinished):
                        out += blocks.close()
                        out += _message_end(event.result)
                    elif event.choice != 0:
                        continue  # never: Anthropic requests have one choice
                    elif isinstance(event, ThinkingDelta):
                        out += blocks.thinking(event.text)
                    elif isinstance(event, TextDelta):
                        out += blocks.text(event.text)
                    elif isinstance(event, ToolCallStarted):
                        out += blocks.tool_started(event)
                    elif isinstance(event, ToolCallArguments):
                        out += blocks.tool_arguments(event)
                    elif isinstance(event, ChoiceFinished):
                        out += blocks.close()
                    # LogprobsDelta: Anthropic's API has no logprobs.
                if out:
                    yield "".join(sse(e.model_dump_json(), event=e.type) for e in out)
        except GatewayError as exc:
            # Headers are out already: the error is an event of the stream, as Anthropic's.
            yield sse(exc.anthropic_body(), event="error")

    def error_body(self, error: GatewayError) -> dict[str, Any]:
        return error.anthropic_body()


def stop_reason(finish: Finish) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finish (module docstring)."""
    if finish.reason == "tool_calls":
        return "tool_use", None
    if finish.reason in ("length", "abort"):
        return "max_tokens", None
    if finish.stop_sequence is not None:
        return "stop_sequence", finish.stop_sequence
    return "end_turn", None


# ---- parsing ----------------------------------------------------------------------------------


def _parse(data: dict[str, Any], ctx: RequestContext, *, count_only: bool) -> TurnRequest:
    req = validate(MessagesRequest, data)
    req.check_extra_fields()
    if req.max_tokens is None and not count_only:
        raise bad_request(
            "missing field 'max_tokens': Anthropic's Messages API requires it",
            param="max_tokens",
            code="invalid_field",
        )
    tools = _tools(req.tools or [])
    choice, parallel = _tool_choice(req.tool_choice, tools)
    output = None
    if req.output_config is not None and req.output_config.format is not None:
        output = JsonOutput(req.output_config.format.schema_, param="output_config.format")
    thinking = None if req.thinking is None else req.thinking.type != "disabled"
    messages = tuple(_conversation(req))
    failed = _failed_tool_uses(req)
    return TurnRequest(
        messages=messages,
        # One recorded entry per template message: drift reports name messages by that index.
        sent=[
            {**m.template(), "is_error": True}
            if m.role == "tool" and m.tool_call_id in failed
            else m.template()
            for m in messages
        ],
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        sampling=Sampling(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=req.max_tokens,
            stop=tuple(req.stop_sequences or ()),
        ),
        output=output,
        thinking=thinking,
        stream=req.stream,
        label=SIDE_LABEL if not tools and is_claude_code(ctx.headers) else None,
        wire=req,
    )


def _failed_tool_uses(req: MessagesRequest) -> frozenset[str]:
    """Ids of the tool uses whose results say ``is_error`` (recorded, never rendered)."""
    return frozenset(
        str(block.get("tool_use_id"))
        for m in req.messages
        if isinstance(m.content, list)
        for block in m.content
        if block.get("type") == "tool_result" and block.get("is_error") is True
    )


def is_claude_code(headers: Headers) -> bool:
    """Whether a request comes from Claude Code (its user agent or its session header)."""
    agent = headers.get("user-agent", "")
    return agent.startswith(CLAUDE_CODE_AGENT) or CLAUDE_CODE_SESSION_HEADER in headers


def _tools(raw: Sequence[dict[str, Any]]) -> tuple[Tool, ...]:
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise bad_request(
                f"tools.{i}: the tool name '{t.name}' is defined twice",
                param=f"tools.{i}.name",
                code="invalid_field",
            )
        seen.add(t.name)
    return tools


def _tool(raw: dict[str, Any], i: int) -> Tool:
    kind = raw.get("type")
    if kind not in (None, "custom"):
        # Server tools (web search, code execution) run at Anthropic; Anthropic-defined client
        # tools (bash, text editor, memory, computer) carry no schema: Anthropic supplies it.
        raise bad_request(
            f"tools.{i}: '{kind}' is one of Anthropic's own tools, which this gateway cannot "
            "offer; define the tool with a name and an input_schema instead",
            param=f"tools.{i}.type",
            code="unsupported_tool",
        )
    if "input_examples" in raw:
        raise bad_request(
            f"unsupported field 'tools.{i}.input_examples': chat templates render a tool's "
            "name, description and schema only",
            param=f"tools.{i}.input_examples",
            code="unsupported_field",
        )
    tool = validate(ToolIn, raw, prefix=f"tools.{i}.")
    if tool.allowed_callers is not None and "direct" not in tool.allowed_callers:
        raise bad_request(
            f"tools.{i}.allowed_callers: the model can only call tools directly here",
            param=f"tools.{i}.allowed_callers",
            code="unsupported_field",
        )
    return Tool(
        name=tool.name,
        description=tool.description,
        parameters=check_tool_schema(tool.input_schema, f"tools.{i}.input_schema"),
    )


def _tool_choice(choice: ToolChoiceIn | None, tools: tuple[Tool, ...]) -> tuple[ToolChoice, bool]:
    """The pipeline's tool choice and whether parallel calls are allowed."""
    if choice is None:
        return "auto", True
    parallel = not choice.disable_parallel_tool_use
    if choice.type in ("any", "tool") and not tools:
        raise bad_request(
            f"tool_choice '{choice.type}' needs tools, and the request offers none",
            param="tool_choice",
            code="invalid_field",
        )
    if choice.type == "any":
        return "required", parallel
    if choice.type == "tool":
        names = [t.name for t in tools]
        if choice.name not in names:
            raise bad_request(
                f"tool_choice names '{choice.name}', which is not among the tools: {names}",
                param="tool_choice.name",
                code="invalid_field",
            )
        return NamedTool(str(choice.name)), parallel
    return choice.type, parallel


def _conversation(req: MessagesRequest) -> list[Message]:
    out: list[Message] = []
    if req.system is not None:
        system = req.system
        text = system if isinstance(system, str) else TEXT_JOINER.join(b.text for b in system)
        out.append(Message(role="system", content=text))
    turns = _turns(req.messages)
    if turns[-1][0] == "assistant":
        raise bad_request(
            "the last message is the assistant's (a prefill): this gateway answers a "
            "conversation but cannot continue a message",
            param=f"messages.{len(req.messages) - 1}",
            code="unsupported_prefill",
        )
    for role, blocks in turns:
        if role == "assistant":
            out.append(_assistant(blocks))
        elif role == "user":
            out += _user(blocks)
        else:
            out.append(Message(role="system", content=_text_only(blocks)))
    return out


_Located = tuple[str, dict[str, Any]]  # a content block and where it is ("messages.2.content.0.")


def _turns(messages: Sequence[MessageIn]) -> list[tuple[str, list[_Located]]]:
    """The messages as turns: consecutive user or assistant messages combined (as Anthropic
    does); each block with its place in the request, for errors."""
    turns: list[tuple[str, list[_Located]]] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            blocks = [(f"messages.{i}.content.", {"type": "text", "text": m.content})]
        else:
            blocks = [(f"messages.{i}.content.{j}.", b) for j, b in enumerate(m.content)]
        if turns and turns[-1][0] == m.role and m.role != "system":
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    return turns


def _assistant(blocks: Sequence[_Located]) -> Message:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for where, raw in blocks:
        kind = _kind(raw, where)
        if kind == "text":
            texts.append(validate(TextBlockIn, raw, prefix=where).text)
        elif kind == "thinking":
            thoughts.append(validate(ThinkingBlockIn, raw, prefix=where).thinking)
        elif kind == "redacted_thinking":
            validate(RedactedThinkingBlockIn, raw, prefix=where)  # opaque: nothing to render
        elif kind == "tool_use":
            use = validate(ToolUseBlockIn, raw, prefix=where)
            args = json.dumps(use.input, ensure_ascii=False)
            calls.append(ToolCall(id=use.id, name=use.name, arguments=args))
        else:
            raise _refused_block(kind, where, "assistant")
    return Message(
        role="assistant",
        content=TEXT_JOINER.join(texts),
        tool_calls=tuple(calls),
        reasoning=TEXT_JOINER.join(thoughts) if thoughts else None,
    )


def _user(blocks: Sequence[_Located]) -> list[Message]:
    out: list[Message] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append(Message(role="user", content=TEXT_JOINER.join(texts)))
            texts.clear()

    for where, raw in blocks:
        kind = _kind(raw, where)
        if kind == "text":
            texts.append(validate(TextBlockIn, raw, prefix=where).text)
        elif kind == "tool_result":
            flush()
            result = validate(ToolResultBlockIn, raw, prefix=where)
            out.append(
                Message(
                    role="tool",
                    content=_tool_result_text(result.content, where),
                    tool_call_id=result.tool_use_id,
                )
            )
        else:
            raise _refused_block(kind, where, "user")
    flush()
    return out or [Message(role="user", content="")]


def _tool_result_text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, raw in enumerate(content):
        at = f"{where}content.{j}."
        kind = _kind(raw, at)
        if kind != "text":
            raise _refused_block(kind, at, "tool_result")
        texts.append(validate(TextBlockIn, raw, prefix=at).text)
    return TEXT_JOINER.join(texts)


def _text_only(blocks: Sequence[_Located]) -> str:
    texts = []
    for where, raw in blocks:
        kind = _kind(raw, where)
        if kind != "text":
            raise _refused_block(kind, where, "system")
        texts.append(validate(TextBlockIn, raw, prefix=where).text)
    return TEXT_JOINER.join(texts)


def _kind(raw: dict[str, Any], where: str) -> str:
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise bad_request(
            f"invalid field '{where}type': a content block needs a 'type'",
            param=where + "type",
            code="invalid_field",
        )
    return kind


def _refused_block(kind: str, where: str, holder: str) -> GatewayError:
    param = where.rstrip(".")
    if kind in _UNSUPPORTED_BLOCKS:
        message = _UNSUPPORTED_BLOCKS[kind].format(kind=kind)
    elif kind.endswith("_tool_result") or kind in ("server_tool_use", "mcp_tool_use"):
        message = _SERVER_BLOCK.format(kind=kind)
    elif kind in ("text", "thinking", "redacted_thinking", "tool_use", "tool_result"):
        message = f"'{kind}' blocks cannot appear in a {holder} message"
    else:
        message = f"unknown content block type '{kind}'"
    return bad_request(f"{param}: {message}", param=param, code="unsupported_content")


def _message_id(turn_id: str) -> str:
    return "msg_" + turn_id


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as ``tool_use`` input. The tool-call parsers only make calls whose
    arguments are a JSON object; anything else (never expected) becomes ``{}``."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _message_start(event: TurnStarted) -> MessageStartEvent:
    return MessageStartEvent(
        message=MessageOut(
            id=_message_id(event.id),
            model=event.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=UsageOut(input_tokens=event.prompt_tokens, output_tokens=0),
        )
    )


def _message_end(result: TurnResult) -> list[StreamEvent]:
    reason, sequence = stop_reason(result.choices[0].finish)
    usage = UsageOut(
        input_tokens=result.usage.prompt_tokens, output_tokens=result.usage.completion_tokens
    )
    delta = MessageDeltaOut(stop_reason=reason, stop_sequence=sequence)
    return [MessageDeltaEvent(delta=delta, usage=usage), MessageStopEvent()]


class _Blocks:
    """The content blocks of a stream: one is open at a time; it closes when the kind of
    output switches (reasoning, text, a tool call) or the choice finishes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text", or "tool:<call index>"
        self.calls: dict[int, int] = {}  # a call's index -> its block's index

    def close(self) -> list[StreamEvent]:
        if self.open is None:
            return []
        out: list[StreamEvent] = []
        if self.open == "thinking":
            signature = SignatureDeltaOut(signature=THINKING_SIGNATURE)
            out.append(BlockDeltaEvent(index=self.index, delta=signature))
        out.append(BlockStopEvent(index=self.index))
        self.open = None
        return out

    def _switch(self, kind: str, block: BlockOut) -> list[StreamEvent]:
        if self.open == kind:
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(BlockStartEvent(index=self.index, content_block=block))
        return out

    def thinking(self, text: str) -> list[StreamEvent]:
        out = self._switch("thinking", ThinkingBlockOut(thinking="", signature=""))
        out.append(BlockDeltaEvent(index=self.index, delta=ThinkingDeltaOut(thinking=text)))
        return out

    def text(self, text: str) -> list[StreamEvent]:
        out = self._switch("text", TextBlockOut(text=""))
        out.append(BlockDeltaEvent(index=self.index, delta=TextDeltaOut(text=text)))
        return out

    def tool_started(self, event: ToolCallStarted) -> list[StreamEvent]:
        block = ToolUseBlockOut(id=event.id, name=event.name, input={})
        out = self._switch(f"tool:{event.call}", block)
        self.calls[event.call] = self.index
        return out

    def tool_arguments(self, event: ToolCallArguments) -> list[StreamEvent]:
        # A call's arguments follow its start, before any other output: its block is open.
        index = self.calls.get(event.call, self.index)
        delta = InputJsonDeltaOut(partial_json=event.text)
        return [BlockDeltaEvent(index=index, delta=delta)]
