"""A training step's groups from real rollouts: the tiny model through the gateway against the
weather bundle's env server; failed groups are dropped and the batch is filled from more rows."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.envs.server import build_app
from corral.gateway.client import GatewayAdmin
from corral.rollouts.player import Player
from corral.rollouts.rows import Row, RowSettings, read_rows, write_rows
from corral.stack import local_stack
from corral.trainer.groups import DROP_FAILED, BatchUnfillable, fill_batch
from corral.trainer.losses import grpo_advantages
from corral.trainer.rollouts import GroupDraw
from corral.trainer.sampling import RowSampler
from tests.servers import serve
from tests.weather import write_weather_bundle


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path) -> Iterator[str]:
    with local_stack(tiny_model_dir) as urls:
        yield urls.gateway


def test_the_row_sampler_is_seeded_and_resumes_where_it_stopped() -> None:
    rows = [object(), object(), object()]
    first = RowSampler(rows, seed=7)  # type: ignore[arg-type]
    taken = first.take(5)  # crosses into the second epoch
    assert sorted(map(id, taken[:3])) == sorted(map(id, rows))
    again = RowSampler(rows, seed=7)  # type: ignore[arg-type]
    assert [id(r) for r in again.take(5)] == [id(r) for r in taken]
    resumed = RowSampler(rows, seed=7)  # type: ignore[arg-type]
    resumed.restore(first.state())
    assert [id(r) for r in resumed.take(4)] == [id(r) for r in again.take(4)]


async def test_failed_groups_are_dropped_and_the_batch_filled_from_more_rows(
    gateway: str, tmp_path: Path
) -> None:
    # "crash": the verifier raises, so the rollout fails whatever the tiny model does (the
    # env's "raise" mode fails only a model that calls the tool, which sampling may not).
    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok", "crash"))
    with serve(build_app(bundle)) as url:
        await asyncio.to_thread(write_rows, url, tmp_path / "rows", RowSettings())
        rows: list[Row] = read_rows(tmp_path / "rows" / "all.jsonl")
        async with GatewayAdmin(gateway) as admin, Player(admin) as player:
            sampler = RowSampler(rows, seed=1)
            draw = GroupDraw(player, sampler, rollouts_per_row=2, concurrency=4)
            batch = await fill_batch(draw, 2, max_draws=6)
            with pytest.raises(BatchUnfillable, match="kept 0"):
                only_failing = [r for r in rows if r.metadata.task_id == "w-crash"]
                failing = GroupDraw(player, RowSampler(only_failing), rollouts_per_row=1)
                await fill_batch(failing, 1, max_draws=2)
    assert len(batch.groups) == 2
    assert all(len(g.rollouts) == 2 for g in batch.groups)
    assert len({g.group_index for g in batch.groups}) == 2
    assert all(d.reason == DROP_FAILED for d in batch.dropped)
    assert batch.dropped, "the 'crash' row was drawn too (2 rows, 2 kept needed)"
    advantages = grpo_advantages(batch.groups, normalize_std=False)
    assert set(advantages) == {r.rollout_id for g in batch.groups for r in g.rollouts}
    assert all(r.failed is False for r in draw.played if r.row.metadata.task_id == "w-ok")
