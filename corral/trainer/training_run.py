"""What every training run does around its steps, the RL loop (:mod:`corral.trainer.loop`) and
SFT (:mod:`corral.trainer.sft_run`) alike:

1. bring megatron's runtime up, and down at the end (:func:`megatron_world`);
2. load the policy from its Hugging Face folder onto the runtime's device, with its AdamW
   optimizer (:meth:`Policy.load`);
3. resume from the run folder's latest checkpoint, if it has one (:meth:`Policy.resume`);
4. on the leader, write the resolved config (:func:`write_run_config`) and the metrics
   (:class:`RunLog`: ``metrics.jsonl`` and TensorBoard from the resumed step on, each line
   also kept and handed to ``on_line``);
5. per step, save the checkpoints (:meth:`Policy.save`) and run the evaluations that
   :mod:`corral.trainer.schedule` says are due.

What a step is (rollouts and the GRPO update; a batch of conversations) is each run's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel

from corral.trainer import megatron_runtime
from corral.trainer.checkpoint import (
    CheckpointUnreadable,
    LoadedCheckpoint,
    TrainerState,
    apply_checkpoint,
    complete_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from corral.trainer.config import ModelSettings, OptimSettings
from corral.trainer.metrics import MetricsWriter
from corral.trainer.step import adamw

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from corral.trainer.model import ModelSpec

log = logging.getLogger(__name__)

# How reading a checkpoint went on one rank, worst first (:meth:`Policy.resume` takes the
# minimum over the ranks).
_MISFIT, _UNREADABLE, _READ = 0, 1, 2

# Called with each metrics line the leader writes (a progress display, a caller's own log).
OnLine = Callable[[dict[str, Any]], None]


@contextmanager
def megatron_world(model: ModelSettings, seed: int) -> Iterator[megatron_runtime.Runtime]:
    """Megatron's runtime for ``model`` (its device, tensor-parallel size and collective
    timeout) seeded with ``seed``, torn down when the block exits, however it exits."""
    runtime = megatron_runtime.setup(
        model.device,
        tensor_parallel_size=model.tensor_parallel,
        seed=seed,
        collective_timeout_s=model.collective_timeout_s,
    )
    try:
        yield runtime
    finally:
        megatron_runtime.teardown()


def load_model(
    path: Path, model: ModelSettings, runtime: megatron_runtime.Runtime
) -> tuple[GPTModel, ModelSpec]:
    """The Hugging Face folder ``path`` as this rank's megatron model (its shard under tensor
    parallelism) in ``model.dtype``, on the runtime's device; every rank calls it."""
    from corral.trainer.convert import load_hf_checkpoint

    dtype = torch.bfloat16 if model.dtype == "bfloat16" else torch.float32
    loaded, spec = load_hf_checkpoint(path, dtype=dtype)
    return loaded.to(runtime.device), spec


@dataclass
class Policy:
    """One rank's share of the model being trained, its optimizer, and the runtime they live
    in: what a checkpoint saves and a resumed run loads."""

    runtime: megatron_runtime.Runtime
    model: GPTModel
    spec: ModelSpec
    optimizer: torch.optim.Optimizer

    @classmethod
    def load(
        cls,
        runtime: megatron_runtime.Runtime,
        path: Path,
        model: ModelSettings,
        optim: OptimSettings,
    ) -> Policy:
        """The policy in ``path`` (:func:`load_model`) with a fresh AdamW of ``optim``."""
        loaded, spec = load_model(path, model, runtime)
        return cls(runtime, loaded, spec, adamw(loaded.parameters(), optim))

    @property
    def lr(self) -> float:
        """The learning rate the optimizer steps with now."""
        return float(self.optimizer.param_groups[0]["lr"])

    def resume(self, run_dir: Path) -> TrainerState | None:
        """Load ``run_dir``'s latest checkpoint that every rank can read into the model and
        optimizer, restore its RNG states and return its :class:`TrainerState`; None (nothing
        changed) without one. Every rank calls it, and all pick the same checkpoint: a newer
        one that some rank cannot read (a torn or missing file,
        :class:`~corral.trainer.checkpoint.CheckpointUnreadable`) is skipped with a warning
        naming it. Nothing is applied before every rank has read its files, so a skipped
        checkpoint leaves the model and optimizer untouched. ValueError when the checkpoint
        does not fit the model (an older one of the same run would not either);
        CheckpointUnreadable when none can be read."""
        candidates = complete_checkpoints(run_dir)
        if not candidates:
            return None
        for path in candidates:
            loaded: LoadedCheckpoint | None = None
            misfit: ValueError | None = None
            reason = "unreadable on another trainer rank"
            try:
                loaded = read_checkpoint(path, rank=self.runtime.rank)
            except CheckpointUnreadable as exc:
                reason = str(exc)
            except ValueError as exc:
                misfit = exc
            # Every rank learns the worst outcome, so none waits in a collective for another
            # that raised, and all take (or skip) the same checkpoint.
            outcome = self._worst_over_ranks(
                _READ if loaded is not None else _MISFIT if misfit else _UNREADABLE
            )
            if outcome == _MISFIT:
                raise misfit or ValueError(f"{path} does not fit another trainer rank's model")
            if outcome == _READ:
                assert loaded is not None
                apply_checkpoint(loaded, self.model, self.optimizer)
                loaded.state.restore_rng()
                return loaded.state
            log.warning("resume: skipping checkpoint %s: %s", path, reason)
        raise CheckpointUnreadable(
            f"none of {run_dir}'s checkpoints can be read: {', '.join(p.name for p in candidates)}"
        )

    def _worst_over_ranks(self, outcome: int) -> int:
        """The least ``outcome`` over every rank of the world (a min-all-reduce; every rank
        calls it)."""
        if self.runtime.world_size == 1:
            return outcome
        flag = torch.tensor([outcome], dtype=torch.int32, device=self.runtime.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return int(flag.item())

    def save(self, run_dir: Path, state: TrainerState, *, keep: int) -> Path:
        """Write the checkpoint of ``state`` (keeping the newest ``keep``) and return its
        folder; every rank calls it together
        (:func:`~corral.trainer.checkpoint.save_checkpoint`)."""
        return save_checkpoint(
            run_dir,
            state,
            self.model,
            self.optimizer,
            rank=self.runtime.rank,
            world_size=self.runtime.world_size,
            keep=keep,
        )


def write_run_config(run_dir: Path, config: BaseModel) -> None:
    """The run's resolved config as ``<run_dir>/config.json`` (the folder made if need be)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(config.model_dump_json(indent=2) + "\n")


@dataclass
class RunLog:
    """The metrics a run writes: on the leader (``writer`` set) each line goes to the metrics
    file (:class:`~corral.trainer.metrics.MetricsWriter`), into :attr:`lines` and to
    ``on_line``; elsewhere (``writer`` None) :meth:`write` does nothing."""

    writer: MetricsWriter | None
    on_line: OnLine | None = None
    lines: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    @contextmanager
    def open(
        cls,
        run_dir: Path,
        *,
        tensorboard: bool,
        resume_step: int,
        on_line: OnLine | None = None,
        leader: bool = True,
    ) -> Iterator[RunLog]:
        """A log for the block: the leader's appends to ``run_dir``'s metrics from
        ``resume_step`` on (later lines a crash left are dropped first); another rank's
        writes nothing."""
        if not leader:
            yield cls(None)
            return
        with MetricsWriter(run_dir, tensorboard=tensorboard, resume_step=resume_step) as out:
            yield cls(out, on_line)

    @property
    def evaluated_steps(self) -> frozenset[int]:
        """The steps the metrics file holds an eval line of (none on a rank that writes no
        metrics)."""
        return self.writer.evaluated_steps if self.writer is not None else frozenset()

    def write(self, line: dict[str, Any]) -> None:
        if self.writer is None:
            return
        self.writer.write(line)
        self.lines.append(line)
        if self.on_line is not None:
            self.on_line(line)
