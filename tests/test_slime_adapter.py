"""The slime and Miles adapters against real local servers: the tiny model on corral's local
engine standing in for slime's SGLang router (it speaks the same API), the gridsim env server,
rows written by the row writer, and the gateway the adapter serves itself in front of the engine.

slime and Miles cannot be installed here: their types come from ``tests/slime_standin.py``
(same fields, written from their source at the commits it names), registered under their module
names. The tiny model was imprinted to call a weather tool, so in gridsim it makes unknown-tool
calls and is graded 0: a real reward, not a failure.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from transformers import AutoTokenizer

from corral.adapters import miles as miles_adapter
from corral.adapters import slime as slime_adapter
from corral.envs.server import build_app
from corral.gateway.client import GatewayAdmin
from corral.rollouts.rows import RowSettings, write_rows
from corral.samples import Sample as CorralSample
from tests import slime_standin as standin
from tests.conftest import ROOT
from tests.servers import serve

# slime's own sampling_params for a training rollout (GenerateState in sglang_rollout.py).
SLIME_PARAMS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 96,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
}
SESSION_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 96}
Status = standin.Sample.Status


class GatedEngine:
    """The engine app, able to hold the next ``/generate`` until released: a rollout is then
    certainly in flight (its episode open, its model call pending) when a test acts on it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.url = ""
        self.called = threading.Event()
        self.release = threading.Event()
        self._armed = False

    def arm(self) -> None:
        self.called.clear()
        self.release.clear()
        self._armed = True

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._armed and scope["type"] == "http" and scope["path"] == "/generate":
            self._armed = False
            self.called.set()
            await asyncio.to_thread(self.release.wait, 60)
        await self.app(scope, receive, send)


@dataclass
class Gridsim:
    app: Any
    url: str
    rows: list[dict[str, Any]]


@dataclass
class Spy:
    """What the adapter's player asked the real gateway (the calls still go through)."""

    opened: list[dict[str, Any]] = field(default_factory=list)
    samples: dict[str, list[CorralSample]] = field(default_factory=dict)
    closed: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def slime_modules() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        standin.install(mp)
        yield


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[GatedEngine]:
    from corral.engines.local.engine import LocalEngine
    from corral.engines.local.server import build_engine_app

    gate = GatedEngine(build_engine_app(LocalEngine(tiny_model_dir)))
    with serve(gate) as url:
        gate.url = url
        yield gate
        gate.release.set()


@pytest.fixture(scope="module")
def gridsim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gridsim]:
    app = build_app(ROOT / "bundles" / "gridsim")
    with serve(app) as url:
        out = tmp_path_factory.mktemp("rows")
        write_rows(url, out, RowSettings(max_turns=2))
        lines = (out / "eval.jsonl").read_text().splitlines()[:6]
        yield Gridsim(app, url, [json.loads(line) for line in lines])


@pytest.fixture(scope="module")
def args(slime_modules: None, engine: GatedEngine, tiny_model_dir: Path) -> Iterator[Namespace]:
    """slime's args as its rollout process has them (the fields the adapter reads)."""
    address = urlsplit(engine.url)
    yield Namespace(
        sglang_router_ip=address.hostname,
        sglang_router_port=address.port,
        hf_checkpoint=str(tiny_model_dir),
        apply_chat_template_kwargs={},
        sglang_tool_call_parser="qwen25",
        sglang_reasoning_parser=None,
        rollout_max_context_len=None,
        reward_key=None,
    )
    slime_adapter.shutdown()


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    seen = Spy()
    real_open, real_samples = GatewayAdmin.open_session, GatewayAdmin.samples
    real_close = GatewayAdmin.close_session

    async def open_session(admin: GatewayAdmin, **kw: Any) -> Any:
        handle = await real_open(admin, **kw)
        seen.opened.append({"id": handle.id, "url": admin.url, **kw})
        return handle

    async def samples(admin: GatewayAdmin, session_id: str) -> list[CorralSample]:
        got = await real_samples(admin, session_id)
        seen.samples[session_id] = got
        return got

    async def close_session(admin: GatewayAdmin, session_id: str) -> None:
        await real_close(admin, session_id)
        seen.closed.append(session_id)

    monkeypatch.setattr(GatewayAdmin, "open_session", open_session)
    monkeypatch.setattr(GatewayAdmin, "samples", samples)
    monkeypatch.setattr(GatewayAdmin, "close_session", close_session)
    return seen


@pytest.fixture
def episode_closed(gridsim: Gridsim, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set when the env server closes an episode (its manager runs in the server's thread)."""
    manager = gridsim.app.state.episodes
    closed = threading.Event()
    real_close = manager.close

    async def close(episode: Any, status: str | None = None) -> None:
        await real_close(episode, status)
        closed.set()

    monkeypatch.setattr(manager, "close", close)
    return closed


def slime_sample(row: dict[str, Any], *, group_index: int, index: int, cls: Any = None) -> Any:
    """What slime's data source makes of a row with --input-key messages --metadata-key metadata
    (no --apply-chat-template): the messages as the prompt, the row's metadata as metadata."""
    cls = cls or standin.Sample
    return cls(
        prompt=copy.deepcopy(row["messages"]),
        metadata=copy.deepcopy(row["metadata"]),
        group_index=group_index,
        index=index,
    )


def failing_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with a model deadline no model meets: the rollout fails before any turn."""
    bad = copy.deepcopy(row)
    bad["metadata"]["env"]["model_timeout"] = 0.001
    return bad


# --------------------------------------------------------------------------- with servers


async def test_a_rollout_comes_back_as_slime_samples_token_exact_with_the_gateways(
    args: Namespace, gridsim: Gridsim, spy: Spy, tiny_model_dir: Path
) -> None:
    row = gridsim.rows[0]
    out = await slime_adapter.generate(
        args, slime_sample(row, group_index=4, index=9), SLIME_PARAMS
    )

    (opened,) = spy.opened
    assert opened["sampling"] == SESSION_SAMPLING
    assert (opened["group_index"], opened["index"]) == (4, 9)
    recorded = spy.samples[opened["id"]]
    assert spy.closed == [opened["id"]]  # the session is gone once its samples are taken
    assert isinstance(out, list) and len(out) == len(recorded) >= 1
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for sample, gateway in zip(out, recorded, strict=True):
        assert isinstance(sample, standin.Sample)
        assert (sample.rollout_id, sample.group_index, sample.index) == (9, 4, 9)
        assert sample.tokens == gateway.tokens
        assert sample.response_length == gateway.response_length > 0
        assert sample.loss_mask == gateway.loss_mask
        assert sample.rollout_log_probs == gateway.rollout_log_probs
        assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
        assert sample.reward == gateway.reward == 0.0  # graded, not failed: a real 0
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
        assert sample.status.value == gateway.status and not sample.remove_sample
        assert sample.response == tok.decode(sample.tokens[-sample.response_length :])
        assert sample.prompt == row["messages"]
        meta = sample.metadata
        assert meta["task_id"] == row["metadata"]["task_id"] and meta["env"]["url"] == gridsim.url
        assert meta["session_id"] == opened["id"] and "failure" not in meta
        assert meta["episode_turns"] >= 1 and set(meta["timing"]) == {
            "model_s",
            "tools_s",
            "total_s",
        }
    text = tok.apply_chat_template(
        row["messages"], tools=row["metadata"]["tools"], add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    assert out[0].tokens[: len(prompt)] == prompt


async def test_evaluation_gives_one_sample_per_episode_and_a_failed_one_scores_zero(
    args: Namespace, gridsim: Gridsim, spy: Spy
) -> None:
    slime_adapter.shutdown()  # the first generates of a process race to start the gateway
    rows = [gridsim.rows[1], gridsim.rows[2], failing_row(gridsim.rows[3])]
    outs = await asyncio.gather(
        *(
            slime_adapter.generate(
                args, slime_sample(r, group_index=0, index=i), SLIME_PARAMS, evaluation=True
            )
            for i, r in enumerate(rows)
        )
    )
    assert len({o["url"] for o in spy.opened}) == 1  # one gateway, started once
    assert [len(o) for o in outs] == [1, 1, 1]
    good, other, failed = (o[0] for o in outs)
    for sample in (good, other):
        assert sample.reward == 0.0 and sample.status != Status.FAILED
        assert sample.tokens == [] and sample.response_length == 0 and sample.remove_sample
        assert "failure" not in sample.metadata and isinstance(sample.metadata["scores"], dict)
    assert failed.reward == 0.0 and failed.status == Status.FAILED
    assert failed.metadata["failure"].startswith("model: no answer within model_timeout")
    assert [s.index for s in (good, other, failed)] == [0, 1, 2]


async def test_a_failed_rollout_is_flagged_and_its_group_left_out(
    args: Namespace, gridsim: Gridsim, spy: Spy
) -> None:
    ok_row, bad_row = gridsim.rows[4], failing_row(gridsim.rows[4])
    ok, bad = await asyncio.gather(
        slime_adapter.generate(args, slime_sample(ok_row, group_index=7, index=20), SLIME_PARAMS),
        slime_adapter.generate(args, slime_sample(bad_row, group_index=7, index=21), SLIME_PARAMS),
    )
    (flagged,) = bad  # no turn was recorded: one sample, nothing to train on
    assert flagged.status == Status.ABORTED and flagged.remove_sample and flagged.reward == 0.0
    assert flagged.metadata["failure"].startswith("model: no answer within model_timeout")
    assert flagged.rollout_id == 21 and all(s.rollout_id == 20 for s in ok)
    dropped = slime_adapter.keep_scored_groups(args, [ok, bad])
    assert isinstance(dropped, standin.DynamicFilterOutput)
    assert (dropped.keep, dropped.reason) == (False, "failed_rollout")
    kept = slime_adapter.keep_scored_groups(args, [ok, copy.deepcopy(ok)])
    assert (kept.keep, kept.reason) == (True, None)


async def test_cancelling_a_generate_closes_its_episode(
    args: Namespace,
    gridsim: Gridsim,
    engine: GatedEngine,
    spy: Spy,
    episode_closed: threading.Event,
) -> None:
    manager = gridsim.app.state.episodes
    engine.arm()
    try:
        task = asyncio.ensure_future(
            slime_adapter.generate(
                args, slime_sample(gridsim.rows[5], group_index=1, index=30), SLIME_PARAMS
            )
        )
        assert await asyncio.to_thread(engine.called.wait, 60)  # the model call is in flight
        assert manager.active == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Closed while the model call is still held: by the cancellation, not by a finished play.
        assert await asyncio.to_thread(episode_closed.wait, 30)
        assert manager.active == 0
        assert spy.closed == [spy.opened[0]["id"]]  # and the session was deleted
    finally:
        engine.release.set()


async def test_slime_aborting_the_step_ends_an_in_flight_rollout_as_aborted(
    args: Namespace,
    gridsim: Gridsim,
    engine: GatedEngine,
    spy: Spy,
    episode_closed: threading.Event,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slime_adapter, "ABORT_POLL_S", 0.02)
    state = standin.GenerateState(args)  # slime's singleton, as generate_and_rm made it
    manager = gridsim.app.state.episodes
    engine.arm()
    try:
        task = asyncio.ensure_future(
            slime_adapter.generate(
                args, slime_sample(gridsim.rows[5], group_index=1, index=31), SLIME_PARAMS
            )
        )
        assert await asyncio.to_thread(engine.called.wait, 60)
        state.aborted = True  # what slime's abort() does once it has enough groups
        (out,) = await task
        assert await asyncio.to_thread(episode_closed.wait, 30)  # with the model call held
        assert manager.active == 0
        assert spy.closed == [spy.opened[0]["id"]]
    finally:
        engine.release.set()
    assert out.status == Status.ABORTED and out.remove_sample and out.rollout_id == 31
    assert "aborted" in out.metadata and out.tokens == []
    # A generate that starts after the abort plays nothing.
    (late,) = await slime_adapter.generate(
        args, slime_sample(gridsim.rows[5], group_index=1, index=32), SLIME_PARAMS
    )
    assert late.status == Status.ABORTED and len(spy.opened) == 1
    state.aborted = False


async def test_a_gateway_named_in_the_environment_is_used_instead(
    args: Namespace,
    gridsim: Gridsim,
    engine: GatedEngine,
    spy: Spy,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from corral.gateway.server import create_gateway

    slime_adapter.shutdown()
    with serve(create_gateway(engine.url, tiny_model_dir, admin_token="ext")) as url:
        monkeypatch.setenv(slime_adapter.GATEWAY_URL_VAR, url)
        monkeypatch.setenv(slime_adapter.GATEWAY_TOKEN_VAR, "ext")
        try:
            out = await slime_adapter.generate(
                args, slime_sample(gridsim.rows[0], group_index=0, index=40), SLIME_PARAMS
            )
        finally:
            slime_adapter.shutdown()  # forget it: later tests serve their own again
    assert [o["url"] for o in spy.opened] == [url]
    assert out and all(s.rollout_id == 40 and s.reward == 0.0 for s in out)


async def test_miles_generate_returns_miles_samples_through_the_same_path(
    args: Namespace, gridsim: Gridsim, spy: Spy
) -> None:
    row = gridsim.rows[0]
    state = standin.MilesGenerateState(args)
    sample = slime_sample(row, group_index=2, index=50, cls=standin.MilesSample)
    out = await miles_adapter.generate(standin.GenerateFnInput(state, sample, SLIME_PARAMS, False))
    assert isinstance(out, standin.GenerateFnOutput) and isinstance(out.samples, list)
    samples = out.samples
    recorded = spy.samples[spy.opened[0]["id"]]
    assert [s.tokens for s in samples] == [s.tokens for s in recorded]
    assert all(isinstance(s, standin.MilesSample) and s.rollout_id == 50 for s in samples)
    assert all(
        s.reward == 0.0 and s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples
    )
    verdict = miles_adapter.keep_scored_groups(args, [samples])
    assert isinstance(verdict, standin.MilesDynamicFilterOutput) and verdict.keep
    state.aborted = True  # Miles' abort flag lives on the state it hands over
    again = await miles_adapter.generate(
        standin.GenerateFnInput(state, sample, SLIME_PARAMS, False)
    )
    (aborted,) = again.samples
    assert aborted.status == Status.ABORTED and len(spy.opened) == 1


# --------------------------------------------------------------------------- units


def _made(
    rollout_id: int,
    *,
    group: int = 0,
    reward: float = 1.0,
    status: Any = Status.COMPLETED,
    **meta: Any,
) -> standin.Sample:
    """slime's sample of rollout ``rollout_id`` (its ``index`` too) in ``group``, with
    ``meta`` as its metadata."""
    return standin.Sample(
        group_index=group,
        index=rollout_id,
        rollout_id=rollout_id,
        status=status,
        reward=reward,
        metadata=dict(meta),
    )


def test_keep_scored_groups_drops_exactly_the_groups_with_a_flagged_rollout(
    slime_modules: None,
) -> None:
    args = Namespace()
    fine_flat = [_made(0), _made(1)]
    fine_nested = [[_made(2), _made(2)], [_made(3)]]  # a rollout may give several samples
    one_failed = [[_made(4), _made(4, failure="env: gone")], [_made(5)]]
    failed_status = [_made(6), _made(7, status=Status.FAILED)]
    one_aborted = [[_made(8)], [_made(9, status=Status.ABORTED)]]
    verdicts = {
        name: slime_adapter.keep_scored_groups(args, group)
        for name, group in {
            "fine_flat": fine_flat,
            "fine_nested": fine_nested,
            "one_failed": one_failed,
            "failed_status": failed_status,
            "one_aborted": one_aborted,
        }.items()
    }
    assert all(isinstance(v, standin.DynamicFilterOutput) for v in verdicts.values())
    assert {k: (v.keep, v.reason) for k, v in verdicts.items()} == {
        "fine_flat": (True, None),
        "fine_nested": (True, None),
        "one_failed": (False, "failed_rollout"),
        "failed_status": (False, "failed_rollout"),
        "one_aborted": (False, "aborted_rollout"),
    }
    assert slime_adapter.flagged_rollouts(one_failed + one_aborted) == {
        4: "failed_rollout",
        9: "aborted_rollout",
    }
    assert not any(v.keep_when_insufficient for v in verdicts.values())


def test_slime_sampling_params_map_to_session_overrides() -> None:
    assert slime_adapter.session_sampling(SLIME_PARAMS, evaluation=False) == SESSION_SAMPLING
    full = {**SLIME_PARAMS, "stop": ["</s>"], "sampling_seed": 7, "min_new_tokens": 0}
    assert slime_adapter.session_sampling(full, evaluation=False) == {
        **SESSION_SAMPLING,
        "stop": ["</s>"],
        "seed": 7,
    }
    with pytest.raises(ValueError, match="stop_token_ids"):
        slime_adapter.session_sampling({**SLIME_PARAMS, "stop_token_ids": [2]}, evaluation=False)
    with pytest.raises(ValueError, match="repetition_penalty"):
        slime_adapter.session_sampling({"repetition_penalty": 1.1}, evaluation=True)
    replay = {**SLIME_PARAMS, "top_p": 0.9, "custom_params": {"return_top_p_token_ids": True}}
    with pytest.raises(ValueError, match=r"--rollout-top-p 1\.0"):
        slime_adapter.session_sampling(replay, evaluation=False)
    assert slime_adapter.session_sampling(replay, evaluation=True)["top_p"] == 0.9


def test_gateway_settings_follow_slimes_args_and_corrals_variables() -> None:
    args = Namespace(
        sglang_tool_call_parser="qwen3_coder",
        sglang_reasoning_parser="deepseek-r1",
        apply_chat_template_kwargs='{"enable_thinking": false}',
        rollout_max_context_len=4096,
        sglang_router_request_timeout_secs=900,
    )
    assert slime_adapter.gateway_settings(args, {}) == {
        "tool_call_parser": "qwen3_coder",
        "reasoning_parser": "deepseek_r1",
        "chat_template_kwargs": {"enable_thinking": False},
        "max_context_tokens": 4096,
        "engine_timeout_s": 900.0,
    }
    env = {slime_adapter.TOOL_CALL_PARSER_VAR: "llama3", slime_adapter.REASONING_PARSER_VAR: "none"}
    chosen = slime_adapter.gateway_settings(args, env)
    assert (chosen["tool_call_parser"], chosen["reasoning_parser"]) == ("llama3", "none")
    assert slime_adapter.gateway_settings(Namespace(), {}) == {}
    assert slime_adapter.router_url(Namespace(sglang_router_ip="::1", sglang_router_port=3000)) == (
        "http://[::1]:3000"
    )
    with pytest.raises(ValueError, match="sglang_router_ip"):
        slime_adapter.router_url(Namespace(sglang_router_ip=None, sglang_router_port=None))


def test_a_sample_that_is_not_a_corral_row_is_refused_with_the_flag_to_fix(
    slime_modules: None,
) -> None:
    rendered = standin.Sample(prompt="<|im_start|>user ...", metadata={})
    with pytest.raises(ValueError, match="without --apply-chat-template"):
        slime_adapter.row_from_sample(rendered)
    no_metadata = standin.Sample(prompt=[{"role": "user", "content": "hi"}], metadata={})
    with pytest.raises(ValueError, match="--metadata-key metadata"):
        slime_adapter.row_from_sample(no_metadata)


def test_group_rewards_are_normalised_per_rollout_not_per_sample(slime_modules: None) -> None:
    # Group 0: rollout 1 gave three samples (reward 1), rollout 2 one (reward 0).
    samples = [_made(1, group=0, reward=1.0)] * 3 + [
        _made(2, group=0, reward=0.0),
        _made(3, group=1, reward=0.5),
        _made(4, group=1, reward=0.5),
    ]
    grpo = Namespace(
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        reward_key=None,
    )
    raw, rewards = slime_adapter.normalize_group_rewards(grpo, samples)
    assert raw == [1.0, 1.0, 1.0, 0.0, 0.5, 0.5]
    spread = 2**-0.5  # the sample std of {1, 0}: the baseline counts each rollout once
    assert rewards[:4] == pytest.approx([0.5 / spread] * 3 + [-0.5 / spread], rel=1e-5)
    assert rewards[4:] == [0.0, 0.0]
    plain = Namespace(advantage_estimator="ppo", rewards_normalization=True, reward_key=None)
    assert slime_adapter.normalize_group_rewards(plain, samples) == (raw, raw)
