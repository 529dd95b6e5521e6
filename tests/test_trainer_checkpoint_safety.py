"""Crash safety of checkpoints and metrics: a resume skips a newest checkpoint whose files are
torn and uses the previous one; a checkpoint that does not fit the model still fails; the
metrics rewrite on resume is never in place; a torn last metrics line is skipped. A tiny torch
module stands in for the megatron model (the checkpoint functions take any module)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from corral.trainer.checkpoint import (
    CheckpointUnreadable,
    TrainerState,
    checkpoint_dir,
    complete_checkpoints,
    latest_step,
)
from corral.trainer.megatron_runtime import Runtime
from corral.trainer.metrics import METRICS_FILE, MetricsWriter, read_metrics
from corral.trainer.training_run import Policy


def _policy(width: int = 4) -> Policy:
    runtime = Runtime(
        device=torch.device("cpu"),
        backend="gloo",
        world_size=1,
        rank=0,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        seed=0,
    )
    model: Any = torch.nn.Linear(width, 3)  # stands in for the GPTModel
    spec: Any = None  # resume and save never look at the spec
    return Policy(runtime, model, spec, torch.optim.AdamW(model.parameters(), lr=0.1))


def _train_and_save(policy: Policy, run: Path, step: int) -> dict[str, torch.Tensor]:
    model: Any = policy.model
    loss = model(torch.ones(2, model.in_features)).sum()
    loss.backward()
    policy.optimizer.step()
    policy.optimizer.zero_grad()
    policy.save(run, TrainerState.capture(step, {"epoch": 0}, step, f"v{step}"), keep=3)
    return {k: v.clone() for k, v in policy.model.state_dict().items()}


def test_resume_skips_a_torn_newest_checkpoint_and_uses_the_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    saver = _policy()
    older = _train_and_save(saver, run, 1)
    _train_and_save(saver, run, 2)
    assert [p.name for p in complete_checkpoints(run)] == ["step-000002", "step-000001"]
    assert not list((run / "checkpoints").glob(".*"))  # no scratch folder left
    shard = checkpoint_dir(run, 2) / "model-rank0.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # torn by a power cut

    resumed = _policy()
    with caplog.at_level(logging.WARNING, logger="corral.trainer.training_run"):
        state = resumed.resume(run)
    assert state is not None and state.step == 1 and state.weight_version == "v1"
    assert "step-000002" in caplog.text and "model-rank0.pt" in caplog.text
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, older[name])
    assert resumed.optimizer.state_dict()["state"][0]["step"] == 1
    assert latest_step(run) == 2  # the cheap answer reads state.json only (documented)


def test_resume_skips_garbage_and_a_missing_optimizer_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    saver = _policy()
    for step in (1, 2, 3):
        _train_and_save(saver, run, step)
    (checkpoint_dir(run, 3) / "model-rank0.pt").write_bytes(b"not a torch file")
    (checkpoint_dir(run, 2) / "optimizer-rank0.pt").unlink()
    state = _policy().resume(run)
    assert state is not None and state.step == 1


def test_resume_fails_when_no_checkpoint_can_be_read(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train_and_save(_policy(), run, 1)
    (checkpoint_dir(run, 1) / "state.json").write_text("{")
    with pytest.raises(CheckpointUnreadable, match="step-000001"):
        _policy().resume(run)


def test_a_checkpoint_that_does_not_fit_the_model_still_raises(tmp_path: Path) -> None:
    run = tmp_path / "run"
    saver = _policy(width=4)
    _train_and_save(saver, run, 1)
    _train_and_save(saver, run, 2)
    with pytest.raises(ValueError, match="step-000002 does not fit the model"):
        _policy(width=5).resume(run)  # not silently the older one: it would not fit either


def test_metrics_rewrite_on_resume_leaves_the_old_file_when_it_dies_midway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with MetricsWriter(tmp_path, tensorboard=False) as out:
        for step in (1, 2, 3):
            out.write({"step": step, "loss": float(step)})
    before = (tmp_path / METRICS_FILE).read_bytes()

    def die(*args: object) -> None:
        raise OSError("killed mid-rewrite")

    monkeypatch.setattr(os, "replace", die)
    with pytest.raises(OSError, match="killed"):
        MetricsWriter(tmp_path, tensorboard=False, resume_step=1)
    assert (tmp_path / METRICS_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_FILE]  # no partial file
    monkeypatch.undo()
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=1):
        pass
    assert [line["step"] for line in read_metrics(tmp_path)] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS_FILE]


def test_read_metrics_skips_a_torn_last_line(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text(json.dumps({"step": 1}) + '\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1}]
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=5) as out:
        out.write({"step": 2})  # the resume drops the torn line before appending
    assert [line["step"] for line in read_metrics(tmp_path)] == [1, 2]


def _two_rank_worker(rank: int, run: Path, port: int) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank
    )
    try:
        torch.manual_seed(rank)  # each rank its own shard
        saver = _policy()
        saver.runtime = replace(saver.runtime, world_size=2, rank=rank)
        older = _train_and_save(saver, run, 1)
        _train_and_save(saver, run, 2)
        if rank == 1:  # only rank 1's file of the newest checkpoint is torn
            (checkpoint_dir(run, 2) / "model-rank1.pt").write_bytes(b"torn")
        torch.distributed.barrier()
        resumed = _policy()
        resumed.runtime = saver.runtime
        state = resumed.resume(run)
        assert state is not None and state.step == 1, state  # rank 0 too: the same checkpoint
        for name, tensor in resumed.model.state_dict().items():
            assert torch.equal(tensor, older[name])
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.e2e  # two spawned processes: seconds, not the unit tier's budget
def test_every_rank_falls_back_to_the_same_checkpoint(tmp_path: Path) -> None:
    from tests.servers import free_port
    from tests.worlds import spawn_world

    spawn_world(_two_rank_worker, (tmp_path / "run", free_port()), world=2, timeout_s=120)
