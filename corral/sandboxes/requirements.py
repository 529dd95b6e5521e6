"""What each sandbox backend needs on this machine, checked before a server starts.

:func:`check_backend` runs one backend's checks and returns a :class:`BackendReadiness`: every
:class:`Check` says what it looked at, whether it is there, and how to fix it when it is not.
A check that is not ``required`` (cgroups for bwrap's limits) is a warning: the backend still
works, with less enforced. :func:`require_ready` turns a backend that is not ready into a
:class:`SandboxNotReady` (a :class:`~corral.sandboxes.base.SandboxError`) whose message has one
line per failed check; :func:`~corral.sandboxes.providers.make_provider` calls it, so every
path that builds a provider by name (``corral serve``, ``corral run``, the trainer's env
servers) stops before it starts, not at the first episode.

The checks are fast and leave nothing behind: each is bounded (``TIMEOUT_S`` for anything
that may hang: the trivial bwrap sandbox, the docker daemon's ping), none needs the network
beyond the docker daemon, and no cluster or cloud API is called (kubernetes: the kubeconfig is
read, not used; e2b: the key is looked for, not tried). The bwrap cgroup probe creates one
cgroup per controller and removes it at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from corral.sandboxes.base import SandboxError

TIMEOUT_S = 2.0
ENVS_EXTRA = "pip install 'corral[envs]'"
DEFAULT_DOCKER_SOCKET = "unix:///var/run/docker.sock"

Status = Literal["ok", "missing", "warning"]


@dataclass(frozen=True, slots=True)
class Check:
    """One thing a backend needs. ``detail``: what was found (when ``ok``) or what is wrong,
    short enough to follow "not ready:" (``pyseccomp is not installed``). ``fix``: the command
    or step that makes it ok ("" when ok). A check that is not ``required`` only warns.
    ``brief``: a few words for a one-line summary (``no kubeconfig``; default: ``detail``)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True
    brief: str = ""

    @property
    def summary(self) -> str:
        return self.brief or self.detail

    @property
    def status(self) -> Status:
        """``ok``, ``missing`` (a required check failed) or ``warning`` (an optional one)."""
        if self.ok:
            return "ok"
        return "missing" if self.required else "warning"

    def line(self) -> str:
        """``detail (fix)``, or just ``detail`` without a fix."""
        return f"{self.detail} ({self.fix})" if self.fix else self.detail


@dataclass(frozen=True, slots=True)
class BackendReadiness:
    """One backend's checks; ``ready`` when no required check failed. Checks that depend on
    a failed one (the daemon without the SDK) are left out rather than reported twice."""

    backend: str
    ready: bool
    checks: list[Check] = field(default_factory=list)

    @classmethod
    def of(cls, backend: str, checks: Sequence[Check]) -> BackendReadiness:
        return cls(backend, all(c.ok or not c.required for c in checks), list(checks))

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "missing"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warning"]

    def error_lines(self) -> list[str]:
        """One self-contained line per failed check: ``the bwrap backend is not ready:
        pyseccomp is not installed (pip install 'corral[envs]')``."""
        return [f"the {self.backend} backend is not ready: {c.line()}" for c in self.failures]

    def warning_lines(self) -> list[str]:
        return [f"the {self.backend} backend: {c.line()}" for c in self.warnings]


class SandboxNotReady(SandboxError):
    """A backend's set-up is incomplete; the message is :meth:`BackendReadiness.error_lines`,
    one line each, and ``readiness`` holds every check."""

    def __init__(self, readiness: BackendReadiness) -> None:
        super().__init__("\n".join(readiness.error_lines()))
        self.readiness = readiness


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


# -- local -------------------------------------------------------------------------------------


def check_local() -> BackendReadiness:
    """Always ready: a subprocess in a temporary folder needs nothing but this Python."""
    return BackendReadiness.of(
        "local",
        [Check("subprocess", True, "envs run as plain subprocesses, with NO isolation")],
    )


# -- bwrap -------------------------------------------------------------------------------------


def _check_libseccomp() -> Check:
    # pyseccomp finds the library the way ctypes does (ldconfig's cache, then gcc/ld): the
    # runtime package libseccomp2 is enough; libseccomp-dev also brings the headers.
    fix = "apt-get install libseccomp2, or libseccomp-dev"
    path = ctypes.util.find_library("seccomp")
    if path is None:
        return Check("libseccomp", False, "libseccomp is not found", fix)
    try:
        ctypes.CDLL(path)
    except OSError as e:
        return Check("libseccomp", False, f"libseccomp cannot be loaded: {e}", fix)
    return Check("libseccomp", True, path)


def _check_pyseccomp(libseccomp_ok: bool) -> Check:
    """pyseccomp importable *and* able to build bwrap.py's filter (the real work)."""
    try:
        import pyseccomp  # noqa: F401
    except ImportError:
        return Check("pyseccomp", False, "pyseccomp is not installed", ENVS_EXTRA)
    except (OSError, RuntimeError) as e:  # pyseccomp raises RuntimeError without libseccomp
        if not libseccomp_ok:
            fix = "apt-get install libseccomp2, or libseccomp-dev"
            return Check("pyseccomp", False, f"pyseccomp cannot load libseccomp: {e}", fix)
        return Check("pyseccomp", False, f"pyseccomp cannot be imported: {e}", ENVS_EXTRA)
    from corral.sandboxes.bwrap import seccomp_filter

    try:
        seccomp_filter()
    except Exception as e:  # a broken libseccomp: say what it said
        return Check("pyseccomp", False, f"the seccomp filter cannot be built: {e}", ENVS_EXTRA)
    return Check("pyseccomp", True, f"pyseccomp {_version('pyseccomp')}, seccomp filter built")


def _read_sysctl(proc_sys: Path, name: str) -> str | None:
    try:
        return (proc_sys / name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def userns_fix(proc_sys: Path = Path("/proc/sys")) -> str:
    """How to allow unprivileged user namespaces on this host: the sysctl that forbids them
    when one does, else every usual way (``proc_sys``: where the sysctls are, for tests)."""
    fixes = []
    if _read_sysctl(proc_sys, "kernel.unprivileged_userns_clone") == "0":
        fixes.append("sysctl -w kernel.unprivileged_userns_clone=1")
    if _read_sysctl(proc_sys, "kernel.apparmor_restrict_unprivileged_userns") == "1":
        fixes.append(
            "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile "
            "allowing user namespaces for bwrap"
        )
    if _read_sysctl(proc_sys, "user.max_user_namespaces") == "0":
        fixes.append("sysctl -w user.max_user_namespaces=15000")
    if fixes:
        return "; ".join(fixes)
    return (
        "allow unprivileged user namespaces: sysctl -w kernel.unprivileged_userns_clone=1, "
        "on Ubuntu 24.04+ sysctl -w kernel.apparmor_restrict_unprivileged_userns=0; or run as "
        "root; in a container, start it with --privileged or with seccomp and AppArmor unconfined"
    )


def userns_argv(bwrap: str) -> list[str]:
    """A trivial sandbox with the namespaces, uid map, mounts and capability drop that
    :class:`~corral.sandboxes.bwrap.BwrapSandbox` uses (policy ``none``), running ``true``."""
    from corral.sandboxes.bwrap import UID

    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--as-pid-1"]
    argv += ["--new-session", "--cap-drop", "ALL", "--uid", str(UID), "--gid", str(UID)]
    argv += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        argv += ["--symlink", f"usr/{link}", f"/{link}"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", "/usr/bin/true"]
    return argv


def _check_userns(bwrap: str, proc_sys: Path) -> Check:
    name = "user namespaces"
    try:
        proc = subprocess.run(
            userns_argv(bwrap),
            capture_output=True,
            timeout=TIMEOUT_S,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,  # never our terminal, like every bwrap exec
            check=False,
        )
    except subprocess.TimeoutExpired:
        return Check(name, False, f"a trivial bwrap sandbox did not finish in {TIMEOUT_S:g} s", "")
    except OSError as e:
        return Check(name, False, f"bwrap cannot be started: {e}", "apt-get install bubblewrap")
    if proc.returncode != 0:
        said = proc.stderr.decode(errors="replace").strip().splitlines()
        why = said[-1] if said else f"exit status {proc.returncode}"
        detail = f"a trivial bwrap sandbox fails: {why}"
        return Check(name, False, detail, userns_fix(proc_sys), brief="no user namespaces")
    return Check(name, True, "a trivial bwrap sandbox runs (user, pid, net, ipc, uts namespaces)")


def _check_cgroups(cgroup_root: Path) -> Check:
    """Probe what :meth:`BwrapProvider._make_cgroups` does: a v1 memory and pids cgroup
    under ``<root>/<controller>/corral``, a limit written, then removed."""
    from corral.sandboxes.cgroups import remove_cgroup

    name = "cgroups"
    fix = "run the server as root on a host with cgroup v1 memory and pids hierarchies"
    probe = f"doctor-{uuid.uuid4().hex[:12]}"
    settings = {"memory": ("memory.limit_in_bytes", str(2**30)), "pids": ("pids.max", "256")}
    for ctl, (setting, value) in settings.items():
        hierarchy = cgroup_root / ctl
        # A v1 hierarchy has cgroup.procs and no cgroup.controllers (that one is v2's): never
        # mkdir into a v2 tree, where "memory" would be a new cgroup, not a controller.
        if not (hierarchy / "cgroup.procs").exists() or (hierarchy / "cgroup.controllers").exists():
            detail = f"no cgroup v1 {ctl} hierarchy at {hierarchy}: limits are NOT enforced"
            return Check(name, False, detail, fix, required=False)
        path = hierarchy / "corral" / probe
        try:
            path.mkdir(parents=True)
            (path / setting).write_text(value)
        except OSError as e:
            detail = f"cannot create a {ctl} cgroup ({e}): limits are NOT enforced"
            return Check(name, False, detail, fix, required=False)
        finally:
            remove_cgroup(path)
    return Check(name, True, f"cgroup v1 memory and pids limits at {cgroup_root}")


def check_bwrap(
    *,
    bwrap: str = "bwrap",
    cgroup_root: Path | None = None,
    proc_sys: Path = Path("/proc/sys"),
) -> BackendReadiness:
    """The ``bwrap`` binary, libseccomp, pyseccomp (building the real filter), a trivial
    sandbox run the way bwrap.py runs one (user namespaces), and (a warning only) cgroups
    for the limits. ``cgroup_root`` / ``proc_sys``: other roots, for tests."""
    from corral.sandboxes.bwrap import CGROUP_ROOT

    checks = []
    found = shutil.which(bwrap)
    if found is None:
        checks.append(
            Check("bwrap", False, f"{bwrap!r} is not on PATH", "apt-get install bubblewrap")
        )
    else:
        checks.append(Check("bwrap", True, found))
    libseccomp = _check_libseccomp()
    checks += [libseccomp, _check_pyseccomp(libseccomp.ok)]
    if found is not None:
        checks.append(_check_userns(found, proc_sys))
    checks.append(_check_cgroups(cgroup_root or CGROUP_ROOT))
    return BackendReadiness.of("bwrap", checks)


# -- docker ------------------------------------------------------------------------------------


def check_docker(image: str | None = None) -> BackendReadiness:
    """The docker SDK, a daemon answering a ping at ``DOCKER_HOST`` (or the default socket)
    within :data:`TIMEOUT_S`, and ``image`` (default: the sandbox image's tag) present there."""
    from corral.sandboxes.image import DEFAULT_TAG

    tag = image or DEFAULT_TAG
    try:
        import docker
        import docker.errors
    except ImportError:
        return BackendReadiness.of(
            "docker", [Check("docker SDK", False, "the docker SDK is not installed", ENVS_EXTRA)]
        )
    checks = [Check("docker SDK", True, f"docker {_version('docker')}")]
    where = os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_SOCKET
    try:
        # from_env already asks the daemon for its API version: the timeout bounds it.
        client = docker.from_env(timeout=TIMEOUT_S)
        client.ping()
        version = client.version().get("Version", "?")
    except Exception as e:
        fix = (
            "start dockerd: systemctl start docker, or set DOCKER_HOST to a running daemon; "
            "install it: apt-get install docker.io"
        )
        detail = f"no docker daemon answers at {where}: {_short(e)}"
        daemon = Check("daemon", False, detail, fix, brief="no docker daemon")
        return BackendReadiness.of("docker", [*checks, daemon])
    checks.append(Check("daemon", True, f"docker {version} at {where}"))
    try:
        client.images.get(tag)
        checks.append(Check("image", True, tag))
    except docker.errors.ImageNotFound:
        build = "corral sandbox image build" + ("" if tag == DEFAULT_TAG else f" --tag {tag}")
        fix = build if tag == DEFAULT_TAG else f"{build}, or docker pull {tag}"
        detail = f"the image {tag} is not in the daemon"
        checks.append(Check("image", False, detail, fix, brief=f"no image {tag}"))
    except Exception as e:
        checks.append(Check("image", False, f"cannot look up the image {tag}: {_short(e)}", ""))
    finally:
        client.close()
    return BackendReadiness.of("docker", checks)


def _short(e: BaseException) -> str:
    """An exception as one short line: the innermost ``OSError``'s reason when the chain has
    one (``No such file or directory``; the SDKs wrap requests' wrapping of urllib3's
    wrapping of it), else the exception's own text."""
    seen: BaseException | None = e
    while seen is not None:
        for inner in (seen, *(a for a in seen.args if isinstance(a, BaseException))):
            if isinstance(inner, OSError) and inner.strerror:
                return inner.strerror
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(e).split()).rstrip(".")  # it is followed by more text
    return text if len(text) <= 200 else text[:197] + "..."


# -- kubernetes --------------------------------------------------------------------------------


def check_kubernetes() -> BackendReadiness:
    """The kubernetes SDK and a configuration the provider can load: a kubeconfig
    (``$KUBECONFIG`` or ``~/.kube/config``) with a current context, else the in-cluster
    service account. Only files are read: no auth plugin runs, no cluster is called."""
    try:
        from kubernetes import client as k8s
        from kubernetes import config
    except ImportError:
        sdk = Check(
            "kubernetes SDK",
            False,
            "the kubernetes SDK is not installed",
            "pip install 'corral[kubernetes]'",
        )
        return BackendReadiness.of("kubernetes", [sdk])
    checks = [Check("kubernetes SDK", True, f"kubernetes {_version('kubernetes')}")]
    # Read KUBECONFIG now: the SDK's own default is the value it had at import time.
    where = os.environ.get("KUBECONFIG") or "~/.kube/config"
    try:
        _, active = config.list_kube_config_contexts(config_file=where)
        checks.append(Check("config", True, f"kubeconfig {where}, context {active['name']!r}"))
    except Exception as kube_error:
        try:
            config.load_incluster_config(client_configuration=k8s.Configuration())
            checks.append(Check("config", True, "in-cluster service account"))
        except Exception:
            fix = (
                "set KUBECONFIG or write ~/.kube/config with a current context: kubectl "
                "config use-context NAME; or run inside a Pod with a service account"
            )
            detail = f"no kubeconfig at {where}: {_short(kube_error)}; not in a cluster"
            checks.append(Check("config", False, detail, fix, brief="no kubeconfig"))
    return BackendReadiness.of("kubernetes", checks)


# -- e2b ---------------------------------------------------------------------------------------


def check_e2b() -> BackendReadiness:
    """The e2b SDK (new enough for the keywords the backend passes) and ``E2B_API_KEY``."""
    from corral.sandboxes.e2b import missing_keywords

    checks = []
    try:
        import e2b
    except ImportError:
        checks.append(
            Check("e2b SDK", False, "the e2b SDK is not installed", "pip install 'corral[e2b]'")
        )
    else:
        missing = missing_keywords(e2b, e2b.AsyncSandbox)
        if missing:
            what = "; ".join(f"{m} lacks {', '.join(sorted(k))}" for m, k in missing.items())
            detail = f"the e2b SDK {_version('e2b')} is too old ({what})"
            checks.append(Check("e2b SDK", False, detail, "pip install -U 'corral[e2b]'"))
        else:
            checks.append(Check("e2b SDK", True, f"e2b {_version('e2b')}"))
    if os.environ.get("E2B_API_KEY"):
        checks.append(Check("API key", True, "E2B_API_KEY is set"))
    else:
        fix = "export E2B_API_KEY=<your key from https://e2b.dev/dashboard>"
        checks.append(Check("API key", False, "E2B_API_KEY not set", fix))
    return BackendReadiness.of("e2b", checks)


# -- by name -----------------------------------------------------------------------------------

_CHECKS: dict[str, Callable[[str | None], BackendReadiness]] = {
    "local": lambda _: check_local(),
    "bwrap": lambda _: check_bwrap(),
    "docker": check_docker,
    "kubernetes": lambda _: check_kubernetes(),
    "e2b": lambda _: check_e2b(),
}


def check_backend(name: str, *, image: str | None = None) -> BackendReadiness:
    """Backend ``name``'s checks (``image``: the docker image to look for; the other backends
    ignore it: a kubernetes image lives in a registry, an e2b template in E2B's cloud).
    ``ValueError`` for an unknown backend."""
    try:
        check = _CHECKS[name]
    except KeyError:
        known = ", ".join(_CHECKS)
        raise ValueError(f"unknown sandbox backend {name!r}; the backends are {known}") from None
    return check(image)


def require_ready(name: str, *, image: str | None = None) -> BackendReadiness:
    """:func:`check_backend`, raising :class:`SandboxNotReady` when a required check fails;
    the caller shows the warnings of a ready backend (``warning_lines``)."""
    readiness = check_backend(name, image=image)
    if not readiness.ready:
        raise SandboxNotReady(readiness)
    return readiness
