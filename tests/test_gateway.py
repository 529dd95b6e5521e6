"""The gateway end to end: the official OpenAI SDK -> gateway -> local engine (tiny model).

Real servers on 127.0.0.1. The engine client is wrapped (``RecordingEngine``) to capture what
the gateway sent to the engine and what the engine answered, so samples can be checked
token for token against the engine's side.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from corral.engines.local.engine import LocalEngine
from corral.engines.local.server import build_engine_app
from corral.engines.tiny_model import TOOLS
from tests.gateway_stack import AUTH, Stack, check_exact_sample, gateway_stack
from tests.servers import free_port, serve


def _assistant_message(message: Any) -> dict[str, Any]:
    return dict(message.model_dump(exclude_none=True))


def _tool_results(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": json.dumps(
                # One of the result formats the tiny model was imprinted on.
                {
                    "city": json.loads(call["function"]["arguments"])["city"],
                    "weather": "sunny",
                    "temp_c": 21,
                }
            ),
        }
        for call in message["tool_calls"]
    ]


# -- the SDK drives multi-turn tool-calling conversations -------------------------------------


def test_sync_sdk_multi_turn_tool_calls_yield_one_exact_sample(stack: Stack) -> None:
    s = stack.session(metadata={"task": "weather"})
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris and Tokyo?"}
    ]
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]  # type: ignore[union-attr]
    assert [json.loads(c.function.arguments) for c in calls] == [  # type: ignore[union-attr]
        {"city": "Paris"},
        {"city": "Tokyo"},
    ]
    assert len({c.id for c in calls}) == 2
    assert first.usage is not None and first.usage.prompt_tokens == len(
        stack.engine.calls[-1].input_ids
    )

    messages.append(_assistant_message(choice.message))
    messages += _tool_results(messages[-1])
    second = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        temperature=0,  # type: ignore[arg-type]
    )
    assert second.choices[0].finish_reason == "stop"
    answer = second.choices[0].message.content or ""
    # A plain sentence (which cities it names is the tiny model's quality, not the gateway's).
    assert answer.startswith("I have checked the weather in")
    assert not second.choices[0].message.tool_calls
    messages.append(_assistant_message(second.choices[0].message))
    messages.append({"role": "user", "content": "Say hello."})
    third = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0
    )  # type: ignore[arg-type]
    assert third.choices[0].message.content == "Hello!"

    sample = check_exact_sample(stack, s["id"], turns=3)
    assert sample["status"] == "completed"
    assert sample["rollout_id"] == s["id"]
    assert sample["metadata"]["task"] == "weather"
    view = stack.view(s["id"])
    assert view["drift"]["forks"] == 0 and view["drift"]["merges"] == 2


async def test_async_sdk_streaming_multi_turn_yields_one_exact_sample(stack: Stack) -> None:
    s = stack.session()
    client = openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Lima?"}]
    for turn in range(2):
        content = ""
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        chunks = 0
        usage = None
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                content += c.delta.content or ""
                finish = c.finish_reason or finish
                for tc in c.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    slot["name"] += (tc.function.name or "") if tc.function else ""
                    slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        assert chunks >= 3  # role, content/tool deltas, finish: really streamed
        assert usage is not None and usage.completion_tokens == len(
            stack.engine.calls[-1].output_ids
        )
        if turn == 0:
            assert finish == "tool_calls"
            assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
                ("get_weather", {"city": "Lima"})
            ]
            assistant = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls.values()
                ],
            }
            messages.append(assistant)
            messages += _tool_results(assistant)
        else:
            assert finish == "stop"
            assert "Lima" in content
    await client.close()
    check_exact_sample(stack, s["id"], turns=2)


def test_streamed_and_plain_answers_agree(stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    plain = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0
    )  # type: ignore[arg-type]
    args = ""
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    ):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                args += tc.function.arguments or "" if tc.function else ""
    assert plain.choices[0].message.tool_calls[0].function.arguments == args  # type: ignore[index,union-attr]


def test_think_template_drift_is_explained(tiny_think_model_dir: Path) -> None:
    with (
        serve(build_engine_app(LocalEngine(tiny_think_model_dir))) as engine_url,
        gateway_stack(tiny_think_model_dir, engine_url, reasoning_parser="qwen3") as stack,
    ):
        # Template history: the whole conversation is rendered each turn (token history, the
        # default, keeps the think block: tests/test_token_history.py).
        s = stack.session(history="template")
        client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hello."}]
        first = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
        reply = first.choices[0].message
        assert reply.content == "Hello!"
        assert reply.reasoning_content  # type: ignore[attr-defined]
        messages.append(_assistant_message(reply))
        messages.append({"role": "user", "content": "Say hello."})
        client.chat.completions.create(model="tiny", messages=messages, temperature=0)

        samples = stack.samples(s["id"])
        assert len(samples) == 2  # the template dropped turn 1's <think>: a fork
        drift = stack.view(s["id"])["drift"]
        assert drift["forks"] == 1
        event = drift["events"][0]
        assert event["reason"] == "diverged"
        assert event["message_role"] == "assistant" and event["message_index"] == 1
        assert "<think>" in event["held_text"] and "<think>" not in event["new_text"][:7]
        assert "assistant" in event["explanation"]


# -- request fields -----------------------------------------------------------------------------


def test_n_choices_are_recorded_as_one_group(stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello."}],
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=8,
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage is not None
    assert r.usage.completion_tokens == sum(len(c.output_ids) for c in stack.engine.calls[-3:])
    samples = stack.samples(s["id"])
    assert len(samples) == 3
    assert stack.view(s["id"])["drift"]["by_reason"].get("sibling_choice") == 2


def test_logprobs_are_the_engines(stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    engine = stack.engine.calls[-1]
    # every generated token but the closing <|im_end|>
    assert [t.logprob for t in content] == pytest.approx(engine.logprobs[:-1], abs=1e-6)  # type: ignore[union-attr]
    assert "".join(t.token for t in content) == "Hello!"  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 2 for t in content)  # type: ignore[union-attr]


def test_tool_choice_none_required_and_named(stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    weather = [{"role": "user", "content": "What is the weather in Rome?"}]
    none = client.chat.completions.create(
        model="tiny", messages=weather, tools=TOOLS, tool_choice="none", temperature=0
    )  # type: ignore[arg-type]
    assert none.choices[0].message.tool_calls is None
    assert "<tool_call>" in (none.choices[0].message.content or "")

    # Forced calls are guaranteed by the engine's grammar, not a prompt prefix: even where the
    # model would say hello, the reply is exactly one valid call of the named tool.
    hello = [{"role": "user", "content": "Say hello."}]
    for stream in (False, True):
        named = client.chat.completions.create(
            model="tiny",
            messages=hello,
            tools=TOOLS,
            temperature=0,
            max_tokens=60,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=stream,
        )  # type: ignore[call-overload]
        prompt = stack.tokenizer.decode(stack.engine.calls[-1].input_ids)
        assert prompt.endswith("<|im_start|>assistant\n")
        if stream:
            chunks = list(named)
            name = "".join(
                t.function.name or ""
                for c in chunks
                for ch in c.choices
                for t in ch.delta.tool_calls or []
            )
            finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
            assert name == "get_weather" and finish == ["tool_calls"]
        else:
            msg = named.choices[0].message
            assert msg.content is None and msg.tool_calls and len(msg.tool_calls) == 1
            assert msg.tool_calls[0].function.name == "get_weather"
            assert isinstance(json.loads(msg.tool_calls[0].function.arguments)["city"], str)
    required = client.chat.completions.create(
        model="tiny", messages=weather, tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice="required",
    )  # type: ignore[call-overload]  # fmt: skip
    calls = required.choices[0].message.tool_calls or []
    assert calls and all(c.function.name in {"get_weather", "add"} for c in calls)  # type: ignore[union-attr]


def test_max_tokens_is_clamped_and_context_limit_is_a_400(stack: Stack) -> None:
    s = stack.session(max_context_tokens=60)
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=10_000,
        temperature=0,
    )
    sent = stack.engine.calls[-1]
    assert len(sent.input_ids) + len(sent.output_ids) <= 60
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * 200}]
        )
    assert err.value.code == "context_length_exceeded"


def test_session_sampling_overrides_win(stack: Stack) -> None:
    s = stack.session(sampling={"temperature": 0.0, "max_tokens": 3})
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=1.5,
        max_tokens=50,
    )
    assert r.choices[0].finish_reason == "length"
    assert len(stack.engine.calls[-1].output_ids) == 3


def test_sdk_retry_replays_the_recorded_answer(stack: Stack) -> None:
    s = stack.session()
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say hello."}],
        "temperature": 1.0,
        "max_tokens": 12,
    }
    headers = {"Authorization": f"Bearer {s['api_key']}"}
    first = httpx.post(f"{s['base_url']}/chat/completions", json=body, headers=headers)
    calls = len(stack.engine.calls)
    retry = httpx.post(
        f"{s['base_url']}/chat/completions",
        json=body,
        headers={**headers, "x-stainless-retry-count": "1"},
    )
    assert retry.status_code == 200
    assert retry.json() == first.json()
    assert len(stack.engine.calls) == calls  # not sampled again
    assert stack.view(s["id"])["drift"]["turns"] == 1


def test_bearer_routed_endpoint_and_models(stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=s["api_key"], max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hello."}], temperature=0
    )
    assert len(stack.samples(s["id"])) == 1


# -- bad input and failures ----------------------------------------------------------------------


def _post_chat(s: dict[str, Any], content: bytes | str, **headers: str) -> httpx.Response:
    return httpx.post(
        f"{s['base_url']}/chat/completions",
        content=content,
        headers={
            "Authorization": f"Bearer {s['api_key']}",
            "content-type": "application/json",
            **headers,
        },
    )


def test_malformed_and_mistyped_bodies_are_clear_400s(stack: Stack) -> None:
    s = stack.session()
    r = _post_chat(s, b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = _post_chat(s, json.dumps({"messages": "hello"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post_chat(s, json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": "x"}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = _post_chat(s, json.dumps([1, 2]))
    assert r.status_code == 400
    r = _post_chat(
        s,
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 5}}),
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "logit_bias" and "vocabulary" in error["message"]
    r = _post_chat(
        s, json.dumps({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 2.5})
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty"
    r = _post_chat(
        s, json.dumps({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"})
    )
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]
    r = _post_chat(s, json.dumps({"messages": [{"role": "tool", "content": "x"}]}))
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]
    assert stack.view(s["id"])["drift"]["turns"] == 0


def test_tool_call_arguments_that_are_not_json_still_render(stack: Stack) -> None:
    """A client may send back arguments that are not JSON; the template renders them as
    written and the conversation goes on."""
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    messages = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{city: Rome"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        temperature=0,
        max_tokens=30,  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason in ("stop", "tool_calls", "length")
    prompt = stack.tokenizer.decode(stack.engine.calls[-1].input_ids)
    assert '{"name": "get_weather", "arguments": {city: Rome}' in prompt


def test_auth_errors(stack: Stack) -> None:
    s = stack.session()
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(f"{s['base_url']}/chat/completions", content=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(
        f"{s['base_url']}/chat/completions", content=body, headers={"Authorization": "Bearer wrong"}
    )
    assert r.status_code == 401
    other = stack.session()
    r = httpx.post(
        f"{s['base_url']}/chat/completions",
        content=body,
        headers={"Authorization": f"Bearer {other['api_key']}"},
    )
    assert r.status_code == 401 and "another session" in r.json()["error"]["message"]
    assert httpx.post(f"{stack.url}/sessions").status_code == 401
    assert httpx.get(f"{stack.url}/sessions/{s['id']}/samples").status_code == 401
    assert httpx.get(f"{stack.url}/sessions/nope", headers=AUTH).status_code == 404
    assert httpx.post(f"{stack.url}/sessions", headers=AUTH, json={"bogus": 1}).status_code == 400


def test_deleted_session_stays_deleted(stack: Stack) -> None:
    s = stack.session()
    assert httpx.delete(f"{stack.url}/sessions/{s['id']}", headers=AUTH).status_code == 200
    r = _post_chat(s, json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    assert r.status_code == 404  # a late request finds no session, and none is made
    assert httpx.get(f"{stack.url}/sessions/{s['id']}", headers=AUTH).status_code == 404
    assert httpx.delete(f"{stack.url}/sessions/{s['id']}", headers=AUTH).status_code == 404


def test_oversized_body_is_413(tiny_model_dir: Path, engine_url: str) -> None:
    with gateway_stack(tiny_model_dir, engine_url, max_body_bytes=2000) as stack:
        s = stack.session()
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]})
        r = _post_chat(s, big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_store_full_is_429(tiny_model_dir: Path, engine_url: str) -> None:
    with gateway_stack(tiny_model_dir, engine_url, max_sessions=1) as stack:
        stack.session()
        r = httpx.post(f"{stack.url}/sessions", headers=AUTH, json={})
        assert r.status_code == 429 and "max_sessions" in r.json()["error"]["message"]


def test_dead_engine_is_503(tiny_model_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with gateway_stack(tiny_model_dir, dead) as stack:
        s = stack.session()
        client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Say hello."}]
            )
        assert err.value.status_code == 503
        assert "unavailable" in err.value.message
        assert httpx.get(f"{stack.url}/health").status_code == 503
        assert stack.samples(s["id"]) == []


def test_engine_failure_mid_session_keeps_earlier_turns(tiny_model_dir: Path) -> None:
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    with gateway_stack(tiny_model_dir, engine_url) as stack:
        s = stack.session()
        client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        hello = [{"role": "user", "content": "Say hello."}]
        with serve(build_engine_app(LocalEngine(tiny_model_dir)), port=port):
            client.chat.completions.create(model="tiny", messages=hello, temperature=0)
        before = stack.samples(s["id"])
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="tiny", messages=hello, temperature=0)
        assert err.value.status_code == 503
        assert stack.samples(s["id"]) == before and len(before) == 1


def test_slow_engine_is_504(tiny_model_dir: Path) -> None:
    """A protocol stand-in engine that accepts /generate and never answers."""
    hang = FastAPI()

    @hang.post("/generate")
    async def generate() -> None:
        await asyncio.Event().wait()

    @hang.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    with serve(hang) as url, gateway_stack(tiny_model_dir, url, timeout=0.5) as stack:
        s = stack.session()
        r = _post_chat(s, json.dumps({"messages": [{"role": "user", "content": "Say hello."}]}))
        assert r.status_code == 504, r.text
        assert r.json()["error"]["type"] == "engine_timeout"
        assert stack.view(s["id"])["drift"]["turns"] == 0


async def test_client_disconnect_mid_stream_aborts_and_records_nothing(stack: Stack) -> None:
    s = stack.session()
    stack.engine.stall_after = 2
    body = {"messages": [{"role": "user", "content": "Say hello."}], "stream": True}
    async with (
        httpx.AsyncClient() as client,
        client.stream(
            "POST",
            f"{s['base_url']}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {s['api_key']}"},
        ) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"role"' in line:
                break  # leave mid-stream, the engine still generating
    # the gateway notices and aborts the engine request
    assert await asyncio.to_thread(stack.engine.abort_seen.wait, 30), "not aborted"
    assert stack.engine.aborted == [stack.engine.calls[-1].rid]
    assert stack.view(s["id"])["drift"]["turns"] == 0


async def test_client_disconnect_while_waiting_aborts_and_records_nothing(stack: Stack) -> None:
    s = stack.session()
    stack.engine.stall_after = 0
    body = {"messages": [{"role": "user", "content": "Say hello."}]}
    async with httpx.AsyncClient(timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                f"{s['base_url']}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {s['api_key']}"},
            )
    assert await asyncio.to_thread(stack.engine.abort_seen.wait, 30), "not aborted"
    assert stack.view(s["id"])["drift"]["turns"] == 0


def test_metrics_and_health(stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hello."}], temperature=0
    )
    text = httpx.get(f"{stack.url}/metrics").text
    assert "corral_gateway_sessions 1.0" in text
    assert 'corral_gateway_turn_outcomes_total{outcome="recorded"} 1.0' in text
    assert httpx.get(f"{stack.url}/health").json() == {"status": "ok", "engine": True}


def test_streamed_logprobs_are_the_engines(stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    tokens = []
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    ):
        for c in chunk.choices:
            tokens += (c.logprobs.content or []) if c.logprobs else []
    engine = stack.engine.calls[-1]
    assert [t.logprob for t in tokens] == pytest.approx(engine.logprobs[:-1], abs=1e-6)
    assert "".join(t.token for t in tokens) == "Hello!"
    for t in tokens:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-6  # greedy: the top one was taken
