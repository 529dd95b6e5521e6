"""What an engine client yields while streaming: only the new tokens of each chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

from corral.engines.protocol import FinishReason, LogprobEntry


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """New output since the previous delta of the same request.

    ``finish_reason`` is set on the last delta only; ``weight_version``, ``prompt_tokens`` and
    ``completion_tokens`` are the engine's running values.
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    weight_version: str = "default"
    prompt_tokens: int = 0
    completion_tokens: int = 0
