"""Env bundles served over HTTP + WebSocket.

- ``corral.envs.bundle``   the bundle format: ``load_bundle``, ``validate_bundle``
- ``corral.envs.episode``  what bundle env code implements (``Env``, ``ToolOutcome``, ``Task``)
- ``corral.envs.protocol`` the WebSocket messages (OpenEnv's shapes plus corral's extensions)
- ``corral.envs.server``   ``build_app``: the env server
- ``corral.envs.client``   ``EnvClient``: plays episodes on an env server
"""

from corral.envs.bundle import Bundle, BundleError, load_bundle, validate_bundle
from corral.envs.client import EnvClient, EnvClientError, EnvServerError
from corral.envs.server import build_app

__all__ = [
    "Bundle",
    "BundleError",
    "EnvClient",
    "EnvClientError",
    "EnvServerError",
    "build_app",
    "load_bundle",
    "validate_bundle",
]
