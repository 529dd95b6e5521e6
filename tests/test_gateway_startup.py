"""``corral gateway``'s log, as the real CLI writes it: one WARNING at start when its engine does
not answer the health check (and none when it does), then one line per failed request (none per
successful one). The gateway runs as a subprocess; its stderr is read line by line with a
deadline."""

from __future__ import annotations

import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.serving import free_port

ROOT = Path(__file__).resolve().parent.parent
ADMIN_VAR = "CORRAL_TEST_GATEWAY_ADMIN"
ADMIN = "startup-test-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
# A line of corral's own loggers, in the CLI's format ("2026-01-01 10:00:00,000 WARNING name: ...")
CORRAL_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) corral\.")
DEADLINE_S = 90.0


class GatewayLog:
    """The stderr of a gateway process, line by line, as it comes (a reader thread)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(
        self, wanted: Callable[[str], bool], what: str, *, from_start: bool = False
    ) -> str:
        """The first line from now on that ``wanted`` accepts (with ``from_start``, the lines
        already read count too: uvicorn's start line may come after the one wanted); fails
        after DEADLINE_S or when the process ends first."""
        if from_start:
            for line in self.lines:
                if wanted(line):
                    return line
        deadline = time.monotonic() + DEADLINE_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                pytest.fail(f"the gateway exited before {what}:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if wanted(line):
                return line
        pytest.fail(f"no {what} within {DEADLINE_S}s:\n" + "\n".join(self.lines))

    def stop(self) -> list[str]:
        """Terminate the process; every line it wrote."""
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        while not self._queue.empty():
            line = self._queue.get_nowait()
            if line is not None:
                self.lines.append(line)
        return self.lines

    def corral_lines(self) -> list[str]:
        return [line for line in self.lines if CORRAL_LINE.match(line)]


@contextmanager
def gateway_process(engine_url: str, model: Path) -> Iterator[tuple[str, GatewayLog]]:
    """``corral gateway`` in front of ``engine_url`` on a free port, started and listening."""
    port = free_port()
    cmd = [sys.executable, "-m", "corral.cli", "gateway", "--engine-url", engine_url]
    cmd += ["--model", str(model), "--port", str(port), "--admin-token-var", ADMIN_VAR]
    env = {**os.environ, ADMIN_VAR: ADMIN}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    log = GatewayLog(proc)
    try:
        log.wait_for(lambda line: "Uvicorn running on" in line, "uvicorn's start")
        yield f"http://127.0.0.1:{port}", log
    finally:
        if proc.poll() is None:
            log.stop()


def _session(gateway: str) -> tuple[str, str]:
    r = httpx.post(f"{gateway}/sessions", headers=AUTH, json={})
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["api_key"]


def _chat(gateway: str, session_id: str, key: str, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], **extra}
    return httpx.post(
        f"{gateway}/sessions/{session_id}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json=body,
        timeout=60,
    )


def test_a_dead_engine_gives_one_warning_at_start_and_one_line_per_failed_request(
    tiny_model_dir: Path,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    with gateway_process(dead, tiny_model_dir) as (gateway, log):
        warning = log.wait_for(
            lambda line: "health check" in line, "the start-up check", from_start=True
        )
        assert " WARNING " in warning and dead in warning and "connection refused" in warning

        session_id, key = _session(gateway)
        for stream in (False, True):
            answer = _chat(gateway, session_id, key, stream=stream)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["type"] == "engine_unavailable"
            assert dead not in answer.text  # clients are not told where the engine lives
            line = log.wait_for(lambda line: " 503 " in line, "the request's log line")
            path = f"/sessions/{session_id}/v1/chat/completions"
            assert f"WARNING corral.gateway.app: POST {path} 503 engine_unavailable" in line
            assert answer.headers["x-request-id"] in line and dead in line

        bad = httpx.post(
            f"{gateway}/sessions/{session_id}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            content=b"{not json",
        )
        assert bad.status_code == 400
        log.wait_for(lambda line: " 400 " in line, "the client error's log line")
        lines = log.stop()

    # Exactly: the start-up warning, one line per 503, one (INFO) for the 400; no retries'
    # warnings, no pipeline lines, no tracebacks.
    corral = log.corral_lines()
    assert len(corral) == 4, "\n".join(corral)
    assert [line.split()[2] for line in corral] == ["WARNING", "WARNING", "WARNING", "INFO"]
    assert not any("Traceback" in line for line in lines)


def test_an_engine_that_answers_gives_no_warning(tiny_model_dir: Path, engine_url: str) -> None:
    with gateway_process(engine_url, tiny_model_dir) as (gateway, log):
        line = log.wait_for(
            lambda line: "health check" in line, "the start-up check", from_start=True
        )
        assert " INFO " in line and engine_url in line and "answers its health check" in line
        session_id, key = _session(gateway)
        answer = _chat(gateway, session_id, key)
        assert answer.status_code == 200, answer.text
        log.stop()
    # A request that succeeded logs nothing; nothing at all was a warning.
    assert log.corral_lines() == [line]
    assert not any(" WARNING " in x or " ERROR " in x for x in log.lines), "\n".join(log.lines)


class BrokenEngine:
    """An engine client whose generate fails with an error no layer maps (a bug's stand-in)."""

    async def generate(self, req: object) -> object:
        raise RuntimeError("a bug in the engine client")

    async def abort(self, rid: str) -> None:
        return None

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


def test_an_unexpected_error_is_a_500_with_one_error_line(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoTokenizer

    from corral.gateway.app import build_gateway_app
    from corral.gateway.pipeline import TurnPipeline
    from corral.gateway.settings import GatewaySettings
    from tests.servers import serve

    settings = GatewaySettings(model_name="tiny", max_context_tokens=4096, admin_token=ADMIN)
    engine: Any = BrokenEngine()
    pipeline = TurnPipeline(settings, engine, AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    with serve(build_gateway_app(settings, engine, pipeline)) as gateway:
        session_id, key = _session(gateway)
        with caplog.at_level(logging.INFO, logger="corral"):
            answer = _chat(gateway, session_id, key)
    assert answer.status_code == 500
    assert answer.json()["error"]["type"] == "server_error"  # the dialect's shape, not text
    assert "a bug" not in answer.text
    lines = [r for r in caplog.records if r.name.startswith("corral")]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, caplog.text
    assert "500 internal" in lines[0].getMessage()
    assert "RuntimeError: a bug in the engine client" in lines[0].getMessage()
    assert lines[0].exc_info is None  # the traceback goes out at DEBUG only
