"""``corral doctor`` and the sandbox backends' start-up checks, against this machine.

This machine (and CI) has bubblewrap, libseccomp and pyseccomp, and a private dockerd (the
``docker_daemon`` fixture). What is missing is simulated per test and only in a subprocess or
through the check's own parameters: a ``-c`` wrapper that makes ``import pyseccomp`` fail
before running the real CLI, a ``PATH`` without ``bwrap``, a ``DOCKER_HOST`` socket nobody
listens on, an environment without ``E2B_API_KEY`` or a kubeconfig.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from corral.sandboxes import bwrap as bwrap_module
from corral.sandboxes.base import SandboxError
from corral.sandboxes.providers import make_provider
from corral.sandboxes.requirements import (
    SandboxNotReady,
    check_backend,
    check_bwrap,
    check_docker,
    check_e2b,
    check_kubernetes,
    require_ready,
    userns_fix,
)

ROOT = Path(__file__).resolve().parent.parent
SHELLCRAFT = ROOT / "bundles" / "shellcraft"
BWRAP_CHECKS = {"bwrap", "libseccomp", "pyseccomp", "user namespaces", "cgroups"}
# Runs corral's real CLI with some modules made unimportable (None in sys.modules makes
# `import name` raise ImportError, as when the package is not installed).
HIDING = (
    "import sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    sys.modules[name] = None\n"
    "from corral.cli import main\n"
    "raise SystemExit(main(sys.argv[2:]))\n"
)
# A table row: owner, check, status, then detail and fix (columns two or more blanks apart).
ROW = re.compile(r"^\s*(\S+(?: \S+)*)\s{2,}(\S+(?: \S+)*)\s{2,}(ok|missing|warning)(?:\s{2,}|$)")

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing")


def corral(
    *args: str, env: Mapping[str, str] | None = None, hide: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """``corral ARGS`` (``python -m corral.cli``, or the CLI behind the hiding wrapper),
    its output piped. ``env``: changes to this process's environment (``""`` removes)."""
    full = {k: v for k, v in {**os.environ, **(env or {})}.items() if v != ""}
    full.pop("COLUMNS", None)  # the piped width must not come from the caller's terminal
    argv = [sys.executable, "-c", HIDING, ",".join(hide), *args] if hide else [
        sys.executable, "-m", "corral.cli", *args
    ]  # fmt: skip
    return subprocess.run(
        argv, cwd=ROOT, env=full, capture_output=True, text=True, timeout=120, check=False
    )


def statuses(stdout: str) -> dict[tuple[str, str], str]:
    """(owner, check) -> status of every table row in ``corral doctor``'s output."""
    found = {}
    for line in stdout.splitlines():
        m = ROW.match(line)
        if m and m.group(1) not in ("backend", "component"):
            found[(m.group(1), m.group(2))] = m.group(3)
    return found


def serve_refusal(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines of a ``corral serve`` that stopped before listening, checked to be that."""
    assert "Traceback" not in result.stderr + result.stdout
    assert "Uvicorn running" not in result.stderr and "application startup" not in result.stderr
    return [line for line in result.stderr.splitlines() if "not ready" in line]


# -- bwrap -------------------------------------------------------------------------------------


@needs_bwrap
def test_doctor_bwrap_is_ready_on_this_machine() -> None:
    result = corral("doctor", "bwrap")
    assert result.returncode == 0, result.stdout + result.stderr
    found = statuses(result.stdout)
    assert {check for (owner, check) in found if owner == "bwrap"} == BWRAP_CHECKS
    assert {status for (owner, _), status in found.items() if owner == "bwrap"} == {"ok"}
    assert result.stdout.splitlines()[-1] == "ready: bwrap; not ready: none"


@needs_bwrap
def test_without_pyseccomp_doctor_and_serve_name_it_and_its_fix() -> None:
    doctor = corral("doctor", "bwrap", hide=["pyseccomp"])
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert statuses(doctor.stdout)[("bwrap", "pyseccomp")] == "missing"
    row = next(line for line in doctor.stdout.splitlines() if "pyseccomp is not installed" in line)
    assert "pip install 'corral[envs]'" in row
    assert doctor.stdout.splitlines()[-1] == (
        "ready: none; not ready: bwrap (pyseccomp is not installed)"
    )

    serve = corral(
        "serve", str(SHELLCRAFT), "--sandbox", "bwrap", "--port", "0", hide=["pyseccomp"]
    )
    assert serve.returncode == 1, serve.stderr
    assert serve_refusal(serve) == [
        "corral serve: the bwrap backend is not ready: pyseccomp is not installed "
        "(pip install 'corral[envs]')"
    ]


def test_without_the_bwrap_binary_the_fix_is_apt_get_install_bubblewrap(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()  # sys.executable is absolute: nothing else the doctor runs is looked up
    doctor = corral("doctor", "bwrap", env={"PATH": str(empty)})
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    row = next(line for line in doctor.stdout.splitlines() if "'bwrap' is not on PATH" in line)
    assert "missing" in row and "apt-get install bubblewrap" in row
    # The sandbox run is not tried without the binary (nothing is reported twice).
    assert ("bwrap", "user namespaces") not in statuses(doctor.stdout)


def test_check_bwrap_in_process_without_the_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    readiness = check_bwrap()
    assert not readiness.ready
    assert readiness.error_lines()[0] == (
        "the bwrap backend is not ready: 'bwrap' is not on PATH (apt-get install bubblewrap)"
    )


def test_no_cgroups_is_a_warning_and_the_backend_stays_ready(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    (v2 / "memory").mkdir(parents=True)
    (v2 / "memory" / "cgroup.procs").touch()
    (v2 / "memory" / "cgroup.controllers").touch()  # a v2 cgroup named memory, not v1's
    for root in (tmp_path / "none", v2):
        readiness = check_bwrap(cgroup_root=root)
        cgroups = next(c for c in readiness.checks if c.name == "cgroups")
        assert cgroups.status == "warning" and "NOT enforced" in cgroups.detail
        assert all(c.status == "ok" for c in readiness.checks if c.name != "cgroups") == (
            shutil.which("bwrap") is not None
        )
    assert not (v2 / "memory" / "corral").exists()  # never a mkdir into a v2 tree


@needs_bwrap
def test_make_provider_logs_the_warning_and_still_makes_the_provider(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(bwrap_module, "CGROUP_ROOT", tmp_path)
    with caplog.at_level(logging.WARNING, logger="corral.sandboxes.providers"):
        provider = make_provider("bwrap", "doctor-test")
    assert provider.name == "bwrap"
    assert any("bwrap backend: no cgroup v1 memory" in r.getMessage() for r in caplog.records)


def test_userns_fix_names_the_sysctl_that_forbids_it(tmp_path: Path) -> None:
    (tmp_path / "kernel").mkdir()
    (tmp_path / "kernel" / "unprivileged_userns_clone").write_text("0\n")
    assert userns_fix(tmp_path) == "sysctl -w kernel.unprivileged_userns_clone=1"
    (tmp_path / "kernel" / "unprivileged_userns_clone").write_text("1\n")
    (tmp_path / "kernel" / "apparmor_restrict_unprivileged_userns").write_text("1\n")
    assert userns_fix(tmp_path).startswith(
        "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0"
    )
    generic = userns_fix(tmp_path / "nothing")
    assert "kernel.unprivileged_userns_clone=1" in generic and "root" in generic


# -- docker ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("docker_daemon")
def test_doctor_docker_is_ready_with_the_daemon_and_its_image() -> None:
    result = corral("doctor", "docker")  # DOCKER_HOST: the fixture's daemon
    assert result.returncode == 0, result.stdout + result.stderr
    found = statuses(result.stdout)
    assert {k: v for k, v in found.items() if k[0] == "docker"} == {
        ("docker", "docker SDK"): "ok",
        ("docker", "daemon"): "ok",
        ("docker", "image"): "ok",
    }


@pytest.mark.usefixtures("docker_daemon")
def test_a_missing_image_is_named_with_its_build_command() -> None:
    default = check_docker()
    assert default.ready, default.error_lines()
    absent = check_docker("corral-doctor-absent:none")
    assert not absent.ready
    assert absent.error_lines() == [
        "the docker backend is not ready: the image corral-doctor-absent:none is not in the "
        "daemon (corral sandbox image build --tag corral-doctor-absent:none, or docker pull "
        "corral-doctor-absent:none)"
    ]


def test_no_docker_daemon_doctor_and_serve_say_so_in_one_line(tmp_path: Path) -> None:
    socket = f"unix://{tmp_path}/nobody.sock"
    doctor = corral("doctor", "docker", env={"DOCKER_HOST": socket})
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert statuses(doctor.stdout)[("docker", "daemon")] == "missing"
    row = next(line for line in doctor.stdout.splitlines() if "no docker daemon answers" in line)
    assert socket in row and "systemctl start docker" in row and "DOCKER_HOST" in row

    serve = corral(
        "serve", str(SHELLCRAFT), "--sandbox", "docker", "--port", "0", env={"DOCKER_HOST": socket}
    )
    assert serve.returncode == 1, serve.stderr
    assert serve_refusal(serve) == [
        f"corral serve: the docker backend is not ready: no docker daemon answers at {socket}: "
        "No such file or directory (start dockerd: systemctl start docker, or set DOCKER_HOST "
        "to a running daemon; install it: apt-get install docker.io)"
    ]


async def test_the_docker_provider_without_a_daemon_raises_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The start-up sweep made the 125-line traceback: from_env's chained DockerException."""
    from corral.sandboxes.docker import DockerProvider

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nobody.sock")
    with pytest.raises(SandboxError) as caught:
        await DockerProvider("doctor-test").sweep()
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert "\n" not in str(caught.value) and "no docker daemon answers" in str(caught.value)


# -- kubernetes and e2b ------------------------------------------------------------------------

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: doctor, context: {cluster: c, user: u}}]
current-context: doctor
"""


def test_kubernetes_needs_a_kubeconfig_and_reads_it_without_a_cluster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("kubernetes")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    missing = check_kubernetes()
    assert not missing.ready
    assert [c.summary for c in missing.failures] == ["no kubeconfig"]
    (tmp_path / "config").write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    found = check_kubernetes()  # the server at 127.0.0.1:1 is never called
    assert found.ready and "context 'doctor'" in found.checks[-1].detail


def test_e2b_without_an_api_key_is_not_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    doctor = corral("doctor", "e2b", env={"E2B_API_KEY": ""})
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert statuses(doctor.stdout)[("e2b", "API key")] == "missing"
    assert doctor.stdout.splitlines()[-1].endswith("not ready: e2b (E2B_API_KEY not set)")
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    with pytest.raises(SandboxNotReady) as caught:
        make_provider("e2b", "doctor-test")
    assert str(caught.value) == (
        "the e2b backend is not ready: E2B_API_KEY not set "
        "(export E2B_API_KEY=<your key from https://e2b.dev/dashboard>)"
    )
    pytest.importorskip("e2b")
    monkeypatch.setenv("E2B_API_KEY", "e2b_not_a_real_key")  # looked for, never tried
    assert check_e2b().ready


# -- the whole report --------------------------------------------------------------------------


def test_doctor_without_backends_reports_everything_on_unwrapped_lines(tmp_path: Path) -> None:
    result = corral(
        "doctor",
        env={
            "E2B_API_KEY": "",
            "KUBECONFIG": str(tmp_path / "absent"),
            "KUBERNETES_SERVICE_HOST": "",
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr  # a report, whatever it says
    found = statuses(result.stdout)
    assert {owner for owner, _ in found} == {
        "local", "bwrap", "docker", "kubernetes", "e2b",
        "local engine", "gateway", "trainer", "agents",
    }  # fmt: skip
    assert found[("local", "subprocess")] == "ok"
    assert found[("agents", "mcp")] in ("ok", "missing")
    last = result.stdout.splitlines()[-1]
    # Longer than 80 columns and still one line: piped output is not wrapped.
    assert len(last) > 80
    assert re.fullmatch(r"ready: local(, \w+)*; not ready: .+", last), last
    assert "kubernetes (no kubeconfig)" in last and "e2b (E2B_API_KEY not set)" in last
    assert not any(line != line.rstrip() for line in result.stdout.splitlines())


def test_doctor_refuses_an_unknown_backend() -> None:
    result = corral("doctor", "podman")
    assert result.returncode == 2
    assert "unknown backend 'podman'" in result.stderr


def test_check_backend_by_name() -> None:
    assert check_backend("local").ready
    with pytest.raises(ValueError, match="unknown sandbox backend 'podman'"):
        check_backend("podman")
    assert require_ready("local").backend == "local"
