"""The training loop end to end on CPU against real local servers: the local engine and gateway
(tiny model), the weather bundle's env server, the megatron-core trainer. Rows ``ok`` (graded 1
when the model asks for the prompt's city) and ``wrong`` (graded 0 whatever it asks)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from corral.envs.server import build_app
from corral.rollouts.rows import RowSettings, read_rows, write_rows
from corral.stack import StackURLs, local_stack
from corral.trainer.config import ConfigError, TrainConfig, load_config
from corral.trainer.metrics import STEP_KEYS, read_metrics
from tests.servers import serve
from tests.weather import write_weather_bundle

pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path) -> Iterator[StackURLs]:
    with local_stack(tiny_model_dir) as urls:
        yield urls


def _config(run_dir: Path, **sections: dict[str, Any]) -> TrainConfig:
    base: dict[str, Any] = {
        "run_dir": str(run_dir),
        "seed": 7,
        "tensorboard": True,
        "rollout": {"groups_per_step": 2, "rollouts_per_row": 2, "temperature": 1.0,
                    "max_tokens": 48, "concurrency": 4},
        "optim": {"lr": 1e-3, "max_tokens_per_micro_batch": 256},
        "schedule": {"steps": 2, "eval_every": 2, "checkpoint_every": 1},
        # An entropy bonus: every step has a gradient, whatever the rewards' spread.
        "loss": {"entropy_coef": 0.01},
    }  # fmt: skip
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return TrainConfig.model_validate(base)


def _services(stack: StackURLs, rows: list[Any], model: Path, *, disk: Path | None = None) -> Any:
    from corral.trainer.services import Services
    from corral.trainer.weights import DiskWeightSync, InProcessWeightSync

    assert stack.local_engine is not None
    sync: Any = (
        InProcessWeightSync(stack.local_engine)
        if disk is None
        else DiskWeightSync([stack.engine], disk, tokenizer_from=model)
    )
    return Services(
        gateway=stack.gateway,
        admin_token=None,
        train_rows=rows,
        eval_rows=rows,
        weight_sync=sync,
        model_path=model,
        eval_groups={r.metadata.task_id: r.metadata.task_id for r in rows},
        group_by="task",
    )


async def _rows(tmp_path: Path, url: str) -> list[Any]:
    await asyncio.to_thread(write_rows, url, tmp_path / "rows", RowSettings(max_turns=2))
    return read_rows(tmp_path / "rows" / "all.jsonl")


async def _train(config: TrainConfig, services: Any) -> list[dict[str, Any]]:
    from corral.trainer.loop import Trainer

    return await Trainer(config, services).run()


def _checkpoint(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step-{step:06d}" / "model-rank0.pt"
    return torch.load(path, weights_only=True)


async def _engine_version(stack: StackURLs) -> str:
    async with httpx.AsyncClient() as http:
        return str((await http.get(f"{stack.engine}/get_model_info")).json()["weight_version"])


async def test_a_run_trains_evaluates_checkpoints_and_resumes_exactly(
    stack: StackURLs, tiny_model_dir: Path, tmp_path: Path
) -> None:
    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok", "wrong"))
    with serve(build_app(bundle)) as url:
        rows = await _rows(tmp_path, url)
        services = _services(stack, rows, tiny_model_dir)
        # A decaying learning rate: the resumed run must continue the schedule.
        linear = {"lr_decay_style": "linear"}
        straight = await _train(_config(tmp_path / "a", optim=linear), services)
        assert await _engine_version(stack) == "step-2"

        # The same run, stopped after one step and resumed (weights pushed through disk now).
        disk = _services(stack, rows, tiny_model_dir, disk=tmp_path / "weights")
        first = await _train(_config(tmp_path / "b", schedule={"steps": 1}, optim=linear), disk)
        resumed = await _train(_config(tmp_path / "b", optim=linear), disk)
        assert await _engine_version(stack) == "step-2"

    kinds = [(line["step"], line.get("kind", "step")) for line in straight]
    assert kinds == [(0, "eval"), (1, "step"), (2, "step"), (2, "eval")]
    for line in straight[1:3]:
        missing = [k for k in STEP_KEYS if k not in line]
        assert not missing
        unmeasured = [k for k in STEP_KEYS if isinstance(line[k], float) and math.isnan(line[k])]
        assert unmeasured == ["kl"]  # no reference model
        assert line["rollouts"] == 4 and line["groups"] == 2 and line["grad_norm"] > 0
        assert line["time/generation"] > 0 and line["time/training"] > 0
    evals = [line for line in straight if line.get("kind") == "eval"]
    assert all(line["eval/episodes"] == 2 for line in evals)
    assert {"eval/group/w-ok", "eval/group/w-wrong"} <= set(evals[0])
    assert evals[0]["eval/group/w-wrong"] == 0.0  # graded 0 whatever the model asks

    # The file matches what run() returned, with null (strict JSON) where nothing was measured.
    on_disk = read_metrics(tmp_path / "a")
    assert [line["step"] for line in on_disk] == [0, 1, 2, 2]
    assert on_disk[1]["kl"] is None
    assert "NaN" not in (tmp_path / "a" / "metrics.jsonl").read_text()
    assert list((tmp_path / "a" / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "a" / "evals" / "step-000002" / "summary.json").is_file()

    # Training changed the weights.
    initial = _checkpoint(tmp_path / "b", 1)
    final = _checkpoint(tmp_path / "a", 2)
    assert any(not torch.equal(initial[n], final[n]) for n in initial)

    # Resume: the next step is the uninterrupted run's (seeded rollouts, same data order).
    assert [line["step"] for line in first] == [0, 1, 1]
    assert [(line["step"], line.get("kind", "step")) for line in resumed] == [
        (2, "step"),
        (2, "eval"),
    ]
    a2, b2 = straight[2], resumed[0]
    for key in ("reward/mean", "tokens", "trained_tokens", "samples", "rollouts", "lr"):
        assert a2[key] == b2[key], key
    assert [straight[1]["lr"], a2["lr"]] == pytest.approx([1e-3, 5e-4])  # linear over 2 steps
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "tis_weight"):
        assert b2[key] == pytest.approx(a2[key], rel=1e-4, abs=1e-6), key
    b_final = _checkpoint(tmp_path / "b", 2)
    for name, tensor in final.items():
        # The rollouts' logprobs (TIS) come from a continuously batching engine, whose last
        # bits depend on which requests share a step: seen 1 element in 32768 off by 4.5e-6.
        torch.testing.assert_close(b_final[name], tensor, rtol=1e-4, atol=1e-5)
    # The stopped run's last evaluation (step 1) stays in the file; each step's lines once.
    assert [line["step"] for line in read_metrics(tmp_path / "b")] == [0, 1, 1, 2, 2]


async def test_overlap_plays_the_next_steps_rollouts_while_training(
    stack: StackURLs, tiny_model_dir: Path, tmp_path: Path
) -> None:
    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok", "wrong"))
    with serve(build_app(bundle)) as url:
        rows = await _rows(tmp_path, url)
        config = _config(
            tmp_path / "c",
            rollout={"overlap": True},
            schedule={"steps": 3, "eval_every": 0, "checkpoint_every": 2},
            loss={"kl_coef": 0.1},
        )
        lines = await _train(config, _services(stack, rows, tiny_model_dir))
    assert [line["step"] for line in lines] == [1, 2, 3]
    # KL to the frozen starting model: none before the first update, some after it.
    assert abs(lines[0]["kl"]) < 1e-6 and lines[2]["kl"] > 1e-6
    assert all(line["rollouts"] == 4 for line in lines)
    # The checkpoint of step 2 points at the rows the already running fill of step 3 took.
    state = json.loads((tmp_path / "c" / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["next_group_index"] == 4 and state["sampler"] == {"epoch": 1, "offset": 2}


async def test_a_batch_that_cannot_fill_stops_the_run_with_the_reasons(
    stack: StackURLs, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from corral.trainer.groups import BatchUnfillable

    bundle = write_weather_bundle(tmp_path / "weather", modes=("raise",))
    with serve(build_app(bundle)) as url:
        rows = await _rows(tmp_path, url)
        config = _config(
            tmp_path / "d",
            rollout={"groups_per_step": 1, "max_draws": 2, "temperature": 0.0},
            schedule={"eval_every": 0},
        )
        with pytest.raises(BatchUnfillable, match=r"max_draws \(2\).*failed_rollout: 2"):
            await _train(config, _services(stack, rows, tiny_model_dir))
    assert not (tmp_path / "d" / "checkpoints").exists()
    dropped = [json.loads(x) for x in (tmp_path / "d" / "dropped.jsonl").read_text().splitlines()]
    assert [d["reason"] for d in dropped] == ["failed_rollout"] * 2
    assert all(d["tasks"] == ["w-raise"] and "RuntimeError" in d["detail"] for d in dropped)


class _NoWeightSync:
    """The scripted engine runs no model: there is nowhere to push the weights."""

    async def push(self, model: Any, spec: Any, version: str) -> None:
        pass


def _move(tokenizer: Any, name: str, schedule: list[int]) -> list[int]:
    """A gridsim tool call as the model would have sampled it, then ``<|im_end|>``."""
    body = json.dumps({"name": name, "arguments": {"schedule": schedule}})
    ids = list(tokenizer(f"<tool_call>\n{body}\n</tool_call>", add_special_tokens=False).input_ids)
    return [*ids, int(tokenizer.convert_tokens_to_ids("<|im_end|>"))]


async def test_samples_per_rollout_counts_every_fork(
    tiny_think_model_dir: Path, tmp_path: Path
) -> None:
    """One step of one group of two gridsim rollouts, the scripted engine playing the model
    behind a gateway with template history and the Qwen3-style template, which forks at every
    turn: one rollout simulates then submits (2 turns, 2 samples), the other submits at once
    (1 turn, 1 sample). The metrics line says 3 samples, 1.5 per rollout."""
    from transformers import AutoTokenizer

    from corral.engines.sglang import SGLangClient
    from corral.gateway.app import build_gateway_app
    from corral.gateway.pipeline import TurnPipeline
    from corral.gateway.settings import GatewaySettings
    from corral.trainer.services import Services
    from tests.conftest import ROOT
    from tests.gateway_stack import ADMIN
    from tests.scripted_engine import ScriptedEngine

    tokenizer: Any = AutoTokenizer.from_pretrained(str(tiny_think_model_dir))
    engine = ScriptedEngine(
        eos_token_ids=[int(tokenizer.convert_tokens_to_ids("<|im_end|>"))],
        decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False)),
    )
    settings = GatewaySettings(
        model_name="tiny",
        max_context_tokens=32_768,
        admin_token=ADMIN,
        engine_timeout_s=60,
        history="template",
        reasoning_parser="qwen3",
        chat_template_kwargs={"enable_thinking": False},
    )
    schedule = [1] + [0] * 23
    # One rollout at a time (concurrency 1), so the engine's requests come in this order.
    engine.push(
        _move(tokenizer, "simulate_schedule", schedule),
        _move(tokenizer, "submit_schedule", schedule),
        _move(tokenizer, "submit_schedule", schedule),
    )
    with serve(build_app(ROOT / "bundles" / "gridsim")) as env_url, serve(engine.app) as engine_url:
        await asyncio.to_thread(write_rows, env_url, tmp_path / "rows", RowSettings(max_turns=3))
        rows = read_rows(tmp_path / "rows" / "all.jsonl")[:1]
        client = SGLangClient(engine_url, timeout=60, retries=0)
        pipeline = TurnPipeline(settings, client, tokenizer)
        with serve(build_gateway_app(settings, client, pipeline)) as gateway_url:
            services = Services(
                gateway=gateway_url,
                admin_token=ADMIN,
                train_rows=rows,
                eval_rows=[],
                weight_sync=_NoWeightSync(),
                model_path=tiny_think_model_dir,
            )
            config = _config(
                tmp_path / "run",
                rollout={"groups_per_step": 1, "concurrency": 1, "max_tokens": 256},
                optim={"max_tokens_per_micro_batch": 8192},
                schedule={"steps": 1, "eval_every": 0, "checkpoint_every": 0},
            )
            await _train(config, services)
    assert engine.pending == 0 and len(engine.requests) == 3
    (line,) = read_metrics(tmp_path / "run")
    assert line["rollouts"] == 2 and line["rollouts_failed"] == 0
    assert line["samples"] == 3
    assert line["samples_per_rollout"] == 1.5
    # What the step trained on: per rollout (session), its samples' turns.
    text = (tmp_path / "run" / "rollouts" / "update-000001" / "samples.jsonl").read_text()
    turns: dict[str, list[int]] = {}
    for sample in map(json.loads, text.splitlines()):
        turns.setdefault(sample["rollout_id"], []).append(sample["metadata"]["num_turns"])
    assert sorted(turns.values()) == [[1], [1, 1]]


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout]\ngroups_per_step = 0\n")
    with pytest.raises(ConfigError, match=r"rollout\.groups_per_step"):
        load_config(bad)
    bad.write_text("[rollout\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"optim\.learning_rate"):
        load_config(None, ["optim.learning_rate=1"])
    with pytest.raises(ConfigError, match=r"not section\.key=value"):
        load_config(None, ["steps"])
    with pytest.raises(ConfigError, match="url and gateway go together"):
        load_config(None, ['engine.url="http://127.0.0.1:1"'])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")
    good = load_config(None, ["rollout.temperature=1.5", "env.url=http://host:1"])
    assert good.rollout.temperature == 1.5 and good.env.url == "http://host:1"


def test_metrics_files_and_the_plot(tmp_path: Path) -> None:
    from corral.trainer.metrics import MetricsWriter
    from corral.trainer.plot import plot_run

    with MetricsWriter(tmp_path, tensorboard=False) as out:
        out.write({"step": 0, "kind": "eval", "eval/reward/mean": 0.2, "eval/reward/se": 0.05})
        for step in (1, 2):
            out.write({"step": step, "reward/mean": 0.1 * step, "kl": math.nan,
                       "time/generation": 1.0, "time/training": 2.0, "time/weight_sync": 0.1,
                       "dropped/failed_rollout": step - 1})  # fmt: skip
    # A resumed run from step 1 drops what a crash left beyond it and knows what was evaluated.
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=1) as resumed:
        assert resumed.evaluated_steps == {0}
        resumed.write({"step": 1, "kind": "eval", "eval/reward/mean": 0.3})
        assert resumed.evaluated_steps == {0, 1}
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=1) as again:
        assert again.evaluated_steps == {0, 1}  # kept: the resumed step's eval is not lost
    assert [line["step"] for line in read_metrics(tmp_path)] == [0, 1, 1]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in read_metrics(tmp_path)[:2])
    )
    png = plot_run(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "rew')  # torn by a crash: skipped
    assert len(read_metrics(tmp_path)) == 2
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        read_metrics(tmp_path)


def test_corral_train_serves_its_own_stack_and_plots(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The command as the README runs it: engine, gateway and env server (episodes in local
    sandboxes) started by ``corral train`` itself, rows written into the run folder."""
    from corral.cli import main

    run = _one_greedy_step(tiny_model_dir, tmp_path)
    assert (run / "rows" / "train.jsonl").is_file()
    assert json.loads((run / "config.json").read_text())["schedule"]["steps"] == 1
    assert (run / "curves.png").stat().st_size > 10_000
    assert main(["train", "--set", "rollout.temperature=-1"]) == 2


async def test_a_time_limit_ends_the_run_like_its_last_step_and_a_rerun_goes_on(
    stack: StackURLs, tiny_model_dir: Path, tmp_path: Path
) -> None:
    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok", "wrong"))
    schedule = {"steps": 3, "eval_every": 5, "checkpoint_every": 5}
    with serve(build_app(bundle)) as url:
        services = _services(stack, await _rows(tmp_path, url), tiny_model_dir)
        # No second step fits in a microsecond: the run stops after its first.
        cut = await _train(
            _config(tmp_path / "run", schedule={**schedule, "time_limit": 1e-6}), services
        )
        rest = await _train(_config(tmp_path / "run", schedule=schedule), services)

    # Stopped as at a last step: checkpointed and evaluated there, although neither is due.
    assert [(m["step"], m.get("kind", "step")) for m in cut] == [
        (0, "eval"),
        (1, "step"),
        (1, "eval"),
    ]
    assert (tmp_path / "run" / "evals" / "step-000001" / "summary.json").is_file()
    # The rerun resumed from that checkpoint and went on to the last step.
    assert [(m["step"], m.get("kind", "step")) for m in rest] == [
        (2, "step"),
        (3, "step"),
        (3, "eval"),
    ]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step-000001",
        "step-000003",
    ]
    # The file keeps the evaluation of the step the rerun resumed from (not due again, so a
    # rerun that dropped it would lose it).
    assert [(m["step"], m.get("kind", "step")) for m in read_metrics(tmp_path / "run")] == [
        (0, "eval"), (1, "step"), (1, "eval"), (2, "step"), (3, "step"), (3, "eval"),
    ]  # fmt: skip


def test_corral_train_can_run_its_services_as_child_processes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``engine.processes`` and ``env.processes``: ``corral engine``, ``corral gateway`` and
    ``corral serve`` as child processes, weights through disk; the run is the same as with
    threads (greedy rollouts: the same rewards) and no child outlives it."""
    from corral.cli import main

    run = _one_greedy_step(tiny_model_dir, tmp_path, "engine.processes=true", "env.processes=true")
    bundle = tmp_path / "weather"
    assert (run / "weights" / "step-1" / "config.json").is_file()  # pushed through disk
    for name in ("engine", "gateway", "env"):
        assert "Uvicorn running" in (run / "logs" / f"{name}.log").read_text()
    assert not _processes_naming(str(bundle)) and not _processes_naming(str(tiny_model_dir))
    # Settings that contradict each other are refused before anything starts.
    assert main(["train", "--set", "engine.processes=true", "--set", 'engine.url="http://x"',
                 "--set", 'engine.gateway="http://y"']) == 2  # fmt: skip


def _one_greedy_step(tiny_model: Path, tmp_path: Path, *extra: str) -> Path:
    """``corral train`` for one step at temperature 0 on the weather bundle (rows ``ok`` and
    ``wrong``, evaluated on the train split), with ``extra`` settings; checks the lines and the
    rewards every such run has (0.5: one row graded 1, one graded 0); returns the run folder."""
    from corral.cli import main

    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok", "wrong"))
    run = tmp_path / "run"
    sets = [f'model.path="{tiny_model}"', f'env.bundle="{bundle}"', 'env.eval_split="train"',
            "rollout.groups_per_step=2", "rollout.rollouts_per_row=2", "rollout.temperature=0",
            "rollout.max_tokens=48", "schedule.eval_every=1", "tensorboard=false",
            *extra]  # fmt: skip
    rc = main(["train", "--run-dir", str(run), "--steps", "1", *[f"--set={s}" for s in sets]])
    assert rc == 0
    lines = read_metrics(run)
    assert [(m["step"], m.get("kind", "step")) for m in lines] == [
        (0, "eval"),
        (1, "step"),
        (1, "eval"),
    ]
    assert lines[0]["eval/reward/mean"] == 0.5 and lines[1]["reward/mean"] == 0.5
    return run


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def test_weights_go_through_disk_unless_the_engine_is_in_this_process() -> None:
    """What the leader's weight sync and every follower's must agree on (under torchrun the
    followers build theirs from the config alone)."""
    assert TrainConfig().engine.weights_in_memory
    spawned = TrainConfig.model_validate({"engine": {"processes": True}})
    remote = TrainConfig.model_validate({"engine": {"url": "http://e", "gateway": "http://g"}})
    assert not spawned.engine.weights_in_memory and not remote.engine.weights_in_memory


def test_corral_train_under_torchrun_with_tensor_parallel_2(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two ranks on CPU (gloo) as ``torchrun`` starts them: rank 0 runs the services and the
    rollouts, rank 1 follows its commands (over the command channel) and trains its shard; the
    run's rewards are the single-process run's (greedy rollouts), every rank writes its
    checkpoint shard, and the evaluation after the step plays the pushed weights."""
    import subprocess
    import sys

    from tests.servers import free_port

    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok", "wrong"))
    run = tmp_path / "run"
    sets = [
        f'model.path="{tiny_model_dir}"',
        f'env.bundle="{bundle}"',
        'env.eval_split="train"',
        "rollout.groups_per_step=2",
        "rollout.rollouts_per_row=2",
        "rollout.temperature=0",
        "rollout.max_tokens=48",
        "schedule.eval_every=1",
        "tensorboard=false",
        "loss.entropy_coef=0.01",
    ]  # fmt: skip  (a gradient whatever the rewards)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
               "--nproc-per-node=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               "-m", "corral.cli", "train", "--run-dir", str(run), "--steps", "1",
               *[f"--set={s}" for s in [*sets, "model.tensor_parallel=2"]]]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from corral.cli import main

    alone = tmp_path / "alone"
    args = ["train", "--run-dir", str(alone), "--steps", "1", *[f"--set={s}" for s in sets]]
    assert main(args) == 0
    lines = read_metrics(run)
    assert [(m["step"], m.get("kind", "step")) for m in lines] == [
        (0, "eval"),
        (1, "step"),
        (1, "eval"),
    ]  # once: rank 1 wrote no line
    assert lines[0]["eval/reward/mean"] == 0.5 and lines[1]["reward/mean"] == 0.5
    one = read_metrics(alone)[1]
    for key in ("loss", "entropy", "grad_norm", "tis_weight"):  # the same update as one process
        assert lines[1][key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert lines[1]["grad_norm"] > 0 and lines[1]["trained_tokens"] == one["trained_tokens"] > 0
    shards = sorted(p.name for p in (run / "checkpoints" / "step-000001").glob("model-rank*"))
    assert shards == ["model-rank0.pt", "model-rank1.pt"]
    assert lines[2]["weight_version"] == "step-1"  # evaluated on the pushed weights
