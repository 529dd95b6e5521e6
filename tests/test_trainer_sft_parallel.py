"""``run_sft`` in a world of two gloo processes on CPU (joined the way torchrun's environment
says) against the same run in one process: data parallel 2, then tensor parallel 2, train the
tiny model to the same metrics and the same weights, rank 0 alone writes the metrics, and every
rank's checkpoint shard is written. About 30 s on 2 cores, most of it the two processes
importing torch and megatron."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")

from corral.trainer.config import SftConfig  # noqa: E402
from corral.trainer.metrics import read_metrics  # noqa: E402
from corral.trainer.sft_run import run_sft  # noqa: E402
from tests.servers import free_port  # noqa: E402
from tests.weather import write_weather_chats  # noqa: E402
from tests.worlds import join_as_torchrun, spawn_world  # noqa: E402

WORLD = 2
LAYOUTS = (("dp2", 1), ("tp2", 2))  # (run folder, tensor_parallel)
SPAWN_TIMEOUT_S = 300


def _config(folder: Path, name: str, model: Path, tensor_parallel: int = 1) -> SftConfig:
    return SftConfig.model_validate(
        {
            "data": str(folder / "chats.jsonl"),
            "eval_data": str(folder / "chats.jsonl"),
            "run_dir": str(folder / name),
            "model": {"path": str(model), "tensor_parallel": tensor_parallel},
            # Every conversation alone in its micro-batch: a step of 4 has 4 to share out.
            "optim": {"lr": 3e-3, "max_tokens_per_micro_batch": 1},
            "batch_size": 4,
            "epochs": 1.0,
            "eval_every": 1,
            "checkpoint_every": 1,
            "tensorboard": False,
        }
    )


def _worker(rank: int, folder: Path, model: Path, ports: list[int]) -> None:
    torch.set_num_threads(1)
    for (name, tp), port in zip(LAYOUTS, ports, strict=True):
        join_as_torchrun(rank, WORLD, port)
        lines = run_sft(_config(folder, name, model, tp))  # tears its world down at the end
        (folder / f"{name}-rank{rank}.json").write_text(json.dumps(lines))


def _weights(model: Path) -> dict[str, Any]:
    """The tensors of the Hugging Face model folder ``model`` (a run's is ``run/model``)."""
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


def test_sft_in_a_world_of_two_trains_as_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    write_weather_chats(tmp_path / "chats.jsonl")
    ports = [free_port() for _ in LAYOUTS]
    spawn_world(_worker, (tmp_path, tiny_model_dir, ports), WORLD, SPAWN_TIMEOUT_S)
    single = run_sft(_config(tmp_path, "single", tiny_model_dir))
    before = _weights(tiny_model_dir)
    want = _weights(tmp_path / "single" / "model")

    for name, _ in LAYOUTS:
        leader = json.loads((tmp_path / f"{name}-rank0.json").read_text())
        assert json.loads((tmp_path / f"{name}-rank1.json").read_text()) == []  # rank 0 writes
        assert [(m["step"], m.get("kind", "step")) for m in leader] == [
            (m["step"], m.get("kind", "step")) for m in single
        ]
        assert read_metrics(tmp_path / name) == leader
        for got, ref in zip(leader, single, strict=True):
            for key in ("loss", "accuracy", "grad_norm", "eval/loss", "eval/accuracy"):
                if key in ref:
                    assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (name, key)
            if "micro_batches" in ref:  # the step's, not a replica's share
                assert got["micro_batches"] == ref["micro_batches"] == 4
        # The same update: the weights moved as in one process, to float rounding (Adam's
        # first steps are nearly sign(gradient) * lr, so compare against the update's size).
        got = _weights(tmp_path / name / "model")
        assert set(got) == set(want)
        shared = [k for k in want if k in before]
        moved = sum(float((want[k].float() - before[k].float()).norm() ** 2) for k in shared)
        apart = sum(float((got[k].float() - want[k].float()).norm() ** 2) for k in want)
        assert moved > 0 and apart**0.5 < 1e-3 * moved**0.5, name
        for checkpoint in (tmp_path / name / "checkpoints").iterdir():
            shards = sorted(p.name for p in checkpoint.glob("model-rank*"))
            assert shards == ["model-rank0.pt", "model-rank1.pt"], checkpoint
