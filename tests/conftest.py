"""Shared fixtures: the tiny chat models, built offline (cached across runs by source hash),
and a docker daemon with the sandbox image; and the test tiers (``unit``, ``e2e``: see
``tests/tiers.py``), registered here.

The daemon: ``DOCKER_HOST`` when set; otherwise a private one that this session starts with
``scripts/dockerd.sh`` in ``CORRAL_DOCKERD_DIR`` (default ``/tmp/corral-dockerd``, a stable folder
so that the image built into its data-root is reused by later runs) and stops at the end. The
image (``corral-sandbox:py3``) is built once (about 50 s) and then found by its input-hash label.
Tests skip, saying why, only when no daemon can be reached or started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SANDBOX_IMAGE = "corral-sandbox:py3"


def pytest_configure(config: pytest.Config) -> None:
    from tests import tiers

    for name, meaning in tiers.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    config.pluginmanager.register(tiers, "corral-tiers")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The Qwen 2.5-style tiny model, imprinted with the tool-calling format."""
    from corral.engines.tiny_model import cached_tiny_model

    return cached_tiny_model("qwen25")


@pytest.fixture(scope="session")
def tiny_think_model_dir() -> Path:
    """The Qwen3-style variant whose template drops earlier <think> blocks from history."""
    from corral.engines.tiny_model import cached_tiny_model

    return cached_tiny_model("qwen3")


def _reachable() -> bool:
    try:
        import docker

        docker.from_env(timeout=5).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def docker_daemon() -> Iterator[None]:
    try:
        import docker  # noqa: F401
    except ImportError:
        pytest.skip("the docker SDK is not installed (pip install docker)")
    started: Path | None = None
    if not os.environ.get("DOCKER_HOST") or not _reachable():
        if shutil.which("dockerd") is None or os.geteuid() != 0:
            pytest.skip("no docker daemon reachable and cannot start one (needs dockerd and root)")
        folder = Path(os.environ.get("CORRAL_DOCKERD_DIR", "/tmp/corral-dockerd"))
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "dockerd.sh"), "start", str(folder)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            pytest.skip(f"could not start dockerd: {proc.stderr.strip()[-500:]}")
        os.environ["DOCKER_HOST"] = proc.stdout.strip().split("=", 1)[1]
        started = folder
    if not _reachable():
        pytest.skip(f"no docker daemon answers at {os.environ.get('DOCKER_HOST')}")
    from corral.sandboxes.image import build_image

    build_image(SANDBOX_IMAGE)
    yield
    if started is not None:
        subprocess.run(["bash", str(ROOT / "scripts" / "dockerd.sh"), "stop", str(started)])


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """The local engine over the tiny model, served on 127.0.0.1 (one per test module)."""
    from corral.engines.local.engine import LocalEngine
    from corral.engines.local.server import build_engine_app
    from tests.servers import serve

    with serve(build_engine_app(LocalEngine(tiny_model_dir))) as url:
        yield url


@pytest.fixture()
def stack(tiny_model_dir: Path, engine_url: str) -> Iterator[Any]:
    """A gateway in front of ``engine_url`` whose engine client records every call."""
    from tests.gateway_stack import gateway_stack

    with gateway_stack(tiny_model_dir, engine_url) as s:
        yield s
