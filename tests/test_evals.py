"""Evals against real local servers: the mean with its standard error, failures counted apart,
groups from the bundle's ``[eval] group_by``, and ``corral eval`` end to end on gridsim."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.envs.server import build_app
from corral.rollouts.evals import Stats, eval_rows, write_eval
from corral.rollouts.rows import Row, RowSettings, write_rows
from corral.stack import local_stack
from tests.conftest import ROOT
from tests.servers import serve
from tests.weather import write_weather_bundle

ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path) -> Iterator[str]:
    with local_stack(tiny_model_dir, admin_token=ADMIN) as urls:
        yield urls.gateway


def _read_rows(path: Path) -> list[Row]:
    return [Row.model_validate_json(line) for line in path.read_text().splitlines()]


def test_stats_mean_se_and_failures_apart() -> None:
    stats = Stats.of([1.0, 0.0, None, 0.5])
    assert (stats.episodes, stats.graded, stats.failed) == (4, 3, 1)
    assert stats.mean == pytest.approx(0.5) and stats.se == pytest.approx(0.5 / 3**0.5)
    assert stats.zero_share == pytest.approx(1 / 3)
    assert (
        Stats.of([None]).mean is None and "no episode graded (1 failed)" in Stats.of([None]).line()
    )


async def test_an_eval_reports_graded_and_failed_episodes_per_group(
    gateway: str, tmp_path: Path
) -> None:
    bundle = write_weather_bundle(tmp_path / "weather", modes=("ok", "raise", "crash"))
    with serve(build_app(bundle)) as url:
        await asyncio.to_thread(write_rows, url, tmp_path / "rows", RowSettings())
        rows = _read_rows(tmp_path / "rows" / "train.jsonl")
        seen: list[str] = []
        report = await eval_rows(
            rows, gateway, admin_token=ADMIN, n=2, sampling={"temperature": 0.0},
            on_episode=lambda r: seen.append(r.task_id),
        )  # fmt: skip
    assert sorted(seen) == sorted(["w-ok", "w-raise", "w-crash"] * 2)
    overall = report.overall
    assert (overall.episodes, overall.graded, overall.failed) == (6, 2, 4)
    assert overall.mean == 1.0 and overall.se == 0.0
    assert report.group_by == "mode"
    assert report.groups["ok"].mean == 1.0 and report.groups["raise"].failed == 2
    assert report.groups["crash"].graded == 0
    failed = [e for e in report.episodes if e.failed]
    assert all(e.reason and e.reward is None for e in failed)
    write_eval(report, tmp_path / "out")
    lines = (tmp_path / "out" / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[0])["messages"][0]["role"] == "system"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["overall"]["failed"] == 4 and "episodes" not in summary


def test_corral_eval_prints_the_mean_per_battery_size(gateway: str, tmp_path: Path) -> None:
    with serve(build_app(ROOT / "bundles" / "gridsim")) as url:
        write_rows(url, tmp_path / "rows", RowSettings(max_turns=1))
        env = {**os.environ, "CORRAL_ADMIN": ADMIN}
        out = subprocess.run(
            [sys.executable, "-m", "corral.cli", "eval", str(tmp_path / "rows" / "all.jsonl"),
             "--gateway", gateway, "--admin-token-var", "CORRAL_ADMIN", "--limit", "4",
             "--temperature", "0", "--out", str(tmp_path / "eval")],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr + out.stdout
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["group_by"] == "battery.capacity_mwh"
    assert summary["overall"]["episodes"] == 4 and summary["groups"]
    assert sum(g["episodes"] for g in summary["groups"].values()) == 4
    assert "mean reward" in out.stdout and "battery.capacity_mwh" in out.stdout
    # Every episode's spans, written as it ended, name the session its record names.
    spans = [json.loads(line) for line in (tmp_path / "eval" / "traces.jsonl").open()]
    sessions = {
        json.loads(line)["session_id"] for line in (tmp_path / "eval" / "episodes.jsonl").open()
    }
    assert {s["session_id"] for s in spans if s["name"] == "episode"} == sessions
    assert len(sessions) == 4
