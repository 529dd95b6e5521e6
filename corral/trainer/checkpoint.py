"""Checkpoints that resume a run exactly.

A checkpoint is a folder ``<run>/checkpoints/step-NNNNNN`` holding, per trainer rank, the
model's own (possibly tensor-parallel) parameters and the optimizer state
(``model-rank{r}.pt``, ``optimizer-rank{r}.pt``), and :class:`TrainerState` (``state.json``):
the step, where the row sampler stands, the next group index and the Python/torch RNG states.
With the rollouts' per-rollout sampling seeds (:func:`corral.trainer.rollouts.rollout_seed`) that
is all the next step depends on: a resumed run's next step equals the uninterrupted run's.

Writes go to a hidden sibling folder renamed into place once complete, so a crash mid-save
leaves the previous checkpoint as the latest; only the newest ``keep`` are kept.
"""

from __future__ import annotations

import base64
import json
import pickle
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS = "checkpoints"
_PREFIX = "step-"


@dataclass(frozen=True)
class TrainerState:
    """What a run needs besides weights and optimizer to continue exactly (module docstring)."""

    step: int
    sampler: dict[str, int]
    next_group_index: int
    weight_version: str
    python_rng: str = ""  # base64 pickle of random.getstate()
    torch_rng: list[int] = field(default_factory=list)

    @classmethod
    def capture(
        cls, step: int, sampler: dict[str, int], next_group_index: int, weight_version: str
    ) -> TrainerState:
        return cls(
            step=step,
            sampler=dict(sampler),
            next_group_index=next_group_index,
            weight_version=weight_version,
            python_rng=base64.b64encode(pickle.dumps(random.getstate())).decode(),
            torch_rng=torch.get_rng_state().tolist(),
        )

    def restore_rng(self) -> None:
        if self.python_rng:
            random.setstate(pickle.loads(base64.b64decode(self.python_rng)))
        if self.torch_rng:
            torch.set_rng_state(torch.tensor(self.torch_rng, dtype=torch.uint8))


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"{_PREFIX}{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or ``None``."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.name.startswith(_PREFIX) and _complete(p))
    return done[-1] if done else None


def latest_step(run_dir: Path) -> int | None:
    """The step of ``run_dir``'s latest complete checkpoint, or None when it has none (read
    from its ``state.json`` alone: no weights are loaded)."""
    path = latest_checkpoint(run_dir)
    if path is None:
        return None
    return TrainerState(**json.loads((path / "state.json").read_text())).step


def _complete(path: Path) -> bool:
    return (path / "state.json").is_file()


def _model_state(model: Any) -> dict[str, torch.Tensor]:
    # This rank's own parameters (a shard under tensor parallelism); the local layer spec's
    # ``_extra_state`` placeholders carry nothing.
    return {
        name: tensor.detach().cpu()
        for name, tensor in model.state_dict().items()
        if not name.endswith("._extra_state")
    }


def save_checkpoint(
    run_dir: Path,
    state: TrainerState,
    model: Any,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int = 0,
    world_size: int = 1,
    keep: int = 2,
) -> Path:
    """Write the checkpoint of ``state.step`` and return its folder. Every rank calls it (each
    writes its own files; rank 0 writes ``state.json`` last and renames the folder into place),
    between barriers when ``world_size > 1``. OSError propagates (the previous checkpoint is
    untouched)."""
    final = checkpoint_dir(run_dir, state.step)
    scratch = final.with_name(f".{final.name}.partial")
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    _barrier(world_size)
    torch.save(_model_state(model), scratch / f"model-rank{rank}.pt")
    torch.save(optimizer.state_dict(), scratch / f"optimizer-rank{rank}.pt")
    _barrier(world_size)
    if rank == 0:
        (scratch / "state.json").write_text(json.dumps(asdict(state), indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        scratch.rename(final)
        done = sorted(p for p in final.parent.iterdir() if p.name.startswith(_PREFIX))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(world_size)
    return final


def load_checkpoint(
    path: Path, model: Any, optimizer: torch.optim.Optimizer, *, rank: int = 0
) -> TrainerState:
    """Load this rank's model and optimizer state from checkpoint ``path`` and return its
    :class:`TrainerState` (RNG states not yet restored: :meth:`TrainerState.restore_rng`).
    ValueError when the checkpoint does not fit the model (missing or unexpected tensors, or a
    different number of ranks)."""
    shard = path / f"model-rank{rank}.pt"
    if not shard.is_file():
        raise ValueError(f"{path} has no files for trainer rank {rank}: saved with fewer ranks?")
    params = torch.load(shard, map_location="cpu", weights_only=True)
    result = model.load_state_dict(params, strict=False)
    missing = [n for n in result.missing_keys if not n.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{path} does not fit the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    optimizer.load_state_dict(
        torch.load(path / f"optimizer-rank{rank}.pt", map_location="cpu", weights_only=True)
    )
    data = json.loads((path / "state.json").read_text())
    return TrainerState(**data)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        torch.distributed.barrier()
