"""The RL training loop: rollouts, the group filter, the update, the weight push, evaluation,
checkpoints and metrics, step after step.

One step (``step`` counts updates done):

1. rollouts: :func:`~corral.trainer.groups.fill_batch` draws rows and plays each
   ``rollouts_per_row`` times through the gateway (:class:`~corral.trainer.rollouts.GroupDraw`),
   dropping groups with a failed rollout and drawing more until ``groups_per_step`` are kept;
2. the update: :func:`~corral.trainer.step.policy_update` on the kept groups (in a worker
   thread, so the servers this process hosts keep answering);
3. the weight push: the engines serve the new weights as version ``step-N``
   (:mod:`corral.trainer.weights`);
4. a metrics line (:mod:`corral.trainer.metrics`), a checkpoint every ``checkpoint_every``
   steps and after the last (:mod:`corral.trainer.checkpoint`), and an evaluation on the eval
   rows before the first step, every ``eval_every`` steps and after the last.

With ``rollout.overlap`` the next step's rollouts are played while this step trains (off-policy
by one: they start under the weights before this update; the engine swaps weights when the push
lands, so a rollout may straddle the two versions. Its samples keep the logprobs they were
sampled with, which the loss's importance ratio and TIS account for).

Exact resume: the checkpoint of step N holds what fill N+1 starts from (the row sampler's place,
the next group index); every rollout's sampling seed is derived from the run seed and its
group and index. A resumed run therefore plays and trains the same step N+1 as the run it
continues, when overlap is off. With overlap, the resumed run's first rollouts are on-policy
(the uninterrupted run played them one version earlier).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from corral.gateway.client import GatewayAdmin
from corral.rollouts.evals import EvalReport, run_eval, write_eval
from corral.rollouts.harness_play import HarnessPlayer
from corral.rollouts.player import Player, Rollout
from corral.rollouts.rows import Row
from corral.trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from corral.trainer.config import TrainConfig
from corral.trainer.groups import (
    DROP_ABORTED,
    DROP_ALL_EQUAL,
    DROP_FAILED,
    BatchUnfillable,
    DroppedGroup,
    FilledBatch,
    Group,
    fill_batch,
)
from corral.trainer.metrics import MetricsWriter, peak_memory_gb, reset_peak_memory
from corral.trainer.rollouts import GroupDraw, RowSampler
from corral.trainer.step import UpdateSettings, adamw, policy_update, scheduled_lr, set_lr
from corral.trainer.weights import FollowerWeightSync, WeightSync

if TYPE_CHECKING:
    from corral.trainer.ray_cluster import RayGroupDraw

log = logging.getLogger(__name__)

INITIAL_VERSION = "step-0"


@dataclass(frozen=True)
class Services:
    """What the loop talks to, already running: the gateway (and its admin token), the rows
    (from the env servers the rows name), and the way weights reach the engines.
    ``eval_groups``/``group_by``: each eval task's group, for per-group eval means."""

    gateway: str
    admin_token: str | None
    train_rows: list[Row]
    eval_rows: list[Row]
    weight_sync: WeightSync
    model_path: Path
    eval_groups: dict[str, str] | None = None
    group_by: str | None = None
    # On Ray: the rollout-worker actors that play the rollouts, and the env servers to spread
    # the rows over (corral.trainer.ray_cluster); without workers the loop plays them here.
    rollout_workers: Sequence[Any] = ()
    env_urls: Sequence[str] = ()


# Called with (kind, done, total) as rollouts and eval episodes end, for a progress display.
Progress = Callable[[str, int, int], None]


class Trainer:
    """Runs :class:`~corral.trainer.config.TrainConfig`'s schedule (module docstring). Call
    :meth:`run` once; it sets megatron up and tears it down.

    Under torchrun every rank runs a Trainer: global rank 0, the *leader*, is given the
    ``services`` and plays the rollouts, evaluates and writes metrics; the other ranks are
    given ``services=None`` and follow the leader's commands (train on these groups, push the
    weights, save a checkpoint), which every rank carries out together (the update and the
    weight gathering are collective)."""

    def __init__(
        self,
        config: TrainConfig,
        services: Services | None,
        *,
        model_path: Path | None = None,
        progress: Progress | None = None,
        on_line: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if services is not None and not services.train_rows:
            raise ValueError("no training rows")
        if services is None and model_path is None:
            raise ValueError("a follower rank needs the model_path")
        self.config = config
        self.services = services
        self.model_path = model_path or (services.model_path if services else None)
        self.progress = progress
        self.on_line = on_line
        self._rollouts_done = 0
        self._eval_s = 0.0  # the last evaluation's wall time (what the time limit allows for)
        self.run_dir = config.run_dir
        self.lines: list[dict[str, Any]] = []

    async def run(self) -> list[dict[str, Any]]:
        """Train until ``schedule.steps`` updates are done (resuming from the run folder's
        latest checkpoint, if any) and return the metrics lines written by this call (none on
        a follower). :class:`~corral.trainer.groups.BatchUnfillable` when a step's rows cannot
        fill its batch; :class:`~corral.trainer.weights.WeightSyncError` when an engine
        refuses weights (the followers are told to stop first)."""
        from corral.trainer import megatron_cpu

        cfg = self.config
        runtime = megatron_cpu.setup(
            cfg.model.device,
            tensor_parallel_size=cfg.model.tensor_parallel,
            seed=cfg.seed,
            collective_timeout_s=cfg.model.collective_timeout_s,
        )
        if (runtime.rank == 0) != (self.services is not None):
            megatron_cpu.teardown()
            raise ValueError("rank 0 (and only rank 0) is given the services")
        try:
            crew = await self._crew(runtime)
            if self.services is None:
                await crew.follow()
                return []
            try:
                return await self._lead(crew, self.services)
            finally:
                await crew.stop()
        finally:
            megatron_cpu.teardown()

    async def _crew(self, runtime: Any) -> _Crew:
        from corral.trainer.convert import load_hf_checkpoint

        cfg = self.config
        assert self.model_path is not None
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        model, spec = await asyncio.to_thread(load_hf_checkpoint, self.model_path, dtype=dtype)
        model = model.to(runtime.device)
        optimizer = adamw(model.parameters(), cfg.optim)
        settings = UpdateSettings(
            loss=cfg.loss.loss_config(),
            normalize_std=cfg.loss.normalize_std,
            max_tokens_per_micro_batch=cfg.optim.max_tokens_per_micro_batch,
            temperature=cfg.rollout.temperature or 1.0,
            max_grad_norm=cfg.optim.max_grad_norm,
        )
        if self.services is not None:
            sync = self.services.weight_sync
        else:
            sync = FollowerWeightSync(
                in_memory=cfg.engine.weights_in_memory, out_dir=cfg.run_dir / "weights"
            )
        reference = None
        if cfg.loss.kl_coef > 0:
            # The starting weights, frozen: the KL term keeps the policy near where it began
            # (a resumed run reloads the same folder, so its reference is the same).
            reference, _ = await asyncio.to_thread(load_hf_checkpoint, self.model_path, dtype=dtype)
            reference = reference.to(runtime.device).eval().requires_grad_(False)
        return _Crew(runtime, model, spec, optimizer, settings, sync, cfg, reference)

    async def _lead(self, crew: _Crew, svc: Services) -> list[dict[str, Any]]:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2) + "\n")
        sampler = RowSampler(svc.train_rows, seed=cfg.seed)
        step, next_group, version = 0, 0, INITIAL_VERSION
        state = await crew.command(_Command("resume"))
        if state is not None:
            sampler.restore(state.sampler)
            step, next_group, version = state.step, state.next_group_index, state.weight_version
        # The engines may serve anything (another model, a later step of a crashed run): the
        # first rollouts must come from the weights being trained.
        await crew.command(_Command("push", version=version))
        eval_sampling = {**cfg.rollout.sampling(), "temperature": cfg.schedule.eval_temperature}
        evaluating = bool(cfg.schedule.eval_every and svc.eval_rows)  # no eval split: no evals
        with MetricsWriter(self.run_dir, tensorboard=cfg.tensorboard, resume_step=step) as out:
            async with (
                GatewayAdmin(svc.gateway, svc.admin_token) as admin,
                self._player(admin, cfg.rollout.sampling()) as player,
                self._player(admin, eval_sampling) as eval_player,
            ):
                draw: GroupDraw | RayGroupDraw
                if svc.rollout_workers:
                    from corral.trainer.ray_cluster import RayGroupDraw

                    draw = RayGroupDraw(
                        svc.rollout_workers,
                        sampler,
                        rollouts_per_row=cfg.rollout.rollouts_per_row,
                        seed=cfg.seed,
                        next_group_index=next_group,
                        env_urls=svc.env_urls,
                    )
                else:
                    draw = GroupDraw(
                        player,
                        sampler,
                        rollouts_per_row=cfg.rollout.rollouts_per_row,
                        concurrency=cfg.rollout.concurrency,
                        seed=cfg.seed,
                        next_group_index=next_group,
                        on_played=self._count_rollout,
                    )
                pending: _Fill | None = None
                clock = _Budget(cfg.schedule.time_limit)
                try:
                    while step < cfg.schedule.steps:
                        due = evaluating and step % cfg.schedule.eval_every == 0
                        if due and step not in out.evaluated_steps:
                            await self._evaluate(eval_player, step, version, out)
                        fill = pending or self._start_fill(draw, sampler)
                        pending = None
                        waited = time.monotonic()
                        try:
                            filled = await fill.task
                        except BatchUnfillable as exc:
                            self._log_dropped(step + 1, exc.dropped_groups)
                            raise
                        generation_s = time.monotonic() - waited
                        played = draw.take_played()
                        self._log_dropped(step + 1, filled.dropped)
                        if cfg.rollout.overlap and step + 1 < cfg.schedule.steps:
                            pending = self._start_fill(draw, sampler)
                        reset_peak_memory(cfg.model.device)
                        began = time.monotonic()
                        lr = scheduled_lr(cfg.optim, step, cfg.schedule.steps)
                        update = await crew.command(_Command("train", groups=filled.groups, lr=lr))
                        training_s = time.monotonic() - began
                        step += 1
                        version = f"step-{step}"
                        began = time.monotonic()
                        await crew.command(_Command("push", version=version))
                        sync_s = time.monotonic() - began
                        line = {
                            "step": step,
                            "weight_version": version,
                            **_rollout_metrics(filled, played),
                            **_update_metrics(update),
                            "lr": crew.optimizer.param_groups[0]["lr"],
                            "time/generation": generation_s,
                            "time/training": training_s,
                            "time/weight_sync": sync_s,
                            "time/eval": 0.0,
                            "time/step": generation_s + training_s + sync_s,
                            "memory/peak_gb": peak_memory_gb(cfg.model.device),
                        }
                        final = step == cfg.schedule.steps or not clock.fits(
                            line["time/step"] + (self._eval_s if evaluating else 0.0)
                        )
                        every = cfg.schedule.checkpoint_every
                        if every and (step % every == 0 or final):
                            # What the next fill starts from: if it already runs (overlap),
                            # the place it started at, else where the sampler stands now.
                            sampler_state, group = (
                                pending.start
                                if pending
                                else (sampler.state(), draw.next_group_index)
                            )
                            saved = TrainerState.capture(step, sampler_state, group, version)
                            await crew.command(_Command("checkpoint", state=saved))
                        self._write(out, line)
                        if final and step < cfg.schedule.steps:
                            log.warning(
                                "schedule.time_limit: stopping after step %d of %d; run again "
                                "to go on",
                                step,
                                cfg.schedule.steps,
                            )
                            break
                finally:
                    if pending is not None:  # an error ended the run while a fill was running
                        pending.task.cancel()
                if evaluating and step not in out.evaluated_steps:
                    await self._evaluate(eval_player, step, version, out)
        return self.lines

    # -- pieces ------------------------------------------------------------------------------

    def _player(self, admin: GatewayAdmin, sampling: dict[str, Any]) -> Player | HarnessPlayer:
        """The episode player, or with ``[agent]`` a harness's player (the agent plays each
        rollout in its episode's sandbox)."""
        agent = self.config.agent
        if agent is None:
            return Player(admin, sampling=sampling)
        from corral.rollouts.harness_play import make_harness

        harness = make_harness(
            agent.harness,
            agent_cmd=agent.agent_cmd,
            agent_dir=agent.agent_dir,
            settings=agent.settings,
        )
        return HarnessPlayer(
            admin,
            harness,
            timeout_s=agent.timeout_s,
            model=agent.model,
            sandbox_gateway=agent.sandbox_gateway,
            sampling=sampling,
        )

    def _count_rollout(self, _: Rollout) -> None:
        self._rollouts_done += 1
        if self.progress is not None:
            cfg = self.config.rollout
            wanted = cfg.groups_per_step * cfg.rollouts_per_row
            self.progress("rollouts", self._rollouts_done, max(wanted, self._rollouts_done))

    def _start_fill(self, draw: GroupDraw | RayGroupDraw, sampler: RowSampler) -> _Fill:
        cfg = self.config.rollout
        self._rollouts_done = 0
        start = (sampler.state(), draw.next_group_index)
        task = asyncio.ensure_future(
            fill_batch(
                draw,
                cfg.groups_per_step,
                max_draws=cfg.max_draws,
                drop_all_equal=cfg.drop_all_equal,
            )
        )
        return _Fill(task, start)

    async def _evaluate(
        self, player: Player | HarnessPlayer, step: int, version: str, out: MetricsWriter
    ) -> EvalReport:
        svc, cfg = self.services, self.config
        assert svc is not None
        rows = svc.eval_rows[: cfg.schedule.eval_limit]
        total = len(rows)
        done = 0

        def ended(_: Any) -> None:
            nonlocal done
            done += 1
            if self.progress is not None:
                self.progress("eval", done, total)

        began = time.monotonic()
        report = await run_eval(
            rows,
            player,
            concurrency=cfg.rollout.concurrency,
            groups=svc.eval_groups,
            group_by=svc.group_by,
            on_episode=ended,
        )
        await asyncio.to_thread(write_eval, report, self.run_dir / "evals" / f"step-{step:06d}")
        line: dict[str, Any] = {
            "step": step,
            "kind": "eval",
            "weight_version": version,
            "eval/reward/mean": _num(report.overall.mean),
            "eval/reward/se": _num(report.overall.se),
            "eval/zero_share": _num(report.overall.zero_share),
            "eval/failed": report.overall.failed,
            "eval/episodes": report.overall.episodes,
            "time/eval": time.monotonic() - began,
        }
        for name, stats in sorted(report.groups.items()):
            line[f"eval/group/{name}"] = _num(stats.mean)
        self._eval_s = line["time/eval"]
        self._write(out, line)
        return report

    def _log_dropped(self, step: int, dropped: Sequence[DroppedGroup]) -> None:
        """Why each dropped group was dropped, one JSON line per group in ``dropped.jsonl``
        (the metrics only count them): the first thing to read when a batch will not fill."""
        if not dropped:
            return
        with (self.run_dir / "dropped.jsonl").open("a") as f:
            for d in dropped:
                tasks = sorted({str(s.metadata.get("task_id")) for s in d.group.samples})
                record = {"step": step, "group_index": d.group.group_index, "tasks": tasks,
                          "reason": d.reason, "detail": d.detail}  # fmt: skip
                f.write(json.dumps(record) + "\n")

    def _write(self, out: MetricsWriter, line: dict[str, Any]) -> None:
        out.write(line)
        self.lines.append(line)
        if self.on_line is not None:
            self.on_line(line)


@dataclass(frozen=True)
class _Command:
    """What the leader has every rank do: ``resume`` (load the latest checkpoint, if any),
    ``push`` the weights as ``version``, ``train`` on ``groups``, save a ``checkpoint`` of
    ``state``, or ``stop``."""

    kind: Literal["resume", "push", "train", "checkpoint", "stop"]
    version: str = ""
    groups: Sequence[Group] = ()
    lr: float = 0.0  # train: the step's learning rate (the leader's schedule, for every rank)
    state: TrainerState | None = None


class _Budget:
    """Wall time left of ``schedule.time_limit`` (None: unlimited), from when it is made."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def fits(self, seconds: float) -> bool:
        return self.deadline is None or time.monotonic() + seconds <= self.deadline


class _Crew:
    """The model, its optimizer and the weight sync of one rank, and the command protocol:
    the leader broadcasts each command and carries it out itself; a follower carries out what
    it receives until ``stop``. At world size 1 the broadcast is a no-op."""

    def __init__(
        self,
        runtime: Any,
        model: Any,
        spec: Any,
        optimizer: torch.optim.Optimizer,
        settings: UpdateSettings,
        sync: WeightSync,
        config: TrainConfig,
        reference: Any | None = None,
    ) -> None:
        self.runtime = runtime
        self.model = model
        self.spec = spec
        self.optimizer = optimizer
        self.settings = settings
        self.sync = sync
        self.config = config
        self.reference = reference

    async def command(self, command: _Command) -> Any:
        await self._share(command)
        return await self._do(command)

    async def stop(self) -> None:
        await self._share(_Command("stop"))

    async def follow(self) -> None:
        while True:
            command = await self._share(None)
            if command.kind == "stop":
                return
            await self._do(command)

    async def _share(self, command: _Command | None) -> _Command:
        from corral.trainer.parallel import broadcast_command

        if self.runtime.world_size == 1:
            assert command is not None
            return command
        # The command channel: a follower waits here through the leader's whole rollout phase.
        shared = await asyncio.to_thread(broadcast_command, command)
        assert shared is not None  # the leader never shares None
        return shared

    async def _do(self, command: _Command) -> Any:
        rt, cfg = self.runtime, self.config
        if command.kind == "resume":
            path = latest_checkpoint(cfg.run_dir)
            if path is None:
                return None
            state = load_checkpoint(path, self.model, self.optimizer, rank=rt.rank)
            state.restore_rng()
            return state
        if command.kind == "push":
            await self.sync.push(self.model, self.spec, command.version)
            return None
        if command.kind == "train":
            set_lr(self.optimizer, command.lr)
            return await asyncio.to_thread(
                partial(policy_update, reference=self.reference),
                self.model,
                self.optimizer,
                list(command.groups),
                self.settings,
            )
        if command.kind == "checkpoint":
            assert command.state is not None
            return await asyncio.to_thread(
                save_checkpoint,
                cfg.run_dir,
                command.state,
                self.model,
                self.optimizer,
                rank=rt.rank,
                world_size=rt.world_size,
                keep=cfg.schedule.keep_checkpoints,
            )
        raise ValueError(f"unknown command {command.kind!r}")


@dataclass
class _Fill:
    """A step's fill in flight, and the (sampler state, next group index) it started from."""

    task: asyncio.Future[FilledBatch]
    start: tuple[dict[str, int], int]


def _num(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _rollout_metrics(filled: FilledBatch, played: list[Rollout]) -> dict[str, float]:
    kept = [r for g in filled.groups for r in g.rollouts]
    rewards = [float(r.reward) for r in kept if r.reward is not None]
    samples = [s for r in kept for s in r.samples]
    response = [sum(s.loss_mask) for s in samples]
    counts = filled.drop_counts
    return {
        "reward/mean": statistics.fmean(rewards) if rewards else math.nan,
        "reward/std": statistics.pstdev(rewards) if rewards else math.nan,
        "reward/zero_share": sum(r == 0.0 for r in rewards) / len(rewards) if rewards else math.nan,
        "rollouts": len(kept),
        "rollouts_played": len(played),
        "rollouts_failed": sum(r.failed for r in played),
        "groups": len(filled.groups),
        "samples": len(samples),
        "samples_per_rollout": len(samples) / len(kept) if kept else math.nan,
        "response_tokens/mean": statistics.fmean(response) if response else math.nan,
        f"dropped/{DROP_FAILED}": counts.get(DROP_FAILED, 0),
        f"dropped/{DROP_ABORTED}": counts.get(DROP_ABORTED, 0),
        f"dropped/{DROP_ALL_EQUAL}": counts.get(DROP_ALL_EQUAL, 0),
        "draws": filled.draws,
        "surplus_groups": len(filled.surplus),
    }


def _update_metrics(update: dict[str, float]) -> dict[str, float]:
    keys = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "tis_weight", "grad_norm",
            "tokens", "trained_tokens", "micro_batches")  # fmt: skip
    # ``kl`` exists only with reference logprobs: NaN says "not measured", not zero.
    return {key: float(update.get(key, math.nan)) for key in keys}
