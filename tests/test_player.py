"""The episode player against real local servers: the tiny model on the local engine, the
gateway, and env servers for gridsim and a weather bundle built here.

The tiny model was imprinted to call a ``get_weather(city)`` tool, so the weather bundle (whose
one tool has that name) gets real tool calls from it; each of its tasks says how its env
behaves (answer, raise, hang, or a verifier that crashes) to drive every failure path. In
gridsim the tiny model cannot play: it makes unknown-tool calls and is graded on an empty
schedule (a real reward of 0, not a failure).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from corral.envs.client import EnvClient
from corral.envs.server import build_app
from corral.gateway.client import GatewayAdmin
from corral.rollouts.player import Player, PlayerError
from corral.rollouts.rows import Row, RowSettings, write_rows
from corral.stack import local_stack
from tests.conftest import ROOT
from tests.processes import kill_processes_in
from tests.servers import serve
from tests.weather import write_weather_bundle

ADMIN = "admin-secret"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def weather_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_weather_bundle(tmp_path_factory.mktemp("bundles") / "weather")


@dataclass
class Stack:
    gateway: str
    model_dir: Path


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[Stack]:
    with local_stack(tiny_model_dir, admin_token=ADMIN) as urls:
        yield Stack(urls.gateway, tiny_model_dir)


async def _rows(
    url: str, tmp_path: Path, token: str | None = None, **settings: Any
) -> dict[str, Row]:
    # write_rows runs its own event loop: off this one.
    out = tmp_path / "rows"
    await asyncio.to_thread(write_rows, url, out, RowSettings(**settings), token=token)
    rows = [json.loads(line) for line in (out / "all.jsonl").read_text().splitlines()]
    return {r["metadata"]["task_id"]: Row.model_validate(r) for r in rows}


async def _play(stack: Stack, row: Row, **kw: Any) -> Any:
    async with GatewayAdmin(stack.gateway, ADMIN) as admin:
        return await Player(admin, sampling=GREEDY).play(row, **kw)


async def test_a_weather_rollout_is_token_exact_and_carries_the_reward(
    stack: Stack, weather_bundle: Path, tmp_path: Path
) -> None:
    with serve(build_app(weather_bundle)) as url:
        row = (await _rows(url, tmp_path))["w-ok"]
        rollout = await _play(stack, row, group_index=3, index=7, metadata={"run": "t"})
    assert not rollout.failed and rollout.reason is None
    assert rollout.reward == 1.0 and rollout.scores == {"right_city": 1.0}
    assert rollout.turns == 1
    (sample,) = rollout.samples
    assert sample.reward == 1.0 and sample.status == "completed"
    assert sample.rollout_id == rollout.session_id
    assert (sample.group_index, sample.index) == (3, 7)
    assert sample.metadata["task_id"] == "w-ok" and sample.metadata["run"] == "t"
    # Token-exact: the prompt is the chat template's rendering of the row with its tools, and
    # the model's tokens decode to the assistant's tool call.
    tok = AutoTokenizer.from_pretrained(stack.model_dir)
    text = tok.apply_chat_template(
        row.messages, tools=row.metadata.tools, add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    assert sample.tokens[: sample.prompt_length] == list(prompt)
    model_tokens = [t for t, m in zip(sample.tokens[sample.prompt_length :], sample.loss_mask,
                                      strict=True) if m]  # fmt: skip
    assert "get_weather" in tok.decode(model_tokens) and "Paris" in tok.decode(model_tokens)
    assert all(lp <= 0.0 for lp in sample.rollout_log_probs)


async def test_a_gridsim_rollout_is_graded_even_when_the_model_cannot_play(
    stack: Stack, tmp_path: Path
) -> None:
    with serve(build_app(ROOT / "bundles" / "gridsim")) as url:
        rows = await _rows(url, tmp_path, max_turns=2)
        row = next(r for r in rows.values() if r.metadata.split == "eval")
        rollout = await _play(stack, row)
    assert not rollout.failed and rollout.reward == 0.0  # no schedule submitted: graded 0
    assert 1 <= rollout.turns <= 2 and rollout.samples
    assert rollout.messages[-1]["role"] in ("assistant", "tool")
    assert all(s.reward == 0.0 and s.status != "failed" for s in rollout.samples)
    assert rollout.timing.model_s > 0 and rollout.timing.tools_s > 0
    assert rollout.timing.total_s >= rollout.timing.model_s + rollout.timing.tools_s


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("raise", "env: execution_error: the env raised RuntimeError: the weather service is down"),
        ("hang", "env: timeout"),
        ("crash", "no reward: the verifier crashed on purpose"),
    ],
)
async def test_env_and_verifier_failures_flag_the_rollout(
    stack: Stack, weather_bundle: Path, tmp_path: Path, mode: str, reason: str
) -> None:
    with serve(build_app(weather_bundle, tool_timeout=1.0)) as url:
        rollout = await _play(stack, (await _rows(url, tmp_path, tool_timeout=1.0))[f"w-{mode}"])
    assert rollout.failed and rollout.reward is None
    assert rollout.reason is not None and rollout.reason.startswith(reason.split(":")[0])
    assert reason.split(": ", 1)[1] in rollout.reason
    assert rollout.samples and all(s.status == "failed" for s in rollout.samples)
    assert all(s.metadata.get("failure") == rollout.reason for s in rollout.samples)


async def test_a_model_timeout_flags_the_rollout_and_no_turn_gives_an_aborted_sample(
    stack: Stack, weather_bundle: Path, tmp_path: Path
) -> None:
    with serve(build_app(weather_bundle)) as url:
        rollout = await _play(stack, (await _rows(url, tmp_path, model_timeout=0.001))["w-ok"])
        async with EnvClient(url) as probe:  # the episode was closed: the server has room
            await probe.reset(split="train", index=0)
    assert rollout.failed and rollout.reason is not None
    assert rollout.reason.startswith("model: no answer within model_timeout")
    (sample,) = rollout.samples
    assert sample.remove_sample and sample.status == "aborted" and sample.tokens == []
    assert sample.rollout_id == rollout.session_id


async def test_a_full_server_delays_the_rollout_instead_of_failing_it(
    stack: Stack, weather_bundle: Path, tmp_path: Path
) -> None:
    app = build_app(weather_bundle, max_concurrent_envs=1)
    manager = app.state.episodes
    with serve(app) as url:
        row = (await _rows(url, tmp_path))["w-ok"]
        async with EnvClient(url) as blocker:
            await blocker.reset(split="train", index=0)
            waiting = asyncio.Event()
            loop = asyncio.get_running_loop()  # the hook runs on the server's thread
            manager.on_capacity_wait = lambda: loop.call_soon_threadsafe(waiting.set)
            play = asyncio.ensure_future(_play(stack, row))
            await waiting.wait()  # the player's reset is waiting for room
        # the blocker's episode closed with its socket: the player gets the room
        rollout = await play
    assert not rollout.failed and rollout.reward == 1.0


async def test_cancelling_a_rollout_closes_its_episode_and_deletes_its_session(
    stack: Stack, weather_bundle: Path, tmp_path: Path
) -> None:
    app = build_app(weather_bundle, tool_timeout=60.0)
    manager = app.state.episodes
    with serve(app) as url:
        row = (await _rows(url, tmp_path))["w-hang"]
        async with GatewayAdmin(stack.gateway, ADMIN) as admin:
            opened: list[str] = []
            real_open = admin.open_session

            async def open_session(**kw: Any) -> Any:
                handle = await real_open(**kw)
                opened.append(handle.id)
                return handle

            admin.open_session = open_session  # type: ignore[method-assign]
            play = asyncio.ensure_future(Player(admin, sampling=GREEDY).play(row))
            # The episode is live (its tool hangs) once the server counts it: the server runs
            # in another thread, so this polls it (an interval, not synchronisation).
            while manager.active == 0 or not opened:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            play.cancel()
            with pytest.raises(asyncio.CancelledError):
                await play
            async with httpx.AsyncClient() as http:
                gone = await http.get(
                    f"{stack.gateway}/sessions/{opened[0]}",
                    headers={"Authorization": f"Bearer {ADMIN}"},
                )
            assert gone.status_code == 404
        while manager.active:  # noqa: ASYNC110 -- until the server notices the closed socket
            await asyncio.sleep(0.02)
        assert manager.active == 0


async def test_a_row_whose_token_variable_is_unset_is_refused(
    stack: Stack, weather_bundle: Path, tmp_path: Path
) -> None:
    with serve(build_app(weather_bundle, token="s3cret")) as url:
        row = (await _rows(url, tmp_path, token="s3cret", token_var="WEATHER_TOKEN"))["w-ok"]
        async with GatewayAdmin(stack.gateway, ADMIN) as admin:
            with pytest.raises(PlayerError, match="WEATHER_TOKEN is not set"):
                await Player(admin, env={}).play(row)
            rollout = await Player(admin, env={"WEATHER_TOKEN": "s3cret"}, sampling=GREEDY).play(
                row
            )
    assert rollout.reward == 1.0


async def test_an_env_killed_mid_episode_flags_the_rollout(
    stack: Stack, weather_bundle: Path, tmp_path: Path
) -> None:
    """The env runs in a local sandbox (a subprocess); it is killed while its tool call runs."""
    from corral.sandboxes.local import LocalProvider

    provider = LocalProvider("test-player", state_dir=tmp_path / "sandboxes")
    with serve(build_app(weather_bundle, sandbox=provider, tool_timeout=30.0)) as url:
        row = (await _rows(url, tmp_path, tool_timeout=30.0))["w-stall"]
        play = asyncio.ensure_future(_play(stack, row))
        folder = tmp_path / "sandboxes" / "local"
        # The tool call is running once it marks its folder (polled: another process).
        while not list(folder.glob("*/hanging")):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        (marker,) = folder.glob("*/hanging")
        assert kill_processes_in(marker.parent) > 0
        rollout = await play
    assert rollout.failed and rollout.reward is None
    assert rollout.reason is not None
    assert rollout.reason.startswith("env: execution_error: the env stopped answering")
    assert all(s.status == "failed" for s in rollout.samples)


async def test_a_gateway_lost_at_the_end_of_an_episode_flags_the_rollout(
    stack: Stack, weather_bundle: Path, tmp_path: Path
) -> None:
    """The reward cannot reach the session (the gateway answers with an error): the rollout is
    flagged failed with the reason, so a training run drops its group instead of stopping."""
    from corral.gateway.client import GatewayAdminError
    from corral.trainer.groups import DROP_FAILED, TrainRollout

    class Flaky(GatewayAdmin):
        async def set_reward(self, session_id: str, reward: float) -> None:
            raise GatewayAdminError("the gateway at ... is unreachable: ReadError")

    with serve(build_app(weather_bundle)) as url:
        row = (await _rows(url, tmp_path))["w-ok"]
        async with Flaky(stack.gateway, ADMIN) as admin:
            rollout = await Player(admin, sampling=GREEDY).play(row, group_index=3, index=0)
    assert rollout.failed and rollout.reward is None
    assert rollout.reason == "gateway: the gateway at ... is unreachable: ReadError"
    (sample,) = rollout.samples
    assert sample.metadata["failure"] == rollout.reason and sample.group_index == 3
    assert TrainRollout.from_player(rollout).flag == DROP_FAILED


async def test_gateway_client_errors_name_the_call_and_what_came_back() -> None:
    """A refusal carries the gateway's message and status; an answer that is not JSON and a
    gateway that is gone are GatewayAdminErrors too, never aiohttp's or json's exceptions."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    from corral.gateway.client import GatewayAdminError
    from corral.serving import free_port

    async def refuse(_: Any) -> JSONResponse:
        return JSONResponse({"error": {"message": "no such session"}}, status_code=404)

    async def garble(_: Any) -> PlainTextResponse:
        return PlainTextResponse("<html>proxy page</html>")

    app = Starlette(routes=[Route("/sessions/gone/reward", refuse, methods=["POST"]),
                            Route("/sessions", garble, methods=["POST"])])  # fmt: skip
    with serve(app) as url:
        async with GatewayAdmin(url, "secret") as admin:
            with pytest.raises(GatewayAdminError, match="404 no such session") as refused:
                await admin.set_reward("gone", 1.0)
            assert refused.value.status == 404
            with pytest.raises(GatewayAdminError, match="the answer is not JSON"):
                await admin.open_session()
    async with GatewayAdmin(f"http://127.0.0.1:{free_port()}") as admin:
        with pytest.raises(GatewayAdminError, match="is unreachable") as gone:
            await admin.samples("any")
        assert gone.value.status is None
