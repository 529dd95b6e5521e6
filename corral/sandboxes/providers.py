"""Make a sandbox provider by its backend's name (what ``corral serve --sandbox`` takes).

Each backend's module (and its optional SDK) is imported only when it is asked for. Before a
provider is made, the backend's set-up is checked (:mod:`corral.sandboxes.requirements`): a
backend that is not ready is refused here, with one line per missing piece and its fix, so a
server never starts healthy only to fail every episode.
"""

from __future__ import annotations

import logging

from corral.sandboxes.base import SandboxError, SandboxProvider
from corral.sandboxes.requirements import require_ready

log = logging.getLogger(__name__)

BACKENDS = ("local", "bwrap", "docker", "kubernetes", "e2b")
# The pip extra that brings each backend's SDK.
EXTRAS = {"bwrap": "envs", "docker": "envs", "kubernetes": "kubernetes", "e2b": "e2b"}


def make_provider(
    name: str, owner: str, *, image: str | None = None, check: bool = True
) -> SandboxProvider:
    """A provider of backend ``name`` whose sandboxes carry ``owner``. ``image``: the docker /
    kubernetes image or e2b template (``None``: the backend's default). ``ValueError`` for an
    unknown name. With ``check`` (the default) the backend's set-up is checked first:
    :class:`~corral.sandboxes.requirements.SandboxNotReady` (a :class:`SandboxError`) when it is
    not ready, its message one line per failed check; warnings (bwrap without cgroups) are
    logged. :class:`SandboxError` also when the backend's SDK is not installed."""
    if name not in BACKENDS:
        raise ValueError(
            f"unknown sandbox backend {name!r}; the backends are {', '.join(BACKENDS)}"
        )
    if check:
        for line in require_ready(name, image=image).warning_lines():
            log.warning("%s", line)
    try:
        if name == "local":
            from corral.sandboxes.local import LocalProvider

            return LocalProvider(owner)
        if name == "bwrap":
            from corral.sandboxes.bwrap import BwrapProvider

            return BwrapProvider(owner)
        if name == "docker":
            from corral.sandboxes.docker import DockerProvider

            return DockerProvider(owner) if image is None else DockerProvider(owner, image=image)
        if name == "kubernetes":
            from corral.sandboxes.kubernetes import KubernetesProvider

            if image is None:
                return KubernetesProvider(owner)
            return KubernetesProvider(owner, image=image)
        from corral.sandboxes.e2b import E2BProvider

        return E2BProvider(owner) if image is None else E2BProvider(owner, template=image)
    except ImportError as exc:
        raise SandboxError(
            f"the {name} backend needs {exc.name!r}: pip install 'corral[{EXTRAS[name]}]'"
        ) from exc
