"""The embedded stack: the local engine and the gateway, in this process, on 127.0.0.1.

What ``corral run`` starts on embedded defaults, and what tests and benchmarks use to get a
real gateway in front of a real engine without launching processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.serving import serve_in_thread


@dataclass(frozen=True)
class StackURLs:
    engine: str
    gateway: str


@contextmanager
def local_stack(
    model_path: str | Path,
    *,
    device: str = "cpu",
    admin_token: str | None = None,
    **gateway_overrides: Any,
) -> Iterator[StackURLs]:
    """Serve ``model_path`` with the local engine and a gateway in front of it.

    ``gateway_overrides`` set :class:`~corral.gateway.settings.GatewaySettings` fields
    (e.g. ``tool_call_parser``, ``reasoning_parser``). Both servers stop when the block exits.
    """
    from corral.engines.local.engine import LocalEngine
    from corral.engines.local.server import build_engine_app
    from corral.gateway.server import create_gateway

    with ExitStack() as stack:
        engine_url = stack.enter_context(
            serve_in_thread(build_engine_app(LocalEngine(model_path, device=device)))
        )
        gateway = create_gateway(
            engine_url, model_path, admin_token=admin_token, **gateway_overrides
        )
        gateway_url = stack.enter_context(serve_in_thread(gateway))
        yield StackURLs(engine=engine_url, gateway=gateway_url)
