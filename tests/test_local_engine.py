"""The local engine (``corral.engines.local``) against a real tiny model, in process and over HTTP.

Logprobs are checked against a fresh full forward pass of a separately loaded copy of the model,
so batching, padding and KV-cache bookkeeping cannot hide an error.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from corral.engines.local.engine import InvalidRequestError, LocalEngine
from corral.engines.local.server import build_engine_app
from corral.engines.protocol import GenerateRequest, GenerateResponse, SamplingParams
from tests.servers import serve

# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[LocalEngine]:
    eng = LocalEngine(tiny_model_dir, max_batch_size=16)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture(scope="module")
def new_weights_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other random weights for the same architecture (no tokenizer: the engine keeps its own)."""
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config).eval()
    out = tmp_path_factory.mktemp("new-weights")
    model.save_pretrained(str(out))
    return out


@pytest.fixture
async def babbler(new_weights_dir: Path, tiny_model_dir: Path) -> AsyncIterator[LocalEngine]:
    """An engine on random weights: sampling from it gives varied text with EOS rare, which
    the stop-condition tests need (the imprinted model mostly answers and stops)."""
    eng = LocalEngine(new_weights_dir, tokenizer_path=tiny_model_dir)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[tuple[str, LocalEngine]]:
    eng = LocalEngine(tiny_model_dir)
    with serve(build_engine_app(eng)) as url:
        yield url, eng


def prompt(n: int, start: int = 40) -> list[int]:
    """A deterministic prompt of ``n`` ordinary token ids."""
    return [start + (7 * i) % 500 for i in range(n)]


def chat_ids(tokenizer: Any, content: str) -> list[int]:
    """The tiny model's chat prompt for one user message (it was imprinted on such prompts)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def req(ids: list[int], **sp: Any) -> GenerateRequest:
    extra = {k: sp.pop(k) for k in ("rid", "top_logprobs_num", "stream") if k in sp}
    return GenerateRequest(input_ids=ids, sampling_params=SamplingParams(**sp), **extra)


def reference_logprobs(
    model: Any, ids: list[int], out: list[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) (T == 0: plain log_softmax) over the full sequence, at ``out``."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].float()
    scaled = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(scaled, -1)


def assert_logprobs_exact(model: Any, ids: list[int], resp: GenerateResponse, t: float) -> None:
    out = resp.output_ids
    ref = reference_logprobs(model, ids, out, t)
    got = torch.tensor([lp for lp, _, _ in resp.meta_info.output_token_logprobs])
    assert [tok for _, tok, _ in resp.meta_info.output_token_logprobs] == out
    want = ref[torch.arange(len(out)), torch.tensor(out)]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    if t == 0:
        assert out == ref.argmax(-1).tolist()


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    """Poll a counter-like condition set by the server thread (not a sleep as synchronisation:
    it returns as soon as the condition holds)."""
    done = threading.Event()
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        done.wait(0.01)


# ---------------------------------------------------------------------------------------------
# in-process engine
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_logprobs_equal_fresh_forward_in_padded_batch(
    engine: LocalEngine, ref_model: Any, temperature: float
) -> None:
    prompts = [prompt(3), prompt(9, 60), prompt(17, 90), prompt(30, 120)]
    before = engine.steps
    resps = await asyncio.gather(
        *(
            engine.generate(
                req(p, max_new_tokens=12, temperature=temperature, ignore_eos=True, sampling_seed=i)
            )
            for i, p in enumerate(prompts)
        )
    )
    assert engine.steps - before == 12  # one batch: one prefill step, then 11 decode steps
    for p, r in zip(prompts, resps, strict=True):
        assert len(r.output_ids) == 12
        assert_logprobs_exact(ref_model, p, r, temperature)


async def test_late_joiner_batches_continuously_and_stays_exact(
    engine: LocalEngine, ref_model: Any
) -> None:
    pa, pb = prompt(20), prompt(5, 300)
    before = engine.steps
    stream_a = engine.stream(req(pa, max_new_tokens=30, temperature=0.8, ignore_eos=True, rid="a"))
    last_a = None
    async for chunk in stream_a:  # let A run for a while before B arrives
        last_a = chunk
        if chunk.meta_info.completion_tokens >= 5:
            break
    resp_b = await engine.generate(req(pb, max_new_tokens=5, temperature=0.0, ignore_eos=True))
    assert engine.finish_reason("a") is None  # B finished while A was still running
    async for chunk in stream_a:
        last_a = chunk
    assert last_a is not None and last_a.meta_info.finish_reason is not None
    assert last_a.meta_info.completion_tokens == 30
    assert engine.steps - before == 30  # B's 5 tokens rode along A's 30 steps
    assert_logprobs_exact(ref_model, pa, last_a, 0.8)
    assert_logprobs_exact(ref_model, pb, resp_b, 0.0)


async def test_batching_takes_far_fewer_steps_than_sequential(engine: LocalEngine) -> None:
    before = engine.steps
    resps = await asyncio.gather(
        *(
            engine.generate(req(prompt(4 + i, 50 + i), max_new_tokens=16, ignore_eos=True))
            for i in range(8)
        )
    )
    assert all(r.meta_info.completion_tokens == 16 for r in resps)
    assert engine.steps - before <= 20  # sequential would be 8 * 16 = 128


async def test_greedy_is_deterministic(engine: LocalEngine) -> None:
    r = req(prompt(11), max_new_tokens=20, temperature=0.0, ignore_eos=True)
    first = await engine.generate(r)
    others = await asyncio.gather(
        engine.generate(r), engine.generate(req(prompt(3, 70), max_new_tokens=25, temperature=0.0))
    )
    assert first.output_ids == others[0].output_ids
    assert first.text == others[0].text


async def test_seed_gives_same_output_regardless_of_batch_mates(engine: LocalEngine) -> None:
    def seeded(seed: int) -> GenerateRequest:
        return req(
            prompt(8), max_new_tokens=24, temperature=1.0, ignore_eos=True, sampling_seed=seed
        )

    alone = await engine.generate(seeded(7))
    mates = [req(prompt(n, 200 + n), max_new_tokens=30, temperature=1.0) for n in (2, 13, 40)]
    together = await asyncio.gather(engine.generate(seeded(7)), *map(engine.generate, mates))
    assert together[0].output_ids == alone.output_ids
    others = await asyncio.gather(*(engine.generate(seeded(s)) for s in (1, 2, 3)))
    assert len({tuple(r.output_ids) for r in [alone, *others]}) > 1  # the seed matters


async def test_top_logprobs(engine: LocalEngine, ref_model: Any) -> None:
    p = prompt(6)
    r = await engine.generate(
        req(p, max_new_tokens=5, temperature=0.8, ignore_eos=True, top_logprobs_num=3)
    )
    ref = reference_logprobs(ref_model, p, r.output_ids, 0.8)
    assert len(r.meta_info.output_top_logprobs) == 5
    for pos, top in enumerate(r.meta_info.output_top_logprobs):
        assert top is not None and len(top) == 3
        vals, idx = torch.topk(ref[pos], 3)
        assert [t for _, t, _ in top] == idx.tolist()
        assert torch.allclose(torch.tensor([lp for lp, _, _ in top]), vals, atol=1e-4)


async def varied_sample(engine: LocalEngine, p: list[int]) -> tuple[int, list[int]]:
    """A seed whose sampled continuation of ``p`` has at least 12 tokens before any EOS, and
    those tokens. Seeded sampling repeats exactly, so later requests with stop conditions
    follow the same tokens until they stop."""
    for seed in range(20):
        r = await engine.generate(
            req(p, max_new_tokens=40, temperature=1.0, sampling_seed=seed, ignore_eos=True)
        )
        out = r.output_ids
        cut = next((i for i, t in enumerate(out) if t in engine.eos_token_ids), len(out))
        if cut >= 12:
            return seed, out[:cut]
    raise AssertionError("no seed gave a long enough EOS-free sample")


async def test_stop_string_trims_text_but_keeps_completing_token(
    babbler: LocalEngine, tokenizer: Any
) -> None:
    engine = babbler
    p = prompt(12)
    seed, out = await varied_sample(engine, p)
    texts = [tokenizer.decode(out[: j + 1]) for j in range(len(out))]
    full = texts[-1]
    # A stop string taken from the second half of the sampled text.
    stop = next(
        full[i : i + 2]
        for i in range(len(full) // 2, len(full) - 2)
        if not any(c.isspace() or c == "\ufffd" for c in full[i : i + 2])
    )
    j = next(j for j, t in enumerate(texts) if stop in t)

    def stopped(**extra: Any) -> GenerateRequest:
        return req(p, max_new_tokens=40, temperature=1.0, sampling_seed=seed, stop=[stop], **extra)

    r = await engine.generate(stopped())
    assert r.meta_info.finish_reason is not None
    assert r.meta_info.finish_reason.model_dump(exclude_none=True) == {
        "type": "stop",
        "matched": stop,
    }
    assert r.output_ids == out[: j + 1]
    assert r.text == texts[j][: texts[j].index(stop)]
    kept = await engine.generate(stopped(no_stop_trim=True))
    assert kept.output_ids == r.output_ids and kept.text == texts[j]


async def test_stop_token_ids(babbler: LocalEngine, tokenizer: Any) -> None:
    engine = babbler
    p = prompt(12)
    seed, out = await varied_sample(engine, p)
    j = next(j for j in range(3, len(out)) if out[j] not in out[:j])

    def stopped(**extra: Any) -> GenerateRequest:
        return req(
            p,
            max_new_tokens=len(out),
            temperature=1.0,
            sampling_seed=seed,
            stop_token_ids=[out[j]],
            **extra,
        )

    r = await engine.generate(stopped())
    assert r.output_ids == out[: j + 1]  # the stop token is included, like SGLang
    assert r.meta_info.finish_reason is not None
    assert r.meta_info.finish_reason.type == "stop"
    assert r.meta_info.finish_reason.matched == out[j]
    assert r.text == tokenizer.decode(out[:j])
    # ignore_eos disables stop_token_ids as well (SGLang's rule)
    r2 = await engine.generate(stopped(ignore_eos=True))
    assert r2.output_ids == out


async def test_eos_is_included_in_output_ids(engine: LocalEngine, tokenizer: Any) -> None:
    ids = chat_ids(tokenizer, "Say hello.")
    r = await engine.generate(req(ids, max_new_tokens=40, temperature=0.0))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert r.output_ids[-1] == eos
    assert r.meta_info.output_token_logprobs[-1][1] == eos
    assert r.meta_info.finish_reason is not None
    assert r.meta_info.finish_reason.model_dump(exclude_none=True) == {
        "type": "stop",
        "matched": eos,
    }
    assert "<|im_end|>" not in r.text and r.text.strip() == "Hello!"
    past = await engine.generate(
        req(ids, max_new_tokens=len(r.output_ids) + 3, temperature=0.0, ignore_eos=True)
    )
    assert past.output_ids[: len(r.output_ids)] == r.output_ids
    assert (
        past.meta_info.finish_reason is not None and past.meta_info.finish_reason.type == "length"
    )


async def test_max_new_tokens_gives_length(engine: LocalEngine) -> None:
    r = await engine.generate(req(prompt(4), max_new_tokens=7, ignore_eos=True))
    assert r.meta_info.finish_reason is not None and r.meta_info.finish_reason.type == "length"
    assert r.meta_info.completion_tokens == len(r.output_ids) == 7
    assert r.meta_info.prompt_tokens == 4
    zero = await engine.generate(req(prompt(4), max_new_tokens=0))
    assert zero.output_ids == [] and zero.meta_info.finish_reason is not None
    assert zero.meta_info.finish_reason.type == "length"


async def test_invalid_requests_are_refused_before_queueing(engine: LocalEngine) -> None:
    too_long = req(prompt(10), max_new_tokens=engine.context_length or 0)
    with pytest.raises(InvalidRequestError, match="context length"):
        await engine.generate(too_long)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        await engine.generate(req([1, engine.vocab_size], max_new_tokens=2))
    with pytest.raises(InvalidRequestError, match="top_k"):
        await engine.generate(req([1, 2], max_new_tokens=2, top_k=0))
    assert engine.num_active == 0


async def test_abort_keeps_output_and_unknown_rid_is_noop(engine: LocalEngine) -> None:
    assert engine.abort("nobody") is False
    chunks = engine.stream(req(prompt(5), max_new_tokens=500, ignore_eos=True, rid="x"))
    last = None
    async for chunk in chunks:
        last = chunk
        if chunk.meta_info.completion_tokens >= 3 and engine.finish_reason("x") is None:
            assert engine.abort("x") is True
    assert last is not None and last.meta_info.finish_reason is not None
    assert last.meta_info.finish_reason.type == "abort"
    assert 3 <= last.meta_info.completion_tokens < 500
    assert len(last.meta_info.output_token_logprobs) == len(last.output_ids)


async def test_cancelled_generate_aborts(engine: LocalEngine) -> None:
    task = asyncio.ensure_future(
        engine.generate(req(prompt(5), max_new_tokens=500, ignore_eos=True, rid="c"))
    )
    start = engine.steps
    # Yield to the scheduler until it has run 3 steps of this request (a counter, not a timer).
    while engine.steps < start + 3:  # noqa: ASYNC110
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    reason = engine.finish_reason("c")
    assert reason is not None and reason.type == "abort"


async def test_weight_swap_lands_between_steps_of_a_running_request(
    engine: LocalEngine, new_weights_dir: Path
) -> None:
    chunks = engine.stream(req(prompt(6), max_new_tokens=20, temperature=0.0, ignore_eos=True))
    versions = []
    async for chunk in chunks:
        versions.append(chunk.meta_info.weight_version)
        if chunk.meta_info.completion_tokens == 5:
            result = await engine.update_weights_from_disk(new_weights_dir)
            assert result.success, result.message
    assert chunk.meta_info.completion_tokens == 20
    assert chunk.meta_info.finish_reason is not None
    assert versions[0] == "default" and versions[-1] == "1" == engine.weight_version


# ---------------------------------------------------------------------------------------------
# over HTTP
# ---------------------------------------------------------------------------------------------


def sse_chunks(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    for line in lines:
        if line.startswith("data: "):
            body = line[len("data: ") :]
            yield body if body == "[DONE]" else json.loads(body)


def test_http_stream_is_cumulative_and_ends_like_non_stream(
    server: tuple[str, LocalEngine],
) -> None:
    url, _ = server
    body = {
        "input_ids": prompt(9),
        "sampling_params": {"max_new_tokens": 15, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    with httpx.Client(base_url=url, timeout=60) as client:
        plain = client.post("/generate", json=body)
        assert plain.status_code == 200
        with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = list(sse_chunks(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert len(chunks) == len(events) - 1 >= 2
    for prev, cur in itertools.pairwise(chunks):
        assert prev["meta_info"]["finish_reason"] is None
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        n = len(prev["meta_info"]["output_token_logprobs"])
        assert (
            cur["meta_info"]["output_token_logprobs"][:n]
            == prev["meta_info"]["output_token_logprobs"]
        )
        assert cur["text"].startswith(prev["text"])
    final, expected = chunks[-1], plain.json()
    for key in ("text", "output_ids"):
        assert final[key] == expected[key]
    for key in ("finish_reason", "output_token_logprobs", "completion_tokens", "prompt_tokens"):
        assert final["meta_info"][key] == expected["meta_info"][key]
    assert expected["meta_info"]["finish_reason"] == {"type": "length", "length": 15}


def test_http_abort_request_mid_generation(server: tuple[str, LocalEngine]) -> None:
    url, _ = server
    body = {
        "input_ids": prompt(7),
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
        "stream": True,
        "rid": "http-abort",
    }
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.post("/abort_request", json={"rid": "unknown"}).status_code == 200
        chunks = []
        aborted = False
        with client.stream("POST", "/generate", json=body) as resp:
            for event in sse_chunks(resp.iter_lines()):
                if event == "[DONE]":
                    break
                assert isinstance(event, dict)
                chunks.append(event)
                if not aborted and event["meta_info"]["completion_tokens"] >= 3:
                    r = client.post("/abort_request", json={"rid": "http-abort"})
                    assert r.status_code == 200
                    aborted = True
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(final["output_ids"]) < 1000


def test_http_client_disconnect_aborts(server: tuple[str, LocalEngine]) -> None:
    url, engine = server
    body = {
        "input_ids": prompt(7),
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        "stream": True,
        "rid": "gone",
    }
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("POST", "/generate", json=body) as resp,
    ):
        for n, _ in enumerate(sse_chunks(resp.iter_lines())):
            if n >= 2:
                break
    # leaving the block closed the connection mid-stream
    wait_for(lambda: engine.finish_reason("gone") is not None)
    reason = engine.finish_reason("gone")
    assert reason is not None and reason.type == "abort"


def test_http_non_stream_client_disconnect_aborts(server: tuple[str, LocalEngine]) -> None:
    url, engine = server
    body = {
        "input_ids": prompt(7),
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        "rid": "gone-plain",
    }
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    start = engine.steps
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_for(lambda: engine.steps > start + 2)
    # the socket is closed while the request is still generating
    wait_for(lambda: engine.finish_reason("gone-plain") is not None)
    reason = engine.finish_reason("gone-plain")
    assert reason is not None and reason.type == "abort"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (json.dumps({"input_ids": "abc"}).encode(), "input_ids"),
        (json.dumps({"input_ids": []}).encode(), "input_ids"),
        (
            json.dumps({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}).encode(),
            "temperature",
        ),
        (json.dumps({"text": "hello"}).encode(), "text"),
        (json.dumps({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}).encode(), "top_k"),
        (json.dumps({"input_ids": [1, 10**9]}).encode(), "vocabulary"),
        (json.dumps({"input_ids": [1] * 20000}).encode(), "context length"),
        (json.dumps({"input_ids": [1] * 20000, "stream": True}).encode(), "context length"),
    ],
    ids=[
        "malformed",
        "ids-type",
        "ids-empty",
        "temp-type",
        "text-input",
        "top-k",
        "vocab",
        "too-long",
        "too-long-stream",
    ],
)
def test_http_bad_input_is_400(
    server: tuple[str, LocalEngine], content: bytes, needle: str
) -> None:
    url, _ = server
    r = httpx.post(f"{url}/generate", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert needle in err["message"]


def test_http_info_endpoints(server: tuple[str, LocalEngine], tiny_model_dir: Path) -> None:
    url, _ = server
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/health").status_code == 200
        info = client.get("/get_model_info").json()
        assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
        assert client.post("/flush_cache").status_code == 200
        assert client.get("/get_server_info").json()["engine"] == "corral-local"
        bad = client.post("/abort_request", json={"rid": 3})
        assert bad.status_code == 400


def test_http_update_weights_from_disk(tiny_model_dir: Path, new_weights_dir: Path) -> None:
    new = AutoModelForCausalLM.from_pretrained(str(new_weights_dir), dtype=torch.float32).eval()
    ids = prompt(9)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
    }
    engine = LocalEngine(tiny_model_dir)
    with serve(build_engine_app(engine)) as url, httpx.Client(base_url=url, timeout=60) as client:
        before = client.post("/generate", json=body).json()
        assert before["meta_info"]["weight_version"] == "default"
        r = client.post("/update_weights_from_disk", json={"model_path": str(new_weights_dir)})
        assert r.status_code == 200 and r.json()["success"] is True
        assert client.get("/get_model_info").json()["weight_version"] == "1"
        after = GenerateResponse.model_validate(client.post("/generate", json=body).json())
        assert after.meta_info.weight_version == "1"
        assert after.output_ids != before["output_ids"]
        assert_logprobs_exact(new, ids, after, 0.0)
        named = client.post(
            "/update_weights_from_disk",
            json={"model_path": str(tiny_model_dir), "weight_version": "v7"},
        )
        assert named.json()["success"] is True
        again = client.post("/generate", json=body).json()
        assert again["output_ids"] == before["output_ids"]
        assert again["meta_info"]["weight_version"] == "v7"
        missing = client.post(
            "/update_weights_from_disk", json={"model_path": str(new_weights_dir / "no")}
        )
        assert missing.status_code == 400 and missing.json()["success"] is False
        assert client.get("/get_model_info").json()["weight_version"] == "v7"


async def test_weights_of_the_loaded_architecture_are_copied_in_place(
    tiny_model_dir: Path, new_weights_dir: Path, tmp_path: Path
) -> None:
    """A trainer's next weights (the same config) go into the loaded model: no new model is
    built per step. Another config with the same shapes is loaded as a new model."""
    engine = LocalEngine(tiny_model_dir)
    await engine.start()
    try:
        loaded = engine._worker.model
        answer = await engine.update_weights_from_disk(new_weights_dir, weight_version="w1")
        assert answer.success and engine._worker.model is loaded
        assert engine.model_info().model_path == str(new_weights_dir)
        on_disk = AutoModelForCausalLM.from_pretrained(str(new_weights_dir)).state_dict()
        own = loaded.state_dict()
        assert all(torch.equal(own[name], tensor) for name, tensor in on_disk.items())

        config = AutoConfig.from_pretrained(str(new_weights_dir))
        config.max_position_embeddings = 2 * config.max_position_embeddings
        other = AutoModelForCausalLM.from_pretrained(str(new_weights_dir), config=config)
        other.save_pretrained(str(tmp_path / "other"))
        answer = await engine.update_weights_from_disk(tmp_path / "other", weight_version="w2")
        assert answer.success and engine._worker.model is not loaded
        assert engine.model_info().weight_version == "w2"
    finally:
        await engine.stop()
