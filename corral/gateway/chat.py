"""The chat service: one OpenAI chat-completions request through the engine, recorded as turns.

Plain logic, no HTTP: the app hands it a session and a validated request; it renders the
prompt, calls the engine with token ids, turns the engine's tokens into OpenAI fields and
returns the turns to record. Recording is the caller's job and happens only once the client
has the answer (:meth:`ChatService.commit`), so a turn the client never got is never recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from corral.engines.client import EngineClient
from corral.engines.errors import EngineError, EngineTimeout, EngineUnavailable
from corral.engines.protocol import FinishReason, GenerateRequest, LogprobEntry, SamplingParams
from corral.engines.stream import StreamDelta
from corral.gateway.detokenize import IncrementalDetokenizer
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
    FinishReasonName,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from corral.gateway.parsers.reasoning import get_reasoning_parser
from corral.gateway.parsers.tool_calls import (
    ContentDelta,
    ToolCallDelta,
    ToolSpec,
    get_tool_call_parser,
)
from corral.gateway.recording import TurnRecord
from corral.gateway.rendering import (
    ChatRenderer,
    TemplateError,
    template_messages,
    template_tools,
)
from corral.gateway.sessions import Session
from corral.gateway.settings import GatewaySettings

# Text forced after the generation prompt to honour tool_choice "required" / a named function,
# per tool-call format. The forced text is part of the prompt (never sampled, loss mask 0), and
# the next turn's re-rendered history contains it, so merging is unaffected.
_REQUIRED_PREFILL = {
    "qwen25": "<tool_call>\n",
    "qwen3_coder": "<tool_call>\n<function=",
    "llama3": '{"name": "',
}
_NAMED_PREFILL = {
    "qwen25": '<tool_call>\n{{"name": "{name}", "arguments": ',
    "qwen3_coder": "<tool_call>\n<function={name}>\n",
    "llama3": '{{"name": "{name}", "parameters": ',
}


@dataclass
class PreparedCall:
    """A validated request, rendered and ready for the engine."""

    request: ChatCompletionRequest
    messages: list[dict[str, Any]]
    # The request's messages as the client sent them (JSON), recorded with the turn.
    sent_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    prompt_ids: list[int]
    prefill: str
    starts_in_reasoning: bool
    tool_specs: list[ToolSpec] | None
    parse_tools: bool
    sampling: list[SamplingParams]
    stops: list[str]
    completion_id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class ChoiceOutput:
    """What the engine produced for one choice, plus the message the client got."""

    index: int
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[LogprobEntry] | None]
    finish: FinishReason
    weight_version: str
    message: ResponseMessage
    finish_reason: FinishReasonName
    parser_errors: list[str]


@dataclass
class Answer:
    """A finished call: the turns to record and, for replay, what the client received."""

    turns: list[TurnRecord]
    replay: str  # the chat completion as JSON, as the client received it


class ChatService:
    def __init__(
        self,
        settings: GatewaySettings,
        engine: EngineClient,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, settings.chat_template_kwargs)
        self.tool_parser = get_tool_call_parser(settings.tool_call_parser)
        self.reasoning_parser = get_reasoning_parser(settings.reasoning_parser)
        self._eos_ids = _eos_ids(tokenizer)

    # -- preparing ---------------------------------------------------------------------------

    def prepare(
        self,
        session: Session,
        request: ChatCompletionRequest,
        sent_messages: list[dict[str, Any]] | None = None,
    ) -> PreparedCall:
        """Validate what the request asks against the session, render it, size the output.

        Raises :class:`GatewayError` (400) naming what cannot be honoured.
        """
        problems = request.unsupported()
        if problems:
            field_name = problems[0].split(":", 1)[0]
            raise bad_request("; ".join(problems), param=field_name, code="unsupported_field")

        overrides = session.options.sampling
        messages = template_messages(request.messages)
        tools = template_tools(request.tools)
        kwargs = dict(request.chat_template_kwargs or {})
        parse_tools = bool(request.tools) and request.tool_choice != "none"
        prefill = self._prefill(request)
        try:
            text = self.renderer.render_text(messages, tools, kwargs) + prefill
        except TemplateError as exc:
            raise bad_request(str(exc), param="messages", code="template_error") from exc
        prompt_ids = self.renderer.encode(text)

        limit = self.settings.max_context_tokens
        if session.options.max_context_tokens is not None:
            limit = min(limit, session.options.max_context_tokens)
        room = limit - len(prompt_ids)
        if room <= 0:
            raise bad_request(
                f"the prompt has {len(prompt_ids)} tokens; this session's context holds at most "
                f"{limit} (prompt plus at least one output token)",
                param="messages",
                code="context_length_exceeded",
            )
        wanted = overrides.get("max_tokens") or request.max_completion_tokens or request.max_tokens
        max_new = room if wanted is None else min(int(wanted), room)

        stops = list(overrides.get("stop") or request.stop_list())
        seed = overrides.get("seed", request.seed)
        temperature = overrides.get("temperature", request.temperature)
        top_p = overrides.get("top_p", request.top_p)
        top_k = overrides.get("top_k", request.top_k)
        sampling = [
            SamplingParams(
                max_new_tokens=max_new,
                temperature=1.0 if temperature is None else float(temperature),
                top_p=1.0 if top_p is None else float(top_p),
                top_k=-1 if top_k is None else int(top_k),
                stop=stops or None,
                sampling_seed=None if seed is None else int(seed) + i,
                skip_special_tokens=False,
            )
            for i in range(request.n)
        ]
        tool_specs = (
            [ToolSpec.from_openai(t.model_dump()) for t in request.tools] if request.tools else None
        )
        if sent_messages is None:
            sent_messages = [m.model_dump(exclude_none=True) for m in request.messages]
        return PreparedCall(
            request=request,
            messages=messages,
            sent_messages=sent_messages,
            tools=tools,
            template_kwargs=kwargs,
            prompt_ids=prompt_ids,
            prefill=prefill,
            starts_in_reasoning=text.rstrip().endswith("<think>"),
            tool_specs=tool_specs,
            parse_tools=parse_tools,
            sampling=sampling,
            stops=stops,
        )

    def _prefill(self, request: ChatCompletionRequest) -> str:
        choice = request.tool_choice
        fmt = self.tool_parser.name
        if choice == "required":
            if fmt not in _REQUIRED_PREFILL:
                raise bad_request(f"tool_choice 'required' is not supported with parser {fmt}")
            return _REQUIRED_PREFILL[fmt]
        if isinstance(choice, NamedToolChoice):
            if fmt not in _NAMED_PREFILL:
                raise bad_request(f"a named tool_choice is not supported with parser {fmt}")
            return _NAMED_PREFILL[fmt].format(name=choice.function.name)
        return ""

    def _engine_request(self, call: PreparedCall, index: int, rid: str) -> GenerateRequest:
        return GenerateRequest(
            input_ids=call.prompt_ids,
            sampling_params=call.sampling[index],
            return_logprob=True,
            top_logprobs_num=call.request.top_logprobs or 0,
            rid=rid,
        )

    # -- non-streaming -----------------------------------------------------------------------

    async def complete(self, call: PreparedCall) -> tuple[str, Answer]:
        """Run all choices; return the chat completion as JSON text and the answer to record.

        On cancellation (client gone) every choice is aborted in the engine.
        """
        rids = [f"{call.completion_id}-{i}" for i in range(call.request.n)]
        tasks = [
            asyncio.ensure_future(self.engine.generate(self._engine_request(call, i, rid)))
            for i, rid in enumerate(rids)
        ]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await self._abort_all(rids)
            raise
        outputs = []
        for i, (rid, res) in enumerate(zip(rids, results, strict=True)):
            ids = list(res.output_ids) or [e[1] for e in res.meta_info.output_token_logprobs]
            logprobs = [e[0] for e in res.meta_info.output_token_logprobs]
            if len(logprobs) != len(ids):
                raise GatewayError(
                    502,
                    f"the engine returned {len(ids)} tokens but {len(logprobs)} logprobs",
                    type="engine_error",
                )
            finish = res.meta_info.finish_reason or FinishReason(type="abort")
            outputs.append(
                self._finish_choice(
                    call,
                    i,
                    rid,
                    ids,
                    logprobs,
                    list(res.meta_info.output_top_logprobs),
                    finish,
                    res.meta_info.weight_version,
                    self._decode(ids),
                )
            )
        response = ChatCompletion(
            id=call.completion_id,
            created=call.created,
            model=self.settings.model_name,
            choices=[
                Choice(
                    index=o.index,
                    message=o.message,
                    finish_reason=o.finish_reason,
                    logprobs=self._logprobs(call, o.output_ids, o.logprobs, o.top_logprobs),
                )
                for o in outputs
            ],
            usage=_usage(call, outputs),
        )
        body = response.model_dump_json(exclude_none=True)
        return body, Answer(turns=self._turns(call, outputs), replay=body)

    def _finish_choice(
        self,
        call: PreparedCall,
        index: int,
        rid: str,
        ids: list[int],
        logprobs: list[float],
        top: list[list[LogprobEntry] | None],
        finish: FinishReason,
        weight_version: str,
        generated: str,
        call_ids: Sequence[str] = (),
    ) -> ChoiceOutput:
        """One finished choice: ``generated`` is the decoded output (stop string not yet
        trimmed); ``call_ids`` are tool-call ids already streamed to the client, reused."""
        text = call.prefill + _trim_stop(generated, finish)
        message, errors = self._message(call, text, call_ids)
        return ChoiceOutput(
            index=index,
            rid=rid,
            output_ids=ids,
            logprobs=logprobs,
            top_logprobs=top,
            finish=finish,
            weight_version=weight_version,
            message=message,
            finish_reason=_finish_reason(finish, bool(message.tool_calls)),
            parser_errors=errors,
        )

    def _message(
        self, call: PreparedCall, text: str, call_ids: Sequence[str] = ()
    ) -> tuple[ResponseMessage, list[str]]:
        reasoning, content = self.reasoning_parser.parse(
            text, starts_in_reasoning=call.starts_in_reasoning
        )
        if not call.parse_tools:
            return ResponseMessage(content=content, reasoning_content=reasoning), []
        parsed = self.tool_parser.parse(content, call.tool_specs)
        calls = [
            ResponseToolCall(
                id=call_ids[i] if i < len(call_ids) else _call_id(),
                function=ResponseFunctionCall(name=c.name, arguments=c.arguments),
            )
            for i, c in enumerate(parsed.tool_calls)
        ]
        message = ResponseMessage(
            content=parsed.content, reasoning_content=reasoning, tool_calls=calls or None
        )
        return message, list(parsed.errors)

    def _decode(self, ids: Sequence[int]) -> str:
        # Special tokens such as <|im_end|> are dropped; the format's markers (<tool_call>,
        # <think>) are ordinary added tokens and stay in the text for the parsers.
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _logprobs(
        self,
        call: PreparedCall,
        ids: Sequence[int],
        logprobs: Sequence[float],
        top: Sequence[list[LogprobEntry] | None],
    ) -> ChoiceLogprobs | None:
        if not call.request.logprobs:
            return None
        content = []
        for pos, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
            if tid in self._eos_ids:
                continue
            token = self._token_text(tid)
            alternatives = top[pos] if pos < len(top) else None
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=lp,
                    bytes=list(token.encode()),
                    top_logprobs=[
                        TopLogprob(
                            token=(t := self._token_text(alt[1])),
                            logprob=alt[0],
                            bytes=list(t.encode()),
                        )
                        for alt in (alternatives or [])[: call.request.top_logprobs or 0]
                    ],
                )
            )
        return ChoiceLogprobs(content=content)

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    # -- streaming ---------------------------------------------------------------------------

    async def stream(self, call: PreparedCall, answer: list[Answer]) -> AsyncGenerator[str, None]:
        """Server-sent events of the call, as the engine makes tokens.

        When the stream has run to its end (``data: [DONE]`` handed to the transport), the
        finished :class:`Answer` is appended to ``answer`` for the caller to commit. If the
        consumer stops early (client disconnect) every engine request is aborted and nothing
        is appended.
        """
        n = call.request.n
        rids = [f"{call.completion_id}-{i}" for i in range(n)]
        states = [_ChoiceStream(self, call, i, rid) for i, rid in enumerate(rids)]
        queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for delta in self.engine.stream(self._engine_request(call, i, rids[i])):
                    queue.put_nowait((i, delta))
                queue.put_nowait((i, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(n)]
        finished = 0
        try:
            for state in states:
                yield _sse(self._chunk(call, [state.opening()]))
            while finished < n:
                i, item = await queue.get()
                if item is None:
                    finished += 1
                    if states[i].finish is None:
                        raise GatewayError(
                            502,
                            "the engine's stream ended without a finish reason",
                            type="engine_error",
                        )
                    continue
                if isinstance(item, BaseException):
                    raise item
                chunk_choices = states[i].push(item)
                if chunk_choices:
                    yield _sse(self._chunk(call, chunk_choices))
            outputs = [s.close() for s in states]
            if call.request.stream_options and call.request.stream_options.include_usage:
                usage_chunk = self._chunk(call, [])
                usage_chunk.usage = _usage(call, outputs)
                yield _sse(usage_chunk)
            yield "data: [DONE]\n\n"
            replay = ChatCompletion(
                id=call.completion_id,
                created=call.created,
                model=self.settings.model_name,
                choices=[
                    Choice(index=o.index, message=o.message, finish_reason=o.finish_reason)
                    for o in outputs
                ],
                usage=_usage(call, outputs),
            ).model_dump_json(exclude_none=True)
            answer.append(Answer(turns=self._turns(call, outputs), replay=replay))
        except (EngineError, GatewayError) as exc:
            # Headers are sent already: report the error in the stream, as OpenAI does.
            yield _sse_error(engine_error(exc) if isinstance(exc, EngineError) else exc)
        finally:
            for task in tasks:
                task.cancel()
            if finished < n:
                await self._abort_all(rids)

    def _chunk(self, call: PreparedCall, choices: list[ChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=call.completion_id,
            created=call.created,
            model=self.settings.model_name,
            choices=choices,
        )

    # -- recording ---------------------------------------------------------------------------

    def _turns(self, call: PreparedCall, outputs: list[ChoiceOutput]) -> list[TurnRecord]:
        group = call.completion_id if len(outputs) > 1 else None
        messages = call.sent_messages
        turns = []
        for o in outputs:
            metadata: dict[str, Any] = {"rid": o.rid, "finish_reason": o.finish_reason}
            if o.parser_errors:
                metadata["parser_errors"] = o.parser_errors
            if call.prefill:
                metadata["prefill"] = call.prefill
            turns.append(
                TurnRecord(
                    prompt_ids=call.prompt_ids,
                    output_ids=o.output_ids,
                    output_logprobs=o.logprobs,
                    finish_reason=o.finish.type,
                    weight_version=o.weight_version,
                    messages=messages,
                    message_starts=lambda position: self.renderer.message_at(
                        call.messages, call.tools, call.template_kwargs, position
                    ),
                    response=o.message.model_dump(exclude_none=True),
                    choice_group=group,
                    metadata=metadata,
                )
            )
        return turns

    def commit(self, session: Session, answer: Answer, replay_key: str | None) -> None:
        """Record a delivered answer. A session deleted meanwhile records nothing."""
        for turn in answer.turns:
            session.record(turn)
        if replay_key is not None:
            session.remember(replay_key, answer.replay)

    async def _abort_all(self, rids: Sequence[str]) -> None:
        async def abort(rid: str) -> None:
            with contextlib.suppress(EngineError):  # an engine that is gone has nothing to abort
                await self.engine.abort(rid)

        await asyncio.shield(asyncio.gather(*(abort(r) for r in rids)))


class _ChoiceStream:
    """One choice of a streamed call: tokens in, OpenAI chunk deltas out."""

    def __init__(self, service: ChatService, call: PreparedCall, index: int, rid: str) -> None:
        self.service = service
        self.call = call
        self.index = index
        self.rid = rid
        self.detok = IncrementalDetokenizer(service.tokenizer, skip_special_tokens=True)
        self.reasoning = service.reasoning_parser.streamer(
            starts_in_reasoning=call.starts_in_reasoning
        )
        self.tools = service.tool_parser.streamer(call.tool_specs) if call.parse_tools else None
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[LogprobEntry] | None] = []
        self.text = ""  # generated text so far (stop strings not yet trimmed)
        self.sent = 0  # characters of self.text already fed to the parsers
        self.hold = max((len(s) for s in call.stops), default=1) - 1
        self.finish: FinishReason | None = None
        self.weight_version = "default"
        self.call_ids: list[str] = []
        self.prefilled = False  # the forced prefill text goes to the parsers first

    def opening(self) -> ChunkChoice:
        return ChunkChoice(index=self.index, delta=Delta(role="assistant", content=""))

    def push(self, delta: StreamDelta) -> list[ChunkChoice]:
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.top.extend(delta.top_logprobs or [None] * len(delta.token_ids))
        self.weight_version = delta.weight_version
        self.text += self.detok.push(delta.token_ids)
        pieces = [] if self.prefilled else [self.call.prefill]
        self.prefilled = True
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason
            self.text += self.detok.flush()
            end = len(_trim_stop(self.text, delta.finish_reason))
        else:
            end = max(self.sent, len(self.text) - self.hold)
        pieces.append(self.text[self.sent : end])
        self.sent = end
        out_delta = self._parse("".join(pieces), final=delta.finish_reason is not None)
        logprobs = self.service._logprobs(
            self.call, delta.token_ids, delta.logprobs, delta.top_logprobs
        )
        choices = []
        if out_delta is not None or (logprobs and logprobs.content):
            choices.append(
                ChunkChoice(index=self.index, delta=out_delta or Delta(), logprobs=logprobs)
            )
        if delta.finish_reason is not None:
            choices.append(
                ChunkChoice(
                    index=self.index,
                    delta=Delta(),
                    finish_reason=_finish_reason(delta.finish_reason, bool(self.call_ids)),
                )
            )
        return choices

    def _parse(self, text: str, *, final: bool) -> Delta | None:
        r = self.reasoning.feed(text)
        reasoning, content = r.reasoning, r.content
        if final:
            tail = self.reasoning.finish()
            reasoning += tail.reasoning
            content += tail.content
        calls: list[DeltaToolCall] = []
        if self.tools is not None:
            events = self.tools.feed(content) if content else []
            if final:
                events += self.tools.finish()
            content = ""
            for event in events:
                if isinstance(event, ContentDelta):
                    content += event.text
                elif isinstance(event, ToolCallDelta):
                    calls.append(self._call_delta(event))
        if not (reasoning or content or calls):
            return None
        return Delta(
            content=content or None,
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )

    def _call_delta(self, event: ToolCallDelta) -> DeltaToolCall:
        if event.name is not None:
            self.call_ids.append(_call_id())
            return DeltaToolCall(
                index=event.index,
                id=self.call_ids[event.index],
                type="function",
                function=DeltaFunctionCall(name=event.name, arguments=event.arguments),
            )
        return DeltaToolCall(
            index=event.index, function=DeltaFunctionCall(arguments=event.arguments)
        )

    def close(self) -> ChoiceOutput:
        assert self.finish is not None
        return self.service._finish_choice(
            self.call,
            self.index,
            self.rid,
            self.ids,
            self.logprobs,
            self.top,
            self.finish,
            self.weight_version,
            self.text,
            self.call_ids,
        )


# -- helpers ---------------------------------------------------------------------------------


def engine_error(exc: EngineError) -> GatewayError:
    """The gateway's answer to an engine failure: 503 down, 504 slow, 502 garbage."""
    if isinstance(exc, EngineUnavailable):
        return GatewayError(503, f"the engine is unavailable: {exc}", type="engine_unavailable")
    if isinstance(exc, EngineTimeout):
        return GatewayError(504, f"the engine did not answer in time: {exc}", type="engine_timeout")
    return GatewayError(502, f"the engine failed: {exc}", type="engine_error")


def _trim_stop(text: str, finish: FinishReason) -> str:
    if finish.type == "stop" and isinstance(finish.matched, str) and finish.matched:
        cut = text.find(finish.matched)
        if cut >= 0:
            return text[:cut]
    return text


def _finish_reason(finish: FinishReason, has_tool_calls: bool) -> FinishReasonName:
    if finish.type == "length":
        return "length"
    if finish.type == "abort":
        return "abort"
    return "tool_calls" if has_tool_calls else "stop"


def _usage(call: PreparedCall, outputs: Sequence[ChoiceOutput]) -> Usage:
    completion = sum(len(o.output_ids) for o in outputs)
    prompt = len(call.prompt_ids)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _eos_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return frozenset(i for i in ids if isinstance(i, int))


def _sse(chunk: ChatCompletionChunk) -> str:
    return "data: " + chunk.model_dump_json(exclude_none=True) + "\n\n"


def _sse_error(exc: GatewayError) -> str:
    return "data: " + json.dumps(exc.body()) + "\n\n"
