"""What a training step played, kept for the viewer (corral.trainer.rollout_log): the folders of
the due updates, the newest kept, each rollout's samples and spans beside its record."""

from __future__ import annotations

import json
from pathlib import Path

from corral.rollouts.player import Rollout, RolloutTiming
from corral.rollouts.traces import Span
from corral.trainer.rollout_log import RolloutLog, SessionTraces, update_folder
from corral.viewer import reader
from tests.factories import make_row, make_sample


def rollout(session: str, group: int, index: int, reward: float | None = 1.0) -> Rollout:
    sample = make_sample(session, group, reward)
    sample.index = index
    return Rollout(
        row=make_row(task_id=f"task-{group}", split="train"),
        session_id=session,
        samples=[sample],
        reward=reward,
        failed=reward is None,
        reason=None if reward is not None else "env: it died",
        scores={},
        turns=1,
        messages=[{"role": "user", "content": "hi"}],
        timing=RolloutTiming(model_s=0.1, tools_s=0.0, total_s=0.2),
    )


def spans(session: str, start: float) -> list[Span]:
    return [
        Span("episode", start, start + 1.0, session_id=session),
        Span("model_call", start + 0.1, start + 0.5, parent="episode", session_id=session),
    ]


def test_held_spans_are_taken_by_session_and_bounded() -> None:
    held = SessionTraces(max_sessions=2)
    for n, session in enumerate(("a", "b", "c")):
        held.write(spans(session, float(n)))
    assert held.take(["a"]) == []  # the oldest, dropped at the bound
    assert [s.name for s in held.take(["c", "b"])] == ["episode", "model_call"] * 2
    assert held.take(["b", "c", "never"]) == []


def test_a_due_update_keeps_its_rollouts_samples_and_spans_for_the_viewer(
    tmp_path: Path,
) -> None:
    log = RolloutLog(tmp_path, every=2, keep=2)
    played = [rollout("s0", 4, 0), rollout("s1", 4, 1, reward=None)]
    for r in played:
        log.traces.write(spans(r.session_id, 10.0))
    assert log.write(1, played) is None  # not due: nothing written, the spans let go
    assert log.traces.take(["s0", "s1"]) == []
    for r in played:
        log.traces.write(spans(r.session_id, 20.0))
    folder = log.write(2, played)
    assert folder == update_folder(tmp_path, 2) and folder.name == "update-000002"
    records = [json.loads(line) for line in (folder / "episodes.jsonl").open()]
    assert [(r["session_id"], r["group"], r["attempt"]) for r in records] == [
        ("s0", "4", 0),
        ("s1", "4", 1),
    ]
    _, (kept,) = reader.open_sources([folder])
    assert kept.kind == "play"
    detail = reader.episode_detail(kept, 0)
    assert len(detail["samples"]) == 1 and detail["spans"]["kind"] == "trace"
    assert reader.episode_detail(kept, 1)["record"]["reason"] == "env: it died"


def test_only_the_newest_folders_are_kept(tmp_path: Path) -> None:
    log = RolloutLog(tmp_path, every=1, keep=2)
    for step in range(1, 5):
        log.write(step, [rollout(f"s{step}", 0, 0)])
    kept = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert kept == ["update-000003", "update-000004"]
    assert RolloutLog(tmp_path / "none", every=0, keep=0).write(1, []) is None
