"""Tool-call and reasoning parsers: each format, malformed input, and split-invariant streaming."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from corral.gateway.parsers.reasoning import get_reasoning_parser
from corral.gateway.parsers.tool_calls import (
    ContentDelta,
    ParsedToolCall,
    ToolCallDelta,
    ToolCallParse,
    ToolCallParser,
    ToolSpec,
    get_tool_call_parser,
)

WEATHER = ToolSpec(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
SUBMIT = ToolSpec(
    "submit",
    {
        "type": "object",
        "properties": {
            "schedule": {"type": "array", "items": {"type": "integer"}},
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "final": {"type": "boolean"},
            "options": {"type": "object"},
            "note": {"type": "string"},
            "maybe": {"type": ["integer", "null"]},
            "either": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        },
    },
)
TOOLS = [WEATHER, SUBMIT]


def qwen_block(name: str, arguments: object) -> str:
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{payload}\n</tool_call>"


def coder_block(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# --------------------------------------------------------------------------- registry


def test_registry_names_and_aliases() -> None:
    assert type(get_tool_call_parser("hermes")) is type(get_tool_call_parser("qwen25"))
    assert get_tool_call_parser("qwen3_coder").name == "qwen3_coder"
    assert get_tool_call_parser("llama3").name == "llama3"
    with pytest.raises(ValueError, match=r"known parsers: .*qwen25"):
        get_tool_call_parser("nope")
    assert get_reasoning_parser("deepseek_r1").name == "qwen3"
    with pytest.raises(ValueError, match=r"known parsers: .*qwen3"):
        get_reasoning_parser("nope")


def test_toolspec_from_openai() -> None:
    spec = ToolSpec.from_openai(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    )
    assert spec == ToolSpec("f", {"type": "object"})
    with pytest.raises(ValueError):
        ToolSpec.from_openai({"type": "function", "function": {}})


# --------------------------------------------------------------------------- qwen25


def test_qwen25_single_call_byte_identical_arguments() -> None:
    args = {"city": "Zürich", "days": 3}
    text = qwen_block("get_weather", args)
    out = get_tool_call_parser("qwen25").parse(text, TOOLS)
    assert out == ToolCallParse(
        content=None,
        tool_calls=[ParsedToolCall("get_weather", '{"city": "Zürich", "days": 3}')],
        errors=[],
    )


def test_qwen25_content_before_and_parallel_calls() -> None:
    text = (
        "Let me check both.\n"
        + qwen_block("get_weather", {"city": "Oslo"})
        + "\n"
        + qwen_block("get_weather", {"city": "Rome"})
        + "\n"
    )
    out = get_tool_call_parser("qwen25").parse(text, TOOLS)
    assert out.content == "Let me check both."
    assert [c.arguments for c in out.tool_calls] == ['{"city": "Oslo"}', '{"city": "Rome"}']
    assert out.errors == []


def test_qwen25_text_between_and_after_calls_is_kept() -> None:
    text = "A\n" + qwen_block("submit", {}) + "\nB\n" + qwen_block("submit", {}) + "\nC\n"
    out = get_tool_call_parser("qwen25").parse(text, TOOLS)
    assert out.content == "A\nB\nC\n"
    assert len(out.tool_calls) == 2


def test_qwen25_no_calls_is_plain_content() -> None:
    parser = get_tool_call_parser("qwen25")
    assert parser.parse("  just text <tool \n", TOOLS) == ToolCallParse(
        "  just text <tool \n", [], []
    )
    assert parser.parse(" \n ", TOOLS).content is None


def test_qwen25_malformed_json_stays_as_content() -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {city: 1}}\n</tool_call>'
    text = "Hi.\n" + bad + "\n" + qwen_block("get_weather", {"city": "Oslo"})
    out = get_tool_call_parser("qwen25").parse(text, TOOLS)
    assert out.content == "Hi.\n" + bad
    assert [c.name for c in out.tool_calls] == ["get_weather"]
    assert len(out.errors) == 1 and "not valid JSON" in out.errors[0]


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ('{"arguments": {}}', "missing or empty tool name"),
        ('{"name": "rm_rf", "arguments": {}}', "unknown tool 'rm_rf'"),
        ('{"name": "submit", "arguments": [1, 2]}', "not a JSON object"),
        ('{"name": "submit", "arguments": "not json"}', "string that is not JSON"),
        ('{"name": "submit", "arguments": "[1]"}', "not a JSON object"),
        ('{"name": "submit", "arguments": {"x": NaN}}', "not valid JSON"),
        ('["submit"]', "not a JSON object"),
    ],
)
def test_qwen25_invalid_calls_are_flagged(payload: str, why: str) -> None:
    block = f"<tool_call>\n{payload}\n</tool_call>"
    out = get_tool_call_parser("qwen25").parse(block, TOOLS)
    assert out.tool_calls == []
    assert out.content == block
    assert len(out.errors) == 1 and why in out.errors[0]


def test_qwen25_string_arguments_and_unknown_tools() -> None:
    parser = get_tool_call_parser("hermes")
    text = '<tool_call>\n{"name": "anything", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    # No tool list: any name goes; a JSON string holding an object is decoded.
    assert parser.parse(text, None).tool_calls == [ParsedToolCall("anything", '{"a": 1}')]
    # An empty tool list offers nothing, so every call is unknown.
    assert parser.parse(text, []).errors
    # No arguments key means no arguments.
    no_args = '<tool_call>\n{"name": "submit"}\n</tool_call>'
    assert parser.parse(no_args, TOOLS).tool_calls == [ParsedToolCall("submit", "{}")]


def test_qwen25_unclosed_blocks() -> None:
    parser = get_tool_call_parser("qwen25")
    complete = '<tool_call>\n{"name": "submit", "arguments": {"count": 1}}'
    assert parser.parse(complete, TOOLS).tool_calls == [ParsedToolCall("submit", '{"count": 1}')]
    truncated = '<tool_call>\n{"name": "submit", "argu'
    out = parser.parse("Hi " + truncated, TOOLS)
    assert out.content == "Hi " + truncated and out.tool_calls == []
    assert "not closed" in out.errors[0]
    # A broken block does not swallow the valid call after it.
    out = parser.parse(truncated + qwen_block("submit", {}), TOOLS)
    assert out.content == truncated and len(out.tool_calls) == 1


# --------------------------------------------------------------------------- qwen3_coder


def test_qwen3_coder_converts_by_schema() -> None:
    params = {
        "schedule": "[1, -1, 0]",
        "count": "7",
        "ratio": "0.5",
        "final": "true",
        "options": '{"mode": "fast"}',
        "note": "42",
        "maybe": "null",
        "either": "3",
    }
    text = "Submitting.\n" + coder_block("submit", params)
    out = get_tool_call_parser("qwen3_coder").parse(text, TOOLS)
    assert out.content == "Submitting." and out.errors == []
    assert json.loads(out.tool_calls[0].arguments) == {
        "schedule": [1, -1, 0],
        "count": 7,
        "ratio": 0.5,
        "final": True,
        "options": {"mode": "fast"},
        "note": "42",
        "maybe": None,
        "either": 3,
    }


def test_qwen3_coder_keeps_strings_without_schema_or_on_mismatch() -> None:
    parser = get_tool_call_parser("qwen3_coder")
    text = coder_block("submit", {"count": "many", "extra": "5", "note": "line1\nline2"})
    args = json.loads(parser.parse(text, TOOLS).tool_calls[0].arguments)
    assert args == {"count": "many", "extra": "5", "note": "line1\nline2"}
    # Tools unknown: every value stays a string.
    args = json.loads(parser.parse(coder_block("f", {"n": "5"}), None).tool_calls[0].arguments)
    assert args == {"n": "5"}


def test_qwen3_coder_parallel_and_lenient_closers() -> None:
    text = (
        coder_block("get_weather", {"city": "Oslo", "days": "2"})
        + "\n"
        + "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n1\n"
        + "</tool_call>"
    )
    out = get_tool_call_parser("qwen3_coder").parse(text, TOOLS)
    assert out.content is None and out.errors == []
    assert [json.loads(c.arguments) for c in out.tool_calls] == [
        {"city": "Oslo", "days": 2},
        {"city": "Rome", "days": 1},
    ]


@pytest.mark.parametrize(
    ("block", "why"),
    [
        ("<tool_call>\n{}\n</tool_call>", "no <function=NAME>"),
        (coder_block("rm_rf", {}), "unknown tool"),
        ("<tool_call>\n<function=submit>\njunk\n</function>\n</tool_call>", "unexpected text"),
        (coder_block("submit", {"note": "a"})[:-12] + "x</tool_call>", "after </function>"),
        (
            "<tool_call><function=submit><parameter=note>a</parameter>"
            "<parameter=note>b</parameter></function></tool_call>",
            "given twice",
        ),
    ],
)
def test_qwen3_coder_malformed(block: str, why: str) -> None:
    out = get_tool_call_parser("qwen3_coder").parse("x " + block, TOOLS)
    assert out.tool_calls == [] and out.content == "x " + block
    assert len(out.errors) == 1 and why in out.errors[0]


# --------------------------------------------------------------------------- llama3


def test_llama3_python_tag_and_semicolons() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "submit", "parameters": {"count": 2}}'
    )
    out = get_tool_call_parser("llama3").parse(text, TOOLS)
    assert out == ToolCallParse(
        None,
        [
            ParsedToolCall("get_weather", '{"city": "Oslo"}'),
            ParsedToolCall("submit", '{"count": 2}'),
        ],
        [],
    )


def test_llama3_bare_json_and_content_before_tag() -> None:
    parser = get_tool_call_parser("llama3")
    bare = '\n{"name": "submit", "arguments": {"count": 1}}'
    assert parser.parse(bare, TOOLS).tool_calls == [ParsedToolCall("submit", '{"count": 1}')]
    out = parser.parse('Sure.\n<|python_tag|>{"name": "submit", "parameters": {}}', TOOLS)
    assert out.content == "Sure." and out.tool_calls == [ParsedToolCall("submit", "{}")]
    # JSON that does not open with "name" is an ordinary answer, not a call.
    assert parser.parse('{"answer": 42}', TOOLS) == ToolCallParse('{"answer": 42}', [], [])
    assert parser.parse("plain", TOOLS) == ToolCallParse("plain", [], [])


def test_llama3_malformed() -> None:
    parser = get_tool_call_parser("llama3")
    code = '<|python_tag|>brave_search.call(query="x")'
    out = parser.parse(code, TOOLS)
    assert out.content == code and out.tool_calls == [] and "not valid JSON" in out.errors[0]
    mixed = '{"name": "submit", "parameters": {}}; {"name": "nope", "parameters": {}}'
    out = parser.parse(mixed, TOOLS)
    assert out.tool_calls == [ParsedToolCall("submit", "{}")]
    assert out.content == '{"name": "nope", "parameters": {}}'
    assert "unknown tool 'nope'" in out.errors[0]
    junk = 'Let me see.\n<|python_tag|>{"name": "submit", "parameters": {}} trailing'
    out = parser.parse(junk, TOOLS)
    assert out.content == "Let me see. trailing" and len(out.tool_calls) == 1
    assert "unexpected text" in out.errors[0]


# --------------------------------------------------------------------------- streaming


def split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def stream(
    parser: ToolCallParser, pieces: list[str], tools: list[ToolSpec] | None
) -> ToolCallParse:
    streamer = parser.streamer(tools)
    events = []
    for piece in pieces:
        events += streamer.feed(piece)
    events += streamer.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.name is not None:
                assert e.index not in names, "the name comes in the first delta only"
                assert e.index == len(names), "indexes are assigned in order"
                names[e.index] = e.name
            else:
                assert e.index in names, "arguments follow the name delta"
            calls.setdefault(e.index, []).append(e.arguments)
    return ToolCallParse(
        content or None,
        [ParsedToolCall(names[i], "".join(calls[i])) for i in sorted(names)],
        streamer.errors,
    )


STREAM_CASES = [
    (
        "qwen25",
        "Thinking about it <tool.\n"
        + qwen_block("get_weather", {"city": "Oslo"})
        + "\n<tool_call>\n{bad}\n</tool_call>\n"
        + qwen_block("submit", {"count": 1})
        + "\n\nDone. <tool_ca",
    ),
    ("qwen25", "  \n" + qwen_block("submit", {}) + "\n  \n"),
    ("qwen25", "no calls at all\n\n"),
    ("qwen25", " \n\t "),
    ("qwen25", 'x <tool_call>\n{"name": "submit", "arguments": {}}'),
    (
        "qwen3_coder",
        "I will submit.\n\n"
        + coder_block("submit", {"schedule": "[1, 0]", "note": "hi\n"})
        + "\n"
        + coder_block("rm_rf", {"a": "b"}),
    ),
    (
        "llama3",
        '  {"name": "submit", "parameters": {"count": 3}};{"name": "get_weather", '
        '"parameters": {"city": "Rome"}}',
    ),
    ("llama3", 'Let me see.\n<|python_tag|>{"name": "submit", "parameters": {}} trailing'),
    ("llama3", '<|python_ta is not a tag, {"name" neither'),
    ("llama3", '{"na'),
]


@pytest.mark.parametrize(("name", "text"), STREAM_CASES)
def test_streaming_equals_parse_at_every_split(name: str, text: str) -> None:
    parser = get_tool_call_parser(name)
    expected = parser.parse(text, TOOLS)
    for i in range(len(text) + 1):
        assert stream(parser, [text[:i], text[i:]], TOOLS) == expected, f"split at {i}"
    assert stream(parser, list(text), TOOLS) == expected


@pytest.mark.parametrize(("name", "text"), STREAM_CASES)
def test_streaming_equals_parse_under_random_splits(name: str, text: str) -> None:
    parser = get_tool_call_parser(name)
    expected = parser.parse(text, TOOLS)
    rng = random.Random(f"{name}:{text}")
    for _ in range(200):
        assert stream(parser, split_randomly(text, rng), TOOLS) == expected


def test_streaming_emits_content_early_and_holds_partial_marker() -> None:
    streamer = get_tool_call_parser("qwen25").streamer(TOOLS)
    assert streamer.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert streamer.feed("ld <tool_") == [ContentDelta("ld")]  # " <tool_" may start a call
    assert streamer.feed('call>\n{"name": "submit", ') == []
    assert streamer.feed('"arguments": {}}\n</tool_call>') == [
        ToolCallDelta(index=0, name="submit"),
        ToolCallDelta(index=0, arguments="{}"),
    ]
    assert streamer.finish() == []
    with pytest.raises(RuntimeError):
        streamer.feed("more")


# --------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    ("text", "starts_in_reasoning", "expected"),
    [
        (
            "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
            False,
            ("Let me think.", "The answer is 4."),
        ),
        ("<think>\n\n</think>\n\nHi", False, (None, "Hi")),
        ("No thinking here.\n", False, (None, "No thinking here.\n")),
        ("Answer <think>x</think>", False, (None, "Answer <think>x</think>")),
        ("<think>\nstill thinking\n", False, ("still thinking\n", "")),
        ("reasoning\n</think>\n\ncontent", True, ("reasoning", "content")),
        ("<think>\nreasoning\n</think>\n\ncontent", True, ("reasoning", "content")),
        ("truncated reasoning", True, ("truncated reasoning", "")),
        ("", True, (None, "")),
        ("", False, (None, "")),
        ("\n<think>a\n\nb</think>c\n", False, ("a\n\nb", "c\n")),
    ],
)
def test_reasoning_cases(
    text: str, starts_in_reasoning: bool, expected: tuple[str | None, str]
) -> None:
    parser = get_reasoning_parser("qwen3")
    assert parser.parse(text, starts_in_reasoning=starts_in_reasoning) == expected
    rng = random.Random(text)
    for trial in range(len(text) + 100):
        if trial <= len(text):
            pieces = [text[:trial], text[trial:]]
        else:
            pieces = split_randomly(text, rng) if len(text) > 1 else [text]
        streamer = parser.streamer(starts_in_reasoning=starts_in_reasoning)
        deltas = [streamer.feed(p) for p in pieces] + [streamer.finish()]
        reasoning = "".join(d.reasoning for d in deltas) or None
        assert (reasoning, "".join(d.content for d in deltas)) == expected


def test_reasoning_streams_early() -> None:
    streamer = get_reasoning_parser("qwen3").streamer()
    assert streamer.feed("<thi").reasoning == ""
    assert streamer.feed("nk>\nStep one.\n").reasoning == "Step one."
    assert streamer.feed("Step two.</th").reasoning == "\nStep two."
    delta = streamer.feed("ink>\n\nDone")
    assert (delta.reasoning, delta.content) == ("", "Done")


def test_no_reasoning_parser() -> None:
    parser = get_reasoning_parser("none")
    assert parser.parse("<think>x</think>y") == (None, "<think>x</think>y")
    streamer = parser.streamer()
    assert streamer.feed("ab").content == "ab" and streamer.finish().content == ""


FRAGMENTS = [
    "text",
    " ",
    "\n",
    "<",
    "<tool_",
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "<|python",
    '{"name": "submit", "arguments": {"count": 1}}',
    '{"name": "submit", "parameters": {}}',
    ";",
    "{",
    "<function=submit>",
    "<parameter=count>\n2\n</parameter>",
    "</function>",
    "<think>",
    "</think>",
    "</thi",
]


@pytest.mark.parametrize("name", ["qwen25", "qwen3_coder", "llama3"])
def test_streaming_fuzz_random_texts(name: str) -> None:
    parser = get_tool_call_parser(name)
    rng = random.Random(name)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        expected = parser.parse(text, TOOLS)
        if not expected.tool_calls:  # nothing is lost: no call means the text is the content
            assert expected.content == (text if text.strip() else None), text
        pieces = split_randomly(text, rng) if len(text) > 1 else [text]
        assert stream(parser, pieces, TOOLS) == expected, text


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
def test_reasoning_fuzz_random_texts(starts_in_reasoning: bool) -> None:
    parser = get_reasoning_parser("qwen3")
    rng = random.Random(int(starts_in_reasoning))
    for _ in range(500):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10)))
        expected = parser.parse(text, starts_in_reasoning=starts_in_reasoning)
        streamer = parser.streamer(starts_in_reasoning=starts_in_reasoning)
        pieces = split_randomly(text, rng) if len(text) > 1 else [text]
        deltas = [streamer.feed(p) for p in pieces] + [streamer.finish()]
        reasoning = "".join(d.reasoning for d in deltas) or None
        assert (reasoning, "".join(d.content for d in deltas)) == expected, text
