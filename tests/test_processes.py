"""``corral.processes.serve_in_process``: corral's servers as child processes (real ones)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from corral.processes import ChildServerError, serve_in_process

BUNDLE = Path(__file__).resolve().parents[1] / "bundles" / "gridsim"


def test_a_child_server_answers_until_the_block_ends(tmp_path: Path) -> None:
    log = tmp_path / "env.log"
    with serve_in_process(["serve", str(BUNDLE)], log=log) as url:
        assert httpx.get(f"{url}/health").json()["status"] == "healthy"
        assert httpx.get(f"{url}/splits").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
    assert "Uvicorn running" in log.read_text()


def test_a_child_that_dies_at_start_is_an_error_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    missing = tmp_path / "no-such-model"
    child = serve_in_process(["engine", "--model", str(missing)], log=log)
    with pytest.raises(ChildServerError, match="exited with status") as failed, child:
        pytest.fail("a child with no model came up")
    assert str(missing) in str(failed.value)  # the log's last lines name what went wrong
    assert str(log) in str(failed.value)
