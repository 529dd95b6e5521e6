"""``corral run``'s output, as a user piping it sees it: stages under numbered headings in the
order they run, every output path printed (``drift.json`` too), no line wrapped, every reward
with three decimals, and ``--seed`` making the run repeatable.

Three real runs, small (2 conversations, 2 policy days, about 30 s each), stdout a pipe: seed 0
twice and seed 1 once, each in its own workdir with the tiny model copied in from the test
session's cache (a cache hit, not a build).

"The same samples" means the same samples files once what names a run rather than what was
played is left out: session and request ids (``session_id``, ``rollout_id``, ``rid``), the env
server's URL (a free port) and wall-clock timings. Tokens, loss masks, logprobs, rewards,
statuses and the rest must be equal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
GRIDSIM = ROOT / "bundles" / "gridsim"
SETTINGS = ["--episodes", "2", "--policy-days", "2"]
STAGES = ["the tiny model", "the gateway", "the env server", "slime rollouts", "the trained policy"]
HEADING = re.compile(r"^(\d)/(\d) (.+)$")
REWARD = r"\d\.\d{3}"
MEAN = rf"{REWARD} ± {REWARD}"
# Keys that name a run (ids, a port, timings), not what was played.
VOLATILE = {"session_id", "rollout_id", "rid", "url", "timing"}


@dataclass(frozen=True)
class Run:
    workdir: Path
    out: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()

    def samples(self, name: str) -> list[Any]:
        """The samples file ``name`` under the run's outputs, volatile keys left out."""
        found = {
            "samples.jsonl": self.workdir / "runs" / "gateway-demo" / "samples.jsonl",
            "slime-samples.jsonl": self.workdir / "runs" / "gridsim" / "slime-samples.jsonl",
        }[name]
        return [_stable(json.loads(line)) for line in found.read_text().splitlines()]


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def _run(tmp: Path, tiny_model_dir: Path, seed: int) -> Run:
    workdir = tmp / f"seed{seed}-{len(list(tmp.iterdir()))}"
    shutil.copytree(tiny_model_dir, workdir / "models" / tiny_model_dir.name)
    # A pipe, with nothing in the environment that makes rich size or colour for a terminal.
    env = {k: v for k, v in os.environ.items() if k not in {"COLUMNS", "FORCE_COLOR", "LINES"}}
    cmd = [sys.executable, "-m", "corral.cli", "run", "--workdir", str(workdir), *SETTINGS]
    proc = subprocess.run(
        [*cmd, "--seed", str(seed)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Run(workdir=workdir, out=proc.stdout)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("corral-run")
    return {
        "first": _run(tmp, tiny_model_dir, 0),
        "again": _run(tmp, tiny_model_dir, 0),
        "other": _run(tmp, tiny_model_dir, 1),
    }


def _section(run: Run, stage: str) -> list[str]:
    """The lines under the heading of ``stage``, up to the next heading."""
    lines = run.lines
    starts = [(i, m.group(3)) for i, line in enumerate(lines) if (m := HEADING.match(line))]
    for n, (i, title) in enumerate(starts):
        if title.startswith(stage):
            end = starts[n + 1][0] if n + 1 < len(starts) else len(lines)
            return lines[i + 1 : end]
    raise AssertionError(f"no heading for {stage!r} in:\n{run.out}")


def test_stages_are_headed_in_the_order_they_run(runs: dict[str, Run]) -> None:
    run = runs["first"]
    headings = [m.groups() for line in run.lines if (m := HEADING.match(line))]
    assert [int(n) for n, _, _ in headings] == [1, 2, 3, 4, 5]
    assert {total for _, total, _ in headings} == {"5"}
    for (_, _, title), stage in zip(headings, STAGES, strict=True):
        assert title.startswith(stage)
    # Each stage's results are printed under its own heading, not after a later stage's.
    assert any("(cached)" in line for line in _section(run, "the tiny model"))
    assert any(line.startswith("samples in ") for line in _section(run, "the gateway"))
    assert any(line.startswith("rows: ") for line in _section(run, "the env server"))
    assert any("idle policy" in line for line in _section(run, "the env server"))
    assert any("slime-shaped samples in" in line for line in _section(run, "slime rollouts"))
    assert any("episodes in " in line for line in _section(run, "the trained policy"))


def test_the_drift_reports_are_named_and_written(runs: dict[str, Run]) -> None:
    run = runs["first"]
    drift = run.workdir / "runs" / "gateway-demo" / "drift.json"
    assert f"drift reports in {drift}" in run.lines
    assert len(json.loads(drift.read_text())) == 2  # one report per conversation
    assert f"samples in {drift.parent / 'samples.jsonl'}" in run.lines


def test_piped_output_is_not_wrapped(runs: dict[str, Run]) -> None:
    run = runs["first"]
    # Lines far over 80 columns, each whole on one line.
    env_line = [line for line in run.lines if line.startswith("env server ")]
    assert len(env_line) == 1 and env_line[0].endswith(
        f"serving {GRIDSIM}, each episode in a local sandbox"
    )
    idle = [line for line in run.lines if "eval episodes with the idle policy" in line]
    assert len(idle) == 1 and idle[0].endswith("(the verifier grades idling 0.200)")
    assert len(idle[0]) > 80
    # Tables at their natural width: no header split over two lines.
    assert any("│ model tokens │" in line or "┃ model tokens ┃" in line for line in run.lines)
    assert any("┃ mean ± se " in line for line in run.lines)


def test_every_reward_has_three_decimals(runs: dict[str, Run]) -> None:
    run = runs["first"]
    means = [line for line in run.lines if "mean reward" in line]
    assert len(means) == 2 and all(re.search(rf"mean reward {MEAN}\b", x) for x in means)
    idle = next(line for line in run.lines if "idle policy" in line)
    assert re.search(rf": eval-\d{{4}} {REWARD}, eval-\d{{4}} {REWARD}; mean {MEAN} ", idle)
    policy_all = next(line for line in run.lines if line.startswith("│ all "))
    assert re.search(rf"│ {MEAN} +│", policy_all)
    # And no number printed in any other format: every decimal left once URLs and paths are
    # taken out is a three-decimal one.
    text = re.sub(r"\S*/\S*", " ", run.out)
    decimals = re.findall(r"(?<![\d.])\d+\.\d+(?![\d.])", text)
    assert decimals and all(re.fullmatch(REWARD, d) for d in decimals), decimals


def _printed_numbers(run: Run) -> str:
    """The output with what differs between two runs of one seed masked: the workdir, ports,
    session ids and elapsed times."""
    text = run.out.replace(str(run.workdir), "WORKDIR")
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    text = re.sub(r"│ [0-9a-f]{8} │", "│ SESSION │", text)
    return re.sub(r"\d+:\d\d:\d\d", "T", text)


def test_the_same_seed_repeats_the_run(runs: dict[str, Run]) -> None:
    first, again = runs["first"], runs["again"]
    for name in ("samples.jsonl", "slime-samples.jsonl"):
        assert first.samples(name) == again.samples(name), name
    assert _printed_numbers(first) == _printed_numbers(again)


def test_another_seed_samples_other_episodes(runs: dict[str, Run]) -> None:
    first, other = runs["first"], runs["other"]
    # Other conversations (cities, forecasts) and other slime rollouts (sampling seeds) ...
    for name in ("samples.jsonl", "slime-samples.jsonl"):
        assert first.samples(name) != other.samples(name), name
    # ... other idle episodes and other policy days.
    idle = [next(x for x in r.lines if "idle policy" in x) for r in (first, other)]
    assert idle[0] != idle[1]
    assert _policy_days(first) != _policy_days(other)


def _policy_days(run: Run) -> set[str]:
    episodes = run.workdir / "runs" / "gridsim" / "policy-eval" / "episodes.jsonl"
    return {json.loads(line)["task_id"] for line in episodes.read_text().splitlines()}
