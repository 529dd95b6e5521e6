"""Run one of corral's servers as a child process (``corral engine``, ``corral gateway``,
``corral serve``) for as long as a block lasts.

What a trainer uses to spread its services over CPU cores when it has no Ray cluster: a
few hundred rollouts in flight keep the engine's scheduler, the gateway and the env server
busy enough that, as threads of one interpreter, they wait on each other for the GIL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from corral.serving import free_port

# How often readiness is polled while a child starts (model loads take seconds).
_POLL_S = 0.2


class ChildServerError(RuntimeError):
    """A child server exited, or did not answer its health check, before it was ready."""


@dataclass(frozen=True)
class ChildServer:
    """A running child server: its base URL and its process (for a test that kills it)."""

    url: str
    process: subprocess.Popen[bytes]


@contextmanager
def serve_in_process(
    argv: Sequence[str],
    *,
    log: Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    ready_timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Start ``corral <argv> --host HOST --port PORT`` and yield its base URL once
    ``GET /health`` answers 200.

    The child's output goes to ``log`` (appended). ``ChildServerError`` if it exits before it
    is ready (the message carries the log's last lines) or is not ready within
    ``ready_timeout`` seconds. On exit the child gets SIGTERM (the servers shut down
    gracefully), then SIGKILL after 15 s.
    """
    with child_server(
        argv, log=log, host=host, port=port, ready_timeout=ready_timeout, env=env
    ) as child:
        yield child.url


@contextmanager
def child_server(
    argv: Sequence[str],
    *,
    log: Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    ready_timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[ChildServer]:
    """:func:`serve_in_process`, yielding the :class:`ChildServer` (same contract)."""
    port = port or free_port(host)
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "corral.cli", *argv, "--host", host, "--port", str(port)]
    url = f"http://{host}:{port}"
    with log.open("ab") as out:
        child = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    try:
        _wait_ready(child, url, log, ready_timeout, " ".join(argv[:1]))
        yield ChildServer(url, child)
    finally:
        _stop(child)


def _wait_ready(
    child: subprocess.Popen[bytes], url: str, log: Path, timeout: float, name: str
) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        while True:
            if child.poll() is not None:
                raise ChildServerError(
                    f"corral {name} exited with status {child.returncode} before it was ready; "
                    f"the end of {log}:\n{_tail(log)}"
                )
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() >= deadline:
                raise ChildServerError(
                    f"corral {name} at {url} was not ready within {timeout:g} s; "
                    f"the end of {log}:\n{_tail(log)}"
                )
            time.sleep(_POLL_S)  # polling a child's readiness, not synchronising threads


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is not None:
        return
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=15)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"
