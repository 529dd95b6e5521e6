"""``corral bundle validate --play``: bundles played through the real env host and judged.

gridsim plays in this process and shellcraft in bwrap (real sandboxes, one per episode); the
flawed fixture bundle (tests/fixtures/flawed_bundle, one flaw per split) must fail each check
with its reason, and nothing else; the CLI runs as a real subprocess (on shellcraft in bwrap
too).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from corral.envs.bundle import load_bundle
from corral.envs.hosting import env_host
from corral.envs.playcheck import (
    CHECK_BASELINES,
    CHECK_DETERMINISTIC,
    CHECK_DO_NOTHING,
    CHECK_LEAKS,
    CHECK_MALFORMED,
    CHECK_PAYLOAD,
    CHECK_SCHEMAS,
    CHECK_SOLVER,
    UNKNOWN_ARGUMENT,
    PlayReport,
    PlaySettings,
    PolicyError,
    SplitReport,
    malformed_calls,
    max_reward,
    planned_episodes,
    play_check_hosted,
    sample_tasks,
    tool_calls,
)

REPO = Path(__file__).resolve().parents[1]
GRIDSIM = REPO / "bundles" / "gridsim"
SHELLCRAFT = REPO / "bundles" / "shellcraft"
FLAWED = REPO / "tests" / "fixtures" / "flawed_bundle"
SPLIT_CHECKS = [
    CHECK_SOLVER,
    CHECK_DO_NOTHING,
    CHECK_DETERMINISTIC,
    CHECK_LEAKS,
    CHECK_MALFORMED,
    CHECK_BASELINES,
]


def _split(report: PlayReport, name: str) -> SplitReport:
    return next(s for s in report.splits if s.split == name)


def _failed(split: SplitReport) -> dict[str, str]:
    return {c.name: c.detail for c in split.checks if not c.passed}


async def test_gridsim_passes_every_check_in_process() -> None:
    bundle = load_bundle(GRIDSIM)
    settings = PlaySettings(tasks=4)
    played: list[str] = []
    report = await play_check_hosted(bundle, env_host(bundle, None), settings, played.append)
    assert report.passed, report.failures()
    assert len(played) == planned_episodes(bundle, settings) == 2 * (4 * 4 + 2)
    for split in report.splits:
        assert [c.name for c in split.checks] == SPLIT_CHECKS
        assert split.solver.rewards == pytest.approx([1.0] * 4)
        assert split.do_nothing.mean == 0.0  # no submission grades 0
        (greedy,) = split.baselines
        assert greedy.name == "greedy" and greedy.mean is not None and 0.3 < greedy.mean < 1.0
    assert [c.name for c in report.checks] == [CHECK_SCHEMAS, CHECK_PAYLOAD]


async def test_shellcraft_passes_every_check_in_bwrap(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    from corral.sandboxes.bwrap import BwrapProvider

    bundle = load_bundle(SHELLCRAFT)
    provider = BwrapProvider(f"test-{uuid.uuid4().hex[:8]}", state_dir=tmp_path / "state")
    host = env_host(bundle, provider)
    assert "bwrap" in host.description
    report = await play_check_hosted(bundle, host, PlaySettings(tasks=3, splits=("eval",)))
    assert report.passed, report.failures()
    (split,) = report.splits
    assert split.solver.rewards == pytest.approx([1.0] * 3)
    assert split.do_nothing.mean == 0.0
    leaks = next(c for c in split.checks if c.name == CHECK_LEAKS)
    # Each task's seed is hidden (the env's view drops it) and its answer file is an answer.
    assert leaks.detail.startswith("3 hidden and 3 answer value(s)")
    assert await provider.list_owned() == []  # every episode's sandbox was removed


@pytest.fixture(scope="module")
def flawed_report() -> PlayReport:
    import asyncio

    bundle = load_bundle(FLAWED)
    return asyncio.run(play_check_hosted(bundle, env_host(bundle, None), PlaySettings(tasks=2)))


# split -> (the one check that fails there, what its reason says)
FLAWS = {
    "unsolved": (CHECK_SOLVER, "unsolved-0: reward 0.500 < 1.000"),
    "idle_high": (CHECK_DO_NOTHING, "too close to the solver: do-nothing 0.950, solver 1.000"),
    "noisy": (CHECK_DETERMINISTIC, "noisy-0: scores differ between two runs (noise "),
    "leaky": (CHECK_LEAKS, "hidden value 'tok-3273-leaky' in the solver episode's reset prompt"),
    "echo": (CHECK_LEAKS, "hidden value 'tok-6021-echo' in the solver episode's reply to call 1"),
    "fragile": (CHECK_MALFORMED, "answer: not an object: the env failed: the env raised"),
    "baseline_low": (CHECK_BASELINES, "half: mean 0.500 is not between do-nothing 0.600"),
}


@pytest.mark.parametrize("split", sorted(FLAWS))
def test_each_flaw_fails_its_check_with_its_reason(flawed_report: PlayReport, split: str) -> None:
    check, reason = FLAWS[split]
    failed = _failed(_split(flawed_report, split))
    assert list(failed) == [check], failed
    assert reason in failed[check]


def test_the_flawed_bundle_fails_the_bundle_wide_checks(flawed_report: PlayReport) -> None:
    assert _failed(_split(flawed_report, "good")) == {}
    wide = {c.name: c for c in flawed_report.checks}
    assert not wide[CHECK_SCHEMAS].passed
    assert "hint: parameters at properties/topic/minLength" in wide[CHECK_SCHEMAS].detail
    assert not wide[CHECK_PAYLOAD].passed
    assert "env.py holds good-0's answer '79948'" in wide[CHECK_PAYLOAD].detail
    # The leaky split shows the answer too, and one reason line per failed check.
    assert "answer '35173'" in _failed(_split(flawed_report, "leaky"))[CHECK_LEAKS]
    # Tool results are searched for hidden values, never for answers (the solver reads back
    # what it wrote): echo's replies name the token, and only the token is reported.
    echo = _failed(_split(flawed_report, "echo"))[CHECK_LEAKS]
    assert "echo-1: hidden value 'tok-2718-echo' in the solver episode's reply" in echo
    assert " answer " not in echo, echo
    assert len(flawed_report.failures()) == 2 + len(FLAWS)
    assert not flawed_report.passed


def test_malformed_calls_are_the_calls_the_schema_rejects() -> None:
    tools = {t.name: t for t in load_bundle(GRIDSIM).manifest.tools}
    kinds = [kind for kind, _ in malformed_calls(tools["submit_schedule"])]
    assert kinds == [
        "not an object",
        "missing 'schedule'",
        "'schedule' of a wrong type",
        "an unknown argument",
    ]
    # Where the schema allows more arguments, one more is no mistake, so it is not sent.
    open_schema = tools["submit_schedule"].model_copy(
        update={"parameters": {"type": "object", "properties": {"note": {"type": "string"}}}}
    )
    calls = dict(malformed_calls(open_schema))
    assert "an unknown argument" not in calls
    assert calls["'note' of a wrong type"].arguments == {"note": {"not": "this"}}
    assert UNKNOWN_ARGUMENT not in calls["'note' of a wrong type"].arguments


def test_the_sample_is_seeded_and_covers_small_splits() -> None:
    bundle = load_bundle(GRIDSIM)
    first = [t.id for t in sample_tasks(bundle, "eval", 5, seed=3)]
    assert first == [t.id for t in sample_tasks(bundle, "eval", 5, seed=3)]
    assert first != [t.id for t in sample_tasks(bundle, "eval", 5, seed=4)]
    assert first == sorted(first) and len(set(first)) == 5
    flawed = load_bundle(FLAWED)
    assert [t.id for t in sample_tasks(flawed, "good", 10, seed=0)] == ["good-0", "good-1"]


def test_the_maximum_reward_follows_from_the_reward_table() -> None:
    assert max_reward(load_bundle(GRIDSIM).manifest.reward) == 1.0
    shell = load_bundle(SHELLCRAFT).manifest.reward
    assert max_reward(shell) == pytest.approx(1.0)  # 0.8 correct + 0.2 partial
    weighted = shell.model_copy(update={"weights": {"a": 2.0, "b": -1.0}})
    assert max_reward(weighted) == 2.0  # a negative weight's best is its score at 0


def test_a_policy_of_the_wrong_shape_is_named() -> None:
    assert tool_calls([{"name": "bash", "arguments": {"command": "ls"}}])[0].name == "bash"
    with pytest.raises(PolicyError, match="not a list of tool calls"):
        tool_calls({"name": "bash"})
    with pytest.raises(PolicyError, match="call 0 is not"):
        tool_calls([{"name": "bash", "args": {}}])
    with pytest.raises(PolicyError, match="arguments an object"):
        tool_calls([{"name": "bash", "arguments": "ls"}])


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="tasks must be at least 1"):
        PlaySettings(tasks=0)
    with pytest.raises(ValueError, match="margin must be a finite number"):
        PlaySettings(margin=float("nan"))


def _corral(*args: str, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a child; ``columns``: the tables' width (one row a line when wide)."""
    env = {**os.environ, "COLUMNS": str(columns)} if columns else None
    return subprocess.run(
        [sys.executable, "-m", "corral.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
        env=env,
    )


def test_the_cli_prints_a_table_per_split_and_a_reason_per_failure() -> None:
    out = _corral(
        "bundle", "validate", str(FLAWED), "--play", "--split", "good", "--split", "unsolved"
    )
    assert out.returncode == 1, out.stderr
    assert "flawed split good: 2 task(s), seed 0, max reward 1.000" in out.stdout
    assert "flawed split unsolved: 2 task(s)" in out.stdout
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.stdout.splitlines()]
    assert [row[2] for row in cells if row and row[0] == "solver"] == ["1.000", "0.500"]
    reasons = [line for line in out.stderr.splitlines() if " FAIL " in line]
    assert reasons == [
        f"{FLAWED}: FAIL tool schemas: hint: parameters at properties/topic/minLength: "
        "'one' is not of type 'integer'",
        f"{FLAWED}: FAIL payload: the sandbox payload holds env.py holds good-0's answer '79948'",
        f"{FLAWED}: FAIL unsolved: solver at max: 2/2 tasks short of the maximum: "
        "unsolved-0: reward 0.500 < 1.000; unsolved-1: reward 0.500 < 1.000",
    ]
    assert out.stderr.splitlines()[-1] == "3 of 14 play check(s) failed"


def test_the_cli_exits_0_when_every_check_passes_and_2_for_play_flags_alone() -> None:
    ok = _corral("bundle", "validate", str(GRIDSIM), "--play", "--tasks", "2", "--split", "eval")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().endswith("ok, all 8 play checks pass (in-process (no sandbox))")
    usage = _corral("bundle", "validate", str(GRIDSIM), "--tasks", "2")
    assert usage.returncode == 2 and "--tasks only apply with --play" in usage.stderr
    shell = _corral("bundle", "validate", str(SHELLCRAFT), "--play", "--tasks", "1")
    assert shell.returncode == 2 and "needs a sandbox" in shell.stderr


async def test_a_call_over_the_bundles_limits_fails_the_episode(tmp_path: Path) -> None:
    """As the server would refuse it: a solver call larger than [limits] max_call_bytes."""
    folder = tmp_path / "flawed"
    shutil.copytree(FLAWED, folder, ignore=shutil.ignore_patterns("__pycache__"))
    with (folder / "bundle.toml").open("a") as f:
        f.write("\n[limits]\nmax_call_bytes = 256\n")
    solver = (folder / "solver.py").read_text()
    padded = solver.replace('{"value": task.data["a"] + task.data["b"]}', '{"pad": "x" * 300}')
    (folder / "solver.py").write_text(padded)
    bundle = load_bundle(folder)
    settings = PlaySettings(tasks=1, splits=("good",))
    report = await play_check_hosted(bundle, env_host(bundle, None), settings)
    failed = _failed(report.splits[0])
    assert (
        "the answer call's arguments take 310 bytes as JSON, over [limits] max_call_bytes"
        in (failed[CHECK_SOLVER])
    )


async def test_a_bundle_without_a_solver_fails_with_that_reason(tmp_path: Path) -> None:
    folder = tmp_path / "flawed"
    shutil.copytree(FLAWED, folder, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = (folder / "bundle.toml").read_text()
    solver = '[solver]\nmodule = "solver.py"\nfunction = "solve"\n'
    assert solver in manifest
    (folder / "bundle.toml").write_text(manifest.replace(solver, ""))
    bundle = load_bundle(folder)
    settings = PlaySettings(tasks=1, splits=("good",))
    report = await play_check_hosted(bundle, env_host(bundle, None), settings)
    failed = _failed(report.splits[0])
    assert "declares no [solver]" in failed[CHECK_SOLVER]
    assert failed[CHECK_DO_NOTHING] == "no solver reward to compare with"
    assert CHECK_MALFORMED not in failed  # probed all the same, without a good call after


def test_the_cli_validates_shellcraft_by_playing_it_in_bwrap() -> None:
    """``corral bundle validate bundles/shellcraft --play --sandbox bwrap --tasks 2``: the real
    CLI as a child, every episode in a bwrap sandbox of its own; exit 0 and its tables."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    args = ("--play", "--sandbox", "bwrap", "--tasks", "2")
    out = _corral("bundle", "validate", "bundles/shellcraft", *args, columns=200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "shellcraft: bundle-wide checks (sandbox bwrap)" in lines
    for split in ("train", "eval"):
        assert f"shellcraft split {split}: 2 task(s), seed 0, max reward 1.000" in lines
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if "│" in line]
    wide = [r[:2] for r in rows if r[0] in (CHECK_SCHEMAS, CHECK_PAYLOAD)]
    assert wide == [[CHECK_SCHEMAS, "pass"], [CHECK_PAYLOAD, "pass"]]
    checks = [r[:2] for r in rows if r[0] in SPLIT_CHECKS]
    assert checks == [[name, "pass"] for name in SPLIT_CHECKS] * 2, checks
    means = [(r[0], r[2]) for r in rows if r[0] in ("solver", "do-nothing")]
    assert means == [("solver", "1.000"), ("do-nothing", "0.000")] * 2
    naive = [r for r in rows if r[0] == "naive"]
    assert len(naive) == 2 and all(0.0 < float(r[2]) < 1.0 for r in naive), naive
    assert lines[-1] == "bundles/shellcraft: ok, all 14 play checks pass (sandbox bwrap)"
    assert " FAIL " not in out.stderr
