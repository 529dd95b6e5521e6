"""The options a gateway session is opened with (the body of ``POST /sessions``).

Shared by the gateway (:mod:`corral.gateway.sessions`) and its client
(:mod:`corral.gateway.client`); light on purpose: pydantic and the gateway's settings module
only, so a rollout process that opens sessions loads no chat-template machinery.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from corral.gateway.settings import HistoryMode
from corral.validation import validation_message

__all__ = ["SamplingOverrides", "SessionOptions"]


class SamplingOverrides(BaseModel):
    """The sampling settings a session may force over its clients' values."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # -1: no top-k (SGLang's convention)
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: list[str] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class SessionOptions(BaseModel):
    """The body of ``POST /sessions``.

    ``sampling`` overrides win over the client's values; its keys must be among
    ``temperature, top_p, top_k, max_tokens, seed, stop``, and it is normalised to the keys
    actually set (``stop`` always a list). ``ttl_s`` (seconds after last use) defaults to the
    store's. ``group_index``/``index`` are carried into the samples; ``metadata`` too.
    ``history``: ``tokens`` (a turn's prompt is the held tokens plus the new messages) or
    ``template`` (the whole conversation rendered each turn); unset, the gateway's setting.
    ``side_requests``: whether trajectories of requests outside the agent's main conversation
    (labelled ``side``: Claude Code's title and summary requests) become samples.
    """

    model_config = ConfigDict(extra="forbid")

    sampling: dict[str, Any] = Field(default_factory=dict)
    max_context_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    ttl_s: float | None = Field(default=None, gt=0.0)
    group_index: int | None = None
    index: int | None = None
    side_requests: Literal["include", "exclude"] = "include"
    # How a turn's prompt is built (corral.gateway.history); None: the gateway's setting.
    history: HistoryMode | None = None

    @field_validator("sampling", mode="before")
    @classmethod
    def _validate_sampling(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # the dict type check reports it
        allowed = set(SamplingOverrides.model_fields)
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"unknown sampling override(s) {unknown}; allowed: {sorted(allowed)}")
        try:
            overrides = SamplingOverrides.model_validate(value)
        except ValidationError as exc:
            raise ValueError(f"invalid sampling override(s): {validation_message(exc)}") from None
        return overrides.model_dump(exclude_none=True)
