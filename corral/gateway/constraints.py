"""Engine constraints for the OpenAI fields that promise a shape: pure functions, no I/O.

The gateway turns ``response_format`` and ``tool_choice`` into one of SGLang's constraint fields
(``sampling_params.json_schema`` / ``regex`` / ``ebnf``) and the engine guarantees the output is
in that language. For ``tool_choice`` "required" or a named function the output is one or more
calls that corral's tool-call parser for that format parses without errors and without content,
each naming an offered tool with arguments valid against its schema; for ``response_format`` it
is a JSON object, or an instance of the schema.

- :func:`json_object`: ``{"type": "object"}`` as a ``json_schema``, exactly what SGLang's OpenAI
  layer sends for ``json_object``.
- :func:`json_schema`: the schema itself (``strict``: OpenAI's strict mode, see below).
- :func:`response_format_constraint`: either of those from a ``response_format`` object.
- :func:`required_tool_calls` / :func:`named_tool_call`: a grammar for the format of a tool-call
  parser (``qwen25`` and its aliases ``hermes``/``qwen``, ``qwen3_coder``, ``llama3``).

Tool-call grammars are ``ebnf`` in llguidance's Lark dialect (they embed the tools' schemas with
``%json``). The local engine serves them; a real SGLang needs ``--grammar-backend llguidance``
(its default, xgrammar, takes GBNF only). One ``llama3`` call is a plain ``json_schema``, which
every backend takes. Grammars start with ``%llguidance {}``, which marks them as Lark for a
backend that would otherwise convert GBNF.

No prefill: generation is constrained from its first token, so the grammar forces a call's
fixed text itself, in the model's own tokens, and nothing is added to the prompt. (A forced
prefix that ended on a lone space token made a named tool choice fail 10 times in 10 on the tiny
model: the model never continues a lone space as it would have tokenized the text itself.)
``reasoning="optional"`` lets a model that thinks first (Qwen 3's ``<think>...</think>``) write
one such block before the calls; ``"open"`` is for a prompt that already opened it (the gateway's
``starts_in_reasoning``); ``"none"`` (the default) starts with the first call.

Layout and strictness: the JSON of a call is in ``json.dumps``'s layout (``", "``, ``": "``, no
other whitespace; properties in the schema's order), what the chat templates render, so that a
generated call re-renders token for token. ``strict=True`` (the default for tool calls, like
OpenAI's strict mode and SGLang's tool-call constraints) forbids undeclared properties wherever a
schema that declares properties leaves ``additionalProperties`` unsaid.

The parsers find calls by their markers before they read JSON, so the strings of a call (values
and keys) may not contain the markers that would cut it short (``<tool_call>``, ``</tool_call>``;
for ``qwen3_coder`` also ``<parameter=``, ``</parameter>``, ``</function>``): every string schema
gets a ``pattern`` excluding them and every free-form value is narrowed to JSON without them. A
call that contained one could not be re-rendered faithfully either.

A request these functions cannot express exactly raises :class:`UnsupportedConstraint`, with the
reason (the gateway answers 400 or serves the request unconstrained); nothing is silently
loosened.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from corral.gateway.parsers.tool_calls import ToolSpec, schema_types

__all__ = [
    "EngineConstraint",
    "Reasoning",
    "UnsupportedConstraint",
    "json_object",
    "json_schema",
    "named_tool_call",
    "required_tool_calls",
    "response_format_constraint",
    "tool_call_formats",
]

Reasoning = Literal["none", "optional", "open"]


@dataclass(frozen=True)
class EngineConstraint:
    """One SGLang constraint field: ``kind`` is the ``sampling_params`` key, ``value`` its text."""

    kind: Literal["json_schema", "regex", "ebnf"]
    value: str

    def sampling_params(self) -> dict[str, str]:
        """The field as ``sampling_params`` takes it, e.g. ``{"ebnf": "..."}``."""
        return {self.kind: self.value}


class UnsupportedConstraint(ValueError):
    """The request asks for a shape these constraints cannot guarantee (the message says why)."""


# --------------------------------------------------------------------------- JSON output


def json_object() -> EngineConstraint:
    """``response_format: {"type": "json_object"}``: any JSON object (SGLang's exact string)."""
    return EngineConstraint("json_schema", '{"type": "object"}')


def json_schema(schema: Mapping[str, Any] | bool, *, strict: bool = False) -> EngineConstraint:
    """``response_format: {"type": "json_schema", ...}``: an instance of ``schema``.

    ``strict`` (OpenAI's ``json_schema.strict``) also forbids undeclared properties wherever the
    schema declares properties and leaves ``additionalProperties`` unsaid.
    """
    if not isinstance(schema, Mapping | bool):
        raise UnsupportedConstraint("a JSON schema must be an object or a boolean")
    value = _strict(schema) if strict else schema
    return EngineConstraint("json_schema", json.dumps(value, ensure_ascii=False))


def response_format_constraint(response_format: Mapping[str, Any]) -> EngineConstraint | None:
    """The constraint for an OpenAI ``response_format`` object (None for ``{"type": "text"}``)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise UnsupportedConstraint("response_format json_schema needs json_schema.schema")
        return json_schema(spec["schema"], strict=bool(spec.get("strict")))
    raise UnsupportedConstraint(f"unknown response_format type {kind!r}")


# --------------------------------------------------------------------------- tool calls

_FORMATS = {"qwen25": "qwen25", "hermes": "qwen25", "qwen": "qwen25"}
_FORMATS |= {"qwen3_coder": "qwen3_coder", "llama3": "llama3"}

# What each parser's segmenter cuts at, in a call's strings (see the module docstring); llama3's
# parser reads calls as JSON, so its strings are free.
_BLOCK_MARKERS = ("<tool_call>", "</tool_call>")
_CODER_MARKERS = ("</parameter>", "<parameter=", "</function>", *_BLOCK_MARKERS)
_MARKERS = {"qwen25": _BLOCK_MARKERS, "qwen3_coder": _CODER_MARKERS, "llama3": ()}

# Every inline schema states the layout (llguidance's JSON options), see the module docstring.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The $defs entry for "any JSON value whose strings hold no marker".
_FREE = "corral_free_json"


def tool_call_formats() -> list[str]:
    """The tool-call parser names the tool-call constraints support."""
    return sorted(_FORMATS)


def required_tool_calls(
    parser: str,
    tools: Sequence[ToolSpec],
    *,
    parallel: bool = True,
    reasoning: Reasoning = "none",
    strict: bool = True,
) -> EngineConstraint:
    """``tool_choice: "required"``: one call (one or more when ``parallel``) of any of
    ``tools``, each with arguments valid against its tool's schema, then the end."""
    if not tools:
        raise UnsupportedConstraint("tool_choice 'required' needs at least one tool")
    return _tool_calls(parser, list(tools), many=parallel, reasoning=reasoning, strict=strict)


def named_tool_call(
    parser: str,
    tools: Sequence[ToolSpec],
    name: str,
    *,
    reasoning: Reasoning = "none",
    strict: bool = True,
) -> EngineConstraint:
    """A named ``tool_choice``: exactly one call, of ``name``, then the end."""
    chosen = [t for t in tools if t.name == name]
    if not chosen:
        raise UnsupportedConstraint(f"tool_choice names {name!r}, which is not among the tools")
    return _tool_calls(parser, chosen[:1], many=False, reasoning=reasoning, strict=strict)


def _tool_calls(
    parser: str, tools: list[ToolSpec], *, many: bool, reasoning: Reasoning, strict: bool
) -> EngineConstraint:
    fmt = _FORMATS.get(parser)
    if fmt is None:
        known = ", ".join(tool_call_formats())
        raise UnsupportedConstraint(f"no tool-call constraint for parser {parser!r} ({known})")
    if len({t.name for t in tools}) != len(tools):
        raise UnsupportedConstraint("tool names must be distinct")
    markers = _MARKERS[fmt]
    for tool in tools:
        _check_text(tool.name, markers, f"tool name {tool.name!r}")
    schemas = [_arguments_schema(t, strict) for t in tools]
    sep = '"; "' if fmt == "llama3" else '"\\n"'  # how the templates / parsers join calls
    calls = f"calls: call ({sep} call)*" if many else "calls: call"
    if fmt == "qwen3_coder":
        return _grammar(reasoning, calls, _coder_rules(tools, schemas, markers))
    key = "parameters" if fmt == "llama3" else "arguments"
    body = _json_calls(tools, schemas, key, markers)
    if fmt == "llama3" and not many and reasoning == "none":
        return EngineConstraint("json_schema", json.dumps(body, ensure_ascii=False))
    if fmt == "llama3":
        rules = ["call: %json " + json.dumps(body, ensure_ascii=False)]
    else:
        rules = [
            'call: "<tool_call>\\n" body "\\n</tool_call>"',
            "body: %json " + json.dumps(body, ensure_ascii=False),
        ]
    return _grammar(reasoning, calls, rules)


def _grammar(reasoning: Reasoning, calls: str, rules: list[str]) -> EngineConstraint:
    lines = ["%llguidance {}"]
    if reasoning == "none":
        lines.append("start: calls")
    else:
        # One terminal, so that the block ends exactly at its first "</think>" (llguidance's
        # lexer is greedy: free text followed by a separate "</think>" lexeme would run over
        # it), then the whitespace the Qwen 3 template puts after the block.
        opener = "" if reasoning == "open" else '"<think>" '
        lines.append("start: THINK? calls" if reasoning == "optional" else "start: THINK calls")
        lines.append(f'THINK: {opener}THOUGHT "</think>" /\\s*/')
        lines.append(f"THOUGHT: {_free_text(['</think>'])}")
    lines.append(calls)
    lines += rules
    return EngineConstraint("ebnf", "\n".join(lines) + "\n")


def _arguments_schema(tool: ToolSpec, strict: bool) -> dict[str, Any]:
    """The tool's parameters schema as an object schema (the parsers need an object)."""
    schema = dict(tool.parameters or {})
    kind = schema.get("type")
    if kind is None:
        schema["type"] = "object"
    elif kind != "object":
        raise UnsupportedConstraint(
            f"tool {tool.name!r}: parameters must be an object schema (type is {kind!r})"
        )
    return _strict(schema) if strict else schema


# --------------------------------------------------------------------------- JSON calls


def _json_calls(
    tools: list[ToolSpec],
    schemas: list[dict[str, Any]],
    arguments_key: str,
    markers: Sequence[str],
) -> dict[str, Any]:
    """The schema of one ``{"name": ..., <arguments_key>: {...}}`` object naming any of
    ``tools``. Each tool's schema moves to ``$defs/tool<i>``, its local ``$ref`` s re-rooted
    there, so that references still resolve in the combined schema."""
    defs: dict[str, Any] = {}
    options = []
    for i, (tool, schema) in enumerate(zip(tools, schemas, strict=True)):
        key = f"tool{i}"
        moved = _reroot(schema, f"#/$defs/{key}")
        defs[key] = _without(moved, markers, f"tool {tool.name!r}") if markers else moved
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.name},
                    arguments_key: {"$ref": f"#/$defs/{key}"},
                },
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    if markers and _uses_free(defs):
        defs[_FREE] = _free_json(_pattern_without(markers))
    body: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**body, "$defs": defs, "x-guidance": _LAYOUT}


def _reroot(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` (``#...``) relative to ``base``, not the root."""
    if isinstance(schema, Mapping):
        return {
            k: base + v[1:]
            if k == "$ref" and isinstance(v, str) and v.startswith("#")
            else _reroot(v, base)
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_reroot(v, base) for v in schema]
    return schema


_OBJECT_SAID = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_SCHEMA_MAPS |= {"dependentSchemas"}


def _strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that declares
    properties and says nothing about others (OpenAI's strict mode)."""
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _DATA_KEYS:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, Mapping):
            out[k] = {name: _strict(sub) for name, sub in v.items()}
        else:
            out[k] = _strict(v)
    if "properties" in out and not any(k in out for k in _OBJECT_SAID):
        out["additionalProperties"] = False
    return out


# --------------------------------------------------------------------------- marker-free JSON


def _pattern_without(markers: Sequence[str]) -> str:
    """An anchored regex (ECMA and Rust syntax alike) for the texts containing no marker.

    Every marker starts with ``<`` and has no other ``<``, so a text is ``[^<]*`` then pieces
    ``<`` + a ``<``-free run that does not begin with the rest of any marker. The allowed runs
    are written off the trie of those rests: at each node, stop, or leave the trie by a
    character that is not a child, or go down a child that does not complete a marker.
    """
    if not markers or any(not m.startswith("<") or "<" in m[1:] for m in markers):
        raise ValueError(f"markers must start with '<' and hold no other: {markers!r}")
    trie: dict[str, Any] = {}
    for marker in markers:
        node = trie
        for ch in marker[1:]:
            node = node.setdefault(ch, {})
        node[""] = {}  # a marker ends here

    def cls(chars: str) -> str:
        return "".join("\\" + c if c in "\\]^-[" else c for c in chars)

    def run(node: dict[str, Any]) -> str:
        children = sorted(c for c in node if c)
        parts = [f"[^<{cls(''.join(children))}][^<]*"]
        parts += [f"[{cls(c)}]{run(node[c])}" for c in children if "" not in node[c]]
        return "(?:" + "|".join(parts) + ")?"

    return f"^[^<]*(?:<{run(trie)})*$"


def _free_json(pattern: str) -> dict[str, Any]:
    """Any JSON value whose strings (values and keys) match ``pattern``."""
    free = {"$ref": f"#/$defs/{_FREE}"}
    return {
        "anyOf": [
            {"type": "string", "pattern": pattern},
            {"type": "number"},
            {"type": "boolean"},
            {"type": "null"},
            {"type": "array", "items": free},
            {"type": "object", "patternProperties": {pattern: free}, "additionalProperties": False},
        ]
    }


def _uses_free(schema: Any) -> bool:
    return any(ref == f"#/$defs/{_FREE}" for ref in _refs(schema))


def _check_text(text: str, markers: Sequence[str], where: str) -> None:
    for marker in markers:
        if marker in text:
            raise UnsupportedConstraint(f"{where} contains {marker!r}, which ends a call")


def _check_data(value: Any, markers: Sequence[str], where: str) -> None:
    """Refuse constants (``enum``/``const`` values) whose strings hold a marker."""
    if isinstance(value, str):
        _check_text(value, markers, where)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_text(str(k), markers, where)
            _check_data(v, markers, where)
    elif isinstance(value, list):
        for v in value:
            _check_data(v, markers, where)


_ANNOTATIONS = frozenset({"description", "title", "examples", "default", "$comment", "$schema"})
_ANNOTATIONS |= {"$id", "deprecated", "readOnly", "writeOnly", "strict"}
_COMBINATORS = frozenset({"anyOf", "oneOf", "allOf", "$ref", "enum", "const", "$defs"})
_COMBINATORS |= {"definitions"}
_OBJECT_WORDS = frozenset({"properties", "required", "additionalProperties", "minProperties"})
_OBJECT_WORDS |= {"maxProperties", "patternProperties"}
_ARRAY_WORDS = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"})
_ARRAY_WORDS |= {"contains"}


def _without(schema: Any, markers: Sequence[str], where: str) -> Any:
    """``schema`` narrowed to instances whose strings hold no marker (see the module docstring).

    Strings get the pattern (intersected with their own, if any); objects whose other
    properties are open get their names restricted by the pattern (``patternProperties``);
    free-form values (``{}``, ``true``, open ``additionalProperties``, arrays without
    ``items``) become marker-free JSON. Constants holding a marker are refused.
    """
    pattern = _pattern_without(markers)
    free = {"$ref": f"#/$defs/{_FREE}"}
    if schema is True:
        return free
    if not isinstance(schema, Mapping):
        return schema
    keys = {k for k in schema if k not in _ANNOTATIONS and k != "type"}
    if "type" not in schema and not keys:
        return free

    def sub(value: Any) -> Any:
        return _without(value, markers, where)

    out = dict(schema)
    for k in _DATA_KEYS & set(out):
        if k in ("const", "enum"):
            _check_data(out[k], markers, where)
    for k in _SCHEMA_MAPS & set(out):
        if isinstance(out[k], Mapping):
            out[k] = {name: sub(s) for name, s in out[k].items()}
    for k in ("items", "additionalProperties", "contains", "then", "else", "additionalItems"):
        if isinstance(out.get(k), Mapping | bool) and out[k] is not False:
            out[k] = sub(out[k])
    for k in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(k), list):
            out[k] = [sub(s) for s in out[k]]

    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or [])
    if not types:
        # Untyped: combinators and references are narrowed through their parts; otherwise the
        # keywords say which kind of value it constrains.
        if keys <= _COMBINATORS:
            return out
        if keys & _OBJECT_WORDS:
            types = {"object"}
        elif keys & _ARRAY_WORDS:
            types = {"array"}
        else:
            raise UnsupportedConstraint(
                f"{where}: cannot guarantee the untyped schema {sorted(keys)} marker-free"
            )
    if "string" in types and "enum" not in out and "const" not in out:
        if "pattern" in out:
            out["allOf"] = [*out.get("allOf", []), {"pattern": pattern}]
        else:
            out["pattern"] = pattern
    if "array" in types and "items" not in out:
        out["items"] = free
    if "object" in types:
        for name in out.get("properties") or {}:
            _check_text(str(name), markers, where)
        if "patternProperties" in schema or "unevaluatedProperties" in schema:
            raise UnsupportedConstraint(f"{where}: cannot make patternProperties names marker-free")
        others = out.get("additionalProperties", True)
        if others is not False:
            if out.get("properties") and others is not True and others != free:
                # Declared properties would also be checked against the pattern's schema.
                raise UnsupportedConstraint(
                    f"{where}: cannot make additionalProperties' names marker-free next to "
                    "declared properties (set additionalProperties to false or true)"
                )
            out["additionalProperties"] = False
            out["patternProperties"] = {pattern: free if others is True else others}
    return out


# --------------------------------------------------------------------------- qwen3_coder

_TOP_KEYS = frozenset({"type", "properties", "required", "additionalProperties"})
_TOP_KEYS |= {"$defs", "definitions"} | _ANNOTATIONS


def _free_text(forbidden: Sequence[str]) -> str:
    """A Lark terminal body: any text (newlines too) containing none of ``forbidden``."""
    words = "|".join(w.replace("/", "\\/") for w in forbidden)
    return f"/(.|\\n)*/ & ~/(.|\\n)*({words})(.|\\n)*/"


def _lark_string(text: str) -> str:
    """A Lark string literal for ``text`` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _coder_rules(
    tools: list[ToolSpec], schemas: list[dict[str, Any]], markers: Sequence[str]
) -> list[str]:
    """``<tool_call>\\n<function=NAME>\\n`` + parameters + ``</function>\\n</tool_call>``, each
    parameter ``<parameter=P>\\nVALUE\\n</parameter>\\n``, in the schema's order, the required
    ones always: VALUE is raw text for string parameters (the parser keeps it as text) and JSON
    for the others (the parser decodes it by the parameter's type)."""
    functions = " | ".join(f"fn{i}" for i in range(len(tools)))
    rules = [f'call: "<tool_call>\\n" ({functions}) "</tool_call>"', f"RAW: {_free_text(markers)}"]
    for i, (tool, schema) in enumerate(zip(tools, schemas, strict=True)):
        where = f"tool {tool.name!r}"
        if any(ch in tool.name for ch in ">\n") or not tool.name.strip():
            raise UnsupportedConstraint(f"{where}: the name cannot be a <function=...> tag")
        extra = sorted(set(schema) - _TOP_KEYS)
        if extra:
            raise UnsupportedConstraint(f"{where}: qwen3_coder calls cannot guarantee {extra}")
        props = schema.get("properties") or {}
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        names = [*props, *(r for r in required if r not in props)]
        defs: dict[str, Any] = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        parts = []
        for j, pname in enumerate(names):
            if any(ch in pname for ch in ">\n") or not pname.strip():
                raise UnsupportedConstraint(f"{where}: parameter name {pname!r} cannot be a tag")
            _check_text(pname, markers, f"{where}: parameter name {pname!r}")
            is_terminal, body = _coder_param(
                f"{where}: parameter {pname!r}", pname, props.get(pname, {}), defs, markers
            )
            rule = f"P{i}_{j}" if is_terminal else f"p{i}_{j}"
            rules.append(f"{rule}: {body}")
            parts.append(rule if pname in required else f"{rule}?")
        head, tail = _lark_string(f"<function={tool.name}>\n"), _lark_string("</function>\n")
        rules.append(f"fn{i}: {' '.join([head, *parts, tail])}")
    return rules


def _coder_param(
    where: str, name: str, schema: Any, defs: dict[str, Any], markers: Sequence[str]
) -> tuple[bool, str]:
    """(whether the rule is a terminal, its Lark body) for one ``<parameter=...>``. Text values
    are one terminal from the open tag to the close tag, so that a value ends at the close tag
    (llguidance's greedy lexer would run a free-text lexeme over a separate close tag)."""
    open_tag = _lark_string(f"<parameter={name}>\n")
    close_tag = _lark_string("\n</parameter>\n")
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise UnsupportedConstraint(f"{where}: schema {schema!r} cannot be guaranteed")
    types = schema_types(schema)
    if not types or "string" in types:
        # The parser keeps such a value as text: only a schema every text satisfies, or a list
        # of texts, can be guaranteed.
        keys = _constraining(schema)
        choices = _string_choices(schema)
        if choices is not None:
            for choice in choices:
                _check_text(choice, markers, where)
            return True, f"{open_tag} ({' | '.join(_lark_string(c) for c in choices)}) {close_tag}"
        if (not types and keys) or not _any_text(schema):
            raise UnsupportedConstraint(
                f"{where}: the parser reads it as text, so {sorted(keys)} cannot be guaranteed"
            )
        return True, f"{open_tag} RAW {close_tag}"
    for ref in _refs(schema):
        if not ref.startswith(("#/$defs/", "#/definitions/")):
            raise UnsupportedConstraint(f"{where}: $ref {ref!r} does not point into $defs")
    inline = _without({**schema, **defs}, markers, where)
    if _uses_free(inline):
        inline["$defs"] = {**inline.get("$defs", {}), _FREE: _free_json(_pattern_without(markers))}
    inline["x-guidance"] = _LAYOUT
    return False, f"{open_tag} %json {json.dumps(inline, ensure_ascii=False)} {close_tag}"


def _constraining(schema: Mapping[str, Any]) -> set[str]:
    return {k for k in schema if k not in _ANNOTATIONS and k != "type"}


def _string_choices(schema: Mapping[str, Any]) -> list[str] | None:
    """The texts an ``enum``/``const`` schema of strings allows; None when it is not one."""
    keys = _constraining(schema)
    if keys == {"enum"} and all(isinstance(v, str) for v in schema["enum"]):
        return list(schema["enum"])
    if keys == {"const"} and isinstance(schema["const"], str):
        return [schema["const"]]
    return None


def _any_text(schema: Mapping[str, Any]) -> bool:
    """Whether every text is valid against ``schema``: a plain string type, or a union with a
    plain string branch."""
    keys = _constraining(schema)
    if not keys:
        return True
    if keys in ({"anyOf"}, {"oneOf"}):
        branches = schema.get("anyOf") or schema.get("oneOf") or []
        return any(
            isinstance(b, Mapping) and schema_types(b) == ["string"] and not _constraining(b)
            for b in branches
        )
    return False


def _refs(schema: Any) -> Iterator[str]:
    if isinstance(schema, Mapping):
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str):
                yield v
            else:
                yield from _refs(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _refs(v)
