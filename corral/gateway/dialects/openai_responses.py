"""OpenAI Responses (``POST /v1/responses``) over the turn pipeline.

Requests are :class:`ResponsesRequest`; answers are ``response`` objects or their event stream.

Input. ``input`` is a string (one user message) or a list of items, turned into template
messages in order: ``message`` items (``type`` may be omitted; ``developer`` is ``system``;
text parts only), ``function_call`` items (joined to the assistant message before them, or
opening one), ``function_call_output`` items (``tool`` messages), ``reasoning`` items (the
reasoning of the assistant message that follows them). ``instructions`` is a system message
put first. Anything a text-only model cannot take (images, files, audio) or this gateway cannot
produce (hosted tool calls, item references) is a 400 naming the item.

Tools. ``function`` tools are offered as they are; the ``function`` tools of a ``namespace`` tool
are offered flattened, named ``{namespace}.{name}`` (:data:`NAMESPACE_SEPARATOR`; OpenAI's
function names cannot hold a dot, so a flattened name never collides with a plain one), and a
call of one is answered as the API does: ``name`` plus ``namespace``. Every other tool (hosted
ones such as ``web_search``, ``file_search``, ``mcp``, ``code_interpreter``, and client tools
this gateway cannot produce calls of: ``custom``, ``local_shell``, ``shell``, ``apply_patch``) is
dropped from what the model sees, never refused, and named in the response's
``metadata[DROPPED_TOOLS_KEY]``.

State. ``store`` defaults to true, as in the API: the response (its whole input, the previous
response's included, and its output items) is kept in the session (the last
:data:`~corral.gateway.sessions.KEPT_RESPONSES`), and a later request naming it in
``previous_response_id`` continues it: stored input + stored output + new input (the stored
``instructions`` are not carried over, as in the API). A response made with ``store: false`` is
not kept, and naming it is a 400 that says so.

Reasoning. The model's reasoning comes back as a ``reasoning`` item before the message: its
text in ``content`` (``reasoning_text``), in ``summary`` (one ``summary_text``) when
``reasoning.summary`` asks for one, and in ``encrypted_content`` when ``include`` asks for
``reasoning.encrypted_content``. That value is not encrypted: it is :data:`ENCRYPTED_PREFIX`
plus the text in base64, so that a stateless client that sends back only the opaque value
(Codex) still gets the exact reasoning re-rendered. ``reasoning.effort`` is the template's
thinking switch (``none``: off; any other: on). ``include`` may also ask for
``message.output_text.logprobs`` (the engine's logprobs on ``output_text``, ``top_logprobs``
alternatives each); its other values name items that never occur here.

Stream. ``response.created``, ``response.in_progress``; per output item, in the order the model
produced them, ``response.output_item.added`` then its deltas (``response.reasoning_text.*``
and, with a summary, ``response.reasoning_summary_*``; ``response.content_part.added`` and
``response.output_text.delta``; ``response.function_call_arguments.delta``); when the model is
done, each item's ``*.done`` events and ``response.output_item.done``, in output order; last
``response.completed`` (or ``response.incomplete`` when the output hit its token limit), whose
response holds the same items, ids and usage. Every event is ``event: <type>`` with data
holding its ``type`` and a ``sequence_number`` counting from 0. A failure after
``response.created`` ends the stream with ``response.failed`` (status ``failed``, ``error``
set, the items so far marked ``incomplete``); one before it with an ``error`` event.

Recording. The turn's ``sent`` conversation is its template messages in chat form (one entry
per message, flattened tool names), so that drift reports index the messages the template saw.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from corral.gateway.dialects.base import (
    EventBatches,
    RequestContext,
    refuse_extra_fields,
    sse,
    validate,
)
from corral.gateway.dialects.responses_types import (
    MEDIA_PARTS,
    REFUSED_FIELDS,
    TEXT_PARTS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    ItemStatus,
    MessageItem,
    NamespaceTool,
    OutputFunctionCall,
    OutputLogprob,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseErrorBody,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    SummaryText,
    TextParam,
    TextPart,
    TopLogprob,
)
from corral.gateway.dialects.schemas import check_tool_schema
from corral.gateway.errors import ERROR_TABLE, GatewayError, bad_request
from corral.gateway.sessions import KEPT_RESPONSES
from corral.gateway.turns import (
    ChoiceFinished,
    ChoiceResult,
    Finish,
    JsonOutput,
    LogprobsDelta,
    Message,
    NamedTool,
    Sampling,
    TextDelta,
    ThinkingDelta,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
    ToolChoice,
    TurnEvent,
    TurnFinished,
    TurnRequest,
    TurnResult,
    TurnStarted,
    Usage,
)

# How a namespace's function is named to the model: "{namespace}{NAMESPACE_SEPARATOR}{name}".
NAMESPACE_SEPARATOR = "."
# The response metadata key naming the tools the model did not see (comma-separated).
DROPPED_TOOLS_KEY = "corral_dropped_tools"
# Marks the gateway's own (plain, base64) reasoning in ``encrypted_content``.
ENCRYPTED_PREFIX = "corral1:"

# ---- what render and frame need of the parsed request -----------------------------------------


@dataclass(frozen=True)
class _Wire:
    """The parsed request as render and frame need it (``TurnRequest.wire``)."""

    echo: dict[str, Any]  # the request fields the response object repeats
    conversation: tuple[dict[str, Any], ...]  # every input item, the previous response's too
    names: dict[str, tuple[str, str | None]]  # name the model sees -> (name, namespace)
    store: bool
    summary: bool
    encrypted: bool
    logprobs: bool


@dataclass(frozen=True)
class KeptResponse:
    """A response kept in the session for ``previous_response_id`` (``stored`` False: made with
    ``store: false``; kept only to say so)."""

    stored: bool
    input: tuple[dict[str, Any], ...] = ()
    output: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class _ToolSet:
    tools: tuple[Tool, ...]
    names: dict[str, tuple[str, str | None]]
    dropped: tuple[str, ...]


class OpenAIResponses:
    """The Responses dialect (see the module docstring for what it accepts and answers)."""

    name = "openai_responses"

    # -- requests ----------------------------------------------------------------------------

    def parse(self, data: dict[str, Any], ctx: RequestContext) -> TurnRequest:
        req = validate(ResponsesRequest, data)
        refuse_extra_fields(*req.unknown_fields(), api="OpenAI's Responses API")
        _refuse(req)
        toolset = _tools(req.tools)
        choice, offered = _tool_choice(req.tool_choice, toolset)
        store = req.store is not False
        conversation = _previous(ctx, req.previous_response_id) + _input_items(req.input)
        messages = _History(toolset.names).messages(conversation)
        if req.instructions:
            messages.insert(0, Message(role="system", content=req.instructions))
        if not messages:
            raise bad_request("the request has no input: send 'input'", param="input")
        include = set(req.include or ())
        logprobs = "message.output_text.logprobs" in include or bool(req.top_logprobs)
        reasoning = req.reasoning
        effort = reasoning.effort if reasoning is not None else None
        summary = reasoning is not None and bool(reasoning.summary or reasoning.generate_summary)
        wire = _Wire(
            echo=_echo(req, data, toolset.dropped, store),
            conversation=tuple(conversation),
            names=toolset.names,
            store=store,
            summary=summary,
            encrypted="reasoning.encrypted_content" in include,
            logprobs=logprobs,
        )
        return TurnRequest(
            messages=tuple(messages),
            sent=[m.template() for m in messages],
            tools=offered,
            tool_choice=choice,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            sampling=Sampling(
                temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_output_tokens
            ),
            output=_json_output(req.text),
            logprobs=logprobs,
            top_logprobs=(req.top_logprobs or 0) if logprobs else 0,
            thinking=None if effort is None else effort != "none",
            stream=bool(req.stream),
            wire=wire,
        )

    # -- answers -----------------------------------------------------------------------------

    def render(self, result: TurnResult, request: TurnRequest, ctx: RequestContext) -> bytes:
        wire = _wire_of(request)
        choice = result.choices[0]
        status = _item_status(choice.finish)
        output = _output_items(result.id, choice, wire, status)
        body = _response(
            wire,
            id=_response_id(result.id),
            created_at=result.created,
            model=result.model,
            output=output,
            finish=choice.finish,
            usage=result.usage,
        )
        _keep(ctx, wire, body.id, output)
        return body.model_dump_json().encode()

    async def frame(
        self, batches: EventBatches, request: TurnRequest, ctx: RequestContext
    ) -> AsyncGenerator[str, None]:
        stream = _EventStream(_wire_of(request), ctx)
        try:
            async for batch in batches:
                for event in _logprobs_first(batch):
                    for chunk in stream.on(event):
                        yield chunk
        except GatewayError as exc:
            # Headers are out already: the failure ends the stream as the API's does.
            for chunk in stream.fail(exc):
                yield chunk

    def error_body(self, error: GatewayError) -> dict[str, Any]:
        return error.openai_body()


# ---- parsing helpers ---------------------------------------------------------------------------


def _refuse(req: ResponsesRequest) -> None:
    """400 for what the gateway cannot honour: background runs, hosted state, prewarming."""
    if req.background:
        raise bad_request(
            "background responses are not supported: the gateway answers while the request is "
            "open (send background: false, or leave it out)",
            param="background",
            code="unsupported_field",
        )
    for name, why in REFUSED_FIELDS.items():
        if getattr(req, name) is not None:
            raise bad_request(
                f"'{name}' is not supported: {why}", param=name, code="unsupported_field"
            )
    if req.prompt_cache_options is not None and req.prompt_cache_options.prewarm:
        raise bad_request(
            "prompt_cache_options.prewarm is not supported: every request here generates",
            param="prompt_cache_options.prewarm",
            code="unsupported_field",
        )


def _tools(raw: list[Any] | None) -> _ToolSet:
    """The function tools the model sees (namespaces flattened), the map back from their names,
    and the tools dropped (by type, ``type:name`` for named ones)."""
    tools: list[Tool] = []
    names: dict[str, tuple[str, str | None]] = {}
    where: dict[str, str] = {}
    dropped: list[str] = []

    def offer(fn: FunctionTool, namespace: str | None, param: str) -> None:
        seen = fn.name if namespace is None else f"{namespace}{NAMESPACE_SEPARATOR}{fn.name}"
        if seen in names:
            raise bad_request(
                f"'{param}' and '{where[seen]}' both define the function '{seen}'",
                param=param,
                code="duplicate_tool",
            )
        parameters = (
            check_tool_schema(fn.parameters, f"{param}.parameters")
            if fn.parameters is not None
            else {"type": "object", "properties": {}}
        )
        tools.append(Tool(name=seen, description=fn.description, parameters=parameters))
        names[seen] = (fn.name, namespace)
        where[seen] = param

    for i, t in enumerate(raw or ()):
        param = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(kind, str):
            raise bad_request(f"'{param}' must be an object with a 'type'", param=param)
        if kind == "function":
            offer(validate(FunctionTool, t, prefix=f"{param}."), None, param)
        elif kind == "namespace":
            ns = validate(NamespaceTool, t, prefix=f"{param}.")
            for j, sub in enumerate(ns.tools):
                sub_param = f"{param}.tools[{j}]"
                sub_kind = sub.get("type") if isinstance(sub, dict) else None
                if sub_kind == "function":
                    offer(validate(FunctionTool, sub, prefix=f"{sub_param}."), ns.name, sub_param)
                else:
                    dropped.append(_tool_label(sub, ns.name))
        else:
            dropped.append(_tool_label(t, None))
    return _ToolSet(tuple(tools), names, tuple(dict.fromkeys(dropped)))


def _tool_label(tool: Any, namespace: str | None) -> str:
    kind = str(tool.get("type")) if isinstance(tool, dict) else "?"
    name = tool.get("name") if isinstance(tool, dict) else None
    if isinstance(name, str) and name:
        prefix = f"{namespace}{NAMESPACE_SEPARATOR}" if namespace else ""
        return f"{kind}:{prefix}{name}"
    return kind


def _tool_choice(
    raw: str | dict[str, Any] | None, toolset: _ToolSet
) -> tuple[ToolChoice, tuple[Tool, ...]]:
    """The pipeline's tool choice and the tools offered (``allowed_tools`` narrows them)."""
    tools = toolset.tools
    choice: ToolChoice
    if raw is None:
        return "auto", tools
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad_request(
                f"tool_choice must be 'auto', 'none', 'required' or an object, not {raw!r}",
                param="tool_choice",
            )
        choice = "auto" if raw == "auto" else "none" if raw == "none" else "required"
    else:
        kind = raw.get("type")
        if kind == "function":
            choice = NamedTool(_resolve(raw, toolset, "tool_choice"))
        elif kind == "allowed_tools":
            mode = raw.get("mode", "auto")
            listed = raw.get("tools")
            if mode not in ("auto", "required") or not isinstance(listed, list):
                raise bad_request(
                    "tool_choice 'allowed_tools' needs 'mode' ('auto' or 'required') and a "
                    "'tools' list",
                    param="tool_choice",
                )
            allowed = {
                _resolve(t, toolset, f"tool_choice.tools[{k}]")
                for k, t in enumerate(listed)
                if isinstance(t, dict) and t.get("type") == "function"
            }
            tools = tuple(t for t in tools if t.name in allowed)
            choice = "required" if mode == "required" else "auto"
        else:
            raise bad_request(
                f"tool_choice of type {kind!r} forces a tool that is not available here (only "
                "function tools are; hosted tools are dropped)",
                param="tool_choice",
                code="unsupported_tool",
            )
    if choice != "auto" and choice != "none" and not tools:
        dropped = f" (dropped here: {', '.join(toolset.dropped)})" if toolset.dropped else ""
        raise bad_request(
            f"tool_choice {raw!r} needs at least one function tool in 'tools'{dropped}",
            param="tool_choice",
        )
    return choice, tools


def _resolve(ref: dict[str, Any], toolset: _ToolSet, param: str) -> str:
    """The name the model sees for a ``{type: function, name, namespace?}`` reference."""
    name, namespace = ref.get("name"), ref.get("namespace")
    if isinstance(name, str):
        if isinstance(namespace, str) and namespace:
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
        if name in toolset.names:
            return name
        # A namespaced function may be named without its namespace when that is unambiguous.
        matches = [seen for seen, (plain, ns) in toolset.names.items() if ns and plain == name]
        if len(matches) == 1:
            return matches[0]
    raise bad_request(
        f"'{param}' names the function {name!r}, which is not among the function tools: "
        f"{sorted(toolset.names)}",
        param=param,
    )


def _previous(ctx: RequestContext, response_id: str | None) -> list[dict[str, Any]]:
    """The conversation so far of ``previous_response_id``: its input and output items."""
    if response_id is None:
        return []
    kept = ctx.session.kept_response(response_id)
    if not isinstance(kept, KeptResponse):
        raise bad_request(
            f"previous_response_id '{response_id}' is not known in this session: the gateway "
            f"keeps the last {KEPT_RESPONSES} responses made with store: true, per session",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if not kept.stored:
        raise bad_request(
            f"previous_response_id '{response_id}' names a response made with store: false, "
            "which is never kept: send the whole conversation as input items instead, or make "
            "the response with store: true (the default)",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return [*kept.input, *kept.output]


def _input_items(raw: str | list[Any] | None) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"'input[{i}]' must be an object", param=f"input[{i}]")
    return list(raw)


class _History:
    """Input items -> template messages, in order.

    A ``function_call`` joins the assistant message right before it (the model's text and its
    calls are one message), or opens one; a ``reasoning`` item is the reasoning of the assistant
    message that follows it, and one that nothing follows is an assistant message of its own.
    """

    def __init__(self, names: dict[str, tuple[str, str | None]]) -> None:
        self._plain = {plain for plain, ns in names.values() if ns is None}
        self._out: list[Message] = []
        self._reasoning: str | None = None
        self._joinable = False  # the last message is an assistant one a call may join

    def messages(self, items: Iterable[dict[str, Any]]) -> list[Message]:
        for i, item in enumerate(items):
            self._add(item, f"input[{i}]")
        self._flush_reasoning()
        return self._out

    def _add(self, item: dict[str, Any], where: str) -> None:
        kind = item.get("type", "message")  # a message's type may be omitted
        prefix = where + "."
        if kind == "message":
            m = validate(MessageItem, item, prefix=prefix)
            text = _text(m.content, f"{where}.content")
            if m.role == "assistant":
                self._out.append(Message("assistant", text, reasoning=self._take_reasoning()))
                self._joinable = True
                return
            self._flush_reasoning()
            self._out.append(Message("user" if m.role == "user" else "system", text))
            self._joinable = False
        elif kind == "function_call":
            c = validate(FunctionCallItem, item, prefix=prefix)
            call = ToolCall(id=c.call_id, name=self._seen_name(c), arguments=c.arguments)
            if self._joinable and self._reasoning is None:
                last = self._out[-1]
                self._out[-1] = dataclasses.replace(last, tool_calls=(*last.tool_calls, call))
            else:
                reasoning = self._take_reasoning()
                self._out.append(Message("assistant", tool_calls=(call,), reasoning=reasoning))
            self._joinable = True
        elif kind == "function_call_output":
            o = validate(FunctionCallOutputItem, item, prefix=prefix)
            self._flush_reasoning()
            text = _text(o.output, f"{where}.output")
            self._out.append(Message("tool", text, tool_call_id=o.call_id))
            self._joinable = False
        elif kind == "reasoning":
            r = validate(ReasoningItem, item, prefix=prefix)
            self._flush_reasoning()
            self._reasoning = _reasoning_text(r)
        elif kind == "item_reference":
            raise bad_request(
                f"'{where}' is an item_reference, which is not supported: send the item itself, "
                "or continue a stored response with previous_response_id",
                param=where,
                code="unsupported_item",
            )
        else:
            raise bad_request(
                f"'{where}' is a {kind!r} item, which this gateway cannot take: only message, "
                "function_call, function_call_output and reasoning items (its tools are "
                "functions only)",
                param=where,
                code="unsupported_item",
            )

    def _seen_name(self, c: FunctionCallItem) -> str:
        # The API names a deferred top-level function's namespace after the function itself.
        if c.namespace is None or (c.namespace == c.name and c.name in self._plain):
            return c.name
        return f"{c.namespace}{NAMESPACE_SEPARATOR}{c.name}"

    def _take_reasoning(self) -> str | None:
        reasoning, self._reasoning = self._reasoning, None
        return reasoning

    def _flush_reasoning(self) -> None:
        if self._reasoning is not None:
            self._out.append(Message("assistant", reasoning=self._take_reasoning()))
            self._joinable = True


def _text(content: str | list[Any], where: str) -> str:
    """The text of a message's content or a call's output; 400 naming a part that is not
    text."""
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        param = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            pieces.append(validate(TextPart, part, prefix=f"{param}.").text)
        elif kind == "refusal" and isinstance(part, dict) and isinstance(part.get("refusal"), str):
            pieces.append(part["refusal"])
        elif kind in MEDIA_PARTS:
            raise bad_request(
                f"'{param}' is {kind}, which is not supported: the model takes text only "
                "(input_text parts)",
                param=param,
                code="unsupported_content",
            )
        else:
            raise bad_request(
                f"'{param}' is a {kind!r} content part; only input_text, output_text and "
                "refusal parts are supported",
                param=param,
                code="unsupported_content",
            )
    return "".join(pieces)


def _reasoning_text(item: ReasoningItem) -> str | None:
    """The reasoning an item carries: its ``reasoning_text`` content, else the gateway's own
    ``encrypted_content``, else its summary (another provider's encrypted content is opaque)."""
    content = "".join(p.text for p in item.content or () if p.type == "reasoning_text")
    if content:
        return content
    decoded = _decode_reasoning(item.encrypted_content)
    if decoded is not None:
        return decoded
    summary = "\n\n".join(p.text for p in item.summary if p.type == "summary_text")
    return summary or None


def _encode_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def _decode_reasoning(value: str | None) -> str | None:
    if not value or not value.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(value[len(ENCRYPTED_PREFIX) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _json_output(text: TextParam | None) -> JsonOutput | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JsonOutput(param="text.format")
    if fmt.schema_ is None:
        raise bad_request(
            "text.format of type 'json_schema' needs 'schema'", param="text.format.schema"
        )
    schema = check_tool_schema(fmt.schema_, "text.format.schema")
    return JsonOutput(schema, strict=bool(fmt.strict), param="text.format")


def _echo(
    req: ResponsesRequest, data: dict[str, Any], dropped: Sequence[str], store: bool
) -> dict[str, Any]:
    """The request fields the response object repeats (the tools as the client sent them)."""
    metadata = dict(req.metadata or {})
    if dropped:
        metadata[DROPPED_TOOLS_KEY] = ",".join(dropped)[:512]  # the API's value limit
    reasoning = req.reasoning
    text = dict(data.get("text") or {})
    text.setdefault("format", {"type": "text"})
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": metadata,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None,
        },
        "store": store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": text,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": list(req.tools or ()),
        "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
    }


# ---- answer helpers ----------------------------------------------------------------------------


def _wire_of(request: TurnRequest) -> _Wire:
    if not isinstance(request.wire, _Wire):
        raise GatewayError("internal", "the Responses dialect got a request it did not parse")
    return request.wire


def _response_id(turn_id: str) -> str:
    return "resp_" + turn_id


def _item_status(finish: Finish) -> ItemStatus:
    return "completed" if finish.reason in ("stop", "tool_calls") else "incomplete"


def _call_item_id(call_id: str) -> str:
    return "fc_" + call_id.removeprefix("call_")


def _mapped(wire: _Wire, seen: str) -> tuple[str, str | None]:
    return wire.names.get(seen, (seen, None))


def _reasoning_item(turn_id: str, text: str, wire: _Wire) -> dict[str, Any]:
    item = OutputReasoning(
        id="rs_" + turn_id,
        summary=[SummaryText(text=text)] if wire.summary else [],
        content=[ReasoningText(text=text)],
        encrypted_content=_encode_reasoning(text) if wire.encrypted else None,
    )
    return item.model_dump(exclude_none=True)


def _message_item(
    turn_id: str, text: str, logprobs: Sequence[TokenLogprob], status: ItemStatus
) -> dict[str, Any]:
    part = OutputText(text=text, logprobs=_wire_logprobs(logprobs))
    return OutputMessage(id="msg_" + turn_id, status=status, content=[part]).model_dump()


def _call_item(wire: _Wire, call: ToolCall, status: ItemStatus) -> dict[str, Any]:
    name, namespace = _mapped(wire, call.name)
    item = OutputFunctionCall(
        id=_call_item_id(call.id),
        call_id=call.id,
        name=name,
        namespace=namespace,
        arguments=call.arguments,
        status=status,
    )
    return item.model_dump(exclude_none=True)


def _output_items(
    turn_id: str, c: ChoiceResult, wire: _Wire, status: ItemStatus
) -> list[dict[str, Any]]:
    """A choice's output items: reasoning, message (when there is text, or nothing else),
    function calls."""
    items = []
    if c.reasoning:
        items.append(_reasoning_item(turn_id, c.reasoning, wire))
    if c.content or not c.tool_calls:
        logprobs = (c.logprobs or ()) if wire.logprobs else ()
        items.append(_message_item(turn_id, c.content or "", logprobs, status))
    items += [_call_item(wire, call, status) for call in c.tool_calls]
    return items


def _wire_logprobs(tokens: Sequence[TokenLogprob]) -> list[OutputLogprob]:
    return [
        OutputLogprob(
            token=t.token,
            bytes=list(t.token.encode()),
            logprob=t.logprob,
            top_logprobs=[
                TopLogprob(token=a.token, bytes=list(a.token.encode()), logprob=a.logprob)
                for a in t.top
            ],
        )
        for t in tokens
    ]


def _usage(u: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens
    )


def _response(
    wire: _Wire,
    *,
    id: str,
    created_at: int,
    model: str,
    output: list[dict[str, Any]],
    finish: Finish | None = None,
    usage: Usage | None = None,
    error: GatewayError | None = None,
) -> ResponseObject:
    """The response object: in progress (no ``finish``), finished, or failed (``error``)."""
    status: ResponseStatus = "in_progress"
    incomplete = None
    failure = None
    if error is not None:
        status = "failed"
        failure = _error_body(error)
    elif finish is not None:
        status = "completed" if _item_status(finish) == "completed" else "incomplete"
        if status == "incomplete":
            length = finish.reason == "length"
            incomplete = IncompleteDetails(reason="max_output_tokens" if length else None)
    return ResponseObject(
        id=id,
        created_at=created_at,
        status=status,
        error=failure,
        incomplete_details=incomplete,
        model=model,
        output=output,
        usage=_usage(usage) if usage is not None else None,
        **wire.echo,
    )


def _error_body(error: GatewayError) -> ResponseErrorBody:
    # The codes of the API's own ResponseError that clients (Codex) act on.
    if error.kind == "invalid_request":
        code = error.code if error.code == "context_length_exceeded" else "invalid_prompt"
    elif error.kind == "rate_limit":
        code = "rate_limit_exceeded"
    else:
        code = "server_error"
    return ResponseErrorBody(
        code=code,
        message=error.message,
        param=error.param,
        type=ERROR_TABLE[error.kind].openai_type,
    )


def _keep(ctx: RequestContext, wire: _Wire, response_id: str, output: list[dict[str, Any]]) -> None:
    """Keep an answered response for ``previous_response_id`` (only a marker with
    ``store: false``, so that naming it later gets a 400 that says why). Idempotent: a replayed
    retry keeps the same thing again."""
    if wire.store:
        kept = KeptResponse(stored=True, input=wire.conversation, output=tuple(output))
    else:
        kept = KeptResponse(stored=False)
    ctx.session.keep_response(response_id, kept)


def _logprobs_first(batch: Sequence[TurnEvent]) -> list[TurnEvent]:
    # An engine delta's logprobs come after its text events; the text delta carries them.
    return sorted(batch, key=lambda e: not isinstance(e, LogprobsDelta))


# ---- the event stream --------------------------------------------------------------------------


@dataclass
class _Item:
    """An output item being streamed."""

    kind: Literal["reasoning", "message", "function_call"]
    index: int
    id: str
    text: str = ""  # reasoning text, message text, or call arguments
    call_id: str = ""
    name: str = ""  # as the model saw it
    logprobs: list[TokenLogprob] = field(default_factory=list)
    done: bool = False


class _EventStream:
    """One streamed turn as Responses events (see the module docstring for the order)."""

    def __init__(self, wire: _Wire, ctx: RequestContext) -> None:
        self.wire = wire
        self.ctx = ctx
        self.sequence = 0
        self.turn_id = ""
        self.head: dict[str, Any] | None = None  # id, created_at, model once started
        self.items: list[_Item] = []
        self.reasoning: _Item | None = None
        self.message: _Item | None = None
        self.calls: dict[int, _Item] = {}
        self.pending: list[TokenLogprob] = []  # logprobs not yet sent with a text delta
        self.finish: Finish | None = None
        self.closed: list[dict[str, Any]] = []  # the finished items, in output order

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return sse(payload, event=kind)

    def at(self, item: _Item, kind: str, **data: Any) -> str:
        """An event about ``item``: ``response.{kind}``."""
        return self.event(f"response.{kind}", item_id=item.id, output_index=item.index, **data)

    def on(self, event: TurnEvent) -> list[str]:
        if isinstance(event, TurnStarted):
            return self._started(event)
        if isinstance(event, ThinkingDelta):
            return self._reasoning_delta(event.text)
        if isinstance(event, TextDelta):
            return self._text_delta(event.text)
        if isinstance(event, LogprobsDelta):
            if self.wire.logprobs:
                self.pending.extend(event.tokens)
            return []
        if isinstance(event, ToolCallStarted):
            item = _Item("function_call", len(self.items), _call_item_id(event.id))
            item.call_id, item.name = event.id, event.name
            self.calls[event.call] = item
            return [self._add(item)]
        if isinstance(event, ToolCallArguments):
            item = self.calls[event.call]
            item.text += event.text
            return [self.at(item, "function_call_arguments.delta", delta=event.text)]
        if isinstance(event, ChoiceFinished):
            return self._close(event.finish)
        if isinstance(event, TurnFinished):
            return self._finished(event.result)
        return []

    # -- lifecycle ---------------------------------------------------------------------------

    def _started(self, event: TurnStarted) -> list[str]:
        self.turn_id = event.id
        self.head = {
            "id": _response_id(event.id),
            "created_at": event.created,
            "model": event.model,
        }
        snapshot = _response(self.wire, output=[], **self.head).model_dump(mode="json")
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def _finished(self, result: TurnResult) -> list[str]:
        out = [] if self.finish is not None else self._close(result.choices[0].finish)
        assert self.head is not None and self.finish is not None
        body = _response(
            self.wire, output=self.closed, finish=self.finish, usage=result.usage, **self.head
        )
        _keep(self.ctx, self.wire, body.id, self.closed)
        kind = "response.completed" if body.status == "completed" else "response.incomplete"
        out.append(self.event(kind, response=body.model_dump(mode="json")))
        return out

    def fail(self, error: GatewayError) -> list[str]:
        """The stream's last events after ``error``: ``response.failed`` once the response
        exists, else an ``error`` event."""
        if self.head is None:
            body = _error_body(error)
            return [self.event("error", code=body.code, message=body.message, param=body.param)]
        partial = self.closed + [self._item(i, "incomplete") for i in self.items if not i.done]
        failed = _response(self.wire, output=partial, error=error, **self.head)
        return [self.event("response.failed", response=failed.model_dump(mode="json"))]

    # -- items -------------------------------------------------------------------------------

    def _item(self, item: _Item, status: ItemStatus) -> dict[str, Any]:
        if item.kind == "reasoning":
            return _reasoning_item(self.turn_id, item.text, self.wire)
        if item.kind == "message":
            return _message_item(self.turn_id, item.text, item.logprobs, status)
        call = ToolCall(id=item.call_id, name=item.name, arguments=item.text)
        return _call_item(self.wire, call, status)

    def _add(self, item: _Item) -> str:
        self.items.append(item)
        added = self._item(item, "in_progress")
        if item.kind == "reasoning":
            # Nothing is known yet: the text (and its encoding) come with the done event.
            added = {"type": "reasoning", "id": item.id, "summary": [], "content": []}
        elif item.kind == "message":
            added["content"] = []
        return self.event("response.output_item.added", output_index=item.index, item=added)

    def _reasoning_delta(self, text: str) -> list[str]:
        out = []
        item = self.reasoning
        if item is None:
            item = self.reasoning = _Item("reasoning", len(self.items), "rs_" + self.turn_id)
            out.append(self._add(item))
            if self.wire.summary:
                part = SummaryText(text="").model_dump()
                out.append(
                    self.at(item, "reasoning_summary_part.added", summary_index=0, part=part)
                )
            part = ReasoningText(text="").model_dump()
            out.append(self.at(item, "content_part.added", content_index=0, part=part))
        item.text += text
        if self.wire.summary:
            out.append(self.at(item, "reasoning_summary_text.delta", summary_index=0, delta=text))
        out.append(self.at(item, "reasoning_text.delta", content_index=0, delta=text))
        return out

    def _open_message(self) -> tuple[_Item, list[str]]:
        item = self.message = _Item("message", len(self.items), "msg_" + self.turn_id)
        part = OutputText(text="").model_dump()
        return item, [
            self._add(item),
            self.at(item, "content_part.added", content_index=0, part=part),
        ]

    def _text_delta(self, text: str) -> list[str]:
        out: list[str] = []
        item = self.message
        if item is None:
            item, out = self._open_message()
        item.text += text
        logprobs, self.pending = self.pending, []
        item.logprobs += logprobs
        wire = [_delta_logprob(t) for t in logprobs]
        out.append(self.at(item, "output_text.delta", content_index=0, delta=text, logprobs=wire))
        return out

    def _close(self, finish: Finish) -> list[str]:
        """Every open item's done events, in output order; an empty message when the model
        produced neither text nor calls (as :meth:`OpenAIResponses.render` answers)."""
        self.finish = finish
        out: list[str] = []
        if self.message is None and not self.calls:
            out += self._open_message()[1]
        if self.message is not None:
            # Logprobs after the last text delta (e.g. the end-of-turn token's) still count.
            self.message.logprobs += self.pending
            self.pending = []
        status = _item_status(finish)
        for item in self.items:
            if item.done:
                continue
            text = item.text
            if item.kind == "reasoning":
                if self.wire.summary:
                    part = SummaryText(text=text).model_dump()
                    out.append(
                        self.at(item, "reasoning_summary_text.done", summary_index=0, text=text)
                    )
                    out.append(
                        self.at(item, "reasoning_summary_part.done", summary_index=0, part=part)
                    )
                part = ReasoningText(text=text).model_dump()
                out.append(self.at(item, "reasoning_text.done", content_index=0, text=text))
                out.append(self.at(item, "content_part.done", content_index=0, part=part))
            elif item.kind == "message":
                wire = _wire_logprobs(item.logprobs)
                logprobs = [p.model_dump() for p in wire]
                part = OutputText(text=text, logprobs=wire).model_dump()
                out.append(
                    self.at(item, "output_text.done", content_index=0, text=text, logprobs=logprobs)
                )
                out.append(self.at(item, "content_part.done", content_index=0, part=part))
            else:
                out.append(self.at(item, "function_call_arguments.done", arguments=text))
            item.done = True
            self.closed.append(self._item(item, status))
            out.append(
                self.event(
                    "response.output_item.done", output_index=item.index, item=self.closed[-1]
                )
            )
        return out


def _delta_logprob(t: TokenLogprob) -> dict[str, Any]:
    return {
        "token": t.token,
        "logprob": t.logprob,
        "top_logprobs": [{"token": a.token, "logprob": a.logprob} for a in t.top],
    }
