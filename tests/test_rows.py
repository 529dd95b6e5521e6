"""The row writer against a real env server (gridsim) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from corral.envs.bundle import load_bundle
from corral.envs.server import build_app
from corral.rollouts.rows import RowsError, RowSettings, read_rows, write_rows
from tests.servers import free_port, serve

GRIDSIM = Path(__file__).resolve().parents[1] / "bundles" / "gridsim"
TOKEN = "rows-secret"


@pytest.fixture(scope="module")
def bundle():  # type: ignore[no-untyped-def]
    return load_bundle(GRIDSIM)


def test_rows_match_the_servers_tasks(bundle, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    settings = RowSettings(max_turns=3, tool_timeout=5.0, token_var="GRIDSIM_TOKEN")
    seen: list[tuple[int, int]] = []
    with serve(build_app(bundle, token=TOKEN)) as url:
        counts = write_rows(
            url, tmp_path, settings, token=TOKEN, progress=lambda d, t: seen.append((d, t))
        )
    sizes = {s: len(bundle.tasks(s)) for s in bundle.splits}
    assert counts == {
        "all.jsonl": sum(sizes.values()),
        **{f"{s}.jsonl": n for s, n in sizes.items()},
    }
    assert seen[-1] == (sum(sizes.values()), sum(sizes.values()))

    rows = read_rows(tmp_path / "eval.jsonl")
    first = bundle.task("eval", 0)
    assert rows[0].messages == [
        {"role": "system", "content": bundle.manifest.system_prompt},
        {"role": "user", "content": first.prompt},
    ]
    meta = rows[0].metadata
    assert (meta.split, meta.index, meta.task_id) == ("eval", 0, first.id)
    names = [t["function"]["name"] for t in meta.tools]
    assert "end_turn" in names and "submit_schedule" in names
    assert meta.env.url == url and meta.env.token_var == "GRIDSIM_TOKEN"
    assert (meta.env.max_turns, meta.env.tool_timeout) == (3, 5.0)
    text = "".join(p.read_text() for p in tmp_path.glob("*.jsonl"))
    assert TOKEN not in text  # rows name the variable, never the token
    assert [r.metadata.index for r in rows] == list(range(sizes["eval"]))

    chosen = read_rows(tmp_path / "all.jsonl", split="eval", limit=3)
    assert [(r.metadata.split, r.metadata.index) for r in chosen] == [("eval", i) for i in range(3)]
    broken = tmp_path / "broken.jsonl"
    broken.write_text((tmp_path / "eval.jsonl").read_text().splitlines()[0] + "\n\n{}\n")
    with pytest.raises(RowsError, match=r"broken\.jsonl:3: not a corral row"):
        read_rows(broken)


def test_unreachable_server_and_refused_token_are_clear_errors(bundle, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RowsError, match="cannot reach the env server"):
        write_rows(f"http://127.0.0.1:{free_port()}", tmp_path, RowSettings())
    with (
        serve(build_app(bundle, token=TOKEN)) as url,
        pytest.raises(RowsError, match="refused the token in \\$WRONG"),
    ):
        write_rows(url, tmp_path, RowSettings(token_var="WRONG"), token="nope")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_cli_rows_exits_non_zero_on_a_refused_token(bundle, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with serve(build_app(bundle, token=TOKEN)) as url:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "corral.cli",
                "rows",
                url,
                str(tmp_path / "rows"),
                "--token-var",
                "ROWS_TOKEN",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "ROWS_TOKEN": "wrong"},
        )
        assert out.returncode == 1 and "refused" in out.stderr
        ok = subprocess.run(
            [
                sys.executable,
                "-m",
                "corral.cli",
                "rows",
                url,
                str(tmp_path / "rows"),
                "--token-var",
                "ROWS_TOKEN",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "ROWS_TOKEN": TOKEN},
        )
        assert ok.returncode == 0, ok.stderr
    line = (tmp_path / "rows" / "train.jsonl").read_text().splitlines()[0]
    assert json.loads(line)["metadata"]["env"]["token_var"] == "ROWS_TOKEN"
