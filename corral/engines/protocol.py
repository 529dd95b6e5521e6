"""The engine protocol: SGLang's native HTTP API, as typed models.

The gateway speaks exactly this to any engine, so a real SGLang server or router drops in
for ``corral.engines.local``. Token ids go in and token ids come out; the engine never
re-tokenizes. Only the fields corral uses are modelled; unknown fields in an engine's
answer are kept (``extra="allow"``) and ignored, unknown fields in a request to the local
engine are rejected so that nothing is silently dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params``. Defaults follow SGLang.

    Constrained decoding, as SGLang: at most one of ``json_schema`` (a JSON Schema, as a JSON
    string; SGLang's OpenAI layer sends ``'{"type": "object"}'`` for ``response_format``
    ``json_object``), ``regex`` (the whole output matches it) and ``ebnf`` (a grammar) may be
    set. The engine guarantees the output (up to ``max_new_tokens``) is in the constraint's
    language; what syntax each accepts depends on the engine's grammar backend (the local
    engine's: :mod:`corral.engines.local.grammar`).
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1  # -1: no top-k filtering (SGLang's convention)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # OpenAI's semantics, as SGLang's: subtracted from a token's logit per time it was generated
    # (frequency) and once if it was (presence); logit_bias adds to a token's logit (keys are
    # token ids as strings).
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingParams:
        # SGLang's check (SamplingParams.verify), with its message.
        if sum(c is not None for c in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        return self


class GenerateRequest(BaseModel):
    """``POST /generate`` body, token-in form only."""

    model_config = ConfigDict(extra="forbid")

    input_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = True
    top_logprobs_num: int = Field(default=0, ge=0)
    stream: bool = False
    rid: str | None = None


class FinishReason(BaseModel):
    """``meta_info.finish_reason``: why generation stopped.

    ``matched`` is the stop token id (int) or stop string (str) that ended it, when one did.
    """

    model_config = ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None


# SGLang's logprob triple: [logprob, token_id, token_text_or_null].
LogprobEntry = tuple[float, int, str | None]


class MetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    finish_reason: FinishReason | None = None  # None while a stream is still running
    prompt_tokens: int
    completion_tokens: int
    output_token_logprobs: list[LogprobEntry] = Field(default_factory=list)
    # Per output position, the top alternatives (only when top_logprobs_num > 0).
    output_top_logprobs: list[list[LogprobEntry] | None] = Field(default_factory=list)
    weight_version: str = "default"


class GenerateResponse(BaseModel):
    """``POST /generate`` answer, and each streamed chunk.

    Streaming follows SGLang's default: every chunk is cumulative (``text``, ``output_ids``
    and ``output_token_logprobs`` hold everything generated so far). An engine started with
    ``--incremental-streaming-output`` sends only the new part instead; the client tells the
    two apart with ``completion_tokens``.
    """

    model_config = ConfigDict(extra="allow")

    # SGLang leaves ``text`` out when started with ``--skip-tokenizer-init``.
    text: str = ""
    output_ids: list[int] = Field(default_factory=list)
    meta_info: MetaInfo


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = ""
    abort_all: bool = False


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None


class UpdateWeightsResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    success: bool
    message: str = ""
    num_paused_requests: int = 0

    @field_validator("num_paused_requests", mode="before")
    @classmethod
    def _none_is_zero(cls, value: object) -> object:
        # SGLang types it ``Optional[int] = 0`` and may send null.
        return 0 if value is None else value


class ModelInfo(BaseModel):
    """``GET /get_model_info``."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    weight_version: str | None = None
