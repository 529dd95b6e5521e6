"""The local engine's token: with one, every route but ``/health`` answers only to it as a
bearer (SGLang's ``--api-key`` header), and a refused request does nothing; without one it
listens on loopback only. The engine client, the gateway and the stack's children send it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.engines.local.engine import LocalEngine
from corral.engines.local.server import build_engine_app, run_engine
from corral.engines.local.settings import EngineSettings, is_loopback
from corral.engines.protocol import GenerateRequest, SamplingParams
from corral.engines.sglang import EngineStatusError, SGLangClient
from corral.gateway.launch import GatewayLaunch
from corral.stack.engine import engine_in_process
from corral.stack.gateway import gateway_in_process
from tests.servers import serve
from tests.test_local_engine import sse_chunks

TOKEN = "engine-secret"
RIGHT = {"Authorization": f"Bearer {TOKEN}"}
WRONG: list[Any] = [
    {},
    {"Authorization": "Bearer not-it"},
    {"Authorization": f"Basic {TOKEN}"},
    {b"Authorization": "Bearer \u00e9t\u00e9".encode()},  # not ASCII: a 401, not a 500
]


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path) -> Iterator[str]:
    with serve(build_engine_app(LocalEngine(tiny_model_dir), token=TOKEN)) as url:
        yield url


def _stream_body(rid: str) -> dict[str, Any]:
    return {
        "input_ids": [40 + i for i in range(6)],
        "sampling_params": {"max_new_tokens": 60, "ignore_eos": True},
        "stream": True,
        "rid": rid,
    }


def _refused(resp: httpx.Response) -> None:
    assert resp.status_code == 401, resp.text
    error = resp.json()["error"]
    assert error["type"] == "authentication_error" and "token" in error["message"]


@pytest.mark.parametrize("headers", WRONG)
def test_every_route_but_health_refuses_a_missing_or_wrong_bearer(
    guarded: str, headers: Any, tmp_path: Path, tiny_model_dir: Path
) -> None:
    other = shutil.copytree(tiny_model_dir, tmp_path / "other")
    with httpx.Client(base_url=guarded, timeout=60, headers=headers) as client:
        _refused(client.post("/generate", json={"input_ids": [1, 2], "stream": False}))
        _refused(client.post("/abort_request", json={"abort_all": True}))
        _refused(client.post("/update_weights_from_disk", json={"model_path": str(other)}))
        for path in ("/get_model_info", "/model_info", "/server_info", "/v1/models", "/metrics"):
            _refused(client.get(path))
        assert client.get("/health").status_code == 200
    info = httpx.get(f"{guarded}/get_model_info", headers=RIGHT, timeout=10)
    assert info.status_code == 200 and info.json()["model_path"] == str(tiny_model_dir)


def test_a_refused_abort_leaves_the_stream_running_and_the_right_one_aborts(guarded: str) -> None:
    def run(rid: str, abort_headers: dict[str, str]) -> str:
        with httpx.Client(base_url=guarded, timeout=60) as client:
            sent = False
            last: dict[str, Any] = {}
            with client.stream("POST", "/generate", json=_stream_body(rid), headers=RIGHT) as resp:
                assert resp.status_code == 200
                for event in sse_chunks(resp.iter_lines()):
                    if event == "[DONE]":
                        break
                    assert isinstance(event, dict)
                    last = event
                    if not sent and event["meta_info"]["completion_tokens"] >= 2:
                        answer = client.post(
                            "/abort_request", json={"abort_all": True}, headers=abort_headers
                        )
                        assert answer.status_code == (200 if abort_headers == RIGHT else 401)
                        sent = True
            assert sent
            return str(last["meta_info"]["finish_reason"]["type"])

    assert run("kept", {"Authorization": "Bearer not-it"}) == "length"
    assert run("aborted", RIGHT) == "abort"


def test_the_right_bearer_swaps_the_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = shutil.copytree(tiny_model_dir, tmp_path / "other")
    with (
        serve(build_engine_app(LocalEngine(tiny_model_dir), token=TOKEN)) as url,
        httpx.Client(base_url=url, timeout=120, headers=RIGHT) as client,
    ):
        resp = client.post("/update_weights_from_disk", json={"model_path": str(other)})
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        assert client.get("/get_model_info").json()["model_path"] == str(other)


async def test_the_engine_client_sends_its_api_key_on_every_call(guarded: str) -> None:
    probe = GenerateRequest(
        input_ids=[40, 41, 42], sampling_params=SamplingParams(max_new_tokens=2)
    )
    async with SGLangClient(guarded, api_key=TOKEN, retries=0) as client:
        assert (await client.get_model_info()).model_path
        assert (await client.generate(probe)).meta_info.completion_tokens == 2
        deltas = [d async for d in client.stream(probe.model_copy(update={"stream": True}))]
        assert deltas
        await client.abort("nobody")
        await client.abort_all()
        assert await client.health()
    async with SGLangClient(guarded, retries=0) as anonymous:
        with pytest.raises(EngineStatusError) as refused:
            await anonymous.get_model_info()
        assert refused.value.status_code == 401


def test_beyond_loopback_the_engine_needs_a_token(tiny_model_dir: Path) -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com"]))
    with pytest.raises(ValueError, match="token"):
        run_engine(tiny_model_dir, host="0.0.0.0", port=1)  # refused before the model loads


def _corral(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corral.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_corral_engine_beyond_loopback_without_a_token_is_one_usage_line() -> None:
    # A model folder that does not exist: the refusal comes before anything is checked or
    # loaded.
    done = _corral("engine", "--model", "/no/such/model", "--host", "0.0.0.0")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--token-var" in lines[0] and "0.0.0.0" in lines[0]
    unset = _corral("engine", "--model", "/no/such", "--token-var", "CORRAL_TEST_UNSET_TOKEN")
    assert unset.returncode == 2 and "CORRAL_TEST_UNSET_TOKEN" in unset.stderr


def test_a_gateway_child_reaches_a_token_engine_child(tiny_model_dir: Path, tmp_path: Path) -> None:
    settings = EngineSettings(model=tiny_model_dir, token_var="CORRAL_TEST_ENGINE_TOKEN")
    assert TOKEN not in " ".join(settings.to_argv())
    untokened = EngineSettings(model=tiny_model_dir)
    with (
        pytest.raises(ValueError, match="token_var"),
        engine_in_process(untokened, log=tmp_path / "x", token="t"),
    ):
        pytest.fail("started a child engine with its token in no variable")
    with engine_in_process(settings, log=tmp_path / "engine.log", token=TOKEN) as engine:
        assert httpx.get(f"{engine}/get_model_info").status_code == 401
        launch = GatewayLaunch(
            engine_url=engine, model=tiny_model_dir, engine_token_var="CORRAL_TEST_ENGINE_TOKEN"
        )
        with gateway_in_process(
            launch, log=tmp_path / "gateway.log", engine_token=TOKEN
        ) as gateway:
            session = httpx.post(f"{gateway}/sessions", json={}, timeout=30)
            assert session.status_code == 201, session.text
            sid, key = session.json()["id"], session.json()["api_key"]
            answer = httpx.post(
                f"{gateway}/sessions/{sid}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}]},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"] is not None
