"""Env bundles served over HTTP + WebSocket.

- ``corral.envs.bundle``    the bundle format: ``load_bundle``, ``validate_bundle``
- ``corral.envs.episode``   what bundle env code implements (``Env``, ``ToolOutcome``, ``Task``)
- ``corral.envs.protocol``  the wire format (OpenEnv's MCP actions and observations)
- ``corral.envs.episodes``  ``Episode`` and ``EpisodeManager``: the server's logic
- ``corral.envs.websocket`` one WebSocket's conversation and loop; ``mcp``: JSON-RPC;
  ``http_episodes``: HTTP episodes; ``catalog``: the bundle's tasks, schema and metadata
- ``corral.envs.server``    ``build_app``: the env server's assembly; ``running``: uvicorn
- ``corral.envs.hosting``   where env code runs (in process, or a sandbox per episode)
- ``corral.envs.playcheck`` ``corral bundle validate --play``: a bundle judged by playing it
- ``corral.envs.client``    ``EnvClient``: plays episodes on an env server

The names below are imported on first use (PEP 562), so that importing one submodule (above
all ``corral.envs.episode``, what bundle authors implement) loads neither the server (FastAPI,
the sandboxes) nor the client (websockets).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corral.envs.bundle import Bundle, BundleError, load_bundle, validate_bundle
    from corral.envs.client import EnvClient, EnvClientError, EnvServerError
    from corral.envs.server import build_app

# Each public name and the module that defines it.
_HOMES = {
    "Bundle": "corral.envs.bundle",
    "BundleError": "corral.envs.bundle",
    "load_bundle": "corral.envs.bundle",
    "validate_bundle": "corral.envs.bundle",
    "EnvClient": "corral.envs.client",
    "EnvClientError": "corral.envs.client",
    "EnvServerError": "corral.envs.client",
    "build_app": "corral.envs.server",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
