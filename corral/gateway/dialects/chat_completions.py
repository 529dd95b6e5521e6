"""OpenAI Chat Completions over the turn pipeline.

Requests are :class:`~corral.gateway.openai_types.ChatCompletionRequest`; answers are
``chat.completion`` bodies or ``chat.completion.chunk`` streams. Stream contract (what the
OpenAI SDK, LiteLLM and LangChain rely on): every choice opens with ``role: assistant``;
a chunk holds at most one entry per choice index, and a delta's ``tool_calls`` at most one
entry per call index; each choice's ``finish_reason`` comes in a chunk of its own; usage (when
asked for) in a chunk with no choices; then ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from corral.gateway.dialects.base import (
    EventBatches,
    RequestContext,
    refuse_extra_fields,
    sse,
    validate,
)
from corral.gateway.dialects.schemas import check_tool_schema
from corral.gateway.errors import GatewayError, bad_request
from corral.gateway.openai_types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    DeltaFunctionCall,
    DeltaToolCall,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
    TopLogprob,
    Usage,
)
from corral.gateway.openai_types import TokenLogprob as WireLogprob
from corral.gateway.turns import (
    ChoiceFinished,
    ChoiceResult,
    JsonOutput,
    LogprobsDelta,
    NamedTool,
    Sampling,
    TextDelta,
    ThinkingDelta,
    TokenLogprob,
    Tool,
    ToolCallArguments,
    ToolCallStarted,
    ToolChoice,
    TurnFinished,
    TurnRequest,
    TurnResult,
    TurnStarted,
)
from corral.gateway.turns import Usage as TurnUsage

# Message fields no template renders: dropped before the turn is recorded.
_UNRENDERED = frozenset({"refusal", "annotations", "audio", "function_call"})


class ChatCompletions:
    name = "chat_completions"

    # -- requests ----------------------------------------------------------------------------

    def parse(self, data: dict[str, Any], ctx: RequestContext) -> TurnRequest:
        req = validate(ChatCompletionRequest, data)
        problem = req.combination_problem()
        if problem is not None:
            raise bad_request(problem[1], param=problem[0], code="invalid_field")
        refuse_extra_fields(*req.unknown_fields(), api="OpenAI's chat completions API")
        tools = tuple(
            Tool(
                name=t.function.name,
                description=t.function.description,
                parameters=check_tool_schema(
                    t.function.parameters, f"tools[{i}].function.parameters"
                ),
            )
            for i, t in enumerate(req.tools or ())
        )
        choice: ToolChoice = "auto"
        if isinstance(req.tool_choice, NamedToolChoice):
            choice = NamedTool(req.tool_choice.function.name)
        elif req.tool_choice is not None:
            choice = req.tool_choice
        output = None
        if req.response_format is not None and req.response_format.type != "text":
            schema = req.response_format.json_schema
            output = (
                JsonOutput(
                    check_tool_schema(schema.schema_ or {}, "response_format.json_schema.schema"),
                    strict=bool(schema.strict),
                )
                if schema is not None
                else JsonOutput()
            )
        thinking = None if req.reasoning_effort is None else req.reasoning_effort != "none"
        return TurnRequest(
            messages=tuple(m.to_turn() for m in req.messages),
            sent=[_recorded(m) for m in data["messages"]],
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            sampling=Sampling(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                max_tokens=req.max_completion_tokens or req.max_tokens,
                stop=tuple(req.stop_list()),
                seed=req.seed,
                n=req.n,
                frequency_penalty=req.frequency_penalty,
                presence_penalty=req.presence_penalty,
                logit_bias={int(k): v for k, v in req.logit_bias.items()}
                if req.logit_bias
                else None,
            ),
            output=output,
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs or 0,
            template_kwargs=dict(req.chat_template_kwargs or {}),
            thinking=thinking,
            stream=req.stream,
            wire=req,
        )

    # -- answers -----------------------------------------------------------------------------

    def render(self, result: TurnResult, request: TurnRequest, ctx: RequestContext) -> bytes:
        body = ChatCompletion(
            id=_completion_id(result.id),
            created=result.created,
            model=result.model,
            choices=[
                Choice(
                    index=c.index,
                    message=_response_message(c),
                    finish_reason=c.finish.reason,
                    logprobs=_wire_logprobs(c.logprobs),
                )
                for c in result.choices
            ],
            usage=_usage(result.usage),
        )
        return body.model_dump_json(exclude_none=True).encode()

    async def frame(
        self, batches: EventBatches, request: TurnRequest, ctx: RequestContext
    ) -> AsyncGenerator[str, None]:
        wire = request.wire
        include_usage = bool(
            isinstance(wire, ChatCompletionRequest)
            and wire.stream_options
            and wire.stream_options.include_usage
        )
        head: dict[str, Any] = {}
        try:
            async for batch in batches:
                deltas: dict[int, _DeltaBuilder] = {}
                finishes: list[ChoiceFinished] = []
                done: TurnFinished | None = None
                for event in batch:
                    if isinstance(event, TurnStarted):
                        head = {
                            "id": _completion_id(event.id),
                            "created": event.created,
                            "model": event.model,
                        }
                        for i in range(event.choices):
                            yield _chunk(head, [ChunkChoice(index=i, delta=_opening())])
                    elif isinstance(event, ChoiceFinished):
                        finishes.append(event)
                    elif isinstance(event, TurnFinished):
                        done = event
                    else:
                        deltas.setdefault(event.choice, _DeltaBuilder(event.choice)).add(event)
                # A batch's deltas, then its choices' ends, then (last batch) usage and [DONE].
                for builder in deltas.values():
                    yield _chunk(head, [builder.build()])
                for f in finishes:
                    finish = ChunkChoice(
                        index=f.choice, delta=Delta(), finish_reason=f.finish.reason
                    )
                    yield _chunk(head, [finish])
                if done is not None:
                    if include_usage:
                        chunk = ChatCompletionChunk(**head, choices=[])
                        chunk.usage = _usage(done.result.usage)
                        yield sse(chunk.model_dump_json(exclude_none=True))
                    yield "data: [DONE]\n\n"
        except GatewayError as exc:
            # Headers are out already: report the error in the stream, as OpenAI does.
            yield sse(exc.openai_body())

    def error_body(self, error: GatewayError) -> dict[str, Any]:
        return error.openai_body()


class _DeltaBuilder:
    """The events of one choice in one batch, as one delta."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.content = ""
        self.reasoning = ""
        self.calls: dict[int, DeltaToolCall] = {}
        self.logprobs: list[TokenLogprob] = []

    def add(self, event: Any) -> None:
        if isinstance(event, TextDelta):
            self.content += event.text
        elif isinstance(event, ThinkingDelta):
            self.reasoning += event.text
        elif isinstance(event, ToolCallStarted):
            self.calls[event.call] = DeltaToolCall(
                index=event.call,
                id=event.id,
                type="function",
                function=DeltaFunctionCall(name=event.name, arguments=""),
            )
        elif isinstance(event, ToolCallArguments):
            call = self.calls.setdefault(
                event.call, DeltaToolCall(index=event.call, function=DeltaFunctionCall())
            )
            call.function.arguments = (call.function.arguments or "") + event.text
        elif isinstance(event, LogprobsDelta):
            self.logprobs.extend(event.tokens)

    def build(self) -> ChunkChoice:
        delta = Delta(
            content=self.content or None,
            reasoning_content=self.reasoning or None,
            tool_calls=[self.calls[k] for k in sorted(self.calls)] or None,
        )
        logprobs = _wire_logprobs(tuple(self.logprobs)) if self.logprobs else None
        return ChunkChoice(index=self.index, delta=delta, logprobs=logprobs)


def _recorded(m: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in m.items() if k not in _UNRENDERED}
    if isinstance(out.get("content"), list):
        out["content"] = [p for p in out["content"] if p.get("type") != "refusal"]
    return out


def _opening() -> Delta:
    return Delta(role="assistant", content="")


def _chunk(head: dict[str, Any], choices: list[ChunkChoice]) -> str:
    return sse(ChatCompletionChunk(**head, choices=choices).model_dump_json(exclude_none=True))


def _completion_id(turn_id: str) -> str:
    return "chatcmpl-" + turn_id


def _response_message(c: ChoiceResult) -> ResponseMessage:
    calls = [
        ResponseToolCall(id=t.id, function=ResponseFunctionCall(name=t.name, arguments=t.arguments))
        for t in c.tool_calls
    ]
    return ResponseMessage(
        content=c.content, reasoning_content=c.reasoning, tool_calls=calls or None
    )


def _wire_logprobs(tokens: tuple[TokenLogprob, ...] | None) -> ChoiceLogprobs | None:
    if tokens is None:
        return None
    return ChoiceLogprobs(
        content=[
            WireLogprob(
                token=t.token,
                logprob=t.logprob,
                bytes=list(t.token.encode()),
                top_logprobs=[
                    TopLogprob(token=a.token, logprob=a.logprob, bytes=list(a.token.encode()))
                    for a in t.top
                ],
            )
            for t in tokens
        ]
    )


def _usage(u: TurnUsage) -> Usage:
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
    )
