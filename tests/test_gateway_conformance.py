"""Chat Completions conformance and the gateway's defences, against real servers on 127.0.0.1.

What the peers' suites and SDKs rely on (one entry per choice index per chunk, the finish
chunk apart, OpenAI's known-but-ignored fields accepted, 400s for what OpenAI refuses), and
what probing the gateway found (a client replacing the chat template, huge prompts rendered
on the event loop, unrendered fields kept, non-ASCII admin tokens, deep JSON, engine URLs in
errors). The engine is corral's local engine over the tiny test model.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from corral.engines.tiny_model import TOOLS
from corral.gateway.openai_types import IGNORED_FIELDS, openai_request_fields
from tests.gateway_stack import AUTH, Stack, gateway_stack
from tests.servers import free_port

HELLO = [{"role": "user", "content": "Say hello."}]


def _post(s: dict[str, Any], body: Any, **headers: str) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(
        f"{s['base_url']}/chat/completions",
        content=content,
        headers={"Authorization": f"Bearer {s['api_key']}", **headers},
        timeout=60,
    )


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in r.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


# -- streams -----------------------------------------------------------------------------------


def test_every_chunk_holds_each_choice_index_once_and_finish_chunks_stand_alone(
    stack: Stack,
) -> None:
    s = stack.session()
    r = _post(
        s,
        {
            "messages": [{"role": "user", "content": "What is the weather in Paris and Tokyo?"}],
            "tools": TOOLS,
            "n": 2,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200
    chunks = _events(r)
    finishes: dict[int, str] = {}
    for chunk in chunks:
        indices = [c["index"] for c in chunk["choices"]]
        assert len(indices) == len(set(indices)), chunk
        for c in chunk["choices"]:
            calls = c["delta"].get("tool_calls") or []
            assert len({t["index"] for t in calls}) == len(calls), chunk
            if c.get("finish_reason"):
                assert c["delta"] == {} and len(chunk["choices"]) == 1, chunk
                finishes[c["index"]] = c["finish_reason"]
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert r.text.rstrip().endswith("data: [DONE]")


def test_the_sdks_stream_accumulates_to_the_plain_answer(stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "tools": TOOLS,
        "temperature": 0,
    }
    plain = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    with client.chat.completions.stream(**ask) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    want = plain.choices[0].message.tool_calls or []
    got = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in got] == [  # type: ignore[union-attr]
        (c.function.name, c.function.arguments)  # type: ignore[union-attr]
        for c in want
    ]
    assert final.choices[0].finish_reason == "tool_calls"


# -- fields ------------------------------------------------------------------------------------


def test_openais_ignorable_fields_are_accepted(stack: Stack) -> None:
    assert openai_request_fields() >= IGNORED_FIELDS  # the list is OpenAI's, not invented
    s = stack.session()
    r = _post(
        s,
        {
            "messages": [
                {"role": "user", "content": "Say hello."},
                {"role": "assistant", "content": "Hello!", "annotations": [], "audio": None},
                {"role": "user", "content": "Say hello."},
            ],
            "store": False,
            "service_tier": "auto",
            "prompt_cache_key": "k",
            "safety_identifier": "u1",
            "reasoning_effort": "low",
            "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False},
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    assert "Hello!" in "".join(
        c["delta"].get("content") or "" for e in _events(r) for c in e["choices"]
    )


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"seed": 2**63}, "seed", "less_than_equal"),  # vLLM's check reads pydantic's type
        ({"seed": -(2**63) - 1}, "seed", "greater_than_equal"),
        ({"top_k": 0}, "top_k", "top_k"),
        ({"top_k": -2}, "top_k", "top_k"),
        ({"tool_choice": "required"}, None, "tools"),
        ({"modalities": ["text", "audio"]}, "modalities", "cannot honour"),
        ({"bogus_field": 1}, "bogus_field", "unknown field"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
            "not a valid JSON Schema",
        ),
        ({"response_format": {"type": "json_schema"}}, None, "json_schema"),
    ],
)
def test_what_openai_refuses_is_a_400_naming_it(
    stack: Stack, extra: dict[str, Any], param: str | None, says: str
) -> None:
    s = stack.session()
    r = _post(s, {"messages": HELLO, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"]
    if param is not None:
        assert error["param"] == param
    assert stack.engine.calls == []


def test_a_body_that_is_not_json_by_type_or_by_depth_is_a_400(stack: Stack) -> None:
    s = stack.session()
    r = _post(s, json.dumps({"messages": HELLO}), **{"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    deep = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"
    r = _post(s, deep, **{"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"
    nested: Any = "x"
    for _ in range(100):
        nested = {"a": nested}
    r = _post(s, {"messages": HELLO, "metadata": nested})
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep"


def test_models_routes(stack: Stack) -> None:
    s = stack.session()
    key = {"Authorization": f"Bearer {s['api_key']}"}
    one = httpx.get(f"{s['base_url']}/models/tiny", headers=key)
    assert one.status_code == 200 and one.json()["id"] == "tiny"
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_unknown_routes_and_methods_answer_json_with_a_request_id(stack: Stack) -> None:
    s = stack.session()
    r = httpx.get(f"{stack.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert r.headers["x-request-id"].startswith("req_"), r.headers
    r = httpx.get(f"{s['base_url']}/chat/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    r = httpx.post(f"{stack.url}/v1/messages/nothing", headers={"x-api-key": "k"})
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error"
    r = _post(s, {"messages": HELLO, "temperature": 0}, **{"x-request-id": "my-id.1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id.1"
    r = _post(s, {"messages": HELLO}, **{"x-request-id": "bad id with spaces"})
    assert r.headers["x-request-id"].startswith("req_")


def test_metrics_count_requests_by_route_dialect_and_status(stack: Stack) -> None:
    s = stack.session()
    assert _post(s, {"messages": HELLO, "temperature": 0}).status_code == 200
    assert _post(s, {"messages": HELLO, "seed": 2**64}).status_code == 400
    text = httpx.get(f"{stack.url}/metrics").text
    route = "/sessions/{session_id}/v1/chat/completions"
    for status in ("200", "400"):
        line = (
            f'corral_gateway_requests_total{{dialect="chat_completions",route="{route}",'
            f'status="{status}"}} 1.0'
        )
        assert line in text, text
    assert 'corral_gateway_request_seconds_count{dialect="chat_completions"} 2.0' in text
    assert 'corral_gateway_turn_tokens_count{dialect="chat_completions",kind="prompt"} 1.0' in text


# -- defences ----------------------------------------------------------------------------------


def test_clients_cannot_replace_the_template_or_set_variables_the_operator_did_not_allow(
    stack: Stack,
) -> None:
    s = stack.session()
    evil = "{% for x in range(10**9) %}{% endfor %}"
    r = _post(s, {"messages": HELLO, "chat_template_kwargs": {"chat_template": evil}})
    assert r.status_code == 400 and r.json()["error"]["code"] == "template_variable_not_allowed"
    r = _post(s, {"messages": HELLO, "chat_template_kwargs": {"tools_in_system": True}})
    assert r.status_code == 400 and "tools_in_system" in r.json()["error"]["message"]
    r = _post(s, {"messages": HELLO, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200
    assert stack.engine.calls and len(stack.engine.calls) == 1


def test_a_huge_prompt_is_refused_before_it_is_rendered(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corral.gateway.rendering import ChatRenderer

    rendered: list[int] = []
    original = ChatRenderer.render_text

    def counting(self: ChatRenderer, *args: Any, **kwargs: Any) -> str:
        rendered.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ChatRenderer, "render_text", counting)
    s = stack.session(max_context_tokens=64)
    r = _post(s, {"messages": [{"role": "user", "content": "x" * 200_000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]
    assert rendered == []  # never rendered, never tokenized


def test_a_large_prompt_is_rendered_off_the_event_loop(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    from corral.gateway import pipeline
    from corral.gateway.rendering import ChatRenderer

    monkeypatch.setattr(pipeline, "OFFLOAD_CHARACTERS", 500)
    threads: list[str] = []
    original = ChatRenderer.render_text

    def where(self: ChatRenderer, *args: Any, **kwargs: Any) -> str:
        threads.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ChatRenderer, "render_text", where)
    s = stack.session()
    small = _post(s, {"messages": HELLO, "temperature": 0, "max_tokens": 2})
    large = _post(
        s,
        {
            "messages": [{"role": "user", "content": "Say hello. " + "word " * 200}],
            "max_tokens": 2,
        },
    )
    assert small.status_code == 200 and large.status_code == 200, large.text
    server_loop_thread, worker = threads[0], threads[1]
    assert worker != server_loop_thread


def test_unrendered_fields_are_not_kept(stack: Stack) -> None:
    s = stack.session()
    messages = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello!", "refusal": "r" * 1_000_000, "annotations": []},
        {"role": "user", "content": "Say hello."},
    ]
    assert _post(s, {"messages": messages, "temperature": 0}).status_code == 200
    view = httpx.get(f"{stack.url}/sessions/{s['id']}", headers=AUTH)
    assert len(view.content) < 100_000
    recorded = view.json()["turns"][0]["messages"]
    assert [set(m) for m in recorded] == [{"role", "content"}] * 3


def test_a_non_ascii_admin_token_is_a_401(stack: Stack) -> None:
    r = httpx.post(
        f"{stack.url}/sessions", headers={"Authorization": "Bearer ädmin".encode()}, json={}
    )
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_engine_errors_never_show_the_engines_address(tiny_model_dir: Path) -> None:
    port = free_port()
    with gateway_stack(tiny_model_dir, f"http://127.0.0.1:{port}") as stack:
        s = stack.session()
        for stream in (False, True):
            r = _post(s, {"messages": HELLO, "stream": stream})
            assert str(port) not in r.text and "127.0.0.1" not in r.text
            assert "unavailable" in r.text


def test_parallel_tool_calls_false_stops_after_the_first_call(stack: Stack) -> None:
    s = stack.session()
    ask = [{"role": "user", "content": "What is the weather in Paris and Tokyo?"}]
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    both = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, temperature=0)  # type: ignore[arg-type]
    assert len(both.choices[0].message.tool_calls or []) == 2
    for stream in (False, True):
        r = _post(
            s,
            {
                "messages": ask,
                "tools": TOOLS,
                "temperature": 0,
                "parallel_tool_calls": False,
                "stream": stream,
            },
        )
        assert r.status_code == 200, r.text
        if stream:
            chunks = _events(r)
            calls = {
                t["index"]
                for e in chunks
                for c in e["choices"]
                for t in c["delta"].get("tool_calls") or []
            }
            finish = [
                c["finish_reason"] for e in chunks for c in e["choices"] if c.get("finish_reason")
            ]
        else:
            message = r.json()["choices"][0]
            calls = {i for i, _ in enumerate(message["message"]["tool_calls"])}
            finish = [message["finish_reason"]]
        assert calls == {0} and finish == ["tool_calls"]
        text = stack.tokenizer.decode(stack.engine.calls[-1].output_ids)
        assert text.endswith("</tool_call>") and text.count("<tool_call>") == 1


def test_null_means_not_set_for_the_fields_sdks_send_as_null(stack: Stack) -> None:
    s = stack.session()
    r = _post(s, {"messages": HELLO, "n": None, "logprobs": None, "stream": None, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Hello!"


def test_cross_field_errors_name_their_field(stack: Stack) -> None:
    s = stack.session()
    r = _post(s, {"messages": HELLO, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = _post(s, {"messages": HELLO, "tools": TOOLS, "tool_choice": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_a_stream_whose_engine_fails_first_gets_an_error_status(tiny_model_dir: Path) -> None:
    """Before the engine's first token nothing has been sent: the client gets the status (and
    its retry logic works), not a 200 whose stream carries the error."""
    with gateway_stack(tiny_model_dir, f"http://127.0.0.1:{free_port()}") as stack:
        s = stack.session()
        r = _post(s, {"messages": HELLO, "stream": True})
        assert r.status_code == 503 and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["type"] == "engine_unavailable"


def test_history_and_fields_as_current_sdks_send_them_are_accepted(stack: Stack) -> None:
    s = stack.session()
    history = [
        {"role": "user", "content": "Say hello."},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Hello!"}, {"type": "refusal", "refusal": "no"}],
            "function_call": None,
            "audio": None,
            "annotations": [],
        },
        {"role": "user", "content": "Say hello."},
    ]
    r = _post(
        s,
        {
            "messages": history,
            "verbosity": "low",
            "modalities": ["text"],
            "audio": None,
            "prediction": None,
            "web_search_options": None,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    recorded = httpx.get(f"{stack.url}/sessions/{s['id']}", headers=AUTH).json()["turns"][0]
    assert recorded["messages"][1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "Hello!"}],
    }
    r = _post(s, {"messages": HELLO, "modalities": ["text", "audio"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "modalities"


async def test_the_admin_api_lists_sessions_page_by_page(stack: Stack) -> None:
    """``GET /sessions`` through the gateway's own admin client: pages oldest first that
    hold the sessions made here, never a key; without the admin token a 401, a bad limit a
    400 naming it, a stale cursor a 404."""
    from corral.gateway.client import GatewayAdmin, GatewayAdminError

    made = [stack.session(metadata={"task_id": f"list-{i}"}) for i in range(3)]
    ids = [m["id"] for m in made]
    async with GatewayAdmin(stack.url, AUTH["Authorization"].removeprefix("Bearer ")) as admin:
        seen, after = [], None
        while True:
            page = await admin.list_sessions(limit=2, after=after)
            assert len(page.sessions) <= 2
            seen.extend(s.id for s in page.sessions)
            if page.next is None:
                break
            after = page.next
        assert [i for i in seen if i in ids] == ids
        listed = {s.id: s for s in (await admin.list_sessions(limit=1000)).sessions}
        assert listed[ids[1]].metadata == {"task_id": "list-1"} and listed[ids[1]].turns == 0
        await admin.close_session(ids[0])
        with pytest.raises(GatewayAdminError) as stale:
            await admin.list_sessions(after=ids[0])
        assert stale.value.status == 404
    async with httpx.AsyncClient(base_url=stack.url) as http:
        raw = await http.get("/sessions", headers=AUTH)
        assert all(m["api_key"] not in raw.text for m in made)
        assert (await http.get("/sessions")).status_code == 401
        for bad in ("0", "1001", "ten"):
            r = await http.get(f"/sessions?limit={bad}", headers=AUTH)
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
