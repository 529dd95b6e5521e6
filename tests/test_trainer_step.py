"""One RL step on CPU against real local servers: rollouts of the tiny model through the
gateway (weather bundle: a right and a wrong city make a group with different rewards), a
policy update of the megatron-core model, and the new weights pushed to the engine."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from corral.envs.server import build_app
from corral.gateway.client import GatewayAdmin
from corral.rollouts.player import Player
from corral.rollouts.rows import RowSettings, read_rows, write_rows
from corral.stack import StackURLs, local_stack
from corral.trainer.groups import Group, filter_groups
from tests.servers import serve
from tests.weather import write_weather_bundle

megatron = pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[StackURLs]:
    with local_stack(tiny_model_dir) as urls:
        yield urls


@pytest.fixture
def runtime() -> Iterator[None]:
    from corral.trainer import megatron_runtime

    megatron_runtime.setup("cpu")
    yield
    megatron_runtime.teardown()


async def test_one_rl_step_changes_the_weights_and_the_engine_serves_them(
    stack: StackURLs, tiny_model_dir: Path, tmp_path: Path, runtime: None
) -> None:
    from corral.trainer.convert import load_hf_checkpoint, megatron_state_dict
    from corral.trainer.step import UpdateSettings, policy_update
    from corral.trainer.weights import DiskWeightSync

    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok", "wrong"))
    with serve(build_app(bundle)) as url:
        await asyncio.to_thread(write_rows, url, tmp_path / "rows", RowSettings())
        rows = {r.metadata.task_id: r for r in read_rows(tmp_path / "rows" / "all.jsonl")}
        # Greedy: the tiny model asks for the prompt's city every time, so the rewards are fixed.
        greedy = {"temperature": 0.0}
        async with GatewayAdmin(stack.gateway) as admin, Player(admin, sampling=greedy) as player:
            played = [
                await player.play(rows[task], group_index=0, index=i)
                for i, task in enumerate(("w-ok", "w-wrong"))
            ]
    assert [r.reward for r in played] == [1.0, 0.0]
    kept, dropped = filter_groups([Group.from_player(played)])
    assert len(kept) == 1 and not dropped

    model, spec = load_hf_checkpoint(tiny_model_dir, dtype=torch.float32)
    before = {n: t.detach().clone() for n, t in megatron_state_dict(model).items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = policy_update(model, optimizer, kept, UpdateSettings(max_tokens_per_micro_batch=512))
    for key in ("loss", "pg_loss", "clip_fraction", "tis_weight", "entropy", "grad_norm",
                "rollouts", "samples", "micro_batches", "tokens", "trained_tokens"):  # fmt: skip
        assert key in metrics and math.isfinite(metrics[key]), key
    assert metrics["rollouts"] == 2 and metrics["grad_norm"] > 0
    after = megatron_state_dict(model)
    assert any(not torch.equal(before[n], after[n]) for n in before)

    sync = DiskWeightSync([stack.engine], tmp_path / "weights", tokenizer_from=tiny_model_dir)
    await sync.push(model, spec, "step-1")
    assert (tmp_path / "weights" / "step-1" / "config.json").is_file()
    async with httpx.AsyncClient() as http:
        info = (await http.get(f"{stack.engine}/get_model_info")).json()
    assert info["weight_version"] == "step-1"


def test_the_learning_rate_schedule_warms_up_then_decays_to_min_lr() -> None:
    from pydantic import ValidationError

    from corral.trainer.config import OptimSettings
    from corral.trainer.step import scheduled_lr

    constant = OptimSettings(lr=1e-3)
    assert [scheduled_lr(constant, s, 10) for s in (0, 5, 9, 20)] == [1e-3] * 4
    warm = OptimSettings(lr=1e-3, lr_warmup_steps=4, lr_decay_style="linear", min_lr=1e-4)
    rates = [scheduled_lr(warm, s, 10) for s in range(10)]
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert rates[4] == pytest.approx(1e-3)  # the decay starts at lr ...
    assert rates[9] == pytest.approx(1e-4 + 9e-4 / 6)  # ... and ends one step short of min_lr
    assert all(a > b for a, b in itertools.pairwise(rates[4:]))
    cosine = OptimSettings(lr=1e-3, lr_decay_style="cosine")
    assert scheduled_lr(cosine, 5, 10) == pytest.approx(5e-4)  # halfway: half of lr
    assert scheduled_lr(cosine, 12, 10) == 0.0  # past the end: min_lr
    # Cosine stays above linear over the first half of the decay.
    linear = OptimSettings(lr=1e-3, lr_decay_style="linear")
    assert scheduled_lr(cosine, 2, 10) > scheduled_lr(linear, 2, 10)
    with pytest.raises(ValueError, match="negative"):
        scheduled_lr(constant, -1, 10)
    with pytest.raises(ValidationError, match="min_lr"):
        OptimSettings(lr=1e-4, min_lr=1e-3)
    with pytest.raises(ValidationError):
        OptimSettings(lr_decay_style="exponential")  # type: ignore[arg-type]
