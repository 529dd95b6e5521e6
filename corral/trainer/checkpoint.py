"""Checkpoints that resume a run exactly.

A checkpoint is a folder ``<run>/checkpoints/step-NNNNNN`` holding, per trainer rank, the
model's own (possibly tensor-parallel) parameters and the optimizer state
(``model-rank{r}.pt``, ``optimizer-rank{r}.pt``), and :class:`TrainerState` (``state.json``):
the step, where the row sampler stands, the next group index and the Python/torch RNG states.
With the rollouts' per-rollout sampling seeds (:func:`corral.trainer.rollouts.rollout_seed`) that
is all the next step depends on: a resumed run's next step equals the uninterrupted run's.

Writes go to a hidden sibling folder renamed into place once complete, so a crash mid-save
leaves the previous checkpoint as the latest; only the newest ``keep`` are kept. Every file is
fsynced before the rename and the parent folder after it, so a power cut cannot leave a
"complete" checkpoint (``state.json`` present) with torn tensors. Reading
(:func:`read_checkpoint`) is separate from applying (:func:`apply_checkpoint`): an unreadable
checkpoint (:class:`CheckpointUnreadable`) changes nothing, so a resume can fall back to an
older one.
"""

from __future__ import annotations

import base64
import json
import os
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


class CheckpointUnreadable(Exception):
    """A checkpoint's file is missing, truncated or corrupt (not: it does not fit the model,
    which is a ValueError)."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """One rank's share of a checkpoint, read into memory and not yet applied."""

    path: Path
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    state: TrainerState


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"{_PREFIX}{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """``run_dir``'s complete checkpoints (``state.json`` written), newest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if p.name.startswith(_PREFIX) and _complete(p)), reverse=True
    )


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or ``None``."""
    done = complete_checkpoints(run_dir)
    return done[0] if done else None


def latest_step(run_dir: Path) -> int | None:
    """The step of ``run_dir``'s latest complete checkpoint, or None when it has none (read
    from its ``state.json`` alone: no weights are loaded). A resume uses an older checkpoint
    when this one's tensors turn out unreadable (``Policy.resume``); this cheap answer does not
    read them, which only matters for a checkpoint damaged after it was written."""
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
    # Each rank's files reach the disk before the barrier that lets rank 0 mark them complete.
    _save_synced(_model_state(model), scratch / f"model-rank{rank}.pt")
    _save_synced(optimizer.state_dict(), scratch / f"optimizer-rank{rank}.pt")
    _barrier(world_size)
    if rank == 0:
        with (scratch / "state.json").open("w") as f:
            f.write(json.dumps(asdict(state), indent=1) + "\n")
            _sync(f)
        _fsync_dir(scratch)
        shutil.rmtree(final, ignore_errors=True)
        scratch.rename(final)
        _fsync_dir(final.parent)  # the rename itself survives a power cut
        done = sorted(p for p in final.parent.iterdir() if p.name.startswith(_PREFIX))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(world_size)
    return final


def load_checkpoint(
    path: Path, model: Any, optimizer: torch.optim.Optimizer, *, rank: int = 0
) -> TrainerState:
    """Load this rank's model and optimizer state from checkpoint ``path`` and return its
    :class:`TrainerState` (RNG states not yet restored: :meth:`TrainerState.restore_rng`):
    :func:`read_checkpoint` then :func:`apply_checkpoint`, so CheckpointUnreadable leaves the
    model and optimizer untouched. ValueError when the checkpoint does not fit the model."""
    loaded = read_checkpoint(path, rank=rank)
    apply_checkpoint(loaded, model, optimizer)
    return loaded.state


def read_checkpoint(path: Path, *, rank: int = 0) -> LoadedCheckpoint:
    """This rank's files of checkpoint ``path``, read into memory (nothing is applied).
    CheckpointUnreadable when one is missing, truncated or corrupt; ValueError when the
    checkpoint has no files for ``rank`` at all (saved with fewer ranks: an older checkpoint
    of the same run would not fit either)."""
    shard = path / f"model-rank{rank}.pt"
    if not shard.is_file() and not (path / f"optimizer-rank{rank}.pt").is_file():
        raise ValueError(f"{path} has no files for trainer rank {rank}: saved with fewer ranks?")
    params = _load_file(shard)
    optim = _load_file(path / f"optimizer-rank{rank}.pt")
    try:
        state = TrainerState(**json.loads((path / "state.json").read_text()))
    except (OSError, ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointUnreadable(f"{path / 'state.json'}: {exc}") from exc
    return LoadedCheckpoint(path, params, optim, state)


def apply_checkpoint(
    loaded: LoadedCheckpoint, model: Any, optimizer: torch.optim.Optimizer
) -> None:
    """Load ``loaded`` into ``model`` and ``optimizer``: every saved tensor and the whole
    optimizer state are replaced, so this also overwrites an earlier, abandoned load.
    ValueError when it does not fit the model (missing or unexpected tensors)."""
    try:
        result = model.load_state_dict(loaded.model, strict=False)
    except RuntimeError as exc:  # a tensor of another shape
        raise ValueError(f"{loaded.path} does not fit the model: {exc}") from exc
    missing = [n for n in result.missing_keys if not n.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{loaded.path} does not fit the model: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    optimizer.load_state_dict(loaded.optimizer)


def _load_file(path: Path) -> Any:
    # Reading one file checks nothing about the model, so whatever it raises means the file is
    # missing (OSError) or torn: the zip reader's RuntimeError, the weights-only unpickler's
    # UnpicklingError, EOFError, and on garbage even IndexError or KeyError.
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointUnreadable(f"{path}: {type(exc).__name__}: {exc}") from exc


def _save_synced(obj: Any, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        _sync(f)


def _sync(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        torch.distributed.barrier()
