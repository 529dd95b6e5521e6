"""The embedded stack: the local engine and the gateway, in this process, on 127.0.0.1.

What ``corral run`` starts on embedded defaults, and what tests and benchmarks use to get a
real gateway in front of a real engine without launching processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.serving import serve_in_thread

if TYPE_CHECKING:
    from corral.engines.local.engine import LocalEngine


@dataclass(frozen=True)
class StackURLs:
    """The servers' base URLs; ``local_engine`` is the engine object itself, for callers in
    this process that push weights to it in memory."""

    engine: str
    gateway: str
    local_engine: LocalEngine | None = None


@contextmanager
def local_stack(
    model_path: str | Path,
    *,
    device: str = "cpu",
    admin_token: str | None = None,
    gateway_host: str = "127.0.0.1",
    max_batch_size: int = 64,
    **gateway_overrides: Any,
) -> Iterator[StackURLs]:
    """Serve ``model_path`` with the local engine and a gateway in front of it.

    ``gateway_host``: the interface the gateway listens on (a node's address when workers on
    other machines call it; the engine stays on 127.0.0.1). ``max_batch_size``: the local
    engine's decode batch (requests beyond it wait). ``gateway_overrides`` set
    :class:`~corral.gateway.settings.GatewaySettings` fields
    (e.g. ``tool_call_parser``, ``reasoning_parser``). Both servers stop when the block exits.
    """
    from corral.engines.local.engine import LocalEngine
    from corral.engines.local.server import build_engine_app
    from corral.gateway.server import create_gateway

    with ExitStack() as stack:
        engine = LocalEngine(model_path, device=device, max_batch_size=max_batch_size)
        engine_url = stack.enter_context(serve_in_thread(build_engine_app(engine)))
        gateway = create_gateway(
            engine_url, model_path, admin_token=admin_token, **gateway_overrides
        )
        gateway_url = stack.enter_context(serve_in_thread(gateway, host=gateway_host))
        yield StackURLs(engine=engine_url, gateway=gateway_url, local_engine=engine)
