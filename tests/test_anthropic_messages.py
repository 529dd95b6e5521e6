"""The Anthropic Messages dialect: the official ``anthropic`` SDK -> gateway -> local engine.

Real servers on 127.0.0.1 (the ``stack`` fixture of ``tests/conftest.py``: its engine client
records what the engine saw, so samples are checked token for token). The dialect's pure parts
(how a request becomes the pipeline's conversation, how events become Anthropic's stream) are
also checked directly, on the requests Claude Code really sends
(``tests/fixtures/agent_requests``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from starlette.datastructures import Headers, QueryParams
from transformers import AutoTokenizer

from corral.engines.local.engine import LocalEngine
from corral.engines.local.server import build_engine_app
from corral.engines.tiny_model import TOOLS
from corral.gateway.app import build_gateway_app
from corral.gateway.dialects.anthropic_messages import THINKING_SIGNATURE, AnthropicMessages
from corral.gateway.dialects.anthropic_types import IGNORED_FIELDS
from corral.gateway.dialects.base import RequestContext
from corral.gateway.errors import GatewayError
from corral.gateway.pipeline import TurnPipeline
from corral.gateway.sessions import SessionOptions, SessionStore
from corral.gateway.settings import GatewaySettings
from corral.gateway.turns import (
    ChoiceFinished,
    ChoiceResult,
    Finish,
    LogprobsDelta,
    NamedTool,
    TextDelta,
    ThinkingDelta,
    TokenLogprob,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
    TurnEvent,
    TurnFinished,
    TurnResult,
    TurnStarted,
    Usage,
    result_events,
)
from tests.gateway_stack import ADMIN, Stack, check_exact_sample, gateway_stack
from tests.servers import serve

FIXTURES = Path(__file__).parent / "fixtures" / "agent_requests"

# The tiny model's tools, as Anthropic tools.
TOOLS_A: list[dict[str, Any]] = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
GREEDY = {"temperature": 0}
CLAUDE_CODE_AGENT = {"User-Agent": "claude-cli/2.1.328 (external, sdk-cli)"}


def _client(s: dict[str, Any], **kwargs: Any) -> anthropic.Anthropic:
    # The SDK sends the key as x-api-key; base_url is the session's Anthropic root.
    return anthropic.Anthropic(
        base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0, **kwargs
    )


def _post(
    s: dict[str, Any], body: dict[str, Any], path: str = "/v1/messages", **headers: str
) -> httpx.Response:
    return httpx.post(
        s["anthropic_base_url"] + path,
        json=body,
        headers={"x-api-key": s["api_key"], "anthropic-version": "2023-06-01", **headers},
    )


def _sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Server-sent events as (event name, data); every event must have both lines."""
    events = []
    for chunk in text.split("\n\n"):
        if not chunk.strip():
            continue
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def _hello(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "Say hello."}],
        **GREEDY,
        **extra,
    }


def _blocks(message: anthropic.types.Message) -> list[dict[str, Any]]:
    # The stream helper's blocks are its Parsed* subclasses: compare what went over the wire.
    return [b.model_dump(exclude={"parsed_output"}, exclude_none=True) for b in message.content]


def _text(message: anthropic.types.Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# -- the SDK drives a multi-turn tool conversation ------------------------------------------------


def test_sdk_multi_turn_tool_conversation_yields_one_exact_sample(stack: Stack) -> None:
    s = stack.session(metadata={"task": "weather"})
    client = _client(s)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Lima?"}]
    first = client.messages.create(
        model="tiny", max_tokens=200, messages=messages, tools=TOOLS_A, extra_body=GREEDY
    )
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert first.id.startswith("msg_") and first.role == "assistant" and first.model == "tiny"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Lima"})]
    engine = stack.engine.calls[-1]
    assert first.usage.input_tokens == len(engine.input_ids)
    assert first.usage.output_tokens == len(engine.output_ids)
    assert first.usage.cache_read_input_tokens == 0

    # The SDK's own content blocks go back as they came; the tool result quotes their id.
    messages.append({"role": "assistant", "content": first.content})
    result = json.dumps({"city": "Lima", "condition": "sunny"})
    messages.append(
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result}],
        }
    )
    with client.messages.stream(
        model="tiny", max_tokens=200, messages=messages, tools=TOOLS_A, extra_body=GREEDY
    ) as stream:
        deltas = sum(1 for e in stream if e.type == "content_block_delta")
        second = stream.get_final_message()
    assert deltas >= 2  # really streamed, token by token
    assert second.stop_reason == "end_turn"
    assert "Lima" in _text(second)
    assert second.usage.output_tokens == len(stack.engine.calls[-1].output_ids)
    assert second.usage.input_tokens == len(stack.engine.calls[-1].input_ids)

    messages.append({"role": "assistant", "content": second.content})
    messages.append({"role": "user", "content": "Say hello."})
    third = client.messages.create(
        model="tiny", max_tokens=50, messages=messages, tools=TOOLS_A, extra_body=GREEDY
    )
    assert third.stop_reason == "end_turn" and _text(third)

    sample = check_exact_sample(stack, s["id"], turns=3)
    assert sample["metadata"]["task"] == "weather"
    assert sample["metadata"]["label"] is None
    view = stack.view(s["id"])
    assert view["drift"]["forks"] == 0 and view["drift"]["merges"] == 2


def test_bearer_key_and_the_route_without_a_session(stack: Stack) -> None:
    # Claude Code authenticates with a bearer token (ANTHROPIC_AUTH_TOKEN), at the root.
    s = stack.session()
    client = anthropic.Anthropic(base_url=stack.url, auth_token=s["api_key"], max_retries=0)
    r = client.messages.create(
        model="tiny",
        max_tokens=32,
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body=GREEDY,
    )
    assert r.stop_reason == "end_turn" and _text(r) == "Hello!"
    assert len(stack.samples(s["id"])) == 1


# -- streams --------------------------------------------------------------------------------------


def test_stream_events_come_in_anthropics_order(stack: Stack) -> None:
    s = stack.session()
    body = {
        "model": "tiny",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "tools": TOOLS_A,
        **GREEDY,
    }
    plain = _post(s, body).json()
    r = _post(s, {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len(stack.engine.calls[-1].input_ids)
    assert start["id"].startswith("msg_")
    # One tool_use block: start (empty input), input_json_delta(s), stop.
    blocks = [d for n, d in events if n == "content_block_start"]
    assert [b["content_block"]["type"] for b in blocks] == ["tool_use"]
    assert blocks[0]["index"] == 0 and blocks[0]["content_block"]["input"] == {}
    assert blocks[0]["content_block"]["name"] == "get_weather"
    body_events = names[2:-2]
    assert body_events[0] == "content_block_start" and body_events[-1] == "content_block_stop"
    assert set(body_events[1:-1]) == {"content_block_delta"}
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == {"city": "Oslo"} == plain["content"][0]["input"]
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == len(stack.engine.calls[-1].output_ids)


def test_streamed_retry_is_replayed_not_recorded_twice(stack: Stack) -> None:
    s = stack.session()
    client = _client(s)
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "What is the weather in Cairo?"}],
        "tools": TOOLS_A,
        "extra_body": {"temperature": 1.0},  # sampled: a second generation would differ
    }
    with client.messages.stream(**kwargs) as stream:
        first = stream.get_final_message()
    calls = len(stack.engine.calls)
    retry = {"x-stainless-retry-count": "1"}
    with client.messages.stream(**kwargs, extra_headers=retry) as stream:
        again = stream.get_final_message()
    assert again.model_dump() == first.model_dump()
    assert len(stack.engine.calls) == calls  # not sampled again
    assert stack.view(s["id"])["drift"]["turns"] == 1
    # A retry of a non-streamed request is answered from the same memory, in kind.
    plain = client.messages.create(**kwargs)
    replayed = client.messages.create(**kwargs, extra_headers=retry)
    assert replayed.model_dump() == plain.model_dump()  # the id too: the same turn
    assert len(stack.engine.calls) == calls + 1
    assert stack.view(s["id"])["drift"]["turns"] == 2


# -- request fields -------------------------------------------------------------------------------


def test_stop_sequences_and_max_tokens_set_the_stop_reason(stack: Stack) -> None:
    s = stack.session()
    client = _client(s)
    hello = [{"role": "user", "content": "Say hello."}]
    stopped = client.messages.create(
        model="tiny", max_tokens=32, messages=hello, stop_sequences=["!"], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "!"
    assert _text(stopped) == "Hello"
    with client.messages.stream(
        model="tiny", max_tokens=32, messages=hello, stop_sequences=["!"], extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "!")
    cut = client.messages.create(model="tiny", max_tokens=1, messages=hello, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 1
    assert len(stack.engine.calls[-1].output_ids) == 1
    plain = client.messages.create(model="tiny", max_tokens=32, messages=hello, extra_body=GREEDY)
    assert plain.stop_reason == "end_turn" and plain.stop_sequence is None


def test_tool_choice_forces_or_forbids_calls(stack: Stack) -> None:
    s = stack.session()
    client = _client(s)
    weather = [{"role": "user", "content": "What is the weather in Rome?"}]

    def ask(choice: dict[str, Any]) -> tuple[anthropic.types.Message, str]:
        r = client.messages.create(
            model="tiny",
            max_tokens=40,
            messages=weather,
            tools=TOOLS_A,
            tool_choice=choice,
            extra_body=GREEDY,
        )
        return r, stack.tokenizer.decode(stack.engine.calls[-1].input_ids)

    # "any" and a named tool are guaranteed by the engine's grammar, nothing is forced into
    # the prompt: the reply is exactly valid calls of the offered (or the named) tool.
    forced, prompt = ask({"type": "any"})
    assert prompt.endswith("<|im_start|>assistant\n")
    assert stack.engine.calls[-1].sampling is not None and stack.engine.calls[-1].sampling.ebnf
    named, prompt = ask({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert prompt.endswith("<|im_start|>assistant\n")
    for r, names in ((forced, {"get_weather", "add"}), (named, {"get_weather"})):
        uses = [b for b in r.content if b.type == "tool_use"]
        assert uses and {u.name for u in uses} <= names and r.stop_reason == "tool_use"
        assert [b.type for b in r.content] == ["tool_use"] * len(uses)  # no text around
    assert len([b for b in named.content if b.type == "tool_use"]) == 1
    named_use = next(b for b in named.content if b.type == "tool_use")
    assert set(named_use.input) == {"city"}  # type: ignore[arg-type]
    none, _ = ask({"type": "none"})
    assert none.stop_reason == "end_turn"
    assert [b.type for b in none.content] == ["text"] and "<tool_call>" in _text(none)


def test_claude_code_fields_are_accepted_and_change_nothing(stack: Stack) -> None:
    s = stack.session()
    client = _client(s)
    plain = client.messages.create(
        model="tiny",
        max_tokens=32,
        system="You are a helpful assistant.",
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS_A,
        extra_body=GREEDY,
    )
    prompt = stack.engine.calls[-1].input_ids
    assert "You are a helpful assistant." in stack.tokenizer.decode(prompt)
    cached = {"type": "ephemeral"}
    with client.messages.stream(  # streamed, as Claude Code does (and the SDK insists on)
        model="claude-sonnet-4-5",  # any model name: the gateway serves its one model
        max_tokens=32000,  # clamped to the context
        system=[{"type": "text", "text": "You are a helpful assistant.", "cache_control": cached}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Say hello.", "cache_control": cached}],
            }
        ],
        tools=[{**t, "cache_control": cached, "type": "custom"} for t in TOOLS_A],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        thinking={"type": "adaptive"},
        metadata={"user_id": "someone"},
        output_config={"effort": "high"},
        service_tier="auto",
        cache_control=cached,
        extra_body={
            **GREEDY,
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        },
        extra_headers={"anthropic-beta": "context-management-2025-06-27"},
        extra_query={"beta": "true"},
    ) as stream:
        r = stream.get_final_message()
    assert r.stop_reason == "end_turn" and _text(r) == _text(plain) == "Hello!"
    assert r.model == "tiny"
    # The same prompt, token for token: none of those fields reached the template.
    assert stack.engine.calls[-1].input_ids == prompt


def test_count_tokens_is_the_prompt_the_engine_sees(stack: Stack) -> None:
    s = stack.session()
    client = _client(s)
    conversation: dict[str, Any] = {
        "model": "tiny",
        "system": "You are a weather assistant. Use the tools.",
        "messages": [{"role": "user", "content": "What is the weather in Rome?"}],
        "tools": TOOLS_A,
    }
    counted = client.messages.count_tokens(**conversation)
    r = client.messages.create(**conversation, max_tokens=64, extra_body=GREEDY)
    assert counted.input_tokens == r.usage.input_tokens == len(stack.engine.calls[-1].input_ids)
    assert stack.view(s["id"])["drift"]["turns"] == 1  # counting records nothing


def test_count_tokens_needs_no_max_tokens(stack: Stack) -> None:
    s = stack.session()
    counted = _client(s).messages.count_tokens(
        model="tiny", messages=[{"role": "user", "content": "Say hello."}]
    )
    assert counted.input_tokens > 0


def test_side_requests_of_claude_code_are_labelled(stack: Stack) -> None:
    s = stack.session(side_requests="exclude")
    claude_code = _client(s, default_headers=CLAUDE_CODE_AGENT)
    hello = [{"role": "user", "content": "Say hello."}]
    side = claude_code.messages.create(
        model="tiny", max_tokens=32, messages=hello, extra_body=GREEDY
    )
    assert side.stop_reason == "end_turn"
    assert stack.view(s["id"])["drift"]["turns"] == 1  # recorded...
    assert stack.samples(s["id"]) == []  # ...but not a sample of this session
    claude_code.messages.create(
        model="tiny", max_tokens=32, messages=hello, tools=TOOLS_A, extra_body=GREEDY
    )
    samples = stack.samples(s["id"])
    assert len(samples) == 1 and samples[0]["metadata"]["label"] is None
    # Without tools from another client: the agent's own conversation.
    other = stack.session(side_requests="exclude")
    _client(other).messages.create(model="tiny", max_tokens=32, messages=hello, extra_body=GREEDY)
    assert len(stack.samples(other["id"])) == 1


def test_thinking_blocks_come_back_and_stream(tiny_think_model_dir: Path) -> None:
    with (
        serve(build_engine_app(LocalEngine(tiny_think_model_dir))) as engine_url,
        gateway_stack(tiny_think_model_dir, engine_url, reasoning_parser="qwen3") as stack,
    ):
        s = stack.session()
        client = _client(s)
        hello = [{"role": "user", "content": "Say hello."}]
        r = client.messages.create(
            model="tiny", max_tokens=64, messages=hello, thinking={"type": "adaptive"}
        )
        kinds = [b.type for b in r.content]
        assert kinds == ["thinking", "text"]
        thought = r.content[0]
        assert thought.type == "thinking" and thought.thinking
        assert thought.signature == THINKING_SIGNATURE
        assert _text(r) == "Hello!"
        with client.messages.stream(
            model="tiny", max_tokens=64, messages=hello, thinking={"type": "adaptive"}
        ) as stream:
            kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
            streamed = stream.get_final_message()
        assert _blocks(streamed) == _blocks(r)  # the same blocks, the signature included
        assert kinds[-1] == "text_delta" and "signature_delta" in kinds
        assert kinds.index("signature_delta") < kinds.index("text_delta")
        # "disabled" is the template's switch: an empty think block in the prompt.
        client.messages.create(
            model="tiny", max_tokens=64, messages=hello, thinking={"type": "disabled"}
        )
        prompt = stack.tokenizer.decode(stack.engine.calls[-1].input_ids)
        assert prompt.endswith("<think>\n\n</think>\n\n")


# -- bad input ------------------------------------------------------------------------------------


def _error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    for word in words:
        assert word in body["error"]["message"], body


def test_bad_requests_get_anthropics_error_shape(stack: Stack) -> None:
    s = stack.session()
    user = [{"role": "user", "content": "Say hello."}]
    no_max = {"model": "tiny", "messages": user}
    _error(_post(s, no_max), 400, "max_tokens")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    pictured = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
    _error(_post(s, _hello(messages=pictured)), 400, "image", "text model", "messages.0.content.1")
    _error(_post(s, _hello(frequency_penalty=1)), 400, "frequency_penalty")
    _error(_post(s, _hello(mcp_servers=[])), 400, "mcp_servers")
    bad_schema = [{"name": "f", "input_schema": {"type": "object", "properties": 3}}]
    _error(_post(s, _hello(tools=bad_schema)), 400, "tools.0.input_schema")
    _error(_post(s, _hello(tool_choice={"type": "any"})), 400, "tool_choice")
    unknown_tool = _hello(tools=TOOLS_A, tool_choice={"type": "tool", "name": "nope"})
    _error(_post(s, unknown_tool), 400, "nope")
    search = [{"type": "web_search_20250305", "name": "web_search"}]
    _error(_post(s, _hello(tools=search)), 400, "web_search_20250305")
    prefill = [*user, {"role": "assistant", "content": "Hel"}]
    _error(_post(s, _hello(messages=prefill)), 400, "prefill")
    tool_image = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}],
        },
    ]
    _error(_post(s, _hello(messages=tool_image, tools=TOOLS_A)), 400, "image")
    _error(_post(s, _hello(temperature=1.5)), 400, "temperature")
    _error(_post(s, _hello(messages=[{"role": "user", "content": [{"text": "x"}]}])), 400, "type")
    # The SDK reads the shape: its own error class, with the message.
    with pytest.raises(anthropic.BadRequestError, match="document"):
        _client(s).messages.create(
            model="tiny",
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": "x"},
                        }
                    ],
                }
            ],
        )
    assert stack.view(s["id"])["drift"]["turns"] == 0
    assert stack.engine.calls == []


def test_auth_and_route_errors_in_anthropics_shape(stack: Stack) -> None:
    s = stack.session()
    _error(_post(s, _hello(), **{"x-api-key": "wrong"}), 401)
    assert _post(s, _hello(), **{"x-api-key": "wrong"}).json()["error"]["type"] == (
        "authentication_error"
    )
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(
            base_url=s["anthropic_base_url"], api_key="wrong", max_retries=0
        ).messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    r = _post(s, _hello(), path="/v1/messages/batches")
    _error(r, 404)
    assert r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{stack.url}/v1/messages/nope", json={}, headers={"x-api-key": s["api_key"]})
    _error(r, 404)
    other = stack.session()
    r = httpx.post(
        f"{s['anthropic_base_url']}/v1/messages",
        json=_hello(),
        headers={"Authorization": f"Bearer {other['api_key']}"},
    )
    _error(r, 401, "another session")


# -- the dialect on its own: Claude Code's real requests, the stream from events ------------------


def _ctx(headers: dict[str, str] | None = None) -> RequestContext:
    store = SessionStore(max_sessions=1, max_held_tokens=1, default_ttl_s=None)
    return RequestContext(
        session=store.create(SessionOptions()),
        headers=Headers(headers or {}),
        query=QueryParams("beta=true"),
    )


def _fixture(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / name).read_text()))


def _uncached(content: Any) -> Any:
    if isinstance(content, str):
        return content
    return [{k: v for k, v in b.items() if k != "cache_control"} for b in content]


def _claude_code_headers() -> dict[str, str]:
    return dict(_fixture("claude_code_headers.json")["headers"])


def test_claude_codes_requests_parse_into_the_conversation() -> None:
    dialect = AnthropicMessages()
    ctx = _ctx(_claude_code_headers())
    first = dialect.parse(_fixture("claude_code_messages.json"), ctx)
    body = _fixture("claude_code_messages_tool_result.json")
    second = dialect.parse(body, ctx)
    assert second.stream and second.thinking is True and second.label is None
    assert [t.name for t in second.tools][:2] == ["Agent", "Bash"] and len(second.tools) == 12
    assert second.sampling.max_tokens == 32000
    roles = [m.role for m in second.messages]
    assert roles == ["system", "user", "system", "assistant", "tool"]
    assert second.messages[: len(first.messages)] == first.messages  # a prefix: it merges
    system = body["system"]
    assert second.messages[0].content == "\n".join(b["text"] for b in system)
    use = body["messages"][2]["content"][0]
    assert second.messages[3].tool_calls == (
        ToolCall(use["id"], "Bash", json.dumps(use["input"], ensure_ascii=False)),
    )
    assert second.messages[3].content == "" and second.messages[3].reasoning is None
    tool = second.messages[4]
    assert (tool.tool_call_id, tool.content) == (use["id"], "(Bash completed with no output)")
    # Recorded as the template sees it: one entry per message, cache markers gone.
    assert second.sent == [m.template() for m in second.messages]
    assert "cache_control" not in json.dumps(second.sent)
    # Without tools, Claude Code's request is a side request; from another client it is not.
    bare = {k: v for k, v in body.items() if k != "tools"}
    assert dialect.parse(bare, ctx).label == "side"
    assert dialect.parse(bare, _ctx()).label is None


def test_user_turns_split_into_tool_and_user_messages_in_order() -> None:
    dialect = AnthropicMessages()
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {"role": "user", "content": "Weather in Rome and Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two cities.", "signature": "x"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "a", "name": "w", "input": {"city": "Rome"}},
                ],
            },
            # Consecutive assistant messages are one turn.
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "b", "name": "w", "input": {"city": "Oslo"}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "a", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "b",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "no"},
                            {"type": "text", "text": "data"},
                        ],
                    },
                    {"type": "text", "text": "Be brief."},
                ],
            },
            {"role": "user", "content": "Really brief."},
        ],
    }
    turn = dialect.parse(body, _ctx())
    assert [(m.role, m.content, m.tool_call_id) for m in turn.messages] == [
        ("user", "Weather in Rome and Oslo?", None),
        ("assistant", "Checking.", None),
        ("tool", "sunny", "a"),
        ("tool", "no\ndata", "b"),  # is_error is not rendered...
        ("user", "Be brief.\nReally brief.", None),
    ]
    assert turn.sent[3] == {**turn.messages[3].template(), "is_error": True}  # ...but recorded
    assert "is_error" not in turn.sent[2]
    assistant = turn.messages[1]
    assert assistant.reasoning == "Two cities."
    assert [c.id for c in assistant.tool_calls] == ["a", "b"]
    assert assistant.tool_calls[1].arguments == '{"city": "Oslo"}'
    assert turn.label is None and turn.thinking is None


def test_tool_choice_and_thinking_map_to_the_pipelines() -> None:
    dialect = AnthropicMessages()

    def parsed(**fields: Any) -> tuple[Any, bool, bool | None]:
        turn = dialect.parse({**_hello(tools=TOOLS_A), **fields}, _ctx())
        return turn.tool_choice, turn.parallel_tool_calls, turn.thinking

    assert parsed() == ("auto", True, None)
    assert parsed(tool_choice={"type": "any"}) == ("required", True, None)
    named = parsed(tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True})
    assert named == (NamedTool("add"), False, None)
    assert parsed(tool_choice={"type": "none"})[0] == "none"
    assert parsed(thinking={"type": "enabled", "budget_tokens": 2048})[2] is True
    assert parsed(thinking={"type": "adaptive", "display": "omitted"})[2] is True
    assert parsed(thinking={"type": "disabled"})[2] is False
    turn = dialect.parse(_hello(stop_sequences=["x", "y"], top_k=5, top_p=0.5), _ctx())
    assert (turn.sampling.stop, turn.sampling.top_k, turn.sampling.top_p) == (("x", "y"), 5, 0.5)
    assert (turn.sampling.temperature, turn.sampling.max_tokens) == (0, 32)


def test_every_ignored_field_is_accepted() -> None:
    dialect = AnthropicMessages()
    top = [k for k in IGNORED_FIELDS if "." not in k]
    body = {**_hello(), **{k: {} for k in top}}
    assert dialect.parse(body, _ctx()).messages
    with pytest.raises(GatewayError) as err:
        dialect.parse({**_hello(), "bogus": 1}, _ctx())
    assert err.value.status == 400 and "bogus" in err.value.message
    with pytest.raises(GatewayError, match="max_tokens"):
        dialect.parse({k: v for k, v in _hello().items() if k != "max_tokens"}, _ctx())
    counted = dialect.parse_count_tokens(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, _ctx()
    )
    assert counted.sampling.max_tokens is None


def _result(choice: ChoiceResult) -> TurnResult:
    return TurnResult(id="abc", created=1, model="tiny", choices=(choice,), usage=Usage(7, 5))


async def _frame(events: Sequence[Sequence[TurnEvent]], fail: bool = False) -> str:
    async def batches() -> AsyncIterator[Sequence[TurnEvent]]:
        for batch in events:
            yield batch
        if fail:
            raise GatewayError("engine_unavailable", "the engine is unavailable")

    dialect = AnthropicMessages()
    request = dialect.parse(_hello(stream=True), _ctx())
    return "".join([e async for e in dialect.frame(batches(), request, _ctx())])


async def test_blocks_open_and_close_as_the_output_switches() -> None:
    call = ToolCall("call_1", "w", '{"city": "Rome"}')
    choice = ChoiceResult(0, "Hi", "hmm", (call,), Finish("tool_calls"))
    started = TurnStarted(id="abc", created=1, model="tiny", choices=1, prompt_tokens=7)
    logprobs = LogprobsDelta(0, (TokenLogprob("x", -0.1),))
    events: list[list[TurnEvent]] = [
        [started],
        [ThinkingDelta(0, "hm"), logprobs],
        [ThinkingDelta(0, "m")],
        [TextDelta(0, "Hi")],
        [ToolCallStarted(0, 0, "call_1", "w"), ToolCallArguments(0, 0, '{"city": ')],
        [ToolCallArguments(0, 0, '"Rome"}')],
        [ChoiceFinished(0, Finish("tool_calls"))],
        [TurnFinished(_result(choice))],
    ]
    got = _sse(await _frame(events))
    assert [(n, d.get("index"), d.get("delta", {}).get("type")) for n, d in got] == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert got[2][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert got[10][1]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "w",
        "input": {},
    }
    assert got[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[-2][1]["usage"]["output_tokens"] == 5
    # A replay (one event per batch) is the same stream, blocks whole.
    replayed = _sse(await _frame([[e] for e in result_events(_result(choice))]))
    assert [(n, d.get("delta", {}).get("type")) for n, d in replayed] == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", None),
        ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", None),
        ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", None),
        ("content_block_delta", "input_json_delta"),
        ("content_block_stop", None),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert replayed[-2] == got[-2]


async def test_a_failure_mid_stream_is_an_error_event() -> None:
    started = TurnStarted(id="abc", created=1, model="tiny", choices=1, prompt_tokens=7)
    got = _sse(await _frame([[started], [TextDelta(0, "Hel")]], fail=True))
    assert [n for n, _ in got] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert got[-1][1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the engine is unavailable"},
    }


def test_claude_codes_requests_render_and_count(tiny_model_dir: Path) -> None:
    """Claude Code's captured requests go through the whole gateway up to the engine: parsed,
    checked, rendered with the model's template and counted (the tiny model's context is too
    small to run them, so the gateway here claims a larger one and only counts)."""
    settings = GatewaySettings(model_name="tiny", max_context_tokens=200_000, admin_token=ADMIN)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    class NoEngine:
        async def aclose(self) -> None:
            return None

    engine: Any = NoEngine()
    app = build_gateway_app(settings, engine, TurnPipeline(settings, engine, tokenizer))
    with serve(app) as url:
        auth = {"Authorization": f"Bearer {ADMIN}"}
        s = httpx.post(f"{url}/sessions", headers=auth, json={}).json()
        headers = {**_claude_code_headers(), "Authorization": f"Bearer {s['api_key']}"}
        for drop in ("Host", "Content-Type", "Accept-Encoding", "Connection"):
            headers.pop(drop)
        counts = []
        for name in ("claude_code_messages.json", "claude_code_messages_tool_result.json"):
            r = httpx.post(
                f"{url}/v1/messages/count_tokens?beta=true", json=_fixture(name), headers=headers
            )
            assert r.status_code == 200, r.text
            counts.append(r.json()["input_tokens"])
        assert 4096 < counts[0] < counts[1]


def test_a_streamed_retry_replays_the_blocks_in_the_order_they_went_out(
    tiny_model_dir: Path,
) -> None:
    """Text between two calls comes as its own block between the tool_use blocks; the replay of
    a retry must give the same blocks in the same order (the scripted engine plays the text)."""
    from tests.gateway_stack import scripted_gateway

    with scripted_gateway(tiny_model_dir) as stack:
        call = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
        text = f"<tool_call>\n{call}\n</tool_call>\nand then\n<tool_call>\n{call}\n</tool_call>"
        stack.engine.push(stack.ids(text))
        s = stack.session()
        client = anthropic.Anthropic(
            base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0
        )
        kwargs: dict[str, Any] = {
            "model": "tiny",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "tools": TOOLS_A,
        }
        with client.messages.stream(**kwargs) as stream:
            first = stream.get_final_message()
        assert [b.type for b in first.content] == ["tool_use", "text", "tool_use"]
        with client.messages.stream(**kwargs, extra_headers={"x-stainless-retry-count": "1"}) as s2:
            again = s2.get_final_message()
        assert again.model_dump() == first.model_dump()
        assert len(stack.engine.requests) == 1  # replayed, not generated again
