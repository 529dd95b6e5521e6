"""What ``corral engine`` serves, as one frozen object: the local engine's settings.

Light on purpose (no torch, no transformers): a trainer config or a launcher imports it to
start the engine in a thread (:func:`corral.stack.engine.engine_in_thread`) or as a child
process (:func:`corral.stack.engine.engine_in_process`, from :meth:`EngineSettings.to_argv`).
Where the engine listens (host, port) is the launcher's: it picks a free port.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

EngineDevice = Literal["cpu", "cuda"]
ENGINE_DEVICES: tuple[EngineDevice, ...] = ("cpu", "cuda")
# Requests decoded together; the rest wait for a free slot.
MAX_BATCH_SIZE = 64


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches only this machine: ``localhost`` or a loopback
    address (127.0.0.0/8, ::1). Anything else, a name included, may be reachable from
    elsewhere: an engine listening there needs a token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class EngineSettings:
    """The local engine's settings: ``model`` (a Hugging Face folder), the ``device`` it runs
    on and ``max_batch_size``, the requests decoded together; ``token_var`` names the
    environment variable the engine reads its bearer token from (the token itself never
    appears in an argv; None: no token, loopback only). Each field is one ``corral engine``
    flag (tests/test_service_settings.py parses :meth:`to_argv` with the real CLI)."""

    model: Path
    device: EngineDevice = "cpu"
    max_batch_size: int = MAX_BATCH_SIZE
    token_var: str | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, not {self.max_batch_size}")

    def to_argv(self) -> list[str]:
        """``corral`` arguments that serve these settings: the subcommand and its flags, all
        but ``--host``/``--port`` (the launcher adds them)."""
        argv = [
            *("engine", "--model", str(self.model), "--device", self.device),
            *("--max-batch-size", str(self.max_batch_size)),
        ]
        if self.token_var is not None:
            argv += ["--token-var", self.token_var]
        return argv
