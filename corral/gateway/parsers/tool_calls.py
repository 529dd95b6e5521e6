"""Tool-call parsers: model output text -> OpenAI ``content`` + ``tool_calls``.

Each parser is selected by name (``--tool-call-parser``, see :func:`get_tool_call_parser`):

- ``qwen25`` (aliases ``hermes``, ``qwen``): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>`` blocks, any number of them, with text around them;
- ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>`` blocks; values are typed by the tool's JSON schema when known;
- ``llama3``: optional text, then ``<|python_tag|>`` (or an output that starts with
  ``{"name"``), then ``{"name": ..., "parameters": {...}}`` objects separated by ``;``: the rest
  of the output is the call(s).

Contract shared by all parsers:

- A block that is not a valid call (bad JSON, no name, a name not among ``tools`` when tools are
  given, arguments that are not a JSON object) is never dropped and never becomes a call: its raw
  text stays in ``content`` and ``errors`` says why. The caller decides what to do with the flag.
- Arguments are re-serialised with ``json.dumps(obj, ensure_ascii=False)``: what the chat
  templates render, so the common case round-trips byte for byte. A JSON string holding an object
  is accepted and decoded; a missing ``arguments`` key means ``{}``.
- Whitespace that only separates calls from text is not content: text right before a call loses
  its trailing whitespace, and whitespace-only text after a call is dropped (the templates put
  those newlines back when they render the message). ``content`` is None when nothing but
  whitespace remains.
- Parsers assign no ids; the gateway does.

``parse`` is defined as one streaming pass over the whole text, so streaming and non-streaming
agree by construction; the streamer's own contract is that its output does not depend on how the
text is split into deltas.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "ContentDelta",
    "ParsedToolCall",
    "StreamEvent",
    "ToolCallDelta",
    "ToolCallParse",
    "ToolCallParser",
    "ToolCallStreamer",
    "ToolSpec",
    "get_tool_call_parser",
    "schema_types",
    "tool_call_parser_names",
]


# --------------------------------------------------------------------------- public types


@dataclass(frozen=True)
class ToolSpec:
    """A tool the request offered: its name and its JSON schema (``parameters``)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_openai(cls, tool: dict[str, Any]) -> ToolSpec:
        """Build from an OpenAI ``tools`` entry (``{"type": "function", "function": {...}}``).

        Raises ValueError when the entry has no function name.
        """
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool entry has no function name: {tool!r}")
        params = fn.get("parameters")
        return cls(name=name, parameters=params if isinstance(params, dict) else {})


@dataclass(frozen=True)
class ParsedToolCall:
    """One call. ``arguments`` is the JSON text of an object, as OpenAI returns it."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallParse:
    """The result of parsing a whole output.

    ``content`` is None when only whitespace remains; ``errors`` has one message per block that
    was not a valid call (that block's raw text is in ``content``).
    """

    content: str | None
    tool_calls: list[ParsedToolCall]
    errors: list[str]


@dataclass(frozen=True)
class ContentDelta:
    """Content text that is safe to show now."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed tool-call fragment in OpenAI's shape.

    The first delta of a call carries ``index`` and ``name`` (arguments ""); later deltas of the
    same ``index`` carry argument text fragments and ``name`` None. The gateway adds id and type.
    """

    index: int
    name: str | None = None
    arguments: str = ""


StreamEvent = ContentDelta | ToolCallDelta


class ToolCallParser(Protocol):
    """Parses one model format. Stateless: one instance serves every request."""

    name: str

    def parse(self, text: str, tools: Sequence[ToolSpec] | None) -> ToolCallParse:
        """Split a whole output into content, calls and errors (see the module contract)."""
        ...

    def streamer(self, tools: Sequence[ToolSpec] | None) -> ToolCallStreamer:
        """A fresh streaming parser for one output."""
        ...


# --------------------------------------------------------------------------- segments


@dataclass(frozen=True)
class _Text:
    """Plain text between call blocks."""

    text: str


@dataclass(frozen=True)
class _Block:
    """The raw text of one call block; ``closed`` is False when the output ended inside it."""

    raw: str
    closed: bool


@dataclass(frozen=True)
class _Malformed:
    """A block (or part of one) that is not a valid call: its raw text and why."""

    raw: str
    error: str


_Segment = _Text | _Block
_Item = ParsedToolCall | _Malformed


class _Segmenter(Protocol):
    """Cuts a text stream into text and call-block segments, independently of delta splits."""

    def feed(self, text: str) -> list[_Segment]: ...

    def finish(self) -> list[_Segment]: ...


def _partial_suffix(buf: str, marker: str) -> int:
    """Length of the longest proper suffix of ``buf`` that is a prefix of ``marker``."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-n:]):
            return n
    return 0


class _MarkerSegmenter:
    """Blocks delimited by a start and an end marker, with text anywhere around them.

    A start marker inside an open block closes that block as unclosed: one broken block must not
    swallow the valid call after it.
    """

    def __init__(self, start: str, end: str) -> None:
        self._start = start
        self._end = end
        self._buf = ""
        self._in_block = False
        self._scanned = 0  # block text already searched for markers, in this buffer

    def feed(self, text: str) -> list[_Segment]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[_Segment]:
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> list[_Segment]:
        out: list[_Segment] = []
        while True:
            buf = self._buf
            if not self._in_block:
                i = buf.find(self._start)
                if i >= 0:
                    if i:
                        out.append(_Text(buf[:i]))
                    self._buf = buf[i:]
                    self._in_block = True
                    self._scanned = 0
                    continue
                # Hold back a possible partial start marker; everything else is plain text.
                cut = len(buf) - (0 if final else _partial_suffix(buf, self._start))
                if cut:
                    out.append(_Text(buf[:cut]))
                    self._buf = buf[cut:]
                return out
            # Resume the marker search where the last feed stopped: blocks arrive token by token.
            skip = max(len(self._start), self._scanned - max(len(self._start), len(self._end)))
            end = buf.find(self._end, skip)
            nxt = buf.find(self._start, skip)
            self._scanned = len(buf)
            if nxt >= 0 and (end < 0 or nxt < end):
                out.append(_Block(buf[:nxt], closed=False))
                self._buf = buf[nxt:]
                self._scanned = 0
                continue
            if end >= 0:
                stop = end + len(self._end)
                out.append(_Block(buf[:stop], closed=True))
                self._buf = buf[stop:]
                self._in_block = False
                continue
            if final:
                out.append(_Block(buf, closed=False))
                self._buf = ""
                self._in_block = False
            return out


_PYTHON_TAG = "<|python_tag|>"
# An output that opens with a JSON object whose first key is "name" is a Llama 3 call.
_LLAMA_JSON_START = re.compile(r'\{\s*"name"')
_LLAMA_JSON_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e)?)?)?)?)?')


class _Llama3Segmenter:
    """Text, then a region from ``<|python_tag|>`` (or a leading ``{"name"``) to the end.

    The region is one block, emitted by ``finish``: Llama 3 ends its turn right after the calls.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start -> text -> region, or start -> region

    def feed(self, text: str) -> list[_Segment]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[_Segment]:
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> list[_Segment]:
        out: list[_Segment] = []
        while True:
            buf = self._buf
            if self._state == "start":
                body = buf.lstrip()
                if _LLAMA_JSON_START.match(body):
                    if len(body) < len(buf):
                        out.append(_Text(buf[: len(buf) - len(body)]))
                    self._buf = body
                    self._state = "region"
                    continue
                if not final and (not body or _LLAMA_JSON_PREFIX.fullmatch(body)):
                    return out  # could still become a JSON call
                self._state = "text"
                continue
            if self._state == "text":
                i = buf.find(_PYTHON_TAG)
                if i >= 0:
                    if i:
                        out.append(_Text(buf[:i]))
                    self._buf = buf[i:]
                    self._state = "region"
                    continue
                cut = len(buf) - (0 if final else _partial_suffix(buf, _PYTHON_TAG))
                if cut:
                    out.append(_Text(buf[:cut]))
                    self._buf = buf[cut:]
                return out
            if final and buf:
                out.append(_Block(buf, closed=True))
                self._buf = ""
            return out


# --------------------------------------------------------------------------- call validation


def _reject_constant(name: str) -> Any:
    # NaN / Infinity are not JSON; json.loads would accept them and json.dumps write them back.
    raise ValueError(f"{name} is not valid JSON")


def _loads(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity."""
    return json.loads(text, parse_constant=_reject_constant)


def _tool_index(tools: Sequence[ToolSpec] | None) -> dict[str, ToolSpec] | None:
    return None if tools is None else {t.name: t for t in tools}


def _make_call(
    name: Any, arguments: Any, tools: dict[str, ToolSpec] | None
) -> ParsedToolCall | str:
    """Validate a decoded call; returns the call or why it is not one."""
    if not isinstance(name, str) or not name.strip():
        return "missing or empty tool name"
    if tools is not None and name not in tools:
        known = ", ".join(sorted(tools)) or "none"
        return f"unknown tool {name!r} (offered: {known})"
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return f"arguments of {name!r} are a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"arguments of {name!r} are not a JSON object (got {type(arguments).__name__})"
    return ParsedToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _unclosed_note(block: _Block) -> str:
    return "" if block.closed else " (block not closed)"


# --------------------------------------------------------------------------- streaming


class ToolCallStreamer:
    """Streams one output: ``feed`` each text delta, then ``finish`` once.

    Content is emitted as soon as it cannot be part of a call: only a possible partial start
    marker and trailing whitespace (which is dropped if a call follows) are held back. A call
    block is buffered until its end marker, then emitted as a name delta plus the whole
    arguments as one fragment; a malformed block is emitted as content at that point.
    ``errors`` lists the malformed blocks seen so far.
    """

    def __init__(
        self,
        segmenter: _Segmenter,
        interpret: Callable[[_Block, dict[str, ToolSpec] | None], list[_Item]],
        tools: Sequence[ToolSpec] | None,
    ) -> None:
        self._segmenter = segmenter
        self._interpret = interpret
        self._tools = _tool_index(tools)
        self._errors: list[str] = []
        self._held = ""  # trailing whitespace of the content so far
        self._emitted_content = False  # any non-whitespace content emitted yet
        self._seen_call = False
        self._piece_has_text = False  # non-whitespace content since the last call
        self._next_index = 0
        self._finished = False

    @property
    def errors(self) -> list[str]:
        """Why each malformed block seen so far was not a call."""
        return list(self._errors)

    def feed(self, text_delta: str) -> list[StreamEvent]:
        """Events made safe by this delta. Raises RuntimeError after ``finish``."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        return self._handle(self._segmenter.feed(text_delta), final=False)

    def finish(self) -> list[StreamEvent]:
        """Flush everything held back; the output has ended."""
        if self._finished:
            return []
        self._finished = True
        return self._handle(self._segmenter.finish(), final=True)

    def _handle(self, segments: list[_Segment], *, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for seg in segments:
            if isinstance(seg, _Text):
                self._content(seg.text, events)
                continue
            for item in self._interpret(seg, self._tools):
                if isinstance(item, _Malformed):
                    self._errors.append(item.error)
                    self._content(item.raw, events)
                else:
                    self._call(item, events)
        # Held whitespace is content unless it only trails the last call, or all was whitespace.
        if final and self._held and self._emitted_content:
            if self._piece_has_text or not self._seen_call:
                self._emit(self._held, events)
            self._held = ""
        return events

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        if body:
            self._emitted_content = True
            self._piece_has_text = True
            self._emit(body, events)

    def _emit(self, text: str, events: list[StreamEvent]) -> None:
        # Merge adjacent content so one feed yields one content delta.
        if events and isinstance(events[-1], ContentDelta):
            events[-1] = ContentDelta(events[-1].text + text)
        else:
            events.append(ContentDelta(text))

    def _call(self, call: ParsedToolCall, events: list[StreamEvent]) -> None:
        self._held = ""  # whitespace before a call only separates it from the text
        self._seen_call = True
        self._piece_has_text = False
        index = self._next_index
        self._next_index += 1
        events.append(ToolCallDelta(index=index, name=call.name))
        events.append(ToolCallDelta(index=index, arguments=call.arguments))


def _collect(events: list[StreamEvent], errors: list[str]) -> ToolCallParse:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.name is not None:
                names[e.index] = e.name
            args.setdefault(e.index, []).append(e.arguments)
    calls = [ParsedToolCall(name=names[i], arguments="".join(args[i])) for i in sorted(names)]
    return ToolCallParse(content=content or None, tool_calls=calls, errors=errors)


class _BaseParser:
    """A segmenter factory plus a block interpreter; ``parse`` is one streaming pass."""

    name = ""

    def _segmenter(self) -> _Segmenter:
        raise NotImplementedError

    def _interpret(self, block: _Block, tools: dict[str, ToolSpec] | None) -> list[_Item]:
        raise NotImplementedError

    def streamer(self, tools: Sequence[ToolSpec] | None) -> ToolCallStreamer:
        return ToolCallStreamer(self._segmenter(), self._interpret, tools)

    def parse(self, text: str, tools: Sequence[ToolSpec] | None) -> ToolCallParse:
        streamer = self.streamer(tools)
        events = streamer.feed(text) + streamer.finish()
        return _collect(events, streamer.errors)


# --------------------------------------------------------------------------- qwen25 / hermes

_TOOL_CALL_START = "<tool_call>"
_TOOL_CALL_END = "</tool_call>"


def _block_body(block: _Block) -> str:
    """The text between the markers of a ``<tool_call>`` block."""
    body = block.raw[len(_TOOL_CALL_START) :]
    return body[: -len(_TOOL_CALL_END)] if block.closed else body


class Qwen25Parser(_BaseParser):
    """``<tool_call>`` blocks holding ``{"name": ..., "arguments": {...}}`` (Qwen 2.5, Hermes).

    ``"parameters"`` is accepted in place of ``"arguments"``. An unclosed last block (output
    truncated, or ``</tool_call>`` used as a stop string) is a call if its JSON is complete.
    """

    name = "qwen25"

    def _segmenter(self) -> _Segmenter:
        return _MarkerSegmenter(_TOOL_CALL_START, _TOOL_CALL_END)

    def _interpret(self, block: _Block, tools: dict[str, ToolSpec] | None) -> list[_Item]:
        note = _unclosed_note(block)
        try:
            obj = _loads(_block_body(block).strip())
        except ValueError as exc:
            return [_Malformed(block.raw, f"<tool_call> block is not valid JSON{note}: {exc}")]
        if not isinstance(obj, dict):
            return [_Malformed(block.raw, f"<tool_call> block is not a JSON object{note}")]
        arguments = obj.get("arguments", obj.get("parameters", {}))
        call = _make_call(obj.get("name"), arguments, tools)
        if isinstance(call, str):
            return [_Malformed(block.raw, f"<tool_call> block: {call}{note}")]
        return [call]


# --------------------------------------------------------------------------- qwen3_coder

_FUNCTION_OPEN = re.compile(r"<function=([^>\n]*)>")
_FUNCTION_CLOSE = "</function>"
_PARAM_OPEN = re.compile(r"<parameter=([^>\n]*)>")
_PARAM_CLOSE = "</parameter>"
_NO_VALUE = object()


def schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows (``type``, a type list, ``anyOf``/``oneOf``)."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    found: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found.extend(schema_types(sub))
    return found


def _as_type(text: str, kind: str) -> Any:
    """``text`` converted to JSON type ``kind``, or ``_NO_VALUE`` when it is not one."""
    s = text.strip()
    if kind == "null":
        return None if s == "null" else _NO_VALUE
    if kind == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _NO_VALUE)
    try:
        value = _loads(s)
    except ValueError:
        return _NO_VALUE
    if kind == "integer":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO_VALUE
    if kind == "number":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return value if ok and math.isfinite(value) else _NO_VALUE
    if kind == "object":
        return value if isinstance(value, dict) else _NO_VALUE
    if kind == "array":
        return value if isinstance(value, list) else _NO_VALUE
    return _NO_VALUE


def _convert_param(text: str, schema: Any) -> Any:
    """A parameter value typed by its schema; the text itself when it is (or may be) a string.

    A value that does not fit its declared type stays a string: the tool, not the parser, is the
    one to reject it, so the model gets a tool error it can learn from.
    """
    types = schema_types(schema)
    if "null" in types and text.strip() == "null":
        return None
    if not types or "string" in types:
        return text
    for kind in types:
        value = _as_type(text, kind)
        if value is not _NO_VALUE:
            return value
    return text


def _strip_one_newline(value: str) -> str:
    # The template renders "<parameter=p>\n{value}\n</parameter>": exactly one newline each side.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3CoderParser(_BaseParser):
    """``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>``.

    Values are typed with the tool's schema (integer, number, boolean, object, array, null);
    strings, parameters without a schema and values that do not fit their type stay strings.
    Like the reference parsers, a missing ``</parameter>`` ends at the next parameter and a
    missing ``</function>`` is tolerated.
    """

    name = "qwen3_coder"

    def _segmenter(self) -> _Segmenter:
        return _MarkerSegmenter(_TOOL_CALL_START, _TOOL_CALL_END)

    def _interpret(self, block: _Block, tools: dict[str, ToolSpec] | None) -> list[_Item]:
        result = self._parse_body(_block_body(block), tools)
        if isinstance(result, str):
            return [_Malformed(block.raw, f"<tool_call> block: {result}{_unclosed_note(block)}")]
        return [result]

    def _parse_body(self, body: str, tools: dict[str, ToolSpec] | None) -> ParsedToolCall | str:
        body = body.strip()
        m = _FUNCTION_OPEN.match(body)
        if m is None:
            return "no <function=NAME> tag"
        name = m.group(1).strip()
        rest = body[m.end() :]
        close = rest.find(_FUNCTION_CLOSE)
        if close >= 0:
            if rest[close + len(_FUNCTION_CLOSE) :].strip():
                return "text after </function>"
            rest = rest[:close]
        spec = tools.get(name) if tools is not None else None
        props = spec.parameters.get("properties") if spec is not None else None
        if not isinstance(props, dict):
            props = {}
        arguments: dict[str, Any] = {}
        pos = 0
        while True:
            pm = _PARAM_OPEN.search(rest, pos)
            gap = rest[pos : pm.start() if pm else len(rest)]
            if gap.strip():
                return f"unexpected text {gap.strip()[:40]!r} outside <parameter=...>"
            if pm is None:
                break
            pname = pm.group(1).strip()
            if not pname:
                return "empty parameter name"
            if pname in arguments:
                return f"parameter {pname!r} given twice"
            start = pm.end()
            pclose = rest.find(_PARAM_CLOSE, start)
            nxt = _PARAM_OPEN.search(rest, start)
            if pclose >= 0 and (nxt is None or pclose < nxt.start()):
                end, pos = pclose, pclose + len(_PARAM_CLOSE)
            else:
                end = pos = nxt.start() if nxt else len(rest)
            text = _strip_one_newline(rest[start:end])
            arguments[pname] = _convert_param(text, props.get(pname))
        return _make_call(name, arguments, tools)


# --------------------------------------------------------------------------- llama3


class Llama3Parser(_BaseParser):
    """Llama 3.x JSON tool calls: ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; ...]``.

    Text before ``<|python_tag|>`` is content; without the tag, an output is a call only when it
    opens with ``{"name"``. ``"arguments"`` is accepted in place of ``"parameters"``. When no
    object in the region is a valid call, the whole region (tag included) is one malformed block;
    otherwise each invalid object is content on its own.
    """

    name = "llama3"

    def _segmenter(self) -> _Segmenter:
        return _Llama3Segmenter()

    def _interpret(self, block: _Block, tools: dict[str, ToolSpec] | None) -> list[_Item]:
        region = block.raw
        if region.startswith(_PYTHON_TAG):
            region = region[len(_PYTHON_TAG) :]
        items = self._split(region, tools)
        if not any(isinstance(item, ParsedToolCall) for item in items):
            errors = [item.error for item in items if isinstance(item, _Malformed)]
            return [_Malformed(block.raw, errors[0] if errors else "empty llama3 tool call")]
        return items

    def _split(self, region: str, tools: dict[str, ToolSpec] | None) -> list[_Item]:
        decoder = json.JSONDecoder(parse_constant=_reject_constant)
        items: list[_Item] = []
        pos, n = 0, 0
        while True:
            while pos < len(region) and region[pos].isspace():
                pos += 1
            if pos >= len(region):
                return items
            n += 1
            try:
                obj, end = decoder.raw_decode(region, pos)
            except ValueError as exc:
                items.append(_Malformed(region[pos:], f"llama3 call {n} is not valid JSON: {exc}"))
                return items
            raw = region[pos:end]
            if isinstance(obj, dict):
                arguments = obj.get("parameters", obj.get("arguments", {}))
                call = _make_call(obj.get("name"), arguments, tools)
            else:
                call = "not a JSON object"
            items.append(
                call
                if isinstance(call, ParsedToolCall)
                else _Malformed(raw, f"llama3 call {n}: {call}")
            )
            pos = end
            while pos < len(region) and region[pos].isspace():
                pos += 1
            if pos < len(region) and region[pos] == ";":
                pos += 1
            elif pos < len(region) and region[pos] != "{":
                # Keep the whitespace before the junk: it separates it from earlier content.
                junk = region[end:]
                items.append(_Malformed(junk, f"unexpected text after llama3 call {n}"))
                return items


# --------------------------------------------------------------------------- registry

_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "qwen25": Qwen25Parser,
    "hermes": Qwen25Parser,
    "qwen": Qwen25Parser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3": Llama3Parser,
}


def tool_call_parser_names() -> list[str]:
    """Every name :func:`get_tool_call_parser` accepts, sorted."""
    return sorted(_PARSERS)


def get_tool_call_parser(name: str) -> ToolCallParser:
    """The parser called ``name``; ValueError naming the known parsers otherwise."""
    factory = _PARSERS.get(name)
    if factory is None:
        known = ", ".join(tool_call_parser_names())
        raise ValueError(f"unknown tool-call parser {name!r}; known parsers: {known}")
    return factory()
