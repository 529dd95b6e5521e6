"""The turn pipeline: one :class:`~corral.gateway.turns.TurnRequest` through the engine,
recorded as turns. It knows no wire format.

Plain logic, no HTTP: a dialect hands it a session and a request; it checks the request
against the session and the operator's settings, renders the prompt with the model's
template, calls the engine with token ids, parses tool calls and reasoning out of the tokens,
and returns a :class:`~corral.gateway.turns.TurnResult` (or streams
:data:`~corral.gateway.turns.TurnEvent` s) plus the turns to record. Recording is the caller's
job (:meth:`TurnPipeline.commit`): the HTTP layer records a turn once its answer is complete
and the client still there, just before the answer's last bytes go out, so that an SDK retry
finds it to replay; a client gone before that gets nothing recorded.

Every failure is a :class:`~corral.gateway.errors.GatewayError` (engine failures are mapped by
:func:`~corral.gateway.errors.engine_error`); nothing else leaves :meth:`prepare`,
:meth:`complete` or :meth:`stream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from corral.engines.client import EngineClient
from corral.engines.errors import EngineError
from corral.engines.protocol import FinishReason, GenerateRequest, LogprobEntry, SamplingParams
from corral.engines.stream import StreamDelta
from corral.gateway import constraints
from corral.gateway.constraints import EngineConstraint, UnsupportedConstraint
from corral.gateway.detokenize import IncrementalDetokenizer
from corral.gateway.errors import GatewayError, bad_request, engine_error
from corral.gateway.history import (
    TokenHistory,
    TokenPrompt,
    TurnConversation,
    kwargs_key,
    message_key,
)
from corral.gateway.parsers.reasoning import get_reasoning_parser
from corral.gateway.parsers.tool_calls import (
    ContentDelta,
    ToolCallDelta,
    ToolSpec,
    get_tool_call_parser,
)
from corral.gateway.recording import TurnRecord
from corral.gateway.rendering import ChatRenderer, PrefixEncoder, TemplateError
from corral.gateway.sessions import Session
from corral.gateway.settings import GatewaySettings, HistoryMode
from corral.gateway.turns import (
    ChoiceFinished,
    ChoiceResult,
    Finish,
    FinishName,
    LogprobsDelta,
    Message,
    NamedTool,
    TextDelta,
    ThinkingDelta,
    TokenLogprob,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
    TopToken,
    TurnEvent,
    TurnFinished,
    TurnRequest,
    TurnResult,
    TurnStarted,
    Usage,
    new_turn_id,
    now_s,
)

# Requests with more text than this are rendered and tokenized in a worker thread, so that
# one large prompt (a coding agent's 50 KB first request) does not stall the event loop.
OFFLOAD_CHARACTERS = 16_384

# What ends one call, per tool-call format: with parallel_tool_calls false, generation stops
# there (a stop string kept in the output), so a reply holds at most one call.
_CALL_END = {"qwen25": "</tool_call>", "qwen3_coder": "</tool_call>"}


@dataclass
class PreparedTurn:
    """A checked request, rendered and ready for the engine."""

    request: TurnRequest
    messages: list[dict[str, Any]]  # template form
    tools: list[dict[str, Any]] | None  # template form
    template_kwargs: dict[str, Any]
    prompt_ids: list[int]
    starts_in_reasoning: bool
    tool_specs: list[ToolSpec] | None
    parse_tools: bool
    sampling: list[SamplingParams]
    stops: list[str]
    # A stop string of the gateway's own (the end of a call), kept in the text, never reported
    # as the client's stop sequence.
    call_end: str | None = None
    # Sent with every engine request of the turn (the session id): a router in front of
    # several engines keeps a session on one (its KV/prefix cache stays warm).
    routing_key: str | None = None
    # How the prompt was built, and why token history was not used when it was asked for.
    history: HistoryMode = "template"
    history_fallback: str | None = None
    # The request's messages as the session compares them (history.message_key); only under
    # token history, the one that remembers conversations (None: nothing to remember).
    keys: tuple[Message, ...] | None = None
    id: str = field(default_factory=new_turn_id)
    created: int = field(default_factory=now_s)


@dataclass
class _Output:
    """What the engine produced for one choice, and what the client got of it."""

    choice: ChoiceResult
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    weight_version: str
    engine_finish: FinishReason
    parser_errors: list[str]


@dataclass
class Answer:
    """A finished turn: the result the client received, the turns to record and, under token
    history, one per turn, the conversation a later request may continue (else none)."""

    result: TurnResult
    turns: list[TurnRecord]
    conversations: list[TurnConversation]


class TurnPipeline:
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
        self.encoder = PrefixEncoder(self.renderer)
        self.history = TokenHistory(self.renderer)
        self.tool_parser = get_tool_call_parser(settings.tool_call_parser)
        self.reasoning_parser = get_reasoning_parser(settings.reasoning_parser)
        self._eos_ids = _eos_ids(tokenizer)
        self._max_token_chars = _longest_token(tokenizer)
        template = str(getattr(tokenizer, "chat_template", "") or "")
        # The thinking switch of the dialects (Anthropic's ``thinking``, OpenAI's reasoning
        # effort) maps onto the template's own variable, where it has one.
        self._thinking_switch = "enable_thinking" in template

    # -- preparing ---------------------------------------------------------------------------

    async def prepare_async(self, session: Session, request: TurnRequest) -> PreparedTurn:
        """:meth:`prepare`, in a worker thread when the request is large."""
        if request.characters > OFFLOAD_CHARACTERS:
            return await asyncio.to_thread(self.prepare, session, request)
        return self.prepare(session, request)

    def context_limit(self, session: Session) -> int:
        limit = self.settings.max_context_tokens
        if session.options.max_context_tokens is not None:
            limit = min(limit, session.options.max_context_tokens)
        return limit

    def history_mode(self, session: Session) -> HistoryMode:
        return session.options.history or self.settings.history

    def template_kwargs(self, request: TurnRequest) -> dict[str, Any]:
        """The client's template variables (allow-listed) plus the thinking switch.

        Raises a 400 naming a variable the operator does not let clients set.
        """
        allowed = self.settings.client_template_kwargs
        refused = sorted(k for k in request.template_kwargs if k not in allowed)
        if refused:
            raise bad_request(
                f"chat template variable(s) {refused} cannot be set by clients; this gateway "
                f"allows {sorted(allowed)} (the operator's --chat-template-kwargs-allow)",
                param="chat_template_kwargs",
                code="template_variable_not_allowed",
            )
        kwargs = dict(request.template_kwargs)
        if request.thinking is not None and self._thinking_switch:
            kwargs.setdefault("enable_thinking", request.thinking)
        return kwargs

    def render(self, session: Session, request: TurnRequest) -> PreparedTurn:
        """Render ``request``'s prompt (no sampling settings): what ``count_tokens`` needs.

        Raises a 400 before any rendering when the request's text alone is certainly over the
        context (each token covers at most the longest vocabulary entry's characters), and
        after rendering when the prompt leaves no room for an output token.
        """
        limit = self.context_limit(session)
        characters = request.characters
        if characters > limit * self._max_token_chars:
            raise bad_request(
                f"the request holds {characters} characters of text: more than this "
                f"session's context of {limit} tokens can hold",
                param="messages",
                code="context_length_exceeded",
            )
        messages = [m.template() for m in request.messages]
        tools = [t.template() for t in request.tools] or None
        kwargs = self.template_kwargs(request)
        history: HistoryMode = "template"
        fallback: str | None = None
        built: TokenPrompt | str | None = None
        keys: tuple[Message, ...] | None = None
        if self.history_mode(session) == "tokens":
            keys = tuple(message_key(m) for m in request.messages)
            built = self.history.prompt(
                session.conversations,
                session.merger.trajectories,
                keys,
                messages,
                request.tools,
                kwargs,
                request.label,
            )
        if isinstance(built, TokenPrompt) and len(built.ids) >= limit:
            # Held tokens may be longer than the template's rendering (kept think blocks):
            # the turn may still fit rendered in full.
            built = (
                f"the held tokens and the new messages ({len(built.ids)} tokens) do not fit "
                f"this session's context of {limit} tokens"
            )
        if isinstance(built, TokenPrompt):
            history = "tokens"
            prompt_ids = built.ids
            # Where the prompt ends tells whether the reply starts inside reasoning.
            text = built.continuation.suffix_text or str(
                self.tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False)
            )
        else:
            fallback = built
            try:
                text = self.renderer.render_text(messages, tools, kwargs)
            except TemplateError as exc:
                raise bad_request(str(exc), param="messages", code="template_error") from exc
            # Only what is new since the session's earlier prompts is encoded (same ids as a
            # full encoding, by construction: see PrefixEncoder).
            prompt_ids = self.encoder.encode(text, session.held_prompts)
        if len(prompt_ids) >= limit:
            raise bad_request(
                f"the prompt has {len(prompt_ids)} tokens; this session's context holds at most "
                f"{limit} (prompt plus at least one output token)",
                param="messages",
                code="context_length_exceeded",
            )
        parse_tools = bool(request.tools) and request.tool_choice != "none"
        return PreparedTurn(
            request=request,
            messages=messages,
            tools=tools,
            template_kwargs=kwargs,
            prompt_ids=prompt_ids,
            starts_in_reasoning=text.rstrip().endswith("<think>"),
            tool_specs=[ToolSpec(t.name, t.parameters) for t in request.tools] or None,
            parse_tools=parse_tools,
            sampling=[],
            stops=[],
            routing_key=session.id,
            history=history,
            history_fallback=fallback,
            keys=keys,
        )

    def prepare(self, session: Session, request: TurnRequest) -> PreparedTurn:
        """Check what the request asks against the session, render it, size the output.

        Raises :class:`GatewayError` (400) naming what cannot be honoured.
        """
        s = request.sampling
        vocab = len(self.tokenizer)
        bad = sorted(t for t in s.logit_bias or {} if not 0 <= t < vocab)
        if bad:
            raise bad_request(
                f"logit_bias names token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                param="logit_bias",
            )
        prepared = self.render(session, request)
        constraint = self._constraint(prepared)
        room = self.context_limit(session) - len(prepared.prompt_ids)
        overrides = session.options.sampling
        wanted = overrides.get("max_tokens") or s.max_tokens
        max_new = room if wanted is None else min(int(wanted), room)
        stops = list(overrides.get("stop") or s.stop)
        if not request.parallel_tool_calls and prepared.parse_tools and constraint is None:
            end = _CALL_END.get(self.tool_parser.name)
            if end is None:
                raise _unsupported(
                    f"parallel_tool_calls false is not supported with parser "
                    f"{self.tool_parser.name}",
                    "parallel_tool_calls",
                )
            prepared.call_end = end
            stops.append(end)
        seed = overrides.get("seed", s.seed)
        temperature = overrides.get("temperature", s.temperature)
        top_p = overrides.get("top_p", s.top_p)
        top_k = overrides.get("top_k", s.top_k)
        prepared.stops = stops
        prepared.sampling = [
            SamplingParams(
                max_new_tokens=max_new,
                temperature=1.0 if temperature is None else float(temperature),
                top_p=1.0 if top_p is None else float(top_p),
                top_k=-1 if top_k is None else int(top_k),
                stop=stops or None,
                sampling_seed=None if seed is None else int(seed) + i,
                skip_special_tokens=False,
                frequency_penalty=s.frequency_penalty or 0.0,
                presence_penalty=s.presence_penalty or 0.0,
                logit_bias={str(k): v for k, v in s.logit_bias.items()} if s.logit_bias else None,
                json_schema=_constraint_value(constraint, "json_schema"),
                regex=_constraint_value(constraint, "regex"),
                ebnf=_constraint_value(constraint, "ebnf"),
            )
            for i in range(s.n)
        ]
        return prepared

    def _constraint(self, call: PreparedTurn) -> EngineConstraint | None:
        """The engine constraint that guarantees what the request asks for: JSON output, or a
        call for tool_choice "required" / a named function. A 400 saying why when it cannot be
        guaranteed (never a hope: nothing is served unconstrained instead)."""
        request = call.request
        forced = call.parse_tools and (
            request.tool_choice == "required" or isinstance(request.tool_choice, NamedTool)
        )
        try:
            if request.output is not None:
                if forced:
                    raise UnsupportedConstraint(
                        "a forced tool call and JSON output cannot both be guaranteed"
                    )
                if request.output.schema is None:
                    return constraints.json_object()
                return constraints.json_schema(request.output.schema, strict=request.output.strict)
            if not forced:
                return None
            reasoning: constraints.Reasoning = (
                "open"
                if call.starts_in_reasoning
                else "optional"
                if self.reasoning_parser.name != "none"
                else "none"
            )
            specs = call.tool_specs or []
            parser = self.tool_parser.name
            if isinstance(request.tool_choice, NamedTool):
                return constraints.named_tool_call(
                    parser, specs, request.tool_choice.name, reasoning=reasoning
                )
            return constraints.required_tool_calls(
                parser, specs, parallel=request.parallel_tool_calls, reasoning=reasoning
            )
        except UnsupportedConstraint as exc:
            param = request.output.param if request.output is not None else "tool_choice"
            raise _unsupported(str(exc), param) from None

    def _engine_request(self, call: PreparedTurn, index: int, rid: str) -> GenerateRequest:
        return GenerateRequest(
            input_ids=call.prompt_ids,
            sampling_params=call.sampling[index],
            return_logprob=True,
            top_logprobs_num=call.request.top_logprobs,
            rid=rid,
            routing_key=call.routing_key,
        )

    def _rids(self, call: PreparedTurn) -> list[str]:
        return [f"{call.id}-{i}" for i in range(call.request.sampling.n)]

    # -- non-streaming -----------------------------------------------------------------------

    async def complete(self, call: PreparedTurn) -> Answer:
        """Run every choice to its end. On cancellation (client gone) every choice is aborted
        in the engine."""
        rids = self._rids(call)
        tasks = [
            asyncio.ensure_future(self.engine.generate(self._engine_request(call, i, rid)))
            for i, rid in enumerate(rids)
        ]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException as exc:
            for task in tasks:
                task.cancel()
            await self._abort_all(rids)
            if isinstance(exc, EngineError):
                raise engine_error(exc) from None
            raise
        outputs = []
        for i, (rid, res) in enumerate(zip(rids, results, strict=True)):
            ids = list(res.output_ids) or [e[1] for e in res.meta_info.output_token_logprobs]
            logprobs = [e[0] for e in res.meta_info.output_token_logprobs]
            if len(logprobs) != len(ids):
                raise GatewayError(
                    "engine_error",
                    f"the engine returned {len(ids)} tokens but {len(logprobs)} logprobs",
                )
            outputs.append(
                self._finish_choice(
                    call,
                    i,
                    rid,
                    ids,
                    logprobs,
                    list(res.meta_info.output_top_logprobs),
                    res.meta_info.finish_reason or FinishReason(type="abort"),
                    res.meta_info.weight_version,
                    self._decode(ids),
                )
            )
        return self._answer(call, outputs)

    def _answer(self, call: PreparedTurn, outputs: list[_Output]) -> Answer:
        result = TurnResult(
            id=call.id,
            created=call.created,
            model=self.settings.model_name,
            choices=tuple(o.choice for o in outputs),
            usage=Usage(
                prompt_tokens=len(call.prompt_ids),
                completion_tokens=sum(len(o.output_ids) for o in outputs),
            ),
        )
        keys = call.keys
        conversations = [
            TurnConversation(
                keys=(*keys, message_key(_reply_message(o.choice))),
                tools=call.request.tools,
                kwargs=kwargs_key(call.template_kwargs),
                label=call.request.label,
                prompt_length=len(call.prompt_ids),
                output_length=len(o.output_ids),
                finish=o.engine_finish.type,
            )
            for o in outputs
            if keys is not None
        ]
        return Answer(result=result, turns=self._turns(call, outputs), conversations=conversations)

    def _finish_choice(
        self,
        call: PreparedTurn,
        index: int,
        rid: str,
        ids: list[int],
        logprobs: list[float],
        top: list[list[LogprobEntry] | None],
        finish: FinishReason,
        weight_version: str,
        generated: str,
        call_ids: Sequence[str] = (),
    ) -> _Output:
        """One finished choice: ``generated`` is the decoded output (stop string not yet
        trimmed); ``call_ids`` are tool-call ids already streamed to the client, reused."""
        text = _trim_stop(generated, finish, call.call_end)
        reasoning, content, calls, errors = self._split(call, text, call_ids)
        choice = ChoiceResult(
            index=index,
            content=content,
            reasoning=reasoning,
            tool_calls=calls,
            finish=_finish(finish, bool(calls), call.call_end),
            logprobs=self._logprobs(call, ids, logprobs, top),
            output_tokens=len(ids),
        )
        return _Output(choice, rid, ids, logprobs, weight_version, finish, errors)

    def _split(
        self, call: PreparedTurn, text: str, call_ids: Sequence[str] = ()
    ) -> tuple[str | None, str | None, tuple[ToolCall, ...], list[str]]:
        reasoning, content = self.reasoning_parser.parse(
            text, starts_in_reasoning=call.starts_in_reasoning
        )
        if not call.parse_tools:
            return reasoning, content, (), []
        parsed = self.tool_parser.parse(content, call.tool_specs)
        calls = tuple(
            ToolCall(
                id=call_ids[i] if i < len(call_ids) else _call_id(),
                name=c.name,
                arguments=c.arguments,
            )
            for i, c in enumerate(parsed.tool_calls)
        )
        return reasoning, parsed.content, calls, list(parsed.errors)

    def _decode(self, ids: Sequence[int]) -> str:
        # Special tokens such as <|im_end|> are dropped; the format's markers (<tool_call>,
        # <think>) are ordinary added tokens and stay in the text for the parsers.
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _logprobs(
        self,
        call: PreparedTurn,
        ids: Sequence[int],
        logprobs: Sequence[float],
        top: Sequence[list[LogprobEntry] | None],
    ) -> tuple[TokenLogprob, ...] | None:
        if not call.request.logprobs:
            return None
        out = []
        for pos, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
            if tid in self._eos_ids:
                continue
            alternatives = (top[pos] if pos < len(top) else None) or []
            out.append(
                TokenLogprob(
                    token=self._token_text(tid),
                    logprob=lp,
                    top=tuple(
                        TopToken(self._token_text(alt[1]), alt[0])
                        for alt in alternatives[: call.request.top_logprobs]
                    ),
                )
            )
        return tuple(out)

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    # -- streaming ---------------------------------------------------------------------------

    async def stream(
        self, call: PreparedTurn, answer: list[Answer]
    ) -> AsyncGenerator[Sequence[TurnEvent], None]:
        """The turn's events as the engine makes tokens, in batches (the events of one engine
        delta): :class:`TurnStarted` first, then the choices' deltas interleaved, each choice's
        :class:`ChoiceFinished`, and last :class:`TurnFinished`.

        When the engine is done, the :class:`Answer` is appended to ``answer`` (before the
        :class:`TurnFinished` batch is yielded) for the caller to commit. If the consumer stops
        early (client gone) every engine request is aborted and nothing is appended. A failure
        raises :class:`GatewayError`.
        """
        n = call.request.sampling.n
        rids = self._rids(call)
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
            yield [
                TurnStarted(
                    id=call.id,
                    created=call.created,
                    model=self.settings.model_name,
                    choices=n,
                    prompt_tokens=len(call.prompt_ids),
                )
            ]
            unfinished = n
            last: list[TurnEvent] = []
            while finished < n:
                i, item = await queue.get()
                if item is None:
                    finished += 1
                    if states[i].finish is None:
                        raise GatewayError(
                            "engine_error", "the engine's stream ended without a finish reason"
                        )
                    continue
                if isinstance(item, EngineError):
                    raise engine_error(item)
                if isinstance(item, BaseException):
                    raise item
                events = states[i].push(item)
                if any(isinstance(e, ChoiceFinished) for e in events):
                    unfinished -= 1
                    if unfinished == 0:
                        # The last choice's end goes out with TurnFinished, after the answer
                        # is ready to record: no dialect may close its stream before that.
                        last = events
                        continue
                if events:
                    yield events
            outputs = [s.close() for s in states]
            done = self._answer(call, outputs)
            answer.append(done)
            yield [*last, TurnFinished(done.result)]
        finally:
            for task in tasks:
                task.cancel()
            if finished < n:
                await self._abort_all(rids)

    # -- recording ---------------------------------------------------------------------------

    def _turns(self, call: PreparedTurn, outputs: list[_Output]) -> list[TurnRecord]:
        group = call.id if len(outputs) > 1 else None
        turns = []
        for o in outputs:
            metadata: dict[str, Any] = {"rid": o.rid, "finish_reason": o.choice.finish.reason}
            if o.parser_errors:
                metadata["parser_errors"] = o.parser_errors
            if call.history_fallback is not None:
                metadata["history_fallback"] = call.history_fallback
            turns.append(
                TurnRecord(
                    prompt_ids=call.prompt_ids,
                    output_ids=o.output_ids,
                    output_logprobs=o.logprobs,
                    finish_reason=o.engine_finish.type,
                    weight_version=o.weight_version,
                    messages=call.request.sent,
                    message_starts=lambda position: self.renderer.message_at(
                        call.messages, call.tools, call.template_kwargs, position
                    ),
                    response=_response_message(o.choice),
                    choice_group=group,
                    metadata=metadata,
                    label=call.request.label,
                    history=call.history,
                )
            )
        return turns

    def commit(self, session: Session, answer: Answer) -> None:
        """Record a delivered answer. Raises ``SessionClosed`` (nothing recorded) when the
        session was deleted meanwhile."""
        for i, turn in enumerate(answer.turns):
            session.record(turn, answer.conversations[i] if answer.conversations else None)

    async def _abort_all(self, rids: Sequence[str]) -> None:
        async def abort(rid: str) -> None:
            with contextlib.suppress(EngineError):  # an engine that is gone has nothing to abort
                await self.engine.abort(rid)

        await asyncio.shield(asyncio.gather(*(abort(r) for r in rids)))


class _ChoiceStream:
    """One choice of a streamed turn: engine tokens in, turn events out."""

    def __init__(self, pipeline: TurnPipeline, call: PreparedTurn, index: int, rid: str) -> None:
        self.pipeline = pipeline
        self.call = call
        self.index = index
        self.rid = rid
        self.detok = IncrementalDetokenizer(pipeline.tokenizer, skip_special_tokens=True)
        self.reasoning = pipeline.reasoning_parser.streamer(
            starts_in_reasoning=call.starts_in_reasoning
        )
        self.tools = pipeline.tool_parser.streamer(call.tool_specs) if call.parse_tools else None
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[LogprobEntry] | None] = []
        self.text = ""  # generated text so far (stop strings not yet trimmed)
        self.sent = 0  # characters of self.text already fed to the parsers
        self.hold = max((len(s) for s in call.stops), default=1) - 1
        self.finish: FinishReason | None = None
        self.weight_version = "default"
        self.call_ids: list[str] = []

    def push(self, delta: StreamDelta) -> list[TurnEvent]:
        self.ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.top.extend(delta.top_logprobs or [None] * len(delta.token_ids))
        self.weight_version = delta.weight_version
        self.text += self.detok.push(delta.token_ids)
        final = delta.finish_reason is not None
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason
            self.text += self.detok.flush()
            end = len(_trim_stop(self.text, delta.finish_reason, self.call.call_end))
        else:
            end = max(self.sent, len(self.text) - self.hold)
        piece = self.text[self.sent : end]
        self.sent = end
        events = self._parse(piece, final=final)
        logprobs = self.pipeline._logprobs(
            self.call, delta.token_ids, delta.logprobs, delta.top_logprobs
        )
        if logprobs:
            events.append(LogprobsDelta(self.index, logprobs))
        if delta.finish_reason is not None:
            finish = _finish(delta.finish_reason, bool(self.call_ids), self.call.call_end)
            events.append(ChoiceFinished(self.index, finish))
        return events

    def _parse(self, text: str, *, final: bool) -> list[TurnEvent]:
        r = self.reasoning.feed(text)
        reasoning, content = r.reasoning, r.content
        if final:
            tail = self.reasoning.finish()
            reasoning += tail.reasoning
            content += tail.content
        events: list[TurnEvent] = []
        if reasoning:
            events.append(ThinkingDelta(self.index, reasoning))
        if self.tools is None:
            if content:
                events.append(TextDelta(self.index, content))
            return events
        parsed = self.tools.feed(content) if content else []
        if final:
            parsed += self.tools.finish()
        for event in parsed:
            if isinstance(event, ContentDelta):
                if event.text:
                    events.append(TextDelta(self.index, event.text))
            elif isinstance(event, ToolCallDelta):
                events.extend(self._call_events(event))
        return events

    def _call_events(self, event: ToolCallDelta) -> list[TurnEvent]:
        out: list[TurnEvent] = []
        if event.name is not None:
            self.call_ids.append(_call_id())
            out.append(
                ToolCallStarted(self.index, event.index, self.call_ids[event.index], event.name)
            )
        if event.arguments:
            out.append(ToolCallArguments(self.index, event.index, event.arguments))
        return out

    def close(self) -> _Output:
        assert self.finish is not None
        return self.pipeline._finish_choice(
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


def _trim_stop(text: str, finish: FinishReason, keep: str | None = None) -> str:
    """The text before the stop string that ended it; through it when it is ``keep``."""
    if finish.type == "stop" and isinstance(finish.matched, str) and finish.matched:
        cut = text.find(finish.matched)
        if cut >= 0:
            return text[: cut + len(keep)] if finish.matched == keep else text[:cut]
    return text


def _finish(finish: FinishReason, has_tool_calls: bool, own_stop: str | None = None) -> Finish:
    reason: FinishName
    if finish.type == "length":
        reason = "length"
    elif finish.type == "abort":
        reason = "abort"
    else:
        reason = "tool_calls" if has_tool_calls else "stop"
    matched = finish.matched if finish.type == "stop" and isinstance(finish.matched, str) else None
    if matched == own_stop:
        matched = None
    return Finish(reason=reason, stop_sequence=matched or None)


def _reply_message(choice: ChoiceResult) -> Message:
    """The reply as the client will send it back in its next request's history."""
    return Message(
        "assistant", choice.content or "", tool_calls=choice.tool_calls, reasoning=choice.reasoning
    )


def _response_message(choice: ChoiceResult) -> dict[str, Any]:
    """The assistant message as recorded in the session view (one shape for every dialect)."""
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in choice.tool_calls
        ]
    return message


def _constraint_value(constraint: EngineConstraint | None, kind: str) -> str | None:
    return constraint.value if constraint is not None and constraint.kind == kind else None


def _unsupported(message: str, param: str) -> GatewayError:
    return bad_request(message, param=param, code="unsupported_field")


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _eos_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return frozenset(i for i in ids if isinstance(i, int))


def _longest_token(tokenizer: PreTrainedTokenizerBase) -> int:
    """Characters of the longest vocabulary entry: no token covers more text than that."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary view: assume generously
        return 256
    return max((len(k) for k in vocab), default=1) or 1
