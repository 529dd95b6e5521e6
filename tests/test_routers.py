"""corral's local engine as a worker behind SGLang's real routers, and session affinity.

Real processes on 127.0.0.1: two ``corral engine`` children (the tiny model), in turn smg
(``--policy consistent_hashing``) and sglang-router (``--policy manual``; 0.3.2 has no
``consistent_hashing``) in front of them, and a gateway whose engine URL is the router.
Multi-turn tool sessions through gateway -> router -> engines must be token-exact, and every
turn of a session must land on one engine, counted on the engines' side (their ``/metrics``),
with the sessions spread over both.

The routers come from ``scripts/routers_venv.sh`` (cached in ``CORRAL_ROUTERS_VENV``, default
``/var/cache/corral-routers``). The tests skip only when that folder lacks them and
``CORRAL_ROUTERS_VENV`` is unset; with it set (CI) a missing router is a failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from corral.engines.errors import EngineNoWorker
from corral.engines.local.engine import LocalEngine
from corral.engines.local.server import build_engine_app
from corral.engines.protocol import GenerateRequest, SamplingParams
from corral.engines.sglang import SGLangClient
from corral.engines.tiny_model import TOOLS
from corral.processes import serve_in_process
from tests.gateway_stack import Stack, check_exact_sample, gateway_stack
from tests.servers import free_port, serve

DEFAULT_VENV = Path("/var/cache/corral-routers")
# (router, policy that honours X-SMG-Routing-Key)
ROUTERS = [("smg", "consistent_hashing"), ("sglang-router", "manual")]
# Fast health checks, so that a dead worker is noticed within a couple of seconds.
HEALTH_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]


def router_binary(name: str) -> Path:
    configured = os.environ.get("CORRAL_ROUTERS_VENV")
    binary = Path(configured or DEFAULT_VENV) / name / "bin" / name
    if not binary.exists():
        why = f"{binary} is missing: run scripts/routers_venv.sh {configured or DEFAULT_VENV}"
        if configured:
            pytest.fail(why)
        pytest.skip(why)
    return binary


@contextmanager
def router(name: str, policy: str, workers: list[str], log: Path) -> Iterator[str]:
    """``NAME launch`` in front of ``workers``; yields its URL once it lists them all healthy."""
    port = free_port("127.0.0.1")
    command = [
        str(router_binary(name)),
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # Both default to 29000 for their Prometheus listener: two at once would clash.
        "--prometheus-port",
        str(free_port("127.0.0.1")),
        "--policy",
        policy,
        "--worker-urls",
        *workers,
        *HEALTH_FLAGS,
        "--log-level",
        "warn",
    ]
    url = f"http://127.0.0.1:{port}"
    with log.open("ab") as out:
        # Its own session: the Python launcher and the router it starts go down together.
        child = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert child.poll() is None, log.read_text()[-3000:]
            try:
                listed = httpx.get(f"{url}/workers", timeout=5).json()["workers"]
                if len(listed) == len(workers) and all(w["is_healthy"] for w in listed):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)  # polling a child's readiness
        yield url
    finally:
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


@dataclass
class Counts:
    requests: int
    prompt_tokens: int
    completion_tokens: int


def counts(engine_url: str) -> Counts:
    """The engine's own counters (its ``/metrics``)."""
    text = httpx.get(f"{engine_url}/metrics", timeout=10).text
    values = {
        line.split()[0]: int(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    return Counts(
        values["corral_engine_generate_requests_total"],
        values["corral_engine_prompt_tokens_total"],
        values["corral_engine_completion_tokens_total"],
    )


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """Two ``corral engine`` processes over the tiny model."""
    for name, _ in ROUTERS:
        router_binary(name)  # skip before paying for the engines
    logs = tmp_path_factory.mktemp("engines")
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                serve_in_process(["engine", "--model", str(tiny_model_dir)], log=logs / f"{i}.log")
            )
            for i in range(2)
        ]


def tool_session(stack: Stack) -> str:
    """A two-turn tool-calling session (the second turn streamed); returns its id."""
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Lima?"}]
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        city = json.loads(call.function.arguments)["city"]  # type: ignore[union-attr]
        result = {"city": city, "weather": "sunny", "temp_c": 21}
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
    )
    text = ""
    for chunk in cast("openai.Stream[ChatCompletionChunk]", stream):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text.startswith("I have checked the weather in"), text
    return str(s["id"])


def sessions_stick_and_spread(stack: Stack, engines: list[str], turns: int = 2) -> None:
    """Play tool sessions through ``stack`` until both ``engines`` had one (at least 4): every
    turn of a session must land on one engine, counted on the engines' side, that engine must
    have run exactly the tokens the gateway sent and got, and each sample must be exact. With
    random session ids, 16 sessions all on one engine happens once in 2**15 runs."""
    used: list[int] = []
    while len(used) < 4 or len(set(used)) < 2:
        assert len(used) < 16, f"every session went to engine {used[0]}"
        before = [counts(e) for e in engines]
        session_id = tool_session(stack)
        after = [counts(e) for e in engines]
        served = [a.requests - b.requests for a, b in zip(after, before, strict=True)]
        assert sorted(served) == [0, turns], f"turns per engine: {served}"
        engine = served.index(turns)
        used.append(engine)
        calls = stack.engine.calls[-turns:]
        b, a = before[engine], after[engine]
        assert a.prompt_tokens - b.prompt_tokens == sum(len(c.input_ids) for c in calls)
        assert a.completion_tokens - b.completion_tokens == sum(len(c.output_ids) for c in calls)
        check_exact_sample(stack, session_id, turns)


@pytest.mark.parametrize(("name", "policy"), ROUTERS, ids=[n for n, _ in ROUTERS])
def test_sessions_are_token_exact_and_stick_to_one_engine(
    name: str, policy: str, engines: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    with (
        router(name, policy, engines, tmp_path / "router.log") as url,
        gateway_stack(tiny_model_dir, url) as stack,
    ):
        sessions_stick_and_spread(stack, engines)


async def generate_once(url: str, req: GenerateRequest) -> None:
    async with SGLangClient(url, retries=0) as client:
        await client.generate(req)


@pytest.mark.parametrize(("name", "policy"), ROUTERS, ids=[n for n, _ in ROUTERS])
def test_a_router_without_a_healthy_worker_is_a_503(
    name: str,
    policy: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every worker down: the router's "no available workers" is the gateway's 503, and the
    client error (and the gateway's log line) say that the router has no healthy worker."""
    req = GenerateRequest(
        input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=2), routing_key="k"
    )
    with ExitStack() as workers:
        worker = workers.enter_context(serve(build_engine_app(LocalEngine(tiny_model_dir))))
        with (
            router(name, policy, [worker], tmp_path / "router.log") as url,
            gateway_stack(tiny_model_dir, url) as stack,
        ):
            workers.close()  # the only worker goes away; router and gateway stay
            deadline = time.monotonic() + 30
            while any(w["is_healthy"] for w in httpx.get(f"{url}/workers").json()["workers"]):
                assert time.monotonic() < deadline, "the router never noticed its worker died"
                time.sleep(0.2)  # polling the router's view
            with pytest.raises(EngineNoWorker, match="the router has no healthy worker"):
                asyncio.run(generate_once(url, req))
            s = stack.session()
            with caplog.at_level(logging.WARNING):
                r = httpx.post(
                    f"{s['base_url']}/chat/completions",
                    headers={"Authorization": f"Bearer {s['api_key']}"},
                    json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},
                    timeout=30,
                )
            assert r.status_code == 503, r.text
            assert "its router has no healthy worker" in r.json()["error"]["message"], r.text
            assert "127.0.0.1" not in r.text  # the router's address stays in the log
            assert "no healthy worker" in caplog.text


# What sglang-router 0.3.2 and smg 1.13 forward: their GenerateRequest with its defaults.
ROUTER_BODY: dict[str, Any] = {
    "model": "unknown",
    "input_ids": [1, 2, 3],
    "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "stop": "\n"},
    "return_logprob": True,
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "rid": "router-body",
}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"image_data": "http://x/cat.png"}, "image_data"),
        ({"lora_path": "adapter"}, "lora_path"),
        ({"logprob_start_len": 0}, "logprob_start_len"),
        ({"text": "hello", "input_ids": None}, "text"),
        ({"sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_the_local_engine_refuses_what_it_cannot_do_by_name(
    engine_url: str, change: dict[str, Any], field: str
) -> None:
    body = {k: v for k, v in {**ROUTER_BODY, **change}.items() if v is not None}
    r = httpx.post(f"{engine_url}/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert f"{field}=" in r.json()["error"]["message"]


def test_the_local_engine_takes_what_the_routers_forward(engine_url: str) -> None:
    body = {**ROUTER_BODY, "session_id": "s", "routing_key": "k", "routed_dp_rank": 0}
    body["sampling_params"] = {**body["sampling_params"], "n": 1, "min_p": 0.0, "top_k": None}
    r = httpx.post(f"{engine_url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["meta_info"]["output_token_logprobs"]) == len(r.json()["output_ids"])
    unknown = httpx.post(f"{engine_url}/generate", json={**body, "bogus": 1}, timeout=60)
    assert unknown.status_code == 400 and "bogus" in unknown.json()["error"]["message"]
    models = httpx.get(f"{engine_url}/v1/models", timeout=10).json()["data"]
    assert models[0]["owned_by"] == "sglang"
    assert httpx.get(f"{engine_url}/server_info", timeout=10).json()["dp_size"] == 1
    assert httpx.get(f"{engine_url}/model_info", timeout=10).json()["is_generation"] is True
    assert httpx.get(f"{engine_url}/health_generate", timeout=30).status_code == 200
    assert httpx.get(f"{engine_url}/version", timeout=10).status_code == 404  # else smg: vLLM
