"""Env bundles served over HTTP + WebSocket.

- ``corral.envs.bundle``    the bundle format: ``load_bundle``, ``validate_bundle``
- ``corral.envs.episode``   what bundle env code implements (``Env``, ``ToolOutcome``, ``Task``)
- ``corral.envs.protocol``  the wire format (OpenEnv's MCP actions and observations)
- ``corral.envs.episodes``  ``Episode`` and ``EpisodeManager``: the server's logic
- ``corral.envs.session``   one WebSocket's messages; ``mcp``: JSON-RPC; ``http_episodes``: HTTP
- ``corral.envs.server``    ``build_app``: the env server's routes; ``running``: uvicorn
- ``corral.envs.hosting``   where env code runs (in process, or a sandbox per episode)
- ``corral.envs.playcheck`` ``corral bundle validate --play``: a bundle judged by playing it
- ``corral.envs.client``    ``EnvClient``: plays episodes on an env server
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
