"""``corral run``, the README's main-job command, end to end on embedded defaults (the tiny
model is taken from the test session's cache instead of being built again)."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from corral.envs.bundle import load_bundle
from corral.envs.episode import Task
from corral.run import run_main_job

GRIDSIM = Path(__file__).resolve().parent.parent / "bundles" / "gridsim"


def test_the_main_job_runs_the_whole_path(tiny_model_dir: Path, tmp_path: Path) -> None:
    models = tmp_path / "work" / "models"
    models.mkdir(parents=True)
    shutil.copytree(tiny_model_dir, models / tiny_model_dir.name)  # a cache hit, not a build
    assert run_main_job(workdir=tmp_path / "work", episodes=2, policy_days=9) == 0
    runs = tmp_path / "work" / "runs"
    gateway_samples = (runs / "gateway-demo" / "samples.jsonl").read_text().splitlines()
    assert len(gateway_samples) >= 2
    rows = (runs / "gridsim" / "rows" / "all.jsonl").read_text().splitlines()
    assert len(rows) == 2200
    played = [json.loads(line) for line in (runs / "gridsim" / "slime-samples.jsonl").open()]
    assert {s["metadata"]["task_id"] for s in played} == {"eval-0000", "eval-0001"}
    for s in played:
        # gridsim grades every episode: a reward (0 when the tiny model cannot play), no failure
        assert s["reward"] is not None and "failure" not in s["metadata"]
        assert s["status"] in ("completed", "truncated")
        assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"]
        assert sum(s["loss_mask"]) > 0

    # The policy examples/gridsim_rl trained plays gridsim on this CPU: legal schedules that
    # beat the greedy rule on the same days (idle grades 0.2; the tiny model above earns
    # nothing).
    summary = json.loads((runs / "gridsim" / "policy-eval" / "summary.json").read_text())
    assert summary["overall"]["episodes"] == 9 and summary["overall"]["failed"] == 0
    assert summary["overall"]["zero_share"] == 0.0
    assert set(summary["groups"]) == {"1", "2", "4"}  # battery sizes, from the bundle
    episodes = [
        json.loads(line) for line in (runs / "gridsim" / "policy-eval" / "episodes.jsonl").open()
    ]
    days = {task.id: task for task in load_bundle(GRIDSIM).tasks("eval")}
    rule = statistics.fmean(_greedy_grade(days[e["task_id"]]) for e in episodes)
    assert summary["overall"]["mean"] > rule + 0.05


def _greedy_grade(task: Task) -> float:
    from bundles.gridsim.baselines import baseline_scores

    return baseline_scores(task.data)[1]["grade"]
