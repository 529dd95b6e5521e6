"""Shared fixtures: the tiny chat models, built offline (cached across runs by source hash),
and a docker daemon with the sandbox image; and the test tiers (``unit``, ``e2e``: see
``tests/tiers.py``), registered here.

The daemon: ``DOCKER_HOST`` when set; otherwise a private one that this session starts with
``scripts/dockerd.sh`` in ``CORRAL_DOCKERD_DIR`` (default ``/tmp/corral-dockerd``, a stable folder
so that the image built into its data-root is reused by later runs) and stops at the end. The
image (``corral-sandbox:py3``) is built once (about 50 s) and then found by its input-hash label.
Tests skip, saying why, only when no daemon can be reached or started; and never in CI (the
environment variable ``CI`` set, as CI's runner sets it for ``.ci/run``, which starts a
dockerd and installs bubblewrap and pyseccomp): there a missing daemon fails the tests that
need it, and so does any skip whose reason names bubblewrap, bwrap or pyseccomp
(:func:`pytest_runtest_makereport`), so that CI cannot pass without its sandbox tests.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

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


def in_ci() -> bool:
    """Whether this run is CI's: ``CI`` set to anything but empty, 0, false or no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(why: str) -> NoReturn:
    """Skip saying ``why``; in CI fail instead, since CI provides what was missing."""
    if in_ci():
        pytest.fail(
            f"CI={os.environ['CI']}: {why}; .ci/run provides a dockerd and the sandbox image, "
            "so this is a broken CI setup, not a test to skip",
            pytrace=False,
        )
    pytest.skip(why)


# Skip reasons that mean "this machine lacks the bwrap backend": in CI, failures.
_BWRAP_SKIP = re.compile(r"bubblewrap|\bbwrap\b|pyseccomp", re.IGNORECASE)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """In CI, a test skipped for want of bubblewrap or pyseccomp (CI installs both) fails,
    with the skip's reason."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and in_ci():
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if _BWRAP_SKIP.search(reason):
            report.outcome = "failed"
            report.longrepr = (
                f"CI={os.environ['CI']}: skipped for want of the bwrap backend ({reason}); "
                ".ci/run installs bubblewrap and pyseccomp, so this is a broken CI setup"
            )
    return report


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
        _unavailable("the docker SDK is not installed (pip install docker)")
    started: Path | None = None
    if not os.environ.get("DOCKER_HOST") or not _reachable():
        if shutil.which("dockerd") is None or os.geteuid() != 0:
            _unavailable("no docker daemon reachable and cannot start one (needs dockerd and root)")
        folder = Path(os.environ.get("CORRAL_DOCKERD_DIR", "/tmp/corral-dockerd"))
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "dockerd.sh"), "start", str(folder)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            _unavailable(f"could not start dockerd: {proc.stderr.strip()[-500:]}")
        os.environ["DOCKER_HOST"] = proc.stdout.strip().split("=", 1)[1]
        started = folder
    if not _reachable():
        _unavailable(f"no docker daemon answers at {os.environ.get('DOCKER_HOST')}")
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
