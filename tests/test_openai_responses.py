"""The OpenAI Responses dialect: the official SDKs (``openai`` and the Agents SDK) -> gateway ->
local engine (tiny model), plus the dialect's parse / render / frame on their own.

Real servers on 127.0.0.1 (the ``stack`` fixture of ``tests/conftest.py``); samples are checked
token for token against what the engine saw.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.datastructures import Headers, QueryParams

from corral.engines.local.engine import LocalEngine
from corral.engines.local.server import build_engine_app
from corral.engines.tiny_model import TOOLS
from corral.gateway.dialects.base import RequestContext
from corral.gateway.dialects.openai_responses import (
    DROPPED_TOOLS_KEY,
    ENCRYPTED_PREFIX,
    OpenAIResponses,
)
from corral.gateway.dialects.responses_types import IGNORED_FIELDS, responses_request_fields
from corral.gateway.errors import GatewayError
from corral.gateway.pipeline import TurnPipeline
from corral.gateway.sessions import Session, SessionOptions
from corral.gateway.settings import GatewaySettings
from corral.gateway.turns import (
    ChoiceFinished,
    ChoiceResult,
    Finish,
    JsonOutput,
    NamedTool,
    TextDelta,
    ThinkingDelta,
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
from tests.gateway_stack import Stack, check_exact_sample, gateway_stack
from tests.servers import serve

FIXTURES = Path(__file__).parent / "fixtures" / "agent_requests"

# The tiny model's tools, as Responses function tools.
RESPONSE_TOOLS: list[dict[str, Any]] = [{"type": "function", **t["function"]} for t in TOOLS]
WEATHER = RESPONSE_TOOLS[0]


def _client(s: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)


def _post(s: dict[str, Any], body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(
        f"{s['base_url']}/responses",
        json=body,
        headers={"Authorization": f"Bearer {s['api_key']}", **headers},
        timeout=60,
    )


def _stream(s: dict[str, Any], body: dict[str, Any], **headers: str) -> list[dict[str, Any]]:
    """A streamed request's events as (data) dicts, checking the SSE framing on the way."""
    events = []
    with httpx.stream(
        "POST",
        f"{s['base_url']}/responses",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {s['api_key']}", **headers},
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for frame in r.read().decode().split("\n\n"):
            if not frame.strip():
                continue
            head, data = frame.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert head == f"event: {event['type']}"
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _weather_results(calls: Sequence[Any]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function_call_output",
            "call_id": c.call_id,
            "output": json.dumps({"city": json.loads(c.arguments)["city"], "condition": "sunny"}),
        }
        for c in calls
    ]


def _calls(response: Any) -> list[Any]:
    return [o for o in response.output if o.type == "function_call"]


def _prompt(stack: Stack) -> str:
    return str(stack.tokenizer.decode(stack.engine.calls[-1].input_ids))


# -- the openai SDK drives multi-turn tool conversations ----------------------------------------


def test_create_multi_turn_with_items_passed_back_yields_one_exact_sample(stack: Stack) -> None:
    s = stack.session()
    client = _client(s)
    items: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(
        model="tiny", input=items, tools=RESPONSE_TOOLS, temperature=0, store=False
    )
    assert first.status == "completed" and first.object == "response"
    assert first.id.startswith("resp_") and first.store is False
    calls = _calls(first)
    assert [c.name for c in calls] == ["get_weather"]
    assert list(json.loads(calls[0].arguments)) == ["city"]
    assert calls[0].call_id.startswith("call_") and calls[0].status == "completed"
    assert calls[0].namespace is None
    engine = stack.engine.calls[-1]
    assert first.usage is not None
    assert first.usage.input_tokens == len(engine.input_ids)
    assert first.usage.output_tokens == len(engine.output_ids)
    assert first.usage.total_tokens == len(engine.input_ids) + len(engine.output_ids)

    items += [o.model_dump(exclude_none=True) for o in first.output]
    items += _weather_results(calls)
    second = client.responses.create(
        model="tiny", input=items, tools=RESPONSE_TOOLS, temperature=0, store=False
    )
    assert second.status == "completed"
    assert [o.type for o in second.output] == ["message"]
    assert second.output_text.strip()
    assert second.output[0].content[0].annotations == []  # type: ignore[union-attr]

    items += [o.model_dump(exclude_none=True) for o in second.output]
    items.append({"role": "user", "content": "Say hello."})
    third = client.responses.create(
        model="tiny", input=items, tools=RESPONSE_TOOLS, temperature=0, store=False
    )
    assert third.output_text

    sample = check_exact_sample(stack, s["id"], turns=3)
    assert sample["status"] == "completed"
    view = stack.view(s["id"])
    assert view["drift"]["forks"] == 0 and view["drift"]["merges"] == 2
    # the recorded conversation is the template's, one entry per message
    roles = [m["role"] for t in view["turns"] for m in t["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant", "user"]


def test_stream_with_previous_response_id_yields_one_exact_sample(stack: Stack) -> None:
    s = stack.session()
    client = _client(s)
    with client.responses.stream(
        model="tiny",
        input="What is the weather in Tokyo?",
        tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
        temperature=0,
    ) as stream:
        events = list(stream)
        first = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert first.store is True
    calls = _calls(first)
    assert [c.name for c in calls] == ["get_weather"]
    streamed = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert streamed == calls[0].arguments
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.id for e in done] == [o.id for o in first.output]  # type: ignore[union-attr]

    # the stored response carries the conversation: only the tool result is sent
    with client.responses.stream(
        model="tiny",
        previous_response_id=first.id,
        input=_weather_results(calls),  # type: ignore[arg-type]
        tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
        temperature=0,
    ) as stream:
        events = list(stream)
        second = stream.get_final_response()
    assert second.previous_response_id == first.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == second.output_text and text.strip()
    assert sum(e.type == "response.output_text.delta" for e in events) >= 2  # really streamed

    third = client.responses.create(
        model="tiny",
        previous_response_id=second.id,
        input="Say hello.",
        tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
        temperature=0,
    )
    assert third.output_text
    check_exact_sample(stack, s["id"], turns=3)
    prompt = _prompt(stack)
    assert prompt.count("What is the weather in Tokyo?") == 1
    assert "<tool_response>" in prompt and prompt.rstrip().endswith("assistant")


def test_instructions_are_not_carried_over_by_previous_response_id(stack: Stack) -> None:
    s = stack.session()
    client = _client(s)
    first = client.responses.create(
        model="tiny", input="Say hello.", instructions="Be brief.", temperature=0
    )
    assert first.instructions == "Be brief."
    assert _prompt(stack).startswith("<|im_start|>system\nBe brief.")
    client.responses.create(
        model="tiny", input="Say hello.", previous_response_id=first.id, temperature=0
    )
    prompt = _prompt(stack)
    assert "Be brief." not in prompt and prompt.count("Say hello.") == 2


def test_bearer_routed_endpoint(stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=s["api_key"], max_retries=0)
    r = client.responses.create(model="tiny", input="Say hello.", temperature=0)
    assert r.model == "tiny" and r.output_text
    assert len(stack.samples(s["id"])) == 1


# -- the OpenAI Agents SDK ------------------------------------------------------------------------


def _weather_agent(s: dict[str, Any], seen: list[str]) -> Any:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city name.
        """
        seen.append(city)
        return json.dumps({"city": city, "condition": "sunny"})

    client = openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    return Agent(
        name="weather",
        tools=[get_weather],
        model=OpenAIResponsesModel(model="tiny", openai_client=client),
        model_settings=ModelSettings(temperature=0),
    )


async def test_agents_sdk_runs_a_tool_turn_to_a_final_output(stack: Stack) -> None:
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no network: traces would go to OpenAI
    s = stack.session()
    seen: list[str] = []
    result = await Runner.run(_weather_agent(s, seen), "What is the weather in Paris?")
    assert len(seen) == 1  # the model called the tool, the SDK ran it
    assert isinstance(result.final_output, str) and result.final_output.strip()
    check_exact_sample(stack, s["id"], turns=2)


async def test_agents_sdk_streamed_run(stack: Stack) -> None:
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)
    s = stack.session()
    seen: list[str] = []
    run = Runner.run_streamed(_weather_agent(s, seen), "What is the weather in Oslo?")
    kinds = [event.type async for event in run.stream_events()]
    assert "raw_response_event" in kinds
    assert len(seen) == 1
    assert isinstance(run.final_output, str) and run.final_output.strip()
    check_exact_sample(stack, s["id"], turns=2)


# -- tools ----------------------------------------------------------------------------------------


def test_hosted_tools_are_dropped_and_reported(stack: Stack) -> None:
    s = stack.session()
    tools = [
        WEATHER,
        {"type": "web_search"},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "custom", "name": "apply_patch"},
    ]
    r = _client(s).responses.create(
        model="tiny",
        input="What is the weather in Lima?",
        tools=tools,  # type: ignore[arg-type]
        metadata={"task": "t1"},
        temperature=0,
    )
    assert r.metadata == {
        "task": "t1",
        DROPPED_TOOLS_KEY: "web_search,file_search,custom:apply_patch",
    }
    assert [t.type for t in r.tools] == ["function", "web_search", "file_search", "custom"]
    prompt = _prompt(stack)
    assert '"name": "get_weather"' in prompt
    assert (
        "web_search" not in prompt and "file_search" not in prompt and "apply_patch" not in prompt
    )
    assert [c.name for c in _calls(r)] == ["get_weather"]


def test_namespace_tools_are_flattened_for_the_model(stack: Stack) -> None:
    s = stack.session()
    namespace = {
        "type": "namespace",
        "name": "weather",
        "description": "Weather tools.",
        "tools": [WEATHER],
    }
    r = _post(
        s,
        {
            "model": "tiny",
            "tools": [namespace],
            "input": [
                {"role": "user", "content": "What is the weather in Rome?"},
                {
                    "type": "function_call",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "namespace": "weather",
                    "arguments": '{"city": "Rome"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            ],
            "max_output_tokens": 30,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    prompt = _prompt(stack)
    # the model sees (and saw itself call) the flattened name, in the tool list and the history
    assert '"function": {"name": "weather.get_weather"' in prompt
    assert '<tool_call>\n{"name": "weather.get_weather", "arguments": {"city": "Rome"}}' in prompt


def test_tool_choice_named_and_required_force_a_call(stack: Stack) -> None:
    """Forced calls are guaranteed by the engine's grammar (``ebnf``), not by a prompt prefix:
    even where the model would answer in prose, the reply is exactly a valid call."""
    s = stack.session()
    client = _client(s)
    named = client.responses.create(
        model="tiny",
        input="Say hello.",
        tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    assert _prompt(stack).endswith("<|im_start|>assistant\n")  # nothing forced into the prompt
    assert stack.engine.calls[-1].sampling is not None and stack.engine.calls[-1].sampling.ebnf
    calls = [item for item in named.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert isinstance(json.loads(calls[0].arguments)["city"], str)  # type: ignore[union-attr]
    required = client.responses.create(
        model="tiny",
        input="Say hello.",
        tools=RESPONSE_TOOLS,  # type: ignore[arg-type]
        tool_choice={
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "add"}],
        },
        max_output_tokens=60,
        temperature=0,
    )
    assert '"name": "add"' in _prompt(stack) and '"name": "get_weather"' not in _prompt(stack)
    calls = [item for item in required.output if item.type == "function_call"]
    assert calls and {c.name for c in calls} == {"add"}  # type: ignore[union-attr]
    for c in calls:
        args = json.loads(c.arguments)  # type: ignore[union-attr]
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


# -- fields ---------------------------------------------------------------------------------------


def test_length_limit_is_incomplete(stack: Stack) -> None:
    s = stack.session()
    r = _client(s).responses.create(
        model="tiny", input="What is the weather in Cairo?", max_output_tokens=2, temperature=0
    )
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.max_output_tokens == 2
    assert len(stack.engine.calls[-1].output_ids) == 2
    events = _stream(s, {"input": "What is the weather in Cairo?", "max_output_tokens": 2})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "incomplete"
    assert {e["item"]["status"] for e in events if e["type"] == "response.output_item.done"} == {
        "incomplete"
    }


def test_logprobs_are_the_engines(stack: Stack) -> None:
    s = stack.session()
    body = {
        "input": "Say hello.",
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    r = _client(s).responses.create(model="tiny", **body)  # type: ignore[call-overload]
    logprobs = r.output[0].content[0].logprobs  # type: ignore[union-attr]
    engine = stack.engine.calls[-1]
    # every generated token but the closing <|im_end|>
    assert [t.logprob for t in logprobs] == pytest.approx(engine.logprobs[:-1], abs=1e-6)
    assert "".join(t.token for t in logprobs) == r.output_text
    assert all(len(t.top_logprobs) == 2 for t in logprobs)

    events = _stream(s, body)
    engine = stack.engine.calls[-1]
    deltas = [t for e in events if e["type"] == "response.output_text.delta" for t in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [t["logprob"] for t in deltas] == pytest.approx(engine.logprobs[:-1], abs=1e-6)
    assert [t["logprob"] for t in done["logprobs"]] == [t["logprob"] for t in deltas]


def test_reasoning_items_stream_and_round_trip(tiny_think_model_dir: Path) -> None:
    with (
        serve(build_engine_app(LocalEngine(tiny_think_model_dir))) as think_url,
        gateway_stack(tiny_think_model_dir, think_url, reasoning_parser="qwen3") as think,
    ):
        s = think.session()
        client = _client(s)
        body: dict[str, Any] = {
            "model": "tiny",
            "input": "Say hello.",
            "reasoning": {"effort": "low", "summary": "auto"},
            "include": ["reasoning.encrypted_content"],
            "temperature": 0,
        }
        r = client.responses.create(**body)
        assert [o.type for o in r.output] == ["reasoning", "message"]
        reasoning = r.output[0]
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
        thought = reasoning.content[0].text  # type: ignore[index]
        assert thought.strip() and "<think>" not in thought
        assert [p.text for p in reasoning.summary] == [thought]
        assert (
            reasoning.encrypted_content
            == ENCRYPTED_PREFIX + base64.b64encode(thought.encode()).decode()
        )
        assert r.reasoning is not None and r.reasoning.summary == "auto"

        events = _stream(s, body)
        summary = "".join(
            e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta"
        )
        raw = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        final = events[-1]["response"]
        assert summary == raw == final["output"][0]["content"][0]["text"] == thought
        types = [e["type"] for e in events]
        assert types.index("response.reasoning_summary_part.done") < types.index(
            "response.output_text.done"
        )

        # a stateless client sends back only the opaque value: the exact reasoning is rendered
        # again (the qwen3 template then drops it from history: a fork, by design)
        item = reasoning.model_dump(exclude_none=True)
        item.pop("content")
        item["summary"] = []
        back = [item, r.output[1].model_dump(exclude_none=True)]
        hello = {"role": "user", "content": "Say hello."}
        again = client.responses.create(**{**body, "input": [hello, *back, hello]})
        assert again.status == "completed"
        sent = think.view(s["id"])["turns"][-1]["messages"]
        assistant = [m for m in sent if m["role"] == "assistant"]
        assert [m.get("reasoning_content") for m in assistant] == [thought]


# -- retries --------------------------------------------------------------------------------------


def test_streamed_retry_is_replayed_not_recorded_twice(stack: Stack) -> None:
    s = stack.session()
    body = {"model": "tiny", "input": "What is the weather in Quito?", "tools": RESPONSE_TOOLS}
    first = _stream(s, body)
    calls = len(stack.engine.calls)
    retry = _stream(s, body, **{"x-stainless-retry-count": "1"})
    assert len(stack.engine.calls) == calls  # not sampled again
    assert retry[-1]["type"] == first[-1]["type"] == "response.completed"
    assert retry[-1]["response"] == first[-1]["response"]
    assert retry[0]["response"]["id"] == first[0]["response"]["id"]
    done = [e["item"] for e in retry if e["type"] == "response.output_item.done"]
    assert done == first[-1]["response"]["output"]
    assert stack.view(s["id"])["drift"]["turns"] == 1
    # the replay kept the same stored response: it can be continued
    r = _post(
        s,
        {
            "previous_response_id": first[-1]["response"]["id"],
            # Sampled (temperature 1): the first answer may be a call or text; a user message
            # continues either.
            "input": [{"type": "message", "role": "user", "content": "Say hello."}],
            "tools": RESPONSE_TOOLS,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text


def test_plain_retry_is_replayed(stack: Stack) -> None:
    s = stack.session()
    body = {"model": "tiny", "input": "Say hello.", "temperature": 1.0, "max_output_tokens": 12}
    first = _post(s, body)
    calls = len(stack.engine.calls)
    retry = _post(s, body, **{"x-stainless-retry-count": "1"})
    assert retry.status_code == 200 and retry.json() == first.json()
    assert len(stack.engine.calls) == calls
    assert stack.view(s["id"])["drift"]["turns"] == 1


# -- bad input ---------------------------------------------------------------------------------


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return dict(error)


def test_bad_requests_are_openai_shaped_400s(stack: Stack) -> None:
    s = stack.session()
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    e = _error(
        _post(
            s,
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, image]}]},
        )
    )
    assert e["param"] == "input[0].content[1]" and "input_image" in e["message"]
    e = _error(_post(s, {"input": "hi", "background": True}))
    assert e["param"] == "background"
    e = _error(_post(s, {"input": "hi", "bogus": 1, "extra": 2}))
    assert e["param"] == "bogus" and e["code"] == "unsupported_field"
    assert "'bogus', 'extra'" in e["message"]
    bad_schema = {"type": "function", "name": "f", "parameters": {"type": "objekt"}}
    e = _error(_post(s, {"input": "hi", "tools": [bad_schema]}))
    assert e["param"] == "tools[0].parameters" and e["code"] == "invalid_schema"
    e = _error(_post(s, {"input": "hi", "previous_response_id": "resp_nope"}))
    assert e["param"] == "previous_response_id" and e["code"] == "previous_response_not_found"
    e = _error(_post(s, {"input": "hi", "conversation": "conv_1"}))
    assert e["param"] == "conversation"
    e = _error(_post(s, {"input": "hi", "prompt": {"id": "pmpt_1"}}))
    assert e["param"] == "prompt"
    e = _error(_post(s, {"input": [{"type": "item_reference", "id": "msg_1"}]}))
    assert e["param"] == "input[0]" and "item_reference" in e["message"]
    e = _error(_post(s, {"input": [{"type": "web_search_call", "id": "ws_1"}]}))
    assert e["param"] == "input[0]"
    e = _error(_post(s, {"input": "hi", "tool_choice": {"type": "web_search_preview"}}))
    assert e["param"] == "tool_choice"
    e = _error(
        _post(s, {"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "required"})
    )
    assert "web_search" in e["message"]
    e = _error(_post(s, {"input": [{"role": "robot", "content": "hi"}]}))
    assert e["param"] == "input[0].role"
    e = _error(_post(s, {"input": "hi", "tools": [WEATHER, WEATHER]}))
    assert e["param"] == "tools[1]"
    e = _error(_post(s, {"input": "hi", "temperature": 5}))
    assert e["param"] == "temperature"
    assert stack.view(s["id"])["drift"]["turns"] == 0


def test_previous_response_made_with_store_false_is_a_400_that_says_why(stack: Stack) -> None:
    s = stack.session()
    first = _client(s).responses.create(model="tiny", input="Say hello.", store=False)
    e = _error(_post(s, {"input": "Say hello.", "previous_response_id": first.id}))
    assert e["param"] == "previous_response_id" and "store: false" in e["message"]
    with pytest.raises(openai.BadRequestError) as err:
        _client(s).responses.create(model="tiny", input="x", previous_response_id="resp_x")
    assert err.value.code == "previous_response_not_found"
    assert stack.view(s["id"])["drift"]["turns"] == 1


def test_errors_use_the_session_key_and_dialect_shape(stack: Stack) -> None:
    s = stack.session()
    r = httpx.post(f"{s['base_url']}/responses", json={"input": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# -- the dialect on its own ----------------------------------------------------------------------


def _ctx() -> RequestContext:
    session = Session("s1", SessionOptions(), ttl_s=None, clock=time.monotonic)
    return RequestContext(session=session, headers=Headers({}), query=QueryParams(""))


def test_codex_requests_parse_and_render(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    dialect = OpenAIResponses()
    settings = GatewaySettings(model_name="tiny", max_context_tokens=1_000_000)
    pipeline = TurnPipeline(settings, None, AutoTokenizer.from_pretrained(str(tiny_model_dir)))  # type: ignore[arg-type]
    ctx = _ctx()
    for name, roles in [
        ("codex_responses.json", ["system", "system", "user", "user"]),
        (
            "codex_responses_tool_output.json",
            ["system", "system", "user", "user", "assistant", "tool"],
        ),
    ]:
        body = json.loads((FIXTURES / name).read_text())
        request = dialect.parse(body, ctx)
        assert [m.role for m in request.messages] == roles
        names = [t.name for t in request.tools]
        assert "exec_command" in names and "multi_agent_v1.spawn_agent" in names
        assert request.stream and request.wire.store is False
        assert request.wire.echo["metadata"] == {DROPPED_TOOLS_KEY: "web_search"}
        assert request.wire.summary and request.wire.encrypted
        assert [m.template() for m in request.messages] == request.sent
        prepared = pipeline.render(ctx.session, request)
        text = pipeline.tokenizer.decode(prepared.prompt_ids)
        assert '"name": "multi_agent_v1.spawn_agent"' in text
        if roles[-1] == "tool":
            call = request.messages[-2].tool_calls[0]
            assert call.name == "exec_command" and call.id.startswith("call_")
            assert "<tool_response>\nChunk ID" in text


def test_ignored_fields_are_real_request_fields() -> None:
    known = responses_request_fields()
    top = {f for f in IGNORED_FIELDS if "." not in f}
    assert top - known == {"client_metadata"}  # Codex's own
    for dotted in IGNORED_FIELDS.keys() - top:
        assert dotted.split(".")[0] in known


def test_input_items_become_template_messages() -> None:
    dialect = OpenAIResponses()
    thought = ENCRYPTED_PREFIX + base64.b64encode(b"I should check.").decode()
    request = dialect.parse(
        {
            "instructions": "Be brief.",
            "tools": [WEATHER],
            "input": [
                {"role": "developer", "content": "Use tools."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "A"}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": thought},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": "{}",
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "get_weather",
                    "arguments": "{}",
                },
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_text", "text": "sun"}],
                },
                {"type": "function_call_output", "call_id": "c2", "output": "rain"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Done."}]},
                {
                    "type": "function_call",
                    "call_id": "c3",
                    "name": "get_weather",
                    "arguments": "{}",
                },
            ],
        },
        _ctx(),
    )
    m = request.messages
    assert [(x.role, x.content) for x in m] == [
        ("system", "Be brief."),
        ("system", "Use tools."),
        ("user", "A"),
        ("assistant", "Looking."),
        ("tool", "sun"),
        ("tool", "rain"),
        ("assistant", ""),
    ]
    assert m[3].reasoning == "I should check." and [c.id for c in m[3].tool_calls] == ["c1", "c2"]
    assert m[4].tool_call_id == "c1"
    assert m[6].reasoning == "Done." and [c.id for c in m[6].tool_calls] == ["c3"]


def test_request_fields_map_onto_the_turn() -> None:
    dialect = OpenAIResponses()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = dialect.parse(
        {
            "input": "hi",
            "tools": RESPONSE_TOOLS,
            "tool_choice": {"type": "function", "name": "add"},
            "parallel_tool_calls": False,
            "temperature": 0.5,
            "top_p": 0.9,
            "max_output_tokens": 7,
            "reasoning": {"effort": "none"},
            "text": {
                "format": {"type": "json_schema", "name": "x", "schema": schema},
                "verbosity": "low",
            },
            "truncation": "auto",
            "prompt_cache_key": "k",
            "client_metadata": {"a": "b"},
            "service_tier": "auto",
            "safety_identifier": "u",
            "store": False,
        },
        _ctx(),
    )
    assert request.tool_choice == NamedTool("add")
    assert request.parallel_tool_calls is False
    assert (request.sampling.temperature, request.sampling.top_p) == (0.5, 0.9)
    assert request.sampling.max_tokens == 7
    assert request.thinking is False
    assert request.output == JsonOutput(schema, param="text.format")
    assert request.messages[0].role == "user" and not request.stream


def _result(
    *,
    content: str | None,
    calls: tuple[ToolCall, ...] = (),
    reasoning: str | None = None,
    finish: str = "stop",
) -> TurnResult:
    choice = ChoiceResult(
        index=0,
        content=content,
        reasoning=reasoning,
        tool_calls=calls,
        finish=Finish("tool_calls" if calls else finish),  # type: ignore[arg-type]
    )
    return TurnResult(id="t1", created=1, model="tiny", choices=(choice,), usage=Usage(5, 3))


async def _frame(
    dialect: OpenAIResponses,
    events: Sequence[TurnEvent],
    request: Any,
    ctx: RequestContext,
    error: GatewayError | None = None,
) -> list[dict[str, Any]]:
    async def batches() -> AsyncIterator[Sequence[TurnEvent]]:
        for event in events:
            yield [event]
        if error is not None:
            raise error

    out = []
    async for chunk in dialect.frame(batches(), request, ctx):
        head, data = chunk.strip().split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {out[-1]['type']}"
    return out


NAMESPACED = {"type": "namespace", "name": "weather", "description": "W.", "tools": [WEATHER]}


async def test_a_call_of_a_flattened_name_is_answered_with_its_namespace() -> None:
    dialect, ctx = OpenAIResponses(), _ctx()
    request = dialect.parse({"input": "hi", "tools": [NAMESPACED]}, ctx)
    assert [t.name for t in request.tools] == ["weather.get_weather"]
    call = ToolCall(id="call_abc", name="weather.get_weather", arguments='{"city": "Rome"}')
    result = _result(content=None, calls=(call,))
    body = json.loads(dialect.render(result, request, ctx))
    item = body["output"][0]
    assert item == {
        "type": "function_call",
        "id": "fc_abc",
        "call_id": "call_abc",
        "name": "get_weather",
        "namespace": "weather",
        "arguments": '{"city": "Rome"}',
        "status": "completed",
    }
    streamed = await _frame(dialect, result_events(result), request, ctx)
    added = next(e for e in streamed if e["type"] == "response.output_item.added")
    assert (added["item"]["name"], added["item"]["namespace"]) == ("get_weather", "weather")
    assert streamed[-1]["response"]["output"] == body["output"]
    # sent back, the call renders under its flattened name again; a stored response continued
    # by previous_response_id gives the same conversation as the items passed back
    output = {"type": "function_call_output", "call_id": "call_abc", "output": "sunny"}
    items = {"input": [{"role": "user", "content": "hi"}, *body["output"], output]}
    chained = {"input": [output], "previous_response_id": body["id"]}
    for fields in (items, chained):
        back = dialect.parse({**fields, "tools": [NAMESPACED]}, ctx)
        assert [m.role for m in back.messages] == ["user", "assistant", "tool"]
        assert back.messages[1].tool_calls == (call,)


async def test_stream_and_render_agree(tmp_path: Path) -> None:
    dialect, ctx = OpenAIResponses(), _ctx()
    request = dialect.parse(
        {"input": "hi", "tools": [WEATHER], "reasoning": {"summary": "detailed"}, "stream": True},
        ctx,
    )
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Rome"}')
    result = _result(content="Checking.", calls=(call,), reasoning="Think.")
    body = json.loads(dialect.render(result, request, ctx))
    assert [o["type"] for o in body["output"]] == ["reasoning", "message", "function_call"]
    live: list[TurnEvent] = [
        TurnStarted(id="t1", created=1, model="tiny", choices=1, prompt_tokens=5),
        ThinkingDelta(0, "Thi"),
        ThinkingDelta(0, "nk."),
        TextDelta(0, "Check"),
        TextDelta(0, "ing."),
        ToolCallStarted(0, 0, "call_1", "get_weather"),
        ToolCallArguments(0, 0, '{"city": '),
        ToolCallArguments(0, 0, '"Rome"}'),
        ChoiceFinished(0, Finish("tool_calls")),
        TurnFinished(result),
    ]
    events = await _frame(dialect, live, request, ctx)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"] == body
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )


async def test_a_failure_mid_stream_is_response_failed() -> None:
    dialect, ctx = OpenAIResponses(), _ctx()
    request = dialect.parse({"input": "hi", "stream": True}, ctx)
    started = TurnStarted(id="t2", created=1, model="tiny", choices=1, prompt_tokens=5)
    failure = GatewayError("engine_unavailable", "the engine is unavailable")
    events = await _frame(dialect, [started, TextDelta(0, "Hel")], request, ctx, failure)
    last = events[-1]
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed" and last["response"]["id"] == "resp_t2"
    assert last["response"]["error"]["message"] == "the engine is unavailable"
    assert last["response"]["error"]["code"] == "server_error"
    assert [o["status"] for o in last["response"]["output"]] == ["incomplete"]
    assert last["response"]["output"][0]["content"][0]["text"] == "Hel"
    # before the response exists: an error event
    events = await _frame(dialect, [], request, ctx, failure)
    assert events == [
        {
            "type": "error",
            "sequence_number": 0,
            "code": "server_error",
            "message": "the engine is unavailable",
            "param": None,
        }
    ]
