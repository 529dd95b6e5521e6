"""Make a sandbox provider by its backend's name (what ``corral serve --sandbox`` takes).

Each backend's module (and its optional SDK) is imported only when it is asked for.
"""

from __future__ import annotations

from corral.sandboxes.base import SandboxError, SandboxProvider

BACKENDS = ("local", "bwrap", "docker", "kubernetes", "e2b")


def make_provider(name: str, owner: str, *, image: str | None = None) -> SandboxProvider:
    """A provider of backend ``name`` whose sandboxes carry ``owner``. ``image``: the docker /
    kubernetes image or e2b template (``None``: the backend's default). ``ValueError`` for an
    unknown name; :class:`SandboxError` when the backend's SDK is not installed."""
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
        if name == "e2b":
            from corral.sandboxes.e2b import E2BProvider

            return E2BProvider(owner) if image is None else E2BProvider(owner, template=image)
    except ImportError as exc:
        raise SandboxError(
            f"the {name} backend needs {exc.name!r}: pip install 'corral[{name}]'"
        ) from exc
    raise ValueError(f"unknown sandbox backend {name!r}; the backends are {', '.join(BACKENDS)}")
