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
   rows before the first step, every ``eval_every`` steps and after the last
   (:mod:`corral.trainer.schedule` says when each is due; :mod:`corral.trainer.training_run`
   holds what the RL and SFT runs share around their steps).

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

from corral.gateway.client import GatewayAdmin
from corral.rollouts.evals import EvalReport, run_eval, write_eval
from corral.rollouts.harness_play import HarnessPlayer
from corral.rollouts.player import Player, Rollout
from corral.rollouts.rows import Row
from corral.rollouts.traces import TraceSink
from corral.trainer.checkpoint import TrainerState
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
from corral.trainer.megatron_runtime import Runtime
from corral.trainer.metrics import peak_memory_gb, reset_peak_memory
from corral.trainer.rollout_log import RolloutLog
from corral.trainer.rollouts import GroupDraw
from corral.trainer.sampling import RowSampler
from corral.trainer.schedule import Checkpointing, Evaluation, TimeBudget
from corral.trainer.step import UpdateSettings, policy_update, scheduled_lr, set_lr
from corral.trainer.training_run import (
    OnLine,
    Policy,
    RunLog,
    load_model,
    megatron_world,
    write_run_config,
)
from corral.trainer.weights import FollowerWeightSync, WeightSync

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from corral.trainer.ray_cluster import RayGroupDraw
    from corral.trainer.services import Services

log = logging.getLogger(__name__)

INITIAL_VERSION = "step-0"


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
        on_line: OnLine | None = None,
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

    async def run(self) -> list[dict[str, Any]]:
        """Train until ``schedule.steps`` updates are done (resuming from the run folder's
        latest checkpoint, if any) and return the metrics lines written by this call (none on
        a follower). :class:`~corral.trainer.groups.BatchUnfillable` when a step's rows cannot
        fill its batch; :class:`~corral.trainer.weights.WeightSyncError` when an engine
        refuses weights (the followers are told to stop first)."""
        cfg = self.config
        with megatron_world(cfg.model, cfg.seed) as runtime:
            if (runtime.rank == 0) != (self.services is not None):
                raise ValueError("rank 0 (and only rank 0) is given the services")
            crew = await self._crew(runtime)
            if self.services is None:
                await crew.follow()
                return []
            try:
                return await self._lead(crew, self.services)
            finally:
                await crew.stop()

    async def _crew(self, runtime: Runtime) -> _Crew:
        cfg = self.config
        assert self.model_path is not None
        policy = await asyncio.to_thread(
            Policy.load, runtime, self.model_path, cfg.model, cfg.optim
        )
        settings = UpdateSettings(
            loss=cfg.loss.loss_config(),
            normalize_std=cfg.loss.normalize_std,
            max_tokens_per_micro_batch=cfg.optim.max_tokens_per_micro_batch,
            temperature=cfg.rollout.temperature or 1.0,
            max_grad_norm=cfg.optim.max_grad_norm,
        )
        sync: WeightSync
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
            frozen, _ = await asyncio.to_thread(load_model, self.model_path, cfg.model, runtime)
            reference = frozen.eval().requires_grad_(False)
        return _Crew(policy, settings, sync, cfg, reference)

    async def _lead(self, crew: _Crew, svc: Services) -> list[dict[str, Any]]:
        """The leader's run: resume, then step (evaluating when due) until the schedule's end
        or the time limit, then the final evaluation."""
        cfg = self.config
        write_run_config(self.run_dir, cfg)
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
        opened = RunLog.open(
            self.run_dir, tensorboard=cfg.tensorboard, resume_step=step, on_line=self.on_line
        )
        with opened as out:
            evaluation = Evaluation(
                enabled=bool(cfg.schedule.eval_every and svc.eval_rows),  # no eval split: none
                every=cfg.schedule.eval_every,
                done=set(out.evaluated_steps),
            )
            rollouts = RolloutLog(
                self.run_dir, every=cfg.schedule.rollouts_every, keep=cfg.schedule.keep_rollouts
            )
            async with (
                GatewayAdmin(svc.gateway, svc.admin_token) as admin,
                self._player(admin, cfg.rollout.sampling(), rollouts.traces) as player,
                self._player(admin, eval_sampling) as eval_player,
            ):
                run = _Run(
                    crew=crew,
                    draw=self._draw(svc, player, sampler, next_group),
                    sampler=sampler,
                    out=out,
                    evaluation=evaluation,
                    checkpointing=Checkpointing(cfg.schedule.checkpoint_every),
                    clock=TimeBudget(cfg.schedule.time_limit),
                    rollouts=rollouts,
                    step=step,
                    version=version,
                )
                try:
                    while run.step < cfg.schedule.steps:
                        if evaluation.due(run.step):
                            await self._evaluate(eval_player, run)
                        if await self._step(run):
                            break
                finally:
                    if run.pending is not None:  # an error ended the run while a fill ran
                        run.pending.task.cancel()
                if evaluation.due(run.step, final=True):
                    await self._evaluate(eval_player, run)
        return out.lines

    async def _step(self, run: _Run) -> bool:
        """One step (module docstring): wait for its fill (and, with overlap, start the next
        one), train, push the weights, save a checkpoint when due, write the metrics line.
        Returns whether it was the run's last: the schedule's, or the time limit's (the next
        step and an evaluation would not fit)."""
        cfg = self.config
        steps = cfg.schedule.steps
        fill = run.pending or self._start_fill(run.draw, run.sampler)
        run.pending = None
        waited = time.monotonic()
        try:
            filled = await fill.task
        except BatchUnfillable as exc:
            self._log_dropped(run.step + 1, exc.dropped_groups)
            raise
        generation_s = time.monotonic() - waited
        played = run.draw.take_played()
        self._log_dropped(run.step + 1, filled.dropped)
        if cfg.rollout.overlap and run.step + 1 < steps:
            run.pending = self._start_fill(run.draw, run.sampler)
        reset_peak_memory(cfg.model.device)
        began = time.monotonic()
        lr = scheduled_lr(cfg.optim, run.step, steps)
        update = await run.crew.command(_Command("train", groups=filled.groups, lr=lr))
        training_s = time.monotonic() - began
        run.step += 1
        await asyncio.to_thread(run.rollouts.write, run.step, played)
        run.version = f"step-{run.step}"
        began = time.monotonic()
        await run.crew.command(_Command("push", version=run.version))
        sync_s = time.monotonic() - began
        step_s = generation_s + training_s + sync_s
        line = {
            "step": run.step,
            "weight_version": run.version,
            **_rollout_metrics(filled, played),
            **_update_metrics(update),
            "lr": run.crew.policy.lr,
            "time/generation": generation_s,
            "time/training": training_s,
            "time/weight_sync": sync_s,
            "time/eval": 0.0,
            "time/step": step_s,
            "memory/peak_gb": peak_memory_gb(cfg.model.device),
        }
        eval_s = self._eval_s if run.evaluation.enabled else 0.0
        final = run.step == steps or not run.clock.fits(step_s + eval_s)
        if run.checkpointing.due(run.step, final):
            await run.crew.command(_Command("checkpoint", state=run.checkpoint_state()))
        run.out.write(line)
        if final and run.step < steps:
            log.warning(
                "schedule.time_limit: stopping after step %d of %d; run again to go on",
                run.step,
                steps,
            )
        return final

    # -- pieces ------------------------------------------------------------------------------

    def _player(
        self, admin: GatewayAdmin, sampling: dict[str, Any], trace: TraceSink | None = None
    ) -> Player | HarnessPlayer:
        """The episode player, or with ``[agent]`` a harness's player (the agent plays each
        rollout in its episode's sandbox); every episode's spans go to ``trace``."""
        agent = self.config.agent
        if agent is None:
            return Player(admin, sampling=sampling, trace=trace)
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
            trace=trace,
        )

    def _draw(
        self,
        svc: Services,
        player: Player | HarnessPlayer,
        sampler: RowSampler[Row],
        next_group: int,
    ) -> GroupDraw | RayGroupDraw:
        """The fills' ``draw``: on Ray, the rollout workers play; else ``player``, here."""
        cfg = self.config
        if svc.rollout_workers:
            from corral.trainer.ray_cluster import RayGroupDraw

            return RayGroupDraw(
                svc.rollout_workers,
                sampler,
                rollouts_per_row=cfg.rollout.rollouts_per_row,
                seed=cfg.seed,
                next_group_index=next_group,
                env_urls=svc.env_urls,
            )
        return GroupDraw(
            player,
            sampler,
            rollouts_per_row=cfg.rollout.rollouts_per_row,
            concurrency=cfg.rollout.concurrency,
            seed=cfg.seed,
            next_group_index=next_group,
            on_played=self._count_rollout,
        )

    def _count_rollout(self, _: Rollout) -> None:
        self._rollouts_done += 1
        if self.progress is not None:
            cfg = self.config.rollout
            wanted = cfg.groups_per_step * cfg.rollouts_per_row
            self.progress("rollouts", self._rollouts_done, max(wanted, self._rollouts_done))

    def _start_fill(self, draw: GroupDraw | RayGroupDraw, sampler: RowSampler[Row]) -> _Fill:
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

    async def _evaluate(self, player: Player | HarnessPlayer, run: _Run) -> EvalReport:
        """Evaluate the weights of ``run.step`` on the eval rows: the report in
        ``evals/step-NNNNNN``, an eval metrics line."""
        svc, cfg = self.services, self.config
        assert svc is not None
        step = run.step
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
            "weight_version": run.version,
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
        run.out.write(line)
        run.evaluation.mark(step)
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


@dataclass
class _Crew:
    """One rank's policy (model and optimizer), its update settings, its weight sync and the
    KL reference (``kl_coef > 0``), and the command protocol: the leader broadcasts each
    command and carries it out itself; a follower carries out what it receives until
    ``stop``. At world size 1 the broadcast is a no-op."""

    policy: Policy
    settings: UpdateSettings
    sync: WeightSync
    config: TrainConfig
    reference: GPTModel | None = None

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

        if self.policy.runtime.world_size == 1:
            assert command is not None
            return command
        # The command channel: a follower waits here through the leader's whole rollout phase.
        shared = await asyncio.to_thread(broadcast_command, command)
        assert shared is not None  # the leader never shares None
        return shared

    async def _do(self, command: _Command) -> Any:
        cfg, policy = self.config, self.policy
        if command.kind == "resume":
            return policy.resume(cfg.run_dir)
        if command.kind == "push":
            await self.sync.push(policy.model, policy.spec, command.version)
            return None
        if command.kind == "train":
            set_lr(policy.optimizer, command.lr)
            return await asyncio.to_thread(
                partial(policy_update, reference=self.reference),
                policy.model,
                policy.optimizer,
                list(command.groups),
                self.settings,
            )
        if command.kind == "checkpoint":
            assert command.state is not None
            return await asyncio.to_thread(
                policy.save, cfg.run_dir, command.state, keep=cfg.schedule.keep_checkpoints
            )
        raise ValueError(f"unknown command {command.kind!r}")


@dataclass
class _Fill:
    """A step's fill in flight, and the (sampler state, next group index) it started from."""

    task: asyncio.Future[FilledBatch]
    start: tuple[dict[str, int], int]


@dataclass
class _Run:
    """The leader's run in progress: what its steps share, and where it stands (``step``
    updates done, the engines serving ``version``, the next step's fill already running under
    overlap)."""

    crew: _Crew
    draw: GroupDraw | RayGroupDraw
    sampler: RowSampler[Row]
    out: RunLog
    evaluation: Evaluation
    checkpointing: Checkpointing
    clock: TimeBudget
    rollouts: RolloutLog
    step: int
    version: str
    pending: _Fill | None = None

    def checkpoint_state(self) -> TrainerState:
        """The state a checkpoint of this step saves: what the next fill starts from. If it
        already runs (overlap), the place it started at, else where the sampler stands now."""
        sampler_state, group = (
            self.pending.start
            if self.pending
            else (self.sampler.state(), self.draw.next_group_index)
        )
        return TrainerState.capture(self.step, sampler_state, group, self.version)


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
