"""The embedded stack: the local engine and the gateway, in this process.

What ``corral run`` starts on embedded defaults, and what tests and benchmarks use to get a
real gateway in front of a real engine without launching processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.engines.local.settings import MAX_BATCH_SIZE, EngineDevice, EngineSettings
from corral.gateway.launch import GatewayLaunch
from corral.stack.engine import engine_in_thread
from corral.stack.gateway import gateway_in_thread

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
    device: EngineDevice = "cpu",
    admin_token: str | None = None,
    gateway_host: str = "127.0.0.1",
    max_batch_size: int = MAX_BATCH_SIZE,
    **gateway_overrides: Any,
) -> Iterator[StackURLs]:
    """Serve ``model_path`` with the local engine and a gateway in front of it.

    ``gateway_host``: the interface the gateway listens on (a node's address when workers on
    other machines call it; the engine stays on 127.0.0.1). ``max_batch_size``: the local
    engine's decode batch (requests beyond it wait). ``gateway_overrides`` set
    :class:`~corral.gateway.settings.GatewaySettings` fields
    (e.g. ``tool_call_parser``, ``reasoning_parser``). Both servers stop when the block exits.
    """
    model = Path(model_path)
    with ExitStack() as stack:
        served = stack.enter_context(
            engine_in_thread(
                EngineSettings(model=model, device=device, max_batch_size=max_batch_size)
            )
        )
        gateway = stack.enter_context(
            gateway_in_thread(
                GatewayLaunch(engine_url=served.url, model=model),
                admin_token=admin_token,
                host=gateway_host,
                **gateway_overrides,
            )
        )
        yield StackURLs(engine=served.url, gateway=gateway, local_engine=served.engine)
