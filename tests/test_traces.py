"""Traces (``traces.jsonl``): the writer's bounds, and the spans the episode player, an eval and
a host-mode agent write, against real local servers (the tiny model on the local engine, the
gateway, the weather bundle's env server), read back by the viewer's reader."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from corral.adapters.agents import play_with_agent
from corral.envs.server import build_app
from corral.gateway.client import GatewayAdmin
from corral.rollouts.evals import eval_rows, write_eval
from corral.rollouts.player import Player
from corral.rollouts.rows import Row, RowSettings, write_rows
from corral.rollouts.traces import TRACES_FILE, EpisodeTrace, Span, TraceBuffer, TraceWriter
from corral.stack import local_stack
from corral.viewer import reader
from tests.servers import serve
from tests.weather import write_weather_bundle

ADMIN = "admin-secret"
GREEDY = {"temperature": 0.0}
# A host-mode agent: one model call through its session, then exit 0 (corral ends the episode).
ONE_CALL_AGENT = """
import os, httpx
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
prompt = os.environ["CORRAL_TASK_PROMPT"]
body = {"model": "corral", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
httpx.post(base + "/chat/completions", json=body, headers={"Authorization": "Bearer " + key},
           timeout=60).raise_for_status()
"""


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path) -> Iterator[str]:
    with local_stack(tiny_model_dir, admin_token=ADMIN) as urls:
        yield urls.gateway


@pytest.fixture(scope="module")
def weather(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Row]]:
    """The weather bundle (tasks ``w-ok``, ``w-raise``) served here, and its rows by task."""
    root = tmp_path_factory.mktemp("weather")
    bundle = write_weather_bundle(root / "bundle", modes=("ok", "raise"))
    with serve(build_app(bundle)) as url:
        write_rows(url, root / "rows", RowSettings())
        lines = (root / "rows" / "train.jsonl").read_text().splitlines()
        rows = [Row.model_validate_json(line) for line in lines]
        yield {r.metadata.task_id: r for r in rows}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _episode(n: int, attrs: dict[str, Any] | None = None) -> list[Span]:
    trace = EpisodeTrace(task_id=f"t-{n}", attempt=0)
    trace.session_id = f"s-{n}"
    with trace.span("env_reset"):
        pass
    trace.add("model_call", trace.started_s, trace.started_s + 0.1, turn=0)
    return trace.spans(attrs)


def test_the_writer_stops_at_its_cap_with_a_marker_and_cuts_long_strings(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path, max_bytes=4000, max_attr_chars=50)
    for n in range(40):
        writer.write(_episode(n, {"reason": "x" * 500}))
    path = tmp_path / TRACES_FILE
    assert path.stat().st_size <= 4000
    lines = _lines(path)
    assert lines[-1]["truncated"] is True and "start_s" not in lines[-1]
    spans = lines[:-1]
    assert spans and len(spans) % 3 == 0  # whole episodes only: 3 spans each
    assert all(len(s["attrs"].get("reason", "")) <= 50 for s in spans)
    assert {s["parent"] for s in spans if s["name"] != "episode"} == {"episode"}
    writer.write(_episode(99))  # past the cap: nothing more, not even a second marker
    assert len(_lines(path)) == len(lines)


def test_concurrent_writers_write_whole_episodes(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path)

    def play(worker: int) -> None:
        for n in range(50):
            writer.write(_episode(worker * 1000 + n))

    threads = [threading.Thread(target=play, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = _lines(tmp_path / TRACES_FILE)
    assert len(lines) == 8 * 50 * 3
    # An episode's spans are written together: consecutive lines, episode span first.
    for i in range(0, len(lines), 3):
        chunk = lines[i : i + 3]
        assert chunk[0]["name"] == "episode" and len({s["session_id"] for s in chunk}) == 1


def test_a_traces_file_cut_at_its_cap_still_reads(tmp_path: Path) -> None:
    """The reader skips the writer's marker line (no ``start_s``)."""
    buffer = TraceBuffer(max_bytes=1500)
    for n in range(10):
        buffer.write(_episode(n))
    records = [{"task_id": f"t-{n}", "session_id": f"s-{n}", "attempt": 0} for n in range(10)]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    TraceWriter(tmp_path).write_lines(buffer.chunks)
    assert _lines(tmp_path / TRACES_FILE)[-1]["truncated"] is True
    _, (episodes,) = reader.open_sources([tmp_path])
    first = reader.episode_detail(episodes, 0)["spans"]
    assert first["kind"] == "trace" and len(first["spans"]) == 3
    assert reader.episode_detail(episodes, 9)["spans"]["kind"] == "sums"  # cut off: no spans


async def test_a_played_episode_records_nested_spans(gateway: str, weather: dict[str, Row]) -> None:
    buffer = TraceBuffer()
    async with (
        GatewayAdmin(gateway, ADMIN) as admin,
        Player(admin, sampling=GREEDY, trace=buffer) as player,
    ):
        rollout = await player.play(weather["w-ok"], index=2)
    assert not rollout.failed
    spans = [json.loads(line) for chunk in buffer.chunks for line in chunk.splitlines()]
    names = [s["name"] for s in spans]
    assert names[0] == "episode"
    assert {"session_open", "env_reset", "model_call", "tool_call", "grading"} <= set(names)
    assert names.count("model_call") == rollout.turns == 1
    assert all(s["session_id"] == rollout.session_id for s in spans)
    assert all((s["task_id"], s["attempt"]) == ("w-ok", 2) for s in spans)
    episode = spans[0]
    assert episode["attrs"]["reward"] == 1.0 and episode["attrs"]["failed"] is False
    assert episode["attrs"]["score.right_city"] == 1.0
    for child in spans[1:]:
        assert child["parent"] == "episode"
        assert episode["start_s"] <= child["start_s"] <= child["end_s"] <= episode["end_s"]
    (call,) = [s for s in spans if s["name"] == "model_call"]
    assert call["attrs"]["completion_tokens"] > 0 and call["attrs"]["finish_reason"]
    assert call["attrs"]["weight_version"]  # from the session's samples
    (tool,) = [s for s in spans if s["name"] == "tool_call"]
    assert tool["attrs"]["tool"] == "get_weather" and tool["attrs"]["ok"] is True


async def test_an_eval_writes_traces_the_viewer_attaches_to_each_episode(
    gateway: str, weather: dict[str, Row], tmp_path: Path
) -> None:
    rows = [weather["w-ok"], weather["w-raise"]]
    report = await eval_rows(rows, gateway, admin_token=ADMIN, n=2, sampling=GREEDY)
    write_eval(report, tmp_path / "eval")
    assert (tmp_path / "eval" / TRACES_FILE).exists()
    _, (episodes,) = reader.open_sources([tmp_path / "eval"])
    assert len(episodes.episodes) == 4
    for line, summary in enumerate(episodes.episodes):
        timeline = reader.episode_detail(episodes, line)["spans"]
        assert timeline["kind"] == "trace"
        (whole,) = [s for s in timeline["spans"] if s["name"] == "episode"]
        assert whole["attrs"]["failed"] is summary.failed
        if summary.failed:  # w-raise: the env raised, and the episode span says so
            assert whole["attrs"]["reason"] == summary.reason
            assert whole["attrs"]["reason"].startswith("env:")
        else:
            assert whole["attrs"]["reward"] == summary.reward == 1.0
    sessions = {s["session_id"] for s in _lines(tmp_path / "eval" / TRACES_FILE)}
    assert sessions == {e.session_id for e in report.episodes}


async def test_a_host_agent_episode_is_traced(
    gateway: str, weather: dict[str, Row], tmp_path: Path
) -> None:
    script = tmp_path / "agent.py"
    script.write_text(ONE_CALL_AGENT)
    buffer = TraceBuffer()
    async with GatewayAdmin(gateway, ADMIN) as admin:
        rollout = await asyncio.wait_for(
            play_with_agent(
                weather["w-ok"], gateway=admin, agent_cmd=[sys.executable, str(script)],
                timeout_s=60, trace=buffer,
            ),
            90,
        )  # fmt: skip
    assert not rollout.failed, rollout.summary()
    spans = [json.loads(line) for chunk in buffer.chunks for line in chunk.splitlines()]
    names = [s["name"] for s in spans]
    assert names[0] == "episode" and {"session_open", "env_reset", "agent", "grading"} <= set(names)
    assert all(s["session_id"] == rollout.session_id for s in spans)
    (agent,) = [s for s in spans if s["name"] == "agent"]
    assert agent["attrs"]["exit_code"] == 0 and agent["attrs"]["timed_out"] is False
    assert spans[0]["attrs"]["turns"] == 1
