"""The env server, in a thread of this process or as a ``corral serve`` child."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from corral.envs.settings import ServeSettings


@contextmanager
def env_server_in_thread(
    settings: ServeSettings,
    *,
    token: str | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> Iterator[str]:
    """Serve ``settings.bundle`` (:func:`~corral.envs.server.build_app` with the settings'
    options) on ``host`` (a free port unless ``port``) until the block exits; yield its base
    URL. ``token``: the bearer token every route but ``/health`` requires (a server in a
    thread is handed the secret; ``settings.token_var`` is for a child). ``build_app``'s
    errors (a bad bundle, a sandbox backend this machine lacks) propagate; on exit the server
    shuts down gracefully (its episodes and sandboxes are torn down)."""
    from corral.envs.server import build_app
    from corral.serving import serve_in_thread

    app = build_app(settings.bundle, token=token, **settings.app_options())
    with serve_in_thread(app, host=host, port=port) as url:
        yield url


@contextmanager
def env_server_in_process(
    settings: ServeSettings, *, log: Path, host: str = "127.0.0.1"
) -> Iterator[str]:
    """``corral serve`` for ``settings`` as a child process on a free port of ``host``; yields
    its base URL once it answers (:func:`corral.processes.serve_in_process`). The child reads
    its token from ``settings.token_var`` in the environment it inherits."""
    from corral.processes import serve_in_process

    with serve_in_process(settings.to_argv(), log=log, host=host) as url:
        yield url
