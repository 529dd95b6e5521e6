"""A gateway stack for tests: the local engine (tiny model) behind a real gateway on 127.0.0.1,
with the engine client wrapped (``RecordingEngine``) to capture what the gateway sent to the
engine and what the engine answered, so samples can be checked token for token. The
``engine_url`` and ``stack`` fixtures (tests/conftest.py) build on it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from corral.engines.client import EngineClient, make_engine_client
from corral.engines.protocol import GenerateRequest, GenerateResponse, ModelInfo, SamplingParams
from corral.engines.sglang import SGLangClient
from corral.engines.stream import StreamDelta
from corral.gateway.app import build_gateway_app
from corral.gateway.pipeline import TurnPipeline
from corral.gateway.server import model_context_length
from corral.gateway.settings import GatewaySettings
from corral.transport import TransportLimits
from tests.scripted_engine import ScriptedEngine
from tests.servers import serve

ADMIN = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@dataclass
class EngineCall:
    input_ids: list[int]
    rid: str | None = None
    sampling: SamplingParams | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False


class RecordingEngine:
    """Wraps the real engine client and keeps every request's input and output tokens."""

    def __init__(self, inner: EngineClient) -> None:
        self.inner = inner
        self.calls: list[EngineCall] = []
        self.aborted: list[str] = []
        self.abort_seen = threading.Event()
        # When set, a request stalls (after this many stream deltas, or before answering a
        # plain generate) until the gateway cancels it: a deterministic "engine still busy".
        self.stall_after: int | None = None

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        call = EngineCall(list(req.input_ids), rid=req.rid, sampling=req.sampling_params)
        self.calls.append(call)
        if self.stall_after is not None:
            await asyncio.Event().wait()
        res = await self.inner.generate(req)
        call.output_ids = list(res.output_ids)
        call.logprobs = [e[0] for e in res.meta_info.output_token_logprobs]
        call.finished = True
        return res

    async def stream(self, req: GenerateRequest) -> AsyncIterator[StreamDelta]:
        call = EngineCall(list(req.input_ids), rid=req.rid, sampling=req.sampling_params)
        self.calls.append(call)
        async for delta in self.inner.stream(req):
            if self.stall_after is not None and len(call.output_ids) >= self.stall_after:
                await asyncio.Event().wait()
            call.output_ids += delta.token_ids
            call.logprobs += delta.logprobs
            call.finished = delta.finish_reason is not None
            yield delta

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.abort_seen.set()
        await self.inner.abort(rid)

    async def health(self) -> bool:
        return await self.inner.health()

    async def get_model_info(self) -> ModelInfo:
        return await self.inner.get_model_info()

    async def aclose(self) -> None:
        await self.inner.aclose()


class Admin:
    """The gateway's session-management calls, as a test makes them (``url``: the gateway)."""

    url: str

    def session(self, **options: Any) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/sessions", headers=AUTH, json=options)
        assert r.status_code == 201, r.text
        return dict(r.json())

    def samples(self, session_id: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/sessions/{session_id}/samples", headers=AUTH)
        assert r.status_code == 200, r.text
        return list(r.json())

    def view(self, session_id: str) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/sessions/{session_id}", headers=AUTH)
        assert r.status_code == 200, r.text
        return dict(r.json())


@dataclass
class Stack(Admin):
    url: str
    engine: RecordingEngine
    engine_url: str
    tokenizer: Any


def check_exact_sample(stack: Stack, session_id: str, turns: int) -> dict[str, Any]:
    """The session holds one sample whose tokens are the engine's last input + output, whose
    mask is 1 exactly on tokens the engine produced, and whose logprobs are the engine's."""
    samples = stack.samples(session_id)
    assert len(samples) == 1, stack.view(session_id)["drift"]
    check_exact_calls(samples[0], stack.engine.calls[-turns:], turns)
    return dict(samples[0])


def check_exact_calls(sample: dict[str, Any], calls: Sequence[Any], turns: int) -> None:
    """``sample`` holds exactly ``calls`` (the engine's requests of its ``turns`` turns, first
    first; anything with ``input_ids``, ``output_ids`` and ``logprobs``): the last prompt and
    its output, the mask 1 exactly on the engine's outputs, the engine's logprobs."""
    assert len(calls) == turns
    last = calls[-1]
    assert sample["tokens"] == last.input_ids + last.output_ids
    prompt_len = len(calls[0].input_ids)
    assert sample["response_length"] == len(sample["tokens"]) - prompt_len
    expected_mask = [0] * len(sample["tokens"])
    expected_lp = [0.0] * len(sample["tokens"])
    for call in calls:
        start = len(call.input_ids)
        assert sample["tokens"][: start + len(call.output_ids)] == call.input_ids + call.output_ids
        for k, lp in enumerate(call.logprobs):
            expected_mask[start + k] = 1
            expected_lp[start + k] = lp
    assert sample["loss_mask"] == expected_mask[prompt_len:]
    assert sample["rollout_log_probs"] == pytest.approx(expected_lp[prompt_len:], abs=1e-6)
    assert sample["metadata"]["num_turns"] == turns


@contextmanager
def gateway_stack(
    model: Path, engine_url: str, *, timeout: float = 60.0, **overrides: Any
) -> Iterator[Stack]:
    settings = GatewaySettings(
        model_name="tiny",
        max_context_tokens=model_context_length(model),
        admin_token=ADMIN,
        engine_timeout_s=timeout,
        **overrides,
    )
    engine = RecordingEngine(make_engine_client("sglang", engine_url, timeout=timeout, retries=0))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    service = TurnPipeline(settings, engine, tokenizer)
    with serve(build_gateway_app(settings, engine, service)) as url:
        yield Stack(url=url, engine=engine, engine_url=engine_url, tokenizer=tokenizer)


@dataclass
class ScriptedStack(Admin):
    """A gateway in front of the scripted test engine (tests/scripted_engine.py)."""

    url: str
    engine: ScriptedEngine
    tokenizer: Any

    def ids(self, text: str) -> list[int]:
        """``text`` as the model would have sampled it, then ``<|im_end|>``."""
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        assert self.tokenizer.decode(ids) == text
        return [*ids, self.tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def tool_call(self, name: str, arguments: dict[str, Any]) -> list[int]:
        """One Qwen 2.5 tool call, formatted exactly as the template renders it back."""
        body = json.dumps({"name": name, "arguments": arguments})
        return self.ids(f"<tool_call>\n{body}\n</tool_call>")


@contextmanager
def scripted_gateway(
    tiny_model_dir: Path,
    *,
    model_name: str = "tiny",
    context: int = 262_144,
    limits: TransportLimits | None = None,
) -> Iterator[ScriptedStack]:
    """A gateway in front of the scripted engine; ``limits``: its transport limits (default:
    corral's own)."""
    tokenizer: Any = AutoTokenizer.from_pretrained(str(tiny_model_dir))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    engine = ScriptedEngine(
        eos_token_ids=[int(tokenizer.convert_tokens_to_ids("<|im_end|>"))], decode=decode
    )
    settings = GatewaySettings(
        model_name=model_name, max_context_tokens=context, admin_token=ADMIN, engine_timeout_s=60
    )
    with serve(engine.app) as engine_url:
        client = SGLangClient(engine_url, timeout=60, retries=0)
        pipeline = TurnPipeline(settings, client, tokenizer)
        with serve(build_gateway_app(settings, client, pipeline), limits=limits) as url:
            yield ScriptedStack(url=url, engine=engine, tokenizer=tokenizer)
