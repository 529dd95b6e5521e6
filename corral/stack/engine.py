"""The local engine, in a thread of this process or as a ``corral engine`` child."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from corral.engines.local.settings import EngineSettings

if TYPE_CHECKING:
    from corral.engines.local.engine import LocalEngine


@dataclass(frozen=True)
class ServedEngine:
    """A local engine served in this process: its base ``url`` and the ``engine`` itself (for
    callers that push weights to it in memory)."""

    url: str
    engine: LocalEngine


@contextmanager
def engine_in_thread(
    settings: EngineSettings, *, host: str = "127.0.0.1"
) -> Iterator[ServedEngine]:
    """Load the model (blocking) and serve it on a free port of ``host`` until the block
    exits. The model's own load errors (``OSError``/``ValueError``) propagate."""
    from corral.engines.local.engine import LocalEngine
    from corral.engines.local.server import build_engine_app
    from corral.serving import serve_in_thread

    engine = LocalEngine(
        settings.model, device=settings.device, max_batch_size=settings.max_batch_size
    )
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_thread(build_engine_app(engine), host=host))
        yield ServedEngine(url=url, engine=engine)


@contextmanager
def engine_in_process(
    settings: EngineSettings,
    *,
    log: Path,
    token: str | None = None,
    host: str = "127.0.0.1",
) -> Iterator[str]:
    """``corral engine`` for ``settings`` as a child process on a free port of ``host``; yields
    its base URL once it answers (:func:`corral.processes.serve_in_process`: its output goes
    to ``log``, ``ChildServerError`` if it dies or is not ready in time). ``token`` (what
    every route but ``/health`` then requires) reaches the child in the variable
    ``settings.token_var`` names, never in its argv (``ValueError`` when a token is given and
    no variable is named)."""
    from corral.processes import serve_in_process

    env: dict[str, str] = {}
    if token is not None:
        if settings.token_var is None:
            raise ValueError("a token for a child engine needs settings.token_var")
        env[settings.token_var] = token
    with serve_in_process(settings.to_argv(), log=log, host=host, env=env) as url:
        yield url
