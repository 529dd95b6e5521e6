"""Training samples, with slime's field names so the slime adapter can copy them field by field.

A sample is one merged trajectory: ``tokens`` is the prompt (the trajectory's first prompt) then
the response (every observation and model token after it). ``loss_mask`` and
``rollout_log_probs`` cover the response only: 1 and the engine's logprob on model tokens, 0 and
0.0 on observation tokens. ``rollout_id`` is shared by the samples of one session (episode).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

SampleStatus = Literal["completed", "truncated", "aborted", "failed"]


def status_for_finish(finish_reason: str) -> SampleStatus:
    """A sample's status from its last turn's finish reason."""
    if finish_reason == "length":
        return "truncated"
    if finish_reason == "abort":
        return "aborted"
    return "completed"


class Sample(BaseModel):
    """One training sample. ``metadata["weight_versions"]`` lists the weight version per model
    turn; the rest of ``metadata`` is the session's metadata plus merge/drift info.

    Contract (checked): ``0 <= response_length <= len(tokens)`` and ``loss_mask`` and
    ``rollout_log_probs`` both have ``response_length`` entries, the mask only 0s and 1s.
    """

    tokens: list[int]
    response_length: int = Field(ge=0)
    loss_mask: list[int]
    rollout_log_probs: list[float]
    reward: float | None = None
    status: SampleStatus = "completed"
    metadata: dict[str, Any] = Field(default_factory=dict)
    group_index: int | None = None
    index: int | None = None
    rollout_id: str
    remove_sample: bool = False

    @model_validator(mode="after")
    def validate_lengths(self) -> Sample:
        if self.response_length > len(self.tokens):
            raise ValueError(
                f"response_length {self.response_length} exceeds the {len(self.tokens)} tokens"
            )
        if len(self.loss_mask) != self.response_length:
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries, response_length is "
                f"{self.response_length}"
            )
        if len(self.rollout_log_probs) != self.response_length:
            raise ValueError(
                f"rollout_log_probs has {len(self.rollout_log_probs)} entries, response_length "
                f"is {self.response_length}"
            )
        if not set(self.loss_mask) <= {0, 1}:
            raise ValueError("loss_mask may hold only 0 and 1")
        return self

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length
