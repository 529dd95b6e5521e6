"""The scripted test engine (tests/scripted_engine.py) read through corral's SGLangClient.

These pin the engine to what the client expects of SGLang, so that tests built on it (the
gateway's dialects against real agent CLIs) can trust its tokens, logprobs and finish reasons.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

import httpx
import pytest

from corral.engines.protocol import GenerateRequest, SamplingParams
from corral.engines.sglang import EngineStatusError, SGLangClient
from corral.engines.stream import StreamDelta
from tests.scripted_engine import Failure, Reply, ScriptedEngine
from tests.servers import serve

EOS = 2
PROMPT = [11, 12, 13]


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine(eos_token_ids=[EOS], weight_version="w7")


@pytest.fixture
def url(engine: ScriptedEngine) -> Iterator[str]:
    with serve(engine.app) as base:
        yield base


@pytest.fixture
async def client(url: str) -> AsyncIterator[SGLangClient]:
    async with SGLangClient(url, timeout=10) as c:
        yield c


def _req(
    max_new_tokens: int = 64,
    *,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    return_logprob: bool = True,
    top_logprobs_num: int = 0,
    stream: bool = False,
    rid: str | None = None,
) -> GenerateRequest:
    return GenerateRequest(
        input_ids=PROMPT,
        sampling_params=SamplingParams(
            max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos
        ),
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
        stream=stream,
        rid=rid,
    )


async def _stream(client: SGLangClient, req: GenerateRequest) -> list[StreamDelta]:
    return [d async for d in client.stream(req)]


async def test_generate_plays_the_script_to_its_stop_token(
    engine: ScriptedEngine, client: SGLangClient
) -> None:
    engine.push([5, 6, 7, EOS, 9])  # ids after the stop token are never generated
    out = await client.generate(_req())
    assert out.output_ids == [5, 6, 7, EOS]
    meta = out.meta_info
    assert [tuple(e) for e in meta.output_token_logprobs] == [
        (-0.5, 5, None),
        (-0.5, 6, None),
        (-0.5, 7, None),
        (-0.5, EOS, None),
    ]
    assert meta.finish_reason is not None
    assert (meta.finish_reason.type, meta.finish_reason.matched) == ("stop", EOS)
    assert (meta.prompt_tokens, meta.completion_tokens) == (3, 4)
    assert meta.weight_version == "w7"
    (got,) = engine.requests
    assert got.input_ids == PROMPT
    assert got.sampling_params.max_new_tokens == 64
    assert not got.stream
    assert got.output_ids == [5, 6, 7, EOS]
    assert got.finish_reason == {"type": "stop", "matched": EOS}


async def test_generate_caps_at_max_new_tokens_with_finish_length(
    engine: ScriptedEngine, client: SGLangClient
) -> None:
    engine.push([5, 6, 7, 8, EOS])
    out = await client.generate(_req(max_new_tokens=3))
    assert out.output_ids == [5, 6, 7]
    assert out.meta_info.finish_reason is not None
    assert out.meta_info.finish_reason.type == "length"
    assert out.meta_info.finish_reason.model_extra == {"length": 3}
    assert len(out.meta_info.output_token_logprobs) == 3


async def test_length_wins_over_a_stop_token_on_the_last_allowed_position(
    engine: ScriptedEngine, client: SGLangClient
) -> None:
    engine.push([5, EOS])
    out = await client.generate(_req(max_new_tokens=2))
    assert out.output_ids == [5, EOS]
    assert out.meta_info.finish_reason is not None
    assert out.meta_info.finish_reason.type == "length"


async def test_request_stop_token_ids_and_ignore_eos(
    engine: ScriptedEngine, client: SGLangClient
) -> None:
    engine.push([5, 6, 7, EOS], [5, EOS, 6], [5, 6])
    out = await client.generate(_req(stop_token_ids=[6]))
    assert out.output_ids == [5, 6]
    assert out.meta_info.finish_reason is not None
    assert out.meta_info.finish_reason.matched == 6
    out = await client.generate(_req(ignore_eos=True))
    assert out.output_ids == [5, EOS, 6]
    # A script that runs out without a stop token: stop, nothing matched.
    assert out.meta_info.finish_reason is not None
    assert (out.meta_info.finish_reason.type, out.meta_info.finish_reason.matched) == (
        "stop",
        None,
    )
    out = await client.generate(_req())
    assert out.output_ids == [5, 6]


async def test_stream_sends_cumulative_chunks_of_three_tokens(
    engine: ScriptedEngine, url: str, client: SGLangClient
) -> None:
    engine.push([5, 6, 7, 8, 9, 10, EOS])
    deltas = await _stream(client, _req())
    assert [d.token_ids for d in deltas] == [[5, 6, 7], [8, 9, 10], [EOS]]
    assert [d.logprobs for d in deltas] == [[-0.5] * 3, [-0.5] * 3, [-0.5]]
    assert [d.finish_reason for d in deltas[:-1]] == [None, None]
    final = deltas[-1].finish_reason
    assert final is not None
    assert (final.type, final.matched) == ("stop", EOS)
    assert [d.completion_tokens for d in deltas] == [3, 6, 7]
    assert {d.weight_version for d in deltas} == {"w7"}
    assert {d.prompt_tokens for d in deltas} == {3}
    got = engine.requests[-1]
    assert got.stream
    assert got.output_ids == [5, 6, 7, 8, 9, 10, EOS]
    assert not got.disconnected

    # On the wire: SGLang's cumulative chunks, then [DONE].
    engine.push([5, 6, 7, 8])
    async with httpx.AsyncClient(base_url=url) as http:
        body = _req(stream=True).model_dump(exclude_none=True)
        resp = await http.post("/generate", json=body)
    events = [line for line in resp.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert len(events) == 3  # [5, 6, 7], [5, 6, 7, 8], [DONE]


async def test_stream_caps_at_max_new_tokens(engine: ScriptedEngine, client: SGLangClient) -> None:
    engine.push([5, 6, 7, 8, 9, 10, 11])
    deltas = await _stream(client, _req(max_new_tokens=5))
    assert [d.token_ids for d in deltas] == [[5, 6, 7], [8, 9]]
    final = deltas[-1].finish_reason
    assert final is not None
    assert final.type == "length"


async def test_scripts_are_taken_in_order_and_callables_see_the_prompt(
    engine: ScriptedEngine, client: SGLangClient
) -> None:
    engine.push([5, EOS], lambda ids: [*reversed(ids), EOS], Reply([7, 8, EOS], [-1.0, -2.0, -3.0]))
    assert engine.pending == 3
    first = await client.generate(_req())
    second = await client.generate(_req())
    third = [d async for d in client.stream(_req())]
    assert first.output_ids == [5, EOS]
    assert second.output_ids == [13, 12, 11, EOS]
    assert [t for d in third for t in d.token_ids] == [7, 8, EOS]
    assert [lp for d in third for lp in d.logprobs] == [-1.0, -2.0, -3.0]
    assert engine.pending == 0
    assert [r.output_ids for r in engine.requests] == [[5, EOS], [13, 12, 11, EOS], [7, 8, EOS]]


async def test_logprobs_off_and_top_logprobs(engine: ScriptedEngine, client: SGLangClient) -> None:
    engine.push([5, EOS], [5, EOS])
    out = await client.generate(_req(return_logprob=False))
    assert out.output_ids == [5, EOS]
    assert out.meta_info.output_token_logprobs == []
    out = await client.generate(_req(top_logprobs_num=2))
    assert [[tuple(e) for e in pos or []] for pos in out.meta_info.output_top_logprobs] == [
        [(-0.5, 5, None), (-1.5, 6, None)],
        [(-0.5, EOS, None), (-1.5, EOS + 1, None)],
    ]


async def test_no_script_and_scripted_failures_are_http_errors(
    engine: ScriptedEngine, client: SGLangClient
) -> None:
    with pytest.raises(EngineStatusError) as err:
        await client.generate(_req())
    assert err.value.status_code == 500
    assert "no script left" in err.value.engine_message
    engine.push(Failure(400, "The input is longer than the context"))
    with pytest.raises(EngineStatusError) as err:
        await _stream(client, _req())
    assert err.value.status_code == 400
    assert err.value.engine_message == "The input is longer than the context"
    assert [r.status for r in engine.requests] == [500, 400]


async def test_unknown_fields_are_refused(engine: ScriptedEngine, url: str) -> None:
    engine.push([5])
    async with httpx.AsyncClient(base_url=url) as http:
        resp = await http.post("/generate", json={"input_ids": [1], "text": "hi"})
    assert resp.status_code == 400
    assert engine.requests == []
    assert engine.pending == 1


async def test_control_endpoints(engine: ScriptedEngine, client: SGLangClient) -> None:
    assert await client.health()
    engine.healthy = False
    assert not await client.health()
    info = await client.get_model_info()
    assert (info.model_path, info.weight_version) == ("scripted-test-engine", "w7")
    await client.flush_cache()
    assert engine.flushes == 1
    out = await client.update_weights_from_disk("/ckpt/step-3", weight_version="w8")
    assert out.success
    engine.push([5])
    assert (await client.generate(_req())).meta_info.weight_version == "w8"
    await client.abort("some-rid")
    await client.abort_all()
    assert engine.aborts == [
        {"rid": "some-rid", "abort_all": False},
        {"rid": "", "abort_all": True},
    ]


async def test_abort_ends_a_running_stream_with_finish_abort() -> None:
    slow = ScriptedEngine(delay_s=0.2, chunk_tokens=1)
    slow.push(list(range(100, 130)))
    with serve(slow.app) as base:
        async with SGLangClient(base, timeout=10) as c:
            deltas: list[StreamDelta] = []
            async with aclosing(c.stream(_req(rid="r1"))) as stream:
                async for d in stream:
                    deltas.append(d)
                    if len(deltas) == 2:
                        await c.abort("r1")
    final = deltas[-1].finish_reason
    assert final is not None
    assert final.type == "abort"
    tokens = [t for d in deltas for t in d.token_ids]
    assert 2 <= len(tokens) < 30
    assert slow.requests[0].output_ids == tokens
    assert slow.requests[0].finish_reason == final.model_dump(exclude_none=True)


async def test_closing_a_stream_early_is_seen_as_a_disconnect() -> None:
    slow = ScriptedEngine(delay_s=0.1, chunk_tokens=1)
    slow.push(list(range(100, 140)))
    with serve(slow.app) as base:
        async with SGLangClient(base, timeout=10) as c:
            async with aclosing(c.stream(_req())) as stream:
                async for _ in stream:
                    break
            for _ in range(50):
                if slow.requests[0].disconnected:
                    break
                await asyncio.sleep(0.05)
    got = slow.requests[0]
    assert got.disconnected
    assert got.finish_reason is None
    assert 1 <= len(got.output_ids) < 40
