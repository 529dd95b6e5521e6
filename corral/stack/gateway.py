"""The gateway, in a thread of this process or as a ``corral gateway`` child."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from corral.gateway.launch import GatewayLaunch


@contextmanager
def gateway_in_thread(
    launch: GatewayLaunch,
    *,
    admin_token: str | None = None,
    engine_token: str | None = None,
    host: str = "127.0.0.1",
    **settings: Any,
) -> Iterator[str]:
    """Serve the gateway ``launch`` describes on a free port of ``host`` until the block exits;
    yield its base URL. ``admin_token`` guards its admin routes (``launch.admin_token_var`` is
    for a child only); ``engine_token`` is the engines' bearer token (likewise, instead of
    ``launch.engine_token_var``). ``settings``: more
    :class:`~corral.gateway.settings.GatewaySettings` fields, those ``corral gateway`` has no
    flag for (``max_context_tokens``, ``engine_timeout_s``, ...); they win over ``launch``'s."""
    from corral.gateway.server import create_gateway
    from corral.serving import serve_in_thread

    options = {**launch.gateway_options(), **settings}
    app = create_gateway(
        launch.engine_url,
        launch.model,
        admin_token=admin_token,
        engine_token=engine_token,
        **options,
    )
    with serve_in_thread(app, host=host) as url:
        yield url


@contextmanager
def gateway_in_process(
    launch: GatewayLaunch,
    *,
    log: Path,
    admin_token: str | None = None,
    engine_token: str | None = None,
    host: str = "127.0.0.1",
) -> Iterator[str]:
    """``corral gateway`` for ``launch`` as a child process on a free port of ``host``; yields
    its base URL once it answers (:func:`corral.processes.serve_in_process`). ``admin_token``
    reaches the child in the variable ``launch.admin_token_var`` names, never in its argv
    (``ValueError`` when a token is given and no variable is named); ``engine_token`` likewise
    in ``launch.engine_token_var``."""
    from corral.processes import serve_in_process

    env: dict[str, str] = {}
    if admin_token is not None:
        if launch.admin_token_var is None:
            raise ValueError("an admin token for a child gateway needs launch.admin_token_var")
        env[launch.admin_token_var] = admin_token
    if engine_token is not None:
        if launch.engine_token_var is None:
            raise ValueError("an engine token for a child gateway needs launch.engine_token_var")
        env[launch.engine_token_var] = engine_token
    with serve_in_process(launch.to_argv(), log=log, host=host, env=env) as url:
        yield url
