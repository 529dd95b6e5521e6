"""Ray placement on a local Ray: the weather bundle served by an env-server actor (with a
bearer token), rows written from it, two rollout-worker actors playing the tiny model greedily
through the local gateway (fixed rewards), a killed worker failing the draw by name, and a
function run as a Ray task."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.rollouts.player import PlayerError
from corral.rollouts.rows import Row, RowSettings, read_rows, write_rows
from corral.samples import Sample
from corral.stack import local_stack
from corral.trainer.ray_cluster import (
    EnvServerHandle,
    RayGroupDraw,
    RolloutWorkerError,
    RolloutWorkerHandle,
    RolloutWorkerLost,
    connect,
    run_on_ray,
    start_env_servers,
    start_rollout_workers,
    token_env,
)
from corral.trainer.sampling import RowSampler
from tests.weather import write_weather_bundle

ray = pytest.importorskip("ray", reason="pip install 'corral[ray]'")

TOKEN_VAR = "CORRAL_RAY_TEST_ENV_TOKEN"
TOKEN = "weather-secret"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    connect("local", num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path) -> Iterator[str]:
    with local_stack(tiny_model_dir) as urls:
        yield urls.gateway


@pytest.fixture(scope="module")
def env_server(
    local_ray: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnvServerHandle]:
    bundle = write_weather_bundle(tmp_path_factory.mktemp("ray") / "weather", modes=("ok", "wrong"))
    (server,) = start_env_servers(bundle, 1, token=TOKEN)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def rows(env_server: EnvServerHandle, tmp_path_factory: pytest.TempPathFactory) -> list[Row]:
    out = tmp_path_factory.mktemp("rows")
    write_rows(env_server.url, out, RowSettings(token_var=TOKEN_VAR), token=TOKEN)
    return read_rows(out / "all.jsonl")


@pytest.fixture
def workers(local_ray: None, gateway: str, rows: list[Row]) -> Iterator[list[RolloutWorkerHandle]]:
    env = token_env(rows, {TOKEN_VAR: TOKEN})
    handles = start_rollout_workers(gateway, 2, sampling=GREEDY, concurrency=4, env=env)
    yield handles
    for handle in handles:
        handle.stop()


def _task(group_samples: list[Sample]) -> str:
    (task,) = {s.metadata["task_id"] for s in group_samples}
    return str(task)


async def test_two_workers_play_a_draw_with_the_expected_rewards(
    workers: list[RolloutWorkerHandle], rows: list[Row], env_server: EnvServerHandle
) -> None:
    assert env_server.url.startswith(f"http://{env_server.node_ip}:")
    assert {r.metadata.env.url for r in rows} == {env_server.url}
    draw = RayGroupDraw(workers, RowSampler(rows, seed=0), rollouts_per_row=2, next_group_index=5)
    groups = await draw(2)

    assert len(groups) == 2 and draw.next_group_index == 7
    assert sorted(g.group_index for g in groups) == [5, 6]
    rewards = {_task(g.samples): g.rewards for g in groups}
    assert rewards == {"w-ok": [1.0, 1.0], "w-wrong": [0.0, 0.0]}
    for group in groups:
        assert all(r.flag is None for r in group.rollouts)
        for s in group.samples:
            assert s.tokens and s.response_length > 0
            assert len(s.loss_mask) == s.response_length and 1 in s.loss_mask
            assert len(s.rollout_log_probs) == s.response_length
    # One row per worker (round-robin), and the played rollouts are there for metrics.
    assert {s.metadata["rollout_worker"] for g in groups for s in g.samples} == {
        w.name for w in workers
    }
    played = draw.take_played()
    assert len(played) == 4 and not draw.played
    assert all(r.timing.total_s > 0 and not r.failed for r in played)

    # env_urls wins over the server a row names (here one that is not listening).
    elsewhere = [r.model_copy(deep=True) for r in rows]
    for r in elsewhere:
        r.metadata.env.url = "http://127.0.0.1:9"
    moved = RayGroupDraw(
        workers, RowSampler(elsewhere), rollouts_per_row=1, env_urls=[env_server.url]
    )
    assert sorted(g.rewards[0] for g in await moved(2)) == [0.0, 1.0]  # type: ignore[type-var]

    # A row that cannot be played stops the draw with the player's own error, naming the worker.
    unset = [r.model_copy(deep=True) for r in rows]
    for r in unset:
        r.metadata.env.token_var = "CORRAL_RAY_TEST_UNSET"
    with pytest.raises(PlayerError, match="CORRAL_RAY_TEST_UNSET is not set") as caught:
        await RayGroupDraw(workers, RowSampler(unset), rollouts_per_row=1)(1)
    assert any(workers[0].name in note for note in caught.value.__notes__)

    # A worker that does not answer in time fails the draw by name (its call is cancelled).
    hurried = RayGroupDraw(workers[:1], RowSampler(rows), rollouts_per_row=1, timeout=0.001)
    with pytest.raises(RolloutWorkerError, match=f"{workers[0].name}.*did not answer"):
        await hurried(1)


async def test_a_killed_worker_fails_the_draw_by_name_and_keeps_the_others_groups(
    workers: list[RolloutWorkerHandle], rows: list[Row]
) -> None:
    alive, dead = workers
    draw = RayGroupDraw(workers, RowSampler(rows, seed=0), rollouts_per_row=1)
    ray.kill(dead.actor)
    with pytest.raises(RolloutWorkerLost, match=dead.name) as caught:
        await asyncio.wait_for(draw(2), 60)
    assert dead.actor_id in str(caught.value) and alive.name not in caught.value.worker
    assert len(caught.value.groups) == 1 and len(caught.value.unplayed) == 1
    assert not draw.played, "a failed draw's groups ride on the error, not in played"
    assert draw.workers == [alive]
    # The survivor plays on.
    (group,) = await draw(1)
    assert group.group_index == 2 and {s.metadata["rollout_worker"] for s in group.samples} == {
        alive.name
    }


def test_run_on_ray_runs_a_function_and_returns_its_value(local_ray: None) -> None:
    def add(a: int, b: int, *, times: int = 1) -> int:
        return (a + b) * times

    async def later(x: str) -> str:
        await asyncio.sleep(0)
        return x.upper()

    def fails() -> None:
        raise ValueError("the trainer broke")

    assert run_on_ray(add, 2, 3, times=2) == 10
    assert run_on_ray(later, "ok", num_cpus=0.5) == "OK"
    with pytest.raises(ValueError, match="the trainer broke"):
        run_on_ray(fails)
    with pytest.raises(RuntimeError, match="no node of the Ray cluster has 1 CPU and 1 GPU"):
        run_on_ray(add, 1, 2, num_gpus=1)


def test_corral_train_on_ray_places_trainer_env_server_and_workers(
    local_ray: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``corral train --ray``: the trainer as a Ray task (with the local engine and gateway in
    it), the bundle on an env-server actor, rollouts on two worker actors; one RL step."""
    from rich.console import Console

    from corral.trainer.config import load_config
    from corral.trainer.launch import train

    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok", "wrong"))
    config = load_config(
        None,
        [
            f'run_dir="{tmp_path / "run"}"',
            f'model.path="{tiny_model_dir}"',
            f'env.bundle="{bundle}"',
            'env.train_split="train"',
            "ray.address='local'",
            "ray.rollout_workers=2",
            "rollout.groups_per_step=2",
            "rollout.rollouts_per_row=2",
            "rollout.temperature=0.0",
            "rollout.max_tokens=48",
            "schedule.steps=1",
            "schedule.eval_every=0",
            "schedule.checkpoint_every=1",
            "tensorboard=false",
        ],
    )
    lines = train(config, Console(quiet=True))
    (line,) = lines
    # The config names no env token: the env server on the node's address got a fresh one,
    # and the rows name the variable that holds it.
    from corral.trainer.services import OWN_ENV_TOKEN_VAR

    rows = (tmp_path / "run" / "rows" / "all.jsonl").read_text().splitlines()
    assert {json.loads(r)["metadata"]["env"]["token_var"] for r in rows} == {OWN_ENV_TOKEN_VAR}
    assert line["step"] == 1 and line["rollouts"] == 4 and line["groups"] == 2
    assert line["reward/mean"] == 0.5  # greedy: the ok row's rollouts 1.0, the wrong row's 0.0
    assert (tmp_path / "run" / "checkpoints" / "step-000001" / "state.json").is_file()
    # The services the task started are gone with it: only the fixture's env server lives.
    alive = [a for a in ray.util.list_named_actors(all_namespaces=True) if "corral-" in str(a)]
    assert len(alive) <= 1


def test_env_servers_on_the_network_are_refused_without_a_token(tmp_path: Path) -> None:
    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok",))
    with pytest.raises(ValueError, match="need a token"):
        start_env_servers(bundle, 1)  # every interface by default
